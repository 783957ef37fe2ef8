"""The ``deploybench`` command line.

Each area registers its own sub-commands (``lab``, ``engine``, ``store``, ...) from
the module that owns it, so this file stays a table of contents. Heavy imports happen
inside the command that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from deploybench.errors import DeploybenchError

# module path -> it defines ``register(subparsers)``; each sub-command sets ``func``.
COMMAND_MODULES = [
    "deploybench.cli.lab",
    "deploybench.cli.engine",
    "deploybench.cli.store",
    "deploybench.cli.analyse",
    "deploybench.cli.run",
    "deploybench.cli.lease",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploybench", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # an area not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return int(args.func(args) or 0)
    except DeploybenchError as exc:
        print(f"deploybench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
