"""The tiny reasoning world (``kdlab://tiny-reasoning``): a student that writes the task's format but slips.

``python -m kdlab.tiny reasoning`` builds ``kdlab/assets/tiny-reasoning``:

* the teacher (and the tokenizer) are the tiny world's (``kdlab://tiny/teacher``), copied unchanged;
* the student is the tiny world's (``kdlab://tiny/student``) trained further on Countdown-3 only in the
  task's own format, the ``<think>`` steps in words and the ``<answer>`` chain of equations the verifier
  requires, but with weak arithmetic: in a seeded share (``slip_share``) of the multiplication steps of
  these chains the product is written one too high, and the steps after it carry the wrong value on, so
  the chain misses the target. The teacher's signal is the arithmetic, not the format.
* its earlier skills are harder than the tiny world's (3-digit addition; sorting, reversal and counting
  of longer lists and words) and learned from few examples, so they start below ceiling and forgetting
  can show.

The harder set is :class:`UnseenCountdown`: Countdown-3 with small targets (``countdown3s``), every
problem the student saw (its build data and the distillation prompts) removed.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kdlab.tasks import Addition, Countdown
from kdlab.tiny.build import recipe_lines
from kdlab.tasks.base import Example, Task, last_tagged
from kdlab.tasks.skills import Counting, Reversal, Sorting

RECIPE: dict[str, Any] = {
    "teacher_from": "tiny",  # kdlab/assets/<teacher_from>/teacher, copied with its tokenizer
    "student_from": "tiny",  # kdlab/assets/<student_from>/student, trained further
    "student_countdown": 8000,
    "slip_share": 0.65,  # share of the training chains' multiplication steps written one too high
    "addition_digits": 3,
    "skill_lengths": {"sorting": [7, 10], "reversal": [8, 12], "counting": [14, 22]},
    "skill_examples": {"addition": 3000, "sorting": 1000, "reversal": 1000, "counting": 1000},
    "student_epochs": 2,
    "student_lr": 1e-3,
    "batch_size": 64,
    "eval_examples": 200,
    "sample_temperature": 0.5,  # the quickstart's Coverage and val sampling temperature
    "harder_problems": 100,
    "harder_samples": 32,
    "harder_temperature": 1.0,
    "data_seed": 2234,
}

DISTILLATION_TRAIN = {"variant": "countdown3", "seed": 42, "num_train": 5000}
"""The distillation prompts of experiments/reasoning (the quickstart's ``model.task``): excluded from the harder set."""

_CHAIN = re.compile(r"^\d+[+\-*/]\d+=\d+(,\d+[+\-*/]\d+=\d+)*$")
_STEP = re.compile(r"^(\d+)([+\-*/])(\d+)=(\d+)$")


def _value(a: int, op: str, b: int) -> int | None:
    """``a op b`` when it is a whole number, else None."""
    if op == "/":
        return a // b if b and a % b == 0 else None
    return a + b if op == "+" else a - b if op == "-" else a * b


def slip(solution: str, draw: random.Random, share: float) -> str:
    """``solution`` with each multiplication step's product written one too high with probability ``share``;
    later steps carry the written value on (a step that would become an inexact division is left as it was,
    and so is every step after it).

    ``slip("25*9=225,225-7=218", ...)`` -> ``"25*9=226,226-7=219"`` when the slip is drawn.
    """
    true_prev = written = None
    out = []
    for step in solution.split(","):
        a, op, b, value = _STEP.match(step).groups()
        a, b, true_value = int(a), int(b), int(value)
        if true_prev != written:  # the previous step's value as written replaces its true value here
            a, b = (written, b) if a == true_prev else (a, written) if b == true_prev else (a, b)
        value = _value(a, op, b)
        if value is None:
            return solution
        if op == "*" and draw.random() < share:
            value += 1
        out.append(f"{a}{op}{b}={value}")
        true_prev, written = true_value, value
    return ",".join(out)


def chain_arithmetic_holds(completion: str) -> bool | None:
    """Whether every equation of the completion's ``<answer>`` chain is arithmetically true (whatever the
    target); None when the answer is not a chain of equations."""
    answer = last_tagged(completion)
    if answer is None or not _CHAIN.match(answer.strip()):
        return None
    return all(_value(int(a), op, int(b)) == int(v) for a, op, b, v in (_STEP.match(s).groups() for s in answer.strip().split(",")))


def countdown(variant: str = "countdown3", **kwargs: Any) -> Countdown:
    """The world's Countdown prompting (the tiny world's: only the ``Numbers``/``Target`` lines)."""
    from kdlab.tiny.world import countdown as tiny_countdown

    return tiny_countdown(variant, **kwargs)


def skills(recipe: dict[str, Any] = RECIPE, num_train: dict[str, int] | None = None, num_val: int = 200, seed: int = 0) -> list[Task]:
    """The earlier-skill probes of this world, harder than the tiny world's: ``recipe["addition_digits"]``-digit
    addition, and sorting, reversal and counting of the longer ``recipe["skill_lengths"]``; no system prompt;
    ``num_train`` examples per skill (default none)."""
    sizes, lengths = num_train or {}, recipe["skill_lengths"]
    common = {"num_val": num_val, "num_test": num_val, "seed": seed, "system_prompt": ""}
    return [Addition(max_digits=recipe["addition_digits"], num_train=sizes.get("addition", 0), **common),
            *(skill(num_train=sizes.get(skill.name, 0), lengths=tuple(lengths[skill.name]), **common) for skill in (Sorting, Reversal, Counting))]


def student_countdown_task(recipe: dict[str, Any] = RECIPE) -> Countdown:
    return countdown(num_train=recipe["student_countdown"], num_val=0, num_test=0, seed=recipe["data_seed"] + 1)


def student_rows(recipe: dict[str, Any] = RECIPE) -> list[dict[str, Any]]:
    """The student's SFT rows: the skills, and Countdown-3 chains with slipped products (English)."""
    from kdlab.tiny.world import skill_rows, trace

    draw = random.Random(recipe["data_seed"])
    task = student_countdown_task(recipe)
    rows = skill_rows(skills(recipe, recipe["skill_examples"], num_val=0, seed=recipe["data_seed"]))
    for example in task.examples("train"):
        rows.append({"id": example["id"], "messages": task.student_messages(example),
                     "completion": trace(slip(example["solution"], draw, recipe["slip_share"]), "english")})
    return rows


def _problem(example: Example) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(example["nums"])), example["target"]


class UnseenCountdown(Countdown):
    """Countdown whose held-out problems (val and test) are each drawn once and none of them is a problem
    (operand multiset and target) of any ``exclude`` training split.

    Args:
        exclude: training splits to remove, each ``{"variant", "seed", "num_train"}`` of a :class:`Countdown`.
        **kwargs: :class:`Countdown`'s.
    """

    def __init__(self, exclude: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exclude = list(exclude or [])
        for index, split in enumerate(self.exclude):
            missing = {"variant", "seed", "num_train"} - set(split)
            if missing:
                raise ValueError(f"UnseenCountdown.exclude[{index}] lacks {sorted(missing)}")

    def excluded(self) -> set[tuple[tuple[int, ...], int]]:
        seen = set()
        for split in self.exclude:
            task = Countdown(variant=split["variant"], seed=split["seed"], num_train=split["num_train"], num_val=0, num_test=0)
            seen |= {_problem(example) for example in task.examples("train")}
        return seen

    def load_split(self, split: str) -> list[Example]:
        if split == "train" or not self.sizes[split]:
            return super().load_split(split)
        seen, wanted, rows = self.excluded(), self.sizes[split], []
        drawn = wanted
        while len(rows) < wanted:
            drawn *= 2
            if drawn > 1000 * wanted:
                raise ValueError(f"UnseenCountdown: fewer than {wanted} unseen {self.variant} problems in {split}")
            pool = Countdown(variant=self.variant, seed=self.seed, num_train=0, num_val=drawn, num_test=drawn).load_split(split)
            rows, kept = [], set(seen)
            for example in pool:
                if _problem(example) not in kept:
                    kept.add(_problem(example))
                    rows.append(dict(example, id=f"{self.variant}-unseen-{split}-{len(rows)}"))
        return rows[:wanted]


def harder_task(recipe: dict[str, Any] = RECIPE, problems: int | None = None) -> UnseenCountdown:
    """The harder set: ``countdown3s`` problems the student never saw (its build chains, the distillation prompts)."""
    student = {"variant": "countdown3", "seed": recipe["data_seed"] + 1, "num_train": recipe["student_countdown"]}
    return UnseenCountdown(exclude=[student, DISTILLATION_TRAIN], variant="countdown3s", instruction=False, system_prompt="",
                           num_train=0, num_val=problems or recipe["harder_problems"], num_test=0)


def teacher_overlap(task: Countdown, phases: list[dict[str, Any]]) -> float:
    """Share of ``task``'s val problems that are problems of the teacher's Countdown-3 training phases."""
    seen = set()
    for phase in phases:
        seen |= {_problem(e) for e in countdown(num_train=phase["countdown"], num_val=0, num_test=0, seed=phase["data_seed"]).examples("train")}
    rows = task.examples("val")
    return sum(_problem(e) in seen for e in rows) / len(rows)


# ---- measuring ---------------------------------------------------------------------------------------
def _with_interval(correct: int, n: int) -> dict[str, float]:
    from kdlab.study.stats import wilson_interval

    low, high = wilson_interval(correct / n, n)
    return {"value": correct / n, "low": low, "high": high, "n": n}


def measure(model_dir: Path, recipe: dict[str, Any] = RECIPE) -> dict[str, Any]:
    """Held-out scores of one model of this world, each ``{"value", "low", "high", "n"}`` (95% Wilson):
    Countdown-3 greedy and sampled once at ``sample_temperature`` (seeded), the share of greedy answers that
    are a chain of equations and of chains whose every equation is true, the skill probes (greedy), and the
    harder set's pass@k (``harder_samples`` samples per problem at ``harder_temperature``, unbiased estimator)."""
    from kdlab.evaluation.metrics import pass_at_k
    from kdlab.evaluation.scoring import completion_texts
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec(str(model_dir))
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    n = recipe["eval_examples"]
    task = countdown(num_train=0, num_val=n, num_test=0)
    examples = task.examples("val")
    greedy = completion_texts(model, tokenizer, task, examples, temperature=0.0, max_new_tokens=96, batch_size=50)
    sampled = completion_texts(model, tokenizer, task, examples, temperature=recipe["sample_temperature"], max_new_tokens=96,
                               batch_size=50, generator=torch.Generator().manual_seed(0))
    holds = [chain_arithmetic_holds(text) for text in greedy]
    chains = [h for h in holds if h is not None]
    results: dict[str, Any] = {
        "countdown3_greedy": _with_interval(sum(task.score(e, t) >= 1.0 for e, t in zip(examples, greedy)), n),
        "countdown3_sampled": _with_interval(sum(task.score(e, t) >= 1.0 for e, t in zip(examples, sampled)), n),
        "chain_format_share": _with_interval(len(chains), n),
        "chain_arithmetic_true_share": _with_interval(sum(chains), max(1, len(chains))),
    }
    for skill in skills(recipe, num_val=n):
        rows = skill.examples("val")
        texts = completion_texts(model, tokenizer, skill, rows, temperature=0.0, max_new_tokens=24, batch_size=100)
        results[f"{type(skill).__name__.lower()}"] = _with_interval(sum(skill.score(e, t) >= 1.0 for e, t in zip(rows, texts)), n)
    harder, samples = harder_task(recipe), recipe["harder_samples"]
    rows = harder.examples("val")
    texts = completion_texts(model, tokenizer, harder, [row for row in rows for _ in range(samples)], temperature=recipe["harder_temperature"],
                             max_new_tokens=64, batch_size=200, generator=torch.Generator().manual_seed(0))
    correct = [sum(harder.score(row, texts[i * samples + j]) >= 1.0 for j in range(samples)) for i, row in enumerate(rows)]
    results["harder_pass_at_k"] = {str(k): sum(pass_at_k(samples, c, k) for c in correct) / len(correct) for k in (1, 4, 16, 32) if k <= samples}
    results["parameters"] = sum(p.numel() for p in model.parameters())
    return results


# ---- building ----------------------------------------------------------------------------------------
def build_reasoning(out_dir: Path, recipe: dict[str, Any] = RECIPE) -> dict[str, Any]:
    """Copy the tiny world's teacher, train the tiny world's student further into this world's (one thread,
    fixed seeds), measure both,
    and write ``teacher/``, ``student/``, ``metrics.json`` and ``MODEL_CARD.md`` to ``out_dir``."""
    from lightning.pytorch import seed_everything

    from kdlab.models.loading import ASSETS
    from kdlab.tiny.build import RECIPE as TINY_RECIPE
    from kdlab.tiny.build import _train

    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and makes the build repeatable
    seed_everything(0, workers=True)
    started = time.time()
    work = out_dir.with_name(out_dir.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(ASSETS / recipe["teacher_from"] / "teacher", work / "teacher")
    shutil.copytree(ASSETS / recipe["student_from"] / "student", work / "student")
    _train(work / "student", student_rows(recipe), recipe["student_epochs"], recipe["student_lr"], recipe["batch_size"], work / "logs", "student")

    measured: dict[str, Any] = {role: measure(work / role, recipe) for role in ("teacher", "student")}
    harder = harder_task(recipe)
    measured["harder_set"] = {"variant": harder.variant, "problems": len(harder.examples("val")),
                              "share_in_teacher_training": teacher_overlap(harder, TINY_RECIPE["teacher_phases"])}
    measured["build_seconds"] = round(time.time() - started)
    (work / "metrics.json").write_text(json.dumps({"recipe": recipe, "measured": measured}, indent=2) + "\n")
    (work / "MODEL_CARD.md").write_text(model_card(recipe, measured), encoding="utf-8")
    shutil.rmtree(work / "logs", ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    work.rename(out_dir)
    print(json.dumps(measured, indent=2))
    return measured


TARGETS = (
    ("teacher", "countdown3_greedy", ">=", 0.75, "teacher greedy Countdown-3 accuracy"),
    ("student", "chain_format_share", ">=", 0.90, "student greedy answers that are a chain of equations (the task's format)"),
    ("student", "countdown3_greedy", ">=", 0.10, "student greedy Countdown-3 accuracy before distillation"),
    ("student", "countdown3_sampled", ">=", 0.10, "student Countdown-3 accuracy before distillation, one sample at T = 0.5"),
    ("student", "countdown3_greedy", "<=", 0.40, "student greedy Countdown-3 accuracy before distillation (room to learn)"),
    ("student", "addition", "<", 0.90, "student 3-digit addition"),
    ("student", "sorting", "<", 0.90, "student sorting"),
    ("student", "reversal", "<", 0.90, "student reversal"),
    ("student", "counting", "<", 0.90, "student counting"),
)


def target_met(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound if op == "<=" else value < bound


def _pct(score: dict[str, float]) -> str:
    return f"{100 * score['value']:.1f}% [{100 * score['low']:.1f}, {100 * score['high']:.1f}]"


def model_card(recipe: dict[str, Any], measured: dict[str, Any]) -> str:
    """The world's model card: how it was built, and its before-distillation scores with 95% Wilson intervals."""
    teacher, student = measured["teacher"], measured["student"]
    lines = [
        "# kdlab tiny reasoning world: teacher and student (`kdlab://tiny-reasoning`)",
        "",
        "Built by `python -m kdlab.tiny reasoning` (kdlab/tiny/reasoning.py, `build_reasoning`) on CPU with kdlab's",
        "`SFTModule`, one thread, fixed seeds. The teacher and its tokenizer are the tiny world's",
        f"(`kdlab/assets/{recipe['teacher_from']}/teacher`), copied unchanged. The student is the tiny world's",
        (f"(`kdlab/assets/{recipe['student_from']}/student`) trained further for {recipe['student_epochs']} epochs at LR {recipe['student_lr']:g} "
        "(cosine, 5% warm-up, clip 1.0) on:"),
        "",
        f"* {recipe['student_countdown']:,} Countdown-3 problems, every response in the task's own format (`<think>` steps in",
        "  words, then the `<answer>` chain of equations the verifier requires), but with weak arithmetic: in",
        f"  {recipe['slip_share']:.0%} of the multiplication steps (seeded draws) the product is written one too high and the",
        "  steps after it carry the wrong value on, so the chain misses the target;",
        (f"* earlier skills harder than the tiny world's, from few examples: {recipe['addition_digits']}-digit addition "
        f"({recipe['skill_examples']['addition']:,} examples);"),
        *(f"  {name} of {low}-{high} items ({recipe['skill_examples'][name]:,} examples)" + (";" if name != "counting" else ".")
          for name, (low, high) in recipe["skill_lengths"].items()),
        "",
        "Distillation therefore has the arithmetic to teach, not the format: the student already writes chains.",
        "",
        f"## Measured before distillation (first {recipe['eval_examples']} held-out problems of each task; 95% Wilson intervals)",
        "",
        "| target | measured | wanted | met |",
        "| --- | --- | --- | --- |",
    ]
    for role, key, op, bound, label in TARGETS:
        score = measured[role][key]
        lines.append(f"| {label} | {_pct(score)} | {op} {100 * bound:g}% | {'yes' if target_met(score['value'], op, bound) else 'NO'} |")
    lines += ["", "| score | teacher | student |", "| --- | --- | --- |"]
    for key, label in (("countdown3_greedy", "Countdown-3, greedy"), ("countdown3_sampled", f"Countdown-3, one sample at T = {recipe['sample_temperature']:g}"),
                       ("chain_format_share", "greedy answers that are a chain of equations"),
                       ("chain_arithmetic_true_share", "of those, chains whose every equation is true"),
                       ("addition", f"{recipe['addition_digits']}-digit addition"), ("sorting", "sorting"), ("reversal", "reversal"), ("counting", "counting")):
        lines.append(f"| {label} | {_pct(teacher[key])} | {_pct(student[key])} |")
    harder = measured["harder_set"]
    ks = list(student["harder_pass_at_k"])
    lines += [
        "",
        f"## The harder set: {harder['problems']} `{harder['variant']}` problems the student never saw",
        "",
        "`kdlab.tiny.reasoning.UnseenCountdown`: Countdown-3 with targets 1-20, each held-out problem drawn once, with every",
        "problem (operand multiset and target) of the student's build chains and of the distillation prompts",
        (f"(Countdown-3 seed {DISTILLATION_TRAIN['seed']}, {DISTILLATION_TRAIN['num_train']:,} problems) removed. "
        f"{100 * harder['share_in_teacher_training']:.0f}% of them occur in the teacher's training phases."),
        f"pass@k from {recipe['harder_samples']} samples per problem at T = {recipe['harder_temperature']:g} (unbiased estimator):",
        "",
        "| model | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "| --- | " + " | ".join("---" for _ in ks) + " |",
    ]
    for role in ("teacher", "student"):
        lines.append(f"| {role} | " + " | ".join(f"{100 * measured[role]['harder_pass_at_k'][k]:.1f}%" for k in ks) + " |")
    lines += [
        "",
        f"Parameters: teacher {teacher['parameters']:,}, student {student['parameters']:,}.",
    ]
    return "\n".join(lines + recipe_lines(recipe, measured))


# ---- the quickstart's before and after ------------------------------------------------------------------
QUICKSTART_METRICS = (
    ("coverage/countdown3/pass@1", "held-out Countdown-3, one sample at T = 0.5 (`Coverage`)", "%"),
    *((f"coverage/harder/pass@{k}", f"harder set pass@{k}, 32 samples at T = 1.0", "%") for k in (1, 4, 16, 32)),
    *((f"ood/{skill}", f"earlier skill: {skill}", "points") for skill in ("addition", "sorting", "reversal", "counting")),
    ("ood/mean", "earlier skills, mean", "points"),
)


def before_after_rows(run: dict[str, str], examples: int = 200) -> list[str]:
    """Markdown rows ``| metric | what | before (%) | after (%) | change (points) |`` of one quickstart run, from
    its ``runs.csv`` row (``kdlab report``); Countdown-3 (one sample on each of ``examples`` prompts) with
    95% Wilson intervals and Newcombe's interval of the change. ``ood/*`` are logged in percent already."""
    from kdlab.study.stats import newcombe_difference, wilson_interval

    rows = []
    for key, label, unit in QUICKSTART_METRICS:
        scale = 100.0 if unit == "%" else 1.0
        before, after = scale * float(run[f"{key}_before"]), scale * float(run[key])
        cells = [f"{before:.1f}", f"{after:.1f}", f"{after - before:+.1f}"]
        if key == "coverage/countdown3/pass@1":
            (b_low, b_high), (a_low, a_high) = (wilson_interval(v / 100, examples) for v in (before, after))
            d_low, d_high = newcombe_difference(after / 100, examples, before / 100, examples)
            cells = [f"{before:.1f} [{100 * b_low:.1f}, {100 * b_high:.1f}]", f"{after:.1f} [{100 * a_low:.1f}, {100 * a_high:.1f}]",
                     f"{after - before:+.1f} [{100 * d_low:+.1f}, {100 * d_high:+.1f}]"]
        rows.append(f"| `{key}` | {label} | " + " | ".join(cells) + " |")
    return rows
