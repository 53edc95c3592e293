"""Generation overlapped with training (kdlab.rollouts.overlap, issue #42 item 2): the student sampled by a
server from pushed weights (kdlab.rollouts.served_sampler), against the loopback server sampling the packaged
tiny student in this process. Lag 0 equals sampling synchronously bit for bit; lag 1 trains each step on
completions written by the previous step's weights, as the logged weights step shows and an independent
sampling from a snapshot of those weights confirms."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from kdlab.cli.main import entry
from kdlab.data import Rollout
from kdlab.rollouts import OverlappedRollouts, ServedRollouts, StudentRollouts
from kdlab.rollouts.engines import SyncedEngine
from kdlab.rollouts.loopback import LoopbackServer
from kdlab.tasks import Addition

STUDENT, TEACHER = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"
SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")


@pytest.fixture(scope="module")
def server():
    with LoopbackServer(STUDENT, name="student", max_batch=1) as running:  # each request alone: answers do not depend on arrival
        yield running


def engine(server, tmp_path, **settings):
    return ServedRollouts(server.url, "student", weights_dir=str(tmp_path), dtype="float32", retries=0, timeout_s=30.0, **settings)


class Steps(pl.Callback):
    """Per micro-batch: the logged train/ metrics; per optimiser step: the student's weights before it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.weights.setdefault(trainer.global_step, {k: v.detach().clone() for k, v in module.student.state_dict().items()})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def fit(rollout, tmp_path, steps=4, accumulate=1, rollout_micro_batches=None):
    from kdlab.stages.distill import DistillModule

    task = Addition(max_digits=2, system_prompt="", num_train=8 * accumulate, num_val=4, num_test=0, seed=0)
    module = DistillModule(STUDENT, TEACHER, task, rollout=rollout, batch_size=2, max_completion_tokens=8, val_examples=4, val_batch_size=4,
                           warmup_steps=1, lr=1e-2, teacher_temperature=0.5, rollout_micro_batches=rollout_micro_batches)
    steps_seen = Steps()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
                         callbacks=[steps_seen], accumulate_grad_batches=accumulate)
    trainer.fit(module)
    return module, steps_seen


@pytest.mark.parametrize("accumulate, groups", [(1, None), (2, 1)])
def test_lag_0_is_synchronous_sampling_bit_for_bit(server, tmp_path, monkeypatch, accumulate, groups):
    """max_lag 0, through the background thread: the same losses, importance weights and trained weights as
    the engine sampling synchronously; with two decode groups per optimiser step the second is written while
    the first trains (a prefetch), still from the step's own weights (policy lag 0 throughout)."""
    prefetched = []
    original = OverlappedRollouts._submit
    monkeypatch.setattr(OverlappedRollouts, "_submit", lambda self, prompts, context: prefetched.append(context.seed) or original(self, prompts, context))
    sync, sync_steps = fit(engine(server, tmp_path), tmp_path, accumulate=accumulate, rollout_micro_batches=groups)
    overlapped, over_steps = fit(OverlappedRollouts(engine(server, tmp_path), max_lag=0), tmp_path, accumulate=accumulate, rollout_micro_batches=groups)
    assert len(sync_steps.rows) == 4 * accumulate
    for key in ("train/loss", "train/importance_weight", "train/engine_kl", "train/policy_lag", "train/rollout_weights_step"):
        assert [row[key] for row in over_steps.rows] == [row[key] for row in sync_steps.rows], key
    assert all(torch.equal(a, b) for a, b in zip(overlapped.student.parameters(), sync.student.parameters()))
    assert [row["train/policy_lag"] for row in over_steps.rows] == [0.0] * 4 * accumulate
    assert all(abs(row["train/importance_weight"] - 1.0) < 1e-5 and abs(row["train/engine_kl"]) < 1e-5 for row in over_steps.rows)
    assert len(prefetched) == 4 * accumulate  # one job per decode group, each through the thread


@pytest.mark.parametrize("max_lag, writers", [(1, [0, 0, 1, 2]), (2, [0, 0, 0, 1])])
def test_lag_1_trains_on_the_previous_steps_weights(server, tmp_path, monkeypatch, max_lag, writers):
    """max_lag 1: step k (k >= 1) trains on completions written by the weights of step k - 1 while step k - 1
    trained (the logged weights step and lag), and they are exactly what the loopback model loaded with a
    snapshot of those weights samples from the same prompts and seeds; the importance weights then differ from 1
    and the engine's KL from 0, while step 0 (written now) has lag 0. max_lag 2: steps 1 and 2 are written by
    step 0's weights, step 3 by step 1's."""
    trained = []
    original = OverlappedRollouts.sample

    def spy(self, prompts, context):
        rollout = original(self, prompts, context)
        rows = zip(prompts.student_ids, prompts.student_mask, rollout.completion_ids, rollout.completion_mask, rollout.behaviour_logprobs)
        trained.append((context.step, context.seed, [(ids[mask.bool()].tolist(), done[kept].tolist(), q[kept].tolist()) for ids, mask, done, kept, q in rows]))
        return rollout

    monkeypatch.setattr(OverlappedRollouts, "sample", spy)
    pushed = len(server.weights.loaded)
    module, steps = fit(OverlappedRollouts(engine(server, tmp_path), max_lag=max_lag), tmp_path)
    pushed = server.weights.loaded[pushed:]
    assert [row["train/rollout_weights_step"] for row in steps.rows] == [float(step) for step in writers]
    assert [row["train/policy_lag"] for row in steps.rows] == [float(step - writer) for step, writer in enumerate(writers)]
    assert abs(steps.rows[0]["train/importance_weight"] - 1.0) < 1e-5
    assert all(abs(row["train/engine_kl"]) > 1e-4 and row["train/importance_weight"] != 1.0 for row in steps.rows[1:])
    reference = LoopbackServer(STUDENT)  # not started: its model and sampler, read in this process
    stops, temperature = [*module.end_ids, reference.tokenizer.eos_token_id], module.student_temperature
    assert [step for step, _, _ in trained] == [0, 1, 2, 3]
    for step, seed, rows in trained:
        reference.model.load_state_dict(steps.weights[writers[step]])  # the weights of the step before (step 0: its own)
        for row, (prompt, completion, behaviour) in enumerate(rows):
            drawn: list[list[float]] = []
            (tokens, _), = reference.sample_many([(prompt, 8, seed + row)], temperature, stops, drawn)
            assert tokens == completion and torch.allclose(torch.tensor(drawn[0]), torch.tensor(behaviour), atol=1e-5), (step, row)
        if step >= 1:  # not the weights training at this step: their log-probs of the same tokens differ
            reference.model.load_state_dict(steps.weights[step])
            for prompt, completion, behaviour in rows:
                with torch.no_grad():
                    logits = reference.model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1, : reference.columns]
                now = torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
                assert (now - torch.tensor(behaviour)).abs().max() > 1e-4
    assert [int(path.rsplit("step", 1)[1].split(".")[0]) for path in pushed] == sorted(set(writers))  # one push per weights used, in order
    assert not list(tmp_path.glob("*.safetensors"))  # each file deleted once loaded


@pytest.mark.parametrize("settings, message", [
    (["--model.rollout.policy=kdlab.rollouts.StudentRollouts"], "OverlappedRollouts.policy must be a rollout engine outside the training process"),
    (["--model.rollout.policy=kdlab.rollouts.ServedRollouts", "--model.rollout.policy.url=http://127.0.0.1:9", "--model.rollout.policy.model=s",
      "--model.rollout.max_lag=-1"], "OverlappedRollouts.max_lag must be an integer >= 0"),
    (["--model.rollout.policy=kdlab.rollouts.ServedRollouts", "--model.rollout.policy.url=http://127.0.0.1:9", "--model.rollout.policy.model=s",
      "--model.rollout.policy.sync_every=0"], "ServedRollouts.sync_every must be >= 1"),
    (["--model.rollout.policy=kdlab.rollouts.ServedRollouts", "--model.rollout.policy.url=http://127.0.0.1:9", "--model.rollout.policy.model=s",
      "--model.rollout.policy.weights_dir=/no/such/folder"], "ServedRollouts.weights_dir '/no/such/folder' is not a folder"),
    (["--model.rollout.policy=kdlab.rollouts.ServedRollouts", "--model.rollout.policy.url=http://gpu7.cluster:8000", "--model.rollout.policy.model=s"],
     "ServedRollouts.weights_dir: the server at http://gpu7.cluster:8000 is not addressed as this machine"),
])
def test_bad_settings_are_named_at_parse_time(tmp_path, capsys, monkeypatch, settings, message):
    monkeypatch.setattr("sys.argv", ["kdlab"])
    with pytest.raises(SystemExit) as stopped:
        entry(["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.rollout=kdlab.rollouts.OverlappedRollouts", *settings])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and message in last and last.startswith("kdlab: error: ")
    assert not any(tmp_path.iterdir())  # nothing started


def test_a_push_the_server_cannot_load_stops_the_run_naming_the_endpoint(server, tmp_path):
    """A weight name the served model lacks (another model behind the URL): the server answers 400, nothing is
    loaded, and the push fails naming the endpoint and how the server must be started."""
    from safetensors.torch import save_file

    from kdlab.rollouts.engines import StagedWeights
    from kdlab.served_wire import ServedTeacherError

    path = tmp_path / "wrong.safetensors"
    save_file({"not.a.weight": torch.zeros(2)}, str(path))
    loaded = list(server.weights.loaded)
    with pytest.raises(ServedTeacherError, match=rf"served sampler {server.url}/collective_rpc: HTTP 400 .*weight names the model lacks.*VLLM_SERVER_DEV_MODE"):
        engine(server, tmp_path).load_weights(StagedWeights(0, str(path)))
    assert server.weights.loaded == loaded


@pytest.mark.parametrize("section, field, value, flag", [
    ("model_config", "logprobs_mode", "raw_logprobs", "--logprobs-mode processed_logprobs"),  # vLLM's default
    ("parallel_config", "worker_extension_cls", None, "--worker-extension-cls kdlab.rollouts.vllm.WeightLoaderExtension"),
])
def test_a_server_not_run_with_the_samplers_settings_is_refused_before_the_first_push(server, tmp_path, section, field, value, flag):
    """vLLM's default log-probs are those of the raw distribution, not the tempered one sampled from: every importance
    weight would be wrong without an error. The sampler reads the server's /server_info before its first push and
    refuses it, naming the flag; nothing is pushed."""
    from kdlab.served_wire import ServedTeacherError

    sampler, loaded = engine(server, tmp_path), list(server.weights.loaded)
    sampler.check()  # the loopback server runs as the sampler needs
    kept = server.server_config[section][field]
    try:
        server.server_config[section][field] = value
        with pytest.raises(ServedTeacherError, match=rf"{section}.{field} is {value!r}, not {kept!r}: run vllm serve with {flag}"):
            engine(server, tmp_path).check()
    finally:
        server.server_config[section][field] = kept
    assert server.weights.loaded == loaded


def test_the_sampler_reply_holds_each_tokens_tempered_logprob(server, tmp_path):
    """logprobs: 0 on a sampling request: one log-prob per sampled token, that of the tempered distribution it
    was drawn from (recomputed here from the model's logits at that temperature)."""
    from kdlab.served_wire import Wire

    prompt = server.tokenizer("Add the numbers. 4+5", add_special_tokens=False)["input_ids"]
    reply = Wire(server.url, 30.0, 0, 0.0).request("/v1/completions", {"model": "student", "prompt": prompt, "max_tokens": 6, "temperature": 0.7,
                                                                     "seed": 5, "return_token_ids": True, "logprobs": 0})
    tokens, values = reply["choices"][0]["token_ids"], reply["choices"][0]["logprobs"]["token_logprobs"]
    assert len(tokens) == len(values) >= 1
    with torch.no_grad():
        logits = server.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1, : server.columns].float()
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(values), expected, atol=1e-5)
    assert json.loads(json.dumps(values)) == values


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_the_benchmark_smoke_path_checks_what_it_measures(tmp_path):
    """``benchmarks/overlap.py --smoke``: the loopback sampler in its own process, both variants through every
    check (rows, threads, dtype, each step's logged lag) and a ratio of the two step times, written to ``--out``."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    out = tmp_path / "overlap.json"
    done = subprocess.run([sys.executable, "benchmarks/overlap.py", "--smoke", f"--out={out}"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["smoke"] and record["problems"] == [] and record["threads"] == 1 and record["batch"] == 2
    synchronous, overlapped = record["variants"]["synchronous"], record["variants"]["overlapped"]
    assert synchronous["fits"][0]["policy_lag"] == [0.0, 0.0, 0.0] and overlapped["fits"][0]["policy_lag"] == [0.0, 1.0, 1.0]
    assert overlapped["fits"][0]["rollout_weights_step"] == [0.0, 0.0, 1.0]
    assert record["ratio"] == overlapped["step_s"] / synchronous["step_s"]


def test_a_vllm_worker_loads_a_pushed_file_as_it_loads_a_stream(tmp_path):
    """``vllm serve --worker-extension-cls kdlab.rollouts.vllm.WeightLoaderExtension``: the file a push names over
    ``/collective_rpc`` reaches the worker model's own ``load_weights`` whole (every name, the same values)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from kdlab.rollouts.vllm import WeightLoaderExtension

    weights = {"model.embed_tokens.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(4, 3)}
    save_file(weights, str(tmp_path / "push.safetensors"))
    received = {}
    model = torch.nn.Linear(1, 1)
    model.load_weights = lambda stream: received.update(stream)
    worker = type("Worker", (WeightLoaderExtension,), {})()
    worker.model_runner = SimpleNamespace(model=model)
    worker.kdlab_load_weights_file(str(tmp_path / "push.safetensors"))
    assert sorted(received) == sorted(weights) and all(torch.equal(received[name], weights[name]) for name in weights)


def test_the_documented_setting_parses(capsys, monkeypatch):
    """docs/scaling.md's ``rollout:`` value for an overlapped served sampler (its ``...`` filled in) is what
    ``kdlab fit`` reads: OverlappedRollouts over ServedRollouts, max_lag 1."""
    import re

    import yaml

    text = (Path(__file__).parents[1] / "docs" / "scaling.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"`rollout: (\{class_path: kdlab\.rollouts\.OverlappedRollouts,.*?max_lag: \d+\}\})`", text, re.S)
    value = " ".join(snippet.split()).replace("url: ...", "url: 'http://127.0.0.1:8000'").replace("model: ...", "model: student")
    monkeypatch.setattr("sys.argv", ["kdlab"])
    with pytest.raises(SystemExit) as stopped:
        entry(["fit", f"--config={SMOKE}", f"--model.rollout={value}", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["rollout"]
    assert stopped.value.code in (0, None)
    assert printed["class_path"] == "kdlab.rollouts.OverlappedRollouts" and printed["init_args"]["max_lag"] == 1
    assert printed["init_args"]["policy"]["class_path"] == "kdlab.rollouts.ServedRollouts"


class CountingEngine(SyncedEngine):
    """An engine outside the training process that writes three token-7 completions and counts its generate calls
    (and the threads it was called from)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.threads = 0, set()

    def snapshot(self, context):
        return context.step

    def load_weights(self, staged):
        self.weights_step = staged.step

    def generate(self, prompts, context):
        self.calls += 1
        self.threads.add(threading.current_thread())
        rows, device = len(prompts), prompts.student_ids.device
        ids, mask = torch.full((rows, 3), 7, dtype=torch.long, device=device), torch.ones(rows, 3, dtype=torch.bool, device=device)
        return Rollout(prompts, ids, mask, None, behaviour_logprobs=torch.full((rows, 3), -3.0, device=device))


def test_many_decode_groups_in_the_lag_window_are_each_written_once(tmp_path):
    """accumulate_grad_batches 16 with a decode group per micro-batch and max_lag 1: up to 31 groups lie within the
    lag window of a step's first group. Every group trained is written once (no job of a group still ahead is
    dropped and written again), none is written for a step after max_steps, every step from the second trains on
    the previous step's weights (policy lag 1), and the background thread has ended when the fit returns."""
    from kdlab.stages.distill import DistillModule

    accumulate, steps = 16, 3
    engine, lags = CountingEngine(), []

    class Lags(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            lags.append(int(trainer.callback_metrics["train/policy_lag"]))

    task = Addition(max_digits=2, system_prompt="", num_train=4 * accumulate, num_val=0, num_test=0, seed=0)
    module = DistillModule("kdlab://tiny/student", "kdlab://tiny/teacher", task, rollout=OverlappedRollouts(engine, max_lag=1), batch_size=1,
                           rollout_micro_batches=1, max_completion_tokens=8, warmup_steps=0, lr=1e-4, val_examples=1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=accumulate,
                         callbacks=[Lags()], default_root_dir=tmp_path)
    trainer.fit(module)
    assert len(lags) == steps * accumulate
    assert engine.calls <= steps * accumulate + accumulate  # at most the trained groups plus one step's window
    assert engine.calls == steps * accumulate  # and none for the step after max_steps
    assert lags == [0] * accumulate + [1] * (steps - 1) * accumulate
    assert not any(thread.is_alive() for thread in engine.threads)
