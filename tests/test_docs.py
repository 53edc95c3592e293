"""The documentation builds without a warning, and the notebook in it runs."""

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
    api = (tmp_path / "site" / "api" / "grpo" / "index.html").read_text(encoding="utf-8")
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
