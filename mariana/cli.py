"""The `mariana` command: the pipeline's commands (services/cli.py) and serving's
(serving/cli.py), composed here above both layers so that serving needs nothing of
services beyond services/runtime/. `python -m mariana` runs it too."""
from __future__ import annotations

import argparse
import sys

from mariana.services import cli as pipeline
from mariana.serving import cli as serving


def build_parser() -> argparse.ArgumentParser:
    parser = pipeline.build_parser()
    serving.add_commands(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)))
    return parser


def main(argv: list[str] | None = None) -> int:
    return pipeline.main(argv, build=build_parser)


if __name__ == "__main__":
    sys.exit(main())
