"""Rows of docs/bad_inputs.md not covered next to their feature: each bad input fails early, naming
the key, file or row."""

from pathlib import Path

import pytest

from kdlab.cli.main import main
from kdlab.rollouts import TeacherDatasetRollouts

SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])


def fit(tmp_path, *extra):
    return main(["fit", f"--config={SMOKE}", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                 f"--trainer.logger.init_args.save_dir={tmp_path}", *extra])


@pytest.mark.parametrize("override, key", [("--model.lr=abc", "lr"), ("--model.objective.chunk_size=big", "chunk_size"),
                                           ("--model.student.dtype=3", "dtype")])
def test_wrong_types_fail_before_training_naming_the_key(tmp_path, capsys, override, key):
    with pytest.raises((SystemExit, ValueError)) as error:
        fit(tmp_path, override)
    assert key in str(error.value) + capsys.readouterr().err
    assert not list(Path(tmp_path).rglob("*.ckpt"))


def test_empty_teacher_dataset_is_rejected(tmp_path):
    empty = tmp_path / "teacher.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="TeacherDatasetRollouts.dataset .*holds no completions"):
        TeacherDatasetRollouts(str(empty))


def test_resuming_with_a_different_student_fails_before_any_step(tmp_path):
    cli = fit(tmp_path / "first")
    checkpoint = Path(cli.trainer.log_dir, "checkpoints", "final.ckpt")
    with pytest.raises(RuntimeError, match="does not fit this student .*student.path='kdlab://tiny/student'"):
        fit(tmp_path / "second", "--model.student.path=kdlab://tiny/student", "--model.teacher.path=kdlab://tiny/teacher",
            f"--ckpt_path={checkpoint}")


# ---- every row through the console script: one line naming the key, exit status 2 -------------------
FIT = ["fit", f"--config={SMOKE}", "--trainer.max_steps=1", "--trainer.limit_val_batches=0"]
RLVR = ["fit", str(Path(SMOKE).with_name("rlvr.yaml")), "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.callbacks=[]"]
RLVR[1] = f"--config={RLVR[1]}"
MIXTURE = ["--model.rollout=kdlab.rollouts.MixtureRollouts"]
DATASET = ["--model.rollout=kdlab.rollouts.TeacherDatasetRollouts"]
CACHED = ["--model.rollout=kdlab.rollouts.CachedTeacherRollouts", "--model.rollout.dataset={tmp}/teacher.jsonl"]
CALLBACK = "--trainer.callbacks+="
# row -> (arguments after the command; {tmp} is a temporary folder, text the last line must contain)
CLI_CASES = {
    "1": (FIT + ["--model.lr=abc"], "model.lr: Expected a <class 'float'>"),
    "2": (FIT + MIXTURE + ["--model.rollout.lamda=0.5"], "model.rollout.lamda: MixtureRollouts has no argument 'lamda' (did you mean 'lam'?)"),
    "3": (FIT + ["--model.objective=kdlab.objectives.NoSuchKL"], "model.objective: no class 'kdlab.objectives.NoSuchKL'"),
    "4": (FIT + MIXTURE + ["--model.rollout.lam=3"], "MixtureRollouts.lam must be in [-2, 2], got 3.0"),
    "5": (FIT + MIXTURE + ["--model.rollout.alpha=0"], "MixtureRollouts.alpha"),
    "6": (FIT + ["--model.lr=0"], "DistillModule.lr"),
    "7": (FIT + ["--model.objective=kdlab.objectives.GeneralizedJSD", "--model.objective.beta=2"], "GeneralizedJSD.beta"),
    "8": (FIT + [CALLBACK + "kdlab.callbacks.UpdateSparsity", "--trainer.callbacks.thresholds=[-1]"], "UpdateSparsity.thresholds must be positive"),
    "9": (FIT + ["--model.student.path=kdlab://tiny/student"], "student and teacher tokenizers differ (student.path="),
    "10": (FIT + ["--model.teacher.path={tmp}/no-such-model"], "teacher.path: no model directory at"),
    "12": (FIT + DATASET + ["--model.rollout.dataset={tmp}/row.jsonl"], "row.jsonl:1: missing string field 'completion'"),
    "14": (FIT + DATASET + ["--model.rollout.dataset={tmp}/empty.jsonl"], "TeacherDatasetRollouts.dataset"),
    "15": (FIT + ["--model.max_prompt_tokens=2"], "the student prompt has"),
    "17": (FIT + [CALLBACK + "kdlab.callbacks.OODForgetting", "--trainer.callbacks.lm_eval_tasks=[nosuchtask]"], "OODForgetting.lm_eval_tasks"),
    "21": (RLVR + ["--model.init_args.policy.checkpoint={tmp}/missing.ckpt"], "policy.checkpoint"),
    "22": (RLVR + ["--model.init_args.group_size=1"], "GRPOModule.group_size must be >= 2"),
    "24": (FIT + CACHED + ["--model.rollout.teacher_cache={tmp}/missing.pt"], "CachedTeacherRollouts.teacher_cache: no such file"),
    "25": (FIT + ["--model.rollout=kdlab.rollouts.VLLMRollouts"], "model.rollout.class_path='kdlab.rollouts.VLLMRollouts' needs vllm, which is not installed: pip install 'kdlab[vllm]'"),
    "27": (FIT + ["--model.rollout=kdlab.rollouts.VLLMRollouts", "--model.rollout.model=student", "--model.rollout.tensor_parallel_size=2"],
           "VLLMRollouts"),
    "30": (RLVR + [CALLBACK + "kdlab.callbacks.StyleTransfer", "--trainer.callbacks.tasks=[{class_path: kdlab.tasks.Addition}]"],
           "StyleTransfer.teacher is required"),
    "31": (RLVR + [CALLBACK + "kdlab.callbacks.RolloutSensitivity"], "RolloutSensitivity"),
    "32": (FIT + ["--model.teacher.path=pkg://llm_smollm3_missing/model"], "teacher.path 'pkg://"),
    "33": (FIT + ["--model.student.path={tmp}/missing.gguf"], "student.path: no GGUF file at"),
    "35": (FIT + ["--model.student.layers=[0, 0]"], "layers (path 'kdlab://tiny-random/student'): layer(s) [0] repeated"),
    "37": (FIT + ["--model.objective=kdlab.objectives.FowardKL"], "(did you mean 'ForwardKL'?)"),
    "38": (["fit", "--config={tmp}/no-such.yaml"], "no-such.yaml: cannot be read"),
    "39": (FIT + ["--model.teacher.path={tmp}/no-such-model"], "teacher.path"),  # a hub id: tests/test_cli.py (needs HF_HUB_OFFLINE)
    "40": (["fit", "--config=" + str(Path(SMOKE).with_name("onpd_rkl.yaml"))], "is an overlay of experiments/tiny/quickstart.yaml"),
    "42": (FIT + DATASET + ["--model.rollout.dataset={tmp}/other-task.jsonl"], "TeacherDatasetRollouts.dataset='"),
    "43": (RLVR + [CALLBACK + "kdlab.callbacks.HeldOutKL"], "HeldOutKL compares a student with its teacher and needs a DistillModule"),
    "44": (FIT + ["--model.task.answer_from=number"], "Addition.answer_from must be one of"),
    "46": (FIT + MIXTURE + ["--model.student.path=kdlab://tiny/student", "--model.cross_tokenizer=kdlab.objectives.CrossTokenizer"],
           "DistillModule.rollout: MixtureRollouts needs one vocabulary shared by student and teacher"),
    "48": (FIT + ['--model.served_teacher={"class_path": "kdlab.rollouts.served.ServedTeacher", "init_args": '
                   '{"url": "http://127.0.0.1:9", "model": "m", "tokenizer": "kdlab://tiny-random/teacher"}}'],
           "DistillModule.served_teacher is the teacher: set teacher: null"),
    "47": (FIT + ["--model.base_teacher=true"], "DistillModule.base_teacher: the teacher is the student's base under its LoRA adapters"),
    "50": (FIT + ['--model.teachers={"a": {"model": {"path": "kdlab://tiny-random/teacher"}}}'],
           "DistillModule.teachers replaces ['teacher']: give each teacher as an entry of teachers"),
    "51": (FIT + ['--model.task={"class_path": "kdlab.tasks.mixture.MultiTask", "init_args": {"tasks": {"a": {"class_path": '
                  '"kdlab.tasks.Addition"}}, "splits": {"val": ["nope"]}}}'], "MultiTask.splits.val: ['nope'] not among MultiTask.tasks ['a']"),
    "52": (FIT + [CALLBACK + "kdlab.callbacks.HeldOutKL", "--trainer.callbacks.prefixes=both"], "HeldOutKL.prefixes must be one of"),
    "55": (FIT + ["--model.teacher=null", '--model.served_teacher={"class_path": "kdlab.rollouts.served.ServedTeacher", "init_args": '
                  '{"url": "http://user:secret@127.0.0.1:9", "model": "m", "tokenizer": "kdlab://tiny-random/teacher"}}'],
           "ServedTeacher.url='http://127.0.0.1:9': a URL with a user, password, query or fragment is refused"),
    "58": (FIT + ["--model.teacher.path=kdlab://../.."], "model.teacher.path='kdlab://../..' is not a packaged model"),
    "63": (FIT + ["--model.teacher_temperature=1e-8"], "DistillModule.teacher_temperature must be a finite number >= 0.0001"),
    "64": (FIT + ["--model.betas=[0.9, 1.5]"], "DistillModule.betas must be two numbers in [0, 1), got [0.9, 1.5]"),
    "65": (FIT + [CALLBACK + "kdlab.callbacks.Coverage", '--trainer.callbacks.task={"class_path": "kdlab.tasks.Addition"}',
                  "--trainer.callbacks.batch_size=0"], "Coverage.batch_size must be >= 1, got 0"),
    "66": (FIT + ["--ckpt_path={tmp}/missing.ckpt"], "missing.ckpt': no such file or folder"),
    "76": (FIT + ["--model.rollout=kdlab.rollouts.ServedRollouts", "--model.rollout.url=http://gpu7.cluster:8000", "--model.rollout.model=s"],
           "ServedRollouts.weights_dir: the server at http://gpu7.cluster:8000 is not addressed as this machine"),
    "80": (FIT + ["--model.lora.r=4", "--model.lora.dropout=1.5"], "lora.dropout must be in [0, 1), got 1.5"),
    "81": (FIT + ["--model.lora.r=4", "--model.lora.target_modules=[q_proj,qproj]"], "lora.target_modules: ['qproj'] match no module of the model"),
    "85": (FIT + [CALLBACK + "kdlab.callbacks.OODForgetting", '--trainer.callbacks.tasks=[{"class_path": "kdlab.tasks.Addition"}, '
                  '{"class_path": "kdlab.tasks.Addition", "init_args": {"max_digits": 4}}]'],
           "OODForgetting.tasks: tasks[0] (Addition), tasks[1] (Addition) are all named 'addition'"),
}
NOT_CLI = {  # rows whose input is not a configuration a command line can give, with where they are tested
    "62": "strategy: deepspeed needs the deepspeed package (not installed here): the check is given Lightning's own class, uninitialised",
    "11": "a corrupted weight file: tested by loading a damaged copy (test_models.py)",
    "13": "a dataset row of a real task read from local files (test_real_tasks.py)",
    "16": "needs a checkpoint of another student: test_resuming_with_a_different_student_fails_before_any_step",
    "18": "an optional package missing: simulated by hiding the module (test_lm_eval_suite.py, test_callbacks.py)",
    "19": "a batch without completion tokens: a warning during training, not an error",
    "20": "model responses: scored, never an error",
    "23": "kdlab pipeline files: their own usage error naming file and key (test_pipeline.py)",
    "26": "kdlab generate settings: checked before any model loads (test_vllm_engine.py)",
    "28": "vLLM sampling temperatures: needs vLLM (test_vllm_engine.py)",
    "29": "strategy: fsdp needs CUDA; the check is tested with a stand-in strategy (test_module.py)",
    "34": "a model config whose head is smaller than its tokenizer: built in test_models.py",
    "36": "exporting a DoRA adapter: a Python call, not a configuration (test_models.py)",
    "41": "kdlab report input: its own usage messages (test_report.py)",
    "45": "kdlab sweep files: their own usage error naming the key (test_sweep.py)",
    "49": "a misbehaving HTTP server: run against kdlab's loopback server with faults (test_served_teacher.py)",
    "53": "a served reply no model gives: the loopback server's fault switches (test_served_faults.py)",
    "54": "a server that trickles, hangs up, dies or throttles: the loopback server's fault switches (test_served_faults.py)",
    "56": "a served tokenizer with other added tokens: a loopback server given another tokenizer (test_served_faults.py)",
    "57": "a hostile teacher cache file: mutated and crafted files read directly (test_cache_codec.py)",
    "59": "kdlab report input: a metrics file read directly (test_no_data_lost.py)",
    "60": "model responses: scored, never an error (test_hostile_inputs.py)",
    "61": "kdlab report input: a run's config read directly (test_no_data_lost.py)",
    "67": "needs a run directory an earlier fit left (test_resume.py)",
    "68": "needs a run to resume (test_resume.py)",
    "69": "a checkpoint's data position read directly (test_resume.py)",
    "70": "a Task subclass with a broken score is Python code, not a configuration (test_module.py)",
    "71": "needs SLURM (detected through a stand-in) and a requeue file (test_resume.py)",
    "72": "a key read from the environment, sent to a loopback server (test_served_faults.py)",
    "73": "a served reply for another prompt: the loopback server's fault switch (test_served_faults.py)",
    "74": "a served reply for a padded output layer: the loopback server answering as vLLM does (test_served_teacher.py)",
    "75": "a served sampling temperature: checked when a sample is asked for, against a loopback server (test_served_teacher.py)",
    "77": "a train split holding nearly every problem of its variant: tested with the skip cap lowered (test_countdown.py)",
    "78": "needs a model folder whose config names layers of another kind than full or sliding attention (test_packing.py)",
    "79": "a task whose prompt renders to no tokens is Python code, not a configuration (test_module.py)",
    "82": "needs a model with tied embeddings (the packaged tiny models are untied): a tied copy of the tiny config (test_distill_lora.py)",
    "83": "needs a LoRA checkpoint file without recorded settings, written by the test (test_distill_lora.py)",
    "84": "kdlab sweep and pipeline files: their own one-line error naming the run and key (test_sweep.py, test_pipeline.py)",
}


@pytest.mark.parametrize("row", CLI_CASES)
def test_each_row_through_the_console_script_ends_in_one_line_naming_the_key(row, tmp_path, capsys):
    """``kdlab`` (the console script's entry, in-process) exits with status 2 and its last line is
    ``kdlab: error: ...`` naming the key or file, not jsonargparse's "Expected a <class 'NoneType'>"."""
    import json

    from kdlab.cli.main import entry

    (tmp_path / "row.jsonl").write_text(json.dumps({"id": "add-train-0"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "other-task.jsonl").write_text(json.dumps({"id": "countdown3-train-0", "completion": "x"}) + "\n")
    (tmp_path / "teacher.jsonl").write_text(json.dumps({"id": "add-train-0", "completion": "x"}) + "\n")
    args, expected = CLI_CASES[row]
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args] + [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_info:
        entry(args)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and last.startswith("kdlab: error: ") and expected in last, last
    assert "NoneType" not in last and "Given value" not in last
    assert not list(tmp_path.rglob("*.ckpt"))


def test_every_row_of_the_bad_inputs_table_has_a_console_script_case_or_a_reason():
    import re

    text = (Path(__file__).parents[1] / "docs" / "bad_inputs.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| (\d+) \|", text, flags=re.M))
    assert not set(CLI_CASES) & set(NOT_CLI)
    assert rows == set(CLI_CASES) | set(NOT_CLI), sorted(rows ^ (set(CLI_CASES) | set(NOT_CLI)), key=int)


def test_the_bad_inputs_table_has_15_rows_and_names_only_tests_that_exist():
    import re

    root = Path(__file__).parents[1]
    text = (root / "docs" / "bad_inputs.md").read_text(encoding="utf-8")
    assert len(re.findall(r"^\| \d+ \|", text, flags=re.M)) >= 15
    for file, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        assert f"def {name}(" in (root / file).read_text(encoding="utf-8"), f"{file}::{name}"


def test_a_teacher_dataset_matching_no_example_fails_before_the_run_directory_and_the_before_evaluation(tmp_path, capsys):
    """The issue's case: ids of another task's dataset. The error names the dataset and an id it lacks,
    before a run directory is written and before Coverage's "before" evaluation runs."""
    import json

    from kdlab.cli.main import entry

    dataset = tmp_path / "other-task.jsonl"
    dataset.write_text(json.dumps({"id": "countdown3-train-0", "completion": "x"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        entry([*FIT, *DATASET, f"--model.rollout.dataset={dataset}", f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
               "--trainer.callbacks+=kdlab.callbacks.Coverage", "--trainer.callbacks.task=kdlab.tasks.Addition"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert last == (f"kdlab: error: DistillModule can train on no train example of Addition (TeacherDatasetRollouts.dataset={str(dataset)!r} "
                    "covers none of its ids, e.g. 'add-train-0')")
    assert not (tmp_path / "runs").exists()  # no half-written run directory, no "before" evaluation logged


def test_the_bad_inputs_intro_names_the_rows_that_fail_during_training_and_those_that_do_not_fail():
    """The page's opening says which rows are not "fails before training starts": the served teacher's (their error
    names a served teacher and comes during training) and the inputs taken without an error (warned, scored, skipped or not imported)."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "bad_inputs.md").read_text(encoding="utf-8")
    intro = " ".join(text.split("\n| # |")[0].split()).lower()
    cells = {int(n): error for n, error in re.findall(r"^\| (\d+) \| [^|]*(?:`[^`]*`[^|]*)*\| (.*?) \| `tests/", text, flags=re.M)}
    assert len(cells) == len(re.findall(r"^\| \d+ \|", text, flags=re.M))
    served = sorted(n for n, error in cells.items() if "served teacher http" in error and "during training" in error)
    lenient = sorted(n for n, error in cells.items() if re.search(r"\bwarning\b|\bscored\b|never raises|never an error|not imported", error))

    def listed(rows: list[int]) -> str:
        return f"rows {', '.join(map(str, rows[:-1]))} and {rows[-1]}"

    assert served and f"({listed(served)})" in intro, (served, intro)
    assert lenient and f"{listed(lenient)} are inputs kdlab takes without failing" in intro, (lenient, intro)


def test_a_strategy_kdlab_does_not_shard_for_is_refused_before_any_step_naming_it(tiny_pair):
    """DeepSpeed (a DDPStrategy subclass in Lightning, so not caught as "not DDP") and any strategy outside single
    device, DDP, FSDP1 and FSDP2 are refused when the stage is set up, before any example or weight is touched."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    from kdlab.stages.sharding import check_strategy

    for strategy in (object.__new__(DeepSpeedStrategy), type("OtherStrategy", (), {})()):
        with pytest.raises(ValueError, match=rf"trainer.strategy: kdlab does not train under {type(strategy).__name__}; use one device, ddp"):
            check_strategy(strategy)
    for strategy in (SingleDeviceStrategy("cpu"), DDPStrategy()):
        check_strategy(strategy)
    # both kinds of stage check it first thing in setup, which Lightning calls before configure_model and any step
    from types import SimpleNamespace

    from kdlab.stages import DistillModule, SFTModule
    from kdlab.tasks import Addition

    for stage in (DistillModule(*tiny_pair, Addition(num_train=4)), SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)])):
        stage._trainer = SimpleNamespace(strategy=object.__new__(DeepSpeedStrategy))
        with pytest.raises(ValueError, match="kdlab does not train under DeepSpeedStrategy"):
            stage.setup("fit")
