"""Joint mixture decoding against each model decoding alone, on CPU (one thread by default):
``MixtureRollouts(lam=0)`` (both models step together with their own KV caches, their next-token
distributions combined every token) divided by the student's plus the teacher's decoding alone. Target
<= 1.15.

    python benchmarks/mixture_decoding.py [--vocab 151936] [--decode 64] [--repeats 5] [--threads 1]

Models: the random Qwen2 pair of ``benchmarks/common.py`` (a tokenizer of exactly V tokens, V embedding
rows), 8 prompts, ``--decode`` new tokens each (end tokens disabled, so every policy decodes exactly that
many). The script checks that every rollout has ``--decode`` tokens and that the mixture read V columns.
Writes ``benchmarks/results/mixture_decoding-V<V>.json``. (The training step is measured by
``benchmarks/real_vocab_step.py``.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, random_pair, finish  # noqa: E402


def run_times(fn, repeats: int) -> list[float]:
    """Seconds of ``repeats`` runs of ``fn`` after a warm-up run."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def decode_times(student: str, teacher: str, new_tokens: int, repeats: int, vocab: int) -> dict[str, list[float]]:
    from kdlab.stages import DistillModule
    from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherRollouts
    from kdlab.tasks import Addition

    module = DistillModule(student, teacher, Addition(num_train=8), max_completion_tokens=new_tokens, batch_size=8)
    if module.token_columns != vocab:
        raise SystemExit(f"the module's shared vocabulary is {module.token_columns}, not V = {vocab}")
    module.end_ids = (-1,)  # never stop early: every policy decodes exactly new_tokens tokens
    examples = module.task.examples("train")
    times = {}
    for name, policy in (("mixture", MixtureRollouts(lam=0.0)), ("student", StudentRollouts()), ("teacher", TeacherRollouts())):
        rollout = module.make_rollout(examples, 0, policy)
        if tuple(rollout.completion_ids.shape) != (8, new_tokens):
            raise SystemExit(f"{name}: rollouts of shape {tuple(rollout.completion_ids.shape)}, not (8, {new_tokens})")
        times[name] = run_times(lambda policy=policy: module.make_rollout(examples, 0, policy), repeats)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/mixture_decoding-V<V>.json)")
    args = parser.parse_args()
    torch.set_num_threads(check_threads(args.threads))
    watch = LoadWatch(processes=1, threads=args.threads)
    with tempfile.TemporaryDirectory() as folder:
        student, teacher = random_pair(args.vocab, Path(folder))
        runs = decode_times(student, teacher, args.decode, args.repeats, args.vocab)
    watch.sample()
    times = {name: statistics.median(values) for name, values in runs.items()}
    ratio = times["mixture"] / (times["student"] + times["teacher"])
    print(f"V={args.vocab}, 8 prompts x {args.decode} tokens, {torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(f"joint mixture {times['mixture']:.3f} s, student alone {times['student']:.3f} s + teacher alone {times['teacher']:.3f} s, "
          f"ratio {ratio:.3f} (target <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'})")
    payload = {"shapes": {"vocab": args.vocab, "prompts": 8, "new_tokens": args.decode}, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "times_s": times, "runs_s": runs, "ratio": ratio, "target": 1.15, **watch.record(), "problems": []}
    finish(f"mixture_decoding-V{args.vocab}", payload, out=args.out)


if __name__ == "__main__":
    main()
