"""The lm-eval forgetting suite off the training loop (kdlab.evaluation.forgetting, kdlab forgetting): the
same numbers and names as the in-loop OODForgetting on a real tiny fit, the before cache, the back ends.
A local task over a local file, lm-eval's Hugging Face back end, nothing downloaded."""

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from kdlab.cli.main import main
from kdlab.evaluation import forgetting
from kdlab.evaluation.before_cache import BeforeCache, weights_digest
from kdlab.evaluation.forgetting import SuiteSettings
from kdlab.evaluation.forgetting_run import measure_run
from kdlab.runlog import metrics_lines

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "experiments" / "tiny" / "smoke.yaml")
TOY = {"toy": {"task": "kdlab_toy_mc", "limit": 8, "metric": "acc,none"}, "toy_first4": {"task": "kdlab_toy_mc", "limit": 4, "metric": "acc,none"}}


pytestmark = pytest.mark.usefixtures("lm_eval_offline")  # conftest.py: offline, inside a copy of the fixture tasks (task_dir)


def fit(output: Path, name: str, task_dir: Path, in_loop: bool, *extra: str) -> Path:
    """A real two-step `kdlab fit` of the tiny pair; with ``in_loop`` the lm-eval OODForgetting callback measures in it."""
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(output), "name": name, "version": ""}}
    args = ["fit", f"--config={SMOKE}", "--trainer.max_steps=2", "--trainer.accumulate_grad_batches=1", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", f"--trainer.logger={json.dumps(logger)}", *extra]
    if in_loop:
        callback = {"class_path": "kdlab.callbacks.OODForgetting",
                    "init_args": {"lm_eval_tasks": TOY, "lm_eval_include_path": str(task_dir), "lm_eval_batch_size": 4}}
        args.append(f"--trainer.callbacks={json.dumps([callback])}")
    main(args)
    return output / name


@pytest.fixture(scope="module")
def in_loop_run(tmp_path_factory, task_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(task_dir)
        # a high learning rate, so that the scores after training differ from those before
        return fit(tmp_path_factory.mktemp("runs"), "in-loop", task_dir, True, "--model.lr=0.05", "--model.warmup_steps=0")


def ood_lines(run_dir: Path) -> dict[int, dict[str, float]]:
    lines: dict[int, dict[str, float]] = {}
    for step, name, value in metrics_lines(run_dir / "metrics.jsonl"):
        if name.startswith("ood/"):
            lines.setdefault(step, {})[name] = value
    return lines


def off_loop_copy(run_dir: Path, target: Path) -> Path:
    """The run as the off-loop suite meets it: its config and final weights, no in-loop ood/ lines."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "config.yaml", target / "config.yaml")
    shutil.copy(run_dir / "checkpoints" / "final.ckpt", target / "checkpoints" / "final.ckpt")
    return target


def suite(task_dir: Path, batch_size: int = 4) -> SuiteSettings:
    return SuiteSettings(tasks=TOY, include_path=str(task_dir), batch_size=batch_size)


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_off_loop_scores_and_names_equal_the_in_loop_callbacks(in_loop_run, task_dir, tmp_path):
    in_loop = ood_lines(in_loop_run)
    assert sorted(in_loop) == [0, 2]  # before at step 0, after at the last step
    assert [in_loop[0][f"ood/{name}_before"] for name in TOY] != [in_loop[2][f"ood/{name}"] for name in TOY]  # two models told apart
    run = off_loop_copy(in_loop_run, tmp_path / "run")
    record = measure_run(run, suite(task_dir), backend="hf", dtype="float32")
    assert record["backend"] == "hf" and record["devices"] == 1 and record["step"] == 2
    assert ood_lines(run) == in_loop  # the same names, steps and numbers, to the last bit
    assert json.loads((run / "forgetting.json").read_text())["after"] == {name: in_loop[2][f"ood/{name}"] for name in TOY}


def test_the_suite_defaults_to_the_runs_own_callback_and_a_second_call_scores_nothing(in_loop_run, task_dir, tmp_path, monkeypatch):
    run = off_loop_copy(in_loop_run, tmp_path / "run")
    first = measure_run(run, backend="hf", dtype="float32")  # the suite of the run's OODForgetting
    assert first["settings"] == suite(task_dir).as_mapping()
    monkeypatch.setattr(forgetting, "score_folder", lambda *a, **k: pytest.fail("scored again"))
    assert measure_run(run, backend="hf", dtype="float32") == first
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # logged once


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_the_before_score_is_cached_by_weights_and_settings(in_loop_run, task_dir, tmp_path, monkeypatch):
    scored = []
    real = forgetting.score_folder
    monkeypatch.setattr(forgetting, "score_folder", lambda *a, **k: scored.append(a[0]) or real(*a, **k))
    cache = tmp_path / "cache"
    first = measure_run(off_loop_copy(in_loop_run, tmp_path / "a"), suite(task_dir), cache_dir=cache, backend="hf", dtype="float32")
    assert not first["before_from_cache"] and len(scored) == 2 and len(list(cache.glob("before-*.json"))) == 1
    second = measure_run(off_loop_copy(in_loop_run, tmp_path / "b"), suite(task_dir), cache_dir=cache, backend="hf", dtype="float32")
    assert second["before_from_cache"] and len(scored) == 3  # the "after" only
    assert second["before"] == first["before"] and second["weights"] == first["weights"]
    # other settings (batch size) and other weights (a student that starts from the first run's final weights) miss
    third = measure_run(off_loop_copy(in_loop_run, tmp_path / "c"), suite(task_dir, batch_size=2), cache_dir=cache, backend="hf", dtype="float32")
    assert not third["before_from_cache"] and len(scored) == 5
    other = off_loop_copy(in_loop_run, tmp_path / "d")
    config = (other / "config.yaml").read_text()
    assert "checkpoint: null" in config
    (other / "config.yaml").write_text(config.replace("checkpoint: null", f"checkpoint: {in_loop_run / 'checkpoints' / 'final.ckpt'}", 1))
    fourth = measure_run(other, suite(task_dir), cache_dir=cache, backend="hf", dtype="float32")
    assert not fourth["before_from_cache"] and fourth["weights"] != first["weights"] and len(scored) == 7
    assert fourth["before"] == second["after"] != second["before"]  # its start is the first run's end, scored the same way


def test_weights_digest_and_settings_key_follow_what_a_score_depends_on(task_dir):
    model = torch.nn.Linear(3, 2)
    copy = torch.nn.Linear(3, 2)
    copy.load_state_dict(model.state_dict())
    assert weights_digest(copy) == weights_digest(model)
    with torch.no_grad():
        copy.bias[0] += 1e-6
    assert weights_digest(copy) != weights_digest(model)
    assert weights_digest(model.to(torch.bfloat16)) != weights_digest(copy.to(torch.float32))
    key = suite(task_dir).key("hf", "float32")
    assert suite(task_dir).key("hf", "float32") == key
    assert len({key, suite(task_dir, 2).key("hf", "float32"), suite(task_dir).key("vllm", "float32"), suite(task_dir).key("hf", "bfloat16")}) == 4


def test_a_changed_task_file_changes_the_key(task_dir, tmp_path):
    other = Path(shutil.copytree(task_dir, tmp_path / "tasks"))
    assert suite(other).key("hf", "float32") == suite(task_dir).key("hf", "float32")  # where the files are does not count
    with (other / "kdlab_toy_mc.jsonl").open("a") as file:
        file.write('{"question": "2 + 2?", "choices": ["3", "4"], "answer": 1}\n')
    assert suite(other).key("hf", "float32") != suite(task_dir).key("hf", "float32")


def test_before_cache_ignores_a_file_of_other_keys(tmp_path):
    cache = BeforeCache(tmp_path)
    path = cache.put("a" * 64, "b" * 64, {"toy": 50.0})
    assert cache.get("a" * 64, "b" * 64) == {"toy": 50.0}
    assert cache.get("a" * 64, "c" * 64) is None
    assert cache.get("a" * 24 + "d" * 40, "b" * 64) is None and path.is_file()  # same file name, other full digest


def test_the_vllm_back_end_gets_the_folder_bf16_and_data_parallel_engines(task_dir, monkeypatch, tiny_pair):
    """vLLM cannot run here: lm-eval's VLLM class is stood in for by its Hugging Face one, recording its arguments."""
    import sys
    import types

    import lm_eval.models.huggingface as hf

    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    made = []

    class StandIn(hf.HFLM):
        def __init__(self, pretrained, dtype, batch_size, data_parallel_size, tensor_parallel_size):
            made.append({"files": sorted(p.name for p in Path(pretrained).iterdir()), "dtype": dtype, "batch_size": batch_size,
                         "data_parallel_size": data_parallel_size, "tensor_parallel_size": tensor_parallel_size})
            super().__init__(pretrained=pretrained, dtype="float32", batch_size=4, device="cpu")

    stand_in = types.ModuleType("lm_eval.models.vllm_causallms")  # the real one imports vllm
    stand_in.VLLM = StandIn
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", stand_in)
    spec = ModelSpec(tiny_pair[0])
    model, tokenizer = load_causal_lm(spec).eval(), load_tokenizer(spec)
    expected = forgetting.score_model(load_causal_lm(spec).eval(), tokenizer, suite(task_dir), "hf", "float32")
    scores = forgetting.score_model(model, tokenizer, suite(task_dir), "vllm", "bfloat16", devices=4)
    (call,) = made
    assert call["dtype"] == "bfloat16" and call["data_parallel_size"] == 4 and call["tensor_parallel_size"] == 1 and call["batch_size"] == "auto"
    assert "config.json" in call["files"] and "model.safetensors" in call["files"] and "tokenizer_config.json" in call["files"]
    assert set(scores) == set(expected) == set(TOY)


def test_backend_and_dtype_choice(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert forgetting.choose_backend("auto") == "hf" and forgetting.choose_dtype("auto") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert forgetting.choose_dtype("auto") == "bfloat16"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert forgetting.choose_backend("auto") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert forgetting.choose_backend("auto") == "hf"
    with pytest.raises(ImportError, match=r"backend 'vllm' needs vLLM"):
        forgetting.choose_backend("vllm")
    with pytest.raises(ValueError, match=r"forgetting\.backend must be one of"):
        forgetting.choose_backend("tgi")


def test_bad_input_names_the_key_or_file(in_loop_run, task_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"forgetting: unknown key 'batch'"):
        SuiteSettings.from_mapping({"tasks": TOY, "batch": 2})
    with pytest.raises(ValueError, match=r"forgetting\.batch_size"):
        SuiteSettings(tasks=TOY, batch_size=0)
    with pytest.raises(FileNotFoundError, match=r"final\.ckpt does not exist"):
        measure_run(tmp_path, suite(task_dir))
    with pytest.raises(ValueError, match=r"already holds ood/mean measured in the training loop"):
        measure_run(in_loop_run, suite(task_dir), backend="hf")
    with pytest.raises(SystemExit) as stopped:
        main(["forgetting", "--run", str(tmp_path / "missing"), "--suite", str(tmp_path / "none.yaml")])
    assert stopped.value.code == 2 and "--suite: no such file" in capsys.readouterr().err


def test_the_command_line_measures_a_run_and_prints_its_scores(in_loop_run, task_dir, tmp_path, capsys):
    run = off_loop_copy(in_loop_run, tmp_path / "run")
    suite_file = tmp_path / "suite.yaml"
    suite_file.write_text(json.dumps({"tasks": TOY, "include_path": str(task_dir), "batch_size": 4}))
    main(["forgetting", "--run", str(run), "--suite", str(suite_file), "--backend", "hf", "--dtype", "float32", "--cache_dir", str(tmp_path / "c")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    in_loop = ood_lines(in_loop_run)
    assert printed["after"] == {name: in_loop[2][f"ood/{name}"] for name in TOY}
    assert printed["before"] == {name: in_loop[0][f"ood/{name}_before"] for name in TOY} and not printed["before_from_cache"]


# ---- kdlab sweep schedules it ----------------------------------------------------------------------------
def sweep_file(path: Path, output: Path, task_dir: Path, forgetting: bool, base: str = SMOKE) -> Path:
    data = {"base": base, "output": str(output), "seeds": [1, 2], "mode": "sequential",
            "overrides": {"trainer.max_steps": 1, "trainer.accumulate_grad_batches": 1, "trainer.limit_val_batches": 0,
                          "trainer.enable_progress_bar": False}}
    if forgetting:
        data["forgetting"] = {"tasks": TOY, "include_path": str(task_dir), "batch_size": 4, "backend": "hf", "dtype": "float32",
                              "cache_dir": str(output / "before-cache")}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_a_sweep_measures_each_finished_run_off_the_loop_reusing_the_before_score(task_dir, tmp_path, monkeypatch, capsys):
    import kdlab.cli.lightning

    fits, real = [], kdlab.cli.lightning.run_lightning
    monkeypatch.setattr(kdlab.cli.lightning, "run_lightning", lambda args, **kw: fits.append(args) or real(args, **kw))
    output = tmp_path / "sweep"
    main(["sweep", "--config", str(sweep_file(tmp_path / "plain.yaml", output, task_dir, forgetting=False))])
    assert len(fits) == 2 and not list(output.glob("*/forgetting.json"))
    # forgetting added afterwards: print mode lists the two fitted, unmeasured runs; a run measures them without fitting again
    with_forgetting = sweep_file(tmp_path / "forgetting.yaml", output, task_dir, forgetting=True)
    main(["sweep", "--config", str(with_forgetting), "--mode", "print"])
    lines = (output / "commands.sh").read_text().splitlines()
    assert [line.split("--run ")[1] for line in lines] == ["seed=1", "seed=2"]
    main(shlex.split(lines[0])[3:])  # print mode's first line: `python -m kdlab.cli sweep --config F --run seed=1` measures it
    assert len(fits) == 2 and (output / "seed=1" / "forgetting.json").is_file() and not (output / "seed=2" / "forgetting.json").is_file()
    main(["sweep", "--config", str(with_forgetting)])  # measures the other one
    assert len(fits) == 2
    records = [json.loads((output / name / "forgetting.json").read_text()) for name in ("seed=1", "seed=2")]
    assert [r["before_from_cache"] for r in records] == [False, True]  # both runs start from the same student
    assert records[0]["before"] == records[1]["before"] and records[0]["weights"] == records[1]["weights"]
    for name, record in zip(("seed=1", "seed=2"), records):
        lines = ood_lines(output / name)
        assert lines[1] == {**{f"ood/{k}": v for k, v in record["after"].items()}, "ood/mean": sum(record["after"].values()) / 2,
                            "ood/mean_delta": sum(record["after"].values()) / 2 - sum(record["before"].values()) / 2}
    assert [run["status"] for run in json.loads((output / "sweep.json").read_text())["runs"]] == ["skipped", "done"]
    capsys.readouterr()
    main(["sweep", "--config", str(with_forgetting)])  # everything done and measured: nothing runs
    assert len(fits) == 2 and "0 done now, 2 already done" in capsys.readouterr().out


def test_a_sweep_refuses_forgetting_measured_in_the_loop_as_well(task_dir, tmp_path):
    from kdlab.study.grid import load_sweep

    base = tmp_path / "in_loop.yaml"
    callback = {"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"lm_eval_tasks": TOY}}
    base.write_text(json.dumps({"trainer": {"callbacks": [callback]}}))
    with pytest.raises(ValueError, match=rf"{base.name} also measures it in the training loop"):
        load_sweep(sweep_file(tmp_path / "s.yaml", tmp_path / "out", task_dir, forgetting=True, base=str(base)))
    path = sweep_file(tmp_path / "s.yaml", tmp_path / "out", task_dir, forgetting=True)
    data = json.loads(path.read_text())
    data["forgetting"]["devices"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"sweep\.forgetting\.devices"):
        load_sweep(path)
    data["forgetting"] = {"tasks": TOY, "batchsize": 4}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"sweep\.forgetting: unknown key 'batchsize'"):
        load_sweep(path)


@pytest.mark.slow  # two processes each index lm-eval's 15,000 task files: minutes on a shared CPU
def test_hf_processes_that_lm_eval_does_not_join_fail_rather_than_each_score_everything(task_dir, tiny_pair):
    """lm-eval's HFLM shards over Accelerate's processes only where it sees several GPUs; on this CPU the
    two processes each score alone, which the worker's report (lm-eval's world size) shows."""
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec(tiny_pair[0])
    with pytest.raises(RuntimeError, match=r"lm-eval saw 1 processes of the 2 started"):
        forgetting.score_model(load_causal_lm(spec).eval(), load_tokenizer(spec), suite(task_dir), "hf", "float32", devices=2)


@pytest.mark.parametrize(("devices", "expected"), [(4, 4), ("2", 2), ("auto", 1), ([0, 1], 1), (None, 1)])
def test_the_default_processes_are_the_runs_devices(tmp_path, devices, expected):
    from kdlab.evaluation.forgetting_run import run_devices

    (tmp_path / "config.yaml").write_text(json.dumps({"trainer": {} if devices is None else {"devices": devices, "num_nodes": 2}}))
    assert run_devices(tmp_path) == expected


def test_a_pipelines_stages_take_the_forgetting_key(task_dir, tmp_path):
    from kdlab.study.pipeline import load_pipeline

    forgetting_key = {"tasks": TOY, "include_path": str(task_dir), "cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps({"output": str(tmp_path / "out"), "distill": {"base": SMOKE, "forgetting": forgetting_key},
                                "rlvr": {"base": str(ROOT / "experiments" / "tiny" / "rlvr.yaml"), "forgetting": forgetting_key}}))
    pipeline = load_pipeline(path)
    for sweep, run_dir in ((pipeline.distill, "out/distill/seed=42"), (pipeline.rlvr_sweep("seed=42"), "out/rlvr/seed=42/seed=42")):
        command = sweep.forgetting_command(tmp_path / run_dir)
        assert command[1:5] == ["-m", "kdlab.cli", "forgetting", "--run"] and command[5] == str(tmp_path / run_dir)
        assert json.loads(command[command.index("--suite_json") + 1]) == SuiteSettings(tasks=TOY, include_path=str(task_dir)).as_mapping()
        assert command[command.index("--cache_dir") + 1] == str(tmp_path / "cache")


def test_a_lora_student_is_refused_naming_the_setting(tmp_path, task_dir):
    from kdlab.evaluation.forgetting_run import start_spec

    (tmp_path / "config.yaml").write_text(json.dumps({"model": {"student": {"path": "kdlab://tiny-random/student"}, "lora": {"r": 8}}}))
    with pytest.raises(NotImplementedError, match=r"trains LoRA adapters \(model\.lora\)"):
        start_spec(tmp_path)
    (tmp_path / "config.yaml").write_text(json.dumps({"model": {"class_path": "kdlab.stages.GRPOModule", "init_args": {"policy": "kdlab://x"}}}))
    assert start_spec(tmp_path)[1] == "policy" and start_spec(tmp_path)[0].path == "kdlab://x"
    (tmp_path / "config.yaml").write_text(json.dumps({"model": {"class_path": "kdlab.stages.SFTModule", "init_args": {"model": "kdlab://x"}}}))
    with pytest.raises(ValueError, match=r"names no trained model \(model\.student or model\.policy\)"):
        start_spec(tmp_path)
