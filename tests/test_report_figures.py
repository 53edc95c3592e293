"""The report's figures read at a glance (issue #43): each kind is drawn from hand-made runs of a small study
(two tasks, OffPD / OnPD / a mixture, FKL / RKL, two learning rates, a bf16 variant, RLVR curves), then its pixel
size, its labels (the study's short names, derived from the settings that differ), its caption (the interval
named once) and its legend (never over a data point) are checked."""

import csv
import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402 - matplotlib's own dependency

from kdlab.cli.main import main  # noqa: E402
from kdlab.study.figure_labels import lr_label, variant_labels  # noqa: E402

COUNTDOWN3 = {"class_path": "kdlab.tasks.Countdown", "init_args": {"variant": "countdown3"}}
ADDITION = {"class_path": "kdlab.tasks.Addition", "init_args": {"num_train": 64}}
DPI = 120  # kdlab report's savefig dpi


def make_run(root, name, rollout, objective, lr, seed, *, task=COUNTDOWN3, lam=None, precision=None, scores=(1, 0, 1, 1), extra=()):
    """A finished run: config.yaml, metrics.jsonl (train/loss at steps 0-3, val/accuracy and pass@k at 3) and
    the last evaluation's samples (two of each problem, scored ``scores``)."""
    run = Path(root, name)
    (run / "samples").mkdir(parents=True)
    rollout_config = {"class_path": f"kdlab.rollouts.{rollout}", **({"init_args": {"lam": lam}} if lam is not None else {})}
    config = {
        "seed_everything": seed,
        "trainer": {"max_steps": 4, **({"precision": precision} if precision else {})},
        "model": {"student": {"path": "kdlab://tiny-random/student"}, "task": task, "rollout": rollout_config,
                  "objective": {"class_path": f"kdlab.objectives.{objective}"}, "lr": lr},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    accuracy = sum(scores) / len(scores)
    rows = [{"step": step, "train/loss": 2.0 / (step + 1) + seed % 7 / 10} for step in range(4)]
    rows += [{"step": 3, "val/accuracy": accuracy, "val/pass@1": accuracy, "val/pass@2": min(1.0, accuracy + 0.25)}, *extra]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "samples" / "val-step000003.jsonl").write_text("".join(json.dumps({"id": str(i), "score": float(s)}) + "\n" for i, s in enumerate(scores) for _ in range(2)))
    (run / "DONE").write_text("{}")
    return run


@pytest.fixture
def study(tmp_path):
    root = tmp_path / "runs"
    for seed in (42, 43):
        for rollout in ("TeacherRollouts", "StudentRollouts"):
            for objective in ("ForwardKL", "ReverseKL"):
                for lr in (1e-4, 5e-4):
                    scores = (1, 0, seed % 2, 1) if rollout == "TeacherRollouts" else (0, 1, 0, seed % 2)
                    make_run(root, f"{rollout}-{objective}-{lr}-{seed}", rollout, objective, lr, seed, scores=scores)
                    make_run(root, f"bf16-{rollout}-{objective}-{lr}-{seed}", rollout, objective, lr, seed, precision="bf16-true")
            make_run(root, f"add-{rollout}-{seed}", rollout, "ForwardKL", 1e-4, seed, task=ADDITION)
        for lam in (-0.5, 0.5):
            for objective in ("ForwardKL", "ReverseKL"):
                make_run(root, f"mix-{lam}-{objective}-{seed}", "MixtureRollouts", objective, 1e-4, seed, lam=lam,
                         extra=[{"step": step, "rlvr/reward": 0.1 * step + (lam > 0) / 10} for step in range(4)])
    return root


def report(runs, out, monkeypatch):
    figures = {}
    monkeypatch.setattr("kdlab.study.report._write_tensorboard", lambda directory, figs, text: figures.update(figs))
    main(["report", *map(str, runs), "--output", str(out)])
    return figures


def texts_of(fig):
    """Every tick label and legend entry of ``fig``."""
    texts = [t.get_text() for ax in fig.axes for t in (*ax.get_yticklabels(), *ax.get_xticklabels())]
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    return [t for t in texts if t], [t.get_text() for legend in legends for t in legend.get_texts()], legends


def data_points(fig, renderer):
    """Display-space boxes of everything drawn from data: bars, line and marker points, error-bar segments."""
    from matplotlib.transforms import Bbox

    boxes = []
    for ax in fig.axes:
        boxes += [patch.get_window_extent(renderer) for patch in ax.patches]
        for line in ax.lines:
            boxes += [Bbox([p, p]) for p in ax.transData.transform(line.get_xydata())]
        for collection in ax.collections:
            for path in collection.get_paths():
                boxes += [Bbox([p, p]) for p in collection.get_transform().transform(path.vertices)]
    return boxes


def check_figure(name, fig, out):
    """The PNG's size is the figure's, at most twice as tall as wide; labels at most 40 characters a line; the
    caption names the error bars once; no legend overlaps a data point."""
    width, height = Image.open(out / f"{name}.png").size
    expected = [DPI * x for x in fig.get_size_inches()]
    assert abs(width - expected[0]) < 1 and abs(height - expected[1]) < 1, (name, width, height, expected)
    assert height <= 2 * width, (name, width, height)
    ticks, entries, legends = texts_of(fig)
    assert all(len(line) <= 40 for text in ticks + entries for line in text.splitlines()), (name, ticks, entries)
    axes_titles = [ax.get_title(loc) for ax in fig.axes for loc in ("left", "center")]
    assert not any("interval" in title or "std" in title for title in axes_titles), axes_titles
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for legend in legends:
        box = legend.get_window_extent(renderer)
        overlaps = [p for p in data_points(fig, renderer) if p.overlaps(box)]
        assert overlaps == [], (name, box, overlaps[:3])
    return ticks, entries


def test_every_figure_of_a_study_is_grouped_by_its_factors_with_short_labels(study, tmp_path, monkeypatch):
    out = tmp_path / "report"
    figures = report([study], out, monkeypatch)
    assert {"accuracy", "spectrum-countdown3", "pass_at_k-countdown3", "rlvr-reward"} <= set(figures)
    assert "train-loss" not in figures  # 22 configurations: more colours than a reader can tell apart, and said so
    assert "Figure train-loss not drawn: its configurations need more than 10 colours" in (out / "report.md").read_text()
    for name, fig in figures.items():
        check_figure(name, fig, out)

    accuracy = figures["accuracy"]
    assert [ax.get_title(loc="left") for ax in accuracy.axes] == ["Addition", "countdown3"]  # a panel per task
    rows = [[t.get_text() for t in ax.get_yticklabels()] for ax in accuracy.axes]
    assert rows == [["OffPD FKL", "OnPD FKL"], [
        "OffPD FKL", "OffPD FKL · precision=bf16-true", "OffPD RKL", "OffPD RKL · precision=bf16-true",
        "λ=-0.5 FKL", "λ=-0.5 RKL", "λ=0.5 FKL", "λ=0.5 RKL",
        "OnPD FKL", "OnPD FKL · precision=bf16-true", "OnPD RKL", "OnPD RKL · precision=bf16-true"]]
    (legend,) = accuracy.legends
    assert legend.get_title().get_text() == "learning rate" and [t.get_text() for t in legend.get_texts()] == ["1e-4", "5e-4"]
    caption = accuracy._suptitle.get_text()
    assert caption.count("95% interval") == 1 and "bootstrap" in caption

    # each bar is its configuration's mean over seeds, its error bar the 95% interval summary.csv holds
    with (out / "summary.csv").open() as handle:
        summary = {(r["task"], r["rollout"], r["objective"], r["lr"], r["other"]): r for r in csv.DictReader(handle)}
    row = summary["countdown3", "TeacherRollouts", "ForwardKL", "0.0001", ""]
    countdown = accuracy.axes[1]
    bar = countdown.patches[0]
    assert bar.get_width() == pytest.approx(100 * float(row["val/accuracy mean"]))
    (segments,) = [c.get_segments() for c in countdown.collections[:1]]
    ((low, _), (high, _)) = segments[0]
    assert (low, high) == pytest.approx((100 * float(row["val/accuracy ci_low"]), 100 * float(row["val/accuracy ci_high"])))

    spectrum = figures["spectrum-countdown3"]
    _, entries = check_figure("spectrum-countdown3", spectrum, out)
    assert entries == ["FKL", "RKL"] and "1e-4" in spectrum._suptitle.get_text()  # lam on the x axis, the shared LR in the caption
    _, passes = check_figure("pass_at_k-countdown3", figures["pass_at_k-countdown3"], out)
    assert passes == ["pass@1 FKL", "pass@1 RKL", "pass@2 FKL", "pass@2 RKL"]

    # the fp32 grid alone (8 configurations, 16 runs): every run's loss curve, a colour per configuration
    grid = sorted(path for path in study.iterdir() if path.name.startswith(("TeacherRollouts", "StudentRollouts")))
    figures = report(grid, tmp_path / "grid", monkeypatch)
    _, loss_keys = check_figure("train-loss", figures["train-loss"], tmp_path / "grid")
    assert loss_keys == [f"{r} {kl} {lr}" for r in ("OffPD", "OnPD") for kl in ("FKL", "RKL") for lr in ("1e-4", "5e-4")]
    assert sum(len(ax.lines) for ax in figures["train-loss"].axes) == len(grid)  # every run a line


def test_the_one_run_figure_draws_its_interval_and_its_loss_curve(tmp_path, monkeypatch):
    """One run (the quickstart's report): the bar's error bar is the bootstrap interval of its samples (no note
    drawn over it), and a second figure draws its train/loss curve."""
    run = make_run(tmp_path / "runs", "quickstart", "TeacherRollouts", "ForwardKL", 1e-4, 42, scores=(1, 0, 0, 1, 1, 0, 1, 1))
    out = tmp_path / "report"
    figures = report([run], out, monkeypatch)
    for name, fig in figures.items():
        check_figure(name, fig, out)
    (ax,) = figures["accuracy"].axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["OffPD FKL"] and len(ax.texts) == 0
    assert "lr 1e-4" in figures["accuracy"]._suptitle.get_text()
    with (out / "summary.csv").open() as handle:
        (row,) = csv.DictReader(handle)
    ((low, _), (high, _)) = ax.collections[0].get_segments()[0]
    assert (low, high) == pytest.approx((100 * float(row["val/accuracy ci_low"]), 100 * float(row["val/accuracy ci_high"])))
    assert 0 < low < 62.5 < high  # an interval around the mean, 5 of 8 right
    (loss,) = figures["train-loss"].axes
    (line,) = loss.lines
    expected = [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]
    assert list(line.get_ydata()) == pytest.approx(expected)


def test_settings_that_tell_configurations_apart_make_the_label_and_only_those():
    """A setting shared within every rollout x KL x LR cell is left out (``rollout={}`` that only comes with one
    rollout); of the ones that differ, the fewest that tell the configurations apart, values cut to what differs."""
    from kdlab.study.groups import Group
    from kdlab.study.runs import RunResult

    def group(rollout, parts, lr=1e-4):
        run = RunResult(path=Path("x"), settings={}, task="countdown3", rollout=rollout, lam=None, objective="ForwardKL", lr=lr, seed=42)
        return Group([run], other_parts=parts)

    checkpoint = "runs/study/hard/rollout={}-objective=ForwardKL-seed=42/checkpoints/final.ckpt"
    groups = [
        group("TeacherRollouts", [("rollout", "{}"), ("callbacks.StyleTransfer", "off")]),
        group("TeacherRollouts", [("rollout", "{}"), ("callbacks.StyleTransfer", "on"), ("teacher_temperature", "1.0")]),
        group("TeacherRollouts", [("rollout", "{}"), ("callbacks.StyleTransfer", "off"), ("precision", "bf16-true")]),
        group("StudentRollouts", [("callbacks.StyleTransfer", "off")]),
        group("GRPOModule", [("checkpoint", checkpoint.format("StudentRollouts"))]),
        group("GRPOModule", [("checkpoint", checkpoint.format("TeacherRollouts"))]),
    ]
    assert variant_labels(groups) == ["", "StyleTransfer", "precision=bf16-true", "", "checkpoint=OnPD", "checkpoint=OffPD"]
    assert [lr_label(x) for x in (1e-4, 5e-5, 2.5e-4, 0.001, 1.0)] == ["1e-4", "5e-5", "2.5e-4", "1e-3", "1e0"]


def test_an_in_process_and_a_served_teacher_are_told_apart_by_the_source_class(tmp_path, monkeypatch):
    """The quickstart spells its teacher as a model (``teacher: {path: ..., dtype: ...}``), the served overlay as
    a source class: the labels name the two sources (``teacher=ModelTeacher`` / ``teacher=Served``), not a field
    only one of them has (``dtype=float32``), and the explicit spelling of the same in-process teacher is the
    same configuration as the shorthand."""
    runs = tmp_path / "runs"
    teachers = {
        "in-process": {"path": "kdlab://tiny/teacher", "dtype": "float32"},
        "served": {"class_path": "kdlab.teachers.Served",
                   "init_args": {"server": {"class_path": "kdlab.rollouts.served.ServedTeacher", "init_args": {"url": "http://127.0.0.1:8000"}}}},
        "explicit": {"class_path": "kdlab.teachers.ModelTeacher", "init_args": {"model": {"path": "kdlab://tiny/teacher", "dtype": "float32"}}},
    }
    for name, teacher in teachers.items():
        run = make_run(runs, name, "TeacherRollouts", "ForwardKL", 1e-4, 42 if name != "explicit" else 43)
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["model"]["teacher"] = teacher
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    figures = report([runs / "in-process", runs / "served"], tmp_path / "two", monkeypatch)
    (ax,) = figures["accuracy"].axes
    assert sorted(t.get_text() for t in ax.get_yticklabels()) == ["teacher=ModelTeacher", "teacher=Served"]
    report([runs / "in-process", runs / "explicit"], tmp_path / "same", monkeypatch)
    with (tmp_path / "same" / "summary.csv").open() as handle:
        (row,) = csv.DictReader(handle)  # one configuration, two seeds
    assert row["n"] == "2"


def test_a_learning_rate_has_one_colour_across_figures_and_every_bar_room_to_read(tmp_path, monkeypatch):
    """The tiny world's runs (docs/tiny_world_runs/runs.tar.gz: five LRs of one configuration and a GRPO run): in
    the accuracy bars each bar is at least 0.1 inch tall, and each LR's train-loss line has its bars' colour."""
    import tarfile

    from matplotlib.colors import to_hex

    with tarfile.open(Path(__file__).parents[1] / "docs" / "tiny_world_runs" / "runs.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    monkeypatch.chdir(tmp_path)
    figures = {}
    monkeypatch.setattr("kdlab.study.report._write_tensorboard", lambda directory, figs, text: figures.update(figs))
    main(["report", "runs/tiny-world", "--output", "out", "--low_lr", "1e-4", "--high_lr", "2e-3"])
    accuracy, loss = figures["accuracy"], figures["train-loss"]
    (ax,) = accuracy.axes
    bars = [patch for container in ax.containers for patch in getattr(container, "patches", [])]
    inches = accuracy.get_size_inches()[1] * ax.get_position().height / abs(ax.get_ylim()[0] - ax.get_ylim()[1])
    assert len(bars) >= 6 and min(bar.get_height() for bar in bars) * inches >= 0.1
    legend = accuracy.legends[0]
    bar_colour = {text.get_text(): to_hex(handle.get_facecolor()) for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    line_colour = {text.get_text().rsplit(" ", 1)[-1]: to_hex(handle.get_color()) for text, handle in zip(loss.legends[0].get_texts(), loss.legends[0].legend_handles)}
    assert len(line_colour) == 6 and line_colour == bar_colour  # the GRPO run's 5e-4 too


def test_chain_labels_drop_the_parts_every_checkpoint_shares_and_the_curves_merge_the_seeds():
    """RLVR chains named by the distilled run they start from: the learning rate every start shares goes from the
    label (it was cut to ``checkpoint=OnPD-FKL…1`` at 18 characters), the seed stays in a chain's label, and a
    curves figure colours the chains of one configuration alike."""
    from kdlab.study.figure_labels import without_seed
    from kdlab.study.groups import Group
    from kdlab.study.runs import RunResult

    def chain(rollout, objective, seed):
        run = RunResult(path=Path("x"), settings={}, task="countdown3s", rollout="GRPOModule", lam=None, objective="GRPOModule", lr=2e-5, seed=42)
        path = f"runs/reasoning-study/distill/rollout={rollout}-objective={objective}-lr=0.0001-seed={seed}/checkpoints/final.ckpt"
        return Group([run], other_parts=[("checkpoint", path)])

    groups = [chain(r, o, s) for r in ("StudentRollouts", "TeacherRollouts") for o in ("ForwardKL", "ReverseKL") for s in (42, 43)]
    labels = variant_labels(groups)
    assert labels[:2] == ["checkpoint=OnPD-FKL-seed=42", "checkpoint=OnPD-FKL-seed=43"] and labels[-1] == "checkpoint=OffPD-RKL-seed=43"
    assert sorted({without_seed(label) for label in labels}) == ["checkpoint=OffPD-FKL", "checkpoint=OffPD-RKL", "checkpoint=OnPD-FKL", "checkpoint=OnPD-RKL"]


def test_the_pass_at_k_figure_names_the_interval_of_every_metric_it_plots(tmp_path, monkeypatch):
    """val/pass@k's error bars are a bootstrap over problems, a Coverage callback's pass@1 a Wilson interval: the
    pass@k-against-lam figure's caption names both, each with its metrics, not only the first metric's."""
    root = tmp_path / "runs"
    coverage = {"class_path": "kdlab.callbacks.Coverage", "init_args": {"name": "countdown4e", "examples": 50, "samples": 4,
                                                                        "task": COUNTDOWN3}}
    for seed in (42, 43):
        for lam in (-0.5, 0.5):
            run = make_run(root, f"mix-{lam}-{seed}", "MixtureRollouts", "ForwardKL", 1e-4, seed, lam=lam,
                           extra=[{"step": 3, "coverage/countdown4e/pass@1": 0.2 + lam / 10 + seed / 1000}])
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["trainer"]["callbacks"] = [coverage]
            (run / "config.yaml").write_text(yaml.safe_dump(config))
    figures = report([root], tmp_path / "report", monkeypatch)
    caption = " ".join(figures["pass_at_k-countdown3"]._suptitle.get_text().split())
    assert "val/pass@1, val/pass@2: 95% interval, bootstrap over problems" in caption
    assert "coverage/countdown4e/pass@1: 95% Wilson interval" in caption
