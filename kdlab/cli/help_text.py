"""What ``kdlab <command> --help`` says: help texts without docstring markup (:func:`clean_help`), what each of
``fit``, ``validate`` and ``test`` does (:data:`DESCRIPTIONS`), and their options in reading order (:func:`plain_help`)."""

from __future__ import annotations

import contextlib
import io
import re
import sys

_RST = [
    # a role the help's line wrapping broke (``kdlab.rol\n    louts.X``) is joined again before its last name is kept
    (re.compile(r":(?:class|func|meth|mod|attr|data|obj|paramref):`~?([\w.\s]+?)`"), lambda m: re.sub(r"\s+", "", m.group(1)).rsplit(".", 1)[-1]),
    (re.compile(r"``([^`]+)``"), lambda m: m.group(1)),
    (re.compile(r"`([^`<]+) <[^>]+>`_"), lambda m: m.group(1)),
    (re.compile(r"`([^`\n]+)`"), lambda m: m.group(1)),  # `N`: interpreted text, shown as is
]


def clean_help(text: str) -> str:
    """Docstring markup out of ``--help`` text: ``:class:`~a.B``` -> B (also ``:paramref:``), ````x```` -> x,
    links -> their text, ```x``` -> x."""
    for pattern, replacement in _RST:
        text = pattern.sub(replacement, text)
    return text


@contextlib.contextmanager
def clean_help_output(argv: list[str]):
    """Around ``kdlab fit|validate|test --help``: print the help without reStructuredText markup."""
    if not any(arg in ("-h", "--help") for arg in argv):
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        sys.stdout.write(clean_help(buffer.getvalue()))


DESCRIPTIONS = {  # what --help says a command does, instead of the first line of the Trainer method's docstring
    "fit": "Train a stage from YAML configs: distillation by default, or the LightningModule a config names with "
           "model: {class_path: ...}; the run logs to <save_dir>/<name>/version_<n>/ and ends with checkpoints/final.ckpt.",
    "validate": "Evaluate on the validation split (val/accuracy, val/pass@k): the weights the config names, or a "
                "trained run's with --ckpt_path=<run>/checkpoints/final.ckpt.",
    "test": "Evaluate on the test split (test/accuracy, test/pass@k): the weights the config names, or a trained "
            "run's with --ckpt_path=<run>/checkpoints/final.ckpt.",
}


def plain_help(parser, prog: str) -> None:
    """Prepare a subcommand parser's ``--help``: what the command does (:data:`DESCRIPTIONS`), every help text
    without docstring markup (:func:`clean_help`, before argparse wraps it, so no role is cut in two), the groups in
    reading order (the model's arguments first, then the command's own and the config options, the trainer's
    last) and a short usage line instead of one entry per option."""
    parser.description = DESCRIPTIONS.get(prog.rsplit(" ", 1)[-1], parser.description)
    for action in parser._actions:
        if action.help:
            action.help = clean_help(action.help)
    for group in parser._action_groups:
        group.description = clean_help(group.description) if group.description else group.description
        group.title = clean_help(group.title) if group.title else group.title

    def rank(group) -> int:
        options = [option for action in group._group_actions for option in action.option_strings]
        if any(option.startswith("--model") for option in options):
            return 0
        if any(option.startswith("--trainer") for option in options):
            return 3
        if any(option in ("--ckpt_path", "--config", "-c") for option in options):
            return 1
        return 2

    parser._action_groups.sort(key=rank)  # stable: the rest keep their order
    parser.usage = f"{prog} [--config FILE.yaml ...] [--model.KEY=VALUE ...] [--trainer.KEY=VALUE ...] [--print_config] (options below)"
