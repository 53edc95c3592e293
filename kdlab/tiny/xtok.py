"""The cross-tokenizer teacher of the tiny world (``kdlab://tiny/teacher-xtok``, issue #27): its recipe,
build (``python -m kdlab.tiny teacher-xtok``) and model card."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kdlab.tiny.build import RECIPE, _target_rows, measure, padded_rows, save_pair, start_build, tiny_qwen2, tiny_shape, train_teacher_phase
from kdlab.tiny.tokenizer import build_tokenizer


# The cross-tokenizer teacher (``kdlab://tiny/teacher-xtok``, issue #27), the recipe the packaged folder was built
# with: the packaged teacher's size and phases, but its own tokenizer, trained on the same corpus with twice the
# vocabulary budget and digit runs kept together (its vocabulary holds multi-digit tokens such as ``"24"``), in a
# Qwen2 folder. transformers 5 loads the tokenizer of any Qwen2 folder as ``Qwen2Tokenizer``, whose pre-tokenizer
# splits digits one by one whatever ``tokenizer.json`` says: as loaded (and as the teacher was trained and is used)
# digits are one token each, the multi-digit tokens are never produced, and the tiny world's text gets the packaged
# tokenizer's token strings under other ids (a test of the vocabulary map, not of multi-token groups). The special
# tokens, tags and chat template are the packaged ones, so the chat markup is the same text.
# ``"architecture": "llama"`` builds a Llama-family teacher instead, a second family whose folder's tokenizer loads
# as built and keeps numbers whole (:func:`keeps_numbers_whole`); that variant is not packaged (packaging it would
# replace the teacher of every committed result of the tiny cross-tokenizer run).
TEACHER_XTOK: dict[str, Any] = {
    "architecture": "qwen2",
    "tokenizer_vocab": 1024,
    "individual_digits": False,
    "teacher": dict(RECIPE["teacher"]),
    "teacher_phases": [dict(phase) for phase in RECIPE["teacher_phases"]],
    "teacher_spanish_share": RECIPE["teacher_spanish_share"],
    "batch_size": RECIPE["batch_size"],
    "eval_examples": RECIPE["eval_examples"],
}


def keeps_numbers_whole(recipe: dict[str, Any]) -> bool:
    """Whether the tokenizer a :data:`TEACHER_XTOK`-like ``recipe`` builds keeps digit runs together as loaded: it is
    trained so (``individual_digits`` false) and saved in a Llama folder (a Qwen2 folder's loads as ``Qwen2Tokenizer``,
    which splits digits one by one)."""
    return recipe["architecture"] == "llama" and not recipe["individual_digits"]


def xtok_tokenizer(recipe: dict[str, Any] = TEACHER_XTOK) -> Any:
    """The byte-level BPE tokenizer of ``recipe`` as trained (before it is saved beside a model and loaded), on the
    tiny world's corpus and chat template: deterministic, so the packaged folder's vocabulary and merges are its."""
    from kdlab.tiny.tokenizer import CHAT_TEMPLATE
    from kdlab.tiny.world import corpus

    return build_tokenizer(corpus() + [CHAT_TEMPLATE], vocab_size=recipe["tokenizer_vocab"], individual_digits=recipe["individual_digits"])


def check_loads_as_recipe(folder: Path, tokenizer: Any, recipe: dict[str, Any]) -> None:
    """Refuse a saved ``folder`` whose tokenizer does not load as ``recipe`` says (:func:`keeps_numbers_whole`: as
    ``tokenizer`` was built, or digits one by one), before any training."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    wanted = tokenizer.tokenize("2024") if keeps_numbers_whole(recipe) else list("2024")
    got = loaded.tokenize("2024")
    if got != wanted:
        raise RuntimeError(f"{folder}: the saved tokenizer loads as {type(loaded).__name__}, which tokenizes '2024' as {got}, "
                           f"not {wanted} as the recipe (architecture {recipe['architecture']!r}, individual_digits "
                           f"{recipe['individual_digits']}) wants")


def tiny_llama(vocab_size: int, hidden: int, layers: int, heads: int, embedding_rows: int | None = None, seed: int = 0,
               eos_token_id: int | None = None, pad_token_id: int | None = None):
    """A random-initialised ``LlamaForCausalLM`` of :func:`tiny_qwen2`'s shape (no BOS token; Llama's default
    BOS/EOS ids 1/2 replaced by ``eos_token_id``/``pad_token_id``): a second model family for the tiny world."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**tiny_shape(vocab_size, hidden, layers, heads, embedding_rows), bos_token_id=None,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def shared_token_bytes(first: Any, second: Any) -> dict[str, int]:
    """How many distinct token byte strings each tokenizer has (special tokens left out), and how many
    both have: the same bytes, whatever the token ids."""
    from kdlab.alignment import token_bytes

    sets = [set(token_bytes(tok, range(len(tok)))) - {b""} for tok in (first, second)]
    return {"first": len(sets[0]), "second": len(sets[1]), "shared": len(sets[0] & sets[1])}


def build_teacher_xtok(tiny_dir: Path, recipe: dict[str, Any] = TEACHER_XTOK) -> dict[str, Any]:
    """Train a tokenizer of its own (:data:`TEACHER_XTOK`: larger vocabulary, trained with digit runs kept together;
    :func:`xtok_tokenizer`) on the tiny world's corpus and a fresh teacher with it through the packaged teacher's
    phases; write it, measured, to ``tiny_dir/teacher-xtok`` with ``MODEL_CARD.md`` and ``metrics.json``. The packaged
    teacher and student are left as they are (their tokenizer is compared with the new one)."""
    from transformers import AutoTokenizer

    out_dir, work, started = start_build(tiny_dir, "teacher-xtok")
    work.mkdir(parents=True)
    model = work / "teacher-xtok"
    tokenizer = xtok_tokenizer(recipe)
    vocab = len(tokenizer)
    if recipe["architecture"] == "llama":
        teacher = tiny_llama(vocab, embedding_rows=padded_rows(vocab), eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **recipe["teacher"])
    else:
        teacher = tiny_qwen2(vocab, embedding_rows=padded_rows(vocab), **recipe["teacher"])
    save_pair(work, tokenizer, {"teacher-xtok": teacher})
    check_loads_as_recipe(model, tokenizer, recipe)  # before the phases: the teacher trains with the tokenizer as loaded
    for phase in recipe["teacher_phases"]:
        train_teacher_phase(model, phase, recipe)
    if recipe["architecture"] == "llama":
        # the generic class name (transformers 4 has no ``TokenizersBackend``): tokenizer.json is read as saved
        config_file = model / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    check_loads_as_recipe(model, tokenizer, recipe)
    packaged = AutoTokenizer.from_pretrained(tiny_dir / "student")
    shared = shared_token_bytes(tokenizer, packaged)
    measured: dict[str, Any] = {"teacher-xtok": measure(model, recipe)}
    measured["tokenizer"] = {"vocab": vocab, "packaged_vocab": len(packaged), "token_bytes": shared["first"],
                             "packaged_token_bytes": shared["second"], "shared_token_bytes": shared["shared"],
                             "embedding_rows": padded_rows(vocab)}
    measured["build_seconds"] = round(time.time() - started)
    packaged_metrics = tiny_dir / "metrics.json"
    teacher = json.loads(packaged_metrics.read_text())["measured"]["teacher"] if packaged_metrics.exists() else None
    (model / "metrics.json").write_text(json.dumps({"recipe": recipe, "measured": measured}, indent=2) + "\n")
    (model / "MODEL_CARD.md").write_text(teacher_xtok_card(recipe, measured, teacher), encoding="utf-8")
    shutil.rmtree(out_dir, ignore_errors=True)
    model.rename(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(measured, indent=2))
    return measured


XTOK_TARGETS = (
    ("teacher-xtok", "countdown3_accuracy", ">=", 0.70, "teacher-xtok greedy Countdown-3 accuracy"),
    ("teacher-xtok", "spanish_prompt_spanish_share", ">=", 0.95, "teacher-xtok responses in Spanish when told to"),
    ("teacher-xtok", "english_prompt_spanish_share", "<=", 0.05, "teacher-xtok responses in Spanish when not told to"),
)


def teacher_xtok_card(recipe: dict[str, Any], measured: dict[str, Any], teacher: dict[str, Any] | None = None) -> str:
    """The cross-tokenizer teacher's model card: its tokenizer against the packaged one, and what it
    measures (``teacher``: the packaged teacher's measured numbers, for comparison, when known)."""
    tok = measured["tokenizer"]
    phases = " then ".join(f"{p['countdown']:,} Countdown-3 problems for {p['epochs']} epochs at LR {p['lr']:g}"
                           for p in recipe["teacher_phases"])
    family = {"llama": "`LlamaForCausalLM`", "qwen2": "`Qwen2ForCausalLM`"}[recipe["architecture"]]
    trained_digits = "one token per digit" if recipe["individual_digits"] else "digit runs kept together"
    if recipe["architecture"] == "qwen2":
        loading = ["Its folder is a Qwen2 model's, and transformers 5 loads a Qwen2 folder's tokenizer as `Qwen2Tokenizer`, whose",
                   "pre-tokenizer splits digits one by one whatever `tokenizer.json` says; the teacher was trained, and is used,",
                   "with that tokenizer (the recipe's `architecture: llama` builds a teacher whose tokenizer loads as built and",
                   "keeps numbers whole; that variant is not packaged)."]
    else:
        loading = ["Llama, not Qwen2 like the packaged pair: a second family, as across-tokenizer pairs are, and transformers 5",
                   "loads the tokenizer of any Qwen2 folder as `Qwen2Tokenizer`, which splits digits one by one whatever",
                   "`tokenizer.json` says; a Llama folder's tokenizer loads as built."]
    if keeps_numbers_whole(recipe):
        digits = ["digits: runs of digits kept together and merged by BPE (`24` is one token), where the packaged one has",
                  "one token per digit."]
        same_text = ["shared): the same text often gets different tokens, numbers above all, and the ids agree only for the",
                     "three special tokens, the 256 bytes and the first merges (the tags sit at the end of each vocabulary)."]
    else:
        digits = ["with other ids for the same strings (the tags, most merges). As loaded, digits are one token each, as in the",
                  "packaged one, so its multi-digit tokens are never produced and it spells the tiny world's text with the same",
                  "token strings as the packaged tokenizer, under other ids: a distillation across tokenizers through this",
                  "teacher exercises the vocabulary map (every id is translated), not multi-token groups."]
        same_text = ["shared)."]
    lines = [
        "# kdlab tiny world: the cross-tokenizer teacher (`kdlab://tiny/teacher-xtok`)",
        "",
        "Built by `python -m kdlab.tiny teacher-xtok` (kdlab/tiny/xtok.py, `build_teacher_xtok`, recipe `TEACHER_XTOK`):",
        f"a byte-level BPE tokenizer of its own, trained on the tiny world's corpus with a budget of {recipe['tokenizer_vocab']:,} tokens",
        f"and {trained_digits}, and a fresh teacher of the packaged teacher's size ({family}, embedding rows",
        f"padded to {tok['embedding_rows']:,}) trained from scratch with kdlab's `SFTModule` through the packaged teacher's phases",
        f"({phases};",
        f"English, {recipe['teacher_spanish_share']:.0%} of them also in Spanish; cosine, 5% warm-up), one thread, fixed seeds.",
        "It exists for distillation across tokenizers (issue #27): the packaged student cannot share its vocabulary.",
        *loading,
        "",
        f"Tokenizer: another vocabulary than the packaged one (`kdlab://tiny/student`, `kdlab://tiny/teacher`): {tok['vocab']:,} tokens",
        f"against {tok['packaged_vocab']:,} (the corpus ran out of merges below the budget);",
        *digits,
        f"Of its {tok['token_bytes']:,} distinct token byte strings (special tokens aside), {tok['shared_token_bytes']:,}",
        f"({tok['shared_token_bytes'] / tok['token_bytes']:.0%}) are also tokens of the packaged tokenizer, which has "
        f"{tok['packaged_token_bytes']:,} ({tok['shared_token_bytes'] / tok['packaged_token_bytes']:.0%} of them",
        *same_text,
        "Special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` = EOS), tags and the ChatML chat template are",
        "the packaged ones, so a chat renders to the same text under both tokenizers.",
        "",
        f"## Measured (greedy decoding, first {recipe['eval_examples']} held-out examples)",
        "",
        "| target | measured | wanted | met |",
        "| --- | --- | --- | --- |",
        *_target_rows(XTOK_TARGETS, measured),
        "",
        "| model | Countdown-3 | Countdown-3, Spanish prompt | Countdown-4E | parameters |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows = [("teacher-xtok", measured["teacher-xtok"])] + ([("teacher (packaged, its model card)", teacher)] if teacher else [])
    for role, m in rows:
        lines.append(f"| {role} | {m['countdown3_accuracy']:.3f} | {m['spanish_prompt_accuracy']:.3f} | "
                     f"{m['countdown4e_accuracy']:.3f} | {m['parameters']:,} |")
    lines += ["", f"Build time on this machine: {measured['build_seconds']} s.", "", "## Recipe", "", "```json",
              json.dumps(recipe, indent=2), "```", ""]
    return "\n".join(lines)
