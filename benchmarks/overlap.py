"""Generation overlapped with training: the wall time of an on-policy step whose completions a server writes,
synchronously (the step waits for them) against overlapped (written one step ahead while the previous step
trains), issue #42 item 2.

    python benchmarks/overlap.py [--batch 8] [--tokens 64] [--steps 12] [--repeats 3] [--threads 1] [--out FILE]
    python benchmarks/overlap.py --smoke --out FILE   (a toy-size pass through every check: tests/test_overlap.py)

Both variants train the packaged tiny student (``kdlab://tiny/student``) against the in-process tiny teacher on
Countdown-3 through ``Trainer.fit`` (forward KL, ``--batch`` prompts per step), with on-policy completions written
by kdlab's loopback server (``python -m kdlab.rollouts.loopback kdlab://tiny/student``) in its own process,
serving the student and taking its weights after every step (``ServedRollouts``: a safetensors file and
``/collective_rpc``):

* ``synchronous``: ``ServedRollouts``: each step pushes its weights, waits for its completions, then trains;
* ``overlapped``: ``OverlappedRollouts(ServedRollouts, max_lag=1)``: while step k trains, the server writes step
  k + 1's completions from step k's weights (a background thread of the training process waits for them).

Time: ``step_s``, the wall time from the start of each fit's third step to the end of its last, per step,
averaged over ``--repeats`` fits per variant, order alternating; ``ratio`` is overlapped over synchronous (below 1:
the overlap pays). The server and the student share this machine's cores, so on a small machine the overlap
mostly moves work from one core to another: the JSON records what it measured, whatever it is. Checked before
the ratio is written: ``B`` rows per step, the thread count, the student's float32 weights, and each variant's
logged ``train/policy_lag`` (synchronous: 0 at every step; overlapped: 0, then 1). Writes
``benchmarks/results/overlap-tiny.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, finish  # noqa: E402
from served_teacher_step import WallTimer, free_port, wait_for  # noqa: E402

STUDENT, TEACHER = "kdlab://tiny/student", "kdlab://tiny/teacher"
VARIANTS = ("synchronous", "overlapped")


class Lags(pl.Callback):
    """Each step's logged ``train/policy_lag`` and ``train/rollout_weights_step``."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.writers: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lags.append(float(trainer.callback_metrics["train/policy_lag"]))
        self.writers.append(float(trainer.callback_metrics["train/rollout_weights_step"]))


def fit(variant: str, args, folder: Path, url: str, task) -> dict:
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import OverlappedRollouts, ServedRollouts
    from kdlab.stages.distill import DistillModule

    engine = ServedRollouts(url, "student", weights_dir=str(folder), dtype="float32", retries=0, timeout_s=600.0, concurrency=args.batch)
    rollout = engine if variant == "synchronous" else OverlappedRollouts(engine, max_lag=1)
    module = DistillModule(STUDENT, TEACHER, task, rollout=rollout, objective=ForwardKL(), batch_size=args.batch, max_completion_tokens=args.tokens,
                           lr=1e-5, warmup_steps=1, val_examples=1, seed=0, teacher_temperature=1.0, fused_lm_head=False)
    timer, lags = WallTimer(), Lags()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=1.0, default_root_dir=folder,
                         callbacks=[timer, lags])
    pl.seed_everything(0)
    trainer.fit(module)
    return {**timer.summary(), "policy_lag": lags.lags, "rollout_weights_step": lags.writers,
            "student_dtypes": sorted({str(p.dtype) for p in module.student.parameters()})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="toy sizes (batch 2, 8 tokens, 3 steps, 1 repeat): checks the script, times nothing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.steps, args.repeats = 2, 8, 3, 1
    check_threads(args.threads)
    if args.steps < 3 or args.repeats < 1 or args.batch < 1:
        raise SystemExit("--steps must be >= 3 (the first two are warm-up), --repeats >= 1, --batch >= 1")
    torch.set_num_threads(args.threads)
    finish("overlap-tiny", measure(args), out=args.out)


def measure(args) -> dict:
    """Both variants' fits against one loopback server started here (``args``: ``batch``, ``tokens``, ``steps``,
    ``repeats``, ``threads``, ``smoke``); the payload :func:`main` writes, ``problems`` listing any shape that is
    not what it claims (``benchmarks/gpu.py`` runs this too)."""
    from kdlab.tasks import Countdown

    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=args.batch * args.steps, num_val=0, num_test=0, seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kdlab.rollouts.loopback", STUDENT, "--name", "student", "--port", str(port)],
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    watch = LoadWatch(processes=2, threads=args.threads)  # the trainer and the loopback server
    try:
        with tempfile.TemporaryDirectory() as folder:
            wait_for(url)
            for round_ in range(args.repeats):
                for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
                    started = time.perf_counter()
                    result = fit(variant, args, Path(folder), url, task)
                    runs[variant].append(result)
                    watch.sample()
                    print(f"round {round_} {variant}: {result['wall_per_step']:.3f} s per step; fit {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    problems, results = [], {}
    expected_lags = {"synchronous": [0.0] * args.steps, "overlapped": [0.0] + [1.0] * (args.steps - 1)}
    for variant, fits in runs.items():
        for f in fits:
            if f["rows"] != [args.batch]:
                problems.append(f"{variant}: steps saw {f['rows']} rows, not B = {args.batch}")
            if f["threads"] != [args.threads]:
                problems.append(f"{variant}: ran on {f['threads']} threads, not {args.threads}")
            if f["student_dtypes"] != ["torch.float32"]:
                problems.append(f"{variant}: the student's weights are {f['student_dtypes']}, not float32")
            if f["policy_lag"] != expected_lags[variant]:
                problems.append(f"{variant}: logged policy lags {f['policy_lag']}, not {expected_lags[variant]}")
        results[variant] = {"step_s": sum(f["wall_per_step"] for f in fits) / len(fits), "fits": fits}
    ratio = results["overlapped"]["step_s"] / results["synchronous"]["step_s"]
    print(f"overlapped / synchronous step time: {ratio:.3f}" + (" (smoke: sizes too small to mean anything)" if args.smoke else ""))
    return {"smoke": args.smoke, "threads": args.threads, "batch": args.batch, "max_completion_tokens": args.tokens, "steps": args.steps,
            "repeats": args.repeats, "timed_steps": "third to last", "cores": os.cpu_count(), "variants": results, "ratio": ratio,
            **watch.record(), "problems": problems}


if __name__ == "__main__":
    main()
