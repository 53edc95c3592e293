"""Peak extra memory and time of full-vocabulary ForwardKL forward+backward: kdlab vs naive autograd.

    python benchmarks/kl_memory.py [--objective token_logprobs]

``--objective token_logprobs`` measures GRPO's policy log-probs of given tokens instead
(:func:`kdlab.grpo.token_logprobs` vs ``log_softmax(logits).gather``), same inputs and method.

Target: kdlab's chunked ForwardKL needs <= 0.2x the naive working memory (peak extra memory minus
the student-logits gradient that both must return) and is no slower. The peak including the
gradient is printed too: in fp32 that gradient alone is 0.2x of a naive peak of ~5 logits copies,
so no implementation that takes logits as input can go below 0.2x on that measure; only a fused
hidden-states + LM-head path can.
The naive version is the textbook one (log_softmax both, ``(p_T * (log p_T - log p_S)).sum(-1)``,
the same per-sequence mean via ``token_weights``), upcast to fp32 like kdlab, so both compute the
same number. Inputs are ``(8, N / 8, V)`` logits with a ragged completion mask.

Why subprocesses: torch has no CPU ``max_memory_allocated``, so each implementation runs in its own
fresh process (this script with a hidden flag) and reads the kernel's peak RSS: reset it by writing
"5" to /proc/self/clear_refs, take VmRSS as the baseline, run forward+backward, read VmHWM.
"Extra" is VmHWM - baseline and includes the student-logits gradient (both need it). Memory is
the first run's peak; time is the median of ``--repeats`` runs after it. Prints a measurement
and exits 0 whether or not the targets are met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from kdlab.objectives import ForwardKL, token_weights

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
    from kdlab.grpo import token_logprobs

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


def loss_fn(impl: str, chunk_size: int, objective: str = "forward_kl"):
    if objective == "token_logprobs":
        return kdlab_policy_logprobs(chunk_size) if impl == "kdlab" else naive_policy_logprobs
    return ForwardKL(chunk_size=chunk_size) if impl == "kdlab" else naive_forward_kl


def proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args: argparse.Namespace) -> None:
    """Measure one implementation in this (fresh) process; print one JSON line."""
    torch.set_num_threads(args.threads)
    student, teacher, mask = make_inputs(args.tokens, args.vocab, getattr(torch, args.dtype))
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
    print(json.dumps({"extra_mib": extra_kib / 1024, "time_s": statistics.median(times), "reset": reset}))


def check(args: argparse.Namespace) -> None:
    """kdlab and naive agree on the loss and the student gradient at a small size (several chunks)."""
    student, teacher, mask = make_inputs(512, args.vocab, getattr(torch, args.dtype), seed=1)
    chunk = min(args.chunk_size, 128)
    results = []
    for impl in ("kdlab", "naive"):
        student.grad = None
        loss = loss_fn(impl, chunk, args.objective)(student, teacher, mask)
        loss.backward()
        results.append((loss.item(), student.grad.float()))
    (l_k, g_k), (l_n, g_n) = results
    rel = abs(l_k - l_n) / abs(l_n)
    diff = (g_k - g_n).abs().max().item()
    grad_tol = 1e-6 if args.dtype == "float32" else 1e-2 * g_n.abs().max().item()  # bf16 grads: ~1 ulp
    ok = rel <= 1e-5 and diff <= grad_tol
    print(f"check {args.objective} (N=512, V={args.vocab}, chunk={chunk}, {args.dtype}): loss kdlab {l_k:.6f} naive {l_n:.6f} "
          f"rel diff {rel:.1e}; grad max abs diff {diff:.1e} (tol {grad_tol:.0e}) -> {'OK' if ok else 'MISMATCH'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="N = B * T tokens, B = 8")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk-size", type=int, default=ForwardKL().chunk_size, help="kdlab tokens per chunk (default: kdlab's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in each run")
    parser.add_argument("--objective", choices=("forward_kl", "token_logprobs"), default="forward_kl",
                        help="forward_kl: the distillation loss; token_logprobs: GRPO's policy log-probs of given tokens")
    parser.add_argument("--child", choices=("kdlab", "naive"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    torch.set_num_threads(args.threads)
    check(args)
    print(f"{args.objective}: N={args.tokens} (B={BATCH}), V={args.vocab}, {args.dtype}, chunk={args.chunk_size}, "
          f"threads={args.threads}, repeats={args.repeats}")
    flags = [f"--tokens={args.tokens}", f"--vocab={args.vocab}", f"--chunk-size={args.chunk_size}", f"--objective={args.objective}",
             f"--repeats={args.repeats}", f"--dtype={args.dtype}", f"--threads={args.threads}"]
    res = {}
    for impl in ("kdlab", "naive"):  # each in a fresh process, so neither inherits the other's peak
        out = subprocess.run([sys.executable, __file__, *flags, f"--child={impl}"],
                             check=True, capture_output=True, text=True).stdout
        res[impl] = json.loads(out.strip().splitlines()[-1])
    if not all(r["reset"] for r in res.values()):
        print("note: /proc/self/clear_refs not writable; peak = VmHWM since process start minus the baseline")
    # The gradient w.r.t. the student logits is the result both must hand to the LM head's backward;
    # "working" memory is everything beyond it, which is what an implementation can actually save.
    grad_mib = args.tokens * args.vocab * getattr(torch, args.dtype).itemsize / 2**20
    print(f"{'implementation':<16}{'peak extra MiB':>16}{'working MiB':>13}{'time s':>10}")
    for impl, r in res.items():
        r["working_mib"] = r["extra_mib"] - grad_mib
        print(f"{impl:<16}{r['extra_mib']:>16.0f}{r['working_mib']:>13.0f}{r['time_s']:>10.2f}")
    print(f"(the student-logits gradient itself is {grad_mib:.0f} MiB in both)")
    mem = res["kdlab"]["extra_mib"] / res["naive"]["extra_mib"]
    work = res["kdlab"]["working_mib"] / res["naive"]["working_mib"]
    tim = res["kdlab"]["time_s"] / res["naive"]["time_s"]
    print(f"peak extra memory ratio kdlab/naive: {mem:.2f} (includes the gradient both return)")
    print(f"working memory ratio kdlab/naive: {work:.2f} (target <= 0.20) {'met' if work <= 0.2 else 'NOT met'}")
    print(f"time ratio kdlab/naive: {tim:.2f} (target <= 1.00) {'met' if tim <= 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
