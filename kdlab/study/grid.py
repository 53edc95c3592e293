"""The sweep file (``kdlab sweep --config sweep.yaml``): what it may hold, the runs it expands to, their
names and their ``kdlab fit`` arguments. Running them is :mod:`kdlab.study.sweep`'s.

A sweep file is plain YAML::

    base: experiments/tiny/smoke.yaml   # the fit config, or a list applied in order (like repeated --config)
    output: runs/sweep-smoke            # run <name> logs to <output>/<name>/
    grid:                               # dotted fit keys -> lists of values; the cartesian product is run
      model.objective: [{class_path: kdlab.objectives.ForwardKL}, {class_path: kdlab.objectives.ReverseKL}]
      model.lr: [1.0e-3, 5.0e-3]
    seeds: [42, 43]                     # --seed_everything, which also seeds the module (default [42])
    overrides: {trainer.max_steps: 2}   # the same for every run
    mode: sequential                    # sequential | processes | print | slurm
    max_parallel: 1                     # runs at a time in ``processes`` and ``slurm`` modes
    slurm: {slurm_partition: gpu, timeout_min: 240, gpus_per_node: 1}   # submitit's settings (slurm mode)
    forgetting:                         # the lm-eval forgetting suite off the training loop, after each run
      tasks: paper                      # (kdlab.evaluation.forgetting.SuiteSettings' keys, and
      cache_dir: runs/before-cache      #  cache_dir, backend, dtype, devices: kdlab forgetting's options)

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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("sequential", "processes", "print", "slurm")
FILE_KEYS = ("base", "output", "grid", "seeds", "overrides", "mode", "max_parallel", "slurm", "forgetting")
FORGETTING_RUN_KEYS = ("cache_dir", "backend", "dtype", "devices")  # a sweep's forgetting keys besides the suite's
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
    slurm: dict[str, Any] = field(default_factory=dict)
    forgetting: dict[str, Any] | None = None

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
        if not isinstance(self.slurm, dict) or not all(isinstance(k, str) for k in self.slurm):
            raise ValueError(f"sweep.slurm must map submitit executor settings (partition, timeout_min, ...) to values, got {self.slurm!r}")
        if self.forgetting is not None:
            _check_forgetting(self.forgetting, self.base, self.overrides, self.grid)

    def forgetting_command(self, run_dir: str | Path) -> list[str] | None:
        """``python -m kdlab.cli forgetting --run <run_dir> ...`` when the sweep measures forgetting off the loop."""
        if self.forgetting is None:
            return None
        from kdlab.evaluation.forgetting import SuiteSettings
        from kdlab.evaluation.forgetting_run import command

        suite = SuiteSettings.from_mapping({k: v for k, v in self.forgetting.items() if k not in FORGETTING_RUN_KEYS}, "sweep.forgetting")
        options = {k: v for k, v in self.forgetting.items() if k in FORGETTING_RUN_KEYS}
        return command(run_dir, suite.as_mapping(), **options)


def _check_forgetting(forgetting: Any, base: list[str], overrides: dict[str, Any], grid: dict[str, Any]) -> None:
    """``sweep.forgetting``'s keys and values, and no in-loop lm-eval ``OODForgetting`` in the runs' configs."""
    from kdlab.evaluation.forgetting import BACKENDS, DTYPES, SuiteSettings

    if not isinstance(forgetting, dict):
        raise ValueError(f"sweep.forgetting must be a mapping (tasks, include_path, batch_size, ..., cache_dir, backend, dtype, devices), got {forgetting!r}")
    SuiteSettings.from_mapping({k: v for k, v in forgetting.items() if k not in FORGETTING_RUN_KEYS}, "sweep.forgetting")
    if forgetting.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"sweep.forgetting.backend must be one of {', '.join(BACKENDS)}, got {forgetting['backend']!r}")
    if forgetting.get("dtype", "auto") not in DTYPES:
        raise ValueError(f"sweep.forgetting.dtype must be one of {', '.join(DTYPES)}, got {forgetting['dtype']!r}")
    devices = forgetting.get("devices")
    if devices is not None and (type(devices) is not int or devices < 1):
        raise ValueError(f"sweep.forgetting.devices must be an int >= 1 (default: each run's devices), got {devices!r}")
    sources = [(path, (yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader) or {}).get("trainer") or {}) for path in base]
    sources += [(f"sweep.overrides[{key!r}]", {"callbacks": value}) for key, value in overrides.items() if key == "trainer.callbacks"]
    sources += [(f"sweep.grid[{key!r}]", {"callbacks": value}) for key, values in grid.items() if key == "trainer.callbacks" for value in values]
    for where, trainer in sources:
        callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
        for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
            if (isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("OODForgetting")
                    and (callback.get("init_args") or {}).get("lm_eval_tasks") is not None):
                raise ValueError(f"sweep.forgetting measures forgetting after each run, but {where} also measures it in the training loop "
                                 "(OODForgetting with lm_eval_tasks): remove that callback, or the forgetting key")


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
    """``kdlab fit`` arguments of ``run`` (what ``kdlab.cli.lightning.run_lightning`` takes), resuming from ``ckpt_path``."""
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
