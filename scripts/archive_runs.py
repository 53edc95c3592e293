"""Keep a sweep's finished runs in the repository: the files `kdlab report` and the sweep's skip rule read (the
sweep's sweep.json; each finished run's config.yaml, metrics.jsonl, run_info.json, samples/*.jsonl and DONE),
without checkpoints or event files, in one .tar.gz. Unfinished runs (no DONE) are left out.

    python scripts/archive_runs.py runs/tiny-study-5x/distill experiments/tiny/study_runs/grid_5x.tar.gz

Restore with `tar xzf <archive>` from the repository root; the sweep then skips the restored runs.
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

KEPT = ("config.yaml", "metrics.jsonl", "DONE", "run_info.json")


def archive(sweep: Path, output: Path) -> int:
    """Write ``output`` from the sweep folder ``sweep`` (a relative path, kept as is in the archive); the runs kept."""
    output.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with tarfile.open(output, "w:gz") as tar:
        tar.add(sweep / "sweep.json")
        for run in sorted(path for path in sweep.iterdir() if (path / "DONE").is_file()):
            for name in KEPT:
                if (run / name).is_file():
                    tar.add(run / name)
            for sample in sorted((run / "samples").glob("*.jsonl")):
                tar.add(sample)
            kept += 1
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep's output folder, relative to the repository root")
    parser.add_argument("output", type=Path, help="the .tar.gz to write")
    args = parser.parse_args()
    print(f"{archive(args.sweep, args.output)} finished runs -> {args.output}")


if __name__ == "__main__":
    main()
