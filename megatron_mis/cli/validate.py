"""``megatron-mis validate FILE``: print the resolved configuration or every error (exit 2).

The file may hold the keys of several components (the MIS keys, the LR-schedule keys, ...), as a
slime / Miles ``--custom-config-path`` file does; every key must belong to one of them.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from megatron_mis.config import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check a mis.yaml and print the resolved configuration",
        description=(
            "Validate a YAML of megatron-mis keys (MIS, LR schedule, ...). Every problem is reported at "
            "once; exit status 2 on errors. With --host slime|miles, also report what the file does on "
            "that host (keys that do nothing there, host flags it overrides, host bounds that are not "
            "read, keys whose host meaning differs, hooks or patches it needs); notes keep exit status 0, "
            "only errors make it 2."
        ),
    )
    p.add_argument("file", help="path to the YAML file")
    p.add_argument(
        "--host",
        choices=("slime", "miles"),
        default=None,
        help="report what the file does as the --custom-config-path of this host (slime 624b824a, Miles 31f1ca96)",
    )
    p.add_argument(
        "--host-flags",
        default=None,
        metavar="FLAGS",
        help=(
            "with --host: the host flags of the launch command as one word, written with '=' "
            "(e.g. --host-flags=\"--use-tis --custom-tis-function-path megatron_mis.compute_mis_weights_with_cp\"); "
            "without it, what depends on them is described instead of decided"
        ),
    )
    p.set_defaults(run=run)


def _host_notes(args: argparse.Namespace) -> tuple[list, list[str]]:
    """(notes, errors that stop the report) for ``--host``."""
    from megatron_mis.config.base import load_yaml_mapping
    from megatron_mis.integrations.host_report import host_report, parse_host_flags

    try:
        data = load_yaml_mapping(args.file, allow_empty=True)
    except (OSError, ConfigError):
        return [], []  # already reported by the configuration check
    flags = None
    if args.host_flags is not None:
        try:
            flags = parse_host_flags(args.host_flags, args.host)
        except ValueError as exc:
            return [], [f"--host-flags: {exc}"]
    return host_report(data, args.host, flags=flags), []


def run(args: argparse.Namespace) -> int:
    from megatron_mis.config.sections import CONFIG_SECTIONS, load_sections

    host = getattr(args, "host", None)
    if getattr(args, "host_flags", None) is not None and host is None:
        print("error: --host-flags needs --host slime|miles", file=sys.stderr)
        return 2
    config_error = None
    try:
        sections = load_sections(args.file)
    except (FileNotFoundError, ConfigError) as exc:
        config_error = exc
    notes, fatal = _host_notes(args) if host else ([], [])
    if config_error is not None:
        print(f"error: {config_error}", file=sys.stderr)
    else:
        print(f"# {args.file}: valid. Resolved configuration (defaults filled in):")
        for name in sorted(sections, key=lambda n: (n != "mis", n)):
            built = sections[name]
            print(f"\n# ---- {name}")
            print(yaml.safe_dump(CONFIG_SECTIONS.get(name).describe(built), sort_keys=False).rstrip())
    for message in fatal:
        print(f"error: {message}", file=sys.stderr)
    if host:
        errors = [n for n in notes if n.is_error]
        label = {"slime": "slime 624b824a", "miles": "Miles 31f1ca96"}[host]
        print(f"\n# ---- on {label}: {len(errors)} error(s), {len(notes) - len(errors)} note(s)")
        for note in notes:
            print(note.format(), file=sys.stderr if note.is_error else sys.stdout)
        if errors:
            return 2
    return 2 if config_error is not None or fatal else 0
