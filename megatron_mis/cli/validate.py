"""``megatron-mis validate FILE``: print the resolved configuration or every error (exit 2). With
``native_engine: true`` it also builds the native kernel (exit 2, naming what is missing, if it
cannot), so that the job's first step does not pay for the build or find it impossible.

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
    if getattr(sections.get("mis"), "native_engine", False):
        return _build_native()
    return 0


def _build_native() -> int:
    """native_engine: true: build the kernel now (cached for the job's ranks), so that a missing
    compiler or ninja shows here rather than in the first training step."""
    from megatron_mis.core import native

    print("\n# native_engine: true: building the native kernel (about 20 s the first time on a machine) ...", flush=True)
    try:
        native.load()
    except native.NativeBuildError as exc:
        print(f"error: native_engine: true, but the kernel does not build here: {exc}", file=sys.stderr)
        return 2
    print("# native kernel: ready (cached in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default)")
    return 0
