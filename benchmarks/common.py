"""What every kdlab benchmark shares: a tokenizer whose ``len()`` is exactly the vocabulary it reports,
a random model pair with that many embedding rows, peak-RSS memory readings, and the JSON result files
under ``benchmarks/results/`` (command, versions, threads, machine, the code's git commit, shapes, every figure).

Why the tokenizer matters: ``DistillModule`` restricts logits to the shared *tokenizer* vocabulary, so a
353-token tokenizer under a 151,936-row head makes every objective 353 columns wide. Here the packaged
tiny tokenizer is extended with added tokens until ``len(tokenizer) == V``, and the benchmarks assert the
columns their objectives actually received.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def check_threads(threads: int) -> int:
    """``threads`` (>= 1), also put in ``OMP_NUM_THREADS`` so that a ``kdlab fit`` the benchmark runs, in this process
    or a child, keeps it (without it kdlab's CLI takes one thread per idle CPU: a fit on 2 threads beside a
    calibration on 1)."""
    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def vocab_tokenizer(vocab: int, folder: Path):
    """The packaged tiny tokenizer extended with added tokens ``<v0>, <v1>, ...`` so that its ``len()`` is
    exactly ``vocab``; saved to ``folder`` and returned."""
    from transformers import AutoTokenizer

    from kdlab.models.loading import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("kdlab://tiny-random/student"))
    base = len(tokenizer)
    if vocab < base:
        raise SystemExit(f"--vocab {vocab} is smaller than the base tokenizer's {base} tokens")
    tokenizer.add_tokens([f"<v{i}>" for i in range(vocab - base)])
    if len(tokenizer) != vocab:
        raise SystemExit(f"built a tokenizer of {len(tokenizer)} tokens, wanted {vocab}")
    tokenizer.save_pretrained(folder)
    return tokenizer


def random_pair(vocab: int, out: Path, student_hidden: int = 64, teacher_hidden: int = 96, layers: int = 2) -> tuple[str, str]:
    """A random Qwen2 student/teacher pair with ``vocab`` embedding rows each and a tokenizer of exactly
    ``vocab`` tokens; small bodies so that the vocabulary dominates, as it does in distillation."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = vocab_tokenizer(vocab, out / "tokenizer")
    for role, seed, hidden in (("student", 1, student_hidden), ("teacher", 2, teacher_hidden)):
        torch.manual_seed(seed)
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
    return str(out / "student"), str(out / "teacher")


def proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def versions(*packages: str) -> dict[str, str | None]:
    found = {}
    for name in ("torch", "transformers", "lightning", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine() -> dict[str, object]:
    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform(),
            "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()]}


SHARED_MARGIN = 0.5  # load above the run's own processes x threads that says others ran


def shared_machine(one_minute_loads: list[float], own_cores: int) -> bool:
    """Whether other processes ran: a 1-minute load average above ``own_cores`` (the run's processes x threads)
    + :data:`SHARED_MARGIN`."""
    return max(one_minute_loads) > own_cores + SHARED_MARGIN


class LoadWatch:
    """The machine's load around a timed run: ``os.getloadavg()`` when it starts and ends, and the 1-minute
    average at each :meth:`sample` (after each fit, batch or variant). :meth:`record` says the machine was shared
    when a 1-minute reading during or after the run exceeded what the run's own work accounts for, ``processes x
    threads`` + 0.5 (``processes``: those of the run that compute at once, a server's included). The reading before
    is kept, not judged: the minute average still counts work that stopped just before the run."""

    def __init__(self, processes: int, threads: int) -> None:
        self.processes, self.threads = processes, threads
        self.before = [round(x, 2) for x in os.getloadavg()]
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(round(os.getloadavg()[0], 2))

    def record(self) -> dict:
        after = [round(x, 2) for x in os.getloadavg()]
        own = self.processes * self.threads
        return {"load_average_before": self.before, "load_average_1min_samples": self.samples, "load_average_after": after,
                "own_processes": self.processes, "own_cores": own, "shared_machine": shared_machine([*self.samples, after[0]], own)}


def provenance(root: Path = ROOT) -> dict:
    """Which code wrote a result: ``commit`` (``git rev-parse HEAD``), ``clean`` (no file of the tree differs from
    that commit, untracked files included, result files under ``benchmarks/results/`` left out: a run writes
    them) and ``changed_code``, the files under ``benchmarks/`` and ``kdlab/`` that differ (what a dirty tree ran
    beyond the commit). Outside a git checkout (a copied tree), ``commit`` and ``clean`` are None and ``why`` says so."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[:200] or f"git {args[0]} exited {done.returncode}")
        return done.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=all")
    except (OSError, subprocess.SubprocessError) as error:
        return {"commit": None, "clean": None, "changed_code": None, "why": f"no git commit: {error}"}
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    changed = [path for path in paths if not path.startswith("benchmarks/results/")]
    return {"commit": commit, "clean": not changed, "changed_code": sorted(p for p in changed if p.startswith(("benchmarks/", "kdlab/")))}


def write_result(name: str, payload: dict, packages: tuple[str, ...] = (), out: Path | None = None) -> Path:
    """Write ``payload`` with the command, versions, machine and :func:`provenance` (``git``) to ``out`` (default
    ``benchmarks/results/<name>.json``); returns the path."""
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
              "versions": versions(*packages), "machine": machine(), "git": provenance(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def failed_path(path: Path) -> Path:
    """Where a run whose own checks found problems writes: ``<stem>-FAILED.json`` beside ``path``, never ``path``
    itself (the committed result a page quotes stays what it was; ``render.py`` refuses a ``-FAILED`` file)."""
    return path.with_name(f"{path.stem}-FAILED{path.suffix}")


def finish(name: str, payload: dict, packages: tuple[str, ...] = (), out: Path | None = None) -> None:
    """Write the result file (see :func:`write_result`), say where, and exit 1 when ``payload["problems"]``
    lists any: a benchmark that measured something other than what it claims must not look like a result, so such
    a run is written to :func:`failed_path` of the file it would have written."""
    path = out or RESULTS / f"{name}.json"
    if payload.get("problems"):
        path = write_result(name, payload, packages, failed_path(path))
        print(f"wrote {path} (a failed run: not {path.name.replace('-FAILED', '')})")
        print("MISMATCH:\n  " + "\n  ".join(payload["problems"]))
        raise SystemExit(1)
    print(f"wrote {write_result(name, payload, packages, path)}")


def fit_problems(variant: str, fits: list[dict], batch: int, threads: int, sides: tuple[str, ...] = ("student",)) -> list[str]:
    """What a variant's fits measured other than they claim: steps of another B, another thread count, or an objective
    whose columns on one of ``sides`` are not that side's tokenizer size (each fit's ``<side>_columns`` and
    ``<side>_vocabulary``)."""
    problems = []
    for f in fits:
        if f["rows"] != [batch]:
            problems.append(f"{variant}: steps saw {f['rows']} rows, not B = {batch}")
        if f["threads"] != [threads]:
            problems.append(f"{variant}: ran on {f['threads']} threads, not {threads}")
        for side in sides:
            if f[f"{side}_columns"] != f[f"{side}_vocabulary"]:
                problems.append(f"{variant}: the objective got {f[f'{side}_columns']} {side} columns, the {side} tokenizer has {f[f'{side}_vocabulary']}")
    return problems
