"""Every run's ``kdlab fit`` configuration checked before any run of a sweep or pipeline starts.

A sweep (or pipeline) expands into runs whose configurations are the base files, the overrides and each run's grid
values. :func:`check_fit_configs` parses each with ``kdlab fit``'s own parser (nothing is instantiated), so a misspelt
key or a bad value stops the whole command in one line before the first run trains, rather than after the runs before
it have.
"""

from __future__ import annotations

import json
import sys

from kdlab.errors import ConfigError
from kdlab.study.grid import Run, Sweep, fit_args


def check_fit_configs(sweep: Sweep, runs: list[Run], where: str = "") -> None:
    """Every run's ``kdlab fit`` configuration (the base files, the overrides and its grid values) parsed by kdlab fit's own
    parser (:func:`~kdlab.cli.lightning.parse_fit_config`: nothing is instantiated) before any run starts, so a misspelt key
    or a bad value fails in one line (``ConfigError``: ``run <where><name>: <key>: <cause>``) instead of after the runs
    before it trained. Runs that differ only in their seed are parsed once."""
    from kdlab.cli.lightning import parse_fit_config

    parsed = set()
    for run in runs:
        settings = json.dumps(run.settings, sort_keys=True, default=str)
        if settings in parsed:
            continue
        parsed.add(settings)
        try:
            parse_fit_config(fit_args(sweep, run)[1:])
        except ConfigError as error:
            raise ConfigError(f"run {where}{run.name}: {error}") from error


def fit_configs_or_exit(stages: list[tuple[Sweep, list[Run], str]], command: str) -> None:
    """:func:`check_fit_configs` for each (sweep, runs, where), or ``<command>: error: run <where><name>: <key>: <cause>``
    alone on stderr and exit status 2 (no usage: the command line was right, a run's configuration was not)."""
    try:
        for sweep, runs, where in stages:
            check_fit_configs(sweep, runs, where)
    except ConfigError as error:
        sys.stdout.flush()
        print(f"{command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
