"""The ``megatron-mis`` command line: ``validate``, ``analyze``, ``demo`` and ``study``.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``;
this module only assembles them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_mis._version import __version__

__all__ = ["main", "build_parser"]

_COMMANDS = ("validate", "analyze", "demo", "study")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="megatron-mis",
        description="Training-inference mismatch correction for Megatron-Core RL.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-mis {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"megatron_mis.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"megatron_mis.cli.{name}":
                continue  # sub-command not shipped in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
