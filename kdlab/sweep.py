"""``kdlab sweep --config sweep.yaml``: a grid of ``kdlab fit`` runs, one directory each, restartable.

A sweep file is plain YAML::

    base: experiments/tiny/smoke.yaml   # the fit config, or a list applied in order (like repeated --config)
    output: runs/sweep-smoke            # run <name> logs to <output>/<name>/
    grid:                               # dotted fit keys -> lists of values; the cartesian product is run
      model.objective: [{class_path: kdlab.objectives.ForwardKL}, {class_path: kdlab.objectives.ReverseKL}]
      model.lr: [1.0e-3, 5.0e-3]
    seeds: [42, 43]                     # --seed_everything, which also seeds the module (default [42])
    overrides: {trainer.max_steps: 2}   # the same for every run
    mode: sequential                    # sequential | processes | print
    max_parallel: 1                     # processes at a time in ``processes`` mode

``base`` and ``output`` are relative to the current directory, like every path inside a fit config
(``save_dir: runs``, datasets), so run a sweep from where its fit configs expect to be run: the
repository root for ``experiments/``.

Each run is ``kdlab fit --config <base> --<key>=<value>... --seed_everything=<seed>`` plus a TensorBoard
logger whose log directory is exactly ``<output>/<name>/`` (``save_dir=<output>``, ``name=<name>``,
``version=""``), so ``config.yaml``, ``metrics.jsonl``, the event files and ``checkpoints/`` land there;
it replaces the base config's logger. Dict and list values go on the command line as JSON, which
jsonargparse reads; keys are applied parents first, so a ``class_path`` comes before its ``init_args``.

Names join ``<key>=<value>`` for every grid key (the key's last part; a ``class_path`` value by its class
name) and the seed, e.g. ``objective=ReverseKL-lr=0.005-seed=43``. Single-valued grid keys are named too,
so adding a value later keeps the names of the runs already done; fixed settings belong in ``overrides``.
Runs are ordered seed by seed, so a sweep stopped halfway has every configuration at least once.

Restarting: a run is done when ``<output>/<name>/DONE`` exists (a JSON summary written after fit
returns). Running the same sweep again skips done runs. A run without ``DONE`` (interrupted or failed)
starts again: from the newer of ``checkpoints/on_exception.ckpt`` (saved when a run stops on an exception,
Ctrl+C or SIGTERM) and ``checkpoints/last.ckpt`` (``ModelCheckpoint(save_last=True)``) when the run saved
one, otherwise from scratch after its directory is deleted. A failing run is recorded and the sweep goes on;
the command then exits with status 1 and lists the failures (Ctrl+C: status 130).
``<output>/sweep.json`` lists every run: name, settings, seed, status and the fit command.

Modes: ``sequential`` runs each fit in this process (``kdlab.cli.main``); ``processes`` starts
``python -m kdlab.cli fit ...`` per run, ``max_parallel`` at a time, its output in ``<name>/fit.log``;
``print`` writes one line per run not yet done, ``python -m kdlab.cli sweep --config <file> --run <name>``
(which runs that one run with the same skip/resume rules), to stdout and to ``<output>/commands.sh``,
one line per run and nothing else, so a SLURM array can pick line ``$SLURM_ARRAY_TASK_ID``:
``sed -n "${SLURM_ARRAY_TASK_ID}p" runs/sweep-smoke/commands.sh | bash``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

MODES = ("sequential", "processes", "print")
FILE_KEYS = ("base", "output", "grid", "seeds", "overrides", "mode", "max_parallel")
# Set by the sweep for every run; a grid or override may not touch them (or anything below them).
RESERVED = ("seed_everything", "model.seed", "model.init_args.seed", "trainer.logger", "trainer.default_root_dir", "ckpt_path", "config")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_CLASS_PATH = re.compile(r"^([A-Za-z_]\w*\.)+[A-Z]\w*$")
_MAX_NAME = 150  # well under the 255-byte file-name limit, with room for a hash suffix


class _Loader(yaml.SafeLoader):
    """PyYAML reads ``1e-5`` as a string (YAML 1.1 wants ``1.0e-5``); learning rates get written both ways."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


@dataclass
class Sweep:
    """One sweep file (see the module docstring); checked on construction, errors name the key."""

    base: list[str]
    output: str
    grid: dict[str, list[Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [42])
    overrides: dict[str, Any] = field(default_factory=dict)
    mode: str = "sequential"
    max_parallel: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.base, str):
            self.base = [self.base]
        if not isinstance(self.base, list) or not self.base or not all(isinstance(b, str) for b in self.base):
            raise ValueError(f"sweep.base must be a fit config path or a list of them, got {self.base!r}")
        for path in self.base:
            if not Path(path).is_file():
                raise ValueError(f"sweep.base: no such file {path!r} (relative to the current directory {Path.cwd()})")
        if not isinstance(self.output, str) or not self.output:
            raise ValueError(f"sweep.output must be a directory path, got {self.output!r}")
        if not isinstance(self.grid, dict):
            raise ValueError(f"sweep.grid must map dotted fit keys to lists of values, got {self.grid!r}")
        for key, values in self.grid.items():
            _check_key("grid", key)
            if not isinstance(values, list) or not values:
                raise ValueError(f"sweep.grid[{key!r}] must be a non-empty list of values, got {values!r}")
            encoded = [json.dumps(v, sort_keys=True, default=str) for v in values]
            if len(set(encoded)) != len(encoded):
                raise ValueError(f"sweep.grid[{key!r}] lists a value twice: {values!r}")
        if not isinstance(self.overrides, dict):
            raise ValueError(f"sweep.overrides must map dotted fit keys to values, got {self.overrides!r}")
        for key in self.overrides:
            _check_key("overrides", key)
            if key in self.grid:
                raise ValueError(f"sweep.overrides[{key!r}] is also a grid key; give it in one place")
        if not isinstance(self.seeds, list) or not self.seeds or not all(type(s) is int for s in self.seeds):
            raise ValueError(f"sweep.seeds must be a non-empty list of ints, got {self.seeds!r}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"sweep.seeds lists a seed twice: {self.seeds!r}")
        if self.mode not in MODES:
            raise ValueError(f"sweep.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if type(self.max_parallel) is not int or self.max_parallel < 1:
            raise ValueError(f"sweep.max_parallel must be an int >= 1, got {self.max_parallel!r}")


def _check_key(where: str, key: Any) -> None:
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"sweep.{where}: {key!r} is not a dotted fit key such as 'model.lr' (no leading '--')")
    for reserved in RESERVED:
        if key == reserved or key.startswith(reserved + "."):
            raise ValueError(f"sweep.{where}[{key!r}] is set by the sweep itself (seeds, output and resuming)")


def read_mapping_file(path: Path, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A YAML file that must be a mapping with only ``keys``; ``ValueError`` names the file and key."""
    if not path.is_file():
        raise ValueError(f"{kind} file {str(path)!r} does not exist")
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {kind} file is a mapping with the keys {', '.join(keys)}")
    unknown = [key for key in data if key not in keys]
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r} (a {kind} file has {', '.join(keys)})")
    return data


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; a ``ValueError`` names the file and the offending key."""
    path = Path(path)
    data = read_mapping_file(path, "sweep", FILE_KEYS)
    for key in ("base", "output"):
        if key not in data:
            raise ValueError(f"{path}: the key {key!r} is missing")
    try:
        return Sweep(**data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


# ---- runs and their names ----------------------------------------------------------------------
@dataclass
class Run:
    """One fit of the sweep: its grid values (dotted key -> value) and seed."""

    name: str
    settings: dict[str, Any]
    seed: int


def value_label(value: Any) -> str:
    """A short readable label: a class by its name (plus its init_args), numbers as Python writes them."""
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        arguments = value.get("init_args") or {}
        return "_".join([value_label(value["class_path"]), *(f"{k}={value_label(v)}" for k, v in arguments.items())])
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1] if _CLASS_PATH.match(value) else value
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return str(value)


def short_keys(keys: list[str]) -> dict[str, str]:
    """The last part of each dotted key (``init_args`` dropped), longer where two would read the same."""
    parts = {key: [p for p in key.split(".") if p != "init_args"] for key in keys}
    short = {}
    for key in keys:
        n = 1
        while n < len(parts[key]):
            taken = {".".join(parts[other][-n:]) for other in keys if other != key} | {"seed"}
            if ".".join(parts[key][-n:]) not in taken:
                break
            n += 1
        short[key] = ".".join(parts[key][-n:])
    return short


def _digest(run: Run) -> str:
    return hashlib.sha1(json.dumps([run.settings, run.seed], sort_keys=True, default=str).encode()).hexdigest()[:8]


def expand(sweep: Sweep) -> list[Run]:
    """The cartesian product of the grid, for each seed in turn (seed outermost), with unique names."""
    keys = list(sweep.grid)
    short = short_keys(keys)
    runs = []
    for seed in sweep.seeds:
        for values in itertools.product(*(sweep.grid[key] for key in keys)):
            settings = dict(zip(keys, values))
            parts = [f"{short[key]}={value_label(value)}" for key, value in settings.items()] + [f"seed={seed}"]
            name = re.sub(r"[^A-Za-z0-9._=+-]+", "_", "-".join(parts)).lstrip(".-")
            runs.append(Run(name, settings, seed))
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    for run in runs:  # labels that collide after sanitising, or are too long, get a hash of the settings
        if counts[run.name] > 1 or len(run.name) > _MAX_NAME:
            run.name = f"{run.name[:_MAX_NAME]}-{_digest(run)}"
    return runs


def _arg(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def fit_args(sweep: Sweep, run: Run, ckpt_path: str | None = None) -> list[str]:
    """``kdlab fit`` arguments of ``run`` (what ``kdlab.cli.main`` takes), resuming from ``ckpt_path``."""
    settings = {**sweep.overrides, **run.settings}
    # parents first (stable): ``model.rollout={class_path: ...}`` must come before ``model.rollout.lam``
    ordered = sorted(settings.items(), key=lambda item: item[0].count("."))
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": sweep.output, "name": run.name, "version": ""},  # log dir = <output>/<name>
    }
    args = ["fit", *(f"--config={path}" for path in sweep.base)]
    args += [f"--{key}={_arg(value)}" for key, value in ordered]
    args += [
        f"--seed_everything={run.seed}",
        f"--trainer.logger={_arg(logger)}",
        f"--trainer.default_root_dir={Path(sweep.output, run.name)}",
    ]
    if ckpt_path:
        args.append(f"--ckpt_path={ckpt_path}")
    return args


# ---- running -----------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """A run's fit did not finish; the message says why."""


def _prepare(run_dir: Path) -> str | None:
    """The checkpoint to resume from (the newer of ``on_exception.ckpt``, which a run stopped by an
    exception or SIGTERM saves, and ``last.ckpt``), or None after clearing what an unfinished run left behind."""
    saved = [path for path in (run_dir / "checkpoints" / name for name in ("on_exception.ckpt", "last.ckpt")) if path.is_file()]
    if saved:
        return str(max(saved, key=lambda path: path.stat().st_mtime))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return None


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")  # never leave half a file behind on interruption
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    partial.replace(path)


def _mark_done(run_dir: Path, run: Run, started: float, resumed_from: str | None, **extra: Any) -> None:
    summary = {
        "name": run.name,
        "seed": run.seed,
        "settings": run.settings,
        "resumed_from": resumed_from,
        "seconds": round(time.time() - started, 2),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    _write_json(run_dir / "DONE", summary)


def _fit_in_process(args: list[str]) -> int:
    """``kdlab fit`` in this process; returns the global step reached, raises RunFailed or KeyboardInterrupt."""
    from kdlab import cli

    saved_argv = sys.argv
    main_thread = threading.current_thread() is threading.main_thread()
    saved_sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    # exactly ``kdlab fit ...``: LightningCLI reads sys.argv (given args as well, it warns) and
    # run_info.json records it as the run's command line
    sys.argv = ["kdlab", *args]
    try:
        result = cli.main()
    except SystemExit as exit_info:
        # Lightning answers Ctrl+C during fit with sys.exit(1) inside its ``except KeyboardInterrupt``: stop the sweep
        if isinstance(exit_info.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from exit_info
        # SIGTERM (a cluster's time limit): Lightning's SIGTERMException, status 143 (kdlab's FinalCheckpoint)
        if exit_info.code == 128 + signal.SIGTERM or type(exit_info).__name__ == "SIGTERMException":
            raise KeyboardInterrupt from exit_info  # stop the sweep, as Ctrl+C does, rather than start the next run
        raise RunFailed(f"fit exited with status {exit_info.code} before training (see its messages above)") from None
    finally:
        sys.argv = saved_argv
        if main_thread and saved_sigint is not None:  # Lightning ignores SIGINT while it shuts down after Ctrl+C
            signal.signal(signal.SIGINT, saved_sigint)
    trainer = getattr(result, "trainer", None)
    if trainer is None or not trainer.state.finished:
        status = trainer.state.status.value if trainer is not None else "no trainer"
        raise RunFailed(f"fit did not finish (trainer status: {status})")
    return trainer.global_step


class _Sweeper:
    """Runs a sweep's runs in one of the modes and keeps ``sweep.json`` up to date."""

    def __init__(self, sweep: Sweep, sweep_file: str) -> None:
        self.sweep, self.sweep_file = sweep, sweep_file
        self.output = Path(sweep.output)
        self.runs = expand(sweep)
        self.records = [
            {
                "name": run.name,
                "seed": run.seed,
                "settings": run.settings,
                "status": "skipped" if (self.output / run.name / "DONE").is_file() else "pending",
                "command": shlex.join(["python", "-m", "kdlab.cli", *fit_args(sweep, run)]),
            }
            for run in self.runs
        ]

    def write_index(self) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        index = {
            "sweep": self.sweep_file,
            "base": self.sweep.base,
            "output": self.sweep.output,
            "overrides": self.sweep.overrides,
            "mode": self.sweep.mode,
            "runs": self.records,
        }
        _write_json(self.output / "sweep.json", index)

    def pending(self) -> list[tuple[Run, dict[str, Any]]]:
        return [(run, record) for run, record in zip(self.runs, self.records) if record["status"] == "pending"]

    # -- modes
    def print_commands(self) -> None:
        lines = [
            shlex.join(["python", "-m", "kdlab.cli", "sweep", "--config", self.sweep_file, "--run", run.name])
            for run, _ in self.pending()
        ]
        self.write_index()
        (self.output / "commands.sh").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        for line in lines:
            print(line)
        done = len(self.runs) - len(lines)
        print(
            f"[sweep] {len(lines)} commands in {self.output / 'commands.sh'}, one per line ({done} done already, "
            "left out); run them from this directory",
            file=sys.stderr,
        )

    def run_in_process(self, run: Run, record: dict[str, Any], position: str = "") -> None:
        run_dir = self.output / run.name
        resume = _prepare(run_dir)
        record.update(status="running", resumed_from=resume)
        record.pop("error", None)
        print(f"[sweep] {position}{run.name}: fit" + (f" (resuming from {resume})" if resume else ""), flush=True)
        started = time.time()
        try:
            step = _fit_in_process(fit_args(self.sweep, run, resume))
        except KeyboardInterrupt:
            record["status"] = "interrupted"
            raise
        except Exception as error:  # noqa: BLE001 -- one failing run must not stop the sweep
            traceback.print_exc()
            record.update(status="failed", error=f"{type(error).__name__}: {error}")
            print(f"[sweep] {run.name}: FAILED: {record['error']}", file=sys.stderr, flush=True)
            return
        _mark_done(run_dir, run, started, resume, global_step=step)
        record["status"] = "done"
        print(f"[sweep] {run.name}: done in {time.time() - started:.1f}s", flush=True)

    def run_sequential(self) -> None:
        pending = self.pending()
        for number, (run, record) in enumerate(pending, start=1):
            try:
                self.run_in_process(run, record, f"{number}/{len(pending)} ")
            finally:
                self.write_index()

    def run_processes(self, max_parallel: int) -> None:
        queue = self.pending()
        active: list[tuple[Run, dict[str, Any], subprocess.Popen, Any, float]] = []
        try:
            while queue or active:
                while queue and len(active) < max_parallel:
                    run, record = queue.pop(0)
                    run_dir = self.output / run.name
                    resume = _prepare(run_dir)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    log = (run_dir / "fit.log").open("a", encoding="utf-8")
                    command = [sys.executable, "-m", "kdlab.cli", *fit_args(self.sweep, run, resume)]
                    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                    record.update(status="running", resumed_from=resume)
                    record.pop("error", None)
                    print(f"[sweep] {run.name}: started (pid {process.pid}, output in {run_dir / 'fit.log'})", flush=True)
                    active.append((run, record, process, log, time.time()))
                    self.write_index()
                time.sleep(0.2)
                for item in [item for item in active if item[2].poll() is not None]:
                    active.remove(item)
                    run, record, process, log, started = item
                    log.close()
                    self._finish_process(run, record, process.returncode, started)
                    self.write_index()
        except BaseException:
            for run, record, process, log, _ in active:  # Ctrl+C reaches the children too; make sure
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                log.close()
                record["status"] = "interrupted"
            self.write_index()
            raise

    def _finish_process(self, run: Run, record: dict[str, Any], returncode: int, started: float) -> None:
        run_dir = self.output / run.name
        if returncode == 0:
            _mark_done(run_dir, run, started, record.get("resumed_from"))
            record["status"] = "done"
            print(f"[sweep] {run.name}: done in {time.time() - started:.1f}s", flush=True)
            return
        record.update(status="failed", error=f"exit status {returncode}; see {run_dir / 'fit.log'}")
        tail = (run_dir / "fit.log").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        print(f"[sweep] {run.name}: FAILED ({record['error']}):\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)


def run_sweep(sweep: Sweep, sweep_file: str) -> list[dict[str, Any]]:
    """Run (or print) every run of ``sweep`` not done yet; returns the ``sweep.json`` run records.

    Failed runs have ``status: failed`` and an ``error``; Ctrl+C raises KeyboardInterrupt after
    ``sweep.json`` records the runs left.
    """
    sweeper = _Sweeper(sweep, sweep_file)
    if sweep.mode == "print":
        sweeper.print_commands()
        return sweeper.records
    sweeper.write_index()
    if sweep.mode == "sequential":
        sweeper.run_sequential()
    else:
        sweeper.run_processes(sweep.max_parallel)
    return sweeper.records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kdlab sweep",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the sweep file (YAML)")
    parser.add_argument("--mode", choices=MODES, help="overrides the sweep file's mode")
    parser.add_argument("--max_parallel", type=int, help="processes at a time in processes mode (overrides the file)")
    parser.add_argument("--run", metavar="NAME", help="run only this run, in this process (what print mode's lines do)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``kdlab sweep --config FILE [--mode M] [--max_parallel N] [--run NAME]``; exits 1 if a run failed."""
    parser = _parser()
    options = parser.parse_args(argv)
    try:
        sweep = load_sweep(options.config)
        changes = {k: v for k, v in (("mode", options.mode), ("max_parallel", options.max_parallel)) if v is not None}
        sweep = dataclasses.replace(sweep, **changes)
    except ValueError as error:
        parser.error(str(error))
    if options.run is not None:
        _run_one(parser, sweep, options.config, options.run)
        return
    try:
        records = run_sweep(sweep, options.config)
    except KeyboardInterrupt:
        print(f"[sweep] interrupted; run the same command again to continue (see {sweep.output}/sweep.json)", file=sys.stderr)
        raise SystemExit(130) from None
    if sweep.mode == "print":
        return
    counts = {status: sum(r["status"] == status for r in records) for status in ("done", "skipped", "failed")}
    print(f"[sweep] {len(records)} runs: {counts['done']} done now, {counts['skipped']} already done, {counts['failed']} failed")
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        lines = "\n".join(f"  {r['name']}: {r['error']}" for r in failed)
        print(f"[sweep] {len(failed)} of {len(records)} runs failed:\n{lines}", file=sys.stderr)
        raise SystemExit(1)


def _run_one(parser: argparse.ArgumentParser, sweep: Sweep, sweep_file: str, name: str) -> None:
    """One run of the sweep (no ``sweep.json``: several may run at once on a cluster)."""
    sweeper = _Sweeper(sweep, sweep_file)
    matches = [(run, record) for run, record in zip(sweeper.runs, sweeper.records) if run.name == name]
    if not matches:
        parser.error(f"--run {name!r} is not a run of {sweep_file} (see {sweep.output}/sweep.json for the names)")
    run, record = matches[0]
    if record["status"] == "skipped":
        print(f"[sweep] {name}: already done ({Path(sweep.output, name, 'DONE')})")
        return
    try:
        sweeper.run_in_process(run, record)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    if record["status"] == "failed":
        raise SystemExit(1)
