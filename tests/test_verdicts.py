"""The study's verdicts (kdlab.study.verdicts): hand-made study folders with known per-sample scores, so each
verdict's effect, interval and word are known in advance."""

import json
import math
from pathlib import Path

import pytest
import yaml

from kdlab.study.runs import collect
from kdlab.study.stats import bootstrap_contrast
from kdlab.study.verdicts import (
    NOT_DISTINGUISHABLE,
    NOT_REPRODUCED,
    NOT_RUN,
    REPRODUCED,
    Study,
    forgetting,
    is_study,
    on_policy_advantage,
    scalar_effect,
    write_verdicts,
)

ROLLOUTS = {"OffPD": "TeacherRollouts", "OnPD": "StudentRollouts"}
OBJECTIVES = {"forward": "ForwardKL", "reverse": "ReverseKL"}
PROBLEMS = 60


def make_run(folder: Path, kind: str, direction: str, lr: float, seed: int, correct: float, metrics: dict, samples: int = 4) -> Path:
    """A finished run: config, DONE, metrics and a samples file where a ``correct`` share of the problems
    (the first ones) is solved by every sample."""
    run = folder / f"{kind}-{direction}-{lr}-{seed}"
    run.mkdir(parents=True)
    config = {"seed_everything": seed, "trainer": {"max_steps": 150},
              "model": {"task": {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}},
                        "rollout": {"class_path": f"kdlab.rollouts.{ROLLOUTS[kind]}"},
                        "objective": {"class_path": f"kdlab.objectives.{OBJECTIVES[direction]}"}, "lr": lr}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "DONE").write_text(json.dumps({"seconds": 60.0}))
    solved = round(correct * PROBLEMS)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 149, "val/accuracy": solved / PROBLEMS, **metrics}) + "\n")
    (run / "samples").mkdir()
    lines = [json.dumps({"id": f"p{i}", "score": float(i < solved)}) for i in range(PROBLEMS) for _ in range(samples)]
    (run / "samples" / "val-step000150.jsonl").write_text("\n".join(lines) + "\n")
    return run


def make_grid(root: Path, accuracy, ood) -> None:
    """``root/distill`` with ``accuracy(kind, direction, level, seed)`` and ``ood(level, seed)``."""
    (root / "distill").mkdir(parents=True)
    (root / "distill" / "sweep.json").write_text(json.dumps({"sweep": "experiments/tiny/grid.yaml"}))
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            for level, lr in (("low", 1e-4), ("high", 2e-3)):
                for seed in (42, 43, 44):
                    make_run(root / "distill", kind, direction, lr, seed, accuracy(kind, direction, level, seed),
                             {"ood/mean_delta": ood(level, seed)})


def study(root: Path) -> Study:
    runs, _ = collect([root])
    return Study(root, runs)


def test_bootstrap_contrast_is_paired_and_centred():
    easy_hard = {f"p{i}": [float(i < 30)] * 4 for i in range(60)}  # the same problems solved in both
    value, low, high = bootstrap_contrast([(1.0, [easy_hard]), (-1.0, [easy_hard])])
    assert (value, low, high) == (0.0, 0.0, 0.0)  # paired: the problems' difficulty cancels exactly
    better = {f"p{i}": [float(i < 45)] * 4 for i in range(60)}
    value, low, high = bootstrap_contrast([(1.0, [better]), (-1.0, [easy_hard])])
    assert value == pytest.approx(0.25) and 0.1 < low < 0.25 < high < 0.4
    unpaired = bootstrap_contrast([(1.0, [better]), (-1.0, [{f"q{i}": v for i, v in enumerate(easy_hard.values())}])])
    assert unpaired[2] - unpaired[1] > high - low  # independent draws: a wider interval for the same means


def test_scalar_effect_is_a_t_interval_over_seeds(tmp_path):
    make_grid(tmp_path, lambda *a: 0.5, lambda level, seed: {42: 1.0, 43: 2.0, 44: 3.0}[seed])
    cell = study(tmp_path).cell("distill", "OffPD", "forward", "low")
    effect = scalar_effect([(1.0, cell)], "ood/mean_delta")
    assert effect.value == pytest.approx(2.0)
    assert effect.high - effect.value == pytest.approx(4.303 / math.sqrt(3))  # t(0.975, 2) * s / sqrt(n), s = 1


def test_a_consistent_on_policy_edge_is_not_the_paper(tmp_path):
    make_grid(tmp_path, lambda kind, *a: 0.7 if kind == "OnPD" else 0.3, lambda *a: 0.0)
    verdict = on_policy_advantage(study(tmp_path))
    assert verdict.verdict == NOT_REPRODUCED
    assert verdict.tiny.count("+40.0 [") == 4  # each (KL, LR) cell: OnPD - OffPD = 40 points, interval beside it


def test_equal_policies_reproduce_no_consistent_edge(tmp_path):
    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    verdict = on_policy_advantage(study(tmp_path))
    assert verdict.verdict.startswith(REPRODUCED) and "no cell's difference is beyond its interval" in verdict.verdict
    assert verdict.command == "kdlab sweep --config experiments/tiny/grid.yaml"


def test_forgetting_needs_the_high_lr_drop_beyond_its_interval(tmp_path):
    noisy = {42: -20.0, 43: 0.0, 44: 20.0}
    make_grid(tmp_path / "clear", lambda *a: 0.5, lambda level, seed: -15.0 + seed - 43 if level == "high" else 0.1 * (seed - 43))
    make_grid(tmp_path / "noisy", lambda *a: 0.5, lambda level, seed: noisy[seed] - 1.0 if level == "high" else 0.0)
    assert forgetting(study(tmp_path / "clear")).verdict == REPRODUCED
    assert forgetting(study(tmp_path / "noisy")).verdict == NOT_DISTINGUISHABLE


def test_report_writes_the_verdicts_and_sums_wall_time(tmp_path, capsys):
    from kdlab.study.report import main

    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    assert is_study(tmp_path) and not is_study(tmp_path / "distill")
    (tmp_path / "wall_times.jsonl").write_text(
        "".join(json.dumps({"step": step, "seconds": s, "command": f"kdlab sweep {step}"}) + "\n"
                for step, s in (("grid", 600), ("rlvr", 300), ("grid", 60))))
    main([str(tmp_path), "--output", str(tmp_path / "out")])
    text = (tmp_path / "out" / "verdicts.md").read_text()
    verdicts, wall = text.split("## Wall time")
    assert verdicts.count("\n| ") == 2 + 8 and wall.count("\n| ") == 2 + 2  # header, rule, then 8 findings / 2 steps
    assert "| grid | 11.0 |" in text and "Whole study: 16.0 min of wall time; 24.0 min summed" in text
    rows = (tmp_path / "out" / "verdicts.csv").read_text().splitlines()
    assert len(rows) == 9
    import csv

    runs = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    assert len(runs) == 24 and {r["fit_seconds"] for r in runs} == {"60.0"}  # each run's DONE summary


def test_verdicts_without_their_runs_say_not_run(tmp_path):
    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    runs, _ = collect([tmp_path])
    verdicts = write_verdicts(tmp_path, runs, tmp_path / "out")
    by_finding = {v.finding: v for v in verdicts}
    hard = next(v for f, v in by_finding.items() if "pass@k" in f)
    assert hard.verdict == NOT_RUN and hard.evidence.startswith("no runs in")
    sparsity = next(v for f, v in by_finding.items() if f.startswith("Updates are sparse"))
    assert sparsity.verdict == NOT_RUN  # its bf16 runs are missing, though the fp32 grid is there
