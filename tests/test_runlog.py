"""kdlab.runlog: one logger (MetricsFile) carries every number of a run into metrics.jsonl."""

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from kdlab.callbacks import UpdateSparsity
from kdlab.runlog import MetricsFile, log_metrics, metrics_file
from kdlab.stages import DistillModule
from kdlab.study.runs import read_metrics
from kdlab.tasks import Addition


def small_fit(tiny_pair, tmp_path, logger):
    model = DistillModule(*tiny_pair, Addition(num_train=8, num_val=2), max_completion_tokens=4, batch_size=4, val_examples=2)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=logger, default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1, val_check_interval=2, num_sanity_val_steps=0,
                         enable_checkpointing=False, callbacks=[UpdateSparsity(every_n_steps=1)])
    trainer.fit(model)
    return trainer


def test_every_tensorboard_scalar_is_in_metrics_jsonl_at_the_same_step(tiny_pair, tmp_path):
    """``self.log`` values (train/*, val/*) and a callback's numbers (sparsity/*) reach the one file, so
    the report needs nothing else: each TensorBoard point is a metrics.jsonl point (float32 apart), except
    Lightning's ``epoch``, which is no metric."""
    trainer = small_fit(tiny_pair, tmp_path, TensorBoardLogger(tmp_path, name="run"))
    assert sum(isinstance(logger, MetricsFile) for logger in trainer.loggers) == 1
    events = EventAccumulator(trainer.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    board = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    metrics = read_metrics(trainer.log_dir)
    assert {"train/loss", "val/accuracy", "sparsity/1e-06"} <= set(board)
    assert set(metrics) == set(board) - {"epoch"}
    for tag, points in board.items():
        if tag == "epoch":
            continue
        last = dict(points)  # at one step (epoch after a train and a val line) the later point wins
        assert [step for step, _ in metrics[tag]] == sorted(last), tag
        assert [value for _, value in metrics[tag]] == pytest.approx([last[step] for step in sorted(last)], rel=1e-6), tag


def test_without_a_logger_the_metrics_file_is_in_default_root_dir(tiny_pair, tmp_path):
    """``logger=False``: no TensorBoard, but the run's numbers still land in ``default_root_dir``."""
    trainer = small_fit(tiny_pair, tmp_path, False)
    assert Path(trainer.log_dir) == tmp_path
    assert {"train/loss", "sparsity/1e-06"} <= set(read_metrics(tmp_path))


def test_log_metrics_writes_its_line_at_once_and_attaches_one_file(tmp_path):
    """A killed run loses nothing it logged: the line is on disk when log_metrics returns; a second call
    reuses the same MetricsFile."""
    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    log_metrics(trainer, {"a/b": 1.5}, step=3)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "a/b": 1.5}
    log_metrics(trainer, {"a/b": 2}, step=4)
    assert [logger for logger in trainer.loggers if isinstance(logger, MetricsFile)] == [metrics_file(trainer)]
    assert read_metrics(tmp_path) == {"a/b": [(3, 1.5), (4, 2.0)]}


def test_a_line_without_a_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a step"):
        MetricsFile(tmp_path).log_metrics({"a": 1.0})


# ---- one step convention ------------------------------------------------------------------------
SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")


def test_tensorboard_metrics_jsonl_callbacks_and_the_summary_name_the_same_steps(tmp_path, monkeypatch, capsys):
    """After N optimiser steps every source says step N: TensorBoard's scalars (Lightning's own and a
    callback's), metrics.jsonl's lines as written, the samples file of the validation, and the end
    summary. Lightning by itself records its self.log lines one lower (val/accuracy of step 2 at 1)."""
    from kdlab.cli.main import main

    monkeypatch.setattr("sys.argv", ["kdlab"])
    main(["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=4",
          "--trainer.val_check_interval=4", "--trainer.log_every_n_steps=2",  # 2 micro-batches a step: validation at steps 2 and 4
          "--trainer.callbacks+=kdlab.callbacks.UpdateSparsity", "--trainer.callbacks.every_n_steps=2"])
    run_dir = tmp_path / "tiny-smoke" / "version_0"
    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})
    events.Reload()
    board = {tag: sorted({e.step for e in events.Scalars(tag)}) for tag in ("train/loss", "val/accuracy", "val/pass@1", "sparsity/1e-06")}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    written = {tag: sorted({row["step"] for row in lines if tag in row}) for tag in board}
    samples = sorted(path.name for path in (run_dir / "samples").glob("*.jsonl"))
    out = capsys.readouterr().out
    assert board == written == {"train/loss": [2, 4], "val/accuracy": [2, 4], "val/pass@1": [2, 4], "sparsity/1e-06": [2, 4]}
    assert samples == ["val-step000002.jsonl", "val-step000004.jsonl"]
    assert "  val/accuracy: 0.0% at step 2 -> 0.0% at step 4  (" in out and " at step 2 -> " in out.split("  train/loss: ")[1].splitlines()[0]
    assert all(row.get("steps") == "optimiser" for row in lines if "epoch" in row)  # what tells them from an older run's


def test_old_and_new_metrics_files_read_at_the_same_optimiser_steps(tmp_path):
    """A run written before kdlab logged at optimiser steps (Lightning's lines one lower, unmarked) and one
    written after (marked) read the same with optimiser_steps=True; as recorded, each keeps its own."""
    from kdlab.runlog import metrics_lines

    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text('{"step": 149, "val/accuracy": 0.4, "epoch": 0.0}\n{"step": 150, "ood/mean": 99.0}\n')
    new.write_text('{"step": 150, "val/accuracy": 0.4, "epoch": 0.0, "steps": "optimiser"}\n{"step": 150, "ood/mean": 99.0}\n')
    assert list(metrics_lines(old, optimiser_steps=True)) == list(metrics_lines(new, optimiser_steps=True)) == [
        (150, "val/accuracy", 0.4), (150, "ood/mean", 99.0)]
    assert [step for step, name, _ in metrics_lines(old) if name == "val/accuracy"] == [149]
    assert [(step, name) for step, name, _ in metrics_lines(new)] == [(150, "val/accuracy"), (150, "epoch"), (150, "ood/mean")]


def test_trimming_rewrites_metrics_jsonl_through_a_temporary_file(tmp_path, monkeypatch):
    """Issue 41 item 6: a resume's rewrite of metrics.jsonl cannot leave half a file: it writes a
    temporary file and renames it over the old one; interrupted before the rename, the old file stays."""
    import time

    from kdlab.cli.resume import trim_logs

    run = tmp_path / "run"
    run.mkdir()
    head = '{"step": 2, "train/loss": 1.0, "epoch": 0.0, "steps": "optimiser"}\n'
    tail = '{"step": 2, "val/accuracy": 0.5, "epoch": 0.0, "steps": "optimiser"}\n{"step": 3, "train/loss": 0.9, "epoch": 0.0, "steps": "optimiser"}\n'
    (run / "metrics.jsonl").write_text(head + tail)
    position = {"step": 2, "global_step": 2, "time": time.time() - 60, "metrics_bytes": len(head), "steps": "optimiser"}

    def interrupted(self, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trim_logs(run, position)
    assert (run / "metrics.jsonl").read_text() == head + tail  # untouched
    monkeypatch.undo()
    assert trim_logs(run, position)["metrics_lines"] == 1  # step 3 is after the checkpoint; step 2's validation stays
    assert (run / "metrics.jsonl").read_text() == head + tail.splitlines(keepends=True)[0]
    assert sorted(path.name for path in run.iterdir()) == ["metrics.jsonl"]


def logged_names() -> tuple[set[str], list[str]]:
    """The metric names the stages, callbacks and evaluations can log, read from their source: every string that looks
    like ``stage/metric`` (``"rlvr/reward_mean"``), and every f-string with literal text beside its ``/`` as a regular
    expression (``f"{split}/pass@{k}"`` -> ``.+/pass@.+``; ``f"coverage/{self.name}/pass@{k}"``); an f-string that is all
    placeholders (``f"{split}/{name}"``) says nothing and is left out."""
    import ast
    import re

    root = Path(__file__).parents[1] / "kdlab"
    names, patterns = set(), []
    for folder in ("stages", "callbacks", "evaluation", "rollouts", "objectives", "teachers"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[a-z_]+/[\w@.]+", node.value):
                    names.add(node.value)
                elif isinstance(node, ast.JoinedStr):
                    parts = [re.escape(p.value) if isinstance(p, ast.Constant) else ".+" for p in node.values]
                    literal = "".join(p.value for p in node.values if isinstance(p, ast.Constant))
                    if "/" in literal and re.search(r"\w", literal) and " " not in literal:
                        patterns.append("".join(parts))
    return names, patterns


def test_every_summary_description_matches_a_metric_name_kdlab_logs():
    """A DESCRIPTIONS key no metric has is a summary line that never appears: ``rlvr/reward`` (GRPO logs
    ``rlvr/reward_mean``) left every RLVR run's summary without its reward. A key ending in ``/`` or ``@`` is a prefix."""
    import re

    from kdlab.runlog import DESCRIPTIONS, describe

    names, patterns = logged_names()
    assert "rlvr/reward_mean" in names and any(re.fullmatch(p, "val/pass@4") for p in patterns)  # the scan finds both kinds
    examples = names | {re.sub(r"\.\+", "x", p).replace("\\", "") for p in patterns}  # coverage/x/pass@x
    for key in DESCRIPTIONS:
        if key.endswith(("/", "@")):
            found = any(re.fullmatch(p, key + "x") for p in patterns) or any(name.startswith(key) for name in examples)
        else:
            found = key in names or any(re.fullmatch(p, key) for p in patterns)
        assert found, f"DESCRIPTIONS[{key!r}] matches no metric name kdlab logs"
    assert describe("rlvr/reward_mean") == "RLVR: mean reward of the step's rollouts"


def test_the_quickstart_says_lightnings_values_are_at_the_optimiser_step_the_test_above_measures():
    """docs/quickstart.md said Lightning's self.log values were recorded "at its logger step, which is one lower"
    (val/accuracy of step 150 at 149); kdlab records them at the optimiser step (the test above), so the page says so
    and cites it."""
    text = " ".join((Path(__file__).parents[1] / "docs" / "quickstart.md").read_text(encoding="utf-8").split())
    paragraph = text.split("Steps are counted in optimiser steps everywhere")[1].split("Run directories")[0]
    assert "one lower" not in paragraph and "149" not in paragraph
    assert "tests/test_runlog.py::test_tensorboard_metrics_jsonl_callbacks_and_the_summary_name_the_same_steps" in paragraph
