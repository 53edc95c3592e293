"""What a config needs beyond kdlab's own dependencies, said when the command line is parsed: before a
model loads, a run directory is made or an evaluation runs.

Each rule of :data:`NEEDS` names a setting (a key, or a ``class_path`` value), the module it imports and
the ``pip install 'kdlab[<extra>]'`` extra (``pyproject.toml``) that installs it. :func:`check_extras`
raises a :class:`~kdlab.errors.ConfigError` naming the setting, the missing package and its extra for
the first that is absent; ``kdlab fit|validate|test`` call it on the parsed config
(:mod:`kdlab.cli.lightning`), so ``spanish_style.yaml`` without ``[eval]`` ends in one line such as
``trainer.callbacks[3].class_path='kdlab.callbacks.StyleTransfer' needs py3langid: pip install
'kdlab[eval]'``, not in an ImportError after the models loaded."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kdlab.errors import ConfigError


@dataclass(frozen=True)
class Need:
    """A setting that needs an optional package: ``applies(key, value)`` over the config's dotted keys."""

    applies: Callable[[str, Any], bool]
    module: str  # what is imported (importlib.util.find_spec)
    package: str  # what pip installs
    extra: str  # kdlab's extra that brings it (pyproject.toml)


def _class(*names: str) -> Callable[[str, Any], bool]:
    return lambda key, value: key.endswith("class_path") and value in names


NEEDS = (
    Need(_class("kdlab.callbacks.StyleTransfer", "kdlab.callbacks.evaluations.StyleTransfer"), "py3langid", "py3langid", "eval"),
    Need(lambda key, value: key.rsplit(".", 1)[-1] == "lora" and value is not None, "peft", "peft", "lora"),
    Need(lambda key, value: key.endswith("lm_eval_tasks") and value is not None, "lm_eval", "lm-eval", "eval"),
    Need(_class("kdlab.rollouts.VLLMRollouts", "kdlab.rollouts.vllm.VLLMRollouts"), "vllm", "vllm", "vllm"),
    Need(lambda key, value: key.endswith("path") and isinstance(value, str) and value.lower().endswith(".gguf"), "gguf", "gguf", "real"),
)


def settings(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every setting in a (nested) config: a jsonargparse Namespace, dict or
    list (items as ``key[i]``); each branch is yielded too, before its leaves."""
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    if isinstance(config, dict):
        for key, value in config.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            yield name, value
            yield from settings(value, name)
    elif isinstance(config, list):
        for index, value in enumerate(config):
            yield from settings(value, f"{prefix}[{index}]")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; nothing is imported)."""
    return importlib.util.find_spec(module) is not None


def missing_extras(config: Any, is_installed: Callable[[str], bool] | None = None) -> list[tuple[str, Any, Need]]:
    """The settings of ``config`` whose package is not installed, in config order (``is_installed``: whether
    a module can be imported; by default :func:`installed`)."""
    is_installed = is_installed or installed
    found = []
    for key, value in settings(config):
        for need in NEEDS:
            if need.applies(key, value) and not is_installed(need.module):
                found.append((key, value, need))
    return found


def check_extras(config: Any, is_installed: Callable[[str], bool] | None = None) -> None:
    """Raise a :class:`ConfigError` naming the first setting whose optional package is missing (see the module docstring)."""
    missing = missing_extras(config, is_installed)
    if not missing:
        return
    key, value, need = missing[0]
    setting = key if isinstance(value, (dict, list)) else f"{key}={value!r}"
    others = sorted({f"kdlab[{other.extra}]" for _, _, other in missing[1:] if other.extra != need.extra})
    more = f" (the config also needs {', '.join(others)})" if others else ""
    raise ConfigError(f"{setting} needs {need.package}, which is not installed: pip install 'kdlab[{need.extra}]'{more}")
