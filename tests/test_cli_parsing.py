"""What ``kdlab fit`` says before it starts: a misspelt or abbreviated option, a class name that does not
exist, a package the config needs that is not installed (each one line, exit status 2, nothing loaded),
and a ``--help`` led by the model's arguments, in plain text."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdlab.cli.main import entry, main

ROOT = Path(__file__).parents[1]
TINY = ROOT / "experiments" / "tiny"
SMOKE = str(TINY / "smoke.yaml")


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])


def entry_error(capsys, args):
    """Run the console script in-process; its exit status and the last line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        entry(args)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_an_abbreviated_option_is_an_unknown_key_not_the_option_it_abbreviates(tmp_path, capsys):
    """argparse took --trainer.max_step=2 as max_steps (allow_abbrev); it names the key it meant instead."""
    status, last = entry_error(capsys, ["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_step=2"])
    assert status == 2 and last == "kdlab: error: trainer.max_step: no such key for kdlab fit (did you mean 'trainer.max_steps'?)"
    status, last = entry_error(capsys, ["fit", f"--config={SMOKE}", "--model.val_exampl=4"])
    assert status == 2 and "model.val_exampl: no such key" in last and "'model.val_examples'" in last
    assert not (tmp_path / "tiny-smoke").exists()


@pytest.mark.parametrize("args, expected", [
    (["sweep", "--config", str(TINY / "sweep_smoke.yaml"), "--max_par", "2"], "kdlab sweep: error: unrecognized arguments: --max_par 2"),
    (["pipeline", "--conf", str(TINY / "pipeline_smoke.yaml")], "kdlab pipeline: error: the following arguments are required: --config"),
    (["report", "runs/x", "--out", "elsewhere"], "kdlab report: error: unrecognized arguments: --out elsewhere"),
    (["estimate", f"--config={SMOKE}", "--trainer.max_step=2"],
     "kdlab: error: trainer.max_step: no such key for kdlab fit (or estimate) (did you mean 'trainer.max_steps'?)"),
])
def test_no_subcommand_takes_a_prefix_of_an_option_for_the_option(capsys, args, expected):
    """argparse's abbreviations are off in every subcommand (issue #43): ``--max_par 2`` is not ``--max_parallel 2``."""
    status, last = entry_error(capsys, args)
    assert status == 2 and last == expected


@pytest.mark.parametrize("given, expected", [
    ("--model.objective=ReverseKLL", "model.objective: no class 'ReverseKLL' (did you mean 'ReverseKL'?)"),
    ("--model.rollout=StudentRollout", "model.rollout: no class 'StudentRollout' (did you mean 'StudentRollouts'?)"),
    ("--trainer.callbacks+=UpdateSparsty", "trainer.callbacks: no class 'UpdateSparsty' (did you mean 'UpdateSparsity'?)"),
])
def test_a_misspelt_short_class_name_gets_the_nearest_class(tmp_path, capsys, given, expected):
    """Short names are jsonargparse's (a subclass of the accepted type); a typo in one said only
    "Expected a dot import path string"."""
    status, last = entry_error(capsys, ["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", given])
    assert status == 2 and last == f"kdlab: error: {expected}"


@pytest.mark.parametrize("config, given, expected", [
    (SMOKE, "--model.objective.chunk_size=big", "model.objective.chunk_size: Expected a <class 'int'>. Got value: big"),
    (str(TINY / "rlvr.yaml"), "--model.group_size=two", "model.group_size: Expected a <class 'int'>. Got value: two"),
])
def test_a_bad_value_inside_a_class_names_its_key_and_the_cause(tmp_path, capsys, config, given, expected):
    """A component's (or a class_path stage's) argument of the wrong type: jsonargparse reports it two levels deep
    ("Problem with given class_path ...: Parser key "chunk_size": Expected ..."); the line said only
    ``model.objective: Parser key "chunk_size":``."""
    status, last = entry_error(capsys, ["fit", f"--config={config}", f"--trainer.logger.init_args.save_dir={tmp_path}", given])
    assert status == 2 and last == f"kdlab: error: {expected}"


def test_a_misspelt_argument_a_class_passes_to_its_base_gets_that_argument(tmp_path, capsys):
    """Coverage's ``exampels: 10`` suggested 'samples': the names offered were Coverage's own arguments, not those it
    takes through ``**settings`` for EvaluationCallback (``examples`` among them), which jsonargparse accepts too."""
    from kdlab.cli.config_errors import _argument_candidates

    candidates = _argument_candidates("kdlab.callbacks.Coverage")
    assert {"samples", "ks", "examples", "max_new_tokens", "batch_size"} <= set(candidates) and "settings" not in candidates
    config = tmp_path / "typo.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: kdlab.callbacks.Coverage\n      init_args:\n        exampels: 10\n")
    status, last = entry_error(capsys, ["fit", f"--config={SMOKE}", f"--config={config}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert status == 2 and last.endswith("Coverage has no argument 'exampels' (did you mean 'examples'?)"), last


def test_a_config_that_needs_a_missing_extra_fails_at_parse_time_naming_the_setting_and_the_extra(tmp_path, capsys, monkeypatch):
    """The style overlay without py3langid, LoRA without peft: one line naming the setting and the extra,
    before any model loads (no run directory)."""
    import kdlab.cli.extras as extras

    monkeypatch.setattr(extras, "installed", lambda module: module not in ("py3langid", "peft"))
    configs = [f"--config={TINY / name}" for name in ("quickstart.yaml", "spanish_style.yaml", "lora_self_distill.yaml")]
    save = f"--trainer.logger.init_args.save_dir={tmp_path}"
    started = time.monotonic()
    status, last = entry_error(capsys, ["fit", *configs, save])
    assert status == 2 and last == (
        "kdlab: error: trainer.callbacks[4].class_path='kdlab.callbacks.StyleTransfer' needs py3langid, which is not installed: "
        "pip install 'kdlab[eval]' (the config also needs kdlab[lora])"
    )
    status, last = entry_error(capsys, ["fit", f"--config={TINY / 'quickstart.yaml'}", f"--config={TINY / 'lora.yaml'}", save])
    assert status == 2 and last == "kdlab: error: model.lora needs peft, which is not installed: pip install 'kdlab[lora]'"
    assert not list(tmp_path.iterdir()) and time.monotonic() - started < 120


def test_each_rule_names_an_extra_of_pyproject_that_installs_its_package():
    """Every need's extra exists in pyproject.toml and lists the package the message tells to install."""
    import re

    from kdlab.cli.extras import NEEDS

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for need in NEEDS:
        line = re.search(rf"^{need.extra} = \[(.*)\]$", text, re.M)
        assert line and f'"{need.package}' in line.group(1), (need.extra, need.package)


def test_fit_help_is_led_by_the_models_arguments_in_plain_text_with_a_short_usage(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    lines = out.splitlines()
    assert lines[0].startswith("usage: kdlab fit [--config FILE.yaml ...] [--model.KEY=VALUE ...]") and len(lines[0]) < 140
    options = [line.split()[0] for line in lines if line.startswith("  --")]
    assert options[0].startswith("--model") and options[-1].startswith("--trainer")
    assert options.index("--ckpt_path") < min(i for i, option in enumerate(options) if option.startswith("--trainer"))
    for markup in ("``", ":class:", ":meth:", ":func:", ":paramref:", "`"):
        assert markup not in out, markup


def test_fit_builds_only_the_parser_of_its_subcommand(tmp_path):
    """kdlab fit no longer builds validate's, test's and predict's parsers (most of --help's time). An empty help cache
    (XDG_CACHE_HOME), or --help prints a cached render and builds no parser at all."""
    code = (
        "import sys\nfrom kdlab.cli import lightning\nseen = []\n"
        "cls = lightning.lightning_cli_class()\nreal = cls._prepare_subcommand_parser\n"
        "def spy(self, klass, subcommand, **kw):\n    seen.append(subcommand)\n    return real(self, klass, subcommand, **kw)\n"
        "cls._prepare_subcommand_parser = spy\nfrom kdlab.cli.main import main\n"
        "try:\n    main(['fit', '--help'])\nexcept SystemExit:\n    pass\nprint('SEEN', seen, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path)})
    assert "SEEN ['fit']" in result.stderr, result.stderr[-2000:]


def test_kdlab_report_writes_its_tables_without_matplotlib_and_names_the_figures_it_skipped(tmp_path, monkeypatch, capsys):
    """kdlab report refused to run without [report]; its tables need only pandas."""
    import json

    import yaml

    import kdlab.study.report  # noqa: F401  (and what it imports, torchmetrics's plotting included, before matplotlib goes)
    import kdlab.study.verdicts  # noqa: F401

    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    for seed, accuracy in ((42, 0.5), (43, 0.7)):
        run = tmp_path / "runs" / f"seed={seed}"
        run.mkdir(parents=True)
        config = {"seed_everything": seed, "trainer": {"max_steps": 4},
                  "model": {"student": {"path": "kdlab://tiny-random/student"}, "task": {"class_path": "kdlab.tasks.Addition"},
                            "rollout": {"class_path": "kdlab.rollouts.TeacherRollouts"}, "objective": {"class_path": "kdlab.objectives.ForwardKL"},
                            "lr": 1e-3}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "val/accuracy": accuracy, "rlvr/reward": 1.0}) + "\n")
    main(["report", str(tmp_path / "runs"), "--output", str(tmp_path / "report")])
    err = capsys.readouterr().err
    report = (tmp_path / "report" / "report.md").read_text()
    assert "[report] figures not drawn, matplotlib is not installed (pip install 'kdlab[report]'): accuracy, rlvr-reward" in err
    assert "Figures not drawn, matplotlib is not installed (pip install 'kdlab[report]'): accuracy, rlvr-reward." in report
    assert "60.0" in report and (tmp_path / "report" / "runs.csv").is_file() and not list((tmp_path / "report").glob("*.png"))


def test_fit_help_is_kept_once_rendered_and_then_printed_without_importing_torch(tmp_path):
    """Rendering --help imports torch, transformers and Lightning (9 s on the issue's machine); the
    second time it comes from the cache, word for word, and imports none of them. A changed source file
    renders it again."""
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    code = "import sys\nfrom kdlab.cli.main import entry\ntry:\n    entry(['fit', '--help'])\nexcept SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules, file=sys.stderr)\n"
    first, second = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env) for _ in range(2))
    assert "TORCH True" in first.stderr and "TORCH False" in second.stderr, (first.stderr[-2000:], second.stderr[-2000:])
    assert first.stdout == second.stdout and first.stdout.startswith("usage: kdlab fit ")
    (cached,) = (tmp_path / "kdlab").glob("help-fit-*.txt")
    assert cached.read_text() == first.stdout


def test_the_help_cache_key_changes_with_the_packages_it_reads(monkeypatch, tmp_path):
    from importlib import metadata

    from kdlab.cli.main import help_cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = help_cache_path("fit")
    assert before.parent == tmp_path / "kdlab" and before == help_cache_path("fit")
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.0" if name == "lightning" else real(name))
    assert help_cache_path("fit") != before


@pytest.mark.parametrize("command", ["fit", "validate", "test", "generate", "prune"])
def test_each_subcommands_help_names_it_and_says_what_it_does_in_whole_sentences(capsys, monkeypatch, tmp_path, command):
    """``kdlab prune --help`` stopped at "keep ``layers``, and write" (the docstring's first line), ``kdlab test --help`` at
    Lightning's "...to make sure you never run on your"; generate's and prune's usage said ``__main__.py``; both showed
    double backticks. Each help now opens with ``usage: kdlab <command>``, and its description is whole sentences."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # rendered now, not a cached render
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith(f"usage: kdlab {command} ")
    description = " ".join(out.split("\n\n")[1].split())  # the paragraph after the usage lines
    assert description[:1].isupper() or description.startswith("kdlab"), description
    assert description.endswith("."), description
    assert "``" not in out and ":mod:" not in out and ":class:" not in out
