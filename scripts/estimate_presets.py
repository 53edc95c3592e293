"""Write ``kdlab estimate``'s figures for every GPU preset into docs/scaling.md, between
``<!-- estimate:begin -->`` and ``<!-- estimate:end -->``; ``--check`` only compares (exit 1 on a difference).

The presets: each ``experiments/paper/scale/*.yaml`` with the base and cell its first line's command names,
on its ``trainer.devices`` GPUs; each single-GPU paper base config (``experiments/paper/*/base-*.yaml``, its own
online ``TeacherRollouts``) on one GPU. A preset's GPU memory is the first ``<N> GB`` its header comment names
(``8 GPUs of 80 GB``, ``e.g. 40 GB``), else 80, read as GiB. A preset built on a paper base config whose grid
measures forgetting off the training loop is estimated with ``--forgetting <that grid>`` (the before pass shared by
the grid's runs, the after pass its own). ``tests/test_estimate.py`` checks the page is this script's output.

    python scripts/estimate_presets.py           # rewrite the section
    python scripts/estimate_presets.py --check   # exit 1 if the page differs
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scaling.md"
BEGIN, END = "<!-- estimate:begin -->", "<!-- estimate:end -->"


def header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return lines


def gpu_memory_gib(path: Path) -> float:
    """The first ``<N> GB`` of the preset's header comment, else 80."""
    match = re.search(r"(\d+(?:\.\d+)?) GB\b", " ".join(header(path)[1:]))
    return float(match.group(1)) if match else 80.0


def forgetting_sweep(args: list[str]) -> list[str]:
    """``--forgetting <grid>`` for a preset built on a paper base config (``<task>/base-<pair>.yaml``) whose main grid
    (``<task>/grid-<pair>.yaml``) measures forgetting off the training loop, else nothing."""
    for arg in args:
        match = re.fullmatch(r"(experiments/paper/\w+)/base-([\w.]+)\.yaml", arg)
        grid = ROOT / f"{match.group(1)}/grid-{match.group(2)}.yaml" if match else None
        if grid is not None and grid.is_file() and re.search(r"^forgetting:", grid.read_text(encoding="utf-8"), re.MULTILINE):
            return ["--forgetting", str(grid.relative_to(ROOT))]
    return []


def presets() -> list[tuple[str, list[str], float]]:
    """``(name, kdlab estimate arguments, GPU memory in GiB)`` of every preset, in a fixed order; a preset whose
    study grid measures forgetting off the loop is estimated with that grid (:func:`forgetting_sweep`)."""
    found = []
    for path in sorted((ROOT / "experiments" / "paper" / "scale").glob("*.yaml")):
        command = header(path)[0].split()
        if command[:2] != ["kdlab", "fit"]:
            raise SystemExit(f"{path}: its first line is not the kdlab fit command it overlays")
        found.append((str(path.relative_to(ROOT)), [*command[2:], *forgetting_sweep(command[2:])], gpu_memory_gib(path)))
    for pattern in ("*/base-*.yaml", "teachers/*.yaml", "rlvr/countdown4-*.yaml"):
        for path in sorted((ROOT / "experiments" / "paper").glob(pattern)):
            name = str(path.relative_to(ROOT))
            found.append((name, ["--config", name, *forgetting_sweep(["--config", name])], gpu_memory_gib(path)))
    return found


TARGET = ["--config", "experiments/paper/countdown3/base-qwen1.5b_from_qwen7b.yaml",
          "--config", "experiments/paper/countdown3/onpd_fkl-qwen1.5b_from_qwen7b.yaml",
          "--forgetting", "experiments/paper/countdown3/grid-qwen1.5b_from_qwen7b.yaml"]
"""Issue #45's target: the 150-step on-policy Qwen2.5-1.5B-from-7B Countdown run on one H200, forgetting measured
off the training loop as its grid does."""


def section() -> str:
    """The generated Markdown: a summary table, then each preset's terms and arithmetic."""
    import os

    from kdlab.cli.estimate import render, run_estimate
    from kdlab.study.estimate import GiB

    os.chdir(ROOT)  # the commands' paths are relative to the repository
    results = [(name, args, run_estimate([*args, "--gpu_memory_gib", f"{memory:g}"])) for name, args, memory in presets()]
    lines = [BEGIN, "", "| preset | GPUs | strategy | peak phase | total GiB per GPU | largest term | fits | step s (H200) | run h (H200) | of which evaluations h |",
             "| --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for name, _, result in results:
        setup, time = result.setup, result.time
        lines.append(f"| `{name}` | {setup.world} x {setup.gpu_memory / GiB:g} GiB | {setup.strategy} | {result.peak_phase} | "
                     f"{result.total / GiB:.2f} | {result.largest.key} | {'yes' if result.fits else '**no**'} | {time.step.seconds:.2f} | "
                     f"{time.seconds / 3600:.2f} | {sum(time.evaluations.values()) / 3600:.2f} |")
    from kdlab.study import step_time

    lines += ["", "The time model's constants (`kdlab.study.step_time`; `--gpu_kind` picks the GPU):", "",
              "| GPU | constant | value | source |", "| --- | --- | ---: | --- |"]
    for kind, hardware in step_time.HARDWARE.items():
        for key, source in hardware.sources.items():
            lines.append(f"| {kind} | `{key}` | {getattr(hardware, key):g} | {source} |")
    counts = [name for name in dir(step_time) if name.startswith("OPS_")]
    lines += ["", "Op counts (aten ops counted on Qwen2 by `tests/test_step_time.py`): "
              + ", ".join(f"`{name}` {getattr(step_time, name)}" for name in counts) + "."]
    from kdlab.cli.estimate import fit_config, forgetting_off_loop, split_arguments
    from kdlab.study.forgetting_time import VLLM_MAX_NUM_SEQS, VLLM_SOURCE
    from kdlab.study.run_time import lm_eval_seconds

    estimated = run_estimate(TARGET)
    target, hardware = estimated.time, step_time.HARDWARE["H200"]
    off = forgetting_off_loop(estimated.setup, fit_config(split_arguments(TARGET)[0]), TARGET[-1], hardware)
    ood = off.before_share + off.after
    in_loop = 2 * lm_eval_seconds(estimated.setup, "paper", 8, hardware)
    lines += ["", f"Forgetting off the training loop (`--forgetting SWEEP.yaml`, `kdlab.study.forgetting_time`): lm-eval's vLLM back end "
              f"in bf16 runs at most `VLLM_MAX_NUM_SEQS` = {VLLM_MAX_NUM_SEQS} requests together ({VLLM_SOURCE}), each decode at the "
              "`vllm` back end's rate above; the before pass is shared by the grid's runs of one student."]
    lines += ["", f"The target run (`kdlab estimate {' '.join(TARGET)}`, one H200): **{target.seconds / 3600:.2f} h**, of which "
              f"{target.training_seconds / 3600:.2f} h training ({target.steps} steps of {target.step.seconds:.2f} s), "
              f"{ood / 3600:.2f} h the OOD forgetting suite off the loop (after {off.after / 3600:.2f} h; before {off.before / 3600:.2f} h "
              f"once for the grid's {off.runs_per_student} runs of this student, {off.before_share / 3600:.2f} h each), "
              f"{(sum(target.evaluations.values()) - ood) / 3600:.2f} h the other evaluations; "
              f"without the OOD suite {(target.seconds - ood) / 3600:.2f} h; with the before pass unshared "
              f"{(target.seconds + off.before - off.before_share) / 3600:.2f} h. "
              f"The same suite in the loop (lm-eval's Hugging Face back end, the fp32 student, batch 8, before and after) would take "
              f"{in_loop / 3600:.2f} h."]
    for name, args, result in results:
        lines += ["", render(result, title=f"`{name}`").replace("### ", "#### ", 1),
                  "", f"`kdlab estimate {' '.join(args)}{'' if result.setup.gpu_memory == 80 * GiB else f' --gpu_memory_gib {result.setup.gpu_memory / GiB:g}'}`"]
    return "\n".join([*lines, "", END])


def main(argv: list[str]) -> int:
    text = PAGE.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        print(f"{PAGE}: no {BEGIN} ... {END} section", file=sys.stderr)
        return 1
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    new = before + section() + after
    if "--check" in argv:
        if new != text:
            print(f"{PAGE.relative_to(ROOT)} differs from python scripts/estimate_presets.py's output", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
