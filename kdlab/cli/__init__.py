"""The ``kdlab`` command: :mod:`kdlab.cli.main` dispatches (``kdlab fit|generate|sweep|...``);
:mod:`kdlab.cli.lightning` is LightningCLI over the stages; :mod:`kdlab.cli.console`,
:mod:`kdlab.cli.config_errors`, :mod:`kdlab.cli.resume` and :mod:`kdlab.cli.prune` serve it."""
