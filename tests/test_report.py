"""``kdlab report``: hand-made run directories with known numbers -> Markdown, CSV, PNG and TensorBoard."""

import csv
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from kdlab.cli import main
from kdlab.report import collect, group_runs, lr_levels


def make_run(root, name, rollout, objective, lr, seed, rows=(), lam=None, max_steps=4):
    run_dir = Path(root, name)
    run_dir.mkdir(parents=True)
    rollout_config = {"class_path": f"kdlab.rollouts.{rollout}"}
    if lam is not None:
        rollout_config["init_args"] = {"lam": lam, "alpha": 0.2}
    config = {
        "seed_everything": seed,
        "trainer": {"max_steps": max_steps, "logger": {"class_path": "TensorBoardLogger", "init_args": {"save_dir": str(root), "name": name}}},
        "model": {
            "student": {"path": "kdlab://tiny-random/student"},
            "task": {"class_path": "kdlab.tasks.Addition", "init_args": {"num_train": 64}},
            "rollout": rollout_config,
            "objective": {"class_path": f"kdlab.objectives.{objective}"},
            "lr": lr,
        },
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def reward_curve(scale):
    return [{"step": step, "rlvr/reward": scale * step} for step in range(5)]


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    # OffPD forward KL at the low LR, two seeds: accuracy 0.6 / 0.8 (the earlier 0.5 is not the last value)
    make_run(root, "off-fkl-42", "TeacherRollouts", "ForwardKL", 1e-3, 42, [
        {"step": 2, "val/accuracy": 0.5},
        {"step": 4, "val/accuracy": 0.6, "ood/mean_delta": -1.0, "sparsity/1e-06": 0.9},
    ])
    make_run(root, "off-fkl-43", "TeacherRollouts", "ForwardKL", 1e-3, 43, [
        {"step": 4, "val/accuracy": 0.8, "ood/mean_delta": -3.0, "sparsity/1e-06": 0.7},
    ])
    # OnPD reverse KL at the high LR: accuracy only in a real TensorBoard event file (last step wins)
    on = make_run(root, "on-rkl-42", "StudentRollouts", "ReverseKL", 5e-3, 42, [
        {"step": 3, "val/accuracy": 0.3, "sparsity/1e-06": 0.55},
    ])
    writer = SummaryWriter(str(on))
    writer.add_scalar("val/accuracy", 0.25, 3)
    writer.add_scalar("val/accuracy", 0.4, 5)
    writer.close()
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
    style = {r["rollout"]: r["style/spanish_share (%)"] for r in markdown_table(text, "## Style transfer")}
    assert style == {"MixtureRollouts (lam=-0.5)": "90.0", "MixtureRollouts (lam=0.5)": "10.0"}
    curves = read_csv(out / "rlvr_curves.csv")
    assert len(curves) == 10 and {float(r["value"]) for r in curves if r["lam"] == "0.5"} == {0.0, 1.0, 2.0, 3.0, 4.0}
    assert len(read_csv(out / "runs.csv")) == 5

    for name in ("accuracy", "spectrum-Addition", "pass_at_k-Addition", "rlvr-reward"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"![{name}]({name}.png)" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = (out / "tensorboard").glob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert {"report/accuracy", "report/spectrum-Addition", "report/rlvr-reward"} <= set(events.Tags()["images"])


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


def test_missing_matplotlib_names_the_extra(runs, tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'kdlab\[report\]'"):
        main(["report", str(runs / "off-fkl-42"), "--output", str(tmp_path / "out")])


def test_a_null_setting_reads_like_an_absent_one():
    from kdlab.report import _flatten

    assert _flatten({"model": {"stop_strings": None, "lr": 1e-4}}) == _flatten({"model": {"lr": 1e-4}}) == {"model.lr": "0.0001"}
