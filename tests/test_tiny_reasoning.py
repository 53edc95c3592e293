"""The tiny reasoning world (kdlab/tiny/reasoning.py, kdlab/assets/tiny-reasoning): its slipped chains, the
harder set with the student's problems removed, the build, and that the packaged card is the build's."""

import json
import random
from pathlib import Path

import pytest
import yaml

from kdlab.models.loading import ASSETS
from kdlab.tasks.countdown import verify
from kdlab.tiny.reasoning import (
    RECIPE,
    TARGETS,
    UnseenCountdown,
    build_reasoning,
    chain_arithmetic_holds,
    harder_task,
    model_card,
    slip,
    student_countdown_task,
    student_rows,
    target_met,
)

ROOT = Path(__file__).parents[1]
WORLD = ASSETS / "tiny-reasoning"
QUICKSTART = ROOT / "experiments" / "reasoning" / "quickstart.yaml"


def test_a_slipped_product_is_one_too_high_and_the_next_step_carries_it_on():
    always, never = random.Random(0), random.Random(0)
    assert slip("25*9=225,225-7=218", always, 1.0) == "25*9=226,226-7=219"
    assert slip("4*2=8,9+8=17", always, 1.0) == "4*2=9,9+9=18"  # the carried value replaces the right operand
    assert slip("10-9=1,50*1=50", always, 1.0) == "10-9=1,50*1=51"
    assert slip("3*4=12,12/6=2", always, 1.0) == "3*4=12,12/6=2"  # 13/6 is not whole: the chain is left as it was
    assert slip("25*9=225,225-7=218", never, 0.0) == "25*9=225,225-7=218"
    assert not verify([7, 9, 25], 218, "<answer>25*9=226,226-7=219</answer>")


def test_chain_arithmetic_is_judged_apart_from_the_target():
    assert chain_arithmetic_holds("<think>x</think><answer>25*9=225,225-7=218</answer>") is True
    assert chain_arithmetic_holds("<answer>25*9=226,226-7=219</answer>") is False
    assert chain_arithmetic_holds("<answer>(6+1)*3</answer>") is None
    assert chain_arithmetic_holds("no answer") is None


def test_the_students_chains_all_have_the_tasks_format_and_only_slipped_ones_are_false():
    recipe = dict(RECIPE, student_countdown=400, skill_examples={"addition": 10, "sorting": 10, "reversal": 10, "counting": 10})
    rows = student_rows(recipe)
    examples = student_countdown_task(recipe).examples("train")
    chains = rows[-len(examples):]
    assert len(rows) == 40 + len(examples)
    holds = [chain_arithmetic_holds(row["completion"]) for row in chains]
    assert None not in holds  # every response answers with a chain of equations
    for example, row, true in zip(examples, chains, holds):
        assert true == verify(example["nums"], example["target"], row["completion"])
        if not true:
            assert "*" in example["solution"]
    share = holds.count(False) / sum("*" in e["solution"] for e in examples)
    assert 0.45 < share < 0.75  # about slip_share of the chains with a multiplication (one slip is enough)


def test_the_harder_set_draws_each_problem_once_and_none_the_student_saw():
    task = harder_task(RECIPE, problems=60)
    rows = task.examples("val")
    problems = [(tuple(sorted(r["nums"])), r["target"]) for r in rows]
    assert len(rows) == 60 and len(set(problems)) == 60
    assert not set(problems) & task.excluded()
    assert all(1 <= target <= 20 for _, target in problems)
    assert len(task.excluded()) > 1000


def test_unseen_countdown_names_a_malformed_exclusion():
    with pytest.raises(ValueError, match=r"exclude\[1\] lacks \['num_train'\]"):
        UnseenCountdown(exclude=[{"variant": "countdown3", "seed": 1, "num_train": 5}, {"variant": "countdown3", "seed": 2}])


def test_the_quickstarts_harder_set_is_the_worlds_without_rlvrs_training_problems():
    """The world's harder set (the build's exclusions), less RLVR's training split (experiments/reasoning/rlvr.yaml)."""
    config = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    coverage = [c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"] == "kdlab.callbacks.Coverage"]
    harder = next(c["task"]["init_args"] for c in coverage if c.get("name") == "harder")
    task = harder_task(RECIPE)
    rlvr = yaml.safe_load((ROOT / "experiments/reasoning/rlvr.yaml").read_text(encoding="utf-8"))["model"]["init_args"]["task"]["init_args"]
    assert harder["exclude"] == task.exclude + [{"variant": rlvr["variant"], "seed": 42, "num_train": rlvr["num_train"]}]
    assert harder["variant"] == task.variant and harder["num_val"] == RECIPE["harder_problems"]
    distill = config["model"]["task"]["init_args"]
    assert {"variant": distill["variant"], "seed": config["seed_everything"], "num_train": distill["num_train"]} in task.exclude
    assert config["model"]["student"]["path"] == "kdlab://tiny-reasoning/student"


def test_the_quickstarts_forgetting_probes_are_the_worlds_skills():
    from kdlab.tiny.reasoning import skills

    config = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    probes = next(c["init_args"]["tasks"] for c in config["trainer"]["callbacks"] if c["class_path"] == "kdlab.callbacks.OODForgetting")
    assert [p["class_path"].rsplit(".", 1)[1] for p in probes] == [type(t).__name__ for t in skills(RECIPE)]
    for probe, task in zip(probes, skills(RECIPE)):
        settings = probe["init_args"]
        assert settings.get("max_digits", getattr(task, "max_digits", None)) == getattr(task, "max_digits", None)
        assert tuple(settings.get("lengths", getattr(task, "lengths", ()))) == getattr(task, "lengths", ())


@pytest.mark.slow
def test_a_small_build_copies_the_teacher_trains_the_student_and_writes_its_card(tmp_path):
    recipe = dict(RECIPE, student_countdown=48, skill_examples={"addition": 8, "sorting": 8, "reversal": 8, "counting": 8}, student_epochs=1,
                  eval_examples=4, harder_problems=3, harder_samples=2)
    measured = build_reasoning(tmp_path / "world", recipe)
    world = tmp_path / "world"
    assert (world / "teacher" / "model.safetensors").read_bytes() == (ASSETS / "tiny" / "teacher" / "model.safetensors").read_bytes()
    saved = json.loads((world / "metrics.json").read_text())
    assert saved["recipe"] == recipe and saved["measured"] == json.loads(json.dumps(measured))
    assert (world / "MODEL_CARD.md").read_text(encoding="utf-8") == model_card(recipe, saved["measured"])
    assert set(measured["student"]["harder_pass_at_k"]) == {"1"} and measured["student"]["countdown3_greedy"]["n"] == 4
    assert not (tmp_path / "world.build").exists()


# ---- the packaged world --------------------------------------------------------------------------------
def test_the_packaged_card_and_metrics_are_the_builds_for_the_current_recipe():
    saved = json.loads((WORLD / "metrics.json").read_text(encoding="utf-8"))
    assert saved["recipe"] == RECIPE
    assert (WORLD / "MODEL_CARD.md").read_text(encoding="utf-8") == model_card(saved["recipe"], saved["measured"])


def test_the_packaged_teacher_is_the_tiny_worlds():
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (WORLD / "teacher" / name).read_bytes() == (ASSETS / "tiny" / "teacher" / name).read_bytes()
    assert (WORLD / "student" / "tokenizer.json").read_bytes() == (ASSETS / "tiny" / "teacher" / "tokenizer.json").read_bytes()


def test_the_packaged_world_meets_its_targets():
    measured = json.loads((WORLD / "metrics.json").read_text(encoding="utf-8"))["measured"]
    missed = [label for role, key, op, bound, label in TARGETS if not target_met(measured[role][key]["value"], op, bound)]
    assert not missed, f"tiny-reasoning misses: {missed}"


def test_the_packaged_student_writes_the_chain_but_its_arithmetic_fails_where_the_teachers_holds():
    """What the card and docs/tiny_reasoning.md say the world is: the format is there, the arithmetic is not."""
    measured = json.loads((WORLD / "metrics.json").read_text(encoding="utf-8"))["measured"]
    student, teacher = measured["student"], measured["teacher"]
    assert student["chain_format_share"]["low"] >= 0.9
    assert student["chain_arithmetic_true_share"]["high"] < 0.5 < teacher["chain_arithmetic_true_share"]["low"]


def test_the_packaged_student_writes_chains_on_a_few_problems():
    """A cheap check of the card's format claim on 12 held-out problems (the card measures 200)."""
    from kdlab.evaluation.scoring import completion_texts
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.tiny.reasoning import countdown

    spec = ModelSpec("kdlab://tiny-reasoning/student")
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    task = countdown(num_train=0, num_val=12, num_test=0)
    texts = completion_texts(model, tokenizer, task, task.examples("val"), max_new_tokens=80)
    assert sum(chain_arithmetic_holds(text) is not None for text in texts) >= 10


# ---- docs/tiny_reasoning.md -----------------------------------------------------------------------------
PAGE = ROOT / "docs" / "tiny_reasoning.md"
REPORT = ROOT / "experiments" / "reasoning" / "quickstart_report"


def _table_rows(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.startswith("|") and any(c.isdigit() for c in line) and not set(line) <= set("|- :")]


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 3)
    return text[start : end if end >= 0 else None]


def _quickstart_run() -> dict[str, str]:
    import csv

    with (REPORT / "runs.csv").open(encoding="utf-8") as handle:
        (run,) = list(csv.DictReader(handle))
    return run


@pytest.mark.parametrize("heading", ["Before distillation", "The harder set"])
def test_the_pages_measurements_are_the_model_cards_rows(heading):
    quoted = _table_rows(_section(PAGE.read_text(encoding="utf-8"), heading))
    card = set(_table_rows((WORLD / "MODEL_CARD.md").read_text(encoding="utf-8")))
    assert quoted and [row for row in quoted if row not in card] == []


def test_the_harder_set_is_covered_by_the_teachers_training_as_the_page_says():
    measured = json.loads((WORLD / "metrics.json").read_text(encoding="utf-8"))["measured"]
    assert measured["harder_set"]["share_in_teacher_training"] == 1.0
    assert "The teacher's own training phases cover all of them" in " ".join(PAGE.read_text(encoding="utf-8").split())


def test_the_pages_quickstart_table_is_the_runs_before_and_after():
    from kdlab.tiny.reasoning import before_after_rows

    run = _quickstart_run()
    assert run["run"].startswith("runs/reasoning-quickstart/") and run["objective"] == "ForwardKL" and run["rollout"] == "TeacherRollouts"
    quoted = _table_rows(_section(PAGE.read_text(encoding="utf-8"), "The quickstart on this world"))
    assert quoted == before_after_rows(run)


def test_the_quickstart_run_meets_the_worlds_distillation_target():
    """The issue's target: OffPD raises held-out Countdown-3 by at least 15 points from at least 10%."""
    run = _quickstart_run()
    before, after = float(run["coverage/countdown3/pass@1_before"]), float(run["coverage/countdown3/pass@1"])
    assert before >= 0.10 and after - before >= 0.15


WORLDS = {
    "kdlab://tiny": ["quickstart.md", "tiny_world.md", "tiny_reproduction.md", "cross_tokenizer.md", "several_teachers.md", "teachers.md", "stages.md"],
    "SmolLM2-135M-Instruct": ["real_model.md"],
    "kdlab://tiny-reasoning": ["tiny_reasoning.md"],
}


def test_the_page_says_which_world_each_page_uses_and_each_page_uses_it():
    table = _section(PAGE.read_text(encoding="utf-8"), "Which world each page uses")
    for world, pages in WORLDS.items():
        for page in pages:
            assert f"| [{page}]({page}) | {world} |" in table, (page, world)
            text = (ROOT / "docs" / page).read_text(encoding="utf-8")
            if world == "kdlab://tiny":
                assert "kdlab://tiny/" in text or "experiments/tiny/" in text, page
                assert "experiments/reasoning/" not in text and "kdlab://tiny-reasoning/" not in text, page
            else:
                assert world in text, page


def test_the_study_page_names_every_experiment_file_of_the_world_and_the_files_match_it():
    """Each experiments/reasoning YAML is named on the page; the study's files hold what the page says (80 runs per
    grid, 20 RLVR chains at 0.2x the low LR from the low-LR runs of seeds 42-46, every split excluded from the harder set)."""
    from kdlab.study.grid import expand, load_sweep
    from kdlab.study.pipeline import load_pipeline

    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    for path in sorted((ROOT / "experiments" / "reasoning").glob("*.yaml")):
        assert f"experiments/reasoning/{path.name}" in text or f"`{path.name}`" in text, path.name
    import os

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        assert len(expand(load_sweep("experiments/reasoning/grid.yaml"))) == 80
        assert len(expand(load_sweep("experiments/reasoning/bf16_grid.yaml"))) == 80
        pipeline = load_pipeline("experiments/reasoning/rlvr_pipeline.yaml")
        chains = [run for run in expand(pipeline.distill) if pipeline.chains_from(run)]
        assert len(chains) == 20 and {run.seed for run in chains} == {42, 43, 44, 45, 46}
        assert {run.settings["model.lr"] for run in chains} == {1.0e-4}
        assert {run.name for run in expand(pipeline.distill)} == {run.name for run in expand(load_sweep("experiments/reasoning/grid.yaml"))}
    finally:
        os.chdir(here)
    rlvr = yaml.safe_load((ROOT / "experiments/reasoning/rlvr.yaml").read_text())
    assert rlvr["model"]["init_args"]["lr"] == pytest.approx(0.2 * 1.0e-4)
    quickstart = yaml.safe_load((ROOT / "experiments/reasoning/quickstart.yaml").read_text())
    harder = lambda callbacks: next(c for c in callbacks if c["init_args"].get("name") == "harder")["init_args"]  # noqa: E731
    training = {(s["variant"], s["seed"], s["num_train"]) for s in harder(quickstart["trainer"]["callbacks"])["task"]["init_args"]["exclude"]}
    from kdlab.tasks import Countdown

    for settings in (quickstart["model"]["task"]["init_args"], rlvr["model"]["init_args"]["task"]["init_args"]):
        task = Countdown(**settings)  # its training problems come from its own seed (not the run's seed_everything)
        assert (task.variant, task.seed, task.sizes["train"]) in training
    def problems(callbacks):  # the harder set's settings but where its scores before training are kept
        return {key: value for key, value in harder(callbacks).items() if key != "before_cache"}

    assert problems(quickstart["trainer"]["callbacks"]) == problems(rlvr["trainer"]["callbacks"])  # the same problems in both stages


def test_the_experiments_harder_set_shares_19_of_100_problems_with_the_cards_as_the_page_says():
    """The model card's harder set excludes the build's chains and the quickstart's prompts; the experiment files also
    exclude RLVR's training problems: the page says 81 of the experiments' 100 problems are not the card's."""
    from kdlab.tiny.reasoning import UnseenCountdown, _problem

    quickstart = yaml.safe_load((ROOT / "experiments/reasoning/quickstart.yaml").read_text())
    settings = next(c for c in quickstart["trainer"]["callbacks"] if c["init_args"].get("name") == "harder")["init_args"]["task"]["init_args"]
    card = dict(settings, exclude=[s for s in settings["exclude"] if s["variant"] == "countdown3"])
    problems = [{_problem(e) for e in UnseenCountdown(**kw).examples("val")} for kw in (settings, card)]
    assert settings["num_val"] == 100 and len(problems[0] - problems[1]) == 81
    assert "so 81 of their 100 problems are not the card's" in " ".join(PAGE.read_text(encoding="utf-8").split())


def test_the_archived_study_runs_come_from_the_one_clean_commit_the_page_names_for_each_archive():
    import re
    import tarfile

    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    named = dict(re.findall(r"`(\w+\.tar\.gz)` \([^)]*\) from commit `([0-9a-f]{7})`", text))
    archives = sorted(p.name for p in (ROOT / "experiments/reasoning/study_runs").glob("*.tar.gz"))
    assert sorted(named) == archives and "grid.tar.gz" in named
    for name, commit in named.items():
        with tarfile.open(ROOT / "experiments/reasoning/study_runs" / name) as archive:
            infos = [json.load(archive.extractfile(m)) for m in archive.getmembers() if m.name.endswith("/run_info.json")]
            done = [m for m in archive.getmembers() if m.name.endswith("/DONE")]
        assert infos and len(infos) == len(done)
        assert {info["git_commit"][:7] for info in infos} == {commit} and not any(info.get("git_dirty") for info in infos)


def test_the_pages_verdict_blocks_are_the_study_reports():
    """docs/tiny_reasoning.md's generated blocks are what scripts/tiny_reproduction_page.py copies from
    docs/tiny_reasoning/verdicts.md, and the rows this study's design leaves to another study say so."""
    import csv
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_reproduction_page.py"), "--page", "docs/tiny_reasoning.md",
                           "--report", "docs/tiny_reasoning", "--rerun", "experiments/reasoning/provenance.json", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    with (ROOT / "docs" / "tiny_reasoning" / "verdicts.csv").open(encoding="utf-8") as handle:
        verdicts = {row["finding"]: row for row in csv.DictReader(handle)}
    assert len(verdicts) == 8
    assert {f for f, row in verdicts.items() if row["verdict"] == "not tested here"} == {
        f for f in verdicts if f.startswith("Spectrum") or "Spanish" in f}


@pytest.mark.slow
def test_the_committed_verdicts_are_what_kdlab_report_writes_from_the_archived_runs(tmp_path, monkeypatch):
    """Every archived run of experiments/reasoning/study_runs/ restored, the report command the page names gives
    docs/tiny_reasoning/verdicts.md byte for byte."""
    import tarfile

    from kdlab.study.report import main as report

    for archive in sorted((ROOT / "experiments" / "reasoning" / "study_runs").glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path, filter="data")
    monkeypatch.chdir(tmp_path)
    report(["runs/reasoning-study", "--low_lr", "1e-4", "--high_lr", "5e-4", "--design", str(ROOT / "experiments/reasoning/design.yaml"),
            "--output", str(tmp_path / "out")])
    committed = (ROOT / "docs" / "tiny_reasoning" / "verdicts.md").read_text(encoding="utf-8")
    assert (tmp_path / "out" / "verdicts.md").read_text(encoding="utf-8") == committed


def test_the_provenance_record_reruns_every_cell_and_the_differing_runs_are_the_ones_the_page_names():
    """experiments/reasoning/provenance.json: every grid cell has a rerun (its lowest seed), every rerun of an archived
    run compared; the runs whose samples differ are reverse KL at the high LR, as the page says, and nothing failed."""
    record = json.loads((ROOT / "experiments" / "reasoning" / "provenance.json").read_text())
    runs = {r["run"]: r for r in record["runs"]}
    cells = {name.rsplit("-seed=", 1)[0] for name in runs}
    assert len(cells) == 8 and all(f"{cell}-seed=42" in runs for cell in cells)
    assert all(r["status"] in ("identical", "differs") for r in runs.values())
    differ = sorted(name for name, r in runs.items() if r["status"] == "differs")
    assert differ and all("objective=ReverseKL-lr=0.0005" in name for name in differ)
    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    assert "The two runs that differ are both reverse KL at the high LR" in text and len(differ) == 2
    chain_starts = [r for r in runs.values() if r["rerun"].startswith("runs/reasoning-study/distill/")]
    assert len(chain_starts) == 20 and all(r["status"] == "identical" for r in chain_starts)  # "each rerun's samples are byte-identical"
