"""LightningCLI over kdlab's stages (``kdlab fit|validate|test``): the config's ``model`` is a
:class:`~kdlab.stages.distill.DistillModule` unless it names another LightningModule by ``class_path``;
``seed_everything`` is linked to the module's seed; every fit ends with :class:`~kdlab.callbacks.FinalCheckpoint` and saves on an exception with
:class:`~kdlab.callbacks.ExceptionCheckpoint`.
Also the checks and messages around it: ``hf://`` paths, overlay hints (``--help``'s text: :mod:`kdlab.cli.help_text`)."""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml

from kdlab.cli.help_text import clean_help, clean_help_output, plain_help  # noqa: F401 - clean_help: its old home

LIGHTNING_COMMANDS = ("fit", "validate", "test")
# jsonargparse's ways of saying a key of the parser does not exist (on the command line, in a config file); a class's
# argument that does not exist ("Option 'lamda' is not accepted") is left to config_errors, which names the class's arguments
UNKNOWN_KEY = re.compile(r"unrecognized arguments: --?([\w.]+)|does not accept option '([\w.]+)'|Key '([\w.]+)' is not expected")


def lightning_cli_class():
    """:class:`KDLabCLI`, defined on first use so that ``kdlab --help`` and the other commands do not
    import Lightning."""
    global KDLabCLI
    if "KDLabCLI" in globals():
        return KDLabCLI
    from lightning.pytorch.cli import LightningCLI

    from kdlab.callbacks.checkpoints import ExceptionCheckpoint, FinalCheckpoint, checkpoint_directory

    class KDLabCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("seed_everything", "model.init_args.seed" if self.subclass_mode_model else "model.seed")

        only_subcommand: str | None = None  # set by run_lightning: the one subcommand parser to build

        def _add_subcommands(self, parser, **kwargs) -> None:
            """Only the parser of the subcommand given (``fit``): building all four (fit, validate, test,
            predict) took most of the time ``kdlab fit --help`` and every run spend parsing."""
            every = type(self).subcommands
            if self.only_subcommand in every():
                self.subcommands = lambda: {self.only_subcommand: every()[self.only_subcommand]}
            try:
                super()._add_subcommands(parser, **kwargs)
            finally:
                self.__dict__.pop("subcommands", None)

        def parse_arguments(self, parser, args) -> None:
            """An unknown key (``--model.lrr``, or ``lrr:`` in a config file) fails naming it and the
            nearest key the command accepts. ``--help`` is plain text led by the model's arguments
            (:func:`plain_help`)."""
            if any(arg in ("-h", "--help") for arg in (args if args is not None else sys.argv[1:])):
                for name, subparser in self._subcommand_parsers.items():
                    plain_help(subparser, f"kdlab {name}")
            try:
                parse_overlaid(self, parser, args)
            except Exception as error:
                from kdlab.cli.config_errors import ConfigError, nearest

                unknown = UNKNOWN_KEY.search(str(error))
                command = next((name for name in self._subcommand_parsers if name in (args or sys.argv[1:])[:1]), None)
                if unknown is None or command is None:
                    raise
                key = next(group for group in unknown.groups() if group)
                keys = [action.dest for action in self._subcommand_parsers[command]._actions if "." in action.dest or action.dest.isidentifier()]
                raise ConfigError(f"{key}: no such key for kdlab {command}{nearest(key, keys)}") from error

        def _parse_ckpt_path(self) -> None:
            """``--ckpt_path``: a missing file or one that is not a checkpoint fails naming the option, before any
            weights load (:func:`~kdlab.cli.resume.check_ckpt_path`). Lightning reads the whole file here to merge
            the module's saved hyperparameters into the config; kdlab's stages save none, so a checkpoint without
            them is only opened memory-mapped (a 7B run's full state is tens of GB) and not read twice."""
            from kdlab.cli.resume import check_ckpt_path, saved_hyperparameters

            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            check_ckpt_path(ckpt_path)
            if ckpt_path and Path(ckpt_path).is_file() and not saved_hyperparameters(ckpt_path):
                return
            super()._parse_ckpt_path()

        def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
            """Checkpoints are read with ``weights_only=True`` (no arbitrary unpickling) unless the command
            line says ``--weights_only=false``."""
            kwargs = super()._prepare_subcommand_kwargs(subcommand)
            if "weights_only" in kwargs and kwargs["weights_only"] is None:
                kwargs["weights_only"] = True
            return kwargs

        def before_instantiate_classes(self) -> None:
            """``fit --ckpt_path <save_dir>/<name>/version_N/...``: the TensorBoard or CSV logger continues in
            ``version_N`` (unless the config names a version), so a resumed run is one run directory."""
            config = self.config.get(self.subcommand) if self.subcommand else None
            if config is not None:
                from kdlab.cli.extras import check_extras

                check_extras(config)  # an optional package the config needs, named before anything loads
                check_hub_paths(config)
            if config is not None and self.subcommand == "fit":  # before any weights are read (kdlab estimate's arithmetic)
                from kdlab.study.estimate import warn_if_it_cannot_fit

                warn_if_it_cannot_fit(config)
            ckpt_path = config.get("ckpt_path") if config is not None and self.subcommand == "fit" else None
            logger = config.get("trainer.logger") if ckpt_path else None
            if not ckpt_path or not hasattr(logger, "get") or not str(logger.get("class_path", "")).endswith(("TensorBoardLogger", "CSVLogger")):
                return
            args = logger.get("init_args")
            if args is None or args.get("version") is not None:
                return
            from kdlab.cli.resume import resume_version

            version = resume_version(args.get("save_dir") or ".", args.get("name") or "lightning_logs", ckpt_path)
            if version is not None:
                args["version"] = version

        def _run_subcommand(self, subcommand: str) -> None:
            """A fit that stops before its first optimiser step leaves no ``version_N`` behind
            (:func:`remove_unstarted_run`): the next run takes its number."""
            log_dir = getattr(getattr(self.trainer, "logger", None), "log_dir", None)
            existed = bool(log_dir) and Path(log_dir).exists()  # another run's folder (an explicit version): never removed
            try:
                super()._run_subcommand(subcommand)
            except BaseException:
                if subcommand == "fit" and not self.config_init[subcommand].get("ckpt_path") and not existed:
                    remove_unstarted_run(self.trainer)
                raise

        def before_fit(self) -> None:
            """Every fit ends with ``final.ckpt``, its final weights, and saves its full state on an exception
            (:mod:`kdlab.callbacks.checkpoints`); ``last.ckpt`` links to the periodic file of its step
            (:func:`link_last_checkpoints`); a resumed fit first removes what the interrupted run logged after
            its checkpoint (:mod:`kdlab.cli.resume`)."""
            from kdlab.runlog import Console

            if not any(isinstance(callback, FinalCheckpoint) for callback in self.trainer.callbacks):
                self.trainer.callbacks.insert(0, FinalCheckpoint())  # first: its --ckpt_path check precedes other start-of-fit work
            if not any(isinstance(callback, ExceptionCheckpoint) for callback in self.trainer.callbacks):
                self.trainer.callbacks.append(ExceptionCheckpoint())
            link_last_checkpoints(self.trainer)
            if not any(isinstance(callback, Console) for callback in self.trainer.callbacks):
                self.trainer.callbacks.append(Console())
            check = getattr(self.model, "training_examples", None)
            if check is not None:  # before any run directory, "before" evaluation or model placement
                check()
            ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
            self.check_run_directory(ckpt_path)
            if ckpt_path:  # resuming into its own run directory: its checkpoints are expected there
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            if ckpt_path and self.trainer.is_global_zero and self.trainer.log_dir:
                from kdlab.cli.resume import log_position, trim_logs

                position = log_position(ckpt_path)
                if position is not None and Path(self.trainer.log_dir).is_dir():
                    trim_logs(self.trainer.log_dir, position)

        def check_run_directory(self, ckpt_path: str | None) -> None:
            """A fresh fit into a folder holding checkpoints is refused; a resumed one must keep the settings its
            run's ``config.yaml`` has (:mod:`kdlab.cli.resume`). Every process reads the folder itself (before any
            process group exists), so all refuse alike where the run folder is on a file system they share."""
            import yaml

            from kdlab.cli.resume import check_fresh_run_directory, check_no_requeue_state, check_resumed_settings

            if not ckpt_path:
                check_fresh_run_directory(checkpoint_directory(self.trainer))
                check_no_requeue_state(Path(self.trainer.default_root_dir))
            elif self.trainer.log_dir:
                now = yaml.safe_load(self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False))
                check_resumed_settings(Path(self.trainer.log_dir) / "config.yaml", now)

        def before_validate(self) -> None:
            self.say_which_weights()
            self.record_evaluation()

        def before_test(self) -> None:
            self.say_which_weights()
            self.record_evaluation()

        def record_evaluation(self) -> None:
            """``kdlab validate|test`` writes a folder of its own (``config.yaml``, ``metrics.jsonl``, ``samples/``): say
            where, and mark it in its ``run_info.json`` as this command's, so ``kdlab report`` names it as an evaluation,
            not an unfinished run (:func:`kdlab.provenance.evaluation_command`)."""
            log_dir = self.trainer.log_dir
            if not log_dir or not self.trainer.is_global_zero:
                return
            from kdlab.provenance import write_run_info

            write_run_info(log_dir, command=self.subcommand)
            print(f"[kdlab] {self.subcommand} writes to {log_dir}", flush=True)

        def say_which_weights(self) -> None:
            """``kdlab validate|test`` without ``--ckpt_path`` scores the weights the config names, not a trained run's."""
            if not self.config_init[self.subcommand].get("ckpt_path") and self.trainer.is_global_zero:
                role = getattr(self.model, "trained_role", "student")
                spec = getattr(self.model, "student_spec", None) or getattr(self.model, "spec", None)
                weights = f"{role}.checkpoint={spec.checkpoint!r}" if getattr(spec, "checkpoint", None) else f"{role}.path={getattr(spec, 'path', '?')!r}"
                print(f"[kdlab] {self.subcommand} without --ckpt_path scores the weights the config names ({weights})",
                      file=sys.stderr, flush=True)

    return KDLabCLI


class _Parsed(Exception):
    def __init__(self, config: Any) -> None:
        super().__init__("parsed")
        self.config = config


def parse_fit_config(argv: list[str], command: str = "kdlab fit") -> dict[str, Any]:
    """The configuration ``kdlab fit <argv>`` would run (``argv`` without ``fit``), parsed by its own parser before
    any class is instantiated (no model is built, no weights read), as a plain dict. A configuration error raises
    :class:`~kdlab.errors.ConfigError` with its one line (:func:`kdlab.cli.config_errors.short_message`): a key that
    does not exist ``<key>: no such key for <command> (did you mean ...?)``, a bad value its key and cause."""
    import lightning.pytorch as pl

    from kdlab.cli.config_errors import ConfigError, nearest, short_message
    from kdlab.stages.distill import DistillModule

    class ParseOnly(lightning_cli_class()):
        def parse_arguments(self, parser, args) -> None:
            try:
                parse_overlaid(self, parser, args)
            except Exception as error:
                unknown = UNKNOWN_KEY.search(str(error))
                if unknown is None:
                    raise
                key = next(group for group in unknown.groups() if group)
                keys = [action.dest for action in parser._actions if "." in action.dest or action.dest.isidentifier()]
                raise ConfigError(f"{key}: no such key for {command}{nearest(key, keys)}") from error

        def _set_seed(self) -> None:
            """Nothing to seed: no run follows."""

        def before_instantiate_classes(self) -> None:
            raise _Parsed(self.config)

    stage_class = names_model_class(argv)
    try:
        ParseOnly(pl.LightningModule if stage_class else DistillModule, subclass_mode_model=stage_class, seed_everything_default=42,
                  args=argv, run=False, parser_kwargs={"exit_on_error": False, "allow_abbrev": False})  # as kdlab fit: no prefixes of keys
    except _Parsed as parsed:
        return parsed.config.as_dict()
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - a configuration error gets its one line; anything else propagates
        message = short_message(error)
        if message is None:
            raise
        raise ConfigError(message) from error
    raise RuntimeError("the fit parser returned without a configuration")  # pragma: no cover


def parse_overlaid(cli: Any, parser: Any, args: Any) -> None:
    """``LightningCLI.parse_arguments`` on :func:`teacher_overlays` of the command line (``args``, or
    ``sys.argv[1:]`` when None) into ``cli.config``. Parsed here rather than by handing the rewritten list to
    Lightning's own method: given a list while ``sys.argv`` holds the command too, that warns on every run that
    "args" and command-line arguments were both given (they are one command line, rewritten)."""
    from jsonargparse import Namespace

    if isinstance(args, (dict, Namespace)):
        cli.config = parser.parse_object(args)
    else:
        cli.config = parser.parse_args(teacher_overlays(list(sys.argv[1:] if args is None else args)))


def teacher_overlays(args: list[str]) -> list[str]:
    """``args`` with ``--model.teacher=null`` before each config file (or ``--model.teacher=<class path>``) that gives
    ``model.teacher`` as a teacher source (``class_path``) after an earlier one gave it as a model (``{path: ...}``):
    jsonargparse would otherwise merge the two and lose the class (a teacher source replaces a teacher model, as a
    later value replaces an earlier one)."""
    import yaml

    out, previous = [], None
    for index, arg in enumerate(args):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else args[index + 1] if arg == "--config" and index + 1 < len(args) else None
        if path is not None and Path(path).is_file():
            try:
                model = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}).get("model") or {}
            except (yaml.YAMLError, AttributeError):
                model = {}
            teacher = model.get("teacher", "absent") if isinstance(model, dict) else "absent"
            if isinstance(teacher, dict) and "class_path" in teacher and isinstance(previous, dict) and "class_path" not in previous:
                out.append("--model.teacher=null")
            previous = previous if teacher == "absent" else teacher
        elif arg.startswith("--model.teacher="):
            value = arg.split("=", 1)[1]
            if re.fullmatch(r"[\w.]+\.[A-Z]\w*", value) and isinstance(previous, dict) and "class_path" not in previous:
                out.append("--model.teacher=null")  # a class given on the command line replaces a model spec too
            previous = {"class_path": value} if re.fullmatch(r"[\w.]+\.[A-Z]\w*", value) else value
        out.append(arg)
    return out


def remove_unstarted_run(trainer) -> None:
    """After a fresh fit stopped before its first optimiser step: remove its run directory, a
    ``version_N`` folder its logger opened, when it holds no checkpoint (there is nothing to resume, and
    a crashed run used up a version number); say so. Rank 0 of one process only; a folder not named
    ``version_N`` (a sweep's run directory) is left alone."""
    import shutil

    logger = trainer.logger
    log_dir = getattr(logger, "log_dir", None) if logger is not None else None
    if trainer.global_step != 0 or trainer.world_size != 1 or not log_dir or not re.fullmatch(r"version_\d+", Path(log_dir).name):
        return
    if not Path(log_dir).is_dir() or any(Path(log_dir).rglob("*.ckpt")):
        return
    shutil.rmtree(log_dir)
    print(f"[kdlab] removed {log_dir}: the run stopped before its first optimiser step, nothing to resume", file=sys.stderr, flush=True)


def link_last_checkpoints(trainer) -> None:
    """``ModelCheckpoint(save_last=True)`` without a ``monitor`` (each of its saves is the newest step's
    full state) on a local folder: ``last.ckpt`` becomes a relative symbolic link to the newest file it
    saved (Lightning's ``save_last="link"``), the state ``save_last=True`` would copy there, instead of a
    second full copy of that step (at the end of the quickstart, ``epoch=0-step=150.ckpt`` and
    ``last.ckpt``); before its first file it is written in full. A monitored checkpoint keeps its copy
    (its newest file can be an older best one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.callbacks:
        if type(callback) is not ModelCheckpoint or callback.save_last is not True:
            continue
        where = str(callback.dirpath or getattr(trainer.logger, "save_dir", None) or trainer.default_root_dir)
        if callback.monitor is None and callback.save_top_k != 0 and ("://" not in where or where.startswith("file://")):
            callback.save_last = "link"


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def check_hub_paths(config) -> None:
    """Fail at once, naming the key, when a ``kdlab://`` model ``path`` is not a packaged one (listing
    those), or when a model ``path`` (``model.student.path``, ...) is neither a
    local folder, nor ``kdlab://``, nor in the Hugging Face cache, so loading it needs the model hub,
    and the hub cannot be reached (offline mode, or no connection within 5 s): otherwise transformers
    retries for about a minute and then names no key."""
    from kdlab.cli.config_errors import ConfigError, nearest
    from kdlab.models.loading import ASSETS as assets

    needed = []
    packaged = sorted(f"kdlab://{family.name}/{model.name}" for family in assets.iterdir() if family.is_dir() for model in family.iterdir() if model.is_dir())
    for key, value in config.items():
        if key.rsplit(".", 1)[-1] != "path" or not isinstance(value, str):
            continue
        if value.startswith("kdlab://") and value.rstrip("/") not in packaged:
            raise ConfigError(f"{key}={value!r} is not a packaged model{nearest(value, packaged)}; packaged: {', '.join(packaged)}")
        if HUB_ID.match(value) and not Path(value).exists():
            needed.append((key, value))
    if not needed:
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        needed = [(key, value) for key, value in needed if not isinstance(try_to_load_from_cache(value, "config.json"), str)]
    except Exception:  # noqa: BLE001 - no cache to consult: the hub is needed
        pass
    if not needed:
        return
    key, value = needed[0]
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "") not in ("", "0"):
        why = "HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE forbid the model hub"
    else:
        import socket

        try:
            socket.create_connection(("huggingface.co", 443), timeout=5).close()
            return
        except OSError as error:
            why = f"the model hub (huggingface.co) cannot be reached ({error})"
    raise ConfigError(
        f"{key}={value!r} is not a local folder, kdlab:// model or cached download, so it needs the model hub, and {why}; "
        f"point {key} at a local folder holding the model (config.json, weights, tokenizer)"
    )


def config_paths(argv: list[str]) -> list[str]:
    """The ``--config`` / ``-c`` files of a command line, in order."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--config", "-c")]
    return paths + [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]


def overlay_hint(argv: list[str]) -> str:
    """``"; X.yaml is an overlay: run kdlab fit --config B.yaml --config X.yaml"`` when a config file's
    first line (its command) puts other config files before it that the command line lacks, else ``""``."""
    given = [Path(path).resolve() for path in config_paths(argv)]
    for path in config_paths(argv):
        try:
            first = Path(path).read_text(encoding="utf-8").splitlines()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        command = first.lstrip("# ").strip()
        bases = config_paths(command.split())
        own = [base for base in bases if Path(base).name == Path(path).name]
        missing = [base for base in bases[: bases.index(own[0])] if Path(base).resolve() not in given] if own else []
        if command.startswith("kdlab ") and missing:
            return f"; {path} is an overlay of {', '.join(missing)}: run `{command}`"
    return ""


def names_model_class(argv: list[str]) -> bool:
    """Whether a ``--config`` file (or ``--model.class_path``) in ``argv`` chooses the stage class."""
    if any(arg.startswith("--model.class_path") for arg in argv):
        return True
    for path in config_paths(argv):
        from kdlab.cli.config_errors import ConfigError

        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise ConfigError(f"--config {path}: cannot be read ({error.strerror or error})") from error
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(f"--config {path}:{line}: not valid YAML ({problem})") from error
        model = config.get("model") if isinstance(config, dict) else None
        if isinstance(model, dict) and "class_path" in model:
            return True
    return False


def run_lightning(argv: list[str], run: bool = True, raise_parse_errors: bool = False, from_sys_argv: bool = False):
    """``kdlab fit|validate|test ...`` (``argv`` starts with the subcommand): LightningCLI over
    :class:`~kdlab.stages.distill.DistillModule`, or over the LightningModule the config names.
    ``run=False`` parses and instantiates, then returns; ``from_sys_argv``: LightningCLI reads
    ``sys.argv`` itself (what ``run_info.json`` records as the command line)."""
    stage_class = names_model_class(argv)
    import lightning.pytorch as pl

    from kdlab.cli.console import choose_cpu_threads
    from kdlab.runlog import quiet

    quiet()
    # nothing but the config may reach stdout under --print_config (it is read back as YAML)
    printing = any(a in ("-h", "--help") or a.startswith("--print_config") for a in argv)
    threads = choose_cpu_threads() if argv[0] in LIGHTNING_COMMANDS and not printing else None
    if threads:
        print(threads, flush=True)

    from kdlab.stages.distill import DistillModule

    # allow_abbrev=False: --trainer.max_step=2 is an unknown key (with its nearest name), not max_steps
    subcommand_kwargs = {"exit_on_error": not raise_parse_errors, "allow_abbrev": False}
    cli_args = argv[1:] if not run and argv[:1] in (["fit"], ["validate"], ["test"]) else (None if from_sys_argv else argv)
    cli_class = lightning_cli_class()
    cli_class.only_subcommand = argv[0]
    with clean_help_output(argv):
        return cli_class(
            pl.LightningModule if stage_class else DistillModule,
            subclass_mode_model=stage_class,
            seed_everything_default=42,
            trainer_defaults={"default_root_dir": "runs", "enable_progress_bar": sys.stdout.isatty()},  # else Console's lines
            save_config_kwargs={"overwrite": True},
            parser_kwargs={**subcommand_kwargs, **{name: dict(subcommand_kwargs) for name in (*LIGHTNING_COMMANDS, "predict")}},
            args=cli_args,
            run=run,
        )

