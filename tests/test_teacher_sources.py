"""One teacher slot, many sources (issue #39): ``kdlab.teachers``. The module never asks which source it holds; a new
source is one class; the earlier spellings train exactly what the new ones train; and the bugs that lived in the
seams between the five earlier options stay fixed."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from kdlab.errors import ConfigError
from kdlab.models.loading import ModelSpec, load_causal_lm
from kdlab.objectives.logits import completion_logits
from kdlab.rollouts.policies import StudentRollouts, TeacherDatasetRollouts, TeacherRollouts
from kdlab.tasks import Addition, Sorting
from kdlab.tasks.mixture import MultiTask
from kdlab.teachers import Average, ByField, ModelTeacher, Served, Several, TeacherSource

ROOT = Path(__file__).resolve().parents[1]
STUDENT, TEACHER = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"
SOURCES = ("ModelTeacher", "BaseModelTeacher", "CachedTeacher", "Served", "Several", "InProcessTeacher")


def task():
    return Addition(max_digits=2, system_prompt="", num_train=8, num_val=4, num_test=0, seed=0)


def module(teacher=TEACHER, rollout=None, task_=None, **settings):
    from kdlab.stages.distill import DistillModule

    base = dict(batch_size=2, max_completion_tokens=6, val_examples=4, val_batch_size=4, warmup_steps=1, lr=1e-2, teacher_temperature=0.5)
    base.update(settings)
    return DistillModule(STUDENT, teacher, task_ or task(), rollout=rollout, **base)


def fit(m, tmp_path, steps=2, callbacks=()):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=list(callbacks))
    trainer.fit(m)
    return trainer


def trained(m, tmp_path, steps=2):
    pl.seed_everything(0)
    trainer = fit(m, tmp_path, steps)
    return float(trainer.callback_metrics["train/loss"]), [p.detach().clone() for p in m.student.parameters()]


# ---- the module never asks which source it holds ------------------------------------------------------
def test_distill_module_names_no_teacher_source_and_tests_no_class_name():
    """``DistillModule`` branches on no source's kind: its module names no source class (the earlier spellings are
    turned into sources by kdlab.teachers.legacy), and no module of kdlab tests a capability by a class's name."""
    source = (ROOT / "kdlab" / "stages" / "distill.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & set(SOURCES), sorted(names & set(SOURCES))
    for attribute in ("served_teacher", "teacher_set", "base_teacher", "teachers"):
        assert attribute not in names, attribute
    from kdlab.stages.distill import DistillModule
    import inspect

    # the four earlier teacher settings are gone (32 - 4); max_tokens_per_row (#42, padding-free micro-batches) came since
    assert len(inspect.signature(DistillModule.__init__).parameters) - 2 <= 32 - 4 + 1  # self and **legacy aside
    for path in (ROOT / "kdlab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "__name__" for side in [node.left, *node.comparators]):
                literals = [side.value for side in [node.left, *node.comparators] if isinstance(side, ast.Constant) and isinstance(side.value, str)]
                assert not any(text.endswith(("Rollouts", "Teacher")) or text in SOURCES for text in literals), f"{path}: {literals}"


class CallableTeacher(TeacherSource):
    """A new kind of teacher, written here and nowhere else: its tempered distribution is a Python callable's
    ``(B, C, V)`` logits on the completion (here: a fixed linear function of the completion's one-hot tokens)."""

    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def offers(self, run):
        return super().offers(run) | {"teacher_scores"}  # it scores any completion; it writes none

    def bind(self, run, setting="DistillModule.teacher"):
        self._run, self.setting = run, setting
        self.tokenizer, self.token_columns = run.student_tokenizer, run.student_columns

    def completion_logprobs(self, rollout, student=None):
        return self.function(rollout.completion_ids, self.token_columns) / self.run.teacher_temperature


def test_a_new_source_is_one_class_and_trains_with_dataset_and_student_rollouts(tmp_path):
    weights = torch.randn(1, 1, 1)

    def teacher(ids, columns):
        return torch.nn.functional.one_hot(ids.roll(1, dims=1), columns).float() * 3.0 + weights

    data = tmp_path / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": task().reference_completion(ex)}) + "\n" for ex in task().examples("train")))
    for rollout in (TeacherDatasetRollouts(str(data)), StudentRollouts()):
        m = module(CallableTeacher(teacher), rollout=rollout)
        before = [p.detach().clone() for p in m.student.parameters()]
        trainer = fit(m, tmp_path)
        assert torch.isfinite(trainer.callback_metrics["train/loss"])
        assert any(not torch.equal(a, b) for a, b in zip(before, m.student.parameters()))
    with pytest.raises(ConfigError, match="TeacherRollouts needs a teacher that writes completions.*CallableTeacher"):
        module(CallableTeacher(teacher), rollout=TeacherRollouts())


# ---- both spellings, one run ----------------------------------------------------------------------------
def test_the_new_and_the_earlier_spellings_train_the_same_bit_for_bit(tmp_path):
    """``teacher: {path}`` == ``ModelTeacher`` == one-entry ``Several`` == the earlier one-entry ``teachers:``."""
    from kdlab.teachers.legacy import TeacherEntry

    runs = {
        "path": module(TEACHER, rollout=TeacherRollouts()),
        "ModelTeacher": module(ModelTeacher(TEACHER), rollout=TeacherRollouts()),
        "Several": module(Several({"only": ModelTeacher(TEACHER)}), rollout=TeacherRollouts()),
    }
    with pytest.warns(FutureWarning, match="DistillModule.teachers is deprecated: use DistillModule.teacher: .*Several"):
        runs["teachers"] = module(None, rollout=TeacherRollouts(), teachers={"only": TeacherEntry(model=ModelSpec(TEACHER))})
    results = {name: trained(m, tmp_path / name) for name, m in runs.items()}
    loss, weights = results["path"]
    for name, (other_loss, other_weights) in results.items():
        assert other_loss == loss and all(torch.equal(a, b) for a, b in zip(weights, other_weights)), name


# ---- the seams ------------------------------------------------------------------------------------------
def teacher_with_extra_end_token(tmp_path) -> tuple[str, int]:
    """A copy of the tiny teacher whose generation config ends completions at one more token (as chat models end at
    their turn token): the folder and that token."""
    from kdlab.models.loading import resolve_path

    folder = tmp_path / "teacher"
    shutil.copytree(resolve_path(TEACHER), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    extra = 7 if 7 not in eos else 8
    config["eos_token_id"] = eos + [extra]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder), extra


def test_a_served_teacher_ends_completions_at_its_own_end_tokens(tmp_path, monkeypatch):
    """The teacher's end tokens (its generation config's) stop the server's samples, as they stop an in-process
    teacher's: they are among the run's end tokens and in every sampling request's stop_token_ids."""
    from kdlab.rollouts.loopback import LoopbackServer
    from kdlab.rollouts.served import ServedTeacher

    folder, extra = teacher_with_extra_end_token(tmp_path)
    in_process = module(folder, rollout=TeacherRollouts())
    assert extra in in_process.end_ids
    stops = []
    original = ServedTeacher.sample
    monkeypatch.setattr(ServedTeacher, "sample", lambda self, prompt, n, t, seed, ends: stops.append(list(ends)) or original(self, prompt, n, t, seed, ends))
    with LoopbackServer(folder, name="tiny-teacher") as server:
        m = module(Served(ServedTeacher(server.url, "tiny-teacher", folder, timeout_s=10.0, retries=0, prefetch=False)), rollout=TeacherRollouts())
        assert extra in m.end_ids and set(m.end_ids) == set(in_process.end_ids)
        m.make_rollout(task().examples("train")[:2], 0)
    assert stops and all(extra in ends for ends in stops)


def mixed():
    return MultiTask({"addition": Addition(max_digits=2, system_prompt="", num_train=8, num_val=4, num_test=0),
                      "sorting": Sorting(system_prompt="", num_train=8, num_val=4, num_test=0)})


def test_routing_sharded_in_process_teachers_is_refused_before_any_weights_load(monkeypatch):
    """Under teacher_placement: shard each rank would call only the teachers its rows need, so ranks would enter
    different teachers' collectives: refused, naming the combination, before a weight is read. One sharded
    in-process teacher beside a served one is refused too: a rank with no row routed to it would skip its forward
    while another rank enters its collectives."""
    import kdlab.teachers.model
    from kdlab.rollouts.served import ServedTeacher

    monkeypatch.setattr(kdlab.teachers.model, "load_causal_lm", lambda *a, **k: pytest.fail("a teacher's weights were read"))
    teachers = {"strong": ModelTeacher(TEACHER), "self": ModelTeacher(STUDENT)}
    with pytest.raises(ConfigError, match=r"routing each example to one teacher \(ByField\) with teacher_placement: shard.*\['strong', 'self'\]"):
        module(Several(teachers, ByField({"addition": "strong", "sorting": "self"})), rollout=TeacherRollouts(), task_=mixed(),
               teacher_placement="shard")
    served = Served(ServedTeacher(url="http://127.0.0.1:9/v1", model="m", tokenizer=STUDENT, retries=0, prefetch=False))
    with pytest.raises(ConfigError, match=r"routing each example to one teacher \(ByField\) with teacher_placement: shard.*\['strong'\]"):
        module(Several({"strong": ModelTeacher(TEACHER), "api": served}, ByField({"addition": "strong", "sorting": "api"})),
               rollout=StudentRollouts(), task_=mixed(), teacher_placement="shard")
    monkeypatch.undo()
    averaged = module(Several({"strong": ModelTeacher(TEACHER), "self": ModelTeacher(STUDENT)}, Average()), rollout=TeacherRollouts(),
                      task_=mixed(), teacher_placement="shard")  # every rank calls every teacher: allowed
    assert len(averaged.sharded_models()) == 3


def test_a_scoring_members_rows_are_expanded_on_the_training_device(tmp_path, monkeypatch):
    """Several teachers with a cached member: its top-k rows are moved to the training device as top-k, then
    expanded there (never a dense (C, V) on the host that is then copied)."""
    from kdlab.rollouts.teacher_cache import TopKLogprobs
    from kdlab.rollouts.teacher_data import build_teacher_cache
    from kdlab.teachers import CachedTeacher

    data = tmp_path / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": mixed().reference_completion(ex)}) + "\n" for ex in mixed().examples("train")))
    cache = str(tmp_path / "cache.safetensors")
    build_teacher_cache(load_causal_lm(ModelSpec(TEACHER)), load_tokenizer_of(TEACHER), mixed(), str(data), cache, top_k=4, temperature=0.5,
                        max_new_tokens=6, max_prompt_tokens=256, batch_size=4)
    calls = []
    for name in ("to", "dense"):
        original = getattr(TopKLogprobs, name)
        monkeypatch.setattr(TopKLogprobs, name, (lambda original, name: lambda self, *a, **k: calls.append(name) or original(self, *a, **k))(original, name))
    m = module(Several({"cached": CachedTeacher(cache), "self": ModelTeacher(STUDENT)}, ByField({"addition": "cached", "sorting": "self"})),
               rollout=TeacherDatasetRollouts(str(data)), task_=mixed())
    rollout = m.make_rollout(m.task.examples("train")[:4], 0)
    m.distillation_logits(rollout)
    assert calls == ["to", "dense"]


def load_tokenizer_of(path):
    from kdlab.models.loading import load_tokenizer

    return load_tokenizer(ModelSpec(path))


def test_held_out_kl_works_with_a_served_teacher(tmp_path):
    """HeldOutKL refused a served teacher although it samples and scores; it now measures the same KL as the
    in-process teacher it serves (whole vocabulary: top_k -1)."""
    from kdlab.callbacks import HeldOutKL
    from kdlab.rollouts.loopback import LoopbackServer
    from kdlab.rollouts.served import ServedTeacher

    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        m = module(Served(ServedTeacher(server.url, "tiny-teacher", TEACHER, top_k=-1, timeout_s=10.0, retries=0)), rollout=StudentRollouts())
        heldout = HeldOutKL(examples=4, batch_size=4, prefixes="student")
        fit(m, tmp_path, steps=1, callbacks=[heldout])
        assert heldout.before["forward"] > 0
        rollout = m.make_rollout(task().examples("val")[:4], 3, policy=StudentRollouts())
        served = m.divergences(rollout)
    reference = module(TEACHER, rollout=StudentRollouts(), fused_lm_head=False)
    reference.student.load_state_dict(m.student.state_dict())
    local = reference.divergences(rollout)
    assert abs(float(served["kl_forward"]) - float(local["kl_forward"])) < 1e-4


def test_the_style_callback_samples_from_the_student_s_base_teacher(tmp_path):
    """The documented LoRA self-distillation with the style overlay crashed (StopIteration: the base-teacher view has no
    parameters of its own); the callback now asks the teacher source, which samples on the module's device."""
    pytest.importorskip("peft")
    pytest.importorskip("py3langid")
    from kdlab.callbacks import StyleTransfer
    from kdlab.stages.lora import LoraSpec
    from kdlab.teachers import BaseModelTeacher

    m = module(BaseModelTeacher(), rollout=TeacherRollouts(), lora=LoraSpec(r=4, alpha=8))
    style = StyleTransfer([task()], examples=2, max_new_tokens=4)
    fit(m, tmp_path, steps=1, callbacks=[style])  # at fit start: the teacher's share and the student's
    texts = style.sample(m, task(), task().examples("val")[:2], role="teacher")
    assert len(texts) == 2 and 0.0 <= style.teacher_share(m) <= 1.0


def test_kdlab_estimate_counts_every_in_process_teacher():
    """Several teachers' weights all count (the earlier spelling counted none), served and cached ones none."""
    from kdlab.study.estimate import estimate, setup_from_config

    student = {"path": "Qwen/Qwen2.5-1.5B-Instruct", "dtype": "bfloat16"}
    seven = {"path": "Qwen/Qwen2.5-7B-Instruct", "dtype": "bfloat16"}
    model_teacher = {"class_path": "kdlab.teachers.ModelTeacher", "init_args": {"model": seven}}
    served = {"class_path": "kdlab.teachers.Served", "init_args": {"server": {"class_path": "kdlab.rollouts.served.ServedTeacher"}}}
    configs = {
        "one": {"student": student, "teacher": seven},
        "several": {"student": student, "teacher": {"class_path": "kdlab.teachers.Several",
                                                    "init_args": {"teachers": {"a": model_teacher, "b": model_teacher, "c": served}}}},
        "earlier": {"student": student, "teacher": None, "teachers": {"a": {"model": seven}, "b": {"model": seven}, "c": {"cache": "x"}}},
    }
    weights = {}
    for name, model in configs.items():
        terms = estimate(setup_from_config({"model": model, "trainer": {"accelerator": "gpu"}})).terms
        weights[name] = sum(term.bytes for term in terms if term.key.startswith("teacher") and term.key.endswith("weights"))
    assert weights["one"] > 0 and weights["several"] == weights["earlier"] == 2 * weights["one"]


def test_what_a_source_cannot_do_is_refused_naming_the_policy_and_the_source():
    from kdlab.rollouts.mixture import MixtureRollouts
    from kdlab.rollouts.served import ServedTeacher

    served = Served(ServedTeacher("http://127.0.0.1:9", "m", TEACHER, retries=0))
    with pytest.raises(ConfigError, match=r"MixtureRollouts needs a teacher that decodes token by token .*DistillModule.teacher \(Served\)"):
        module(served, rollout=MixtureRollouts(0.0))
    from kdlab.teachers import CachedTeacher

    with pytest.raises(ConfigError, match=r"StudentRollouts needs a teacher that scores any completion .*\(CachedTeacher\)"):
        module(CachedTeacher("never-read.safetensors"), rollout=StudentRollouts())  # refused before the file is opened


# ---- YAML: the new spellings overlay the quickstart, the earlier ones still parse -------------------------
EARLIER = {
    "served": ("model:\n  teacher: null\n  served_teacher:\n    class_path: kdlab.rollouts.served.ServedTeacher\n"
               "    init_args: {url: http://127.0.0.1:9, model: tiny-teacher, tokenizer: kdlab://tiny/teacher}\n", "Served"),
    "several": ("model:\n  teacher: null\n  teachers:\n    a: {model: {path: kdlab://tiny/teacher}}\n"
                "    b: {model: {path: kdlab://tiny/teacher}}\n  teacher_choice: {class_path: kdlab.stages.multi_teacher.Average}\n", "Several"),
}


@pytest.mark.parametrize("overlay, source", [("served_teacher.yaml", "Served"), ("multi_teacher.yaml", "Several"),
                                             ("lora_self_distill.yaml", "BaseModelTeacher"), ("earlier:served", "Served"),
                                             ("earlier:several", "Several")])
def test_committed_overlays_and_the_earlier_spellings_parse_over_the_quickstart(overlay, source, tmp_path, monkeypatch):
    """A teacher source (class_path) overlaid on the quickstart's teacher model ({path: ...}) replaces it (jsonargparse
    alone would merge the two and lose the class), from a file or the command line; the earlier keys still parse,
    with a FutureWarning naming the new spelling."""
    if overlay == "lora_self_distill.yaml":
        pytest.importorskip("peft")
    from kdlab.cli.lightning import run_lightning

    monkeypatch.chdir(tmp_path)
    if overlay.startswith("earlier:"):
        text, _ = EARLIER[overlay.split(":")[1]]
        path = tmp_path / "earlier.yaml"
        path.write_text(text)
    else:
        path = ROOT / "experiments" / "tiny" / overlay
    with pytest.warns(FutureWarning) if overlay.startswith("earlier:") else _no_teacher_warning():
        cli = run_lightning(["fit", f"--config={ROOT / 'experiments/tiny/quickstart.yaml'}", f"--config={path}", "--trainer.max_steps=1",
                             "--trainer.logger=false"], run=False, raise_parse_errors=True)
    assert type(cli.model.teacher_source).__name__ == source


class _no_teacher_warning:
    def __enter__(self):
        import warnings

        self.caught = warnings.catch_warnings(record=True)
        self.records = self.caught.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.caught.__exit__(*exc)
        assert not [r for r in self.records if issubclass(r.category, FutureWarning) and "teacher" in str(r.message)]


def test_a_teacher_class_on_the_command_line_replaces_the_quickstart_teacher_model():
    from kdlab.cli.lightning import teacher_overlays

    quickstart = str(ROOT / "experiments/tiny/quickstart.yaml")
    args = ["fit", f"--config={quickstart}", "--model.teacher=kdlab.teachers.CachedTeacher", "--model.teacher.path=x"]
    assert teacher_overlays(args) == ["fit", f"--config={quickstart}", "--model.teacher=null", *args[2:]]
    assert teacher_overlays(["fit", f"--config={quickstart}", "--model.teacher.path=kdlab://tiny/student"])[2:] == ["--model.teacher.path=kdlab://tiny/student"]


def test_the_served_spellings_train_the_same_with_prefetch_on_and_off(tmp_path):
    """``teacher: Served(server)`` trains exactly what the earlier ``served_teacher: server`` trains, with prefetch on
    and off (teacher-written completions sampled by the server, one request per forward on it)."""
    from kdlab.rollouts.loopback import LoopbackServer
    from kdlab.rollouts.served import ServedTeacher

    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        server.max_batch = 1

        def client(prefetch):
            return ServedTeacher(server.url, "tiny-teacher", TEACHER, timeout_s=10.0, retries=0, backoff_s=0.0, prefetch=prefetch)

        runs = {}
        for name, prefetch in (("new", True), ("new-no-prefetch", False), ("earlier", True)):
            if name == "earlier":
                with pytest.warns(FutureWarning, match="served_teacher is deprecated"):
                    m = module(None, rollout=TeacherRollouts(), served_teacher=client(prefetch))
            else:
                m = module(Served(client(prefetch)), rollout=TeacherRollouts())
            runs[name] = trained(m, tmp_path / name, steps=3)
    loss, weights = runs["new"]
    for name, (other_loss, other_weights) in runs.items():
        assert other_loss == loss and all(torch.equal(a, b) for a, b in zip(weights, other_weights)), name


def test_kdlab_estimate_reads_the_committed_several_teachers_overlay():
    """``kdlab estimate`` parses what ``kdlab fit`` parses (the teacher source overlaid on the quickstart's model) and
    finds both in-process teachers of experiments/tiny/multi_teacher.yaml."""
    from kdlab.cli.estimate import fit_config
    from kdlab.study.estimate import teacher_models

    config = fit_config([f"--config={ROOT / 'experiments/tiny/quickstart.yaml'}", f"--config={ROOT / 'experiments/tiny/multi_teacher.yaml'}"])
    specs, cached = teacher_models(config["model"])
    assert [spec.path for spec in specs] == ["kdlab://tiny/teacher", "kdlab://tiny/student"] and not cached


def test_a_served_teacher_writes_the_evaluation_completions_an_in_process_one_writes(tmp_path):
    """The evaluating callbacks' teacher samples (``TeacherSource.texts``) from a served teacher: greedy, they are the
    in-process teacher's texts."""
    from kdlab.rollouts.loopback import LoopbackServer
    from kdlab.rollouts.served import ServedTeacher

    examples = task().examples("val")[:3]
    local = module(TEACHER, rollout=TeacherRollouts()).teacher_source
    expected = local.texts(task(), examples, torch.device("cpu"), temperature=0.0, max_new_tokens=6, batch_size=4)
    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        source = module(Served(ServedTeacher(server.url, "tiny-teacher", TEACHER, timeout_s=10.0, retries=0)), rollout=TeacherRollouts()).teacher_source
        served = source.texts(task(), examples, torch.device("cpu"), temperature=0.0, max_new_tokens=6, batch_size=4)
    assert served == expected and all(isinstance(text, str) for text in served)
