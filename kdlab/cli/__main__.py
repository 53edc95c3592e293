"""``python -m kdlab.cli ...``: the ``kdlab`` command (what ``kdlab sweep`` starts in ``processes`` mode)."""

from kdlab.cli.main import main

main()
