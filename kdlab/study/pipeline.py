"""``kdlab pipeline --config pipeline.yaml``: distillation runs, then an RLVR stage from each of them,
with pass@k, forgetting and update sparsity tracked across both stages.

A pipeline file is plain YAML::

    output: runs/pipeline-tiny          # distillation runs in <output>/<distill_dir>/<name>/,
                                        # RLVR runs in <output>/rlvr/<distill name>/<name>/
    distill:                            # a sweep (see kdlab.study.sweep) without ``output``
      base: experiments/tiny/quickstart.yaml
      grid: {model.rollout: [...], model.objective: [...]}
    rlvr:                               # a sweep run once per finished distillation run
      base: experiments/tiny/rlvr.yaml
      overrides: {trainer.max_steps: 300}
      mode: processes                   # with max_parallel N: N chains at a time (each chain's runs in turn)
      max_parallel: 2
    checkpoint: final.ckpt              # the file in each distillation run's checkpoints/ RLVR starts from
    policy_key: model.policy.checkpoint # the RLVR config key that receives that path
    distill_dir: distill                # the folder under <output> of the distillation runs (e.g. hard)
    rlvr_seeds: [42, 43]                # RLVR only from the distillation runs of these seeds (default: all)
    rlvr_where: {model.lr: 1.0e-4}      # ... and only from those whose grid values are these (default: all)

Both stages keep the sweep's rules: every distillation run's and the first chain's RLVR runs' fit configurations are
parsed before anything runs (a bad key or value: ``kdlab pipeline: error: run distill/<name>: <key>: <cause>``); finished runs (``DONE``) are skipped, interrupted ones resume from
their newest checkpoint (``on_exception.ckpt`` or ``last.ckpt``), a failed run is recorded and the rest go on (exit status 1 at the end). An
RLVR chain starts only from a distillation run that finished. A finished distillation run without the
checkpoint RLVR starts from (restored from an archive, which keeps no checkpoints: scripts/archive_runs.py)
whose RLVR stage has not finished is run again first, from scratch, to write it.

A stage with ``mode: print`` runs nothing and writes one command per run for a cluster's job arrays, each
``python -m kdlab.cli pipeline --config <file> --run <stage>/<name>`` (which runs that one run with the sweep's skip
and resume rules): the distillation stage's lines in ``<output>/<distill_dir>/commands.sh``, every chain's RLVR
lines in ``<output>/rlvr/commands.sh`` (``rlvr/<distilled>/<name>``; chains in the grid's order, finished or
not, so line N stays run N). An RLVR line whose distillation run has not written its checkpoint refuses to start
(exit status 1, naming the checkpoint): submit the RLVR array after the distillation one.

``<output>/pipeline.md`` and ``pipeline.csv`` then hold one row per chain: the distilled run's and the
RLVR run's last ``val/accuracy`` and ``val/pass@k``, the forgetting of each stage relative to the
original student (``ood/mean`` after the stage minus the distillation run's ``ood/mean_before``, in
points), ``sparsity/<tau>`` of each stage (the RLVR config should measure it against the original
student: ``UpdateSparsity(reference=...)``), the last ``rlvr/reward_mean`` and the number of
reward-collapse events.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kdlab.study import launch
from kdlab.study.grid import FILE_KEYS as SWEEP_KEYS
from kdlab.study.grid import Sweep, expand, read_mapping_file
from kdlab.study.fit_configs import fit_configs_or_exit
from kdlab.study.sweep import RunFailed, UnknownRun, run_one, run_sweep, write_commands
from kdlab.study.tables import counted

PIPELINE_KEYS = ("output", "distill", "rlvr", "checkpoint", "policy_key", "distill_dir", "rlvr_seeds", "rlvr_where")
STAGE_KEYS = tuple(key for key in SWEEP_KEYS if key != "output")


@dataclass
class Pipeline:
    output: str
    distill: Sweep
    rlvr: dict[str, Any]
    checkpoint: str = "final.ckpt"
    policy_key: str = "model.policy.checkpoint"
    distill_dir: str = "distill"
    rlvr_seeds: list[int] | None = None
    rlvr_where: dict[str, Any] | None = None

    def chains_from(self, run: Any) -> bool:
        """Whether an RLVR stage starts from distillation run ``run`` (a :class:`~kdlab.study.grid.Run`): its seed
        is one of ``rlvr_seeds`` and its grid values include ``rlvr_where``'s (each default: every run)."""
        if self.rlvr_seeds is not None and run.seed not in self.rlvr_seeds:
            return False
        return all(run.settings.get(key) == value for key, value in (self.rlvr_where or {}).items())

    def rlvr_sweep(self, distilled: str) -> Sweep:
        """The RLVR sweep that starts from distillation run ``distilled``."""
        overrides = dict(self.rlvr.get("overrides") or {})
        overrides[self.policy_key] = str(Path(self.output, self.distill_dir, distilled, "checkpoints", self.checkpoint))
        return Sweep(**{**self.rlvr, "overrides": overrides, "output": str(Path(self.output, "rlvr", distilled))})


def _stage(path: Path, data: dict[str, Any], key: str) -> dict[str, Any]:
    stage = data.get(key)
    if not isinstance(stage, dict):
        raise ValueError(f"{path}: {key!r} must be a sweep mapping with the keys {', '.join(STAGE_KEYS)}")
    unknown = [k for k in stage if k not in STAGE_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key {key}.{unknown[0]} (a stage has {', '.join(STAGE_KEYS)})")
    if "base" not in stage:
        raise ValueError(f"{path}: the key {key}.base is missing")
    return stage


def load_pipeline(path: str | Path) -> Pipeline:
    """Read and check a pipeline file; a ``ValueError`` names the file and the offending key."""
    path = Path(path)
    data = read_mapping_file(path, "pipeline", PIPELINE_KEYS)
    if not isinstance(data.get("output"), str) or not data["output"]:
        raise ValueError(f"{path}: 'output' must be a directory path")
    distill, rlvr = _stage(path, data, "distill"), _stage(path, data, "rlvr")
    policy_key = data.get("policy_key", "model.policy.checkpoint")
    distill_dir = data.get("distill_dir", "distill")
    if not isinstance(distill_dir, str) or not distill_dir or Path(distill_dir).name != distill_dir or distill_dir in (".", "..", "rlvr"):
        raise ValueError(f"{path}: 'distill_dir' must be one folder name other than 'rlvr', got {distill_dir!r}")
    if policy_key in (rlvr.get("grid") or {}) or policy_key in (rlvr.get("overrides") or {}):
        raise ValueError(f"{path}: rlvr sets {policy_key!r}; the pipeline sets it to each distilled checkpoint")
    rlvr_seeds = data.get("rlvr_seeds")
    if rlvr_seeds is not None and (not isinstance(rlvr_seeds, list) or not all(type(seed) is int for seed in rlvr_seeds)):
        raise ValueError(f"{path}: 'rlvr_seeds' must be a list of integer seeds, got {rlvr_seeds!r}")
    rlvr_where = data.get("rlvr_where")
    grid = distill.get("grid") or {}
    if rlvr_where is not None:
        if not isinstance(rlvr_where, dict) or not rlvr_where:
            raise ValueError(f"{path}: 'rlvr_where' must be a mapping of distill grid keys to one of their values, got {rlvr_where!r}")
        for key, value in rlvr_where.items():
            if key not in grid:
                raise ValueError(f"{path}: rlvr_where.{key} is not a key of distill.grid ({', '.join(grid) or 'none'})")
            if value not in grid[key]:
                raise ValueError(f"{path}: rlvr_where.{key}={value!r} is not one of distill.grid.{key}'s values {grid[key]!r}")
    try:
        pipeline = Pipeline(
            output=data["output"],
            distill=Sweep(**distill, output=str(Path(data["output"], distill_dir))),
            rlvr=rlvr,
            checkpoint=data.get("checkpoint", "final.ckpt"),
            policy_key=policy_key,
            distill_dir=distill_dir,
            rlvr_seeds=rlvr_seeds,
            rlvr_where=rlvr_where,
        )
        pipeline.rlvr_sweep("check")  # the RLVR stage's settings are checked before anything runs
        unknown = sorted(set(rlvr_seeds or ()) - {run.seed for run in expand(pipeline.distill)})
        if unknown:
            raise ValueError(f"'rlvr_seeds' {unknown} are not seeds of the distillation stage")
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    return pipeline


# ---- tracking across stages ---------------------------------------------------------------------
def chain_row(distill_dir: Path, rlvr_dir: Path) -> dict[str, Any]:
    """One chain's numbers (see the module docstring); a missing metric is left empty."""
    from kdlab.study.runs import read_metrics

    first, second = read_metrics(distill_dir), read_metrics(rlvr_dir)
    last = lambda series, name: series[name][-1][1] if series.get(name) else None  # noqa: E731
    original = last(first, "ood/mean_before")
    row: dict[str, Any] = {"distill": distill_dir.name, "rlvr": rlvr_dir.name}
    for stage, series in (("distill", first), ("rlvr", second)):
        for name in sorted(n for n in series if n.startswith(("val/accuracy", "val/pass@", "sparsity/")) and n.count("/") <= 1):
            row[f"{stage} {name}"] = last(series, name)
        mean = last(series, "ood/mean")
        row[f"{stage} ood/delta_from_original"] = None if mean is None or original is None else mean - original
    row["rlvr reward_mean"] = last(second, "rlvr/reward_mean")
    row["reward collapses"] = len(second.get("events/reward_collapse", []))
    return row


def write_tracking(pipeline: Pipeline, chains: list[tuple[Path, Path]]) -> Path:
    """``pipeline.md`` and ``pipeline.csv`` under the output directory; returns the markdown path."""
    from kdlab.study.tables import markdown_table, write_csv

    rows = [chain_row(d, r) for d, r in chains]
    header = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(key)) for key in header] for row in rows]
    output = Path(pipeline.output)
    output.mkdir(parents=True, exist_ok=True)
    write_csv(output / "pipeline.csv", header, [[row.get(key) for key in header] for row in rows])
    text = "# Distillation -> RLVR\n\n" + (markdown_table(header, cells) if rows else "No chain has finished yet.") + "\n"
    (output / "pipeline.md").write_text(text, encoding="utf-8")
    return output / "pipeline.md"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- running ----------------------------------------------------------------------------------
def without_checkpoint(pipeline: Pipeline) -> list[str]:
    """Finished distillation runs (``DONE``) that lack the checkpoint RLVR starts from, and whose RLVR stage
    has not finished: the runs :func:`run_pipeline` runs again."""
    missing = []
    for run in filter(pipeline.chains_from, expand(pipeline.distill)):
        folder = Path(pipeline.distill.output, run.name)
        if (folder / "DONE").is_file() and not (folder / "checkpoints" / pipeline.checkpoint).is_file():
            rlvr = pipeline.rlvr_sweep(run.name)
            if not all((Path(rlvr.output, step.name) / "DONE").is_file() for step in expand(rlvr)):
                missing.append(run.name)
    return missing


def stage_command(pipeline_file: str, stage: str) -> Callable[[str], list[str]]:
    """Print mode's command for one run of a stage: ``kdlab pipeline --config <file> --run <stage>/<name>``
    (``stage``: ``distill`` or ``rlvr/<distilled run>``; :func:`run_one_of` runs it)."""
    return lambda name: ["python", "-m", "kdlab.cli", "pipeline", "--config", pipeline_file, "--run", f"{stage}/{name}"]


def run_pipeline(pipeline: Pipeline, pipeline_file: str) -> list[dict[str, Any]]:
    """Run both stages (or print their commands: a stage's ``mode: print``); returns every run record
    (distillation first), each with its ``stage``."""
    launch.refuse_several("kdlab pipeline")
    for name in without_checkpoint(pipeline):
        print(f"[pipeline] {name}: finished without checkpoints/{pipeline.checkpoint} (an archived run?); running it again to write it", file=sys.stderr)
        Path(pipeline.distill.output, name, "DONE").unlink()
    distilled_records = [dict(r, stage="distill") for r in run_sweep(pipeline.distill, pipeline_file, stage_command(pipeline_file, "distill"))]
    records, chains = list(distilled_records), []
    finished = []
    seeds = {run.name: run for run in expand(pipeline.distill)}
    settings = pipeline.rlvr_sweep("check")
    for record in distilled_records:
        if not pipeline.chains_from(seeds[record["name"]]):
            continue
        if record["status"] in ("done", "skipped") or settings.mode == "print":  # print mode: every chain's lines
            finished.append(record["name"])
        else:
            print(f"[pipeline] {record['name']}: distillation did not finish; no RLVR stage from it", file=sys.stderr)
    sweeps = [pipeline.rlvr_sweep(distilled) for distilled in finished]
    at_once = settings.max_parallel if settings.mode == "processes" else 1
    if settings.mode == "print":
        stages = _print_rlvr(pipeline, pipeline_file, finished, sweeps)
    elif at_once > 1:  # chains side by side, each chain's runs one at a time: max_parallel processes in all
        from concurrent.futures import ThreadPoolExecutor

        for sweep in sweeps:
            sweep.max_parallel = 1
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            stages = list(pool.map(lambda sweep: run_sweep(sweep, pipeline_file), sweeps))
    else:
        stages = [run_sweep(sweep, pipeline_file) for sweep in sweeps]
    for distilled, rlvr, stage in zip(finished, sweeps, stages):
        records += [dict(r, stage="rlvr", distilled=distilled) for r in stage]
        chains += [(Path(pipeline.distill.output, distilled), Path(rlvr.output, r["name"])) for r in stage if r["status"] in ("done", "skipped")]
    path = write_tracking(pipeline, chains)
    print(f"[pipeline] {counted(len(chains), 'chain')} tracked in {path}")
    return records


def _print_rlvr(pipeline: Pipeline, pipeline_file: str, distilled: list[str], sweeps: list[Sweep]) -> list[list[dict[str, Any]]]:
    """The RLVR stage in print mode: each chain's ``commands.sh`` and ``sweep.json``, and ``<output>/rlvr/commands.sh``
    with every chain's lines (chains in the distillation grid's order, finished or not, so line N stays run N)."""
    stages, every, pending = [], [], []
    for name, sweep in zip(distilled, sweeps):
        records, lines, waiting = write_commands(sweep, pipeline_file, stage_command(pipeline_file, f"rlvr/{name}"))
        stages.append(records)
        every += lines
        pending += waiting
    target = Path(pipeline.output, "rlvr", "commands.sh")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(line + "\n" for line in every), encoding="utf-8")
    for line in pending:
        print(line)
    print(
        f"[pipeline] {counted(len(every), 'RLVR command')} in {target}, one per run of every chain (a SLURM array --array=1-{len(every)} "
        "submitted after the distillation runs', e.g. with --dependency=afterany:<their job id>); a line whose distillation "
        "run has not finished refuses to start; run them from this directory",
        file=sys.stderr,
    )
    return stages


def run_one_of(pipeline: Pipeline, pipeline_file: str, target: str) -> str:
    """One run of the pipeline in this process, by print mode's name for it: ``distill/<name>`` or
    ``rlvr/<distilled>/<name>``, with the sweep's skip and resume rules. A distillation run finished without the
    checkpoint RLVR starts from runs again (as in :func:`run_pipeline`); an RLVR run whose distillation run has not
    written that checkpoint raises :class:`~kdlab.study.sweep.RunFailed` before anything loads. Returns ``skipped``,
    ``done`` or ``failed``; :class:`~kdlab.study.sweep.UnknownRun` names a target that is no run of the pipeline."""
    stage, _, rest = target.partition("/")
    if stage == "distill" and rest and "/" not in rest:
        if rest in without_checkpoint(pipeline):
            print(f"[pipeline] {rest}: finished without checkpoints/{pipeline.checkpoint} (an archived run?); running it again to write it", file=sys.stderr)
            Path(pipeline.distill.output, rest, "DONE").unlink(missing_ok=True)  # every rank of a launch may get here
        return run_one(pipeline.distill, pipeline_file, rest)
    distilled, _, name = rest.partition("/")
    chains = {run.name for run in expand(pipeline.distill) if pipeline.chains_from(run)}
    if stage != "rlvr" or distilled not in chains or not name or "/" in name:
        raise UnknownRun(
            f"--run {target!r} is not a run of {pipeline_file}: distill/<name> or rlvr/<distilled>/<name>, with <distilled> "
            f"one of {', '.join(sorted(chains)) or 'none'} (see {pipeline.output}/rlvr/commands.sh for every line)"
        )
    rlvr = pipeline.rlvr_sweep(distilled)
    checkpoint = Path(pipeline.distill.output, distilled, "checkpoints", pipeline.checkpoint)
    done = Path(pipeline.distill.output, distilled, "DONE")
    if not (done.is_file() and checkpoint.is_file()) and not Path(rlvr.output, name, "DONE").is_file():
        raise RunFailed(f"{target} starts from {checkpoint}, and its distillation run has not finished writing it "
                        f"({done} {'is there' if done.is_file() else 'is missing'}); run distill/{distilled} first")
    return run_one(rlvr, pipeline_file, name)


def fit_checks(pipeline: Pipeline, target: str | None = None) -> list[tuple[Sweep, list[Any], str]]:
    """What :func:`~kdlab.study.fit_configs.fit_configs_or_exit` parses before anything runs: every distillation run and the
    RLVR runs of the first chain (the chains differ only in the checkpoint they start from), or only ``target``
    (``--run``'s ``distill/<name>`` or ``rlvr/<distilled>/<name>``; an unknown one is left to :func:`run_one_of`)."""
    chains = [run.name for run in expand(pipeline.distill) if pipeline.chains_from(run)]
    if target is None:
        first = [(pipeline.rlvr_sweep(chains[0]), f"rlvr/{chains[0]}/")] if chains else []
        return [(pipeline.distill, expand(pipeline.distill), "distill/")] + [(sweep, expand(sweep), where) for sweep, where in first]
    stage, _, rest = target.partition("/")
    distilled, _, name = rest.partition("/")
    if stage == "distill":
        return [(pipeline.distill, [run for run in expand(pipeline.distill) if run.name == rest], "distill/")]
    if stage == "rlvr" and distilled in chains:
        sweep = pipeline.rlvr_sweep(distilled)
        return [(sweep, [run for run in expand(sweep) if run.name == name], f"rlvr/{distilled}/")]
    return []


def main(argv: list[str] | None = None) -> None:
    """``kdlab pipeline --config FILE``; exits 1 if a run failed."""
    parser = argparse.ArgumentParser(prog="kdlab pipeline", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)  # no prefixes of options (issue #43)
    parser.add_argument("--config", required=True, help="the pipeline file (YAML)")
    parser.add_argument("--run", metavar="STAGE/NAME", help="run only this run, in this process (what print mode's lines do): distill/<name> or rlvr/<distilled>/<name>")
    options = parser.parse_args(argv)
    try:
        pipeline = load_pipeline(options.config)
    except ValueError as error:
        parser.error(str(error))
    fit_configs_or_exit(fit_checks(pipeline, options.run), "kdlab pipeline")
    if options.run is not None:
        try:
            status = run_one_of(pipeline, options.config, options.run)
        except UnknownRun as error:
            parser.error(str(error))
        except RunFailed as error:
            print(f"[pipeline] {error}", file=sys.stderr)
            raise SystemExit(1) from None
        except KeyboardInterrupt:
            raise SystemExit(130) from None
        if status == "failed":
            raise SystemExit(1)
        return
    try:
        records = run_pipeline(pipeline, options.config)
    except ValueError as error:  # settings found wrong before any run started (a launch of several processes)
        parser.error(str(error))
    except KeyboardInterrupt:
        print("[pipeline] interrupted; run the same command again to continue", file=sys.stderr)
        raise SystemExit(130) from None
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        lines = "\n".join(f"  {r['stage']} {r['name']}: {r.get('error')}" for r in failed)
        print(f"[pipeline] {counted(len(failed), 'run')} failed:\n{lines}", file=sys.stderr)
        raise SystemExit(1)
