"""``megatron-mis study``: the demo's GRPO run over arms x seeds in one mismatch setting, run in
parallel processes (resumable), with bootstrap statistics, paired differences against no
correction, a markdown report and a PNG. See ``docs/study.md``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from megatron_mis.cli.stopping import Stopped, deferring, stop_on_sigterm, stopped_exit
from megatron_mis.config import ConfigError

# (flag, StudyConfig field, argparse extras); help texts come from the config's field docs
_VALUE_FLAGS: tuple[tuple[str, str, dict], ...] = (
    ("--setting", "setting", {"metavar": "NAME"}),
    ("--sweep", "sweep", {"metavar": "NAME"}),
    ("--seeds", "seeds", {"type": int, "metavar": "N"}),
    ("--first-seed", "first_seed", {"type": int, "metavar": "S"}),
    ("--steps", "steps", {"type": int, "metavar": "N"}),
    ("--jobs", "jobs", {"type": int, "metavar": "N"}),
    ("--threads", "threads", {"type": int, "metavar": "N"}),
    ("--out-dir", "out_dir", {"metavar": "DIR"}),
    ("--last-k", "last_k", {"type": int, "metavar": "K"}),
    ("--threshold", "threshold", {"type": float, "metavar": "R"}),
    ("--collapse-fraction", "collapse_fraction", {"type": float, "metavar": "F"}),
    ("--bootstrap", "bootstrap", {"type": int, "metavar": "B"}),
    ("--confidence", "confidence", {"type": float, "metavar": "C"}),
)


def add_parser(sub) -> None:
    from megatron_mis.testbed.study.config import QUICK, StudyConfig

    docs = StudyConfig.field_docs()
    p = sub.add_parser(
        "study",
        help="arms x seeds of the demo in one mismatch setting: bootstrap CIs, paired differences, report",
        description=(
            "Runs the demo's GRPO loop (Megatron-Core GPT on CPU, a separate rollout engine with a real numeric "
            "mismatch) for every arm (no correction, the correction presets, bypass / decoupled PPO, length-decay "
            "LR, the no-mismatch references fp32 and true on-policy) and seed, in parallel worker processes. Each "
            "run is written to OUT_DIR/SETTING/ARM/seed-S.jsonl and reused when the study is run again. The "
            "report (report.md, report.png, summary.json) gives per arm the final reward, greedy reward, collapse "
            "rate, steps to a threshold, K3 KL, with bootstrap CIs and paired differences against none."
        ),
        epilog=(
            "examples:\n"
            "  megatron-mis study                          # the default setting, every arm, 8 seeds\n"
            "  megatron-mis study --quick                  # smoke run: 2 seeds x 4 small steps\n"
            "  megatron-mis study --setting bf16 --arms none,token_tis,ref_fp32 --seeds 4\n"
            "  megatron-mis study --report-only            # re-read the finished runs, rewrite the report\n"
            "  megatron-mis study --sweep long-tail-stale-128 --seeds 16 \\\n"
            "      --archive docs/study/sweep-long-tail-stale-128/runs   # extend a committed study\n"
            "  megatron-mis study --list                   # settings, arms and dose-response sweeps\n"
            "  megatron-mis study --sweep staleness --seeds 8 --jobs 2   # a dose-response sweep (resumable)\n"
            "  megatron-mis study --sweep temperature --quick            # its smoke run: first and last dose"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, field, extra in _VALUE_FLAGS:
        _, default, text = docs[field]
        p.add_argument(flag, dest=field, default=None, help=f"{text} (default: {default})".replace("%", "%%"), **extra)
    p.add_argument("--arms", default=None, metavar="A,B,..", help="Comma-separated arms (default: the setting's arms; see --list).")
    p.add_argument("--doses", default=None, metavar="A,B,..", help="--sweep only: comma-separated dose labels (default: all; see --list).")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="A further demo setting for every run (e.g. --set lr=0.005); repeatable.")
    p.add_argument("--quick", action="store_true", default=None,
                   help=f"Smoke mode: {QUICK['seeds']} seeds x {QUICK['steps']} steps of 4 prompts x 4 samples (explicit flags win).")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="Hide the progress bar.")
    p.add_argument("--no-plot", dest="plot", action="store_false", default=None, help="Do not write report.png.")
    p.add_argument("--report-only", action="store_true", help="Do not run anything: write the report from the finished runs.")
    p.add_argument("--archive", default=None, metavar="DIR",
                   help="A run archive folder (e.g. docs/study/sweep-NAME/runs: one .jsonl.gz per run): its runs missing from "
                        "OUT_DIR are written there first (and reused where their configuration matches), and every finished "
                        "run of the study's settings (with --doses, those doses') that DIR lacks is added at the end "
                        "(it never replaces one).")
    p.add_argument("--list", action="store_true", help="List the settings, the arms and the dose-response sweeps and exit.")
    p.set_defaults(run=run)


def _parse_extra(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("StudyConfig", [f"--set {item!r} must read KEY=VALUE"])
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def build_config(args: argparse.Namespace):
    from megatron_mis.testbed.study.config import QUICK, StudyConfig

    values = {field: getattr(args, field) for _, field, _ in _VALUE_FLAGS if getattr(args, field) is not None}
    if args.doses is not None:
        values["doses"] = [d.strip() for d in args.doses.split(",") if d.strip()]
    if args.arms is not None:
        values["arms"] = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.extra:
        values["extra"] = _parse_extra(args.extra)
    for name in ("progress", "plot"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.quick:
        values = {**{k: v for k, v in QUICK.items() if k != "steps"}, **values, "quick": True}
    return StudyConfig(**values)


def run(args: argparse.Namespace) -> int:
    from megatron_mis.testbed.study.config import ARMS, SETTINGS, SWEEPS

    if args.list:
        print("settings:")
        sweep_settings = {w.setting_name(label) for w in SWEEPS.values() for label in w.labels}
        for name, s in SETTINGS.items():
            if name not in sweep_settings:
                print(f"  {name:14s} {s.description}")
        print("arms:")
        for name, a in ARMS.items():
            print(f"  {name:20s} {a.description}")
        print("dose-response sweeps (--sweep NAME [--doses A,B]; each dose is the setting NAME-DOSE):")
        for name, w in SWEEPS.items():
            print(f"  {name:16s} {w.description}")
            print(f"  {'':16s}   dose {w.measure}: {', '.join(w.labels)}")
            print(f"  {'':16s}   arms: {', '.join(w.arms)}")
        return 0
    try:
        study = build_config(args)
    except ConfigError as exc:
        print(f"megatron-mis study: {exc}", file=sys.stderr)
        return 2
    from megatron_mis.testbed.study.config import arm_overrides_of_extra

    for arm, key, mine, theirs in arm_overrides_of_extra(study):
        print(f"megatron-mis study: arm {arm} runs with {key}={mine!r}, not --set {key}={theirs!r} (an arm's own fields win)",
              file=sys.stderr)
    try:
        with stop_on_sigterm():
            return _run_archived(args, study)
    except (Stopped, KeyboardInterrupt) as exc:
        status, message = stopped_exit("study", exc, f"; the finished runs stay in {study.out_dir} (and in the archive, "
                                                     f"with --archive): rerun the same command to resume")
        print(message, file=sys.stderr)
        return status


def _run_archived(args: argparse.Namespace, study) -> int:
    """The study, with ``--archive``'s restore before it and update after it (also after a failed
    or stopped study)."""
    from megatron_mis.testbed.study.config import SWEEPS

    if args.archive is None:
        return _run(study, report_only=args.report_only)
    from megatron_mis.testbed.study.archive import ArchiveError, restore_runs, update_archive

    # the settings this command runs (with --doses, only those doses): the out-dir's runs of the sweep's other doses
    # are not the study's, and the archive of one dose does not take them
    settings = ([SWEEPS[study.sweep].setting_name(label) for label in study.dose_labels]
                if study.sweep is not None else [study.setting])
    try:
        if os.path.exists(args.archive):
            got = restore_runs(args.archive, study.out_dir)
            differ = f" ({got['differ']} of them differ from the archive's: the files on disk are kept)" if got["differ"] else ""
            print(f"archive {args.archive}: restored {got['restored']} runs into {study.out_dir}, "
                  f"{got['present']} already there{differ}", file=sys.stderr)
        else:
            print(f"archive {args.archive}: not there yet, it will be made", file=sys.stderr)
    except ArchiveError as exc:
        print(f"megatron-mis study: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(study, report_only=args.report_only)
    finally:  # a failed or interrupted study keeps its finished runs: so does the archive
        with deferring(signal.SIGTERM):  # a SIGTERM now stops the command once the archive is written
            wrote = update_archive(args.archive, study.out_dir, settings)
        print(f"archive {args.archive}: {wrote['runs']} runs ({wrote['added']} added from {study.out_dir}, "
              f"{wrote['written']} files written)", file=sys.stderr)
        if wrote["conflicts"]:
            print(f"archive {args.archive}: {len(wrote['conflicts'])} runs in {study.out_dir} differ from the archive's "
                  f"runs of the same name and were not written (the archive keeps its runs; keep another configuration "
                  f"in another archive): {', '.join(wrote['conflicts'][:5])}{' ...' if len(wrote['conflicts']) > 5 else ''}",
                  file=sys.stderr)


def _run(study, *, report_only: bool) -> int:
    if study.sweep is not None:
        return _run_sweep(study, report_only=report_only)
    from megatron_mis.testbed.study.report import format_markdown, write_report
    from megatron_mis.testbed.study.runner import StudyError, run_study, study_dir

    if not report_only:
        print(f"study {study.setting}: {len(study.arm_names)} arms x {study.seeds} seeds, {study.resolved_steps} steps each, "
              f"{study.num_jobs} runs in parallel x {study.threads} thread(s) -> {study_dir(study)}", file=sys.stderr)
        try:
            done = run_study(study)
        except StudyError as exc:
            print(f"megatron-mis study: {exc}", file=sys.stderr)
            return 1
        print(_done_line(done), file=sys.stderr)
    summary = write_report(study)
    if not summary["arms"]:
        print("megatron-mis study: no finished runs to report", file=sys.stderr)
        return 1
    print(format_markdown(summary))
    out = study_dir(study)
    print(f"wrote {out / 'report.md'}, {out / 'summary.json'}" + (f", {out / 'report.png'}" if study.plot else ""),
          file=sys.stderr)
    return 0


def _run_sweep(study, *, report_only: bool) -> int:
    from megatron_mis.testbed.study.runner import StudyError, plan_sweep, run_sweep
    from megatron_mis.testbed.study.sweep_report import format_sweep_markdown, sweep_dir, write_sweep_report

    if not report_only:
        n = len(plan_sweep(study))
        print(f"sweep {study.sweep}: {len(study.dose_labels)} doses x {len(study.arm_names)} arms x {study.seeds} seeds = "
              f"{n} runs of {study.resolved_steps} steps, {study.num_jobs} in parallel x {study.threads} thread(s) "
              f"-> {study.out_dir}", file=sys.stderr)
        try:
            done = run_sweep(study)
        except StudyError as exc:
            print(f"megatron-mis study: {exc}", file=sys.stderr)
            return 1
        print(_done_line(done), file=sys.stderr)
    summary = write_sweep_report(study)
    if not summary["doses"]:
        print("megatron-mis study: no finished runs to report", file=sys.stderr)
        return 1
    print(format_sweep_markdown(summary))
    print(f"wrote {sweep_dir(study) / 'report.md'}", file=sys.stderr)
    return 0


def _done_line(done: dict) -> str:
    copied = f", copied {done['copied']} (the same configuration as another run)" if done.get("copied") else ""
    return f"ran {done['ran']} runs, reused {done['reused']}{copied}, {done['wall_s']:.0f} s"
