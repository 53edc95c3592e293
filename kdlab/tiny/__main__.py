"""``python -m kdlab.tiny random|world|student|teacher-4e|teacher-xtok|reasoning [--out DIR]``: rebuild the packaged tiny models.

``student`` rebuilds the tiny world's student only, keeping the teacher and tokenizer in DIR;
``teacher-4e`` trains DIR/teacher further on Countdown-4E into DIR/teacher-4e (``kdlab://tiny/teacher-4e``);
``teacher-xtok`` trains a teacher with a tokenizer of its own into DIR/teacher-xtok (``kdlab://tiny/teacher-xtok``);
``reasoning`` builds the tiny reasoning world into DIR (default ``kdlab/assets/tiny-reasoning``, ``kdlab://tiny-reasoning``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kdlab.models.loading import ASSETS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kdlab.tiny", description=__doc__)
    parser.add_argument("what", choices=["random", "world", "student", "teacher-4e", "teacher-xtok", "reasoning"], help="which packaged models to rebuild")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the packaged one)")
    args = parser.parse_args(argv)
    if args.what == "random":
        from kdlab.tiny.build import build_random_pair

        build_random_pair(args.out or ASSETS / "tiny-random")
    elif args.what == "teacher-4e":
        from kdlab.tiny.build import build_teacher_4e

        build_teacher_4e(args.out or ASSETS / "tiny")
    elif args.what == "reasoning":
        from kdlab.tiny.reasoning import build_reasoning

        build_reasoning(args.out or ASSETS / "tiny-reasoning")
    elif args.what == "teacher-xtok":
        from kdlab.tiny.xtok import build_teacher_xtok

        build_teacher_xtok(args.out or ASSETS / "tiny")
    else:
        from kdlab.tiny.build import build_world

        build_world(args.out or ASSETS / "tiny", keep_teacher=args.what == "student")


if __name__ == "__main__":
    main()
