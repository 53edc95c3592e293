"""``kdlab fit|validate|test --config X.yaml``: LightningCLI over :class:`~kdlab.stages.distill.DistillModule`, or
over any LightningModule (:class:`~kdlab.stages.grpo.GRPOModule` for RLVR, :class:`~kdlab.stages.sft.SFTModule` for
teacher training) when a config names one with ``model: {class_path: ..., init_args: {...}}``;
``kdlab generate --config X.yaml``: teacher data for off-policy runs (:mod:`kdlab.rollouts.teacher_data`);
``kdlab sweep --config S.yaml``: a grid of fit runs (:mod:`kdlab.study.sweep`);
``kdlab pipeline --config P.yaml``: distillation runs, then RLVR from each (:mod:`kdlab.study.pipeline`);
``kdlab prune --model M --layers every_other --output DIR``: a depth-pruned student (:mod:`kdlab.models.pruning`);
``kdlab forgetting --run RUN_DIR``: the lm-eval forgetting suite on a finished run (:mod:`kdlab.evaluation.forgetting_run`);
``kdlab report RUN_DIR...``: the paper's tables and figures from finished runs (:mod:`kdlab.study.report`).

Components (``task``, ``rollout``, ``objective``) are chosen with ``class_path``/``init_args``;
``--print_config`` shows every knob. TensorBoard is the default logger; ``seed_everything``
(default 42) is linked to ``model.seed``, so it also seeds the module's rollout and sampling streams.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kdlab import __version__
from kdlab.cli.lightning import LIGHTNING_COMMANDS, overlay_hint, run_lightning

COMMANDS = {
    "fit": "train a stage from a YAML config (distillation by default): kdlab fit --config X.yaml",
    "validate": "evaluate on the validation split (val/accuracy, val/pass@k): kdlab validate --config X.yaml",
    "test": "evaluate on the test split (test/accuracy, test/pass@k): kdlab test --config X.yaml",
    "generate": "write teacher data for off-policy runs: kdlab generate --config gen.yaml",
    "sweep": "run a grid of fits: kdlab sweep --config S.yaml",
    "pipeline": "distillation runs, then RLVR from each: kdlab pipeline --config P.yaml",
    "forgetting": "the lm-eval forgetting suite on a finished run, off the training loop: kdlab forgetting --run runs/<name>",
    "report": "tables and figures from finished runs: kdlab report runs/<name>...",
    "prune": "a depth-pruned copy of a model: kdlab prune --help",
    "estimate": "per-GPU memory, step work, step time and wall time of a fit, before running it: kdlab estimate --config X.yaml",
}
HELP = """usage: kdlab COMMAND [options]          (kdlab COMMAND --help: that command's options)

kdlab {version}: strong-to-weak distillation of language models with PyTorch Lightning.

commands:
{commands}

A fit logs to <save_dir>/<name>/version_<n>/ (TensorBoard events, config.yaml, metrics.jsonl,
samples/, checkpoints/final.ckpt: the final weights); it prints that directory when it starts. Resume an
interrupted fit with the same command plus --ckpt_path=<run>/checkpoints/on_exception.ckpt (or last.ckpt).
A configuration error ends in one line naming the key (exit status 2); KDLAB_TRACEBACK=1 or
--traceback shows the whole traceback.
"""


def top_help() -> str:
    """``kdlab --help``: every command, without importing Lightning (it answers at once)."""
    width = max(map(len, COMMANDS))
    return HELP.format(version=__version__, commands="\n".join(f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()))


HELP_CACHE_PACKAGES = ("lightning", "jsonargparse", "torch", "transformers", "docstring-parser")


def help_cache_path(command: str) -> Path:
    """Where ``kdlab <command> --help`` (no other option) is kept once rendered: a file in
    ``$XDG_CACHE_HOME/kdlab`` (default ``~/.cache/kdlab``) named by a hash of every kdlab source file's
    size and modification time and of the versions of the packages the parser reads signatures from, so
    any change to them renders it again. Building it imports torch, transformers and Lightning (about 9 s
    of CPU); reading it imports none of them."""
    import hashlib
    from importlib import metadata

    digest = hashlib.sha256(f"{sys.version_info[:2]}{__version__}".encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for name in HELP_CACHE_PACKAGES:
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=none;".encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdlab"
    return root / f"help-{command}-{digest.hexdigest()[:16]}.txt"


def cached_help(argv: list[str], run) -> None:
    """``kdlab fit|validate|test --help`` from :func:`help_cache_path`, rendered by ``run`` (which prints it
    and exits) and stored the first time."""
    import contextlib
    import io

    path = help_cache_path(argv[0])
    if path.is_file():
        sys.stdout.write(path.read_text(encoding="utf-8"))
        raise SystemExit(0)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            run()
    except SystemExit as done:
        sys.stdout.write(buffer.getvalue())
        if not done.code:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(path.name + f".{os.getpid()}.partial")
                partial.write_text(buffer.getvalue(), encoding="utf-8")
                partial.replace(path)
            except OSError:  # a read-only home: the help is still printed, just not kept
                pass
        raise


def function_cli(function, argv: list[str]):
    """``kdlab <argv[0]> ...`` as jsonargparse's ``auto_cli`` over ``function`` (its typed arguments become options), with
    a ``--help`` that says ``usage: kdlab <command>``, describes the command by the docstring's whole first paragraph
    (less a "Returns" sentence, which is for Python callers) and shows no docstring markup (:func:`clean_help`)."""
    import re

    from jsonargparse import ArgumentParser, auto_cli

    from kdlab.cli.help_text import clean_help

    paragraph = " ".join((function.__doc__ or "").split("\n\n")[0].split())
    description = clean_help(re.sub(r"\s*Returns [^.]*\.$", "", paragraph))

    class Parser(ArgumentParser):
        def format_help(self) -> str:
            self.description = description
            for action in self._actions:
                if action.help:
                    action.help = clean_help(action.help)
            return super().format_help()

    return auto_cli(function, args=argv[1:], parser_class=Parser, prog=f"kdlab {argv[0]}", allow_abbrev=False)


def main(args: list[str] | None = None, run: bool = True, raise_parse_errors: bool = False):
    """``kdlab generate ...`` writes teacher data; every other subcommand is LightningCLI's
    (``run=False``: parse and instantiate the model and trainer, then return without running).
    A command-line or config-file error exits with jsonargparse's message (``SystemExit(2)``), or with
    ``raise_parse_errors`` raises it (what :func:`entry` shortens to one line)."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help())
        return None
    if argv[0] == "--version":
        print(f"kdlab {__version__}")
        return None
    if argv[:1] == ["generate"]:
        from kdlab.rollouts.teacher_data import generate_teacher_data

        return function_cli(generate_teacher_data, argv)
    if argv[:1] == ["sweep"]:
        from kdlab.study.sweep import main as sweep

        return sweep(argv[1:])
    if argv[:1] == ["pipeline"]:
        from kdlab.study.pipeline import main as pipeline

        return pipeline(argv[1:])
    if argv[:1] == ["estimate"]:  # per-GPU memory of a fit's config, no weights read (kdlab.cli.estimate)
        from kdlab.cli.estimate import main as estimate

        return estimate(argv[1:])
    if argv[:1] == ["prune"]:  # a depth-pruned copy of a model (kdlab.models.pruning)
        from kdlab.cli.prune import prune_checkpoint

        return function_cli(prune_checkpoint, argv)
    if argv[:1] == ["forgetting"]:  # the lm-eval suite on a finished run, off the training loop
        from kdlab.evaluation.forgetting_run import main as forgetting

        return forgetting(argv[1:])
    if argv[:1] == ["report"]:
        from kdlab.study.report import main as report

        return report(argv[1:])
    if argv[0] not in (*LIGHTNING_COMMANDS, "predict") and not argv[0].startswith("-"):
        from kdlab.cli.config_errors import ConfigError, nearest

        raise ConfigError(f"unknown command {argv[0]!r}{nearest(argv[0], list(COMMANDS))}; kdlab --help lists them")
    if len(argv) == 2 and argv[0] in LIGHTNING_COMMANDS and argv[1] in ("-h", "--help"):
        return cached_help(argv, lambda: run_lightning(argv, run=run, raise_parse_errors=raise_parse_errors, from_sys_argv=args is None))
    return run_lightning(argv, run=run, raise_parse_errors=raise_parse_errors, from_sys_argv=args is None)


def entry(args: list[str] | None = None) -> None:
    """The ``kdlab`` console script: exit status 0 on success (``main``'s return value is for Python
    callers). A configuration error ends in one line, ``kdlab: error: <key>: <cause>``, and exit status
    2 (:mod:`kdlab.cli.config_errors`); ``KDLAB_TRACEBACK=1`` or ``--traceback`` shows the traceback."""
    argv = sys.argv[1:] if args is None else list(args)
    show_traceback = os.environ.get("KDLAB_TRACEBACK", "") not in ("", "0") or "--traceback" in argv
    sys.argv[1:] = [arg for arg in argv if arg != "--traceback"]
    try:
        main(raise_parse_errors=True)
    except Exception as error:  # noqa: BLE001 - shortened only when it is a configuration error
        from kdlab.cli.config_errors import short_message

        message = None if show_traceback else short_message(error)
        if message is None:
            raise
        message += overlay_hint(sys.argv[1:])
        sys.stdout.flush()
        print(f"kdlab: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
