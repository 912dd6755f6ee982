"""The ``megatron-mis`` command line: ``validate``, ``analyze``, ``demo`` and ``study``.

Each sub-command lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``;
this module only assembles them.

``demo``, ``study`` and ``analyze`` need the ``[demo]`` extra (matplotlib, tqdm), which a training
container does not install: :func:`main` checks for it before running one of them and exits with
status 2 naming ``pip install "megatron-mis[demo]"`` instead of failing later with a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_mis._version import __version__

__all__ = ["main", "build_parser"]

_COMMANDS = ("validate", "analyze", "demo", "study")

#: The ``[demo]`` extra's packages (setup.py) each sub-command imports: the demo and the study plot
#: (matplotlib) and show progress bars (tqdm); analyze shows a progress bar over files and plots
#: only with ``--plot``.
_DEMO_EXTRA = ("matplotlib", "tqdm")
_NEEDS = {"demo": _DEMO_EXTRA, "study": _DEMO_EXTRA, "analyze": ("tqdm",)}
_INSTALL_DEMO = 'pip install "megatron-mis[demo]"'


def _missing_packages(args: argparse.Namespace) -> list[str]:
    """The ``[demo]`` packages the chosen sub-command needs that cannot be imported here."""
    import importlib.util

    needs = list(_NEEDS.get(args.command, ()))
    if getattr(args, "plot", None) and "matplotlib" not in needs:  # analyze --plot PNG
        needs.append("matplotlib")
    missing = []
    for name in needs:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            found = False
        if not found:
            missing.append(name)
    return missing


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
    missing = _missing_packages(args)
    if missing:
        one = len(missing) == 1
        print(
            f"error: megatron-mis {args.command} needs {' and '.join(missing)}, which {'is' if one else 'are'} not installed "
            f"(a plain install for training leaves {'it' if one else 'them'} out); install {'it' if one else 'them'} with: "
            f"{_INSTALL_DEMO}",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.run(args) or 0)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _DEMO_EXTRA:
            raise
        print(f"error: megatron-mis {args.command} needs {exc.name.split('.')[0]}, which is not installed (a plain install for "
              f"training leaves it out); install it with: {_INSTALL_DEMO}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
