"""``kdlab report``: hand-made run directories with known numbers -> Markdown, CSV, PNG and TensorBoard."""

import csv
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from kdlab.cli.main import main
from kdlab.study.groups import group_runs, lr_levels
from kdlab.study.runs import collect


ADDITION = {"class_path": "kdlab.tasks.Addition", "init_args": {"num_train": 64}}
COUNTDOWN3 = {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}}  # the paper's task


def make_run(root, name, rollout, objective, lr, seed, rows=(), lam=None, max_steps=4, rollout_args=None, task=ADDITION, callbacks=None):
    run_dir = Path(root, name)
    run_dir.mkdir(parents=True)
    rollout_config = {"class_path": f"kdlab.rollouts.{rollout}"}
    if lam is not None:
        rollout_config["init_args"] = {"lam": lam, "alpha": 0.2}
    if rollout_args is not None:
        rollout_config["init_args"] = rollout_args
    config = {
        "seed_everything": seed,
        "trainer": {"max_steps": max_steps, "logger": {"class_path": "TensorBoardLogger", "init_args": {"save_dir": str(root), "name": name}}},
        "model": {
            "student": {"path": "kdlab://tiny-random/student"},
            "task": task,
            "rollout": rollout_config,
            "objective": {"class_path": f"kdlab.objectives.{objective}"},
            "lr": lr,
        },
    }
    if callbacks is not None:
        config["trainer"]["callbacks"] = callbacks
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def reward_curve(scale):
    return [{"step": step, "rlvr/reward": scale * step} for step in range(5)]


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    make_run = functools.partial(globals()["make_run"], task=COUNTDOWN3)  # the paper's task: its numbers apply
    # OffPD forward KL at the low LR, two seeds: accuracy 0.6 / 0.8 (the earlier 0.5 is not the last value)
    make_run(root, "off-fkl-42", "TeacherRollouts", "ForwardKL", 1e-3, 42, [
        {"step": 2, "val/accuracy": 0.5},
        {"step": 4, "val/accuracy": 0.6, "ood/mean_delta": -1.0, "sparsity/1e-06": 0.9},
    ])
    make_run(root, "off-fkl-43", "TeacherRollouts", "ForwardKL", 1e-3, 43, [
        {"step": 4, "val/accuracy": 0.8, "ood/mean_delta": -3.0, "sparsity/1e-06": 0.7},
    ])
    # OnPD reverse KL at the high LR: a later line wins at the same step, and the last step wins
    make_run(root, "on-rkl-42", "StudentRollouts", "ReverseKL", 5e-3, 42, [
        {"step": 3, "val/accuracy": 0.3, "sparsity/1e-06": 0.55},
        {"step": 3, "val/accuracy": 0.25, "epoch": 0.0},
        {"step": 5, "val/accuracy": 0.4, "epoch": 0.0},
    ])
    # the rollout spectrum, with pass@k, style and RLVR curves
    make_run(root, "mix-neg", "MixtureRollouts", "ForwardKL", 1e-3, 42, [
        {"step": 4, "val/accuracy": 0.5, "val/pass@1": 0.3, "val/pass@10": 0.6, "coverage/countdown4e/pass@1": 0.2, "style/spanish_share": 0.9},
        *reward_curve(0.5),
    ], lam=-0.5)
    make_run(root, "mix-pos", "MixtureRollouts", "ForwardKL", 1e-3, 42, [
        {"step": 4, "val/accuracy": 0.7, "val/pass@1": 0.4, "val/pass@10": 0.8, "style/spanish_share": 0.1},
        *reward_curve(1.0),
    ], lam=0.5)
    no_config = root / "crashed-before-config"
    no_config.mkdir()
    (no_config / "metrics.jsonl").write_text('{"step": 1, "val/accuracy": 1.0}\n')
    return root


def markdown_table(text, heading):
    """The first table after ``heading`` as a list of {column: cell} (the paper column names repeat)."""
    lines = iter(text.split(heading, 1)[1].splitlines())
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), itertools.dropwhile(lambda line: not line.startswith("|"), lines)))
    def split(line):
        return [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]

    header = split(lines[0])
    header = [f"{h} {header[i - 1]}" if h == "paper" else h for i, h in enumerate(header)]
    return [dict(zip(header, split(line))) for line in lines[2:]]


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_report_tables_figures_and_paper_numbers(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])
    out = tmp_path / "report"
    main(["report", *sorted(str(p) for p in runs.iterdir()), "--output", str(out)])
    err = capsys.readouterr().err
    assert "skipped" in err and "crashed-before-config" in err and "no config.yaml" in err
    text = (out / "report.md").read_text()
    assert "crashed-before-config`: no config.yaml" in text
    assert "0.001 = low, 0.005 = high" in text

    rows = {(r["rollout"], r["objective"]): r for r in markdown_table(text, "## Results by configuration")}
    off = rows["TeacherRollouts", "ForwardKL"]
    # by hand: accuracy mean (0.6 + 0.8) / 2 = 70%, sample std sqrt(2 * 0.1^2 / 1) = 14.14%; ood -2.0 +- 1.41
    assert (off["n"], off["lr level"]) == ("2", "low")
    assert off["val/accuracy (%)"] == "70.0 ± 14.1"
    assert off["ood/mean_delta (points)"] == "-2.0 ± 1.4"
    assert off["sparsity/1e-06 (%)"] == "80.0 ± 14.1"
    assert off["paper val/accuracy (%)"] == "73 [P2]; 71-73 [P3]"
    assert off["paper ood/mean_delta (points)"] == "|change| <= 1.3 [P5]"
    assert off["paper sparsity/1e-06 (%)"] == "85.3-89.6 [P7]"
    on = rows["StudentRollouts", "ReverseKL"]
    assert (on["n"], on["lr level"], on["val/accuracy (%)"], on["sparsity/1e-06 (%)"]) == ("1", "high", "40.0", "55.0")
    assert on["ood/mean_delta (points)"] == ""  # not measured: left out
    assert on["paper val/accuracy (%)"] == "72 [P1]; 35-72 [P4]"
    assert on["paper ood/mean_delta (points)"] == "-14.0 to -11.2 [P6]"
    assert on["paper sparsity/1e-06 (%)"] == "51.9-60.0 [P8]"
    mixture = rows["MixtureRollouts (lam=-0.5)", "ForwardKL"]
    assert mixture["val/accuracy (%)"] == "50.0" and mixture["paper val/accuracy (%)"] == ""  # not in the paper's grid
    for line in ("Best mean accuracy: OnPD 72% vs OffPD 73%", "reverse KL 35-72%", "at 5e-5 drops of 11.2-14.0 points", "85.3-89.6% at 1e-5"):
        assert line in text

    summary = {(r["rollout"], r["objective"]): r for r in read_csv(out / "summary.csv")}
    raw = summary["TeacherRollouts", "ForwardKL"]  # the units the runs logged
    assert math.isclose(float(raw["val/accuracy mean"]), 0.7)
    assert math.isclose(float(raw["val/accuracy std"]), math.sqrt(0.02))
    assert math.isclose(float(raw["ood/mean_delta mean"]), -2.0) and raw["val/accuracy n"] == "2"
    assert math.isclose(float(summary["StudentRollouts", "ReverseKL"]["val/accuracy mean"]), 0.4, rel_tol=1e-6)

    spectrum = {r["lam"]: r for r in read_csv(out / "spectrum.csv")}
    assert set(spectrum) == {"-0.5", "0.5"} and math.isclose(float(spectrum["0.5"]["val/accuracy mean"]), 0.7)
    assert "| -0.5 | 50.0 (n=1) |" in text and "| 0.5 | 70.0 (n=1) |" in text
    passes = markdown_table(text, "## pass@k")
    assert list(passes[0])[-3:] == ["val/pass@1 (%)", "val/pass@10 (%)", "coverage/countdown4e/pass@1 (%)"]
    assert {(r["rollout"], r["val/pass@10 (%)"]) for r in passes} == {("MixtureRollouts (lam=-0.5)", "60.0"), ("MixtureRollouts (lam=0.5)", "80.0")}
    style = {r["rollout"]: (r["style/spanish_share (%)"], r["val/accuracy (%)"]) for r in markdown_table(text, "## Style transfer")}
    assert style == {"MixtureRollouts (lam=-0.5)": ("90.0", "50.0"), "MixtureRollouts (lam=0.5)": ("10.0", "70.0")}  # accuracy beside
    curves = read_csv(out / "rlvr_curves.csv")
    assert len(curves) == 10 and {float(r["value"]) for r in curves if r["lam"] == "0.5"} == {0.0, 1.0, 2.0, 3.0, 4.0}
    assert len(read_csv(out / "runs.csv")) == 5

    for name in ("accuracy", "spectrum-countdown3", "pass_at_k-countdown3", "rlvr-reward"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"![{name}]({name}.png)" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = (out / "tensorboard").glob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert {"report/accuracy", "report/spectrum-countdown3", "report/rlvr-reward"} <= set(events.Tags()["images"])


def test_a_sweep_directory_stands_for_its_runs_and_lr_levels_can_be_given(runs, tmp_path):
    (runs / "sweep.json").write_text("{}")
    found, skipped = collect([runs])
    assert len(found) == 5 and [Path(p).name for p, _ in skipped] == ["crashed-before-config"]
    main(["report", str(runs), "--output", str(tmp_path / "out"), "--low_lr", "0.005", "--high_lr", "0.001"])
    rows = {r["rollout"]: r for r in markdown_table((tmp_path / "out" / "report.md").read_text(), "## Results by configuration")}
    assert rows["StudentRollouts"]["lr level"] == "low" and rows["StudentRollouts"]["paper sparsity/1e-06 (%)"] == "85.3-89.6 [P7]"


def test_lr_levels():
    assert lr_levels({1e-3, 5e-3}) == {1e-3: "low", 5e-3: "high"}
    assert lr_levels({1e-5, 2e-5, 5e-5}) == {1e-5: "low", 5e-5: "high"}  # more than two: the paper's own rates only
    assert lr_levels({1e-4}) == {}
    assert lr_levels({1e-4, 3e-4, 1e-3}, low=[1e-4, 3e-4], high=[1e-3]) == {1e-4: "low", 3e-4: "low", 1e-3: "high"}


def test_settings_beyond_the_columns_are_not_averaged_together(tmp_path):
    make_run(tmp_path, "a", "TeacherRollouts", "ForwardKL", 1e-3, 42, [{"step": 4, "val/accuracy": 0.2}])
    make_run(tmp_path, "b", "TeacherRollouts", "ForwardKL", 1e-3, 43, [{"step": 4, "val/accuracy": 0.4}])
    make_run(tmp_path, "c", "TeacherRollouts", "ForwardKL", 1e-3, 42, [{"step": 8, "val/accuracy": 0.9}], max_steps=8)
    make_run(tmp_path, "d", "StudentRollouts", "ForwardKL", 1e-3, 42)  # other class, other init_args: not a difference
    found, _ = collect(sorted(tmp_path.iterdir()))
    groups = group_runs(found, {})
    assert [(g.rollout, g.other, len(g.runs)) for g in groups] == [
        ("TeacherRollouts", "max_steps=4", 2),
        ("TeacherRollouts", "max_steps=8", 1),
        ("StudentRollouts", "max_steps=4", 1),
    ]
    assert groups[0].stats("val/accuracy")[:2] == pytest.approx((0.3, math.sqrt(0.02)))


def test_teacher_dataset_and_cache_runs_are_reported_under_the_class_they_built(tmp_path, capsys):
    """kdlab 0.1's TeacherRollouts(dataset=..., teacher_cache=...) built what TeacherDatasetRollouts and
    CachedTeacherRollouts build now: a report names each run by the class it built, a run of each spelling
    of one setting is one configuration (two seeds), and all three teacher policies are OffPD."""
    from kdlab.study.runs import read_run

    data = {"dataset": "data/teacher.jsonl"}
    cache = {**data, "teacher_cache": "data/teacher.jsonl.topk.safetensors"}
    make_run(tmp_path, "old", "TeacherRollouts", "ForwardKL", 1e-3, 42, [{"step": 4, "val/accuracy": 0.2}], rollout_args={**data, "teacher_cache": None})
    make_run(tmp_path, "new", "TeacherDatasetRollouts", "ForwardKL", 1e-3, 43, [{"step": 4, "val/accuracy": 0.4}], rollout_args=data)
    make_run(tmp_path, "old-cached", "TeacherRollouts", "ForwardKL", 1e-3, 42, [{"step": 4, "val/accuracy": 0.6}], rollout_args=cache)
    make_run(tmp_path, "cached", "CachedTeacherRollouts", "ForwardKL", 1e-3, 43, [{"step": 4, "val/accuracy": 0.8}], rollout_args=cache)
    make_run(tmp_path, "online", "TeacherRollouts", "ForwardKL", 1e-3, 42, [{"step": 4, "val/accuracy": 0.1}])
    make_run(tmp_path, "on", "StudentRollouts", "ForwardKL", 1e-3, 42, [{"step": 4, "val/accuracy": 0.5}])
    assert {name: read_run(tmp_path / name).rollout for name in ("old", "new", "old-cached", "cached", "online", "on")} == {
        "old": "TeacherDatasetRollouts", "new": "TeacherDatasetRollouts", "old-cached": "CachedTeacherRollouts",
        "cached": "CachedTeacherRollouts", "online": "TeacherRollouts", "on": "StudentRollouts"}
    found, _ = collect(sorted(tmp_path.iterdir()))
    groups = group_runs(found, {})
    assert [(g.rollout, g.kind, sorted(r.path.name for r in g.runs)) for g in groups] == [
        ("CachedTeacherRollouts", "OffPD", ["cached", "old-cached"]),
        ("TeacherDatasetRollouts", "OffPD", ["new", "old"]),
        ("TeacherRollouts", "OffPD", ["online"]),
        ("StudentRollouts", "OnPD", ["on"]),
    ]
    assert groups[1].stats("val/accuracy")[:2] == pytest.approx((0.3, math.sqrt(0.02)))
    main(["report", *sorted(str(p) for p in tmp_path.iterdir()), "--output", str(tmp_path / "report")])
    rows = markdown_table((tmp_path / "report" / "report.md").read_text(), "## Results by configuration")
    assert [r["rollout"] for r in rows] == ["CachedTeacherRollouts", "TeacherDatasetRollouts", "TeacherRollouts", "StudentRollouts"]


def test_missing_matplotlib_names_the_extra(runs, tmp_path, monkeypatch, capsys):
    """Without matplotlib the tables are written and the skipped figures named with the extra (issue 43)."""
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    main(["report", str(runs / "off-fkl-42"), "--output", str(tmp_path / "out")])
    assert "matplotlib is not installed (pip install 'kdlab[report]'): accuracy" in capsys.readouterr().err
    assert (tmp_path / "out" / "report.md").is_file() and not list((tmp_path / "out").glob("*.png"))


def test_a_null_setting_reads_like_an_absent_one():
    from kdlab.study.runs import _flatten

    assert _flatten({"model": {"stop_strings": None, "lr": 1e-4}}) == _flatten({"model": {"lr": 1e-4}}) == {"model.lr": "0.0001"}


# ---- bad input: refused or flagged, never averaged silently ----------------------------------------
def test_an_unfinished_run_is_refused_not_averaged_and_same_seed_reruns_are_one_seed(tmp_path, capsys):
    """The issue's case: an interrupted run logged only its "before" coverage (step 0 of max_steps=150);
    two finished runs agree at 36.5%. The report shows 36.5 over n=2, lists the interrupted run as
    unfinished, and a rerun of seed 42 (a done marker, same value) does not become a third seed."""
    root = tmp_path / "runs"
    before_only = [{"step": 0, "coverage/countdown3/pass@1": 0.0}]
    finished = [*before_only, {"step": 150, "coverage/countdown3/pass@1": 0.365, "val/accuracy": 0.4}]
    make_run(root, "seed42", "TeacherRollouts", "ForwardKL", 1e-4, 42, finished, max_steps=150)
    make_run(root, "seed43", "TeacherRollouts", "ForwardKL", 1e-4, 43, finished, max_steps=150)
    rerun = make_run(root, "seed42-again", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 3, "val/accuracy": 0.1}], max_steps=150)
    (rerun / "checkpoints").mkdir()
    (rerun / "checkpoints" / "final.ckpt").write_bytes(b"")  # the done marker every kdlab fit ends with
    make_run(root, "interrupted", "TeacherRollouts", "ForwardKL", 1e-4, 44, before_only, max_steps=150)
    main(["report", str(root), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "skipped" in err and "interrupted: unfinished: no done marker" in err and "last logged step 0 of max_steps=150" in err
    text = (tmp_path / "out" / "report.md").read_text()
    (row,) = markdown_table(text, "## Results by configuration")
    assert row["n"] == "2"  # seeds 42 and 43; the rerun of 42 is averaged into 42
    assert row["val/accuracy (%)"].startswith("32.5 ± 10.6")  # seed 42: (0.4 + 0.1) / 2, seed 43: 0.4
    (passes,) = markdown_table(text, "## pass@k")
    assert passes["coverage/countdown3/pass@1 (%)"].startswith("36.5 ± 0.0")  # not 24.3 ± 21.1 with the "before"
    assert "1 runs, 2 seeds" not in text and "3 runs, 2 seeds" in text
    assert "`" + str(root / "interrupted") + "`: unfinished" in text


def test_a_run_folder_stands_for_its_versions_and_the_report_goes_beside_the_runs(tmp_path, monkeypatch):
    """``kdlab report runs/<name>`` finds ``version_N`` inside; without --output the report is written
    in the folder holding the runs, not in the current directory."""
    name = tmp_path / "runs" / "tiny-quickstart"
    make_run(name, "version_0", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.25}])
    make_run(name, "version_1", "TeacherRollouts", "ForwardKL", 1e-4, 43, [{"step": 4, "val/accuracy": 0.75}])
    found, skipped = collect([name])
    assert [run.path.name for run in found] == ["version_0", "version_1"] and not skipped
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    main(["report", str(name)])
    assert not list(elsewhere.iterdir())
    (row,) = markdown_table((name / "report" / "report.md").read_text(), "## Results by configuration")
    assert row["n"] == "2" and row["val/accuracy (%)"] == "50.0 ± 35.4"
    found, skipped = collect([name])  # the report written there is not taken for a run the next time
    assert len(found) == 2 and not skipped


def test_a_run_without_a_done_marker_or_max_steps_is_flagged(tmp_path, capsys):
    run = make_run(tmp_path, "hand-made", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.5}])
    config = yaml.safe_load((run / "config.yaml").read_text())
    del config["trainer"]["max_steps"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    main(["report", str(run), "--output", str(tmp_path / "out")])
    assert "flagged" in capsys.readouterr().err
    assert "cannot tell whether it finished" in (tmp_path / "out" / "report.md").read_text()


def test_figures_name_their_metric_and_say_when_every_value_is_equal(tmp_path, monkeypatch):
    """All accuracies 0 (the issue's empty chart): the axis still spans 0-100%, the caption names
    val/accuracy and says that every value is 0 (in the caption, never over the bars)."""
    make_run(tmp_path, "a", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.0}])
    make_run(tmp_path, "b", "StudentRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.0}])
    figures = {}
    monkeypatch.setattr("kdlab.study.report._write_tensorboard", lambda directory, figs, text: figures.update(figs))
    main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(tmp_path / "out")])
    (ax,) = figures["accuracy"].axes
    caption = figures["accuracy"]._suptitle.get_text()
    assert ax.get_xlim() == (0.0, 100.0) and "val/accuracy" in caption
    assert "all 2 values of val/accuracy (%) are 0" in " ".join(caption.split()) and len(ax.texts) == 0


# ---- uncertainty -------------------------------------------------------------------------------
def test_bootstrap_interval_covers_problems_and_samples():
    from kdlab.study.stats import bootstrap_interval

    assert bootstrap_interval([{"a": [1.0, 1.0], "b": [0.0, 0.0]}] * 2, draws=500)[0] < 0.5  # problems vary
    assert bootstrap_interval([{str(i): [1.0] * 3 for i in range(5)}]) == (1.0, 1.0)
    low, high = bootstrap_interval([{"only": [1.0] * 5 + [0.0] * 5}])  # one problem: only its samples vary
    assert low < 0.3 and high > 0.7
    # 200 problems, one sample each, 80 correct: close to the normal approximation 0.4 +- 1.96 sqrt(0.24 / 200)
    low, high = bootstrap_interval([{str(i): [float(i < 80)] for i in range(200)}], draws=4000)
    half = 1.96 * math.sqrt(0.4 * 0.6 / 200)
    assert low == pytest.approx(0.4 - half, abs=0.01) and high == pytest.approx(0.4 + half, abs=0.01)
    # pass@2 of 2 samples: a problem counts when either sample is right
    assert bootstrap_interval([{str(i): [1.0, 0.0] for i in range(4)}], k=2, draws=300)[1] == 1.0


def test_accuracy_from_samples_files_and_coverage_get_a_95_percent_interval(tmp_path, capsys):
    """val/accuracy: bootstrap from samples/val-step*.jsonl (the last step's file); the README's
    coverage 36.5% over 200 examples x 1 sample: Wilson interval [30.1, 43.4]."""
    run = make_run(tmp_path, "r", "TeacherRollouts", "ForwardKL", 1e-4, 42,
                   [{"step": 4, "val/accuracy": 0.5, "coverage/countdown3/pass@1": 0.365}])
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["callbacks"] = [{"class_path": "kdlab.callbacks.Coverage", "init_args": {
        "task": {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}}, "samples": 1, "examples": 200}}]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "samples").mkdir()
    (run / "samples" / "val-step000002.jsonl").write_text(json.dumps({"id": "x", "score": 0.0}) + "\n")  # an earlier evaluation
    (run / "samples" / "val-step000004.jsonl").write_text("".join(json.dumps({"id": str(i), "score": 1.0}) + "\n" for i in range(5)))
    main(["report", str(run), "--output", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    (row,) = markdown_table(text, "## Results by configuration")
    assert row["val/accuracy (%)"] == "50.0 [100.0, 100.0]"  # the interval comes from the last samples file
    (passes,) = markdown_table(text, "## pass@k")
    assert passes["coverage/countdown3/pass@1 (%)"] == "36.5 [30.1, 43.4]"
    summary = read_csv(tmp_path / "out" / "pass_at_k.csv")[0]
    assert summary["coverage/countdown3/pass@1 ci"] == "Wilson" and float(summary["coverage/countdown3/pass@1 ci_low"]) == pytest.approx(0.3014, abs=5e-4)


def test_the_report_of_a_real_fit_and_of_its_interrupted_rerun(tmp_path, monkeypatch, capsys):
    """A real ``kdlab fit`` (done marker, samples file) is reported with a bootstrap interval from its
    samples; a second fit of the same config stopped by Ctrl-C before it finished is refused."""
    import signal

    from kdlab.stages import DistillModule

    monkeypatch.setattr("sys.argv", ["kdlab"])
    smoke = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")
    args = ["fit", f"--config={smoke}", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    main(args)
    real = DistillModule.training_step
    monkeypatch.setattr(DistillModule, "training_step", lambda self, *a: (_ for _ in ()).throw(KeyboardInterrupt) if self.global_step else real(self, *a))
    try:
        with pytest.raises(SystemExit):
            main(args)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    capsys.readouterr()
    main(["report", str(tmp_path / "runs" / "tiny-smoke")])
    assert "version_1: unfinished" in capsys.readouterr().err
    (row,) = markdown_table((tmp_path / "runs" / "tiny-smoke" / "report" / "report.md").read_text(), "## Results by configuration")
    assert row["n"] == "1" and row["val/accuracy (%)"] == "0.0 [0.0, 0.0]"  # the random tiny pair scores 0 on all 8


def test_a_grpo_run_is_named_by_its_stage_not_as_a_distillation(tmp_path):
    """A GRPOModule config has no rollout policy or KL objective: it must not read as OffPD forward KL
    (the defaults of DistillModule), nor take the paper's distillation numbers."""
    from kdlab.study.runs import read_run

    run = tmp_path / "grpo"
    run.mkdir()
    config = {"seed_everything": 0, "trainer": {"max_steps": 2},
              "model": {"class_path": "kdlab.stages.GRPOModule", "init_args": {"lr": 5e-4, "task": {"class_path": "kdlab.tasks.Addition"}}}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/accuracy": 0.5}) + "\n")
    result = read_run(run)
    assert (result.rollout, result.objective, result.lr) == ("GRPOModule", "GRPOModule", 5e-4)
    (group,) = group_runs([result], lr_levels({5e-4}))
    assert group.kind is None and group.direction is None and group.paper("val/accuracy") == []


def test_a_setting_at_its_default_reads_as_absent(tmp_path):
    """Runs saved before a class gained an argument (absent) and after (at its default) are one
    configuration; a run that changed the argument is another."""
    from kdlab.study.runs import read_run

    def run(name, task_args, lr=1e-4):
        folder = tmp_path / name
        folder.mkdir()
        callback = {"class_path": "kdlab.callbacks.OODForgetting",
                    "init_args": {"tasks": [{"class_path": "kdlab.tasks.Counting", "init_args": task_args}]}}
        config = {"seed_everything": 1, "trainer": {"max_steps": 2, "callbacks": [callback]},
                  "model": {"lr": lr, "warmup_steps": 10, "task": {"class_path": "kdlab.tasks.Addition"}}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/accuracy": 0.5}) + "\n")
        return read_run(folder)

    before, after, changed = run("before", {"num_val": 5}), run("after", {"num_val": 5, "answer_from": "tag"}), run("changed", {"num_val": 5, "answer_from": "last_number"})
    assert before.settings == after.settings != changed.settings
    assert "model.warmup_steps" not in before.settings  # DistillModule's own default (model without class_path)
    assert len(group_runs([before, after, changed], {})) == 2


def test_write_csv_writes_what_the_csv_module_writes(tmp_path):
    """The report's CSV files through pandas are byte for byte what ``csv.writer`` wrote before: float
    repr, quoting, None as an empty cell, NaN as ``nan``, CRLF line ends."""
    import csv
    import io

    from kdlab.study.tables import write_csv

    header = ["name", "n", "mean", "std", "empty", "lr", "flag"]
    rows = [["a,b", 1, 0.1, None, "", 1e-05, True], ['say "x"', 2, float("nan"), 2 / 3, "z", 5e-05, False]]
    expected = io.StringIO()
    writer = csv.writer(expected)
    writer.writerow(header)
    writer.writerows(rows)
    write_csv(tmp_path / "t.csv", header, rows)
    assert (tmp_path / "t.csv").read_bytes() == expected.getvalue().encode("utf-8")


def test_runs_frame_and_group_statistics(tmp_path):
    """One row per run with its last values; a configuration's mean and std are over seeds, reruns of one
    seed averaged first, a run without a seed its own; a logged NaN stays NaN (it is not "absent")."""
    import statistics

    from kdlab.study.groups import Group, runs_frame
    from kdlab.study.runs import RunResult

    def run(seed, name, **last):
        return RunResult(tmp_path / name, "addition", "TeacherRollouts", None, "ForwardKL", 1e-5, seed, {},
                         {metric: [(1, -1.0), (2, value)] for metric, value in last.items()})

    runs = [run(1, "a", acc=0.1, kl=float("nan")), run(1, "b", acc=0.3), run(2, "c", acc=0.7), run(None, "d", acc=0.2), run(None, "e", other=1.0)]
    frame = runs_frame(runs)
    assert list(frame["run"]) == runs and list(frame["seed_key"]) == [1, 1, 2, "run-3", "run-4"]
    assert frame["acc"].tolist()[:4] == [0.1, 0.3, 0.7, 0.2] and math.isnan(frame["acc"][4])
    group = Group(runs)
    assert group.seeds == 4 and [len(members) for members in group.by_seed().values()] == [2, 1, 1, 1]
    mean, std, n = group.stats("acc")
    assert n == 3 and mean == pytest.approx(statistics.fmean([0.2, 0.7, 0.2])) and std == pytest.approx(statistics.stdev([0.2, 0.7, 0.2]))
    kl = group.stats("kl")
    assert math.isnan(kl[0]) and kl[1:] == (None, 1)
    assert group.stats("missing") is None


def test_a_run_from_before_the_metrics_file_held_self_log_values_reads_them_from_tensorboard(tmp_path):
    """Old runs logged ``self.log`` values to TensorBoard only: without any Lightning line (``epoch``) in
    metrics.jsonl the events are read, the file winning at equal steps, and a scalar only the events hold (a
    ``self.log`` value, at Lightning's logger step) is moved one step on, to the optimiser steps the file's
    lines count; a current run's file is the whole record and its events are not read."""
    from torch.utils.tensorboard import SummaryWriter

    from kdlab.study.runs import read_metrics

    for name, lines in (("old", [{"step": 3, "sparsity/1e-06": 0.5, "val/accuracy": 0.3}]),
                        ("new", [{"step": 3, "val/accuracy": 0.3, "epoch": 0.0, "steps": "optimiser"}])):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        writer = SummaryWriter(str(run))
        writer.add_scalar("val/accuracy", 0.25, 3)
        writer.add_scalar("val/accuracy", 0.5, 5)
        writer.add_scalar("train/loss", 2.0, 4)
        writer.close()
    assert read_metrics(tmp_path / "old") == {"val/accuracy": [(3, 0.3), (5, 0.5)], "sparsity/1e-06": [(3, 0.5)], "train/loss": [(5, 2.0)]}
    assert read_metrics(tmp_path / "new") == {"val/accuracy": [(3, 0.3)]}


def test_an_archived_runs_lightning_lines_read_at_the_optimiser_step_as_its_callbacks_lines(tmp_path):
    """Lightning's ``self.log`` lines of a run written before kdlab logged them at optimiser steps (no
    ``"steps": "optimiser"``) are one step early: they read one step on, beside the callbacks' lines of the
    same step and a marked line; ``epoch`` is no metric (kdlab.runlog's "Steps")."""
    from kdlab.study.runs import read_run

    run = make_run(tmp_path, "old", "TeacherRollouts", "ForwardKL", 1e-4, 42, [
        {"step": 3, "train/loss": 1.5, "epoch": 0.0},
        {"step": 4, "ood/mean": 50.0},
        {"step": 4, "val/accuracy": 0.5, "epoch": 0.0, "steps": "optimiser"},
    ])
    result = read_run(run)
    assert result.series == {"train/loss": [(4, 1.5)], "ood/mean": [(4, 50.0)], "val/accuracy": [(4, 0.5)]}
    assert not result.unfinished  # its last step is max_steps=4


# ---- a report people can read (issue #30, item 5) ------------------------------------------------------
def long_callbacks(every_n_steps, coverage=True, examples=None):
    """A realistic callbacks list (about 600 characters as JSON): HeldOutKL, OODForgetting over two skills
    and, optionally, Coverage on Countdown-4E."""
    held = {"class_path": "kdlab.callbacks.HeldOutKL", "init_args": {"every_n_steps": every_n_steps, "split": "val", "batch_size": 4}}
    if examples is not None:
        held["init_args"]["examples"] = examples
    ood = {"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"tasks": [
        {"class_path": "kdlab.tasks.Counting", "init_args": {"num_val": 5}}, {"class_path": "kdlab.tasks.Sorting", "init_args": {"num_val": 5}}]}}
    cov = {"class_path": "kdlab.callbacks.Coverage", "init_args": {
        "task": {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown4e"}}, "samples": 10, "examples": 200, "k": [1, 5, 10]}}
    return [held, ood, *([cov] if coverage else [])]


def test_settings_that_differ_in_one_callback_argument_are_named_by_that_argument(tmp_path):
    """Runs whose callbacks lists differ in one argument: the other column names that argument alone
    (``callbacks.HeldOutKL.every_n_steps``, classes without their module), never the list as JSON; a
    callback missing from some configurations reads ``=off``; an argument left at its class's default shows
    that default; a long value is cut to 120 characters; no table line of report.md exceeds 200."""
    from kdlab.study.groups import OTHER_WIDTH

    rows = [{"step": 4, "val/accuracy": 0.5}]
    make_run(tmp_path / "runs", "every50", "TeacherRollouts", "ForwardKL", 1e-3, 42, rows, callbacks=long_callbacks(50))
    make_run(tmp_path / "runs", "every100", "TeacherRollouts", "ForwardKL", 1e-3, 42, rows, callbacks=long_callbacks(100))
    main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    others = [r["other"] for r in markdown_table(text, "## Results by configuration")]
    assert others == ["callbacks.HeldOutKL.every_n_steps=100", "callbacks.HeldOutKL.every_n_steps=50"]
    assert "class_path" not in text and '{"' not in text and "kdlab.callbacks" not in text
    assert max(len(line) for line in text.splitlines() if line.startswith("|")) <= 200
    assert [r["other"] for r in read_csv(tmp_path / "out" / "summary.csv")] == others

    # one without Coverage (and HeldOutKL's examples changed from its default, 50), one with a long path
    make_run(tmp_path / "more", "no-coverage", "TeacherRollouts", "ForwardKL", 1e-3, 42, rows, callbacks=long_callbacks(50, coverage=False, examples=7))
    make_run(tmp_path / "more", "long", "TeacherRollouts", "ForwardKL", 1e-3, 42, rows,
             callbacks=long_callbacks(50, coverage=False, examples=7), task={"class_path": "kdlab.tasks.Addition", "init_args": {"num_train": 64, "path": "data/" + "x" * 300}})
    found, _ = collect([tmp_path / "runs", tmp_path / "more"])
    others = [g.other for g in group_runs(found, {})]
    assert others[:3] == [
        "callbacks.Coverage=off, callbacks.HeldOutKL.every_n_steps=50, callbacks.HeldOutKL.examples=7",
        "callbacks.Coverage=on, callbacks.HeldOutKL.every_n_steps=100, callbacks.HeldOutKL.examples=50",
        "callbacks.Coverage=on, callbacks.HeldOutKL.every_n_steps=50, callbacks.HeldOutKL.examples=50",
    ]
    assert len(others[3]) == OTHER_WIDTH and others[3].startswith("path=data/xxx") and "x…x" in others[3]  # the long value cut, every name kept
    assert others[3].endswith(", callbacks.Coverage=off, callbacks.HeldOutKL.every_n_steps=50, callbacks.HeldOutKL.examples=7")


def test_figure_labels_fit_inside_the_figure(tmp_path, monkeypatch):
    """Configurations with long labels (every setting differs, each value long): drawing every figure warns
    of no layout that could not be applied (the issue's "Tight layout not applied"), and every tick label,
    title and legend entry lies inside the figure."""
    import warnings

    figures = {}
    monkeypatch.setattr("kdlab.study.report._write_tensorboard", lambda directory, figs, text: figures.update(figs))
    for index, lam in enumerate((-0.5, 0.5)):
        for every in (50, 100):
            task = {"class_path": "kdlab.tasks.Addition", "init_args": {"num_train": 64, "path": f"data/{'a_rather_long_folder_name/' * 3}{index}"}}
            make_run(tmp_path / "runs", f"run-{lam}-{every}", "MixtureRollouts", "ForwardKL", 1e-3, 42,
                     [{"step": 4, "val/accuracy": 0.5, "val/pass@1": 0.25}, *reward_curve(0.5)], lam=lam, task=task,
                     callbacks=long_callbacks(every, coverage=every == 50))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "out")])
    assert [str(w.message) for w in caught if "layout" in str(w.message).lower()] == []
    assert {"accuracy", "spectrum-Addition", "pass_at_k-Addition", "rlvr-reward"} <= set(figures)
    for name, fig in figures.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        for ax in fig.axes:
            drawn = ax.get_tightbbox(renderer)  # every tick label, title, axis label and legend drawn
            texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *(ax.get_legend().get_texts() if ax.get_legend() else [])]
            texts += [tick.label1 for axis in (ax.xaxis, ax.yaxis) for tick in axis.get_major_ticks()
                      if axis.get_view_interval().min() - 1e-9 <= tick.get_loc() <= axis.get_view_interval().max() + 1e-9]
            for extent, what in [(drawn, "axes"), *((t.get_window_extent(renderer), t.get_text()) for t in texts if t.get_text())]:
                inside = extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and extent.y0 >= box.y0 - 1 and extent.y1 <= box.y1 + 1
                assert inside, (name, what, extent, box)
    labels = [t.get_text() for t in figures["accuracy"].axes[0].get_yticklabels()]
    assert len(labels) == 4 and all(max(map(len, label.splitlines())) <= 40 for label in labels)


def test_the_report_folder_by_default(tmp_path, monkeypatch, capsys):
    """One folder: ``<folder>/report`` (README: ``kdlab report runs/sweep-smoke`` -> ``runs/sweep-smoke/report``).
    Several: ``report/`` in the folder holding them when it lies below the working directory; else (their
    common folder is outside it, or is the working directory itself) refused, asking for --output, and
    nothing is written."""
    from kdlab.study.report import default_output

    rows = [{"step": 4, "val/accuracy": 0.5}]
    for folder in ("runs/a", "runs/b", "elsewhere/c"):
        make_run(tmp_path / folder, "version_0", "TeacherRollouts", "ForwardKL", 1e-3, 42, rows)
    monkeypatch.chdir(tmp_path)
    assert default_output(["runs/a"]) == Path("runs/a/report")
    assert default_output(["runs/a", "runs/b"]) == default_output([str(tmp_path / "runs/a"), "runs/b/version_0"]) == Path("runs/report")
    main(["report", "runs/a", "runs/b"])
    (row,) = markdown_table((tmp_path / "runs" / "report" / "report.md").read_text(), "## Results by configuration")
    assert row["n"] == "1"
    for given in (["runs/a", "elsewhere/c"], [str(tmp_path / "runs/a"), "/tmp"]):
        with pytest.raises(ValueError, match="--output"):
            default_output(given)
        with pytest.raises(SystemExit) as exit_:
            main(["report", *given])
        assert exit_.value.code == 2 and "--output" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "runs"]  # no report/ in the working directory
    monkeypatch.chdir(tmp_path / "runs")  # the common folder is the working directory: --output too
    with pytest.raises(ValueError, match="working directory"):
        default_output(["a", "b"])
    main(["report", "a", "b", "--output", str(tmp_path / "out")])
    assert (tmp_path / "out" / "report.md").is_file()
    outside = tmp_path / "elsewhere" / "c"  # one folder named outside the working directory: its own report/
    main(["report", str(outside)])
    assert (outside / "report" / "report.md").is_file()


def test_the_papers_numbers_only_beside_rows_of_its_tasks(tmp_path):
    """The paper's headline numbers are Countdown-3 / Science / MedReason: a SmolLM2 run on Counting gets no
    paper number, and a report of such runs alone no paper column, no table of the paper's numbers and no
    paper note; beside it, a Countdown-3 row of the same setting still gets its numbers."""
    counting = {"class_path": "kdlab.tasks.Counting", "init_args": {"num_val": 50}}
    rows = [{"step": 4, "val/accuracy": 0.12, "ood/mean_delta": 0.0, "sparsity/1e-06": 0.007, "val/pass@1": 0.12,
             "coverage/counting/pass@1": 0.12, "style/spanish_share": 0.0}]
    for rollout in ("TeacherRollouts", "StudentRollouts"):
        for objective in ("ForwardKL", "ReverseKL"):
            run = make_run(tmp_path / "smollm2", f"{rollout}-{objective}", rollout, objective, 1e-5, 42, rows, task=counting)
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["model"]["student"] = {"path": "HuggingFaceTB/SmolLM2-135M"}
            (run / "config.yaml").write_text(yaml.safe_dump(config))
    main(["report", str(tmp_path / "smollm2"), "--output", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    table = markdown_table(text, "## Results by configuration")
    assert len(table) == 4 and all(not key.startswith("paper") for key in table[0])
    assert "headline numbers" not in text and "> Paper:" not in text and "[P1]" not in text and "[P2]" not in text

    make_run(tmp_path / "countdown", "countdown3", "TeacherRollouts", "ForwardKL", 1e-5, 42, rows, task=COUNTDOWN3)
    main(["report", str(tmp_path / "smollm2"), str(tmp_path / "countdown"), "--output", str(tmp_path / "both")])
    text = (tmp_path / "both" / "report.md").read_text()
    papers = {(r["task"], r["rollout"], r["objective"]): r["paper val/accuracy (%)"] for r in markdown_table(text, "## Results by configuration")}
    assert papers[("countdown3", "TeacherRollouts", "ForwardKL")] == "73 [P2]; 71-73 [P3]"
    assert {v for (task, *_), v in papers.items() if task == "Counting"} == {""}
    assert "headline numbers" in text and "> Paper: On-policy rollouts give 10-15% higher pass@k" in text


def test_the_heldout_kl_gap_closed_is_a_column_of_the_main_table(tmp_path):
    """docs/real_model.md leads with HeldOutKL's share of the forward-KL gap closed: the report carries it."""
    for seed, closed in ((42, 0.69), (43, 0.59)):
        rows = [{"step": 0, "heldout_kl/forward_closed": 0.0}, {"step": 15, "val/accuracy": 0.1, "heldout_kl/forward_closed": closed}]
        make_run(tmp_path / "runs", f"seed{seed}", "TeacherRollouts", "ForwardKL", 1e-5, seed, rows)
    main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "out")])
    table = markdown_table((tmp_path / "out" / "report.md").read_text(), "## Results by configuration")
    assert table[0]["heldout_kl/forward_closed (%)"].startswith("64.0 ± 7.1")


def test_the_spanish_share_gets_a_wilson_interval_over_the_answers_judged(tmp_path):
    """StyleTransfer judges examples x tasks answers per run: the style table gives the share its Wilson
    interval over them (pooled over seeds), with the student's accuracy and held-out KLs beside it."""
    from kdlab.study.runs import collect
    from kdlab.study.groups import group_runs
    from kdlab.study.stats import wilson_interval

    style = {"class_path": "kdlab.callbacks.StyleTransfer",
             "init_args": {"examples": 200, "tasks": [{"class_path": "kdlab.tasks.Counting"}], "at_start": False}}
    rows = [{"step": 4, "val/accuracy": 0.3, "style/spanish_share": 0.25, "heldout_kl/forward": 0.5, "heldout_kl/student_prefixes/forward": 0.2}]
    for seed in (42, 43):
        make_run(tmp_path / "runs", f"s{seed}", "TeacherRollouts", "ForwardKL", 1e-5, seed, rows, callbacks=[style])
    runs, _ = collect([tmp_path / "runs"])
    assert {run.coverage_draws["style"] for run in runs} == {200}
    (group,) = group_runs(runs, {1e-5: "low"})
    low, high, how = group.interval("style/spanish_share")
    assert (low, high) == pytest.approx(wilson_interval(0.25, 400)) and how == "Wilson"
    main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "out")])
    (row,) = markdown_table((tmp_path / "out" / "report.md").read_text(), "## Style transfer")
    assert row["heldout_kl/student_prefixes/forward"].startswith("0.2") and row["val/accuracy (%)"].startswith("30.0")


def test_the_spanish_share_interval_counts_each_style_entrys_own_rows(tmp_path):
    """kdlab.study.setups.style_transfer_rows: a StyleTransfer entry that names its count (TaskPrompts) is judged on that
    many answers, the others on the callback's ``examples``; the style interval's n is their sum (150 + 200 + 200)."""
    from kdlab.study.runs import collect

    prompts = "kdlab.callbacks.TaskPrompts"
    style = {"class_path": "kdlab.callbacks.StyleTransfer", "init_args": {"examples": 200, "at_start": False, "tasks": [
        {"class_path": prompts, "init_args": {"task": {"class_path": "kdlab.tasks.Counting"}, "split": "train", "examples": 150}},
        {"class_path": prompts, "init_args": {"task": {"class_path": "kdlab.tasks.Counting"}, "split": "test", "examples": None}},
        {"class_path": "kdlab.tasks.Counting"}]}}
    make_run(tmp_path / "runs", "s42", "TeacherRollouts", "ForwardKL", 1e-5, 42, [{"step": 4, "style/spanish_share": 0.5}], callbacks=[style])
    (run,), _ = collect([tmp_path / "runs"])
    assert run.coverage_draws["style"] == 550


def test_an_init_args_left_empty_by_its_defaults_reads_like_no_init_args(tmp_path):
    """``rollout: {class_path: MixtureRollouts}`` and ``init_args: {lam: 0.0}`` (lam's default) are one
    configuration: removing the defaults empties ``init_args``, and an empty one is no setting."""
    root = tmp_path / "runs"
    make_run(root, "without", "MixtureRollouts", "ForwardKL", 1e-4, 42)
    make_run(root, "at-default", "MixtureRollouts", "ForwardKL", 1e-4, 43, rollout_args={"lam": 0.0})
    make_run(root, "empty", "MixtureRollouts", "ForwardKL", 1e-4, 44, rollout_args={})
    found, _ = collect([root])
    (group,) = group_runs(found, {})
    assert group.seeds == 3 and group.other == "" and group.lam == 0.0


def test_the_archived_spectrum_studys_lam_0_runs_are_no_configuration_of_their_own(tmp_path):
    """The archived spectrum study wrote ``init_args: {lam: 0.0, alpha: 0.2}`` (both defaults): its
    lam=0 runs carry no ``rollout={}`` setting that would split them into a column of their own."""
    import tarfile

    with tarfile.open(Path(__file__).resolve().parents[1] / "experiments/tiny/study_runs/spectrum_5x.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    found, skipped = collect([tmp_path / "runs"])
    assert found and not skipped
    assert {group.other for group in group_runs(found, {})} == {""}
    committed = Path(__file__).resolve().parents[1] / "docs" / "tiny_reproduction"  # the study's reports written from them
    assert not any("rollout={}" in path.read_text(encoding="utf-8") for path in committed.rglob("*") if path.suffix in (".md", ".csv"))


def test_the_seed_of_a_model_given_by_class_path_is_per_run(tmp_path):
    """A notebook's run (:func:`kdlab.run_config.describe_run`) or ``kdlab fit --model GRPOModule`` writes
    the seed as ``model.init_args.seed``: runs that differ only there are seeds of one configuration."""
    for seed in (42, 43, 44):
        run = tmp_path / "runs" / f"seed{seed}"
        run.mkdir(parents=True)
        config = {"seed_everything": None, "trainer": {"max_steps": 5},
                  "model": {"class_path": "kdlab.stages.DistillModule",
                            "init_args": {"seed": seed, "lr": 1e-4, "task": COUNTDOWN3}}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "val/accuracy": 0.3 + seed / 1000, "epoch": 0}) + "\n")
        (run / "DONE").write_text("{}")
    found, _ = collect([tmp_path / "runs"])
    assert sorted(run.seed for run in found) == [42, 43, 44]
    (group,) = group_runs(found, {})
    assert group.seeds == 3 and group.other == ""
def test_a_folder_that_does_not_exist_is_named_as_missing(tmp_path, capsys):
    """``kdlab report runs/does-not-exist`` said "no finished run directory with a config.yaml among" it."""
    missing = tmp_path / "runs" / "does-not-exist"
    make_run(tmp_path / "runs", "real", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.25}])
    for given in ([str(missing)], [str(tmp_path / "runs" / "real"), str(missing)]):  # alone, or beside a run
        with pytest.raises(SystemExit) as exit_info:
            main(["report", *given, "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.splitlines()[-1] == f"kdlab report: error: {missing}: no such file or folder"
    assert not (tmp_path / "out").exists()


def test_a_validate_folder_is_named_as_an_evaluation_not_an_unfinished_run(tmp_path, capsys, monkeypatch):
    """``kdlab validate --ckpt_path .../final.ckpt`` writes runs/<name>/version_1, which ``kdlab report`` listed as
    "skipped ... unfinished"; validate did not say where it wrote. It now prints its folder, records its command in
    run_info.json, and the report says what the folder is."""
    monkeypatch.setattr("sys.argv", ["kdlab"])
    save = f"--trainer.logger.init_args.save_dir={tmp_path}"
    smoke = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")
    main(["fit", f"--config={smoke}", "--trainer.max_steps=2", save])
    final = tmp_path / "tiny-smoke" / "version_0" / "checkpoints" / "final.ckpt"
    capsys.readouterr()
    main(["validate", f"--config={smoke}", save, f"--ckpt_path={final}"])
    evaluation = tmp_path / "tiny-smoke" / "version_1"
    assert f"[kdlab] validate writes to {evaluation}" in capsys.readouterr().out
    assert json.loads((evaluation / "run_info.json").read_text())["command"] == "validate"
    main(["report", str(tmp_path / "tiny-smoke"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"[report] skipped {evaluation}: an evaluation written by kdlab validate, not a training run" in err
    assert "unfinished" not in err
    (row,) = markdown_table((tmp_path / "out" / "report.md").read_text(), "## Results by configuration")
    assert row["n"] == "1"


def test_counts_of_one_read_in_the_singular(tmp_path, capsys):
    """A report of one run said "1 runs in 1 configurations" and "[report] 1 runs -> ..."."""
    make_run(tmp_path / "runs", "only", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.25}])
    main(["report", str(tmp_path / "runs" / "only"), "--output", str(tmp_path / "out")])
    assert "\n1 run in 1 configuration: mean" in (tmp_path / "out" / "report.md").read_text()
    assert f"[report] 1 run -> {tmp_path / 'out' / 'report.md'}" in capsys.readouterr().out
    make_run(tmp_path / "runs", "again", "TeacherRollouts", "ForwardKL", 1e-4, 42, [{"step": 4, "val/accuracy": 0.75}])
    main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "out2")])
    text = (tmp_path / "out2" / "report.md").read_text()
    assert "\n2 runs in 1 configuration: mean" in text and ": 2 runs, 1 seed\n" in text  # a rerun of seed 42
