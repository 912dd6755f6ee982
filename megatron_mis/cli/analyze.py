"""``megatron-mis analyze [FILE]``: a mismatch report for recorded log-probs (or a built-in
sample generated at run time)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from megatron_mis.config import ConfigError, MISConfig


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="mismatch report for rollout vs training log-probs",
        description=(
            "Read per-sample rollout and training log-probs (JSONL lines with rollout_log_probs, "
            "train_log_probs and optional loss_mask; or a torch .pt dict of lists of tensors) and print "
            "the mismatch metrics, what a mis.yaml would do, and the probability-bucket table. Without "
            "FILE, a built-in sample is generated at run time (a small random model scored in fp32 and bf16)."
        ),
    )
    p.add_argument("file", nargs="?", help="JSONL or .pt file; omitted: the built-in sample")
    p.add_argument("--config", help="mis.yaml whose effect to report (default: token TIS + ratio veto + geometric RS preset seed000_default)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON instead of the report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_mis.analysis import analyze, builtin_sample, format_report, load_samples
    from megatron_mis.presets import preset_path

    try:
        if args.config:
            cfg, source = MISConfig.from_yaml(args.config), args.config
        else:
            path = preset_path("seed000_default")
            cfg, source = MISConfig.from_yaml(path), f"preset seed000_default ({path})"
        samples = load_samples(args.file) if args.file else builtin_sample()
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.file:
        print("note: no FILE given; analysing the built-in sample generated at run time "
              "(a random 2-layer LM scored in fp32 as 'train' and bf16 as 'rollout').", file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = analyze(samples, cfg)
        scalars = result.scalars()
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.json:
        table = {k: v.tolist() for k, v in result.bucket_table.items()}
        print(json.dumps({"source": samples.source, "config": source, "metrics": scalars, "buckets": table}, indent=2))
    else:
        print(format_report(samples, result, cfg, source))
    return 0
