"""Peak extra memory and time of full-vocabulary ForwardKL forward+backward: kdlab vs naive autograd.

    python benchmarks/kl_memory.py [--tokens 8192] [--vocab 32000] [--threads 1] [--objective token_logprobs]

Three implementations, each in a fresh process: ``kdlab`` (``ForwardKL``, which returns a new
``(B, T, V)`` gradient), ``kdlab-consume`` (``ForwardKL(..., consume=True)``, as ``DistillModule`` calls
it: the gradient is written into the student logits' own storage) and ``naive`` (the textbook version:
log_softmax both, ``(p_T * (log p_T - log p_S)).sum(-1)``, the same per-sequence mean via
``token_weights``, upcast to fp32 like kdlab, so all compute the same number). Inputs are
``(8, N / 8, V)`` logits with a ragged completion mask. ``--objective token_logprobs`` measures GRPO's
policy log-probs of given tokens instead (:func:`kdlab.objectives.logprobs.token_logprobs` vs
``log_softmax(logits).gather``).

Target: extra peak memory <= 0.2x naive. A naive peak is about five ``(N, V)`` fp32 tensors and the
returned gradient is one of them, so an objective that allocates its gradient sits at about 0.2x; only
writing the gradient into the logits (``kdlab-consume``) or the fused hidden-state path goes below.

Why subprocesses: torch has no CPU ``max_memory_allocated``, so each implementation runs in its own
process and reads the kernel's peak RSS: reset it by writing "5" to /proc/self/clear_refs, take VmRSS as
the baseline, run forward+backward, read VmHWM. Memory is the first run's peak; time is the median of
``--repeats`` runs after it. Writes ``benchmarks/results/kl_memory-<objective>-<dtype>.json``; exits 1
when an implementation disagrees with naive (loss or gradient) or the measurement is not what it claims.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, proc_kib, reset_peak_rss, finish  # noqa: E402,F401  (proc_kib, reset_peak_rss: used by children)

from kdlab.objectives import ForwardKL
from kdlab.objectives.reduction import token_weights

BATCH = 8


def make_inputs(tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Student (requires grad) and teacher logits (B, T, V); mask (B, T) with every other sequence 3/4 long."""
    if tokens % BATCH:
        raise ValueError(f"--tokens must be a multiple of {BATCH}, got {tokens}")
    gen = torch.Generator().manual_seed(seed)
    seq = tokens // BATCH
    student = torch.randn(BATCH, seq, vocab, generator=gen, dtype=dtype).requires_grad_(True)
    teacher = torch.randn(BATCH, seq, vocab, generator=gen, dtype=dtype)
    lengths = torch.tensor([seq if b % 2 == 0 else 3 * seq // 4 for b in range(BATCH)])
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return student, teacher, mask


def naive_forward_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Textbook autograd KL(pi_T || pi_S) over (B, T, V), reduced like kdlab (per-sequence mean)."""
    log_s = torch.log_softmax(student.float(), dim=-1)
    log_t = torch.log_softmax(teacher.float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return (kl * token_weights(mask)).sum()


def sampled_ids(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, mask.shape, generator=torch.Generator().manual_seed(7))


def kdlab_policy_logprobs(chunk_size: int):
    """GRPO's policy term: the sum of weighted log-probs of given tokens, via kdlab's chunked function."""
    from kdlab.objectives.logprobs import token_logprobs

    def loss(student, teacher, mask):
        values, _ = token_logprobs(student, sampled_ids(mask, student.shape[-1]), mask, chunk_size=chunk_size)
        return (values * token_weights(mask)).sum()

    return loss


def naive_policy_logprobs(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The textbook ``log_softmax(logits).gather(ids)`` (autograd keeps the (B, T, V) fp32 log-softmax),
    with the per-position entropy GRPO logs, as kdlab computes it too."""
    logprobs = torch.log_softmax(student.float(), dim=-1)
    values = logprobs.gather(-1, sampled_ids(mask, student.shape[-1])[..., None]).squeeze(-1)
    with torch.no_grad():
        (logprobs.exp() * logprobs).sum(-1)
    return (values * token_weights(mask)).sum()


IMPLEMENTATIONS = ("kdlab", "kdlab-consume", "naive")
"""``kdlab-consume``: ForwardKL with ``consume=True`` (as ``DistillModule`` calls it): the gradient is
written into the student logits' own storage, so only block buffers are extra."""


def loss_fn(impl: str, chunk_size: int, objective: str = "forward_kl"):
    if objective == "token_logprobs":
        return kdlab_policy_logprobs(chunk_size) if impl.startswith("kdlab") else naive_policy_logprobs
    if impl == "kdlab-consume":
        objective_module = ForwardKL(chunk_size=chunk_size)
        return lambda student, teacher, mask: objective_module(student, teacher, mask, consume=True)
    return ForwardKL(chunk_size=chunk_size) if impl == "kdlab" else naive_forward_kl


def child(args: argparse.Namespace) -> None:
    """Measure one implementation in this (fresh) process; print one JSON line."""
    torch.set_num_threads(args.threads)
    student, teacher, mask = make_inputs(args.tokens, args.vocab, getattr(torch, args.dtype))
    assert student.shape == (BATCH, args.tokens // BATCH, args.vocab) and student.dtype == getattr(torch, args.dtype)
    fn = loss_fn(args.child, args.chunk_size, args.objective)
    times, reset = [], False
    for i in range(1 + args.repeats):  # run 0 measures memory (and warms up); the rest are timed
        student.grad = None
        if i == 0:
            reset = reset_peak_rss()
            baseline = proc_kib("VmRSS")
        start = time.perf_counter()
        fn(student, teacher, mask).backward()
        elapsed = time.perf_counter() - start
        if i == 0:
            extra_kib = proc_kib("VmHWM") - baseline  # student.grad is still alive here
        else:
            times.append(elapsed)
    print(json.dumps({"extra_mib": extra_kib / 1024, "time_s": statistics.median(times), "times_s": times, "reset": reset,
                      "threads": torch.get_num_threads()}))


def check(args: argparse.Namespace) -> dict:
    """Every implementation agrees with naive on the loss and the student gradient at a small size
    (several chunks), each on its own copy of the inputs (``kdlab-consume`` overwrites its logits)."""
    student, teacher, mask = make_inputs(512, args.vocab, getattr(torch, args.dtype), seed=1)
    chunk = min(args.chunk_size, 128)
    results = {}
    for impl in IMPLEMENTATIONS:
        mine = student.detach().clone().requires_grad_(True)
        loss = loss_fn(impl, chunk, args.objective)(mine, teacher, mask)
        loss.backward()
        if mine.grad.shape != (BATCH, 512 // BATCH, args.vocab):
            raise SystemExit(f"{impl}: gradient of shape {tuple(mine.grad.shape)}, not (B, T, V) = ({BATCH}, {512 // BATCH}, {args.vocab})")
        results[impl] = (loss.item(), mine.grad.float())
    l_n, g_n = results["naive"]
    grad_tol = 1e-6 if args.dtype == "float32" else 1e-2 * g_n.abs().max().item()  # bf16 grads: ~1 ulp
    report = {}
    for impl, (value, grad) in results.items():
        rel, diff = abs(value - l_n) / abs(l_n), (grad - g_n).abs().max().item()
        report[impl] = {"loss": value, "loss_rel_diff": rel, "grad_max_abs_diff": diff, "ok": rel <= 1e-5 and diff <= grad_tol}
        print(f"check {args.objective} (N=512, V={args.vocab}, chunk={chunk}, {args.dtype}) {impl}: loss {value:.6f} vs naive {l_n:.6f}, "
              f"rel diff {rel:.1e}; grad max abs diff {diff:.1e} (tol {grad_tol:.0e}) -> {'OK' if report[impl]['ok'] else 'MISMATCH'}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="N = B * T tokens, B = 8")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-size", type=int, default=ForwardKL().chunk_size, help="kdlab tokens per chunk (default: kdlab's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each run (default 1)")
    parser.add_argument("--objective", choices=("forward_kl", "token_logprobs"), default="forward_kl",
                        help="forward_kl: the distillation loss; token_logprobs: GRPO's policy log-probs of given tokens")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/kl_memory-<objective>-<dtype>.json)")
    parser.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.child:
        return child(args)

    torch.set_num_threads(args.threads)
    checks = check(args)
    print(f"{args.objective}: N={args.tokens} (B={BATCH}), V={args.vocab}, {args.dtype}, chunk={args.chunk_size}, "
          f"threads={torch.get_num_threads()}, repeats={args.repeats}")
    flags = [f"--tokens={args.tokens}", f"--vocab={args.vocab}", f"--chunk-size={args.chunk_size}", f"--objective={args.objective}",
             f"--repeats={args.repeats}", f"--dtype={args.dtype}", f"--threads={args.threads}"]
    res, watch = {}, LoadWatch(processes=1, threads=args.threads)  # one implementation's process at a time
    implementations = IMPLEMENTATIONS if args.objective == "forward_kl" else ("kdlab", "naive")
    for impl in implementations:  # each in a fresh process, so neither inherits the other's peak
        out = subprocess.run([sys.executable, __file__, *flags, f"--child={impl}"],
                             check=True, capture_output=True, text=True).stdout
        res[impl] = json.loads(out.strip().splitlines()[-1])
        watch.sample()
    problems = [f"{impl}: loss or gradient differs from naive" for impl, c in checks.items() if not c["ok"]]
    problems += [f"{impl}: ran on {r['threads']} threads, not {args.threads}" for impl, r in res.items() if r["threads"] != args.threads]
    problems += [f"{impl}: the peak-RSS counter could not be reset" for impl, r in res.items() if not r["reset"]]
    # The gradient w.r.t. the student logits is the result both must hand to the LM head's backward;
    # "working" memory is everything beyond it, which is what an implementation can actually save.
    grad_mib = args.tokens * args.vocab * getattr(torch, args.dtype).itemsize / 2**20
    print(f"{'implementation':<16}{'peak extra MiB':>16}{'x naive':>9}{'working MiB':>13}{'time s':>10}{'x naive':>9}")
    for impl, r in res.items():
        r["working_mib"] = r["extra_mib"] - (0 if impl == "kdlab-consume" else grad_mib)
        r["extra_ratio"] = r["extra_mib"] / res["naive"]["extra_mib"]
        r["time_ratio"] = r["time_s"] / res["naive"]["time_s"]
        print(f"{impl:<16}{r['extra_mib']:>16.0f}{r['extra_ratio']:>9.3f}{r['working_mib']:>13.0f}{r['time_s']:>10.2f}{r['time_ratio']:>9.2f}")
    print(f"(the student-logits gradient itself is {grad_mib:.0f} MiB; kdlab-consume writes it into the logits' own storage)")
    payload = {"objective": args.objective, "shapes": {"tokens": args.tokens, "batch": BATCH, "vocab": args.vocab}, "dtype": args.dtype,
               "chunk_size": args.chunk_size, "threads": args.threads, "repeats": args.repeats, "gradient_mib": grad_mib,
               "check": checks, "results": res, **watch.record(), "problems": problems}
    finish(f"kl_memory-{args.objective}-{args.dtype}", payload, out=args.out)


if __name__ == "__main__":
    main()
