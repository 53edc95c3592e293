"""A teacher served over HTTP with vLLM's API (kdlab.rollouts.served), against a real loopback server that
serves the packaged tiny teacher (kdlab.rollouts.loopback), issue #28 item 1."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch

from kdlab.errors import ConfigError
from kdlab.rollouts.loopback import LoopbackServer
from kdlab.rollouts.policies import StudentRollouts, TeacherDatasetRollouts, TeacherRollouts
from kdlab.rollouts.mixture import MixtureRollouts
from kdlab.rollouts.served import ServedTeacher, ServedTeacherError, tempered_topk
from kdlab.tasks import Addition

STUDENT, TEACHER = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"


@pytest.fixture(scope="module")
def server():
    with LoopbackServer(TEACHER, name="tiny-teacher") as running:
        yield running


@pytest.fixture(autouse=True)
def no_faults(server):
    server.faults, server.fault_after, server.completions, server.max_batch = set(), 0, 0, 64
    yield
    server.faults, server.max_batch = set(), 64


def task():
    return Addition(max_digits=2, system_prompt="", num_train=8, num_val=4, num_test=0, seed=0)


def dataset(tmp_path):
    path = tmp_path / "teacher.jsonl"
    path.write_text("".join(json.dumps({"id": ex["id"], "completion": task().reference_completion(ex)}) + "\n" for ex in task().examples("train")))
    return str(path)


def module(served=None, teacher=None, rollout=None, **settings):
    from kdlab.stages.distill import DistillModule

    return DistillModule(STUDENT, teacher, task(), rollout=rollout, served_teacher=served, batch_size=2, max_completion_tokens=8,
                         val_examples=4, val_batch_size=4, warmup_steps=1, lr=1e-3, teacher_temperature=0.5, **settings)


def served(server, **settings):
    return ServedTeacher(server.url, "tiny-teacher", TEACHER, **{"timeout_s": 10.0, "retries": 1, "backoff_s": 0.0, **settings})


def test_the_whole_vocabulary_from_the_server_is_the_in_process_teacher(server, tmp_path):
    """top_k = -1: the served log-probs, tempered by kdlab, equal the in-process teacher's tempered
    log-probs to 1e-5 on every completion position, and so do the loss and its diagnostics."""
    data = dataset(tmp_path)
    remote = module(served(server, top_k=-1), rollout=TeacherDatasetRollouts(data), fused_lm_head=False)
    local = module(teacher=TEACHER, rollout=TeacherDatasetRollouts(data), fused_lm_head=False)
    examples = task().examples("train")[:2]
    r_remote, r_local = remote.make_rollout(examples, 0), local.make_rollout(examples, 0)
    assert torch.equal(r_remote.completion_ids, r_local.completion_ids)
    s_remote, t_remote = remote.distillation_logits(r_remote)
    s_local, t_local = local.distillation_logits(r_local)
    mask = r_local.completion_mask
    expected = torch.log_softmax(t_local.float(), -1)[mask]
    got = t_remote.dense()[mask]
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-5
    loss_remote = remote.objective(s_remote, t_remote, mask)
    loss_local = local.objective(s_local, t_local, mask)
    assert abs(loss_remote.item() - loss_local.item()) < 1e-5


def test_a_padded_output_layer_is_answered_for_every_row_and_its_padding_rows_dropped(server, tmp_path):
    """kdlab://tiny-random/teacher's output layer has 384 rows for its tokenizer's 353 tokens. As vLLM does, the
    server answers ``prompt_logprobs: -1`` with all 384 rows at every position (before, kdlab refused that: "a
    position has 384 entries, more than the 353 asked for"). kdlab accepts ids below the 384 rows of the config,
    drops the 31 padding rows, whose mass (about 8% here) the server's normaliser counted, and, with the whole
    vocabulary, normalises over the 353 tokens: the in-process teacher's softmax, at T = 1 as at T = 0.5. Without a
    config (``ServedTeacher.tokenizer`` a tokenizer alone) the row count is unknown and such a reply is refused."""
    from kdlab.models.loading import ModelSpec, load_tokenizer

    teacher = served(server, top_k=-1, decode_workers=0)
    local = LoopbackServer(TEACHER)  # the same model, read in this process
    teacher.check(local.tokenizer)
    prompt = local.tokenizer("Add the numbers. 12+30", add_special_tokens=False)["input_ids"] + [5, 9, 17]
    reply = teacher.request("/v1/completions", {"model": "tiny-teacher", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": -1})
    assert [len(position) for position in reply["choices"][0]["prompt_logprobs"][1:]] == [384] * (len(prompt) - 1)
    ids, raw = teacher.prompt_logprobs(prompt, 1)
    assert ids.shape == (len(prompt) - 1, 353) and all(sorted(row) == list(range(353)) for row in ids.tolist())
    assert bool((raw.exp().sum(1) < 0.97).all())  # the padding rows' mass, left out
    logits = local.model(input_ids=torch.tensor([prompt])).logits[0, :-1, :353].float()
    for temperature in (1.0, 0.5):
        indices, logprobs = tempered_topk(ids, raw, temperature, 353)
        assert (logprobs - torch.log_softmax(logits / temperature, -1).gather(1, indices)).abs().max().item() < 1e-5
    for workers in (0, 1):  # a decoding process is told the rows too
        assert served(server, top_k=-1, decode_workers=workers).score([prompt[:3]], [prompt[3:]], 0.5, 353)[0][0].shape == (len(prompt) - 3, 353)
    alone = tmp_path / "tokenizer"
    load_tokenizer(ModelSpec(TEACHER)).save_pretrained(alone)
    unknown = ServedTeacher(server.url, "tiny-teacher", str(alone), top_k=-1, retries=0, decode_workers=0)
    assert unknown.head_rows() is None
    with pytest.raises(ServedTeacherError, match=r"a position has 384 entries, more than the 353 rows of the served model's output layer "
                                                  r"\(the vocab_size of ServedTeacher.tokenizer's config; without a config, the tokenizer's tokens\)"):
        unknown.score([prompt[:3]], [prompt[3:]], 0.5, 353)


def test_top_20_is_bracketed_by_the_tail_bounds(server):
    """K = 20 of a 353-token teacher whose output layer has 384 rows (31 of padding, which the server answers for,
    as vLLM does) at T = 0.5, 1 and 2: the exact tempered log-probs of the in-process teacher (a softmax over the
    353 tokens) lie between the values with the tail's share of the normaliser at zero and at its bound (the one
    kdlab uses), the padding rows dropped from the top 20 and their mass left to the tail. At T = 1 the bound
    gives the server's own log-probs (over all 384 rows)."""
    teacher = served(server, top_k=20)
    local = LoopbackServer(TEACHER)  # the same model, read in this process
    teacher.check(local.tokenizer)
    prompt = local.tokenizer("Add the numbers. 12+30", add_special_tokens=False)["input_ids"] + [5, 9, 17]
    ids, raw = teacher.prompt_logprobs(prompt, 1)
    columns, rows = len(local.tokenizer), local.model.config.vocab_size
    assert (columns, rows, teacher.head_rows()) == (353, 384, 384) and int(ids.max()) < columns and 1 <= ids.shape[1] < 20
    logits = local.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    assert bool((logits.topk(20, -1).indices >= columns).any())  # padding rows are among the top 20 the server sends
    for temperature in (0.5, 1.0, 2.0):
        exact = torch.log_softmax(logits[:, :columns] / temperature, -1)
        for tail, sign in (("none", 1), ("bound", -1)):
            indices, logprobs = tempered_topk(ids, raw, temperature, columns, tail=tail)
            truth = exact.gather(1, indices)
            assert bool((sign * (logprobs - truth) >= -1e-5).all()), (temperature, tail)  # none: upper bound; bound: lower bound
    indices, logprobs = tempered_topk(ids, raw, 1.0, columns)
    assert (logprobs - torch.log_softmax(logits, -1).gather(1, indices)).abs().max().item() < 1e-5  # T = 1: the server's


def test_training_from_the_server_on_and_off_policy(server, tmp_path):
    for rollout in (StudentRollouts(), TeacherRollouts()):
        m = module(served(server, top_k=20), rollout=rollout)
        before = [p.detach().clone() for p in m.student.parameters()]
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
        trainer.fit(m)
        assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
        assert any(not torch.equal(a, b) for a, b in zip(before, m.student.parameters()))


def test_served_samples_pin_every_sampling_setting_the_in_process_engine_pins(tmp_path):
    """``vllm serve`` fills a sampling field a request leaves out from the model's ``generation_config.json``
    (``repetition_penalty: 1.1`` for Qwen2-1.5B-Instruct). The served teacher's samples (``ServedTeacher.sample``)
    and the served student's (``ServedRollouts``) are requested with every setting the in-process vLLM engine pins,
    built by the same function (``sampling_params``, then ``completion_fields``): min_p 0, the repetition, presence
    and frequency penalties neutral, no top-k, and a bias of -100 on the 31 padding rows of
    kdlab://tiny-random/teacher's output layer (384 rows, 353 tokens), which the server, as vLLM, would sample
    from otherwise. Both refuse a temperature vLLM does not honour exactly."""
    from kdlab.rollouts import ServedRollouts
    from kdlab.rollouts.served import COMPLETION_REQUEST_FIELDS
    from kdlab.rollouts.vllm_sampling import completion_fields, sampling_params
    from kdlab.stages.distill import DistillModule

    seen = []

    class Recording(LoopbackServer):
        def answer(self, payload, *args, **kwargs):
            seen.append(payload)
            return super().answer(payload, *args, **kwargs)

    pinned = {"n": 1, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
              "ignore_eos": False, "skip_special_tokens": False, "logit_bias": {str(row): -100.0 for row in range(353, 384)}}
    with Recording(TEACHER, name="tiny-teacher") as server:
        teacher = served(server)
        teacher.check(server.tokenizer)
        assert 1 <= len(teacher.sample([1, 2, 3], 4, 0.7, 5, [0])) <= 4
        (payload,) = seen
        assert {key: payload.get(key) for key in pinned} == pinned and set(payload) <= set(COMPLETION_REQUEST_FIELDS)
        assert (payload["temperature"], payload["top_p"], payload["seed"], payload["max_tokens"], payload["stop_token_ids"]) == (0.7, 1.0, 5, 4, [0])
        expected = completion_fields(sampling_params(0.7, 4, (0,), seed=5, logprobs=False, logit_bias={row: -100.0 for row in range(353, 384)}))
        assert {key: value for key, value in payload.items() if key not in ("model", "prompt", "return_token_ids")} == expected
        module = DistillModule(TEACHER, TEACHER, task(), rollout=StudentRollouts(), batch_size=2, max_completion_tokens=4, student_temperature=0.9)
        context = module.rollout_context(torch.Generator().manual_seed(0), seed=7)
        context.top_p = 0.95  # (GRPO's nucleus)
        engine = ServedRollouts(server.url, "tiny-teacher", weights_dir=str(tmp_path), dtype="float32", retries=0)
        engine.generate(module._prompts(task().examples("train")[:2]), context)
        # the rows' requests are concurrent (concurrency 8): they reach the server in either order
        assert sorted((p["seed"], p["temperature"], p["top_p"], p["logprobs"]) for p in seen[1:]) == [(7, 0.9, 0.95, 0), (8, 0.9, 0.95, 0)]
        assert all({key: p.get(key) for key in pinned} == pinned and set(p) <= set(COMPLETION_REQUEST_FIELDS) for p in seen[1:])
        # without the bias the server draws the padding rows too, as vLLM does
        unbiased, _ = server.sample([1, 2, 3], 64, 1.0, 0, [])
        biased, _ = server.sample([1, 2, 3], 64, 1.0, 0, [], teacher.padding_bias())
        assert max(unbiased) >= 353 and max(biased) < 353
        for temperature in (0.005, 2.5):
            with pytest.raises(ValueError, match=rf"ServedTeacher.sample: vLLM samples at temperature 0 or in \[0.01, 2.0\], got {temperature}"):
                teacher.sample([1, 2, 3], 4, temperature, 5, [0])
            context.student_temperature = temperature
            with pytest.raises(ValueError, match=r"ServedRollouts \(DistillModule.student_temperature\): vLLM samples at temperature 0 or in"):
                engine.generate(module._prompts(task().examples("train")[:2]), context)
        assert len(seen) == 3  # nothing sent for a refused temperature


def test_the_server_sample_is_seeded(server):
    teacher = served(server)
    prompt = [int(t) for t in LoopbackServer(TEACHER).tokenizer("Add the numbers. 4+5", add_special_tokens=False)["input_ids"]]
    a, b = teacher.sample(prompt, 6, 1.0, 3, []), teacher.sample(prompt, 6, 1.0, 3, [])
    assert a == b and 1 <= len(a) <= 6


@pytest.mark.parametrize("fault, message", [("timeout", "timed out"), ("malformed", "not JSON"), ("error", "500"),
                                            ("wrong_model", "answered for model 'another-model'"), ("id_out_of_range", "token id 384 outside"),
                                            ("mass_over_one", "probabilities sum to"), ("trickle", "timed out"), ("hang_up", "Remote end closed")])
def test_a_failing_server_stops_the_run_naming_the_endpoint_after_its_retries_with_the_last_checkpoint_intact(tmp_path, fault, message):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # a server of its own: a request still on its way from another test's client (a prefetch) would count towards fault_after
    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        failing_run(server, tmp_path, fault, message, ModelCheckpoint)


def failing_run(server, tmp_path, fault, message, ModelCheckpoint):
    server.faults, server.fault_after = {fault}, 2  # two steps are scored (one request of two completions each), then it fails
    # a short timeout only where the fault is a timeout: elsewhere a loaded machine's slow reply would be retried,
    # counted by the server as one more request, and the fault would start a step early. 3 s, not 1: at 1 s a healthy
    # reply on a loaded machine (the everyday tier's two workers on two cores) timed out once in three tier runs; the
    # faults take far longer (a 30 s sleep; a reply trickled a byte every 0.2 s)
    teacher = served(server, timeout_s=3.0 if fault in ("timeout", "trickle") else 10.0, retries=1)
    m = module(teacher, rollout=TeacherDatasetRollouts(dataset(tmp_path)))
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[checkpoint])
    with pytest.raises(ServedTeacherError, match=rf"served teacher {server.url}/v1/completions.*{message}"):
        trainer.fit(m)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2


def test_the_server_is_checked_before_training(server):
    with pytest.raises(ServedTeacherError, match=r"/v1/models serves \['tiny-teacher'\], not ServedTeacher.model='other'"):
        ServedTeacher(server.url, "other", TEACHER, retries=0).check(LoopbackServer(TEACHER).tokenizer)
    from kdlab.models.loading import ModelSpec, load_tokenizer

    with pytest.raises(ServedTeacherError, match="/tokenize: the server's tokenizer gives .* not the same vocabulary"):
        served(server).check(load_tokenizer(ModelSpec("kdlab://tiny/student")))
    with pytest.raises(ServedTeacherError, match="served teacher http://127.0.0.1:9/v1/models"):
        ServedTeacher("http://127.0.0.1:9", "x", TEACHER, retries=0, timeout_s=1.0).check(None)


def test_what_needs_the_teacher_model_is_refused_with_a_served_teacher(server):
    with pytest.raises(ConfigError, match="MixtureRollouts needs a teacher that decodes token by token in this process.*Served"):
        module(served(server), rollout=MixtureRollouts(0.0))
    with pytest.raises(ConfigError, match="served_teacher is the teacher: set teacher: null"):
        module(served(server), teacher=TEACHER)
    with pytest.raises(ValueError, match="top_k must be >= 1 or -1"):
        ServedTeacher("http://x", "m", TEACHER, top_k=0)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


@pytest.mark.parametrize("kind, accumulate, prefetches, requests", [("dataset", 1, 3, 4), ("sampled", 1, 3, 4 * (2 + 1)), ("dataset", 2, 1, 2),
                                                                   ("student", 1, 0, 4)])
def test_prefetch_gives_bit_identical_losses_and_sends_no_extra_request(server, tmp_path, monkeypatch, kind, accumulate, prefetches, requests):
    """The next decode group's requests go out while a group trains (TeacherDatasetRollouts: scored;
    TeacherRollouts: sampled, one request per prompt, and scored by the server; with accumulation, one decode
    group of two micro-batches per step); the losses and weights equal those without prefetch bit for bit,
    and every prefetched result is used (as many requests as without). StudentRollouts are never prefetched:
    the next group's completions need the student after this step. One request per forward on the
    server, so its answers do not depend on which requests arrived together."""
    from kdlab.rollouts.served import ServedTeacher as Served

    server.max_batch = 1
    started = []
    original = Served.in_background
    monkeypatch.setattr(Served, "in_background", lambda self, work: started.append(1) or original(self, work))
    runs = {}
    for prefetch in (False, True):
        rollout = {"dataset": lambda: TeacherDatasetRollouts(dataset(tmp_path)), "sampled": TeacherRollouts, "student": StudentRollouts}[kind]()
        m = module(served(server, prefetch=prefetch), rollout=rollout)
        losses = Losses()
        server.completions = 0
        trainer = pl.Trainer(max_steps=4 // accumulate, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[losses],
                             accumulate_grad_batches=accumulate)
        trainer.fit(m)
        runs[prefetch] = (losses.values, [p.detach().clone() for p in m.student.parameters()], server.completions)
    assert len(started) == prefetches  # each group but the epoch's last starts the next (4 micro-batches of 2 prompts: one epoch)
    (off_losses, off_weights, off_requests), (on_losses, on_weights, on_requests) = runs[False], runs[True]
    assert len(off_losses) == 4 and on_losses == off_losses
    assert all(torch.equal(a, b) for a, b in zip(on_weights, off_weights))
    assert on_requests == off_requests == requests  # per group: one scoring request (and one sampling request per prompt)


def test_a_prefetch_is_used_only_for_its_own_examples_policy_and_seed(server, tmp_path):
    import pickle

    server.max_batch = 1
    examples = task().examples("train")
    fresh = module(served(server, prefetch=False), rollout=TeacherDatasetRollouts(dataset(tmp_path)))
    m = module(served(server), rollout=TeacherDatasetRollouts(dataset(tmp_path)))
    m.teacher_source.prefetch(m.rollout, lambda: m._prompts(examples[2:4]), 7, lambda: m.rollout_context(m._generator(7), 7))
    ahead = m.teacher_source.ahead
    for wrong_examples, wrong_seed in ((examples[:2], 7), (examples[2:4], 8)):  # computed afresh; the prefetch waits
        got, expected = m.make_rollout(wrong_examples, wrong_seed), fresh.make_rollout(wrong_examples, wrong_seed)
        assert torch.equal(got.teacher_logprobs.logprobs, expected.teacher_logprobs.logprobs) and m.teacher_source.ahead is ahead
    requests = server.completions
    got = m.make_rollout(examples[2:4], 7)
    assert m.teacher_source.ahead is None and server.completions == requests  # taken: no new request
    expected = fresh.make_rollout(examples[2:4], 7)
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.teacher_logprobs.indices, expected.teacher_logprobs.indices)
    assert torch.equal(got.teacher_logprobs.logprobs, expected.teacher_logprobs.logprobs)
    copy = pickle.loads(pickle.dumps(m.teacher_source.server))  # threads and connections are made anew
    assert copy.prompt_logprobs([1, 2, 3], 1)[0].shape == (2, 20)


def test_a_decoding_process_gives_what_this_process_decodes_and_is_restarted_when_it_dies(server):
    """decode_workers=1 (a helper process receives and decodes the scoring replies) and 0 (this process's
    threads) give the same arrays bit for bit; a helper that died is started afresh; one that cannot reach
    the server reports the endpoint as this process would."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    local = served(server, decode_workers=0).prompt_logprobs_many(prompts, [1, 2])
    teacher = served(server, decode_workers=1)
    remote = teacher.prompt_logprobs_many(prompts, [1, 2])
    assert torch.equal(local[0], remote[0]) and torch.equal(local[1], remote[1]) and local[2] == remote[2] == [4, 1]
    (process,) = teacher._workers.running
    process.kill()
    process.wait()
    again = teacher.prompt_logprobs_many(prompts, [1, 2])
    assert torch.equal(again[1], local[1]) and len(teacher._workers.running) == 2 and teacher._workers.running[1].poll() is None
    with pytest.raises(ServedTeacherError, match=r"served teacher http://127.0.0.1:9/v1/completions: .*after 1 attempt"):
        ServedTeacher("http://127.0.0.1:9", "x", TEACHER, retries=0, timeout_s=1.0).prompt_logprobs([1, 2, 3], 1)


def test_the_reply_is_ranked_and_cut_to_k_for_every_position_at_once():
    from kdlab.rollouts.served import ranked_topk

    def entry(logprob, rank):
        return {"logprob": logprob, "rank": rank, "decoded_token": "x"}

    rows = [{"9": entry(-5.0, 7), "3": entry(-0.5, 1), "4": entry(-2.0, 2), "5": entry(-2.0, 2)},  # own token first, a tie
            {"4": entry(-0.4, 1), "8": entry(-2.5, 3), "2": entry(-2.0, 2)}]  # own token inside the top 3
    ids, values = ranked_topk(rows, 3)
    assert ids.tolist() == [[3, 4, 5], [4, 2, 8]] and values.tolist() == [[-0.5, -2.0, -2.0], [-0.4, -2.0, -2.5]]
    assert ids.dtype == torch.long and values.dtype == torch.float64
    assert ranked_topk(rows, -1)[0].tolist() == [[3, 4, 5], [4, 2, 8]]  # the fewest any position has
    assert ranked_topk([], 3)[0].shape == (0, 3)
    with pytest.raises(ValueError, match="fewer than top_k=4"):
        ranked_topk(rows, 4)
    # an output layer of 384 rows for 353 tokens: a padding row among a position's K is dropped after the ranking, and
    # every position keeps as many as the one with the fewest tokens (their mass, like the rest, is the tail's)
    padded = [{"360": entry(-0.7, 1), "3": entry(-1.2, 2), "361": entry(-3.0, 3)}, rows[1]]
    ids, values = ranked_topk(padded, 2, 353, 384)
    assert ids.tolist() == [[3], [4]] and values.tolist() == [[-1.2], [-0.4]]
    assert ranked_topk(padded, 2, 353, 384)[0].tolist() == ranked_topk(padded, 2, 353, 400)[0].tolist()
    with pytest.raises(ValueError, match=r"token id 361 outside the rows of the served model's output layer \[0, 353\)"):
        ranked_topk(padded, 2, 353)  # without the layer's row count, an id past the tokenizer is refused
    with pytest.raises(ValueError, match=r"a position's 2 most likely rows are all padding rows of the model's output layer .*ask for a larger top_k"):
        ranked_topk([{"360": entry(-0.7, 1), "361": entry(-1.2, 2), "3": entry(-3.0, 3)}], 2, 353, 384)


def test_the_docs_figures_are_the_committed_benchmark_and_report():
    """docs/teachers.md's served-teacher figures (the step's cost, the quickstart's accuracy served and in process)
    are what scripts/served_teacher_results.py writes from benchmarks/results/served_teacher_step-tiny.json and
    experiments/tiny/served_teacher_report/ (nothing typed by hand)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "scripts/served_teacher_results.py", "--check"], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_waiting_sampling_requests_share_their_forwards_and_each_keeps_its_seeds_tokens(server):
    """Issue #43 item 3: sampling requests waiting together at one temperature are decoded as one batch
    (server.batches records it), and each gets the tokens its seed gives when it is sampled alone."""
    from kdlab.rollouts.loopback import _Job

    def job(i):
        return _Job({"prompt": [1, 2, 3 + i] + [7] * i, "max_tokens": 6 - i, "temperature": 1.0, "seed": 10 + i})

    together = [job(i) for i in range(4)]
    server.batches.clear()
    server._run(together)
    assert server.batches == [4]
    for i, shared in enumerate(together):
        alone = job(i)
        server._run([alone])
        assert shared.results == alone.results and len(alone.results[0]["new"]) <= 6 - i
    queued = LoopbackServer(TEACHER)  # its worker not started: the queue is served below, in this thread
    scoring = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1, "prompt_logprobs": 2}
    for payload in ({"prompt": [1, 2], "max_tokens": 3, "seed": 1}, scoring, {"prompt": [3, 4], "max_tokens": 3, "seed": 2},
                    {"prompt": [5], "max_tokens": 3, "temperature": 0.5}, scoring):
        queued.jobs.put(_Job(payload))
    queued.jobs.put(None)
    queued._serve_jobs()
    assert queued.batches == [2, 4, 1]  # the two samples at T = 1 together, then both scoring requests, then T = 0.5


def test_a_burst_of_one_sampling_request_per_prompt_decodes_as_one_batch(server):
    """Issue #43 item 3: ServedTeacher samples one prompt per request (each its own seed); sent together (concurrency
    16), they reach the worker a little apart. Without gathering, the first one or few decoded alone and the rest
    after them (two waves); the worker now keeps taking arrivals while they come less than ``gather_s`` apart, so
    all 16 share one decode, and each row still gets the tokens its seed gives alone."""
    client = served(server, concurrency=16)
    gather = server.gather_s
    server.gather_s = 2.0  # a loaded machine sends and parses requests slowly (0.2 s gaps seen on CI; more beside 3 busy processes on 2 cores); the mechanism is what is tested
    try:
        server.batches.clear()
        together = client.concurrently(lambda i: client.sample([1, 2, 3 + i % 5], 6, 1.0, 100 + i, [0]), list(range(16)))
        assert server.batches == [16]
    finally:
        server.gather_s = gather
    server.max_batch = 1
    assert together == [client.sample([1, 2, 3 + i % 5], 6, 1.0, 100 + i, [0]) for i in range(16)]
    with pytest.raises(ValueError, match="gather_s"):
        LoopbackServer(TEACHER, gather_s=-1)


@pytest.mark.parametrize("workers", [1, 2, 0])
def test_scoring_requests_are_in_flight_up_to_concurrency(server, monkeypatch, workers):
    """Issue #45: with decode_workers helper processes (1, the default; 2) each took one scoring request at a
    time, so ``concurrency`` had no effect. Eight requests of one completion each, the server holding each reply
    until four requests have been in at once (at most 30 s; a loaded CI machine starts the decoding processes
    slowly; a held request counts as in flight until its reply is written):
    ``concurrency`` (4) of them are at the server at once, and the scores are those of one request at a time."""
    import time

    server.max_batch = 1
    prompts, completions = [[1, 2, 3 + i] for i in range(8)], [[4, 5, 6 + i] for i in range(8)]
    alone = served(server, concurrency=1, request_prompts=1, decode_workers=0).score(prompts, completions, 0.5, 353)
    slow = server.reply  # (within the server's count of the requests it is answering)

    def held(*args):
        deadline = time.monotonic() + 30.0
        while server.most_in_flight < 4 and time.monotonic() < deadline:  # once four were in, none waits
            time.sleep(0.01)
        return slow(*args)

    monkeypatch.setattr(server, "reply", held)
    teacher = served(server, concurrency=4, request_prompts=1, decode_workers=workers, timeout_s=60.0)  # longer than the hold
    teacher.score(prompts, completions, 0.5, 353)  # its decoding processes started
    server.most_in_flight = 0
    scores = teacher.score(prompts, completions, 0.5, 353)
    assert server.most_in_flight == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(scores, alone))
