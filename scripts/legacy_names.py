#!/usr/bin/env python
"""List every public name kdlab 0.1 exported at a module path, as the fixture the legacy-import test reads.

    python scripts/legacy_names.py [--commit f7e1234] [--out tests/fixtures/kdlab_0_1_names.json]

kdlab 0.1 is the flat layout at commit ``f7e1234``. Each ``kdlab/**/*.py`` there is read with ``git show``
and parsed with :mod:`ast` (nothing is imported). A module's public names are its ``__all__`` when it has
one; otherwise the top-level ``def``, ``class`` and assignment targets whose names do not start with ``_``
(those inside a top-level ``if``/``try``/``with`` count too). A name a plain module merely imported
(``import torch``, ``from kdlab.models import ModelSpec``) is not its own and is left out; in a package's
``__init__`` a ``from ... import name`` is a public re-export and counts. Logger objects (``logger``,
``log``) are module plumbing, not API, and are left out.

The output is ``{old_module: [names, sorted]}``, written as JSON (one module a line) to ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "f7e1234"
OUT = ROOT / "tests" / "fixtures" / "kdlab_0_1_names.json"
PLUMBING = {"logger", "log"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def module_name(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.expr):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)


def _statements(body: list[ast.stmt]):
    """Top-level statements, descending into top-level ``if``/``try``/``with`` blocks."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _statements(node.body)
            for handler in node.handlers:
                yield from _statements(handler.body)
            yield from _statements(node.orelse)
            yield from _statements(node.finalbody)
        elif isinstance(node, ast.With):
            yield from _statements(node.body)
        else:
            yield node


def public_names(source: str, is_package: bool) -> list[str]:
    tree = ast.parse(source)
    for node in tree.body:  # __all__ wins
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return sorted(ast.literal_eval(node.value))
    names: set[str] = set()
    for node in _statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(_targets(target))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif isinstance(node, ast.ImportFrom) and is_package:
            names.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
    return sorted(name for name in names if not name.startswith("_") and name not in PLUMBING)


def legacy_names(commit: str = COMMIT) -> dict[str, list[str]]:
    paths = [p for p in git("ls-tree", "-r", "--name-only", commit, "kdlab").splitlines() if p.endswith(".py")]
    found = {}
    for path in sorted(paths):
        names = public_names(git("show", f"{commit}:{path}"), path.endswith("/__init__.py"))
        if names:
            found[module_name(path)] = names
    return dict(sorted(found.items()))


def dump(table: dict[str, list[str]]) -> str:
    lines = [f"  {json.dumps(module)}: {json.dumps(names)}" for module, names in table.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default=COMMIT)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    table = legacy_names(args.commit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(table), encoding="utf-8")
    print(f"{sum(map(len, table.values()))} names in {len(table)} modules -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
