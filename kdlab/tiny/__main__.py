"""``python -m kdlab.tiny random|world|student [--out DIR]``: rebuild the packaged tiny models.

``student`` rebuilds the tiny world's student only, keeping the teacher and tokenizer in DIR."""

from __future__ import annotations

import argparse
from pathlib import Path

from kdlab.models import ASSETS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kdlab.tiny", description=__doc__)
    parser.add_argument("what", choices=["random", "world", "student"], help="which packaged models to rebuild")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the packaged one)")
    args = parser.parse_args(argv)
    if args.what == "random":
        from kdlab.tiny.build import build_random_pair

        build_random_pair(args.out or ASSETS / "tiny-random")
    else:
        from kdlab.tiny.build import build_world

        build_world(args.out or ASSETS / "tiny", keep_teacher=args.what == "student")


if __name__ == "__main__":
    main()
