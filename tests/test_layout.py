"""The package's layout: no import cycles, small modules, and a map (docs/package_map.md) that lists
every module. The graph counts every ``import`` in a module, function-level ones included."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kdlab"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports(name: str, path: Path) -> set[str]:
    """The kdlab modules ``name`` imports (anywhere in it), with the packages whose ``__init__`` such an
    import runs first (a package that contains ``name`` is already running, so it does not count)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "kdlab" or target not in MODULES:
                continue
            found.add(target)
            found.update(a for a in ancestors(target) if a not in ancestors(name) and a != "kdlab")
    found.discard(name)
    return found


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_the_import_graph_has_no_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    """The check above can fail: a sweep that imported the CLI's dispatcher, which imports the sweep."""
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    assert "kdlab.study.sweep" in graph["kdlab.cli.main"]
    graph["kdlab.study.sweep"].add("kdlab.cli.main")
    assert any({"kdlab.cli.main", "kdlab.study.sweep"} <= set(component) for component in cycles(graph))


def test_the_graph_sees_function_level_imports():
    assert "kdlab.cli.lightning" in GRAPH["kdlab.study.sweep"]  # imported inside _fit_in_process
    assert "kdlab.cli" in GRAPH["kdlab.study.sweep"]  # the package's __init__ runs first


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines"


def test_the_package_map_lists_every_module_and_only_modules():
    text = (ROOT / "docs" / "package_map.md").read_text(encoding="utf-8")
    rows = [line.rstrip(" |").rsplit("|", 1)[-1] for line in text.splitlines() if line.startswith("| ")]
    listed = {name for cell in rows for name in re.findall(r"`(kdlab(?:\.\w+)+)`", cell)}  # the module column
    missing = {name for name in MODULES if name not in listed and name.count(".") >= 1 and not MODULES[name].name == "__init__.py"}
    missing -= {"kdlab.tiny.__main__", "kdlab.cli.__main__"}
    assert not missing, f"docs/package_map.md does not list {sorted(missing)}"
    assert listed <= set(MODULES), f"docs/package_map.md names modules that do not exist: {sorted(listed - set(MODULES))}"


MAP_SECTION = re.compile(r"^\| \*\*(.+?)\*\* \|")
# the imports up the map's list that docs/package_map.md names as its three exceptions (the last one of two imports)
UPWARD_IMPORTS = {("kdlab.data", "kdlab.tasks.base"), ("kdlab.study.sweep", "kdlab.cli.lightning"), ("kdlab.study.fit_configs", "kdlab.cli.lightning"),
                  ("kdlab.study.sweep", "kdlab.cli.console")}


def map_sections() -> dict[str, int]:
    """Each module the package map lists -> the index of its section (``| **Tasks** |``) down the page."""
    section, found = -1, {}
    for line in (ROOT / "docs" / "package_map.md").read_text(encoding="utf-8").splitlines():
        if MAP_SECTION.match(line):
            section += 1
        elif line.startswith("|") and section >= 0:
            for name in re.findall(r"`(kdlab[\w.]*)`", line.rstrip(" |").rsplit("|", 1)[-1]):
                found[name] = section
    return found


def upward_imports(graph: dict[str, set[str]], sections: dict[str, int]) -> set[tuple[str, str]]:
    return {(name, target) for name, targets in graph.items() for target in targets
            if name in sections and target in sections and sections[target] > sections[name]}


def test_imports_go_down_the_package_map_but_for_the_two_it_names():
    sections = map_sections()
    assert len(set(sections.values())) >= 10 and "kdlab.cli.main" in sections  # the parse found the page's sections
    assert upward_imports(GRAPH, sections) == UPWARD_IMPORTS
    planted = {**GRAPH, "kdlab.tasks.base": GRAPH["kdlab.tasks.base"] | {"kdlab.stages.distill"}}
    assert ("kdlab.tasks.base", "kdlab.stages.distill") in upward_imports(planted, sections)  # the check can fail


@pytest.mark.parametrize("old, new", [
    ("kdlab.module.DistillModule", "kdlab.stages.DistillModule"),
    ("kdlab.stage.TaskStage", "kdlab.stages.TaskStage"),
    ("kdlab.grpo.GRPOModule", "kdlab.stages.GRPOModule"),
    ("kdlab.sft.SFTModule", "kdlab.stages.SFTModule"),
    ("kdlab.vllm_engine.VLLMRollouts", "kdlab.rollouts.VLLMRollouts"),
    ("kdlab.heldout_kl.HeldOutKL", "kdlab.callbacks.HeldOutKL"),
])
def test_old_class_paths_are_the_same_classes(old, new):
    """Configs written for the flat layout keep working: the old path is the very class, not a copy."""
    def resolve(path):
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    assert resolve(old) is resolve(new)
    assert importlib.import_module(old.rsplit(".", 1)[0]).__spec__.name != old.rsplit(".", 1)[0]  # the new module's own spec


def test_an_old_class_path_in_a_config_still_fits(tmp_path, monkeypatch):
    """jsonargparse resolves ``class_path: kdlab.grpo.GRPOModule`` as it did before the move."""
    from kdlab.cli.main import main

    monkeypatch.setattr("sys.argv", ["kdlab"])
    config = tmp_path / "old.yaml"
    config.write_text("model:\n  class_path: kdlab.grpo.GRPOModule\n  init_args:\n    policy: {path: kdlab://tiny-random/student}\n"
                      "    task: {class_path: kdlab.tasks.Addition}\n")
    cli = main(["fit", f"--config={config}", "--trainer.max_steps=1", "--trainer.logger=false"], run=False)
    from kdlab.stages import GRPOModule

    assert type(cli.model) is GRPOModule
