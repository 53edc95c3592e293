"""OMP_NUM_THREADS=1 python experiments/smollm2/cross_tokenizer/make_student.py --model runs/smollm2/student --vocab 16384 --output runs/smollm2/student-trimmed

A student with another tokenizer for the cross-tokenizer SmolLM2 run (issue #27,
``experiments/smollm2/cross_tokenizer.yaml``): the depth-pruned SmolLM2 student (``kdlab prune ... --layers
first:27 --output runs/smollm2/student``) with a *trimmed vocabulary*.

The new tokenizer is SmolLM2's own byte-level BPE keeping only its first ``N`` merges (``--merges N``, or
``--vocab V`` for the smallest ``N`` whose vocabulary, special and added tokens included, has ``V`` tokens).
Kept: every added/special token (``<|im_start|>``, ``<|im_end|>``, ...), the byte alphabet and the tokens
the first ``N`` merges make; everything else of the model (normaliser, pre-tokeniser, decoder, chat
template, BOS/EOS/PAD/UNK) is unchanged. Kept tokens are renumbered compactly, and the model's embedding
rows (and LM-head rows: SmolLM2 ties them) are gathered for the kept tokens, with ``config.vocab_size``
and the config's and generation config's special ids set to match. A word whose merges were dropped is
spelt with more, shorter tokens than SmolLM2 spells it; every kept token has the same bytes and the same
(pretrained) embedding as in SmolLM2.

Ids (``--layout``): SmolLM2's vocabulary is laid out in merge order (17 added tokens, the 235-character
byte alphabet, then the 48,900 merges' tokens, merge ``i`` making id ``252 + i``), so the kept tokens are
its ids ``0..V-1``. ``specials-last`` (default) numbers the regular tokens first and the 17 added tokens
after them, as GPT-2 and Qwen2 lay out their vocabularies: every kept token's id differs from SmolLM2's
(regular tokens by -17; the added tokens are 16,367-16,383, ``<|im_end|>`` 16,369 instead of 2). ``source`` keeps SmolLM2's ids (the new
vocabulary is then a prefix of SmolLM2's): the vocabulary map is the identity on the first 16,384 ids, a
case ``kdlab.objectives.aligned.event_logprobs`` failed on when this was written (a ``(G, 49152)`` teacher
row masked with a 16,384-column mask).

The output is a normal Hugging Face folder (``model.safetensors``, config, generation config, tokenizer
files, the source's ``pruning.json`` if any) plus ``trimming.json`` recording the source, ``N``, the sizes,
the kept ids (as ranges) and the checks below. Checks, each failing the script when it does not hold:

* the folder reloads through :mod:`kdlab.models.loading` (``ModelSpec(<folder>)``) with
  ``len(tokenizer) == config.vocab_size == `` the embedding's rows, and the same normaliser, pre-tokeniser
  and decoder as the source tokenizer (transformers may rebuild a tokenizer class from ``tokenizer.json``);
* the reloaded tokenizer reproduces the bytes of every plain check text (:func:`kdlab.alignment.check_reproduces`;
  English, digits, non-ASCII, emoji, whitespace runs) and decodes each check text, a chat-templated Counting
  prompt included, back to itself;
* every id names a token with its source token's bytes (special tokens: the same content and flag), and
  :class:`kdlab.objectives.aligned.VocabularyMap` (what ``CrossTokenizer`` builds) pairs every trimmed
  token with its source token;
* on the check texts the trimmed tokenizer's ids, and some segmentations, differ from the source's, and
  on a text both segment alike, the trimmed model's logits equal the source's at the kept columns.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

CHECK_TEXTS = [
    "How many times does the letter 'r' appear in the word 'strawberry'? Count them one at a time.",
    "The letter 'e' appears 3 times in 'excellence': e, x, c, e, l, l, e, n, c, e.",
    "Distillation across tokenizers: 1234567890, 3.14159, naïve café, 世界, 🎉!\n\n  indented\tand tabbed",
    "Hello, world. The quick brown fox jumps over the lazy dog.",
]
SAME_TEXT = "The cat is on the mat."  # tokenised alike by both (checked): the logits must agree there


def _merge_pair(merge: Any) -> tuple[str, str]:
    """A merge as ``(left, right)``: tokenizer.json stores ``["a", "b"]`` (new) or ``"a b"`` (old)."""
    if isinstance(merge, str):
        left, right = merge.split(" ")
        return left, right
    return merge[0], merge[1]


def trim_tokenizer_json(data: dict[str, Any], *, merges: int | None = None, vocab: int | None = None,
                        layout: str = "specials-last") -> tuple[dict[str, Any], list[int], int]:
    """``(new tokenizer.json, old ids kept in new-id order, merges kept)`` for a byte-level BPE
    ``tokenizer.json`` ``data``, keeping its added tokens, its alphabet and its first ``merges`` merges (or
    the fewest merges giving ``vocab`` tokens in all). ``layout``: ``"source"`` keeps the kept tokens in
    their old id order; ``"specials-last"`` puts the regular tokens first (in their old order), then the
    added tokens (in theirs)."""
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"the tokenizer is {model.get('type')!r}, not a BPE model")
    if "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise ValueError("the tokenizer is not byte level (no ByteLevel pre-tokenizer): trimming could lose bytes")
    if (merges is None) == (vocab is None):
        raise ValueError("give exactly one of merges and vocab")
    old_vocab: dict[str, int] = model["vocab"]
    pairs = [_merge_pair(m) for m in model["merges"]]
    added = {int(token["id"]) for token in data.get("added_tokens", [])}
    made = {left + right for left, right in pairs}
    alphabet = {i for token, i in old_vocab.items() if token not in made and len(token) == 1}
    unreachable = [token for token, i in old_vocab.items() if token not in made and len(token) != 1 and i not in added]
    if unreachable:
        print(f"dropping {len(unreachable)} vocabulary entries no merge makes: {unreachable[:5]}")
    kept = added | alphabet
    if vocab is not None and vocab < len(kept):
        raise ValueError(f"--vocab {vocab} is below the {len(kept)} added and alphabet tokens")
    count = 0
    for left, right in pairs:
        if merges is not None and count >= merges or vocab is not None and len(kept) >= vocab:
            break
        if left + right not in old_vocab:
            raise ValueError(f"merge {count} ({left!r}, {right!r}) makes a token outside the vocabulary")
        kept.add(old_vocab[left + right])
        count += 1
    if vocab is not None and len(kept) != vocab:
        raise ValueError(f"--vocab {vocab} cannot be reached: all {count} merges give {len(kept)} tokens")
    if layout == "source":
        old_ids = sorted(kept)
    elif layout == "specials-last":
        old_ids = sorted(kept - added) + sorted(kept & added)
    else:
        raise ValueError(f"layout must be 'source' or 'specials-last', got {layout!r}")
    new_id = {old: new for new, old in enumerate(old_ids)}
    out = json.loads(json.dumps(data))
    out["model"]["vocab"] = {token: new_id[i] for token, i in sorted(old_vocab.items(), key=lambda item: item[1]) if i in new_id}
    out["model"]["merges"] = model["merges"][:count]
    for token in out.get("added_tokens", []):
        token["id"] = new_id[int(token["id"])]
    processor = out.get("post_processor") or {}
    for special in (processor.get("special_tokens") or {}).values():  # TemplateProcessing names ids too
        special["ids"] = [new_id[int(i)] for i in special.get("ids", [])]
    return out, old_ids, count


def ranges(ids: list[int]) -> list[list[int]]:
    """Ids as ``[start, stop)`` runs of consecutive ids, in their order."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def gather_vocabulary(network: torch.nn.Module, old_ids: list[int]) -> None:
    """Keep the embedding (and untied LM-head) rows of ``old_ids``, in that order; ties stay tied."""
    index = torch.tensor(old_ids, dtype=torch.long)
    embedding = network.get_input_embeddings()
    head = network.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    new_embedding = torch.nn.Embedding(len(old_ids), embedding.weight.shape[1], dtype=embedding.weight.dtype)
    new_embedding.weight.data.copy_(embedding.weight.data[index])
    network.set_input_embeddings(new_embedding)
    if head is not None:
        if tied:
            head.weight = new_embedding.weight
        else:
            head.weight = torch.nn.Parameter(head.weight.data[index].clone())
        if getattr(head, "bias", None) is not None:
            head.bias = torch.nn.Parameter(head.bias.data[index].clone())
        head.out_features = len(old_ids)
    text_config = network.config.get_text_config()
    text_config.vocab_size = len(old_ids)
    if text_config is not network.config and hasattr(network.config, "vocab_size"):
        network.config.vocab_size = len(old_ids)


def remap_special_ids(config: Any, new_id: dict[int, int]) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "decoder_start_token_id"):
        value = getattr(config, name, None)
        if value is None:
            continue
        mapped = [new_id[int(v)] for v in value] if isinstance(value, (list, tuple)) else new_id[int(value)]
        setattr(config, name, mapped)


def counting_prompt(tokenizer: Any) -> str:
    """A Counting prompt as the run renders it (the task's system prompt through the chat template)."""
    from kdlab.tasks import Counting

    task = Counting(answer_from="last_number", num_train=0, num_val=1, num_test=0)
    return task.render(tokenizer, task.student_messages(task.examples("val")[0]))


def check(source: str, output: Path, old_ids: list[int], source_tokenizer: Any) -> dict[str, Any]:
    """The checks of the module docstring on the written folder; returns what they measured."""
    from kdlab.alignment import check_reproduces, special_ids, token_bytes
    from kdlab.objectives.aligned import VocabularyMap
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec(str(output))
    tokenizer = load_tokenizer(spec, "trimmed")
    network = load_causal_lm(spec, "trimmed").eval()
    rows = network.get_input_embeddings().weight.shape[0]
    assert len(tokenizer) == network.config.vocab_size == rows == len(old_ids), (len(tokenizer), network.config.vocab_size, rows)
    written, loaded = json.loads(source_tokenizer.backend_tokenizer.to_str()), json.loads(tokenizer.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        assert written.get(part) == loaded.get(part), f"the reloaded tokenizer's {part} changed: {loaded.get(part)} vs {written.get(part)}"
    for name in ("eos_token", "pad_token", "bos_token"):
        assert getattr(tokenizer, name) == getattr(source_tokenizer, name), name
    assert tokenizer.chat_template == source_tokenizer.chat_template
    # every id names a token, with the bytes (or special content) of the source token it was gathered from
    names = tokenizer.convert_ids_to_tokens(list(range(rows)))
    assert None not in names, f"ids without a token: {[i for i, name in enumerate(names) if name is None][:5]}"
    assert names == source_tokenizer.convert_ids_to_tokens(old_ids)
    assert token_bytes(tokenizer, range(rows)) == token_bytes(source_tokenizer, old_ids)
    assert special_ids(tokenizer) == {new_id for new_id, old in enumerate(old_ids) if old in special_ids(source_tokenizer)}
    # the map DistillModule(cross_tokenizer=CrossTokenizer()) builds pairs every trimmed token with its source token
    vocabulary = VocabularyMap.build(source_tokenizer, tokenizer, len(source_tokenizer), rows)
    assert vocabulary.size == rows and vocabulary.teacher_ids.tolist() == [old_ids[i] for i in vocabulary.student_ids.tolist()]
    texts = CHECK_TEXTS + [counting_prompt(tokenizer)]
    measured = {"texts": []}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        source_ids = source_tokenizer(text, add_special_tokens=False)["input_ids"]
        if "<|im_start|>" not in text:
            check_reproduces(tokenizer, text, ids, "trimmed student")
        assert tokenizer.decode(ids) == text, (tokenizer.decode(ids), text)
        assert max(ids) < len(old_ids)
        measured["texts"].append({"text": text[:60], "tokens": len(ids), "source_tokens": len(source_ids), "same_ids": ids == source_ids,
                                  "same_segmentation": [old_ids[i] for i in ids] == source_ids})
    assert not all(row["same_ids"] for row in measured["texts"]), "the trimmed tokenizer gives SmolLM2's ids on every check text"
    assert not all(row["same_segmentation"] for row in measured["texts"]), "the trimmed tokenizer segments every check text as SmolLM2"
    ids = tokenizer(SAME_TEXT, add_special_tokens=False)["input_ids"]
    assert [old_ids[i] for i in ids] == source_tokenizer(SAME_TEXT, add_special_tokens=False)["input_ids"], "SAME_TEXT is segmented differently"
    source_network = load_causal_lm(ModelSpec(source), "source").eval()
    with torch.no_grad():
        trimmed_logits = network(torch.tensor([ids])).logits[0]
        source_logits = source_network(torch.tensor([[old_ids[i] for i in ids]])).logits[0][:, torch.tensor(old_ids)]
    difference = (trimmed_logits - source_logits).abs().max().item()
    assert difference < 1e-4, difference
    measured["logits_max_difference_on_a_shared_tokenisation"] = difference
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", required=True, help="the source model (any kdlab ModelSpec path: the pruned student's folder)")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--merges", type=int, help="keep the first N merges")
    size.add_argument("--vocab", type=int, help="keep the fewest merges giving this many tokens, special and added tokens included")
    parser.add_argument("--output", required=True, help="a new or empty folder")
    parser.add_argument("--layout", default="specials-last", choices=["specials-last", "source"],
                        help="new ids: regular tokens then special ones (default), or the source's order")
    parser.add_argument("--no-check", action="store_true", help="skip the reload checks")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tokenizers import Tokenizer

    from kdlab.models.export import export_pretrained
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--output {str(out)!r} exists and is not an empty folder")
    spec = ModelSpec(args.model)
    tokenizer = load_tokenizer(spec, "model")
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    trimmed, old_ids, count = trim_tokenizer_json(data, merges=args.merges, vocab=args.vocab, layout=args.layout)
    new_id = {old: new for new, old in enumerate(old_ids)}

    network = load_causal_lm(spec, "model")
    before = sum(p.numel() for p in network.parameters())
    source_rows = network.get_input_embeddings().weight.shape[0]
    gather_vocabulary(network, old_ids)
    remap_special_ids(network.config, new_id)
    if getattr(network, "generation_config", None) is not None:
        remap_special_ids(network.generation_config, new_id)
    after = sum(p.numel() for p in network.parameters())

    # the source tokenizer object, carrying the trimmed backend: its class, chat template and special
    # tokens are saved unchanged, and tokenizer.json is the trimmed one
    trimmed_tokenizer = tokenizer.__class__(tokenizer_object=Tokenizer.from_str(json.dumps(trimmed)),
                                            **{name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                                               if getattr(tokenizer, name, None) is not None})
    trimmed_tokenizer.chat_template = tokenizer.chat_template
    out.mkdir(parents=True, exist_ok=True)
    export_pretrained(network, trimmed_tokenizer, out)
    source_record = Path(spec.resolved) / "pruning.json" if Path(spec.resolved).is_dir() else None
    if source_record is not None and source_record.exists():
        (out / "pruning.json").write_text(source_record.read_text(encoding="utf-8"), encoding="utf-8")
    record: dict[str, Any] = {
        "source": args.model,
        "merges": {"kept": count, "source": len(data["model"]["merges"])},
        "vocabulary": {"source": source_rows, "trimmed": len(old_ids), "added_tokens": len(data.get("added_tokens", []))},
        "layout": args.layout,
        "kept_source_ids": ranges(old_ids),
        "parameters": {"before": before, "after": after},
    }
    if not args.no_check:
        record["checks"] = check(args.model, out, old_ids, tokenizer)
    (out / "trimming.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
