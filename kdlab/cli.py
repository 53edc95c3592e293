"""``kdlab fit|validate|test --config X.yaml``: LightningCLI over :class:`~kdlab.module.DistillModule`;
``kdlab generate --config X.yaml``: teacher data for off-policy runs (:mod:`kdlab.teacher_data`);
``kdlab sweep --config S.yaml``: a grid of fit runs (:mod:`kdlab.sweep`);
``kdlab report RUN_DIR...``: the paper's tables and figures from finished runs (:mod:`kdlab.report`).

Components (``task``, ``rollout``, ``objective``) are chosen with ``class_path``/``init_args``;
``--print_config`` shows every knob. TensorBoard is the default logger; ``seed_everything``
(default 42) is linked to ``model.seed``, so it also seeds the module's rollout and sampling streams.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from kdlab.checkpointing import FinalCheckpoint
from kdlab.module import DistillModule


class KDLabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("seed_everything", "model.seed")

    def before_fit(self) -> None:
        """Every fit ends with a checkpoint of its final state (see :mod:`kdlab.checkpointing`)."""
        if not any(isinstance(callback, FinalCheckpoint) for callback in self.trainer.callbacks):
            self.trainer.callbacks.append(FinalCheckpoint())


def main(args: list[str] | None = None):
    """``kdlab generate ...`` writes teacher data; every other subcommand is LightningCLI's."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["generate"]:
        from jsonargparse import auto_cli

        from kdlab.teacher_data import generate_teacher_data

        return auto_cli(generate_teacher_data, args=argv[1:])
    if argv[:1] == ["sweep"]:
        from kdlab.sweep import main as sweep

        return sweep(argv[1:])
    if argv[:1] == ["report"]:
        from kdlab.report import main as report

        return report(argv[1:])
    return KDLabCLI(
        DistillModule,
        seed_everything_default=42,
        trainer_defaults={"default_root_dir": "runs"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()


def entry() -> None:
    """The ``kdlab`` console script: exit status 0 on success (``main``'s return value is for Python callers)."""
    main()
