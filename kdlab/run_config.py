"""What a run was, described from the objects it was built from: the ``config.yaml`` of a run that
``kdlab fit`` did not start (a notebook's ``Trainer.fit``) and the hyperparameters every run gives its
loggers (TensorBoard's HPARAMS tab and its ``hparams.yaml``).

``kdlab fit`` writes the resolved YAML itself (Lightning's ``SaveConfigCallback``). A run built in Python has
no such file, so :class:`~kdlab.stages.base.TaskStage` writes one when fit starts, in the layout
``kdlab report`` reads: ``model`` with the stage's ``class_path`` and ``init_args``, each component (task,
rollout policy, objective, teacher source) a ``class_path`` with its own ``init_args``; ``trainer`` with the
Trainer's settings and callbacks; ``seed_everything`` (from :func:`lightning.seed_everything`). The
arguments are the ones each object's constructor was called with (:func:`remember_arguments`), so a
component written in a notebook is named by its class (``__main__.SkewKL``) and its settings. A stage
argument left ``None`` that the stage filled with a component (``objective=None``: a ``ForwardKL``) is
described as that component. A value that is not plain data (a model object, a tokenizer) is named by its
type and ``name_or_path``. The file is for reading (``kdlab report``, a reviewer): a class defined in a
notebook cannot be imported by ``kdlab fit``, so it is not promised to run there.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import os
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import yaml

ARGUMENTS = "_kdlab_arguments"
"""The attribute holding what an object's constructor was called with (:func:`remember_arguments`)."""

HEADER = (
    "# Written by {stage} at fit start: this run was not started by kdlab fit, so this file describes the\n"
    "# objects it was built from (see kdlab.run_config). kdlab report reads it; kdlab fit may not run it.\n"
)


def remember_arguments(obj: Any, frame: FrameType | None) -> None:
    """Keep on ``obj`` the arguments its constructor was called with. ``frame`` is the innermost
    ``__init__`` frame of ``obj``'s constructor chain that may hold them (a base class passes its caller's
    frame); every ``__init__`` frame of the same object outside it is read too, the class ``obj`` is taking
    precedence, and only the parameters of ``type(obj).__init__`` are kept (all of them if it takes
    ``**kwargs``)."""
    found: dict[str, Any] = {}
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is obj:
        info = inspect.getargvalues(frame)
        mine = {name: info.locals[name] for name in info.args if name != "self" and name in info.locals}
        if info.keywords:
            mine.update(info.locals.get(info.keywords) or {})
        found = {**found, **mine}
        frame = frame.f_back
    parameters = inspect.signature(type(obj).__init__).parameters
    ordered = {name: found.pop(name) for name in parameters if name in found}  # in the signature's order
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        ordered.update(found)
    found = ordered
    object.__setattr__(obj, ARGUMENTS, found)


def class_path(value: Any) -> str:
    kind = value if isinstance(value, type) else type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def described(value: Any) -> Any:
    """``value`` as YAML-safe data: plain values as they are, an object whose arguments were remembered as
    ``{class_path, init_args}``, a dataclass as its fields, anything else as its type (and ``name_or_path``)."""
    if isinstance(value, enum.Enum):
        return described(value.value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    for plain in (bool, int, float, str):  # a subclass (numpy's float64) as the builtin YAML can write
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, (torch.Tensor, np_generic())) and getattr(value, "ndim", 1) == 0:
        return described(value.item())  # a 0-dim tensor or numpy scalar (np.int64): its value
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [described(item) for item in value]
    if isinstance(value, dict):
        return {str(key): described(item) for key, item in value.items()}
    arguments = getattr(value, ARGUMENTS, None)
    if isinstance(arguments, dict):
        return {"class_path": class_path(value), "init_args": {name: described(item) for name, item in arguments.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: described(getattr(value, field.name)) for field in dataclasses.fields(value)}
    source = getattr(value, "name_or_path", None) or getattr(getattr(value, "config", None), "_name_or_path", None)
    return f"{class_path(value)}({source})" if source else class_path(value)


def np_generic() -> type:
    """numpy's scalar base class where numpy is installed (a type nothing is an instance of otherwise)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return type("NoNumpy", (), {})
    return numpy.generic


def stage_arguments(module: pl.LightningModule) -> dict[str, Any]:
    """The stage's remembered arguments, a ``None`` replaced by the component the stage put in its place (an
    attribute of that name whose own arguments were remembered; one that cannot be read is left alone)."""
    arguments = dict(getattr(module, ARGUMENTS, {}))
    for name, value in arguments.items():
        if value is not None or name not in vars(module).get("_modules", {}):
            continue
        used = vars(module)["_modules"][name]
        if hasattr(used, ARGUMENTS):
            arguments[name] = used
    return arguments


TRAINER_SETTINGS = ("max_steps", "max_epochs", "accumulate_grad_batches", "precision", "gradient_clip_val", "val_check_interval",
                    "check_val_every_n_epoch", "log_every_n_steps", "num_nodes")


def trainer_settings(trainer: pl.Trainer) -> dict[str, Any]:
    """The Trainer's settings that change what a run computes, its device count and strategy, and every
    callback that is not Lightning's own."""
    settings = {name: described(getattr(trainer, name, None)) for name in TRAINER_SETTINGS}
    settings["devices"] = trainer.num_devices
    settings["strategy"] = class_path(trainer.strategy)
    settings["callbacks"] = [described(callback) if hasattr(callback, ARGUMENTS) else {"class_path": class_path(callback)}
                             for callback in trainer.callbacks if not type(callback).__module__.startswith("lightning.")]
    return settings


def run_config(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Any]:
    """``{seed_everything, model: {class_path, init_args}, trainer: {...}}`` for ``module`` fit by ``trainer``."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return {
        "seed_everything": int(seed) if seed is not None and seed.lstrip("-").isdigit() else None,
        "model": {"class_path": class_path(module), "init_args": described(stage_arguments(module))},
        "trainer": trainer_settings(trainer),
    }


def started_by_cli(trainer: pl.Trainer) -> bool:
    """Whether ``kdlab fit`` (a LightningCLI) made this Trainer: it saves the resolved config itself."""
    from lightning.pytorch.cli import SaveConfigCallback

    return any(isinstance(callback, SaveConfigCallback) for callback in trainer.callbacks)


def write_run_config(trainer: pl.Trainer, config: dict[str, Any], log_dir: str | Path) -> Path | None:
    """Write ``config`` as ``<log_dir>/config.yaml`` for a run ``kdlab fit`` did not start; a resumed run keeps
    the file its first part wrote (a fresh run in a reused folder replaces it). Returns the path written, else ``None``."""
    path = Path(log_dir) / "config.yaml"
    if started_by_cli(trainer) or (trainer.ckpt_path and path.exists()):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(stage=config["model"]["class_path"].rsplit(".", 1)[-1])
    path.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


HPARAMS_METRICS = ("val/accuracy", "train/loss")
"""The scalars TensorBoard's HPARAMS tab shows beside each run's settings (a run logs them itself)."""


def log_hyperparameters(trainer: pl.Trainer, config: dict[str, Any]) -> None:
    """Give every logger the run's description. A TensorBoard logger keeps it in ``hparams.yaml`` and its events
    carry the HPARAMS tab's summaries, naming :data:`HPARAMS_METRICS`; no ``hp_metric`` placeholder scalar is
    written (Lightning's default logs ``hp_metric = -1``, once more on every resume)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(config)
            continue
        logger.log_hyperparams(config, metrics={})  # hparams.yaml only
        from torch.utils.tensorboard.summary import hparams

        flat = logger._sanitize_params({key: value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
                                        for key, value in flat_settings(config, separator="/").items()})
        writer = logger.experiment._get_file_writer()
        for summary in hparams(flat, dict.fromkeys(HPARAMS_METRICS, 0.0)):  # the metrics' names; their values are the run's own scalars
            writer.add_summary(summary)


def flat_settings(value: Any, prefix: str = "", separator: str = ".") -> dict[str, Any]:
    """``{"model.lr": leaf}`` of nested dicts, keys joined by ``separator`` under ``prefix`` (an empty dict is a leaf)."""
    if isinstance(value, dict) and value:
        return {key: leaf for name, item in value.items()
                for key, leaf in flat_settings(item, f"{prefix}{separator}{name}" if prefix else str(name), separator).items()}
    return {prefix: value}


def describe_run(module: pl.LightningModule, trainer: pl.Trainer, log_dir: str | Path) -> None:
    """At fit start, on rank 0: the ``config.yaml`` of a run ``kdlab fit`` did not start and every logger's
    hyperparameters, from ``module``'s description (:func:`run_config`)."""
    config = run_config(module, trainer)
    write_run_config(trainer, config, log_dir)
    log_hyperparameters(trainer, config)
