"""Keep a sweep's finished runs in the repository: the files `kdlab report` and the sweep's skip rule read (the
sweep's sweep.json; each finished run's config.yaml, metrics.jsonl, run_info.json, samples/*.jsonl and DONE; the
study's wall_times.jsonl beside the sweep, which the verdicts' wall-time table reads), without checkpoints or event
files, in one .tar.gz. Unfinished runs (no DONE) are left out.

    python scripts/archive_runs.py runs/tiny-study-5x/distill experiments/tiny/study_runs/grid_5x.tar.gz
    python scripts/archive_runs.py runs/tiny-study-5x/rlvr/* experiments/tiny/study_runs/rlvr_harder.tar.gz  # several sweeps

Restore with `tar xzf <archive>` from the repository root; the sweep then skips the restored runs.
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

KEPT = ("config.yaml", "metrics.jsonl", "DONE", "run_info.json")


def archive(sweeps: list[Path], output: Path) -> int:
    """Write ``output`` from the sweep folders ``sweeps`` (relative paths, kept as they are in the archive); the runs kept.
    A sweep folder with no finished run is left out."""
    output.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with tarfile.open(output, "w:gz") as tar:
        for sweep in sweeps:
            kept += _add(tar, sweep)
        for times in dict.fromkeys(sweep.parent / "wall_times.jsonl" for sweep in sweeps):  # each study's, once
            if times.is_file():
                tar.add(times)
    return kept


def _add(tar: tarfile.TarFile, sweep: Path) -> int:
    kept = 0
    finished = sorted(path for path in sweep.iterdir() if (path / "DONE").is_file())
    if finished:
        tar.add(sweep / "sweep.json")
        for run in finished:
            for name in KEPT:
                if (run / name).is_file():
                    tar.add(run / name)
            for sample in sorted((run / "samples").glob("*.jsonl")):
                tar.add(sample)
            kept += 1
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, nargs="+", help="the sweeps' output folders, relative to the repository root")
    parser.add_argument("output", type=Path, help="the .tar.gz to write")
    args = parser.parse_args()
    print(f"{archive(args.sweep, args.output)} finished runs -> {args.output}")


if __name__ == "__main__":
    main()
