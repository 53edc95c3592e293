"""Rerun finished runs of a sweep at this checkout's commit and compare their per-sample files byte for byte with
the archived ones (issue #44, item 5): does the code at this commit still give the runs a study reports?

    python scripts/provenance_rerun.py --sweep experiments/reasoning/grid.yaml --runs runs/reasoning-study/distill \\
        --one-per-cell --output experiments/reasoning/provenance.json

For each chosen run (``--one-per-cell``: the lowest seed of every grid cell; ``--every-rerun``: every run already
rerun in a ``--reruns`` folder, below; ``--name`` given once per run; any of them together) the
run's fit command is rebuilt from the sweep file with its output folder moved under ``--scratch``, run with one
thread, and every file under the archived run's ``samples/`` is compared with the rerun's: ``identical`` or the
files that differ, with the archived run's commit (``run_info.json``) beside this checkout's. The JSON lists each run.
A run archived from another commit may differ where the code between the commits changed what it computes; the
JSON says which runs differ so the page can say why.

``--reruns DIR`` (repeatable) names a folder where some chosen runs have already been run again at this commit (a
pipeline that reran archived runs to write their checkpoints, or an earlier call's ``--scratch``): a finished run
there (``DONE`` or its final checkpoint) whose ``run_info.json`` names this commit on a clean tree is compared as it
is, not run a third time. Each run's entry also lists ``environment``: the ``run_info.json`` fields (package
versions, Python, platform) in which the archived run and the rerun differ, the first place to look when the
samples differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kdlab.study.grid import expand, fit_args, load_sweep
from kdlab.study.runs import DONE_MARKERS


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sample_files(run_dir: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under the run's ``samples/``."""
    folder = run_dir / "samples"
    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*")) if p.is_file()} if folder.is_dir() else {}


def run_info(run_dir: Path) -> dict:
    """The run's ``run_info.json`` (``{}`` when it is missing or unreadable)."""
    try:
        return json.loads((run_dir / "run_info.json").read_text())
    except (OSError, ValueError):
        return {}


def commit_of(run_dir: Path) -> str | None:
    return run_info(run_dir).get("git_commit")


def rerun_at(run_dir: Path) -> str | None:
    """The commit a run was made at, if its tree was clean (``run_info.json``); None otherwise."""
    info = run_info(run_dir)
    return None if info.get("git_dirty", True) else info.get("git_commit")


def environment_differences(archived: Path, rerun: Path) -> dict[str, list]:
    """``{field: [archived, rerun]}`` for each ``run_info.json`` field other than the command line and the commit
    (packages one by one) in which the two runs differ."""
    def flat(run_dir: Path) -> dict:
        info = run_info(run_dir)
        packages = info.pop("packages", {}) or {}
        return {**{k: v for k, v in info.items() if k not in ("argv", "git_commit", "git_dirty")}, **{f"packages.{k}": v for k, v in packages.items()}}

    before, after = flat(archived), flat(rerun)
    return {key: [before.get(key), after.get(key)] for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)}


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", required=True, help="the sweep file the runs came from")
    parser.add_argument("--runs", required=True, type=Path, help="the folder holding the archived runs (the sweep's output)")
    parser.add_argument("--name", action="append", default=[], help="a run to rerun (repeatable)")
    parser.add_argument("--one-per-cell", action="store_true", help="rerun the lowest seed of every grid cell")
    parser.add_argument("--every-rerun", action="store_true", help="also compare every run already rerun in a --reruns folder")
    parser.add_argument("--scratch", type=Path, default=Path("runs/provenance"))
    parser.add_argument("--reruns", type=Path, action="append", default=[], help="a folder of runs already rerun at this commit (compared, "
                        "not run again); repeatable")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    sweep = load_sweep(args.sweep)
    runs = expand(sweep)
    commit = head()
    names = set(args.name)
    unknown = sorted(names - {r.name for r in runs})
    if unknown or not (names or args.one_per_cell or args.every_rerun):
        parser.error(f"--name must name runs of {args.sweep} (unknown: {unknown or 'none given'}), or give --one-per-cell or --every-rerun")
    if args.one_per_cell:
        cells: dict[str, object] = {}
        for run in sorted(runs, key=lambda r: r.seed):
            cells.setdefault(json.dumps(run.settings, sort_keys=True), run)
        names |= {run.name for run in cells.values()}
    if args.every_rerun:
        names |= {run.name for run in runs for folder in args.reruns if rerun_at(folder / run.name) == commit
                  and any((folder / run.name / marker).is_file() for marker in DONE_MARKERS)}
    chosen = [r for r in runs if r.name in names]
    rerun_sweep = dataclasses.replace(sweep, output=str(args.scratch))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = []
    for run in chosen:
        archived = args.runs / run.name
        if not (archived / "DONE").is_file():
            results.append({"run": run.name, "status": "not archived"})
            continue
        start = time.time()
        done = next((folder / run.name for folder in args.reruns if any((folder / run.name / marker).is_file() for marker in DONE_MARKERS)
                     and rerun_at(folder / run.name) == commit), None)
        if done is not None:
            code, rerun, seconds = 0, done, None  # already rerun at this commit
        else:
            log = args.scratch / f"{run.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as handle:
                code = subprocess.call([sys.executable, "-m", "kdlab.cli", *fit_args(rerun_sweep, run)], env=env, stdout=handle, stderr=subprocess.STDOUT)
            rerun, seconds = args.scratch / run.name, round(time.time() - start, 1)
        before, after = sample_files(archived), sample_files(rerun)
        differ = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        results.append({"run": run.name, "status": "failed" if code else ("identical" if before and not differ else "differs"),
                        "differing_files": differ, "files": len(before), "archived_commit": commit_of(archived),
                        "environment": environment_differences(archived, rerun),
                        "rerun": str(rerun), "seconds": seconds})
        print(json.dumps(results[-1]), flush=True)
    script = Path(__file__).resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix()  # scripts/provenance_rerun.py, wherever it ran from
    record = {"command": "python " + " ".join([script, *(argv if argv is not None else sys.argv[1:])]), "commit": commit, "threads": 1,
              "sweep": args.sweep, "runs": results,
              "identical": sum(r["status"] == "identical" for r in results), "checked": len(results)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(r["status"] == "identical" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
