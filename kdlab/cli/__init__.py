"""The ``kdlab`` command: :mod:`kdlab.cli.main` dispatches (``kdlab fit|generate|sweep|...``);
:mod:`kdlab.cli.lightning` is LightningCLI over the stages; :mod:`kdlab.cli.console`,
:mod:`kdlab.cli.config_errors`, :mod:`kdlab.cli.resume` and :mod:`kdlab.cli.prune` serve it."""


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
