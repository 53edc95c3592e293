"""``ConfigError``: a configuration mistake kdlab found itself, whose message already names the key or file.

It lives in the shared layer so any part of kdlab (a callback that refuses a checkpoint, a stage) can raise
it; ``kdlab``'s command line (:mod:`kdlab.cli.config_errors`) prints its message alone, without a traceback."""


class ConfigError(ValueError):
    """A configuration mistake found by kdlab itself; its message already names the key or file."""
