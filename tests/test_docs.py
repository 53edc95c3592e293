"""The documentation builds without a warning, and the notebook in it runs."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_docs_build_strictly_with_api_pages(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "stages" / "index.html").read_text(encoding="utf-8")
    assert "dapo_loss" in api and "clip_high" in api  # generated from the docstrings


def test_custom_components_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(ROOT / "docs" / "notebooks" / "custom_components.ipynb", as_version=4)
    shutil.copy(ROOT / "docs" / "notebooks" / "custom_components.ipynb", tmp_path)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails (its asserts included)
    printed = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    assert "val/accuracy" in printed


def test_the_readme_notebook_example_logs_to_tensorboard_under_runs(tmp_path, monkeypatch):
    """The README's notebook example, run as written in an empty folder: its scalars reach TensorBoard
    (10 steps, so log_every_n_steps matters) under runs/notebook, and nothing lands in lightning_logs/."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Writing your own component"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    runs = list((tmp_path / "runs" / "notebook").glob("version_*"))
    assert len(runs) == 1 and not (tmp_path / "lightning_logs").exists()
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    assert {"train/loss", "train/kl_forward", "train/max_gap"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/loss")) == 10


def test_every_test_a_page_cites_exists():
    """A doc sentence that names its test (`tests/test_x.py::test_name`) names one that exists
    (generalises tests/test_bad_inputs.py's check of its own table to every page)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = {(page.relative_to(ROOT), file, name) for page in pages
             for file, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", page.read_text(encoding="utf-8"))}
    assert len(cited) > 20  # the pattern finds the citations
    missing = [(str(page), f"{file}::{name}") for page, file, name in sorted(cited)
               if not (ROOT / file).is_file() or not re.search(rf"^def {name}\(", (ROOT / file).read_text(encoding="utf-8"), re.M)]
    assert not missing, missing


def test_the_readme_notebook_example_prints_no_noise_and_ends_with_the_summary_kdlab_fit_prints(tmp_path):
    """Run as a notebook runs it (a fresh interpreter, the warnings Python shows by default): no Lightning
    tip, no warning, no "Loading weights" bar, no ``Epoch 0/-2``; the run directory first and, at the end,
    the summary kdlab fit prints (kdlab.runlog.Console, which the stage adds: named metrics at optimiser
    steps, the validation after the last step included)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Writing your own component"):], re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    for noise in ("Tip:", "Warning", "warn", "Loading weights", "Epoch 0/-2"):
        assert noise not in printed, (noise, printed[-3000:])
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[kdlab] fit finished at step 10 in "))
    assert any(line.startswith("[kdlab] run directory: runs/notebook/version_0") for line in lines[:start])
    summary = [line.split(":")[0].strip() for line in lines[start + 1 : start + 4]]
    assert summary == ["train/loss", "val/accuracy", "val/pass@1"] and " at step 1 -> " in lines[start + 1] and "at step 10  (" in lines[start + 2]


def test_the_home_page_links_every_page_of_the_navigation():
    """docs/index.md linked 10 of mkdocs.yml's 18 pages and none of the API pages: a reader starting there never
    found the package map, the teachers, forgetting or the real model."""
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may tag values (!!python/name:...); only its nav is read here
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(nav)) - {"index.md"}
    assert len(listed) >= 30  # 18 pages and the API's
    linked = set(re.findall(r"\]\(([\w/]+\.md)\)", (ROOT / "docs" / "index.md").read_text(encoding="utf-8")))
    assert listed - linked == set(), sorted(listed - linked)
