"""The verdicts' labels do not depend on the problems bootstrap's random numbers (the only ones a report draws): every row's label is the same under ten
RNG seeds, on a made-up grid (every tier) and on the committed study's runs (the slow tier)."""

import tarfile
from pathlib import Path

import numpy as np
import pytest

from kdlab.study import effects
from kdlab.study.runs import collect
from kdlab.study.verdicts import FINDINGS, PRECISION_FINDINGS, Study, with_bf16

ROOT = Path(__file__).resolve().parents[1]


def labels_under(study: Study, rng_seed: int, monkeypatch) -> list[str]:
    monkeypatch.setattr(effects, "SEED", rng_seed)
    monkeypatch.setattr(effects, "PROBLEM_DRAWS", 100)  # the problems interval is shown, never labelled
    study._groups.clear()
    return [(with_bf16(f, study) if f in PRECISION_FINDINGS else f(study)).verdict for f in FINDINGS]


def test_labels_of_a_made_up_grid_do_not_move_with_the_rng(tmp_path, monkeypatch):
    """Six seeds per cell, an OnPD edge of about 2 points that varies by seed."""
    from test_verdicts import make_run

    rng = np.random.default_rng(0)
    for kind in ("OffPD", "OnPD"):
        for direction in ("forward", "reverse"):
            for level, lr in (("low", 1e-4), ("high", 5e-4)):
                for seed in range(42, 48):
                    correct = 0.5 + (0.02 + rng.normal(0, 0.02) if kind == "OnPD" else 0.0) + 0.01 * (seed - 45)
                    make_run(tmp_path / "distill", kind, direction, lr, seed, correct, {"ood/mean_delta": rng.normal(-1, 0.5)})
    (tmp_path / "distill" / "sweep.json").write_text('{"sweep": "experiments/tiny/grid_5x.yaml"}')
    runs, _ = collect([tmp_path])
    study = Study(tmp_path, runs)
    first = labels_under(study, 0, monkeypatch)
    assert "paired seeds x problems, 6 seeds" in effects.accuracy_effect(
        [(1.0, study.cell("distill", "OnPD", "forward", "low")), (-1.0, study.cell("distill", "OffPD", "forward", "low"))]).how
    assert all(labels_under(study, seed, monkeypatch) == first for seed in range(1, 10))


@pytest.mark.slow
def test_labels_of_the_committed_study_do_not_move_with_the_rng(tmp_path, monkeypatch):
    for archive in sorted((ROOT / "experiments" / "tiny" / "study_runs").glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path, filter="data")
    root = tmp_path / "runs" / "tiny-study-5x"
    runs, _ = collect([root])
    study = Study(root, runs)
    first = labels_under(study, 0, monkeypatch)
    for seed in range(1, 10):
        assert labels_under(study, seed, monkeypatch) == first, seed
