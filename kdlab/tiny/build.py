"""Building the packaged tiny models: ``python -m kdlab.tiny random|world|student|teacher-4e|teacher-xtok``.

``random``: random-initialised Qwen2 student/teacher sharing a tokenizer (``kdlab://tiny-random``),
for tests that need real architectures but no skill.

``world``: the tiny world (``kdlab://tiny``). A byte-level BPE tokenizer is trained on the world's
text; a teacher (Qwen2, several times larger) and a student are initialised from fixed seeds and
trained from scratch with :class:`kdlab.stages.sft.SFTModule` on CPU; both are then measured and a model
card records how they were built and what they score. The same command rebuilds them
bit-for-bit on the same software stack (fixed seeds, one thread, deterministic kernels).
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kdlab.tiny.tokenizer import build_tokenizer


def tiny_qwen2(vocab_size: int, hidden: int, layers: int, heads: int, embedding_rows: int | None = None, seed: int = 0):
    """A random-initialised ``Qwen2ForCausalLM`` with ``embedding_rows`` (default ``vocab_size``) rows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**tiny_shape(vocab_size, hidden, layers, heads, embedding_rows))
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def tiny_shape(vocab_size: int, hidden: int, layers: int, heads: int, embedding_rows: int | None = None) -> dict[str, Any]:
    """The config settings every tiny model shares, whatever its family: sizes, 512 positions, an untied head."""
    return {"vocab_size": embedding_rows or vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": 512, "tie_word_embeddings": False}


def padded_rows(vocab: int, multiple: int = 64) -> int:
    """Embedding rows rounded up past the vocabulary, as real families pad them."""
    return vocab + multiple - vocab % multiple


def save_pair(out_dir: Path, tokenizer: Any, models: dict[str, torch.nn.Module]) -> None:
    for role, model in models.items():
        target = out_dir / role
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)


def build_random_pair(out_dir: Path) -> None:
    """Write ``student/`` and ``teacher/`` (random Qwen2, shared tokenizer) under ``out_dir``."""
    from kdlab.tasks.addition import Addition
    from kdlab.tiny.tokenizer import CHAT_TEMPLATE

    task = Addition(num_train=2000, num_val=0, num_test=0)
    texts = [task.user_prompt(ex) + " " + task.reference_completion(ex) for ex in task.examples("train")]
    tokenizer = build_tokenizer(texts + [CHAT_TEMPLATE], vocab_size=512)
    vocab = len(tokenizer)
    save_pair(
        out_dir,
        tokenizer,
        {
            "student": tiny_qwen2(vocab, hidden=32, layers=2, heads=4, seed=1),
            "teacher": tiny_qwen2(vocab, hidden=64, layers=2, heads=4, embedding_rows=padded_rows(vocab), seed=2),
        },
    )
    print(f"wrote {out_dir}/student and {out_dir}/teacher")


# ---- the tiny world --------------------------------------------------------------------------
RECIPE: dict[str, Any] = {
    "tokenizer_vocab": 512,
    "teacher": {"hidden": 128, "layers": 4, "heads": 4, "seed": 11},
    "student": {"hidden": 64, "layers": 4, "heads": 4, "seed": 12},
    # The teacher learns Countdown-3 in phases, each on freshly drawn problems (English), a share of
    # them also shown with the Spanish instruction; later phases continue from the earlier weights.
    "teacher_phases": [
        {"countdown": 60000, "data_seed": 1234, "epochs": 2, "lr": 3e-3},
        {"countdown": 60000, "data_seed": 1244, "epochs": 3, "lr": 1.5e-3},
    ],
    "teacher_spanish_share": 0.25,
    # the student: earlier skills well, and Countdown-3 in its own habit: the same reasoning, but 90% of
    # its answers are one expression ("(6+1)*3") where the task (and the teacher) want the chain of
    # equations; held-out Countdown-3 (chain) starts near 0 while the skill is there to be redirected
    "student_skill_examples": 15000,
    "student_countdown": 20000,
    "student_expression_share": 0.9,
    "student_epochs": 4,
    "student_lr": 3e-3,
    "batch_size": 64,
    "eval_examples": 200,
    "data_seed": 1234,
}

# The extended teacher (``kdlab://tiny/teacher-4e``): the packaged teacher, further trained on Countdown-4E
# (four operands 1-10, three steps) with Countdown-3 mixed in so it keeps that skill, in English only.
# The main study keeps the packaged teacher; this one makes the harder set's pass@k testable
# (the packaged teacher and student solve no Countdown-4E problem).
TEACHER_4E: dict[str, Any] = {
    "countdown4e": 20000,
    "countdown3": 10000,
    "data_seed": 1264,
    "epochs": 2,
    "lr": 1e-3,
    "batch_size": 64,
    "eval_examples": 200,
    "pass_at_k_samples": 10,
    "pass_at_k_temperature": 0.5,
}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


@functools.cache
def whole_logits_sft() -> type:
    """:class:`~kdlab.stages.sft.SFTModule` with the loss and data order the packaged tiny models were trained with:
    cross-entropy over the whole ``(B, T, V)`` logits upcast to fp32, every head row in the normaliser (the padded
    teachers' too), and rows drawn by a ``RandomSampler`` seeded with ``seed``.
    ``SFTModule``'s own loss now runs in chunks over the tokenizer's tokens, which rounds differently and, for a head
    with padding rows, normalises over fewer rows; the builds keep this one so that they rebuild the packaged models
    as they are. Built on first use (Lightning is imported lazily)."""
    from kdlab.stages.sft import SFTModule

    class WholeLogitsSFT(SFTModule):
        def train_dataloader(self) -> Any:
            """The order the packaged models were trained with (SFTModule's before it drew from (seed, epoch)): a
            ``RandomSampler`` on a generator seeded with ``seed``, one process, no resume."""
            from torch.utils.data import DataLoader

            order = torch.Generator().manual_seed(self.seed)
            return DataLoader(self.encoded, batch_size=self.batch_size, shuffle=True, generator=order, collate_fn=list)

        def loss(self, batch: dict[str, Any], num_tokens: float | None = None) -> torch.Tensor:
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            flat = (logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
            if num_tokens is None:  # the builds' loader: each batch its own token mean, as the packaged models had
                return torch.nn.functional.cross_entropy(*flat, ignore_index=-100)
            return torch.nn.functional.cross_entropy(*flat, ignore_index=-100, reduction="sum") / num_tokens

    return WholeLogitsSFT


def _train(model_dir: Path, rows: list[dict[str, Any]], epochs: int, lr: float, batch_size: int, log_dir: Path, name: str) -> None:
    """SFT ``model_dir`` in place on ``rows`` with kdlab's SFTModule and the packaged models' loss
    (:func:`whole_logits_sft`; cosine, 5% warm-up, clip 1.0)."""
    from lightning.pytorch import seed_everything

    seed_everything(0, workers=True)  # each training call starts from the same global RNG state
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    data = model_dir.parent / f"{name}-sft.jsonl"
    _write_jsonl(data, rows)
    steps = epochs * -(-len(rows) // batch_size)
    module = whole_logits_sft()(str(model_dir), dataset=str(data), lr=lr, warmup_steps=max(1, steps // 20), batch_size=batch_size, max_length=256, seed=0)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=1.0,
        logger=TensorBoardLogger(log_dir, name=name),
        enable_checkpointing=False,
        deterministic=True,
        log_every_n_steps=20,
    )
    trainer.fit(module)
    module.save_pretrained(model_dir)
    data.unlink()


def greedy_countdown(model: Any, tokenizer: Any, variant: str, n: int) -> tuple[Any, list, list[str]]:
    """``(task, examples, greedy completions)`` for the first ``n`` held-out problems of a tiny-world Countdown."""
    from kdlab.evaluation.scoring import completion_texts
    from kdlab.tiny.world import countdown

    task = countdown(variant, num_train=0, num_val=n, num_test=0)
    examples = task.examples("val")
    return task, examples, completion_texts(model, tokenizer, task, examples, temperature=0.0, max_new_tokens=96, batch_size=50)


def measure(model_dir: Path, recipe: dict[str, Any] = RECIPE) -> dict[str, Any]:
    """Greedy held-out accuracies and Spanish shares of one tiny-world model."""
    from kdlab.evaluation.metrics import spanish_share
    from kdlab.evaluation.scoring import accuracy, completion_texts
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.tiny.world import countdown, skills

    spec = ModelSpec(str(model_dir))
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    n = recipe["eval_examples"]
    results: dict[str, Any] = {}
    for variant in ("countdown3", "countdown4e"):
        task, examples, texts = greedy_countdown(model, tokenizer, variant, n)
        results[f"{variant}_accuracy"] = accuracy(task, examples, texts)
        if variant == "countdown3":
            as_expression = countdown(variant, num_train=0, num_val=n, num_test=0, answer_format="expression")
            results["countdown3_expression_accuracy"] = accuracy(as_expression, examples, texts)
            results["english_prompt_spanish_share"] = spanish_share(texts)
            spanish = completion_texts(model, tokenizer, task, examples, role="teacher", temperature=0.0, max_new_tokens=96, batch_size=50)
            results["spanish_prompt_spanish_share"] = spanish_share(spanish)
            results["spanish_prompt_accuracy"] = accuracy(task, examples, spanish)
    for task in skills(num_train=0, num_val=n):
        examples = task.examples("val")
        texts = completion_texts(model, tokenizer, task, examples, temperature=0.0, max_new_tokens=24, batch_size=100)
        results[f"{type(task).__name__.lower()}_accuracy"] = accuracy(task, examples, texts)
    results["parameters"] = sum(p.numel() for p in model.parameters())
    return results


def train_teacher_phase(model_dir: Path, phase: dict[str, Any], recipe: dict[str, Any] = RECIPE) -> None:
    """One teacher phase: ``phase["countdown"]`` fresh Countdown-3 problems in English, a share also in Spanish."""
    import random

    from kdlab.tiny.world import countdown, countdown_rows

    task = countdown(num_train=phase["countdown"], num_val=0, num_test=0, seed=phase["data_seed"])
    english = countdown_rows(task, "train", "english")
    spanish = countdown_rows(task, "train", "spanish")
    spanish = random.Random(phase["data_seed"]).sample(spanish, int(len(english) * recipe["teacher_spanish_share"]))
    _train(model_dir, english + spanish, phase["epochs"], phase["lr"], recipe["batch_size"], model_dir.parent / "logs", "teacher")


def train_student(model_dir: Path, recipe: dict[str, Any] = RECIPE) -> None:
    """The student: the four earlier skills, and a little Countdown-3 in English."""
    from kdlab.tiny.world import countdown, countdown_rows, skill_rows, skills

    seed = recipe["data_seed"]
    task = countdown(num_train=recipe["student_countdown"], num_val=0, num_test=0, seed=seed + 1)
    share = recipe.get("student_expression_share", 0.0)
    rows = skill_rows(skills(num_train=recipe["student_skill_examples"], num_val=0, seed=seed)) + countdown_rows(task, "train", "english", share, seed)
    _train(model_dir, rows, recipe["student_epochs"], recipe["student_lr"], recipe["batch_size"], model_dir.parent / "logs", "student")


def build_world(out_dir: Path, recipe: dict[str, Any] = RECIPE, keep_teacher: bool = False) -> dict[str, Any]:
    """Train and measure the tiny world's teacher and student; write them and MODEL_CARD.md to ``out_dir``.

    ``keep_teacher``: keep the teacher (and its tokenizer) already in ``out_dir`` and rebuild the student only.
    """
    from lightning.pytorch import seed_everything

    from kdlab.tiny.tokenizer import CHAT_TEMPLATE
    from kdlab.tiny.world import corpus

    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and makes the build repeatable
    seed_everything(0, workers=True)
    started = time.time()
    work = out_dir.with_name(out_dir.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if keep_teacher:
        from transformers import AutoTokenizer

        shutil.copytree(out_dir / "teacher", work / "teacher")
        tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
        save_pair(work, tokenizer, {"student": tiny_qwen2(len(tokenizer), **recipe["student"])})
    else:
        tokenizer = build_tokenizer(corpus() + [CHAT_TEMPLATE], vocab_size=recipe["tokenizer_vocab"])
        vocab = len(tokenizer)
        teacher = tiny_qwen2(vocab, embedding_rows=padded_rows(vocab), **recipe["teacher"])
        student = tiny_qwen2(vocab, **recipe["student"])
        save_pair(work, tokenizer, {"teacher": teacher, "student": student})
        for phase in recipe["teacher_phases"]:
            train_teacher_phase(work / "teacher", phase, recipe)
    train_student(work / "student", recipe)

    measured = {role: measure(work / role, recipe) for role in ("teacher", "student")}
    measured["build_seconds"] = round(time.time() - started)
    (work / "metrics.json").write_text(json.dumps({"recipe": recipe, "measured": measured}, indent=2) + "\n")
    (work / "MODEL_CARD.md").write_text(model_card(recipe, measured), encoding="utf-8")
    shutil.rmtree(work / "logs", ignore_errors=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    work.rename(out_dir)
    print(json.dumps(measured, indent=2))
    return measured


def measure_4e(model_dir: Path, recipe: dict[str, Any] = TEACHER_4E) -> dict[str, Any]:
    """Greedy held-out Countdown-3 and Countdown-4E accuracy, and Countdown-4E pass@1/pass@10 from
    ``pass_at_k_samples`` samples per problem at ``pass_at_k_temperature`` (seeded), of one model."""
    from kdlab.evaluation.metrics import pass_at_k
    from kdlab.evaluation.scoring import accuracy, completion_texts
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec(str(model_dir))
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    n, samples = recipe["eval_examples"], recipe["pass_at_k_samples"]
    results: dict[str, Any] = {}
    for variant in ("countdown3", "countdown4e"):
        task, examples, texts = greedy_countdown(model, tokenizer, variant, n)
        results[f"{variant}_accuracy"] = accuracy(task, examples, texts)
    repeated = [example for example in examples for _ in range(samples)]
    generator = torch.Generator().manual_seed(0)
    texts = completion_texts(model, tokenizer, task, repeated, temperature=recipe["pass_at_k_temperature"], max_new_tokens=96,
                     batch_size=200, generator=generator)
    correct = [sum(task.score(e, t) >= 1.0 for e, t in zip(repeated[i:i + samples], texts[i:i + samples]))
               for i in range(0, len(repeated), samples)]
    for k in (1, samples):
        results[f"countdown4e_pass@{k}"] = sum(pass_at_k(samples, c, k) for c in correct) / len(correct)
    return results


def start_build(tiny_dir: Path, name: str) -> tuple[Path, Path, float]:
    """``(tiny_dir/name, an empty work folder beside tiny_dir, the start time)`` of a repeatable build of one
    packaged model: one thread, every seed fixed."""
    from lightning.pytorch import seed_everything

    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and makes the build repeatable
    seed_everything(0, workers=True)
    work = tiny_dir.parent / f"{name}.build"
    shutil.rmtree(work, ignore_errors=True)
    return tiny_dir / name, work, time.time()


def build_teacher_4e(tiny_dir: Path, recipe: dict[str, Any] = TEACHER_4E) -> dict[str, Any]:
    """Train ``tiny_dir/teacher`` further on Countdown-4E and Countdown-3 (:data:`TEACHER_4E`) and write
    it, measured, to ``tiny_dir/teacher-4e`` with ``MODEL_CARD.md`` and ``metrics.json``; the packaged
    teacher and student are left as they are."""
    from kdlab.tiny.world import countdown, countdown_rows

    out_dir, work, started = start_build(tiny_dir, "teacher-4e")
    shutil.copytree(tiny_dir / "teacher", work / "teacher-4e")
    rows = []
    for offset, variant in enumerate(("countdown4e", "countdown3")):
        task = countdown(variant, num_train=recipe[variant], num_val=0, num_test=0, seed=recipe["data_seed"] + offset)
        rows += countdown_rows(task, "train", "english")
    _train(work / "teacher-4e", rows, recipe["epochs"], recipe["lr"], recipe["batch_size"], work / "logs", "teacher-4e")
    measured = {"teacher-4e": measure_4e(work / "teacher-4e", recipe), "teacher": measure_4e(tiny_dir / "teacher", recipe),
                "student": measure_4e(tiny_dir / "student", recipe)}
    measured["build_seconds"] = round(time.time() - started)
    model = work / "teacher-4e"
    (model / "metrics.json").write_text(json.dumps({"recipe": recipe, "measured": measured}, indent=2) + "\n")
    (model / "MODEL_CARD.md").write_text(teacher_4e_card(recipe, measured), encoding="utf-8")
    shutil.rmtree(out_dir, ignore_errors=True)
    model.rename(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(measured, indent=2))
    return measured


def teacher_4e_targets(recipe: dict[str, Any] = TEACHER_4E) -> tuple[tuple[str, str, str, float, str], ...]:
    """(model, measured key, comparison, bound, label) of each target of the Countdown-4E teacher."""
    most = f"countdown4e_pass@{recipe['pass_at_k_samples']}"
    return (
        ("teacher-4e", most, ">=", 0.20, f"teacher-4e Countdown-4E pass@{recipe['pass_at_k_samples']} (T = {recipe['pass_at_k_temperature']:g})"),
        ("teacher-4e", "countdown3_accuracy", ">=", 0.75, "teacher-4e greedy Countdown-3 accuracy (kept)"),
        ("student", most, "<=", 0.05, f"student Countdown-4E pass@{recipe['pass_at_k_samples']} before distillation"),
    )


def _target_rows(targets: tuple, measured: dict[str, Any]) -> list[str]:
    rows = []
    for role, key, op, bound, label in targets:
        value = measured[role][key]
        met = value >= bound if op == ">=" else value <= bound
        rows.append(f"| {label} | {value:.3f} | {op} {bound} | {'yes' if met else 'NO'} |")
    return rows


def teacher_4e_card(recipe: dict[str, Any], measured: dict[str, Any]) -> str:
    """The extended teacher's model card: what changed from the packaged teacher, and what it measures."""
    lines = [
        "# kdlab tiny world: the Countdown-4E teacher (`kdlab://tiny/teacher-4e`)",
        "",
        "Built by `python -m kdlab.tiny teacher-4e` (kdlab/tiny/build.py, `build_teacher_4e`): the packaged tiny",
        f"teacher (`kdlab://tiny/teacher`, unchanged) trained further with kdlab's `SFTModule` on {recipe['countdown4e']:,}",
        f"Countdown-4E problems (four operands 1-10, three-step chains) and {recipe['countdown3']:,} Countdown-3 problems,",
        f"English only, {recipe['epochs']} epochs at LR {recipe['lr']:g} (cosine, 5% warm-up), one thread, fixed seeds. Same",
        "tokenizer and architecture as the packaged pair. It exists so that the harder set's pass@k can be",
        "measured: the packaged teacher and student solve no Countdown-4E problem (experiments/tiny/harder_split_probe.json).",
        "",
        f"## Measured (first {recipe['eval_examples']} held-out problems; greedy accuracy, and pass@k from "
        f"{recipe['pass_at_k_samples']} samples per problem at T = {recipe['pass_at_k_temperature']:g})",
        "",
        "| target | measured | wanted | met |",
        "| --- | --- | --- | --- |",
        *_target_rows(teacher_4e_targets(recipe), measured),
        "",
        "| model | Countdown-3 greedy | Countdown-4E greedy | Countdown-4E pass@1 | Countdown-4E pass@10 |",
        "| --- | --- | --- | --- | --- |",
    ]
    most = f"countdown4e_pass@{recipe['pass_at_k_samples']}"
    for role in ("teacher-4e", "teacher", "student"):
        m = measured[role]
        lines.append(f"| {role} | {m['countdown3_accuracy']:.3f} | {m['countdown4e_accuracy']:.3f} | "
                     f"{m['countdown4e_pass@1']:.3f} | {m[most]:.3f} |")
    lines += ["", f"Build time on this machine: {measured['build_seconds']} s.", "", "## Recipe", "", "```json",
              json.dumps(recipe, indent=2), "```", ""]
    return "\n".join(lines)


TARGETS = (
    ("teacher", "countdown3_accuracy", ">=", 0.75, "teacher greedy Countdown-3 accuracy"),
    ("student", "countdown3_accuracy", "<=", 0.40, "student greedy Countdown-3 accuracy before distillation"),
    ("student", "addition_accuracy", ">=", 0.90, "student addition"),
    ("student", "sorting_accuracy", ">=", 0.90, "student sorting"),
    ("student", "reversal_accuracy", ">=", 0.90, "student reversal"),
    ("student", "counting_accuracy", ">=", 0.90, "student counting"),
    ("teacher", "spanish_prompt_spanish_share", ">=", 0.95, "teacher responses in Spanish when told to"),
    ("teacher", "english_prompt_spanish_share", "<=", 0.05, "teacher responses in Spanish when not told to"),
)


def model_card(recipe: dict[str, Any], measured: dict[str, Any]) -> str:
    """The model card written next to the weights: how they were built and what they measure."""
    lines = [
        "# kdlab tiny world: teacher and student",
        "",
        "Built by `python -m kdlab.tiny world` (kdlab/tiny/build.py) from scratch on CPU with kdlab's",
        "`SFTModule`: Qwen2 architecture (`transformers.Qwen2ForCausalLM`), a byte-level BPE tokenizer",
        "trained on the world's text, fixed seeds, one thread. The teacher's embedding matrix is padded",
        "past the vocabulary, as in real model families.",
        "",
        "Data: the teacher learns Countdown-3 (prompt: `Numbers: [...]` / `Target: ...`, response:",
        "`<think>` steps in words `</think><answer>` chain `</answer>`), in English, and in Spanish when",
        "its prompt ends with \"Razona solo en español.\". The student learns four earlier skills",
        "(2-digit addition, sorting, reversal, counting) and Countdown-3 in English with the same reasoning but,",
        f"{recipe.get('student_expression_share', 0.0):.0%} of the time, its own answer habit: one expression",
        "(`<answer>(6+1)*3</answer>`) where the task and the teacher write the chain of equations, which the",
        "task's verifier requires; distillation has to carry the teacher's format over to a student that already",
        "has much of the skill (`student countdown3 as an expression` below).",
        "",
        "## Measured (greedy decoding, first 200 held-out examples of each task)",
        "",
        "| target | measured | wanted | met |",
        "| --- | --- | --- | --- |",
    ]
    for role, key, op, bound, label in TARGETS:
        value = measured[role][key]
        met = value >= bound if op == ">=" else value <= bound
        lines.append(f"| {label} | {value:.3f} | {op} {bound} | {'yes' if met else 'NO'} |")
    lines += [
        "",
        f"Parameters: teacher {measured['teacher']['parameters']:,}, student {measured['student']['parameters']:,}.",
        f"Student held-out Countdown-3 scored as an expression (its own habit): {measured['student'].get('countdown3_expression_accuracy', float('nan')):.3f}.",
        f"Countdown-4E (harder, not trained on): teacher {measured['teacher']['countdown4e_accuracy']:.3f}, "
        f"student {measured['student']['countdown4e_accuracy']:.3f}.",
    ]
    return "\n".join(lines + recipe_lines(recipe, measured))


def recipe_lines(recipe: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """A model card's last lines: the build time and the recipe as JSON (every world's card ends so)."""
    return [f"Build time on this machine: {measured['build_seconds']} s.", "", "## Recipe", "", "```json", json.dumps(recipe, indent=2), "```", ""]
