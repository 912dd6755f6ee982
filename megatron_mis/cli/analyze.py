"""``megatron-mis analyze [PATH ...]``: the training-inference mismatch in recorded log-probs —
slime, Miles or megatron-mis dumps, one file or a whole run — or in a built-in sample generated at
run time. See docs/analyze.md."""

from __future__ import annotations

import argparse
import sys

from megatron_mis.config import ConfigError, MISConfig

_FORMAT_HELP = (
    "auto (default: detected from the content), jsonl / pt (megatron-mis' own), slime "
    "(--save-debug-train-data, format_version 2), slime-legacy (older per-rank slime dumps), miles "
    "(Miles --save-debug-train-data)"
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="mismatch report for rollout vs training log-probs (one file or a whole run)",
        description=(
            "Read rollout and trainer log-probs from slime / Miles --save-debug-train-data dumps or "
            "megatron-mis' JSONL / .pt files (files, directories or glob patterns; formats detected "
            "automatically) and report the mismatch: for one batch the full metric report, for a run one "
            "row per rollout id (K3 KL mean / p99 / max, log-ppl gap, chi-square, TV, ESS, what --config "
            "rejects and vetoes, response length), the mismatch monitor's warnings replayed over that "
            "history and Beyond Precision (arXiv:2602.01826)'s length-surge verdict. --compare applies several configurations to the "
            "same data. Without PATH a built-in sample is generated at run time (a small random model "
            "scored in fp32 and bf16). Exit status: 0, 1 if some files were skipped as bad, 2 if nothing "
            "could be analysed."
        ),
    )
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="dump files, directories (their .pt / .pth / .bin / .jsonl / .json files) or glob patterns; "
                        "omitted: the built-in sample")
    p.add_argument("--format", default="auto",
                   choices=["auto", "jsonl", "pt", "slime", "slime-legacy", "miles"], help=_FORMAT_HELP)
    p.add_argument("--config", metavar="YAML",
                   help="mis.yaml (or a preset name) whose effect to report; it may also hold length_surge_* / "
                        "length_decay_* / monitor_* keys (default: preset seed000_default)")
    p.add_argument("--schedule-config", metavar="YAML",
                   help="YAML with length_surge_* / length_decay_* / monitor_* keys for the surge detector and the "
                        "monitor replay (default: those in --config, else the defaults)")
    p.add_argument("--compare", nargs="+", metavar="PRESET",
                   help="what-if: apply each configuration (a configs/presets name or a mis.yaml path) to the same data")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (strict: non-finite values become null and are listed)")
    p.add_argument("--plot", metavar="PNG",
                   help="write a PNG: mismatch trends, response length and surge, mismatch by rollout probability, "
                        "IS-weight distribution")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over files")
    p.add_argument("--trust-pickle", action="store_true",
                   help="let torch.load unpickle arbitrary Python objects (weights_only=False); only for files you trust")
    p.set_defaults(run=run)


def _load_config(spec: str) -> tuple[MISConfig, str]:
    from megatron_mis.monitor import SCHEDULE_KEYS
    from megatron_mis.presets import preset_path

    path = preset_path(spec)
    source = spec if str(path) == spec else f"{spec} ({path})"
    return MISConfig.from_yaml(path, ignore=SCHEDULE_KEYS), source


def _schedule_configs(args: argparse.Namespace):
    from megatron_mis.config.base import load_yaml_mapping
    from megatron_mis.monitor import SCHEDULE_KEYS, load_schedule_configs
    from megatron_mis.presets import preset_path

    ignore = tuple(MISConfig.field_names())
    if args.schedule_config:
        return load_schedule_configs(args.schedule_config, ignore=ignore)
    if args.config:
        path = preset_path(args.config)
        data = load_yaml_mapping(path)
        if isinstance(data, dict) and any(k in SCHEDULE_KEYS for k in data):
            return load_schedule_configs(
                {k: v for k, v in data.items() if k in SCHEDULE_KEYS}, source=str(path)
            )
    return None


def run(args: argparse.Namespace) -> int:
    from megatron_mis.analysis import (
        DumpError,
        analyze_history,
        builtin_sample,
        format_compare,
        format_history,
        format_report,
        plot_history,
        to_json,
    )
    from megatron_mis.analysis.single import LogProbSamples

    try:
        if args.config:
            cfg, source = _load_config(args.config)
        else:
            cfg, source = _load_config("seed000_default")
            source = f"preset {source}"
        compare = {}
        for spec in args.compare or []:
            compare[spec], _ = _load_config(spec)
        schedule = _schedule_configs(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    sample = None
    if not args.paths:
        print("note: no PATH given; analysing the built-in sample generated at run time "
              "(a random 2-layer LM scored in fp32 as 'train' and bf16 as 'rollout').", file=sys.stderr)
        sample = builtin_sample()
    try:
        result = analyze_history(
            args.paths, cfg, source, compare=compare, format=args.format, trust_pickle=args.trust_pickle,
            schedule=schedule, progress=not args.no_progress, sample=sample,
        )
    except DumpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = result.report
    for err in report["errors"]:
        print(f"error: {err['error']} (skipped)", file=sys.stderr)
    for note in report["notes"]:
        print(f"warning: {note}", file=sys.stderr)
    if args.plot:
        path = plot_history(report, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(to_json(report))
    elif result.single is not None:
        res, batch = result.single
        samples = LogProbSamples(batch.train_log_probs, batch.rollout_log_probs, batch.loss_masks, batch.source)
        print(format_report(samples, res, res.config, source))
        if report["compare"]:
            print("\n" + format_compare(report))
    else:
        print(format_history(report))
    return 1 if report["errors"] else 0
