"""Every documented command works as written: the command on the first line of each
``experiments/tiny/*.yaml`` (``# kdlab fit --config ...``, ``# kdlab sweep ...``, ``# kdlab pipeline ...``,
``# kdlab generate ...``) runs in a subprocess, ``python -m kdlab.cli`` with the repository on
``PYTHONPATH``, from a fresh working folder (the repository's ``experiments/`` and nothing else: no
``runs/``), for 2 optimiser steps, and must finish with exit status 0, no traceback, and validation
after its last step (``val/accuracy`` at step 2 in ``metrics.jsonl``).

Shortened as a user would: a fit gets ``--trainer.max_steps=2`` and ``--trainer.limit_val_batches=1``
(the validation after the last step is :class:`kdlab.stages.base.ValidateLastStep`'s); a sweep or
pipeline file is copied with the first value of each grid key, its first seed and those two settings in
its ``overrides``; ``kdlab generate`` writes 8 prompts' completions (``--limit=8``). A header that needs a server
(served_teacher.yaml) names the command that starts one; the test starts kdlab's loopback server with it
on a free port. The concrete ``kdlab`` commands a header gives next (``kdlab report`` after the smoke
sweep, the fit from the teacher cache) run after it. The slow tier (CI runs it: ``-m "not gpu"``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kdlab.cli.extras import NEEDS, missing_extras
from kdlab.runlog import metrics_lines

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny"
SHORT = {"trainer.max_steps": 2, "trainer.limit_val_batches": 1}
TIMEOUT_S = 900

def header_command(path: Path) -> list[str] | None:
    """The command on a YAML's first line (``# kdlab ...``), split as a shell would, or None."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    return shlex.split(first[1:]) if first.startswith("# kdlab ") else None


def follow_ups(path: Path) -> list[list[str]]:
    """The concrete ``kdlab`` commands a header gives as indented comment lines (``#   kdlab ...``, joined
    over a trailing backslash), without those holding a ``<placeholder>`` or repeating the header's own."""
    commands, current = [], None
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if current is not None:
            current += " " + text
        elif line.startswith("#   kdlab "):
            current = text
        if current is not None and not current.endswith("\\"):
            commands.append(current)
            current = None
        elif current is not None:
            current = current[:-1].rstrip()
    return [shlex.split(command) for command in commands if "<" not in command and shlex.split(command) != header_command(path)]


HEADERS = {path.name: header_command(path) for path in sorted(TINY.glob("*.yaml")) if header_command(path)}
XFAIL: dict[str, str] = {}  # a header command known to fail, with why (none: the LoRA + style crash is fixed, issue 39)


def test_every_tiny_experiment_names_its_command_on_its_first_line():
    """The tier covers every experiment file: each one's first line is the command that runs it."""
    missing = [path.name for path in sorted(TINY.glob("*.yaml")) if path.name not in HEADERS]
    assert not missing, f"experiments/tiny files without a '# kdlab ...' first line: {missing}"
    assert {command[1] for command in HEADERS.values()} <= {"fit", "sweep", "pipeline", "generate"}


# ---- running a command ------------------------------------------------------------------------
def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # several at once under xdist; one thread each is fastest then
    env["HF_HUB_OFFLINE"] = "1"  # the tiny world downloads nothing
    env.pop("KDLAB_TRACEBACK", None)
    return env


def kdlab(args: list[str], cwd: Path) -> str:
    """Run ``kdlab <args>`` (``python -m kdlab.cli``) in ``cwd``; its output, after checking it ended well."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kdlab.cli", *args], cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = done.stdout + done.stderr
    command = shlex.join(["kdlab", *args])
    assert done.returncode == 0, f"{command} exited with {done.returncode} after {time.monotonic() - started:.0f} s:\n{output[-6000:]}"
    assert "Traceback (most recent call last)" not in output, f"{command} printed a traceback:\n{output[-6000:]}"
    return output


def fresh_folder(tmp_path: Path) -> Path:
    """A working folder as a fresh clone has it: the repository's experiments/, no runs/."""
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    return tmp_path


def config_arg(args: list[str]) -> tuple[int, str]:
    index = next(i for i, arg in enumerate(args) if arg == "--config")
    return index + 1, args[index + 1]


def shortened_sweep(spec: dict) -> dict:
    """A sweep file's first run only (first value of each grid key, first seed), 2 steps, one validation batch."""
    spec = dict(spec)
    spec["grid"] = {key: values[:1] for key, values in (spec.get("grid") or {}).items()}
    spec["seeds"] = list(spec.get("seeds") or [42])[:1]
    spec["overrides"] = {**(spec.get("overrides") or {}), **SHORT}
    return spec


def shortened_file(args: list[str], folder: Path) -> list[str]:
    """``args`` with its sweep or pipeline file replaced by a shortened copy (see the module docstring)."""
    index, path = config_arg(args)
    spec = yaml.safe_load((folder / path).read_text(encoding="utf-8"))
    if args[0] == "pipeline":
        spec["distill"] = shortened_sweep(spec["distill"])
        spec["rlvr"] = {**shortened_sweep(spec["rlvr"]), "seeds": list(spec["rlvr"].get("seeds") or [42])[:1]}
        if spec.get("rlvr_seeds"):
            spec["rlvr_seeds"] = spec["distill"]["seeds"]
    else:
        spec = shortened_sweep(spec)
    copy = folder / f"shortened-{Path(path).name}"
    copy.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return [*args[:index], str(copy), *args[index + 1 :]]


def fit_runs(folder: Path) -> list[Path]:
    """Every run directory under ``folder/runs`` (those holding a config.yaml)."""
    return sorted(path.parent for path in (folder / "runs").rglob("config.yaml"))


def check_validated(run_dir: Path) -> None:
    """The run's metrics.jsonl has ``val/accuracy`` at step 2: the validation after its last step."""
    steps = [step for step, name, _ in metrics_lines(run_dir / "metrics.jsonl", optimiser_steps=True) if name == "val/accuracy"]
    assert steps and steps[-1] == 2, f"{run_dir}: val/accuracy at steps {steps}, expected a validation after step 2"
    assert (run_dir / "samples" / "val-step000002.jsonl").is_file(), run_dir


class LoopbackServer:
    """The server a served-teacher header names (``python -m kdlab.rollouts.loopback ... --port 8000``),
    started on a free port; ``url`` is where it answers."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        args = [arg for arg in command[2:]]
        args[args.index("--port") + 1] = str(port)
        self.url = f"http://127.0.0.1:{port}"
        self.log = cwd / "loopback.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the loopback server exited:\n{self.log.read_text()[-4000:]}"
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2).close()
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise AssertionError(f"the loopback server did not answer within 180 s:\n{self.log.read_text()[-4000:]}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def server_command(path: Path) -> list[str] | None:
    """The loopback server a header says to start first, or None."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") and "python -m kdlab.rollouts.loopback" in line:
            return shlex.split(line[1:])
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name])) if name in XFAIL else name for name in HEADERS]
)
def test_the_header_command_runs_two_steps_from_a_fresh_folder(name, tmp_path):
    path = TINY / name
    folder = fresh_folder(tmp_path)
    args = HEADERS[name][1:]
    server = None
    if args[0] in ("sweep", "pipeline"):
        args = shortened_file(args, folder)
    elif args[0] == "generate":
        args = [*args, "--limit=8"]
    else:
        args = [*args, *(f"--{key}={value}" for key, value in SHORT.items())]
    if server_command(path):
        server = LoopbackServer(server_command(path), folder)
        args.append(f"--model.teacher.init_args.server.init_args.url={server.url}")  # the server on its free port
    try:
        output = kdlab(args, folder)
    finally:
        if server is not None:
            server.close()
    if args[0] == "generate":
        written = yaml.safe_load(path.read_text(encoding="utf-8"))["output"]
        assert len((folder / written).read_text(encoding="utf-8").splitlines()) == 8
    else:
        runs = fit_runs(folder)
        assert runs, f"no run directory under {folder / 'runs'}:\n{output[-3000:]}"
        for run_dir in runs:
            check_validated(run_dir)
    for follow_up in follow_ups(path):
        before = set(fit_runs(folder))
        if follow_up[1] == "fit":
            kdlab([*follow_up[1:], *(f"--{key}={value}" for key, value in SHORT.items())], folder)
            (run_dir,) = set(fit_runs(folder)) - before
            check_validated(run_dir)
        else:
            kdlab(follow_up[1:], folder)
        if follow_up[1] == "report":
            report = folder / follow_up[follow_up.index("--output") + 1]
            assert any(report.glob("*.md")), f"kdlab report wrote no table to {report}"


def test_follow_up_commands_are_read_from_the_header():
    """The two headers that give a next command: the report after the smoke sweep, the fit from the cache."""
    # the folder the README and the quickstart name: the report's own default for that folder
    assert follow_ups(TINY / "sweep_smoke.yaml") == [["kdlab", "report", "runs/sweep-smoke", "--output", "runs/sweep-smoke/report"]]
    from kdlab.study.report import default_output

    assert default_output(["runs/sweep-smoke"]) == Path("runs/sweep-smoke/report")
    fit = follow_ups(TINY / "teacher_cache.yaml")
    assert len(fit) == 1 and fit[0][:2] == ["kdlab", "fit"] and "--model.teacher.path=runs/tiny-teacher-cache/teacher.jsonl.topk.safetensors" in fit[0]
    assert follow_ups(TINY / "quickstart.yaml") == []  # its <experiment> line is a pattern, not a command
    assert json.dumps(server_command(TINY / "served_teacher.yaml")).count("--port") == 1
    assert re.match(r"python -m kdlab\.rollouts\.loopback", shlex.join(server_command(TINY / "served_teacher.yaml")))


# ---- what a header says its command needs ---------------------------------------------------------
def read_configs(args: list[str]) -> list[dict]:
    """The settings a header command reads: its config files; a sweep's or pipeline's stages, their
    base files, grid and overrides."""
    found = []
    for path in [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--config"]:
        spec = yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))
        stages = [spec[key] for key in ("distill", "rlvr") if key in spec] if args[1] == "pipeline" else [spec] if args[1] == "sweep" else []
        found += [spec] if not stages else []
        for stage in stages:
            bases = stage.get("base") or []
            for base in [bases] if isinstance(bases, str) else bases:
                found.append(yaml.safe_load((ROOT / base).read_text(encoding="utf-8")))
            found += [stage.get("grid") or {}, stage.get("overrides") or {}]
    return found


def needed_extras(name: str) -> set[str]:
    return {need.extra for config in read_configs(HEADERS[name]) for _, _, need in missing_extras(config, is_installed=lambda module: False)}


def test_each_header_names_the_extras_its_command_needs():
    """A tiny experiment whose settings need an optional package (kdlab.cli.extras.NEEDS: StyleTransfer's
    py3langid, LoRA's peft, ...) says so in its header comment, with the extra that installs it."""
    needing = {name: needed_extras(name) for name in HEADERS}
    assert needing["spanish_style.yaml"] == {"eval"} and needing["lora_self_distill.yaml"] == {"eval", "lora"}  # the rules see them
    assert needing["quickstart.yaml"] == set()
    for name, extras in needing.items():
        header = "\n".join(line for line in (TINY / name).read_text(encoding="utf-8").splitlines() if line.startswith("#"))
        for extra in extras:
            assert f"kdlab[{extra}]" in header, f"{name} needs kdlab[{extra}] and its header does not say so"


def test_the_readme_install_brings_every_package_the_tiny_experiments_need():
    """The README installs kdlab[tiny]; that extra holds the package of every need of the tiny headers
    (and matplotlib, scipy and statsmodels, for kdlab report's figures and statistics)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[tiny]" && kdlab fit --config experiments/tiny/quickstart.yaml' in readme
    tiny = re.search(r"^tiny = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)  # tomllib: Python 3.11+
    packages = {re.split(r"[<>=\[]", requirement.strip().strip('"'))[0] for requirement in tiny.split(",")}
    needed = {need.package for need in NEEDS for name in HEADERS for config in read_configs(HEADERS[name])
              for _, _, found in missing_extras(config, is_installed=lambda module: False) if found is need}
    assert needed == {"py3langid", "peft"} and needed | {"matplotlib", "scipy", "statsmodels"} == packages
