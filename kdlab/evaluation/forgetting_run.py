"""``kdlab forgetting --run <run dir>``: a finished run's forgetting, off the training loop
(:mod:`kdlab.evaluation.forgetting` says how it is scored).

The run's ``config.yaml`` names the student it started from (``model.student``, or ``model.policy`` for
RLVR; a string or a :class:`~kdlab.models.loading.ModelSpec` mapping, its own ``checkpoint`` included) and
``checkpoints/final.ckpt`` holds what it became. The suite comes from ``--suite`` (a YAML file of
:class:`~kdlab.evaluation.forgetting.SuiteSettings`' keys) or, without it, from the run's own
``OODForgetting`` callback's ``lm_eval_*`` settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml

from kdlab.evaluation.before_cache import BeforeCache, weights_digest
from kdlab.evaluation.forgetting import (
    BACKENDS,
    DTYPES,
    RESULT_FILE,
    TRAINED_ROLES,
    SuiteSettings,
    choose_backend,
    choose_dtype,
    score_model,
)
from kdlab.runlog import METRICS_FILE, metrics_lines


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"forgetting: {path} does not exist (--run must be a kdlab fit's run directory)")
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def _init_args(value: Any) -> dict[str, Any]:
    if isinstance(value, dict) and "class_path" in value:
        return value.get("init_args") or {}
    return value if isinstance(value, dict) else {}


def start_spec(run_dir: str | Path) -> tuple[Any, str]:
    """``(ModelSpec of the student the run started from, its role in the config)``."""
    from kdlab.models.loading import ModelSpec

    model = _init_args(_config(Path(run_dir)).get("model"))
    for role in TRAINED_ROLES:
        spec = model.get(role)
        if spec is None:
            continue
        if isinstance(spec, dict) and "path" not in spec:
            spec = _init_args(spec)
        spec = ModelSpec(spec) if isinstance(spec, str) else ModelSpec(**spec)
        if model.get("lora") is not None:
            raise NotImplementedError(
                f"forgetting: {run_dir} trains LoRA adapters (model.lora); its final.ckpt holds adapters, which off-loop "
                "forgetting does not merge yet: measure it in-loop (OODForgetting) or score an exported folder with --model"
            )
        return spec, role
    raise ValueError(f"forgetting: {Path(run_dir) / 'config.yaml'} names no trained model (model.{' or model.'.join(TRAINED_ROLES)})")


def suite_of_run(run_dir: str | Path) -> SuiteSettings:
    """The suite of the run's ``OODForgetting`` callback with ``lm_eval_tasks``."""
    callbacks = (_config(Path(run_dir)).get("trainer") or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("OODForgetting"):
            args = callback.get("init_args") or {}
            if args.get("lm_eval_tasks") is not None:
                return SuiteSettings(
                    tasks=args["lm_eval_tasks"],
                    include_path=args.get("lm_eval_include_path"),
                    batch_size=int(args.get("lm_eval_batch_size", 8)),
                    allow_code_execution=bool(args.get("lm_eval_allow_code_execution", False)),
                    apply_chat_template=bool(args.get("lm_eval_apply_chat_template", False)),
                )
    raise ValueError(f"forgetting: {run_dir} has no OODForgetting callback with lm_eval_tasks in its config.yaml; give the suite with --suite FILE")


def run_devices(run_dir: str | Path) -> int:
    """The run's ``trainer.devices`` where it is a number (the GPUs of one machine), else 1."""
    devices = (_config(Path(run_dir)).get("trainer") or {}).get("devices", 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    return devices if type(devices) is int and devices > 0 else 1


def metrics(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The callback's two lines: ``ood/<entry>_before`` and ``ood/mean_before``; ``ood/<entry>``,
    ``ood/mean`` and ``ood/mean_delta`` (after - before, points)."""
    first = {f"ood/{name}_before": value for name, value in before.items()}
    first["ood/mean_before"] = sum(before.values()) / len(before)
    last = {f"ood/{name}": value for name, value in after.items()}
    last["ood/mean"] = sum(after.values()) / len(after)
    last["ood/mean_delta"] = last["ood/mean"] - first["ood/mean_before"]
    return first, last


def measure_run(
    run_dir: str | Path,
    settings: SuiteSettings | None = None,
    cache_dir: str | Path | None = None,
    backend: str = "auto",
    dtype: str = "auto",
    devices: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Score the run's starting student (from ``cache_dir`` when measured before) and its ``final.ckpt``,
    append the callback's metric lines to ``metrics.jsonl`` and write ``forgetting.json``; returns that record."""
    from kdlab.models.loading import load_causal_lm, load_tokenizer

    run_dir = Path(run_dir)
    final = run_dir / "checkpoints" / "final.ckpt"
    if not final.is_file():
        raise FileNotFoundError(f"forgetting: {final} does not exist (the run has not finished)")
    settings = settings if settings is not None else suite_of_run(run_dir)
    backend, dtype = choose_backend(backend), choose_dtype(dtype)
    devices = run_devices(run_dir) if devices is None else devices
    if type(devices) is not int or devices < 1:
        raise ValueError(f"forgetting.devices must be an int >= 1, got {devices!r}")
    settings_key = settings.key(backend, dtype)
    result_file = run_dir / RESULT_FILE
    if result_file.is_file() and not force:
        record = json.loads(result_file.read_text(encoding="utf-8"))
        if record.get("settings_key") == settings_key:
            return record
    logged = [name for _, name, _ in metrics_lines(run_dir / METRICS_FILE) if name == "ood/mean"]
    if logged and not result_file.is_file():
        raise ValueError(f"forgetting: {run_dir / METRICS_FILE} already holds ood/mean measured in the training loop (OODForgetting); "
                         "remove the callback from the config to measure forgetting off the loop")
    settings.validate()  # an unknown task fails before any weights are read
    spec, role = start_spec(run_dir)
    tokenizer = load_tokenizer(spec, role)
    step = int(torch.load(final, map_location="cpu", weights_only=True).get("global_step", 0))

    student = load_causal_lm(spec, role).eval()
    weights = weights_digest(student)
    cache = BeforeCache(cache_dir) if cache_dir is not None else None
    before = cache.get(weights, settings_key) if cache is not None else None
    hit = before is not None
    if before is None:
        before = score_model(student, tokenizer, settings, backend, dtype, devices, scratch=run_dir)
        if cache is not None:
            cache.put(weights, settings_key, before, model=spec.path, checkpoint=spec.checkpoint, backend=backend, dtype=dtype,
                      settings=settings.as_mapping(), created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    del student
    trained = load_causal_lm(dataclasses.replace(spec, checkpoint=str(final)), role).eval()
    after = score_model(trained, tokenizer, settings, backend, dtype, devices, scratch=run_dir)
    del trained

    first, last = metrics(before, after)
    with (run_dir / METRICS_FILE).open("a", encoding="utf-8") as file:
        file.write(json.dumps({"step": 0, **first}) + "\n")
        file.write(json.dumps({"step": step, **last}) + "\n")
    record = {
        "before": before, "after": after, "step": step, "before_from_cache": hit, "weights": weights, "settings_key": settings_key,
        "backend": backend, "dtype": dtype, "devices": devices, "settings": settings.as_mapping(),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
    partial = result_file.with_name(result_file.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    partial.replace(result_file)
    return record


def read_suite_file(path: str | Path) -> SuiteSettings:
    """A YAML file of :class:`SuiteSettings`' keys; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--suite: no such file {str(path)!r}")
    try:
        return SuiteSettings.from_mapping(yaml.safe_load(path.read_text(encoding="utf-8")) or {}, f"{path}")
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def command(run_dir: str | Path, suite: dict[str, Any] | None = None, cache_dir: str | None = None, backend: str = "auto",
            dtype: str = "auto", devices: int | None = None) -> list[str]:
    """The ``python -m kdlab.cli forgetting ...`` command line for ``run_dir`` (what a sweep runs or prints)."""
    args = [sys.executable if sys.executable else "python", "-m", "kdlab.cli", "forgetting", "--run", str(run_dir)]
    if suite is not None:
        args += ["--suite_json", json.dumps(suite, sort_keys=True)]
    if cache_dir is not None:
        args += ["--cache_dir", str(cache_dir)]
    args += ["--backend", backend, "--dtype", dtype]
    if devices is not None:
        args += ["--devices", str(devices)]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kdlab forgetting", description=__doc__.split("\n\n", 1)[0] + " " + __doc__.split("\n\n", 1)[1])
    parser.add_argument("--run", required=True, help="a finished run's directory (config.yaml, checkpoints/final.ckpt, metrics.jsonl)")
    parser.add_argument("--suite", help="a YAML file: tasks, include_path, batch_size, allow_code_execution, apply_chat_template "
                                        "(default: the run's OODForgetting lm_eval_* settings)")
    parser.add_argument("--suite_json", help=argparse.SUPPRESS)  # the same as one JSON mapping (what a sweep passes)
    parser.add_argument("--cache_dir", help="where the students' before scores are kept and reused (default: not kept)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="lm-eval back end (auto: vllm where installed with CUDA, else hf)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights' dtype while scoring (auto: bfloat16 on GPU, else float32)")
    parser.add_argument("--devices", type=int, help="data-parallel processes or engines, one GPU each (default: the run's trainer.devices)")
    parser.add_argument("--force", action="store_true", help="score again although forgetting.json holds this suite's scores")
    options = parser.parse_args(argv)
    try:
        settings = read_suite_file(options.suite) if options.suite else None
        if options.suite_json:
            settings = SuiteSettings.from_mapping(json.loads(options.suite_json), "--suite_json")
        record = measure_run(options.run, settings, options.cache_dir, options.backend, options.dtype, options.devices, options.force)
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        parser.exit(2, f"kdlab forgetting: error: {error}\n")
    print(json.dumps({"before": record["before"], "after": record["after"], "before_from_cache": record["before_from_cache"]}))
