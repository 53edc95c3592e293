"""kdlab 0.1's import paths keep working: every public name 0.1 exported at a module path
(``tests/fixtures/kdlab_0_1_names.json``, written by ``scripts/legacy_names.py`` from the flat layout at
commit f7e1234) imports from that path as the very object of its new home, with a ``FutureWarning`` that
names the new path where it moved (:data:`kdlab._legacy.MOVED`), and without one where it did not.

Module-level warnings fire once per process, so the imports run in one fresh interpreter (this file run as
a script), which prints what it saw as JSON."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "kdlab_0_1_names.json"
COMMIT = "f7e1234"
# the one 0.1 name that cannot come back: ``main`` was a function of kdlab/cli.py, and kdlab.cli.main is now
# the dispatcher module (the function is kdlab.cli.main.main); a package attribute cannot be both
NOT_KEPT = {("kdlab.cli", "main")}


def old_names() -> dict[str, list[str]]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def home(old: str, name: str) -> tuple[str, str, str | None]:
    """Where ``old.name`` lives now, from the table in kdlab._legacy: (module, name, the warning's words,
    None where it did not move)."""
    from kdlab import _legacy

    if old in _legacy.MOVED and name in _legacy.names(old):
        module, new_name = _legacy.names(old)[name]
        return module, new_name, f"{old}.{name} moved to {module}.{new_name}"
    if old in _legacy.MOVED and _legacy.whole(old):
        return _legacy.whole(old), name, f"{old} moved to {_legacy.whole(old)}"
    return old, name, None


def ours(warnings_seen) -> list[str]:
    return [str(w.message) for w in warnings_seen if issubclass(w.category, FutureWarning) and str(w.message).startswith("kdlab")]


def check() -> dict:
    """Run in a fresh interpreter: the two imports issue #30 names, then every fixture pair."""
    import warnings

    from kdlab import _legacy

    report = {"explicit": {}, "pairs": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from kdlab.metrics import pass_at_k
        from kdlab.models import resolve_path
        from kdlab.evaluation.metrics import pass_at_k as new_pass_at_k
        from kdlab.models.loading import resolve_path as new_resolve_path

        report["explicit"] = {"same": [pass_at_k is new_pass_at_k, resolve_path is new_resolve_path], "warnings": ours(caught)}
        for old, listed in old_names().items():
            if old in _legacy.MOVED and old not in _legacy.PACKAGES:
                sys.modules.pop(old, None)  # imported above or by another old path: import it afresh, so it warns again
            start = len(caught)
            try:
                module, error = importlib.import_module(old), None
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                module, error = None, repr(exc)
            at_import = ours(caught[start:])
            for name in listed:
                new_module, new_name, expect = home(old, name)
                entry = {"home": f"{new_module}.{new_name}", "expect": expect, "at_import": at_import, "error": error}
                start = len(caught)
                try:
                    found = getattr(module, name)
                    expected = getattr(importlib.import_module(new_module), new_name)
                    entry["same"] = found is expected
                    entry["defined_in"] = found.__module__ if isinstance(found, (type, types.FunctionType)) else None
                    if old in _legacy.MOVED and _legacy.whole(old) and name not in _legacy.names(old):
                        entry["same"] = entry["same"] and module is importlib.import_module(_legacy.whole(old))
                except Exception as exc:  # noqa: BLE001
                    entry["error"] = entry["error"] or repr(exc)
                entry["warnings"] = ours(caught[start:])
                report["pairs"][f"{old}:{name}"] = entry
    return report


@pytest.fixture(scope="module")
def seen() -> dict:
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_two_imports_of_the_issue_work_and_warn(seen):
    assert seen["explicit"]["same"] == [True, True]
    assert any("kdlab.evaluation.metrics" in message for message in seen["explicit"]["warnings"])
    assert "kdlab.models.resolve_path moved to kdlab.models.loading.resolve_path" in seen["explicit"]["warnings"]


def test_every_old_name_imports_as_its_new_home(seen):
    pairs = {tuple(key.split(":")): entry for key, entry in seen["pairs"].items()}
    assert len(pairs) == sum(map(len, old_names().values()))
    broken = {f"{old}.{name}": entry.get("error") or f"not {entry['home']}" for (old, name), entry in pairs.items()
              if (old, name) not in NOT_KEPT and (entry["error"] or not entry.get("same"))}
    assert not broken


def test_a_moved_name_warns_with_its_new_path(seen):
    """A name listed one by one warns as it is read (``kdlab.models.resolve_path moved to
    kdlab.models.loading.resolve_path``); a module that is another module now warns as it is imported."""
    silent = [key for key, entry in seen["pairs"].items() if entry["expect"] and tuple(key.split(":")) not in NOT_KEPT
              and not any(entry["expect"] in message for message in entry["at_import"] + entry["warnings"])]
    assert not silent
    assert "kdlab.report.read_run moved to kdlab.study.runs.read_run" in seen["pairs"]["kdlab.report:read_run"]["warnings"]
    assert any("kdlab.grpo moved to kdlab.stages.grpo" in message for message in seen["pairs"]["kdlab.grpo:GRPOModule"]["at_import"])


def test_a_name_that_did_not_move_does_not_warn(seen):
    unmoved = [entry for entry in seen["pairs"].values() if not entry["expect"]]
    assert len(unmoved) > 100  # kdlab.tasks, kdlab.data, kdlab.tiny, ... and the packages' own names
    assert [entry["home"] for entry in unmoved if entry["at_import"] or entry["warnings"]] == []


def test_a_name_listed_one_by_one_is_defined_where_the_table_says(seen):
    """The table points at a name's home, not at a module that happens to import it."""
    from kdlab import _legacy

    elsewhere = [key for key, entry in seen["pairs"].items()
                 if entry["expect"] and entry.get("defined_in") and key.split(":")[1] in _legacy.names(key.split(":")[0])
                 and entry["defined_in"] != entry["home"].rsplit(".", 1)[0]]
    assert not elsewhere


def test_the_name_that_is_not_kept_is_the_cli_module():
    done = subprocess.run([sys.executable, "-c", "from kdlab.cli import main; print(main.__name__)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["kdlab.cli.main"]
    assert "main" in old_names()["kdlab.cli"]


def test_the_fixture_lists_known_names():
    names = old_names()
    known = {("kdlab.metrics", "pass_at_k"), ("kdlab.models", "resolve_path"), ("kdlab.grpo", "GRPOModule"),
             ("kdlab.report", "wilson_interval"), ("kdlab.sweep", "Sweep"), ("kdlab.kl_kernels", "HeadLogits"),
             ("kdlab.tasks", "Addition"), ("kdlab.optim", "warmup_factor"), ("kdlab.evaluation", "generate"),
             ("kdlab.callbacks", "report"), ("kdlab.stage", "decoder_layer_classes")}
    assert {(old, name) for old, name in known if name not in names.get(old, [])} == set()
    assert len(names) >= 40 and sum(map(len, names.values())) >= 380


def test_the_fixture_is_what_the_script_reads_from_kdlab_0_1():
    if subprocess.run(["git", "cat-file", "-e", f"{COMMIT}^{{commit}}"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip(f"kdlab 0.1 ({COMMIT}) is not in this checkout's history")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from legacy_names import legacy_names
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert legacy_names(COMMIT) == old_names()


def test_the_table_names_only_old_names_and_knows_which_paths_are_packages():
    from kdlab import _legacy

    names = old_names()
    extra = {f"{old}.{name}" for old in _legacy.MOVED for name in _legacy.names(old) if name not in names.get(old, [])
             and old not in _legacy.SINCE_0_1}
    assert not extra
    real = {old for old in _legacy.MOVED  # a module or package of that name in its parent package's folder
            if importlib.machinery.PathFinder.find_spec(old, [str(ROOT.joinpath(*old.split(".")[:-1]))]) is not None}
    assert real == set(_legacy.PACKAGES)
    for package in _legacy.PACKAGES:
        assert "def __getattr__" in (ROOT / package.replace(".", "/") / "__init__.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("old, new", [("kdlab.stages.multi_teacher.ByField", "kdlab.teachers.ByField"),
                                      ("kdlab.stages.multi_teacher.Average", "kdlab.teachers.Average"),
                                      ("kdlab.stages.multi_teacher.TeacherEntry", "kdlab.teachers.legacy.TeacherEntry"),
                                      ("kdlab.stages.teachers.vocabulary_columns", "kdlab.teachers.model.vocabulary_columns")])
def test_paths_moved_since_0_1_give_the_same_objects_with_a_warning(old, new):
    """``class_path: kdlab.stages.multi_teacher.ByField`` (committed configs of kdlab 0.3) is kdlab.teachers' class."""
    module, name = old.rsplit(".", 1)
    with pytest.warns(FutureWarning, match=f"{module}.{name} moved to"):
        found = getattr(importlib.import_module(module), name)
    new_module, new_name = new.rsplit(".", 1)
    assert found is getattr(importlib.import_module(new_module), new_name)


def test_importing_kdlab_imports_nothing_heavy():
    """The table is strings: ``import kdlab`` loads no stage, model or framework."""
    code = "import sys, kdlab; print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'lightning', 'transformers', 'kdlab'}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "['kdlab', 'kdlab._legacy']"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's kdlab, whatever is installed
    print(json.dumps(check()))
