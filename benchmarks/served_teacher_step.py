"""The cost of a served teacher: a training step whose teacher log-probs come over HTTP against the step
that reads them from a top-k cache, at the same shapes.

    python benchmarks/served_teacher_step.py [--batch 8] [--steps 12] [--top-k 20] [--repeats 3] [--threads 1] [--out FILE]
    python benchmarks/served_teacher_step.py --smoke --out FILE  # toy sizes, one attempt, load not checked: the path, no timing

Every variant trains the packaged tiny student through ``Trainer.fit`` (``DistillModule.training_step``:
student forward/backward, forward KL against a top-k teacher, logging, AdamW) on the same completions (the
task's reference completions, Countdown-3), ``--batch`` prompts per step, teacher temperature 0.5:

* ``cached``: ``CachedTeacherRollouts``: the packaged teacher's top-k log-probs, written once before the fit
  by ``kdlab generate``'s cache builder; no teacher work during the step.
* ``served``: ``TeacherDatasetRollouts`` with the teacher ``Served(ServedTeacher(...))`` (its defaults: ``prefetch`` on,
  ``request_prompts`` 8, ``decode_workers`` 1): kdlab's loopback server (``python -m kdlab.rollouts.loopback
  kdlab://tiny/teacher``), in its own process on its own thread, scores each micro-batch's completions
  (``prompt_logprobs`` over HTTP, JSON replies); kdlab's decoding process receives and ranks them, and the
  training process tempers and stacks them; with ``prefetch`` the requests for micro-batch n+1 go out (from
  a background thread of the training process) while micro-batch n trains, and step n+1 takes the answer. The first step of an epoch has nothing prefetched: here the epoch is the fit, and that step
  is one of the two warm-up steps left out (``mean_all_steps_s`` counts them).
* ``served_no_prefetch``: the same with ``prefetch: false``: the step waits for the server.

The loopback server stands for vLLM, and like vLLM's scheduler it batches: a request's prompts (and the
scoring requests waiting together) go through one forward. The server's forward passes and JSON writing, and
the decoding process's JSON reading (``json_decoder``: orjson when installed) and ranking, run on the
machine's second core while the student trains on the first, so ``served`` measures how well that work is
hidden, not its absence (on a real deployment the server runs on other GPUs); the training process keeps
the request threads, the tempering and stacking, and what is left of waiting.

Time: ``step_s``, the wall time from the start of each fit's third step to the end of its last, per step
(what a run pays per step, the moments between steps included), averaged over ``--repeats`` fits per
variant, order rotating; ``median_step_s`` is the median of the same steps' own times. A fit during which
other processes used more than ``--max-foreign`` cores (this machine is shared) is run again, up to
``--attempts`` times (``foreign_cores``, ``fits_discarded``). Checked before the ratio is printed: ``B`` rows
per step, the student's columns (the objective's against the student tokenizer's size), the thread count, and that
all variants' first-step losses agree (the same top-k teacher). Writes ``benchmarks/results/served_teacher_step-tiny.json``. Target (issue #28): ``served``
at most 1.3x ``cached`` (``ratio``, of ``step_s``).
"""

from __future__ import annotations

import argparse
import json
import os
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
from common import LoadWatch, check_threads, finish, fit_problems  # noqa: E402
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


class WallTimer(StepTimer):
    """:class:`StepTimer`, and when each step started and ended (the wall time of the timed steps, gaps between them included)."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.starts.append(self._start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.ends.append(time.perf_counter())

    def summary(self) -> dict:
        """Each step's seconds, the wall seconds per step after the first two (warm-up; gaps between steps
        included), and the rows and threads the steps saw."""
        if len(self.ends) < 3:
            raise RuntimeError(f"{len(self.ends)} steps timed: the wall time per step needs at least 3 (the first two are warm-up)")
        return {"seconds": self.seconds, "wall_per_step": (self.ends[-1] - self.starts[2]) / (len(self.ends) - 2),
                "rows": sorted({s["rows"] for s in self.shapes}), "threads": sorted({s["threads"] for s in self.shapes})}


def cpu_ticks(pids: list[int]) -> tuple[int, int]:
    """(the machine's busy CPU ticks, the ticks of ``pids`` with all their threads), from /proc."""
    with open("/proc/stat") as handle:
        ticks = [int(value) for value in handle.readline().split()[1:]]
    own = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        own += int(fields[11]) + int(fields[12])  # utime, stime
    return sum(ticks) - ticks[3] - ticks[4], own  # less idle and iowait


def fit(variant: str, args, folder: Path, url: str, cache: str, data: str, task, server_pid: int) -> dict:
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts import CachedTeacherRollouts, TeacherDatasetRollouts
    from kdlab.rollouts.served import ServedTeacher
    from kdlab.stages.distill import DistillModule
    from kdlab.teachers import Served

    common = dict(objective=ForwardKL(), batch_size=args.batch, max_completion_tokens=args.tokens, lr=1e-5, warmup_steps=1,
                  val_examples=1, seed=0, teacher_temperature=0.5, fused_lm_head=False)
    server = None  # the ServedTeacher of the served variants
    if variant == "cached":
        module = DistillModule(STUDENT, None, task, rollout=CachedTeacherRollouts(data, cache), **common)
    else:
        server = ServedTeacher(url, "tiny-teacher", TEACHER, top_k=args.top_k, concurrency=args.concurrency, prefetch=variant == "served")
        module = DistillModule(STUDENT, Served(server), task, rollout=TeacherDatasetRollouts(data), **common)
    timer = WallTimer()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         gradient_clip_val=1.0, default_root_dir=folder, callbacks=[timer])
    pl.seed_everything(0)
    rollout = module.make_rollout(task.examples("train")[: args.batch], 0)
    student, teacher = module.distillation_logits(rollout)
    first_loss = float(module.objective(student.detach(), teacher, rollout.completion_mask))

    def ours() -> list[int]:  # this process, the server and the served teacher's decoding processes
        return [os.getpid(), server_pid, *[process.pid for process in getattr(getattr(server, "_workers", None), "running", [])]]

    busy, own, start = *cpu_ticks(ours()), time.perf_counter()
    trainer.fit(module)
    busy_after, own_after = cpu_ticks(ours())
    foreign = (busy_after - busy - (own_after - own)) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - start)
    return {**timer.summary(), "foreign_cores": max(foreign, 0.0), "prefetch": getattr(server, "prefetch", None),
            "request_prompts": getattr(server, "request_prompts", None), "decode_workers": getattr(server, "decode_workers", None),
            "student_columns": int(student.shape[-1]), "student_vocabulary": len(module.student_tokenizer), "first_loss": first_loss, "completion_tokens": int(rollout.completion_mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-foreign", type=float, default=0.25,
                        help="a fit during which other processes used more cores than this is run again (up to --attempts times)")
    parser.add_argument("--attempts", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="B = 2, 8 tokens, 3 steps, one fit each, no load check: the path, no timing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.smoke:
        args.batch, args.tokens, args.steps, args.repeats, args.attempts, args.max_foreign = 2, 8, 3, 1, 1, float("inf")
        if args.out is None:
            raise SystemExit("--smoke writes only where --out says (its times are not results)")
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
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=subprocess.DEVNULL)
    discarded: dict[str, int] = {}
    runs: dict[str, list[dict]] = {"cached": [], "served": [], "served_no_prefetch": []}
    # the trainer; the loopback server and the served teacher's decoding process, which share the other core
    watch = LoadWatch(processes=2, threads=args.threads)
    try:
        with tempfile.TemporaryDirectory() as folder:
            data = dataset(task, Path(folder))
            cache = str(Path(folder) / "cache.safetensors")
            build_teacher_cache(load_causal_lm(ModelSpec(TEACHER)), load_tokenizer(ModelSpec(TEACHER)), task, data, cache, top_k=args.top_k,
                                temperature=0.5, max_new_tokens=args.tokens, max_prompt_tokens=256, batch_size=args.batch)
            wait_for(url)
            variants = list(runs)
            for round_ in range(args.repeats):
                for variant in variants[round_ % 3 :] + variants[: round_ % 3]:
                    for attempt in range(args.attempts):
                        result = fit(variant, args, Path(folder), url, cache, data, task, server.pid)
                        print(f"round {round_} {variant}: {result['wall_per_step']:.3f} s per step (median {statistics.median(result['seconds'][2:]):.3f} s), "
                              f"other processes {result['foreign_cores']:.2f} cores; steps {[round(x, 3) for x in result['seconds']]}", flush=True)
                        if result["foreign_cores"] <= args.max_foreign or attempt == args.attempts - 1:
                            break
                        discarded[variant] = discarded.get(variant, 0) + 1
                        time.sleep(20)
                    runs[variant].append(result)
                    watch.sample()
    finally:
        server.terminate()
        server.wait(timeout=30)
    problems, results = [], {}
    for variant, fits in runs.items():
        problems += fit_problems(variant, fits, args.batch, args.threads)
        steps = [s for f in fits for s in f["seconds"][2:]]
        every = [s for f in fits for s in f["seconds"]]
        results[variant] = {"step_s": statistics.fmean(f["wall_per_step"] for f in fits), "median_step_s": statistics.median(steps),
                            "steps_timed": len(steps), "mean_all_steps_s": statistics.fmean(every),
                            "fits_step_s": [round(f["wall_per_step"], 4) for f in fits],
                            "foreign_cores": [round(f["foreign_cores"], 3) for f in fits], "fits_discarded": discarded.get(variant, 0),
                            "student_columns": fits[0]["student_columns"], "student_vocabulary": fits[0]["student_vocabulary"], "first_loss": fits[0]["first_loss"],
                            "completion_tokens": fits[0]["completion_tokens"], "prefetch": fits[0]["prefetch"]}
        if fits[0]["request_prompts"] is not None:
            results[variant]["request_prompts"], results[variant]["decode_workers"] = fits[0]["request_prompts"], fits[0]["decode_workers"]
        problems += [f"{variant}: other processes used {f['foreign_cores']:.2f} cores during a fit, after {args.attempts} attempts"
                     for f in fits if f["foreign_cores"] > args.max_foreign]
    for variant in ("served", "served_no_prefetch"):
        if abs(results["cached"]["first_loss"] - results[variant]["first_loss"]) > 1e-3:
            problems.append(f"first-step losses differ: cached {results['cached']['first_loss']}, {variant} {results[variant]['first_loss']}")
    if [f["prefetch"] for f in runs["served"]] != [True] * args.repeats or [f["prefetch"] for f in runs["served_no_prefetch"]] != [False] * args.repeats:
        problems.append("the served variants did not run with prefetch on and off")
    ratio = results["served"]["step_s"] / results["cached"]["step_s"]
    ratio_no_prefetch = results["served_no_prefetch"]["step_s"] / results["cached"]["step_s"]
    ratio_median = results["served"]["median_step_s"] / results["cached"]["median_step_s"]
    print(f"cached {results['cached']['step_s']:.3f} s, served {results['served']['step_s']:.3f} s: {ratio:.2f}x (medians {ratio_median:.2f}x; "
          f"without prefetch {results['served_no_prefetch']['step_s']:.3f} s: {ratio_no_prefetch:.2f}x)")
    from kdlab.rollouts.served import json_loads

    payload = {"pair": "tiny", "smoke": args.smoke, "shapes": {"batch": args.batch, "max_completion_tokens": args.tokens, "top_k": args.top_k},
               "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "concurrency": args.concurrency, "target": TARGET,
               "max_foreign": args.max_foreign,
               "json_decoder": json_loads.__module__.split(".")[0], "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "server": "kdlab.rollouts.loopback, its own process, max_batch 64",
               "results": results, "ratio": ratio, "ratio_median": ratio_median, "ratio_no_prefetch": ratio_no_prefetch, **watch.record(),
               "problems": problems}
    finish("served_teacher_step-tiny", payload, out=args.out)


if __name__ == "__main__":
    main()
