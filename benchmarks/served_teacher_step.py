"""The cost of a served teacher: a training step whose teacher log-probs come over HTTP against the step
that reads them from a top-k cache, at the same shapes.

    python benchmarks/served_teacher_step.py [--batch 8] [--steps 12] [--top-k 20] [--repeats 2] [--threads 1] [--out FILE]

Both variants train the packaged tiny student through ``Trainer.fit`` (``DistillModule.training_step``:
student forward/backward, forward KL against a top-k teacher, logging, AdamW) on the same completions (the
task's reference completions, Countdown-3), ``--batch`` prompts per step, teacher temperature 0.5:

* ``cached``: ``CachedTeacherRollouts``: the packaged teacher's top-k log-probs, written once before the fit
  by ``kdlab generate``'s cache builder; no teacher work during the step.
* ``served``: ``TeacherDatasetRollouts`` with ``served_teacher``: kdlab's loopback server (``python -m
  kdlab.rollouts.loopback kdlab://tiny/teacher``), in its own process on its own thread, scores each
  completion with ``prompt_logprobs`` over HTTP during the step (``concurrency`` requests at once).

``served`` therefore includes the teacher's forward passes (on the server) and the HTTP and JSON work that
``cached`` never does; on a real deployment the server runs on other GPUs. Time: each optimiser step's wall
time, median over the steps after the first two of each fit, ``--repeats`` fits per variant, order
alternating. Checked before the ratio is printed: ``B`` rows per step, the student's columns, the thread
count, and that both variants' first-step losses agree (the same top-k teacher). Writes
``benchmarks/results/served_teacher_step-tiny.json``. Target (issue #28): ``served`` at most 1.3x ``cached``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import check_threads, finish  # noqa: E402
from cross_tokenizer_step import StepTimer, dataset  # noqa: E402

STUDENT, TEACHER = "kdlab://tiny/student", "kdlab://tiny/teacher"
TARGET = 1.3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(url: str, seconds: float = 120.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the loopback server at {url} did not come up in {seconds:.0f} s")


def fit(variant: str, args, folder: Path, url: str, cache: str, data: str, task) -> dict:
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import CachedTeacherRollouts, TeacherDatasetRollouts
    from kdlab.rollouts.served import ServedTeacher
    from kdlab.stages.distill import DistillModule

    common = dict(objective=ForwardKL(), batch_size=args.batch, max_completion_tokens=args.tokens, lr=1e-5, warmup_steps=1,
                  val_examples=1, seed=0, teacher_temperature=0.5, fused_lm_head=False)
    if variant == "cached":
        module = DistillModule(STUDENT, None, task, rollout=CachedTeacherRollouts(data, cache), **common)
    else:
        served = ServedTeacher(url, "tiny-teacher", TEACHER, top_k=args.top_k, concurrency=args.concurrency)
        module = DistillModule(STUDENT, None, task, rollout=TeacherDatasetRollouts(data), served_teacher=served, **common)
    timer = StepTimer()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         gradient_clip_val=1.0, default_root_dir=folder, callbacks=[timer])
    pl.seed_everything(0)
    rollout = module.make_rollout(task.examples("train")[: args.batch], 0)
    student, teacher = module.distillation_logits(rollout)
    first_loss = float(module.objective(student.detach(), teacher, rollout.completion_mask))
    trainer.fit(module)
    return {"seconds": timer.seconds, "rows": sorted({s["rows"] for s in timer.shapes}), "threads": sorted({s["threads"] for s in timer.shapes}),
            "student_columns": int(student.shape[-1]), "first_loss": first_loss, "completion_tokens": int(rollout.completion_mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.steps < 3 or args.repeats < 1 or args.top_k < 1:
        raise SystemExit("--steps must be >= 3 (the first two are warm-up), --repeats >= 1, --top-k >= 1")
    torch.set_num_threads(args.threads)
    from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.rollouts.teacher_data import build_teacher_cache
    from kdlab.tasks import Countdown

    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=args.batch * args.steps, num_val=0, num_test=0, seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kdlab.rollouts.loopback", TEACHER, "--name", "tiny-teacher", "--port", str(port)],
                              env={**__import__("os").environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"cached": [], "served": []}
    try:
        with tempfile.TemporaryDirectory() as folder:
            data = dataset(task, Path(folder))
            cache = str(Path(folder) / "cache.safetensors")
            build_teacher_cache(load_causal_lm(ModelSpec(TEACHER)), load_tokenizer(ModelSpec(TEACHER)), task, data, cache, top_k=args.top_k,
                                temperature=0.5, max_new_tokens=args.tokens, max_prompt_tokens=256, batch_size=args.batch)
            wait_for(url)
            variants = list(runs)
            for round_ in range(args.repeats):
                for variant in (variants if round_ % 2 == 0 else variants[::-1]):
                    runs[variant].append(fit(variant, args, Path(folder), url, cache, data, task))
                    print(f"round {round_} {variant}: median step {statistics.median(runs[variant][-1]['seconds'][2:]):.3f} s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    problems, results = [], {}
    for variant, fits in runs.items():
        for f in fits:
            if f["rows"] != [args.batch]:
                problems.append(f"{variant}: steps saw {f['rows']} rows, not B = {args.batch}")
            if f["threads"] != [args.threads]:
                problems.append(f"{variant}: ran on {f['threads']} threads, not {args.threads}")
        steps = [s for f in fits for s in f["seconds"][2:]]
        results[variant] = {"median_step_s": statistics.median(steps), "steps_timed": len(steps), "student_columns": fits[0]["student_columns"],
                            "first_loss": fits[0]["first_loss"], "completion_tokens": fits[0]["completion_tokens"]}
    if abs(results["cached"]["first_loss"] - results["served"]["first_loss"]) > 1e-3:
        problems.append(f"first-step losses differ: cached {results['cached']['first_loss']}, served {results['served']['first_loss']}")
    ratio = results["served"]["median_step_s"] / results["cached"]["median_step_s"]
    print(f"cached {results['cached']['median_step_s']:.3f} s, served {results['served']['median_step_s']:.3f} s: {ratio:.2f}x")
    payload = {"pair": "tiny", "shapes": {"batch": args.batch, "max_completion_tokens": args.tokens, "top_k": args.top_k},
               "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "concurrency": args.concurrency, "target": TARGET,
               "results": results, "ratio": ratio, "problems": problems}
    finish("served_teacher_step-tiny", payload, out=args.out)


if __name__ == "__main__":
    main()
