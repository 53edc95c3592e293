"""No data lost (issue #41 item 6): a torn last line of metrics.jsonl is skipped with a warning naming the
file, not a run dropped from the report; ``kdlab://`` and ``pkg://`` paths stay inside what they name. (A sweep
moves an unresumable run aside: tests/test_sweep.py::test_a_rerun_resumes_from_the_newest_full_state_never_final.)"""

from __future__ import annotations

import json

import pytest

from kdlab.models.loading import ASSETS, resolve_path
from kdlab.study.runs import read_metrics


def test_a_torn_last_metrics_line_is_skipped_with_a_warning_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "train/loss": 2.0, "epoch": 0}) + "\n" + json.dumps({"step": 2, "train/loss": 1.5, "epoch": 0})
                    + "\n" + '{"step": 3, "train/lo')
    with pytest.warns(UserWarning, match=rf"{path}: its last line is torn"):
        metrics = read_metrics(tmp_path)
    assert metrics["train/loss"] == [(2, 2.0), (3, 1.5)]  # unmarked Lightning lines: at the optimiser step, one on
    path.write_text('{"step": 1, "train/lo\n' + json.dumps({"step": 2, "train/loss": 1.5, "epoch": 0}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}: line 1 is not JSON"):  # only the last line may be torn
        read_metrics(tmp_path)


@pytest.mark.parametrize("path", ["kdlab://../..", "kdlab://tiny/../../../etc", "kdlab:///etc/passwd", "pkg://kdlab/../../etc"])
def test_packaged_paths_stay_inside_what_they_name(path):
    with pytest.raises(ValueError, match=rf"model.path '{path}': leaves "):
        resolve_path(path, "model.path")
    assert resolve_path("kdlab://tiny/teacher") == str(ASSETS / "tiny" / "teacher")


def test_a_report_imports_no_module_a_run_config_names_outside_kdlab(tmp_path, monkeypatch):
    """Reading a run's settings looks up class defaults; a config naming another package's module (someone's
    archive) does not get that module imported: importing it would run its code."""
    import sys

    from kdlab.study.runs import class_defaults

    (tmp_path / "kdlab_planted_module.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').write_text('x')\n"
                                                      "class Thing:\n    def __init__(self, a=1):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert class_defaults("kdlab_planted_module.Thing") == {}
    assert "kdlab_planted_module" not in sys.modules and not (tmp_path / "ran").exists()
    assert class_defaults("kdlab.objectives.ForwardKL")  # kdlab's own classes still give their defaults
