"""``kdlab estimate --config A.yaml [--config B.yaml ...] [--gpus N] [--gpu_memory_gib M] [--json]``: before
any GPU hour is spent, the per-GPU memory of a DistillModule, SFTModule or GRPOModule fit, term by term, the
work and seconds of one optimiser step and the whole run's wall time on ``--gpu_kind`` (:mod:`kdlab.study.estimate`,
:mod:`kdlab.study.step_time` and :mod:`kdlab.study.run_time` document the arithmetic).

It takes exactly what ``kdlab fit`` takes (the same LightningCLI parser: configs, overlays, ``--model.x=...``),
reads the models' configs only (no weights), and exits 0 whether or not the run fits; ``--gpus`` (default
``trainer.devices x trainer.num_nodes``) and ``--gpu_memory_gib`` (default 80) name the machine. ``--forgetting
SWEEP.yaml`` adds the lm-eval suite the sweep's ``forgetting:`` key measures off the training loop
(:mod:`kdlab.study.forgetting_time`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kdlab.cli.config_errors import ConfigError
from kdlab.cli.lightning import parse_fit_config
from kdlab.study.estimate import Estimate, GiB, estimate, setup_from_config
from kdlab.study.run_time import RunTime, run_time
from kdlab.study.step_time import HARDWARE

USAGE = """usage: kdlab estimate --config X.yaml [--config Y.yaml ...] [fit options] [--gpus N] [--gpu_memory_gib M] [--gpu_kind H200|H100]
                      [--forgetting SWEEP.yaml] [--json]

Per-GPU memory (weights, gradients, AdamW, teacher, activations, logits/fused workspace, KV caches, vLLM),
the work and time of one optimiser step and the whole run's wall time of the fit (DistillModule, SFTModule,
GRPOModule) `kdlab fit` would run with the same arguments.
No weights are read. --gpus: GPUs in all (default trainer.devices x trainer.num_nodes); --gpu_memory_gib:
memory of one GPU (default 80); --gpu_kind: the GPU the time model assumes (default H200: one optimiser step's
parts and the whole run's wall time with every evaluation, kdlab.study.step_time); --forgetting: a sweep file whose
`forgetting:` key measures the lm-eval suite off the training loop: its before pass (shared by the grid's runs
of one student) and after pass are added (kdlab.study.forgetting_time); --json: machine-readable output.
"""


def fit_config(argv: list[str]) -> dict[str, Any]:
    """The configuration ``kdlab fit <argv>`` would run, parsed by its own parser, before any class is
    instantiated (no model is built, no weights read), as a plain dict (:func:`~kdlab.cli.lightning.parse_fit_config`)."""
    return parse_fit_config(argv, "kdlab fit (or estimate)")


def split_arguments(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` without ``--gpus``, ``--gpu_memory_gib``, ``--gpu_kind``, ``--forgetting`` and ``--json`` (each ``--x V`` or ``--x=V``), and their values."""
    rest, options, index = [], {"gpus": None, "gpu_memory_gib": None, "json": False, "gpu_kind": "H200", "forgetting": None}, 0
    while index < len(argv):
        arg = argv[index]
        name, _, value = arg.partition("=")
        if name == "--json":
            options["json"] = True
        elif name == "--gpu_kind":
            if not value:
                if index + 1 >= len(argv):
                    raise ConfigError(f"{name}: needs a value")
                index, value = index + 1, argv[index + 1]
            if value not in HARDWARE:
                raise ConfigError(f"--gpu_kind: one of {sorted(HARDWARE)}, got {value!r}")
            options["gpu_kind"] = value
        elif name == "--forgetting":
            if not value:
                if index + 1 >= len(argv):
                    raise ConfigError(f"{name}: needs a sweep file")
                index, value = index + 1, argv[index + 1]
            options["forgetting"] = value
        elif name in ("--gpus", "--gpu_memory_gib"):
            if not value:
                if index + 1 >= len(argv):
                    raise ConfigError(f"{name}: needs a value")
                index, value = index + 1, argv[index + 1]
            try:
                number = int(value) if name == "--gpus" else float(value)
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {value!r}") from None
            if not number > 0:
                raise ConfigError(f"{name}: must be > 0, got {value}")
            options[name[2:]] = number
        else:
            rest.append(arg)
        index += 1
    return rest, options


def run_estimate(argv: list[str]) -> Estimate:
    """The estimate for ``kdlab estimate <argv>`` (without printing it)."""
    rest, options = split_arguments(argv)
    config = fit_config(rest)
    try:
        setup = setup_from_config(config, options["gpus"], options["gpu_memory_gib"])
        result = estimate(setup)
        if int((config.get("trainer") or {}).get("max_steps") or 0) > 0:
            result.time = run_time(setup, result.work, config, HARDWARE[options["gpu_kind"]])
            if options["forgetting"]:
                result.time.evaluations.update(forgetting_off_loop(setup, config, options["forgetting"], HARDWARE[options["gpu_kind"]]).evaluations())
    except ValueError as error:
        raise ConfigError(str(error)) from error
    return result


def forgetting_off_loop(setup: Any, config: dict[str, Any], path: str, hardware: Any) -> Any:
    """The off-loop suite of the sweep file ``path`` (its ``forgetting`` key, its grid and seeds) for the fit ``config``,
    which must not also measure it in the loop (:mod:`kdlab.study.forgetting_time`)."""
    from kdlab.study.forgetting_time import off_loop
    from kdlab.study.grid import load_sweep
    from kdlab.study.setups import name_of

    sweep = load_sweep(path)
    if sweep.forgetting is None:
        raise ValueError(f"--forgetting {path}: the sweep file has no forgetting key")
    for index, callback in enumerate((config.get("trainer") or {}).get("callbacks") or []):
        name, args = name_of(callback)
        if name == "OODForgetting" and args.get("lm_eval_tasks") is not None:
            raise ValueError(f"--forgetting {path}: trainer.callbacks[{index}] (OODForgetting with lm_eval_tasks) also measures forgetting "
                             "in the training loop: remove that callback, or the option")
    return off_loop(setup, sweep.forgetting, sweep.grid, sweep.seeds, hardware)


def render(result: Estimate, title: str = "") -> str:
    """The Markdown report: every term in GiB per GPU with its arithmetic, the total (persistent + the largest
    phase + reserved) against the GPU's memory, the largest term, and the work of one optimiser step."""
    setup, work = result.setup, result.work
    sharded = f" over {setup.shard}" if setup.strategy.startswith("fsdp") else ""
    lines = [f"### {title}", ""] if title else []
    lines += [f"Per GPU: {setup.world} GPU(s) of {setup.gpu_memory / GiB:g} GiB, strategy {setup.strategy}{sharded}, "
              f"{'16-bit autocast' if setup.mixed else 'no autocast'}; student {setup.student.source}, "
              f"{setup.student.params / 1e9:.3f}B params in {setup.student_dtype}; "
              + (f"teacher {setup.teacher.source}, {setup.teacher.params / 1e9:.3f}B params in {setup.teacher_dtype}." if setup.teacher else "no teacher in memory."),
              *setup.notes, "", "| term | phase | GiB | arithmetic |", "| --- | --- | ---: | --- |"]
    lines += [f"| {term.key} | {term.phase} | {term.bytes / GiB:.2f} | {term.formula} |" for term in result.terms]
    peak, largest = result.peak_phase, result.largest
    reserved = f" + {result.phase('reserved') / GiB:.2f} reserved" if result.phase("reserved") else ""
    lines += ["", f"Total: {result.phase('persistent') / GiB:.2f} persistent + {result.phase(peak) / GiB:.2f} {peak} (the largest phase){reserved} "
              f"= **{result.total / GiB:.2f} GiB** of {setup.gpu_memory / GiB:g} GiB: {'fits' if result.fits else 'DOES NOT FIT'}. "
              f"Largest term: {largest.key} ({largest.bytes / GiB:.2f} GiB).", "",
              f"Work per optimiser step and rank: {work['prompts']} prompts, {work['decodes']} decode(s) of {work['decode_forwards']} forwards in all, "
              f"{work['decoded_tokens']} decoded tokens, {work['trained_tokens']} trained tokens, {work['flops'] / 1e12:.1f} TFLOP "
              f"({work['flops'] * setup.world / 1e12:.1f} TFLOP over {setup.world} rank(s))."]
    if result.time is not None:
        lines += ["", *render_time(result.time)]
    return "\n".join(lines)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def render_time(time: RunTime) -> list[str]:
    """The time model's parts (:mod:`kdlab.study.step_time`, :mod:`kdlab.study.run_time`) on one hardware kind."""
    step, kind = time.step, time.step.hardware.name
    lines = [f"Time on {kind} (kdlab.study.step_time's constants; decodes at their caps): one optimiser step {step.seconds:.2f} s = "
             + " + ".join(f"{name} {seconds:.2f} s" for name, seconds in step.parts.items()) + ".",
             f"Whole run: {time.steps} steps x {step.seconds:.2f} s = {hours(time.training_seconds)}"
             + "".join(f" + {name} {hours(seconds)}" for name, seconds in time.evaluations.items())
             + f" = **{hours(time.seconds)}** of wall time."]
    return lines


def as_json(result: Estimate) -> dict[str, Any]:
    from kdlab.study.estimate import PHASES

    return {
        "gpus": result.setup.world, "gpu_memory_gib": result.setup.gpu_memory / GiB, "strategy": result.setup.strategy,
        "terms": [{"term": t.key, "phase": t.phase, "gib": t.bytes / GiB, "arithmetic": t.formula} for t in result.terms],
        "phases_gib": {name: result.phase(name) / GiB for name in PHASES}, "peak_phase": result.peak_phase,
        "total_gib": result.total / GiB, "fits": result.fits, "largest_term": result.largest.key, "work": result.work,
        "notes": result.setup.notes,
        **({"time": {"gpu_kind": result.time.step.hardware.name, "step_seconds": result.time.step.seconds, "step_parts": result.time.step.parts,
                     "steps": result.time.steps, "evaluations_seconds": result.time.evaluations, "run_seconds": result.time.seconds}}
           if result.time is not None else {}),
    }


def main(argv: list[str]) -> Estimate | None:
    """``kdlab estimate``: print the report (``--json``: one JSON object); exit status 0 whether or not it fits."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return None
    result = run_estimate(argv)
    print(json.dumps(as_json(result), indent=1) if split_arguments(argv)[1]["json"] else render(result))
    sys.stdout.flush()
    return result
