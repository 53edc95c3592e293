"""Every YAML under experiments/ starts with the command that runs it, and that command parses."""

import shlex
from pathlib import Path

import pytest

from kdlab.cli import main

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "experiments").rglob("*.yaml"))


def header_command(path: Path) -> list[str]:
    first = (ROOT / path).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# kdlab "), f"{path}: the first line must be '# kdlab ...', the command that runs it"
    words = shlex.split(first[2:])
    assert str(path) in first, f"{path}: its header command does not name the file itself"
    return words[1:]


def test_there_are_experiment_configs():
    assert len(CONFIGS) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_header_command_parses_with_the_real_cli(path, monkeypatch, capsys):
    args = header_command(path)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])
    if args[0] in ("fit", "validate", "test"):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--print_config"])
        assert exit_info.value.code in (0, None), capsys.readouterr().err
        assert "class_path: kdlab.tasks." in capsys.readouterr().out
    elif args[0] == "generate":
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--print_config"])
        assert exit_info.value.code in (0, None)
    else:
        pytest.skip(f"{args[0]} configs are checked by their own tests")
