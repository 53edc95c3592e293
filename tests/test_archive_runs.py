"""scripts/archive_runs.py keeps what `kdlab report` and a sweep's skip rule read, and the study's wall times."""

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_archive_keeps_finished_runs_their_report_files_and_the_studys_wall_times(tmp_path):
    sweep = tmp_path / "runs" / "study" / "distill"
    for name, done in (("a", True), ("b", False)):
        run = sweep / name
        (run / "samples").mkdir(parents=True)
        (run / "checkpoints").mkdir()
        for file in ("config.yaml", "metrics.jsonl", "run_info.json", "samples/step150.jsonl", "checkpoints/last.ckpt", "fit.log"):
            (run / file).write_text("x")
        if done:
            (run / "DONE").write_text("{}")
    (sweep / "sweep.json").write_text("{}")
    (sweep.parent / "wall_times.jsonl").write_text('{"step": "grid", "seconds": 1.0, "command": "c"}\n')
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "archive_runs.py"), "runs/study/distill", "out.tar.gz"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "1 finished runs" in done.stdout
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        names = set(tar.getnames())
    assert names == {"runs/study/distill/sweep.json", "runs/study/wall_times.jsonl",
                     *(f"runs/study/distill/a/{f}" for f in ("config.yaml", "metrics.jsonl", "run_info.json", "DONE", "samples/step150.jsonl"))}
