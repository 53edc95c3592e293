"""``kdlab fit|validate|test --config X.yaml``: LightningCLI over :class:`~kdlab.module.DistillModule`.

Components (``task``, ``rollout``, ``objective``) are chosen with ``class_path``/``init_args``;
``--print_config`` shows every knob. TensorBoard is the default logger; ``seed_everything``
(default 42) also seeds the module's rollout and sampling streams unless ``model.seed`` is set.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from kdlab.module import DistillModule


class KDLabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("seed_everything", "model.seed")


def main(args: list[str] | None = None) -> KDLabCLI:
    return KDLabCLI(
        DistillModule,
        seed_everything_default=42,
        trainer_defaults={"default_root_dir": "runs"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
