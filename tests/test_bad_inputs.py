"""Rows of docs/bad_inputs.md not covered next to their feature: each bad input fails early, naming
the key, file or row."""

from pathlib import Path

import pytest

from kdlab.cli import main
from kdlab.rollouts import TeacherRollouts

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
    with pytest.raises(ValueError, match="TeacherRollouts.dataset .*holds no completions"):
        TeacherRollouts(dataset=str(empty))


def test_resuming_with_a_different_student_fails_before_any_step(tmp_path):
    cli = fit(tmp_path / "first")
    checkpoint = Path(cli.trainer.log_dir, "checkpoints", "final.ckpt")
    with pytest.raises(RuntimeError, match="does not fit this student .*student.path='kdlab://tiny/student'"):
        fit(tmp_path / "second", "--model.student.path=kdlab://tiny/student", "--model.teacher.path=kdlab://tiny/teacher",
            f"--ckpt_path={checkpoint}")


def test_the_bad_inputs_table_has_15_rows_and_names_only_tests_that_exist():
    import re

    root = Path(__file__).parents[1]
    text = (root / "docs" / "bad_inputs.md").read_text(encoding="utf-8")
    assert len(re.findall(r"^\| \d+ \|", text, flags=re.M)) >= 15
    for file, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        assert f"def {name}(" in (root / file).read_text(encoding="utf-8"), f"{file}::{name}"
