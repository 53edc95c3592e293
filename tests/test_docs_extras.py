"""Every docs page that points at a config needing an optional extra names an extra that installs it (issue #43):
the needs come from :data:`kdlab.cli.extras.NEEDS` (what ``kdlab fit`` checks at parse time), applied to each
experiments file a page names, through its header command's config files (an overlay runs with the configs its
first line gives); an extra counts when ``pyproject.toml`` lists the needed package under it (``[tiny]`` brings
py3langid as ``[eval]`` does)."""

import re
import tomllib
from pathlib import Path

import yaml

from kdlab.cli.extras import missing_extras

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CONFIG = re.compile(r"experiments/[\w/.-]+\.yaml")


def header_files(path: str) -> list[str]:
    """The config files of ``path``'s header command (``# kdlab fit --config A --config B``), else ``path``."""
    first = (ROOT / path).read_text(encoding="utf-8").splitlines()[0]
    return (CONFIG.findall(first) if first.startswith("# kdlab") else []) or [path]


def installs(text: str) -> set[str]:
    """The packages of every extra a page names (``kdlab[eval]``, ``kdlab[lora,eval]``, ``.[real]``)."""
    named = {extra for group in re.findall(r"(?:kdlab|\.)\[([\w,]+)\]", text) for extra in group.split(",")}
    return {re.split(r"[<>=\[ ]", requirement)[0] for extra in named for requirement in EXTRAS.get(extra, [])}


def needs(page: Path) -> dict[str, set[str]]:
    """package -> the configs a page names that need it."""
    found: dict[str, set[str]] = {}
    for path in sorted(set(CONFIG.findall(page.read_text(encoding="utf-8")))):
        if not (ROOT / path).is_file():
            continue
        for config in header_files(path):
            if (ROOT / config).is_file():
                for _, _, need in missing_extras(yaml.safe_load((ROOT / config).read_text(encoding="utf-8")) or {}, lambda module: False):
                    found.setdefault(need.package, set()).add(path)
    return found


def test_each_page_names_the_extras_its_configs_need():
    missing = {}
    for page in PAGES:
        have = installs(page.read_text(encoding="utf-8"))
        lacking = {package: sorted(paths) for package, paths in needs(page).items() if package not in have}
        if lacking:
            missing[page.name] = lacking
    assert missing == {}


def test_the_check_sees_the_needs_it_checks():
    """Not vacuous: the LoRA + style overlay needs peft and py3langid through its header command, the SmolLM2
    configs gguf, an in-loop lm-eval suite lm-eval (the paper's configs measure forgetting off the loop, so their
    fits do not); and a page without the extra's name would fail."""
    assert needs(ROOT / "docs" / "teachers.md")["py3langid"] == {"experiments/tiny/lora_self_distill.yaml"}
    assert "experiments/tiny/lora_self_distill.yaml" in needs(ROOT / "docs" / "teachers.md")["peft"]
    assert "gguf" in needs(ROOT / "docs" / "real_model.md") and "lm-eval" not in needs(ROOT / "docs" / "scaling.md")
    in_loop = {"trainer": {"callbacks": [{"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"lm_eval_tasks": "paper"}}]}}
    assert [need.package for _, _, need in missing_extras(in_loop, lambda module: False)] == ["lm-eval"]
    assert installs("pip install 'kdlab[lora,eval]'") >= {"peft", "py3langid", "lm-eval"} and "peft" not in installs("kdlab[eval]")


def test_the_quickstart_installs_what_the_readme_installs_and_says_what_the_report_needs():
    """docs/quickstart.md installed ``pip install -e .`` as "what the quickstart runs" and said only the report's figures
    need ``[report]``, while the README installs ``.[tiny]`` and says the report's statistics need scipy and statsmodels
    (``kdlab.study.stats``: without them an ImportError names ``kdlab[report]``). Both pages give the same install."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    setup = next(line for line in readme.splitlines() if line.startswith("pip install torch") and "kdlab fit" in line)
    readme_installs = [part.strip() for part in setup.split("&&") if part.strip().startswith("pip install")]
    block = quickstart.split("```bash", 1)[1].split("```", 1)[0]
    quickstart_installs = [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("pip install")]
    assert quickstart_installs == readme_installs, (quickstart_installs, readme_installs)
    report = " ".join(quickstart.split("`kdlab report runs/sweep-smoke` writes")[1].split("\n\n")[0].split())
    assert "statistics need scipy and statsmodels" in report and {"scipy", "statsmodels", "matplotlib"} <= installs(report)
