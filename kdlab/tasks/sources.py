"""Where the real-data tasks get their rows: one loader for local files and Hugging Face Hub datasets.

Every real task (:mod:`kdlab.tasks.multiple_choice`, :mod:`kdlab.tasks.math`) reads its rows through
:func:`load_rows`, so a test or an offline machine can point any task at a local file in the dataset's
own column layout (``tests/fixtures/`` holds one per dataset), and a run on a connected machine reads
the same columns from the Hub.

A ``source`` is local when it names an existing path, ends in a data-file suffix
(``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or starts with ``/``, ``./``, ``../`` or ``~``;
anything else (``"openai/gsm8k"``) is a Hub dataset id. A local *file* holds exactly one split, so
``split`` is only a label for it; a local *directory* is read with ``datasets``' own split
inference (``train.jsonl``, ``test.jsonl``, ...), and ``split`` picks one of its splits.

:func:`hashed_order` is the deterministic shuffle the tasks use where a dataset publishes no split
of its own (SciKnowEval, MedReason) or a subset must be drawn (Numina-MATH).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

FILE_BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> the ``datasets`` packaged builder that reads it."""

_LOCAL_PREFIXES = ("/", "./", "../", "~")


def is_local(source: str) -> bool:
    """Whether ``source`` names a local file or directory rather than a Hub dataset id."""
    return (
        Path(source).expanduser().exists()
        or source.startswith(_LOCAL_PREFIXES)
        or Path(source).suffix.lower() in FILE_BUILDERS
    )


def load_rows(source: str, split: str, *, config: str | None = None, revision: str | None = None) -> list[dict]:
    """The rows of ``split`` of ``source`` as plain dicts, in the source's order.

    Args:
        source: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a local directory of
            such files, or a Hub dataset id (``"openai/gsm8k"``).
        split: the split to read. A local file holds one split and ignores the name; a directory or
            Hub dataset must have a split of that name.
        config: Hub configuration name (``"main"`` for GSM8K, ``"Chemistry"`` for SciKnowEval);
            ignored for local files.
        revision: Hub branch, tag or commit to pin; ignored for local sources.

    Raises:
        FileNotFoundError: ``source`` looks local but does not exist (the message names the path).
        ValueError: a local file with an unreadable suffix.
    """
    import datasets  # imported here: only the real tasks need it, and it is slow to import

    if is_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist (resolved to {path.resolve()})")
        if path.is_dir():
            table = datasets.load_dataset(str(path), split=split)
        else:
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"data source {source!r}: cannot read {path.suffix!r} files; use one of {tuple(FILE_BUILDERS)}"
                )
            # The file is the split: map it to the requested name so `split=` selects it.
            table = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    else:
        table = datasets.load_dataset(source, config, split=split, revision=revision)
    return table.to_list()


class UnresolvedAnswer(ValueError):
    """A row whose reference answer cannot be established (an answer letter that is not an option,
    answer text naming no option or several, a solution without a boxed answer). Tasks with an
    ``unmatched`` setting drop such rows when it is ``"skip"``."""


def require_fields(source: str, rows: Iterable[tuple[int, dict]], fields: Sequence[str]) -> None:
    """Check that every ``(index, row)`` has each of ``fields`` with a value that is not ``None``.

    ``datasets`` fills a column that some rows lack with ``None``, so an absent key and a ``None``
    value are the same fault. Raises ``ValueError("<source> row <i>: missing field '<name>'")``.
    """
    for index, row in rows:
        for name in fields:
            if row.get(name) is None:
                raise ValueError(f"{source} row {index}: missing field {name!r}")


def hashed_order(keys: Sequence[str], seed: int) -> list[int]:
    """Indices ``0..len(keys)-1`` sorted by ``sha256(f"{seed}\\x1f{key}")``, ties by index.

    A shuffle that depends on each row's content, not on its position: rows added, removed or
    reordered upstream leave every other row's relative order unchanged, and identical rows (same
    key) sit next to each other, so a prefix/suffix split never puts a duplicate on both sides
    (except for a tie group cut at the boundary, which the tie-break by index makes deterministic).
    """

    def rank(index: int) -> tuple[str, int]:
        return hashlib.sha256(f"{seed}\x1f{keys[index]}".encode()).hexdigest(), index

    return sorted(range(len(keys)), key=rank)


def split_by_fraction(keys: Sequence[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train_indices, eval_indices)``: the first ``round(fraction * n)`` of :func:`hashed_order` are eval.

    Both lists keep the hashed order, so "the first N" of either is a uniform-looking sample rather
    than the head of a file that may be grouped by topic.
    """
    order = hashed_order(keys, seed)
    cut = round(fraction * len(order))
    return order[cut:], order[:cut]
