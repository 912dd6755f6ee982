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
            "once; exit status 2 on errors."
        ),
    )
    p.add_argument("file", help="path to the YAML file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_mis.config.sections import CONFIG_SECTIONS, load_sections

    try:
        sections = load_sections(args.file)
    except (FileNotFoundError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# {args.file}: valid. Resolved configuration (defaults filled in):")
    for name in sorted(sections, key=lambda n: (n != "mis", n)):
        built = sections[name]
        print(f"\n# ---- {name}")
        print(yaml.safe_dump(CONFIG_SECTIONS.get(name).describe(built), sort_keys=False).rstrip())
    return 0
