"""The cost of a served teacher in the setting a user runs first: the quickstart's step with its teacher in the
training process against the same step with the quickstart's served-teacher overlay, the teacher behind kdlab's
loopback server (issue #43, item 3).

    python benchmarks/served_quickstart_step.py [--steps 8] [--repeats 3] [--threads 1] [--out FILE]
    python benchmarks/served_quickstart_step.py --smoke      # toy sizes: checks the path, times nothing worth quoting

Both variants are ``kdlab fit`` itself, built by the command line from the committed configs (in this process,
``kdlab.cli.main.main(..., run=False)``, then ``trainer.fit``):

* ``in_process``: ``kdlab fit --config experiments/tiny/quickstart.yaml`` (teacher rollouts sampled by the
  packaged teacher in the training process, forward KL, B = 32);
* ``served``: the same with ``--config experiments/tiny/served_teacher.yaml``: the server samples the rollouts at
  the teacher temperature and returns the top-20 log-probs of each completion; kdlab's loopback server
  (``python -m kdlab.rollouts.loopback kdlab://tiny/teacher --name tiny-teacher``) runs in its own process,
  ``--threads`` threads, on a free port (the overlay's URL overridden to it).

Left out of both, equally: validation, logging to TensorBoard, checkpoints and the quickstart's evaluation
callbacks (they run between steps, not in them). ``step_s`` is the wall time from the start of each fit's third
step to the end of its last, per step, averaged over ``--repeats`` fits per variant, order alternating; ``ratio``
is served over in-process. Checked before the ratio is written: every step saw the config's ``B`` rows, both ran
on ``--threads`` threads, the served fit's teacher is the server (``Served``) and the in-process one's a model in
this process. Writes ``benchmarks/results/served_quickstart_step-tiny.json`` (``--smoke``: only with ``--out``);
``python scripts/served_teacher_results.py`` then copies it into docs/teachers.md. Target (issue #43): at most
1.5x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LoadWatch, check_threads, finish  # noqa: E402
from served_teacher_step import WallTimer, free_port, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "tiny" / "quickstart.yaml"
OVERLAY = ROOT / "experiments" / "tiny" / "served_teacher.yaml"
TARGET = 1.5
SMOKE = ["--model.batch_size=2", "--model.max_completion_tokens=8"]  # toy sizes: the path, not a timing


def fit(variant: str, args, folder: Path, url: str) -> dict:
    """One ``kdlab fit`` of ``variant`` for ``args.steps`` steps; its step times, shapes and teacher source."""
    from kdlab.cli.main import main as kdlab

    configs = [f"--config={QUICKSTART}"] + ([f"--config={OVERLAY}", f"--model.teacher.init_args.server.init_args.url={url}"] if variant == "served" else [])
    cli = kdlab(["fit", *configs, f"--trainer.max_steps={args.steps}", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
                 "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
                 f"--trainer.default_root_dir={folder}", *(SMOKE if args.smoke else [])], run=False)
    timer = WallTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model)
    return {**timer.summary(), "batch_size": cli.model.hparams.get("batch_size", getattr(cli.model, "batch_size", None)),
            "teacher": type(cli.model.teacher_source).__name__ if hasattr(cli.model, "teacher_source") else type(cli.model.teacher).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="B = 2, 8 tokens, 3 steps, one fit each: the path, no timing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.smoke:
        args.steps, args.repeats = 3, 1
    if args.steps < 3 or args.repeats < 1:
        raise SystemExit("--steps must be >= 3 (the first two are warm-up), --repeats >= 1")
    if args.smoke and args.out is None:
        raise SystemExit("--smoke writes only where --out says (its times are not results)")
    torch.set_num_threads(args.threads)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kdlab.rollouts.loopback", "kdlab://tiny/teacher", "--name", "tiny-teacher", "--port", str(port)],
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"in_process": [], "served": []}
    # the trainer; the loopback server and the served teacher's decoding process, which share the other core
    watch = LoadWatch(processes=2, threads=args.threads)
    try:
        wait_for(url)
        with tempfile.TemporaryDirectory() as folder:
            for round_ in range(args.repeats):
                for variant in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
                    result = fit(variant, args, Path(folder), url)
                    print(f"round {round_} {variant}: {result['wall_per_step']:.3f} s per step; steps {[round(x, 3) for x in result['seconds']]}", flush=True)
                    runs[variant].append(result)
                    watch.sample()
    finally:
        server.terminate()
        server.wait(timeout=30)
    problems, results = [], {}
    for variant, fits in runs.items():
        for f in fits:
            if f["rows"] != [f["batch_size"]]:
                problems.append(f"{variant}: steps saw {f['rows']} rows, not the config's B = {f['batch_size']}")
            if f["threads"] != [args.threads]:
                problems.append(f"{variant}: ran on {f['threads']} threads, not {args.threads}")
        expected = "Served" if variant == "served" else "ModelTeacher"
        if fits[0]["teacher"] != expected:
            problems.append(f"{variant}: the teacher source is {fits[0]['teacher']}, not {expected}")
        steps = [s for f in fits for s in f["seconds"][2:]]
        results[variant] = {"step_s": statistics.fmean(f["wall_per_step"] for f in fits), "median_step_s": statistics.median(steps),
                            "steps_timed": len(steps), "fits_step_s": [round(f["wall_per_step"], 4) for f in fits],
                            "batch": fits[0]["batch_size"], "teacher": fits[0]["teacher"]}
    ratio = results["served"]["step_s"] / results["in_process"]["step_s"]
    print(f"in-process {results['in_process']['step_s']:.3f} s, served {results['served']['step_s']:.3f} s: {ratio:.2f}x")
    payload = {"setting": "kdlab fit --config experiments/tiny/quickstart.yaml [--config experiments/tiny/served_teacher.yaml]",
               "smoke": args.smoke, "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "target": TARGET,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "server": "kdlab.rollouts.loopback, its own process",
               "results": results, "ratio": ratio, **watch.record(), "problems": problems}
    finish("served_quickstart_step-tiny", payload, out=args.out)


if __name__ == "__main__":
    main()
