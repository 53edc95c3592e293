"""Scores of a student before training, measured once and reused by every run that starts from the same weights.

A grid's runs start from one student, and an evaluation before training depends only on that student, the
evaluation's own settings and the code that runs it; so its scores are kept in a :class:`BeforeCache` (a folder
of JSON files) keyed by :func:`weights_digest` (the student's effective weights, LoRA adapters merged) and a settings key. Two users:

* ``kdlab forgetting`` (:mod:`kdlab.evaluation.forgetting`): the lm-eval suite off the training loop, keyed by
  :meth:`~kdlab.evaluation.forgetting.SuiteSettings.key`;
* the in-loop evaluation callbacks (``OODForgetting``, ``Coverage``) with ``before_cache: <folder>``: keyed by
  :func:`evaluation_key`, which holds every input of the measurement but the weights: the callback's class and
  settings, its tasks (their settings and the very examples evaluated), the student's tokenizer, the process
  layout, the device (its type, GPU name and float32 matmul precision), the versions of torch and transformers
  and a digest of kdlab's own source files, so a cached score is only ever reused by code that would compute it
  the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

PRIMITIVES = (bool, int, float, str, type(None))


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of ``model``'s effective weights (:func:`~kdlab.models.export.merged_weights`: each LoRA adapter merged
    into its base weight, ``W + B A * alpha / r``, under the base weight's Hugging Face name): every weight's name,
    dtype, shape and bytes, in name order. So runs of a LoRA grid that differ only in their seed's random ``A`` (while
    ``B = 0``) share one digest, and a trained adapter (``B != 0``) gets another. One merged weight is alive at a time."""
    from kdlab.models.export import merged_weights

    entries = []
    with torch.no_grad():
        for name, tensor in merged_weights(model):
            tensor = tensor.detach().to("cpu").contiguous()
            entry = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
            entry.update(tensor.reshape(-1).view(torch.uint8).numpy())
            entries.append((name, entry.digest()))
            del tensor
    digest = hashlib.sha256()
    for name, entry in sorted(entries):
        digest.update(name.encode() + b"\0" + entry)
    return digest.hexdigest()


class BeforeCache:
    """Scores of a student before training, one JSON file per (weights digest, settings key) in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path(self, weights: str, settings_key: str) -> Path:
        return self.directory / f"before-{weights[:24]}-{settings_key[:24]}.json"

    def get(self, weights: str, settings_key: str) -> dict[str, float] | None:
        """The cached scores, or None (nothing cached, or a file for other full keys)."""
        path = self.path(weights, settings_key)
        if not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("weights") != weights or data.get("settings_key") != settings_key:
            return None
        return {name: float(value) for name, value in data["scores"].items()}

    def put(self, weights: str, settings_key: str, scores: Mapping[str, float], **about: Any) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(weights, settings_key)
        record = {"weights": weights, "settings_key": settings_key, "scores": dict(scores), **about}
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # several runs of a grid may write at once
        partial.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        partial.replace(path)
        return path


@cache
def source_digest() -> str:
    """SHA-256 of every file of the installed kdlab package (relative path and bytes, in path order): two
    checkouts that differ in any line of kdlab get different keys."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def settings_of(obj: Any) -> dict[str, Any]:
    """``obj``'s public attributes that are plain values (numbers, strings, and lists, tuples or dicts of them),
    with its class's dotted path: what a constructor argument in YAML can set."""

    def plain(value: Any) -> bool:
        if isinstance(value, PRIMITIVES):
            return True
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        return False

    fields = {name: value for name, value in sorted(vars(obj).items()) if not name.startswith("_") and plain(value)}
    return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}", **fields}


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's vocabulary, special tokens and chat template."""
    description = {"vocab": sorted(tokenizer.get_vocab().items()), "special": getattr(tokenizer, "all_special_tokens", None),
                   "template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(description, default=str).encode()).hexdigest()


def device_description(device: torch.device | str) -> dict[str, str]:
    """What of the device an evaluation runs on can change its numbers: the device type (CPU and CUDA generators
    draw different streams from one seed), the GPU's name (its kernels round differently) and
    ``torch.get_float32_matmul_precision()`` (TF32 or not)."""
    device = torch.device(device)
    found = {"type": device.type, "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda" and torch.cuda.is_available():
        found["name"] = torch.cuda.get_device_name(device)
    return found


def evaluation_key(callback: Any, tasks: list[Any], examples: list[list[dict]], tokenizer: Any, layout: tuple[int, int],
                   precision: str, decoding: dict[str, Any] | None = None, device: torch.device | str = "cpu") -> str:
    """The settings key of an in-loop evaluation's "before" scores: ``callback``'s class and plain settings, each
    of ``tasks`` (class and plain settings) with the ``examples`` it evaluates, the student's tokenizer, the
    ``(replicas, rank)`` layout, the trainer's ``precision``, the module's ``decoding`` settings (end tokens, stop
    strings, prompt limit: :func:`kdlab.callbacks.periodic.module_decoding`), the ``device`` it samples on
    (:func:`device_description`), torch's and transformers' versions and kdlab's source (:func:`source_digest`)."""
    import transformers

    description = {
        "callback": {k: v for k, v in settings_of(callback).items() if k not in ("before", "before_cache")},
        "tasks": [{**settings_of(task), "examples": hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()}
                  for task, chosen in zip(tasks, examples)],
        "tokenizer": tokenizer_digest(tokenizer), "layout": list(layout), "precision": str(precision), "decoding": decoding or {},
        "device": device_description(device),
        "torch": torch.__version__, "transformers": transformers.__version__, "kdlab": source_digest(),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()
