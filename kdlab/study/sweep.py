"""``kdlab sweep --config sweep.yaml``: run a grid of ``kdlab fit`` runs (the file and its runs:
:mod:`kdlab.study.grid`), one directory each, restartable.

Restarting: a run is done when ``<output>/<name>/DONE`` exists (a JSON summary written after fit
returns). Running the same sweep again skips done runs. A run without ``DONE`` (interrupted or failed)
starts again: from the newest full state in ``checkpoints/`` (``on_exception.ckpt``, saved when a run stops on
an exception, Ctrl+C or SIGTERM; ``last.ckpt`` from ``ModelCheckpoint(save_last=True)``; any other file a
``ModelCheckpoint`` wrote; never the weights-only ``final.ckpt``) when the run saved one, otherwise from
scratch after its directory is moved aside to ``<name>.unresumable-<UTC time>`` (nothing is deleted; an
empty one is removed). A failing run is recorded and the sweep goes on;
the command then exits with status 1 and lists the failures (Ctrl+C: status 130).
``<output>/sweep.json`` lists every run: name, settings, seed, status and the fit command.

Before any run starts (in every mode, and for ``--run NAME``), each run's fit configuration (base files, overrides,
its grid values) is parsed by ``kdlab fit``'s own parser, nothing instantiated; a key no fit has or a value of the
wrong type ends the sweep in one line naming the run and the key, exit status 2:
``kdlab sweep: error: run lrr=0.001-seed=42: model.lrr: no such key for kdlab fit (did you mean 'model.lr'?)``.

Modes: ``slurm`` submits the runs not done as a job array through submitit (settings in ``sweep.slurm``,
e.g. ``{slurm_partition: gpu, timeout_min: 240, gpus_per_node: 1}``; ``max_parallel`` jobs at a time), waits
for them and records each job's id and outcome in ``sweep.json``; ``sequential`` runs each fit in this process (``kdlab.cli.lightning.run_lightning``); ``processes`` starts
``python -m kdlab.cli fit ...`` per run, ``max_parallel`` at a time (each choosing its CPU threads for its share of the
CPUs, :data:`kdlab.cli.console.PARALLEL_RUNS`, unless ``OMP_NUM_THREADS`` is set), its output in ``<name>/fit.log``;
``print`` writes ``python -m kdlab.cli sweep --config <file> --run <name>`` (which runs that one run with the
same skip/resume rules) for every run of the grid, in its order, to ``<output>/commands.sh``, one line per run
and nothing else (a done run's line does nothing, so line N stays run N when the file is written again), and
the lines of the runs not yet done to stdout; a SLURM array (``--array=1-<runs>``: sed counts lines from 1) picks
line ``$SLURM_ARRAY_TASK_ID``: ``sed -n "${SLURM_ARRAY_TASK_ID}p" runs/sweep-smoke/commands.sh | bash``.

Forgetting off the training loop: with a ``forgetting`` key (:mod:`kdlab.study.grid`) each run, once its
fit is done, is measured by ``python -m kdlab.cli forgetting --run <output>/<name> ...``
(:mod:`kdlab.evaluation.forgetting_run`) in a process of its own, from the sweep's working directory, in
every mode (``print`` and ``slurm`` through ``--run``, which does the same). A run counts as done when it
has ``DONE`` and ``forgetting.json``; a run done but not yet measured is measured without fitting again.
A failed measurement marks the run failed (its ``DONE`` stays: the next sweep measures it again).

A ``--run`` line launched as several processes (the SLURM tasks of a multi-GPU run, or torchrun) is one multi-process
fit in which rank 0 alone prepares the folder, marks it done and measures forgetting (:mod:`kdlab.study.launch`); a
whole sweep in such a launch is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from kdlab.study.fit_configs import fit_configs_or_exit
from kdlab.study import launch
from kdlab.study.run_folder import mark_done, newest_checkpoint, prepare, write_json
from kdlab.study.grid import MODES, Run, Sweep, expand, fit_args, load_sweep
from kdlab.study.tables import counted


# ---- running -----------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """A run's fit did not finish; the message says why."""


class UnknownRun(ValueError):
    """A run name that is not a run of the sweep (or pipeline) it was asked of."""


def _fit_in_process(args: list[str]) -> int:
    """``kdlab fit`` in this process; returns the global step reached, raises RunFailed or KeyboardInterrupt."""
    from kdlab.cli import lightning

    saved_argv = sys.argv
    main_thread = threading.current_thread() is threading.main_thread()
    saved_sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    # exactly ``kdlab fit ...``: LightningCLI reads sys.argv (given args as well, it warns) and
    # run_info.json records it as the run's command line. The console script's own path is kept: Lightning starts a
    # multi-device fit's other processes as ``python <sys.argv[0]> ...`` (``kdlab`` alone would be ./kdlab, the package)
    sys.argv = [saved_argv[0] if saved_argv and Path(saved_argv[0]).name == "kdlab" else "kdlab", *args]
    try:
        result = lightning.run_lightning(args, from_sys_argv=True)
    except SystemExit as exit_info:
        # Lightning answers Ctrl+C during fit with sys.exit(1) inside its ``except KeyboardInterrupt``: stop the sweep
        if isinstance(exit_info.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from exit_info
        # SIGTERM (a cluster's time limit): Lightning's SIGTERMException, status 143 (kdlab's ExceptionCheckpoint)
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

    def __init__(self, sweep: Sweep, sweep_file: str, run_command: Callable[[str], list[str]] | None = None) -> None:
        self.sweep, self.sweep_file = sweep, sweep_file
        self.run_command = run_command or (lambda name: ["python", "-m", "kdlab.cli", "sweep", "--config", sweep_file, "--run", name])
        self.output = Path(sweep.output)
        self.runs = expand(sweep)
        self.records = [
            {
                "name": run.name,
                "seed": run.seed,
                "settings": run.settings,
                "status": "skipped" if self.complete(run) else "pending",
                "command": shlex.join(["python", "-m", "kdlab.cli", *fit_args(sweep, run)]),
            }
            for run in self.runs
        ]

    def complete(self, run: Run) -> bool:
        """``DONE``, and ``forgetting.json`` when the sweep measures forgetting off the loop."""
        run_dir = self.output / run.name
        return (run_dir / "DONE").is_file() and (self.sweep.forgetting is None or (run_dir / "forgetting.json").is_file())

    def measure_forgetting(self, run: Run, record: dict[str, Any]) -> None:
        """``kdlab forgetting`` on the finished run, in its own process; a failure marks the record failed."""
        command = self.sweep.forgetting_command(self.output / run.name)
        if command is None:
            return
        print(f"[sweep] {run.name}: forgetting ({shlex.join(command[1:])})", flush=True)
        completed = subprocess.run(command, check=False, env=launch.child_environment())
        if completed.returncode == 0:
            record["status"] = "done"
            return
        if completed.returncode in (130, -signal.SIGINT):
            record["status"] = "interrupted"
            raise KeyboardInterrupt
        record.update(status="failed", error=f"forgetting: exit status {completed.returncode} ({shlex.join(command[1:])})")
        print(f"[sweep] {run.name}: FAILED: {record['error']}", file=sys.stderr, flush=True)

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
        write_json(self.output / "sweep.json", index)

    def pending(self) -> list[tuple[Run, dict[str, Any]]]:
        return [(run, record) for run, record in zip(self.runs, self.records) if record["status"] == "pending"]

    # -- modes
    def write_commands(self) -> tuple[list[str], list[str]]:
        """``sweep.json`` and ``commands.sh``: one line per run of the grid, in the grid's order whatever is done (line N
        is always run N, so a SLURM array index requeued after the file was written again starts the same run; a done
        run's line does nothing). Returns every line and the lines of the runs not yet done."""
        self.write_index()
        lines = [shlex.join(self.run_command(run.name)) for run in self.runs]
        (self.output / "commands.sh").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return lines, [line for line, record in zip(lines, self.records) if record["status"] == "pending"]

    def print_commands(self) -> None:
        """:meth:`write_commands`, and the lines of the runs not yet done on stdout."""
        lines, pending = self.write_commands()
        for text in pending:
            print(text)
        print(
            f"[sweep] {counted(len(lines), 'command')} in {self.output / 'commands.sh'}, one per run of the grid (a SLURM array "
            f"--array=1-{len(lines)}; {len(lines) - len(pending)} done already: their lines do nothing); run them "
            "from this directory",
            file=sys.stderr,
        )

    def run_in_process(self, run: Run, record: dict[str, Any], position: str = "") -> None:
        """Fit ``run`` here (resuming from its newest checkpoint), mark it done and measure its forgetting. One process of
        a multi-process launch (:mod:`kdlab.study.launch`): only rank 0 prepares the folder, marks and measures; the
        other ranks fit from the checkpoint rank 0 chose."""
        run_dir = self.output / run.name
        me = launch.current()
        if (run_dir / "DONE").is_file():  # fitted; forgetting not measured yet
            if me.rank == 0:
                self.measure_forgetting(run, record)
            return
        note = self.output / ".launches" / f"{run.name}.json"
        try:
            resume = launch.agree_on_start(me, note, lambda: prepare(run_dir), lambda: newest_checkpoint(run_dir))
        except RuntimeError as error:
            record.update(status="failed", error=str(error))
            print(f"[sweep] {run.name}: FAILED: {error}", file=sys.stderr, flush=True)
            return
        record.update(status="running", resumed_from=resume)
        record.pop("error", None)
        where = f" (rank {me.rank} of {me.world})" if me.several else ""
        print(f"[sweep] {position}{run.name}: fit{where}" + (f" (resuming from {resume})" if resume else ""), flush=True)
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
        finally:
            launch.finish(me, note)
        record["status"] = "done"
        if me.rank != 0:
            print(f"[sweep] {run.name}: rank {me.rank} fitted; rank 0 marks the run done", flush=True)
            return
        mark_done(run_dir, run, started, resume, global_step=step)
        print(f"[sweep] {run.name}: done in {time.time() - started:.1f}s", flush=True)
        self.measure_forgetting(run, record)

    def run_sequential(self) -> None:
        pending = self.pending()
        for number, (run, record) in enumerate(pending, start=1):
            try:
                self.run_in_process(run, record, f"{number}/{len(pending)} ")
            finally:
                self.write_index()

    def run_processes(self, max_parallel: int) -> None:
        from kdlab.cli.console import PARALLEL_RUNS

        queue = self.pending()
        active: list[tuple[Run, dict[str, Any], subprocess.Popen, Any, float]] = []
        try:
            while queue or active:
                while queue and len(active) < max_parallel:
                    run, record = queue.pop(0)
                    run_dir = self.output / run.name
                    if (run_dir / "DONE").is_file():  # fitted; forgetting not measured yet
                        self.measure_forgetting(run, record)
                        self.write_index()
                        continue
                    resume = prepare(run_dir)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    log = (run_dir / "fit.log").open("a", encoding="utf-8")
                    command = [sys.executable, "-m", "kdlab.cli", *fit_args(self.sweep, run, resume)]
                    # runs started together share the CPUs: each fit chooses its threads for its share (kdlab.cli.console)
                    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, PARALLEL_RUNS: str(max_parallel)})
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

    def run_slurm(self) -> None:
        """Every pending run as one job of a job array through submitit (``sweep.slurm``: its executor
        settings; ``cluster: local`` runs the jobs as local processes), ``max_parallel`` at a time, then wait.
        Each job does what ``kdlab sweep --run NAME`` does (same skip and resume rules); job logs go to
        ``<output>/slurm/``. Ctrl+C cancels the jobs not finished and records them as interrupted."""
        pending = self.pending()
        executor = slurm_executor(self.sweep)  # bad settings fail here, before anything is submitted
        if not pending:
            return
        with executor.batch():
            jobs = [executor.submit(run_job, self.sweep, self.sweep_file, run.name, os.getcwd()) for run, _ in pending]
        for (run, record), job in zip(pending, jobs):
            record.update(status="submitted", job_id=str(job.job_id))
            print(f"[sweep] {run.name}: submitted (job {job.job_id}, log in {self.output / 'slurm'})", flush=True)
        self.write_index()
        try:
            for (run, record), job in zip(pending, jobs):
                try:
                    job.results()  # every task's (a run on several GPUs is one task per GPU; submitit's result() refuses those)
                    record["status"] = "done"
                except Exception as error:  # noqa: BLE001 -- one failing run must not stop the sweep
                    last = str(error).strip().splitlines()[-1:] or [type(error).__name__]
                    record.update(status="failed", error=f"job {job.job_id}: {last[0]}; see {self.output / 'slurm'}")
                    print(f"[sweep] {run.name}: FAILED: {record['error']}", file=sys.stderr, flush=True)
                self.write_index()
        except KeyboardInterrupt:
            for (run, record), job in zip(pending, jobs):
                if not job.done():
                    job.cancel(check=False)
                    record["status"] = "interrupted"
            self.write_index()
            raise

    def find(self, name: str) -> tuple[Run, dict[str, Any]] | None:
        return next(((run, record) for run, record in zip(self.runs, self.records) if run.name == name), None)

    def _finish_process(self, run: Run, record: dict[str, Any], returncode: int, started: float) -> None:
        run_dir = self.output / run.name
        if returncode == 0:
            mark_done(run_dir, run, started, record.get("resumed_from"))
            record["status"] = "done"
            print(f"[sweep] {run.name}: done in {time.time() - started:.1f}s", flush=True)
            self.measure_forgetting(run, record)  # waits: lm-eval takes the GPUs a next fit would
            return
        record.update(status="failed", error=f"exit status {returncode}; see {run_dir / 'fit.log'}")
        tail = (run_dir / "fit.log").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        print(f"[sweep] {run.name}: FAILED ({record['error']}):\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)


def slurm_executor(sweep: Sweep) -> Any:
    """submitit's ``AutoExecutor`` for ``sweep.slurm`` (``cluster``: ``slurm``, ``local`` or ``debug``; found
    by submitit when absent), with ``max_parallel`` as the array's parallelism; ``ValueError`` names the key."""
    try:
        import submitit
    except ImportError:
        raise ValueError("sweep.mode 'slurm' needs submitit: pip install 'kdlab[slurm]'") from None
    settings = dict(sweep.slurm)
    cluster = settings.pop("cluster", None)
    try:
        executor = submitit.AutoExecutor(folder=Path(sweep.output) / "slurm", cluster=cluster)
        executor.update_parameters(**{"name": f"kdlab-{Path(sweep.output).name}", "slurm_array_parallelism": sweep.max_parallel, **settings})
    except (ValueError, AssertionError, NameError, RuntimeError) as error:  # what submitit raises on bad settings
        raise ValueError(f"sweep.slurm: {error}") from None
    return executor


def run_job(sweep: Sweep, sweep_file: str, name: str, cwd: str) -> str:
    """One run as a cluster job (``slurm`` mode): ``kdlab sweep --run NAME`` in the job's process, from the
    directory the sweep was started in. Returns ``done`` or ``skipped``; raises :class:`RunFailed`."""
    os.chdir(cwd)
    sweeper = _Sweeper(sweep, sweep_file)
    run, record = sweeper.find(name)
    if record["status"] == "skipped":
        return "skipped"
    sweeper.run_in_process(run, record)
    if record["status"] == "failed":
        raise RunFailed(f"{name}: {record['error']}")
    return record["status"]


def write_commands(sweep: Sweep, sweep_file: str, run_command: Callable[[str], list[str]]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Print mode's files for ``sweep`` without printing (``sweep.json``, ``commands.sh``): the run records, every
    line and the lines of the runs not yet done."""
    sweeper = _Sweeper(sweep, sweep_file, run_command)
    lines, pending = sweeper.write_commands()
    return sweeper.records, lines, pending


def run_sweep(sweep: Sweep, sweep_file: str, run_command: Callable[[str], list[str]] | None = None) -> list[dict[str, Any]]:
    """Run (or print) every run of ``sweep`` not done yet; returns the ``sweep.json`` run records.

    Failed runs have ``status: failed`` and an ``error``; Ctrl+C raises KeyboardInterrupt after
    ``sweep.json`` records the runs left. ``run_command(name)``: print mode's command for one run (default
    ``python -m kdlab.cli sweep --config <sweep_file> --run <name>``; a pipeline's stages name their own).
    """
    launch.refuse_several(f"kdlab sweep --mode {sweep.mode}")
    sweeper = _Sweeper(sweep, sweep_file, run_command)
    if sweep.mode == "print":
        sweeper.print_commands()
        return sweeper.records
    sweeper.write_index()
    if sweep.mode == "sequential":
        sweeper.run_sequential()
    elif sweep.mode == "slurm":
        sweeper.run_slurm()
    else:
        sweeper.run_processes(sweep.max_parallel)
    return sweeper.records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kdlab sweep",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --max_par 2 is an unknown option, not --max_parallel (issue #43)
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
    fit_configs_or_exit([(sweep, [run for run in expand(sweep) if options.run in (None, run.name)], "")], "kdlab sweep")
    if options.run is not None:
        _run_one(parser, sweep, options.config, options.run)
        return
    try:
        records = run_sweep(sweep, options.config)
    except ValueError as error:  # settings found wrong before any run started (slurm's executor settings)
        parser.error(str(error))
    except KeyboardInterrupt:
        print(f"[sweep] interrupted; run the same command again to continue (see {sweep.output}/sweep.json)", file=sys.stderr)
        raise SystemExit(130) from None
    if sweep.mode == "print":
        return
    counts = {status: sum(r["status"] == status for r in records) for status in ("done", "skipped", "failed")}
    print(f"[sweep] {counted(len(records), 'run')}: {counts['done']} done now, {counts['skipped']} already done, {counts['failed']} failed")
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        lines = "\n".join(f"  {r['name']}: {r['error']}" for r in failed)
        print(f"[sweep] {len(failed)} of {counted(len(records), 'run')} failed:\n{lines}", file=sys.stderr)
        raise SystemExit(1)


def run_one(sweep: Sweep, sweep_file: str, name: str) -> str:
    """One run of the sweep in this process, with the sweep's skip and resume rules (what ``--run NAME`` and print
    mode's lines do; no ``sweep.json``: several may run at once on a cluster). Returns ``skipped``, ``done`` or
    ``failed``; :class:`UnknownRun` when ``name`` is not a run of the sweep; Ctrl+C raises KeyboardInterrupt."""
    sweeper = _Sweeper(sweep, sweep_file)
    found = sweeper.find(name)
    if found is None:
        raise UnknownRun(f"--run {name!r} is not a run of {sweep_file} (see {sweep.output}/sweep.json for the names)")
    run, record = found
    if record["status"] == "skipped":
        print(f"[sweep] {name}: already done ({Path(sweep.output, name, 'DONE')}" + (", forgetting.json)" if sweep.forgetting else ")"))
        return "skipped"
    sweeper.run_in_process(run, record)
    return record["status"]


def _run_one(parser: argparse.ArgumentParser, sweep: Sweep, sweep_file: str, name: str) -> None:
    try:
        status = run_one(sweep, sweep_file, name)
    except UnknownRun as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    if status == "failed":
        raise SystemExit(1)
