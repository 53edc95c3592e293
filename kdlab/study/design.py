"""A study's design and runs: the parts a study may have and the command that fills each (:data:`PART_COMMANDS`,
:class:`StudyDesign`), its runs by part and its configurations (:class:`Study`), and what testing one of the paper's
findings on them yields (:class:`Verdict`). The findings themselves: :mod:`kdlab.study.findings`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kdlab.study.groups import Group, group_runs, lr_levels
from kdlab.study.labels import Claim
from kdlab.study.runs import RunResult

PART_COMMANDS = {  # each part's folder and the command of experiments/tiny/study.sh that fills it
    "distill": "kdlab sweep --config experiments/tiny/grid_5x.yaml",
    "rlvr": "kdlab pipeline --config experiments/tiny/rlvr_harder_pipeline.yaml",
    "bf16": "kdlab sweep --config experiments/tiny/bf16_grid_5x.yaml",
    "spectrum": "kdlab sweep --config experiments/tiny/spectrum_sweep_5x.yaml",
    "spectrum_high": "kdlab sweep --config experiments/tiny/spectrum_high_5x.yaml",
    "style": "kdlab sweep --config experiments/tiny/style_grid_5x.yaml",
    "hard": "kdlab pipeline --config experiments/tiny/rlvr_harder_pipeline.yaml",
    "style_alone": "kdlab sweep --config experiments/smollm2/style_alone_grid.yaml",
    "style_alone_control": "kdlab sweep --config experiments/smollm2/style_alone_control_offpd_fkl.yaml; kdlab sweep --config experiments/smollm2/style_alone_control_onpd_rkl.yaml",
}
PARTS = tuple(PART_COMMANDS)
NOT_IN_DESIGN = "not in this study's design"  # the evidence of a part StudyDesign.elsewhere names
PARALLEL_RUNS = 2  # the study scripts' sweeps run two processes at a time (max_parallel), one thread each


@dataclass
class Verdict:
    finding: str
    paper: str
    tiny: str
    verdict: str
    evidence: str
    command: str
    rule: str = ""  # the claims the label is generated from (:attr:`Claim.rule`)
    departure: str = ""  # how the runs' design differs from the paper's for this claim ("" when it does not)
    claims: list[Claim] = field(default_factory=list, compare=False, repr=False)
    primary: list[Claim] = field(default_factory=list, compare=False, repr=False)  # the pre-stated primary claim's parts
    holm_p: float | None = None  # the primary claim's Holm-adjusted p-value over the study's findings

    @property
    def primary_rule(self) -> str:
        return " and ".join(claim.rule for claim in self.primary)

    @property
    def primary_p(self) -> float:
        """The primary claim's p-value: an intersection-union test of its parts (all must hold), their largest."""
        return max((claim.p_value for claim in self.primary), default=1.0)


@dataclass(frozen=True)
class StudyDesign:
    """What a study runs and what it leaves to another (``kdlab report --design FILE``, a YAML file of both keys):
    ``commands``, the command that fills each part it runs (in place of :data:`PART_COMMANDS`, the tiny study's);
    ``elsewhere``, each part it does not run, with why and where the finding is tested instead (its verdict:
    "not tested here")."""

    commands: dict[str, str] = field(default_factory=dict)
    elsewhere: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> StudyDesign:
        """The design in the YAML file ``path``; an unknown key or part is refused, naming it and the file."""
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"study design {path}: {error}") from None
        if not isinstance(data, dict) or set(data) - {"commands", "elsewhere"}:
            raise ValueError(f"study design {path}: the keys are 'commands' and 'elsewhere', got {sorted(data) if isinstance(data, dict) else data!r}")
        for key in ("commands", "elsewhere"):
            given = data.get(key) or {}
            if not isinstance(given, dict) or not all(isinstance(text, str) and text for text in given.values()):
                raise ValueError(f"study design {path}: {key} maps a part to a line of text")
            unknown = sorted(set(given) - set(PARTS))
            if unknown:
                raise ValueError(f"study design {path}: {key}.{unknown[0]} is no part of a study (the parts: {', '.join(PARTS)})")
        both = sorted(set(data.get("commands") or {}) & set(data.get("elsewhere") or {}))
        if both:
            raise ValueError(f"study design {path}: part {both[0]} is both run (commands) and left elsewhere")
        return cls(dict(data.get("commands") or {}), dict(data.get("elsewhere") or {}))


class Study:
    """The study's runs by part, and its configurations by (rollout kind, KL direction, LR level); ``design`` says
    which parts the study runs (:class:`StudyDesign`; by default the tiny study's, every part). ``low_lr`` and
    ``high_lr`` (``kdlab report --low_lr/--high_lr``) are the LR levels of every part; without them a part's levels
    are its own (:func:`~kdlab.study.groups.lr_levels`: the smaller of its two rates low, else the paper's)."""

    def __init__(self, root: Path, runs: list[RunResult], design: StudyDesign | None = None,
                 low_lr: list[float] | None = None, high_lr: list[float] | None = None) -> None:
        self.root = root
        self.design = design or StudyDesign()
        self.low_lr, self.high_lr = low_lr, high_lr
        self._groups: dict[str, list[Group]] = {}
        self.parts: dict[str, list[RunResult]] = {part: [] for part in PARTS}
        for run in runs:
            relative = Path(run.path).resolve().relative_to(root.resolve()) if _inside(run.path, root) else None
            if relative is not None and relative.parts and relative.parts[0] in self.parts:
                self.parts[relative.parts[0]].append(run)
        students = sorted({json.loads(r.settings.get("model.student.path") or r.settings.get("model.init_args.student.path") or '""') for r in runs} - {""})
        self.tiny = all(path.startswith("kdlab://") for path in students)  # the packaged tiny models (docs/tiny_world.md)
        reasoning = bool(students) and all(path.startswith("kdlab://tiny-reasoning/") for path in students)  # docs/tiny_reasoning.md
        self.world = "the tiny reasoning world" if reasoning else "the tiny world" if self.tiny else ", ".join(students)
        self.world_page = "docs/tiny_reasoning.md" if reasoning else "docs/tiny_world.md"

    def groups(self, part: str) -> list[Group]:
        """The part's configurations (grouped once: each group keeps its computed intervals)."""
        if part not in self._groups:
            runs = self.parts[part]
            self._groups[part] = group_runs(runs, lr_levels({r.lr for r in runs}, self.low_lr, self.high_lr))
        return self._groups[part]

    def cell(self, part: str, kind: str, direction: str | None = None, level: str | None = None) -> Group | None:
        """The part's pure-policy configuration of rollout ``kind`` (OffPD/OnPD), KL ``direction`` and LR ``level``."""
        for group in self.groups(part):
            if group.lam is None and group.kind == kind and direction in (None, group.direction) and level in (None, group.level):
                return group
        return None

    def command(self, part: str) -> str:
        """The commands that filled the part: the file each ``sweep.json`` names (the part's own, else those of
        its subfolders; ``kdlab pipeline`` for a pipeline file, which has a ``distill`` stage, else ``kdlab
        sweep``), else the design's, else :data:`PART_COMMANDS`'s; none for a part the design leaves elsewhere."""
        if part in self.design.elsewhere:
            return "none: not in this study's design"
        folder = self.root / part
        found = [folder / "sweep.json"] if (folder / "sweep.json").is_file() else sorted(folder.glob("*/sweep.json"))
        commands = [command for command in map(_sweep_command, found) if command]
        return "; ".join(dict.fromkeys(commands)) or self.design.commands.get(part) or PART_COMMANDS[part]

    def chain_evidence(self, chains: dict, source_part: str) -> str:
        """:meth:`evidence` of the RLVR part, led by "no runs" (the row is "not run") when none of its runs starts
        from a run of ``source_part`` (``chains``: :func:`rlvr_chains`'s), as an RLVR sweep beside an unrelated
        LR sweep."""
        evidence = self.evidence("rlvr")
        if self.parts["rlvr"] and "rlvr" not in self.design.elsewhere and not any(chains.values()):
            return f"no runs of {self.root.name}/rlvr/ start from a run of {self.root.name}/{source_part}/ (0 chains); {evidence}"
        return evidence

    def evidence(self, part: str) -> str:
        if part in self.design.elsewhere:
            return f"{NOT_IN_DESIGN} ({part}/): {self.design.elsewhere[part]}"
        runs = self.parts[part]
        return f"{len(runs)} runs in {self.root.name}/{part}/" if runs else f"no runs in {self.root.name}/{part}/"


def _sweep_command(path: Path) -> str | None:
    """``kdlab sweep|pipeline --config <file>`` for the file a ``sweep.json`` names, or None."""
    try:
        sweep = json.loads(path.read_text(encoding="utf-8")).get("sweep")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(sweep, str) or not sweep:
        return None
    here = next((p for p in (Path(sweep), Path(__file__).resolve().parents[2] / sweep) if p.is_file()), None)  # or in kdlab's checkout
    try:
        pipeline = here is not None and isinstance(yaml.safe_load(here.read_text(encoding="utf-8")).get("distill"), dict)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pipeline = False
    return f"kdlab {'pipeline' if pipeline else 'sweep'} --config {sweep}"


def _inside(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False
