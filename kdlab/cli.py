"""``kdlab fit|validate|test --config X.yaml``: LightningCLI over :class:`~kdlab.module.DistillModule`, or
over any LightningModule (:class:`~kdlab.grpo.GRPOModule` for RLVR, :class:`~kdlab.sft.SFTModule` for
teacher training) when a config names one with ``model: {class_path: ..., init_args: {...}}``;
``kdlab generate --config X.yaml``: teacher data for off-policy runs (:mod:`kdlab.teacher_data`);
``kdlab sweep --config S.yaml``: a grid of fit runs (:mod:`kdlab.sweep`);
``kdlab pipeline --config P.yaml``: distillation runs, then RLVR from each (:mod:`kdlab.pipeline`);
``kdlab prune --model M --layers every_other --output DIR``: a depth-pruned student (:mod:`kdlab.pruning`);
``kdlab report RUN_DIR...``: the paper's tables and figures from finished runs (:mod:`kdlab.report`).

Components (``task``, ``rollout``, ``objective``) are chosen with ``class_path``/``init_args``;
``--print_config`` shows every knob. TensorBoard is the default logger; ``seed_everything``
(default 42) is linked to ``model.seed``, so it also seeds the module's rollout and sampling streams.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import LightningCLI

from kdlab.checkpointing import FinalCheckpoint
from kdlab.module import DistillModule


class KDLabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("seed_everything", "model.init_args.seed" if self.subclass_mode_model else "model.seed")

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
        ckpt_path = config.get("ckpt_path") if config is not None and self.subcommand == "fit" else None
        logger = config.get("trainer.logger") if ckpt_path else None
        if not ckpt_path or not hasattr(logger, "get") or not str(logger.get("class_path", "")).endswith(("TensorBoardLogger", "CSVLogger")):
            return
        args = logger.get("init_args")
        if args is None or args.get("version") is not None:
            return
        from kdlab.checkpointing import resume_version

        version = resume_version(args.get("save_dir") or ".", args.get("name") or "lightning_logs", ckpt_path)
        if version is not None:
            args["version"] = version

    def before_fit(self) -> None:
        """Every fit ends with a checkpoint of its final state (see :mod:`kdlab.checkpointing`); a resumed
        fit first removes what the interrupted run logged after its checkpoint."""
        if not any(isinstance(callback, FinalCheckpoint) for callback in self.trainer.callbacks):
            self.trainer.callbacks.append(FinalCheckpoint())
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path and self.trainer.is_global_zero and self.trainer.log_dir:
            from kdlab.checkpointing import log_position, trim_logs

            position = log_position(ckpt_path)
            if position is not None and Path(self.trainer.log_dir).is_dir():
                trim_logs(self.trainer.log_dir, position)


def names_model_class(argv: list[str]) -> bool:
    """Whether a ``--config`` file (or ``--model.class_path``) in ``argv`` chooses the stage class."""
    if any(arg.startswith("--model.class_path") for arg in argv):
        return True
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--config", "-c")]
    paths += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    for path in paths:
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue  # LightningCLI reports the bad file itself
        model = config.get("model") if isinstance(config, dict) else None
        if isinstance(model, dict) and "class_path" in model:
            return True
    return False


def main(args: list[str] | None = None, run: bool = True):
    """``kdlab generate ...`` writes teacher data; every other subcommand is LightningCLI's
    (``run=False``: parse and instantiate the model and trainer, then return without running)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["generate"]:
        from jsonargparse import auto_cli

        from kdlab.teacher_data import generate_teacher_data

        return auto_cli(generate_teacher_data, args=argv[1:])
    if argv[:1] == ["sweep"]:
        from kdlab.sweep import main as sweep

        return sweep(argv[1:])
    if argv[:1] == ["pipeline"]:
        from kdlab.pipeline import main as pipeline

        return pipeline(argv[1:])
    if argv[:1] == ["prune"]:  # a depth-pruned copy of a model (kdlab.pruning)
        from jsonargparse import auto_cli

        from kdlab.pruning import prune_checkpoint

        return auto_cli(prune_checkpoint, args=argv[1:])
    if argv[:1] == ["report"]:
        from kdlab.report import main as report

        return report(argv[1:])
    stage_class = names_model_class(argv)
    return KDLabCLI(
        pl.LightningModule if stage_class else DistillModule,
        subclass_mode_model=stage_class,
        seed_everything_default=42,
        trainer_defaults={"default_root_dir": "runs"},
        save_config_kwargs={"overwrite": True},
        args=(argv[1:] if not run and argv[:1] in (["fit"], ["validate"], ["test"]) else args),
        run=run,
    )


if __name__ == "__main__":
    main()


def entry() -> None:
    """The ``kdlab`` console script: exit status 0 on success (``main``'s return value is for Python callers)."""
    main()
