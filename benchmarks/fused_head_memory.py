"""Peak extra memory of a forward-KL step from the student's final hidden states, three ways, side by side:

* ``naive``: logits = hidden @ W.T, textbook autograd KL (log_softmax both, p_T (log p_T - log p_S));
* ``logits``: logits = hidden @ W.T, kdlab's chunked ForwardKL (closed-form gradient);
* ``fused``: kdlab's ``HeadLogits(hidden, W)``: the ``(N, V)`` student logits and their gradient never exist.

    python benchmarks/fused_head_memory.py [--tokens 8192 --vocab 32000 --hidden 1024] [--objective token_logprobs]

``--objective token_logprobs`` measures GRPO's policy term instead (weighted log-probs of given tokens, and
the entropy GRPO logs): ``naive`` is ``log_softmax(h W^T).gather``, ``logits`` is
:func:`kdlab.objectives.logprobs.token_logprobs` on ``h W^T``, ``fused`` is ``token_logprobs(HeadLogits(h, W))``.

Each runs forward + backward to the hidden states and the head weight in a fresh process (peak RSS via
/proc, as in ``kl_memory.py``), after a check that all three give the same loss and gradients. Ratios
are printed against ``naive``; the teacher logits ``(N, V)`` are an input to all three. Writes
``benchmarks/results/fused_head_memory-<objective>.json``; exits 1 on a mismatch.
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
from common import LoadWatch, check_threads, proc_kib, reset_peak_rss, finish  # noqa: E402
from kl_memory import BATCH  # noqa: E402

from kdlab.objectives import ForwardKL, HeadLogits
from kdlab.objectives.reduction import token_weights


def make_inputs(tokens: int, vocab: int, hidden_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    seq = tokens // BATCH
    hidden = (torch.randn(BATCH, seq, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_(True)
    teacher = torch.randn(BATCH, seq, vocab, generator=gen)
    lengths = torch.tensor([seq if b % 2 == 0 else 3 * seq // 4 for b in range(BATCH)])
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return hidden, weight, teacher, mask


def policy_term(impl: str, hidden, weight, mask):
    """GRPO's policy term: sum of weighted log-probs of fixed tokens (plus the entropy it logs)."""
    from kdlab.objectives.logprobs import token_logprobs

    ids = torch.randint(0, weight.shape[0], mask.shape, generator=torch.Generator().manual_seed(7))
    if impl == "naive":
        logprobs = torch.log_softmax(hidden @ weight.T, -1)
        values = logprobs.gather(-1, ids[..., None]).squeeze(-1)
        with torch.no_grad():
            (logprobs.exp() * logprobs).sum(-1)
    else:
        values, _ = token_logprobs(HeadLogits(hidden, weight) if impl == "fused" else hidden @ weight.T, ids, mask)
    return (values * token_weights(mask)).sum()


def loss(impl: str, hidden, weight, teacher, mask, objective: str = "forward_kl"):
    if objective == "token_logprobs":
        return policy_term(impl, hidden, weight, mask)
    if impl == "fused":
        return ForwardKL()(HeadLogits(hidden, weight), teacher, mask)
    logits = hidden @ weight.T
    if impl == "logits":
        return ForwardKL()(logits, teacher, mask)
    log_s, log_t = torch.log_softmax(logits, -1), torch.log_softmax(teacher, -1)
    return ((log_t.exp() * (log_t - log_s)).sum(-1) * token_weights(mask)).sum()


def child(args) -> None:
    torch.set_num_threads(args.threads)
    hidden, weight, teacher, mask = make_inputs(args.tokens, args.vocab, args.hidden)
    times = []
    for i in range(1 + args.repeats):
        hidden.grad = weight.grad = None
        if i == 0:
            reset = reset_peak_rss()
            baseline = proc_kib("VmRSS")
        start = time.perf_counter()
        loss(args.child, hidden, weight, teacher, mask, args.objective).backward()
        if i == 0:
            extra = (proc_kib("VmHWM") - baseline) / 1024
        else:
            times.append(time.perf_counter() - start)
    assert hidden.shape == (BATCH, args.tokens // BATCH, args.hidden) and weight.shape == (args.vocab, args.hidden)
    print(json.dumps({"extra_mib": extra, "time_s": statistics.median(times), "times_s": times, "reset": reset, "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--objective", choices=("forward_kl", "token_logprobs"), default="forward_kl")
    parser.add_argument("--out", type=Path, help="result file (default benchmarks/results/fused_head_memory-<objective>.json)")
    parser.add_argument("--child", choices=("naive", "logits", "fused"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.child:
        return child(args)
    small = make_inputs(512, min(args.vocab, 4096), 64, seed=1)
    results = []
    for impl in ("naive", "logits", "fused"):
        hidden, weight, teacher, mask = (t.detach().clone().requires_grad_(t.requires_grad) for t in small)
        value = loss(impl, hidden, weight, teacher, mask, args.objective)
        value.backward()
        results.append((value.item(), hidden.grad, weight.grad))
    agree = all(abs(r[0] - results[0][0]) < 1e-5 and torch.allclose(r[1], results[0][1], atol=1e-5) and torch.allclose(r[2], results[0][2], atol=1e-4) for r in results)
    print(f"check (N=512): the three agree on loss and gradients -> {'OK' if agree else 'MISMATCH'}")
    flags = [f"--tokens={args.tokens}", f"--vocab={args.vocab}", f"--hidden={args.hidden}", f"--repeats={args.repeats}",
             f"--threads={args.threads}", f"--objective={args.objective}"]
    res, watch = {}, LoadWatch(processes=1, threads=args.threads)  # one implementation's process at a time
    for impl in ("naive", "logits", "fused"):
        out = subprocess.run([sys.executable, __file__, *flags, f"--child={impl}"], check=True, capture_output=True, text=True).stdout
        res[impl] = json.loads(out.strip().splitlines()[-1])
        watch.sample()
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"{args.objective}: N={args.tokens} (B={BATCH}), V={args.vocab}, H={args.hidden}, fp32, threads={args.threads}; "
          f"one (N, V) fp32 tensor = {logits_mib:.0f} MiB")
    print(f"{'implementation':<16}{'peak extra MiB':>16}{'x naive':>10}{'time s':>10}{'x naive':>10}")
    for impl, r in res.items():
        r["extra_ratio"] = r["extra_mib"] / res["naive"]["extra_mib"]
        r["time_ratio"] = r["time_s"] / res["naive"]["time_s"]
        print(f"{impl:<16}{r['extra_mib']:>16.0f}{r['extra_ratio']:>10.2f}{r['time_s']:>10.2f}{r['time_ratio']:>10.2f}")
    problems = [] if agree else ["the three implementations disagree on loss or gradients at N = 512"]
    problems += [f"{impl}: ran on {r['threads']} threads, not {args.threads}" for impl, r in res.items() if r["threads"] != args.threads]
    payload = {"objective": args.objective, "shapes": {"tokens": args.tokens, "batch": BATCH, "vocab": args.vocab, "hidden": args.hidden},
               "dtype": "float32", "threads": args.threads, "repeats": args.repeats, "results": res, **watch.record(), "problems": problems}
    finish(f"fused_head_memory-{args.objective}", payload, out=args.out)


if __name__ == "__main__":
    main()
