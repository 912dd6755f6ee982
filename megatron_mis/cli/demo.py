"""``megatron-mis demo``: a small GRPO run on a real Megatron-Core GPT (CPU), rollouts from a
separate engine whose numerics differ, the mismatch measured step by step, and a correction
switched on (and, with ``--compare``, compared against none). See ``docs/demo.md``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from megatron_mis.config import ConfigError

# (flag, DemoConfig field, argparse extras); help texts come from the config's field docs
_VALUE_FLAGS: tuple[tuple[str, str, dict], ...] = (
    ("--steps", "steps", {"type": int, "metavar": "N"}),
    ("--name", "name", {"metavar": "NAME"}),
    ("--out-dir", "out_dir", {"metavar": "DIR"}),
    ("--seed", "seed", {"type": int, "metavar": "S"}),
    ("--correction", "correction", {"metavar": "PRESET"}),
    ("--rollout-precision", "rollout_precision", {"choices": ("fp32", "bf16", "fp16", "int8", "int4")}),
    ("--temperature", "temperature", {"type": float, "metavar": "T"}),
    ("--trainer-temperature", "trainer_temperature", {"type": float, "metavar": "T"}),
    ("--top-p", "top_p", {"type": float, "metavar": "P"}),
    ("--top-k", "top_k", {"type": int, "metavar": "K"}),
    ("--rollout-logprobs", "rollout_logprobs", {"choices": ("raw", "processed")}),
    ("--replay-entropy", "replay_entropy", {"choices": ("kept", "full")}),
    ("--staleness", "staleness", {"type": int, "metavar": "K"}),
    ("--stale-fraction", "stale_fraction", {"type": float, "metavar": "F"}),
    ("--task", "task", {"choices": ("copy", "reverse", "sort")}),
    ("--min-digits", "min_digits", {"type": int, "metavar": "N"}),
    ("--max-digits", "max_digits", {"type": int, "metavar": "N"}),
    ("--vocab-size", "vocab_size", {"type": int, "metavar": "V"}),
    ("--scratchpad", "scratchpad", {"type": int, "metavar": "S"}),
    ("--distractors", "distractors", {"type": int, "metavar": "M"}),
    ("--scratchpad-position", "scratchpad_position", {"choices": ("before", "after")}),
    ("--digit-credit", "digit_credit", {"type": float, "metavar": "C"}),
    ("--prompts-per-step", "prompts_per_step", {"type": int, "metavar": "P"}),
    ("--samples-per-prompt", "samples_per_prompt", {"type": int, "metavar": "G"}),
    ("--advantage-estimator", "advantage_estimator", {"choices": ("grpo", "rloo")}),
    ("--micro-batch-size", "micro_batch_size", {"type": int, "metavar": "B"}),
    ("--updates-per-step", "updates_per_step", {"type": int, "metavar": "U"}),
    ("--lr", "lr", {"type": float}),
    ("--lr-schedule", "lr_schedule", {"choices": ("constant", "length-decay")}),
    ("--lr-surge-step", "lr_surge_step", {"type": int, "metavar": "STEP"}),
    ("--clip-grad", "clip_grad", {"type": float, "metavar": "NORM"}),
    ("--eps-clip", "eps_clip", {"type": float, "metavar": "EPS"}),
    ("--entropy-coef", "entropy_coef", {"type": float, "metavar": "C"}),
    ("--hidden-size", "hidden_size", {"type": int, "metavar": "H"}),
    ("--num-layers", "num_layers", {"type": int, "metavar": "L"}),
    ("--num-attention-heads", "num_attention_heads", {"type": int, "metavar": "A"}),
    ("--num-moe-experts", "num_moe_experts", {"type": int, "metavar": "E"}),
    ("--moe-router-topk", "moe_router_topk", {"type": int, "metavar": "K"}),
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", {"type": int, "metavar": "F"}),
    ("--rollout-router-noise", "rollout_router_noise", {"type": float, "metavar": "SIGMA"}),
    ("--tp", "tp", {"type": int, "metavar": "N"}),
    ("--cp", "cp", {"type": int, "metavar": "N"}),
    ("--pp", "pp", {"type": int, "metavar": "N"}),
    ("--dp", "dp", {"type": int, "metavar": "N"}),
    ("--threads", "threads", {"type": int, "metavar": "N"}),
    ("--dump-log-probs", "dump_log_probs", {"metavar": "DIR"}),
)
# (flag, field, value stored, help; None: the field's doc)
_SWITCHES: tuple[tuple[str, str, bool, str | None], ...] = (
    ("--compare", "compare", True, None),
    ("--true-on-policy", "true_on_policy", True, None),
    ("--trainer-truncation", "trainer_truncation", True, None),
    ("--eos", "eos", True, None),
    ("--routing-replay", "routing_replay", True, None),
    ("--no-progress", "progress", False, "Hide the progress bar (the per-step metrics are still written)."),
    ("--no-plot", "plot", False, "Do not write the PNG report."),
)


def _help(field: str, docs: dict) -> str:
    _, default, text = docs[field]
    text = text.replace("%", "%%")
    if isinstance(default, bool):
        return text
    return f"{text} (default: {default if default is not None else 'see text'})"


def add_parser(sub) -> None:
    from megatron_mis.testbed.demo.config import QUICK

    p = sub.add_parser(
        "demo",
        help="GRPO on a Megatron-Core GPT (CPU) with a mismatched rollout engine, corrected and measured",
        description=(
            "A small GRPO run with a real Megatron-Core GPTModel on CPU learning a synthetic digit task "
            "(copy / reverse / sort, programmatic reward, generated at run time: no downloads). Rollouts come "
            "from a separate engine (KV cache, its own numeric path: --rollout-precision) that records its "
            "log-probs as SGLang does; the trainer recomputes pi_old in fp32, so the training-inference "
            "mismatch is real. Every step writes reward, K3 KL, log-ppl gap, IS weight statistics, rejected "
            "fraction, learning rate, gradient norm and timings to OUT_DIR/NAME/metrics.jsonl; the end "
            "writes report.png and summary.json. Default: about a minute on 2 CPU cores (docs/demo.md)."
        ),
        epilog=(
            "examples:\n"
            "  megatron-mis demo                                   # token TIS against bf16 rollouts\n"
            "  megatron-mis demo --compare                         # stale rollouts (k=4): none vs bypass PPO\n"
            "  megatron-mis demo --compare --preset int4           # none vs token TIS under int4 rollouts\n"
            "  megatron-mis demo --true-on-policy                  # bitwise-equal log-probs, checked every step\n"
            "  megatron-mis demo --rollout-precision int8 --correction seed000_default\n"
            "  megatron-mis demo --tp 2 --steps 20                 # the same run over 2 processes (gloo)\n"
            f"  megatron-mis demo --quick                           # {QUICK['steps']} tiny steps (tests)\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """The demo's flags (one per :class:`DemoConfig` field, help from the field docs, no default
    stored unless given) and ``--quick``; ``exclude`` names fields to leave out (the torchrun
    example derives ``dp`` from the world size)."""
    from megatron_mis.testbed.demo.config import QUICK, DemoConfig

    docs = DemoConfig.field_docs()
    for flag, field, extra in _VALUE_FLAGS:
        if field not in exclude:
            parser.add_argument(flag, dest=field, default=argparse.SUPPRESS, help=_help(field, docs), **extra)
    for flag, field, value, text in _SWITCHES:
        if field not in exclude:
            parser.add_argument(
                flag, dest=field, action="store_const", const=value, default=argparse.SUPPRESS,
                help=(text or docs[field][2]).replace("%", "%%"),
            )
    from megatron_mis.testbed.study.config import DEMO_COMPARE_SETTING, SETTINGS

    compare = SETTINGS[DEMO_COMPARE_SETTING]
    parser.add_argument(
        "--preset",
        choices=tuple(SETTINGS),
        default=None,
        help="A study setting (task + mismatch source, docs/study.md) as the starting values, with its "
        f"demo correction; explicit flags win. --compare without --preset uses '{DEMO_COMPARE_SETTING}' "
        f"(staleness {compare.overrides['staleness']}: none vs {compare.demo_correction}, the first setting where "
        "the study measured the uncorrected run falling behind and a correction closing the gap).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"Short mode for tests and a first look: {', '.join(f'{k}={v}' for k, v in QUICK.items())} "
        "(explicit flags win).",
    )


def build_config(args: argparse.Namespace, **overrides):
    """The :class:`DemoConfig` of the parsed flags: the ``--preset`` setting's values first (with
    ``compare`` and no ``--preset``: :data:`~megatron_mis.testbed.study.config.DEMO_COMPARE_SETTING`;
    under ``true_on_policy`` without the setting's rollout precision and mismatch mechanisms), then
    ``--quick``'s, then explicit flags, then ``overrides``.

    Raises:
        ConfigError: every problem with the flags at once.
    """
    from megatron_mis.testbed.demo.config import QUICK, DemoConfig
    from megatron_mis.testbed.study.config import DEMO_COMPARE_SETTING, NO_MECHANISM, SETTINGS

    given = {k: v for k, v in vars(args).items() if k not in ("command", "run", "quick", "preset")}
    preset = getattr(args, "preset", None)
    if preset is None and {**given, **overrides}.get("compare"):
        preset = DEMO_COMPARE_SETTING
    base = dict(SETTINGS[preset].demo_values()) if preset else {}
    if {**given, **overrides}.get("true_on_policy"):
        # true on-policy is its own mismatch-free (fp32) rollout path: the preset's mismatch source
        # (its rollout precision, staleness, temperature, truncation, router noise) yields to it
        for key in ("rollout_precision", *NO_MECHANISM):
            base.pop(key, None)
    if getattr(args, "quick", False):
        base.update(QUICK)
    return DemoConfig.from_dict({**base, **given, **overrides}, source="megatron-mis demo")


def report(cfg, results) -> None:
    """Print the per-run summaries (and the table under ``compare``), write ``report.png`` and
    ``summary.json`` into the run folder (the reporting rank's results of
    :func:`megatron_mis.testbed.demo.train.run_rank`)."""
    from pathlib import Path

    from megatron_mis.testbed.demo.report import format_table, plot_report
    from megatron_mis.testbed.demo.train import summarize

    run_dir = Path(cfg.out_dir) / cfg.name
    summaries = {r.label: summarize(r) for r in results}
    for r in results:
        s = summaries[r.label]
        tail = max(3, len(r.records) // 10)
        print(
            f"\n[{r.label}] reward {s['reward_start']:.3f} (first {tail} steps) -> {s['reward_final']:.3f} "
            f"(last {tail}), peak {s['reward_peak']:.3f}; exact answers {s['accuracy_final']:.1%}; "
            f"K3 KL mean {s['k3_kl_mean']:.2e}, max {s['k3_kl_max']:.2e}; {s['wall_s']:.1f} s"
        )
        if cfg.true_on_policy:
            fast = [x["time_rollout_fast_s"] for x in r.records if "time_rollout_fast_s" in x]
            aligned = [x["time_rollout_s"] for x in r.records]
            print(
                f"  true on-policy: rollout and trainer log-probs bitwise equal at every step "
                f"(max |diff| {s['logprob_abs_diff_max']:.1e}); aligned rollout {1e3 * sum(aligned) / len(aligned):.0f} ms "
                f"per step vs fast fp32 engine {1e3 * sum(fast) / max(len(fast), 1):.0f} ms "
                f"({sum(aligned) / max(sum(fast), 1e-9):.1f}x)"
            )
        if r.evaluation:
            print(
                f"  greedy decoding of 64 fresh prompts after training: reward {r.evaluation['greedy_reward']:.3f}, "
                f"exact {r.evaluation['greedy_exact']:.1%}"
            )
        print(f"  lr schedule: {r.schedule}")
        for line in r.samples:
            print(f"  greedy: {line}")
    if cfg.compare:
        print("\n" + format_table(summaries))
    if cfg.plot:
        rollout = "true on-policy" if cfg.true_on_policy else f"{cfg.precision} rollouts"
        if cfg.staleness:
            share = "" if cfg.stale_fraction == 1 else f" for {cfg.stale_fraction:g} of the groups"
            rollout += f" from the weights {cfg.staleness} step(s) earlier{share}"
        title = f"megatron-mis demo '{cfg.name}': {rollout}, TP={cfg.tp} CP={cfg.cp} PP={cfg.pp} DP={cfg.dp}, seed {cfg.seed}"
        png = plot_report({r.label: r.records for r in results}, run_dir / "report.png", title=title)
        print(f"\nreport:  {png}")
    summary_path = run_dir / "summary.json"
    summary_path.write_text(
        json.dumps({"config": asdict(cfg), "summaries": summaries}, indent=2, default=str) + "\n", encoding="utf-8"
    )
    print(f"metrics: {run_dir / 'metrics.jsonl'}\nsummary: {summary_path}")


def describe(cfg) -> str:
    layout = f"TP={cfg.tp} CP={cfg.cp} PP={cfg.pp} DP={cfg.dp}: {cfg.world_size} process(es) on gloo, {cfg.num_threads} thread(s) each"
    rollout = "true on-policy (the trainer's kernels, fp32)" if cfg.true_on_policy else f"fast engine in {cfg.precision} (KV cache)"
    runs = " then ".join(cfg.arms)
    return (
        f"megatron-mis demo: {cfg.steps} GRPO steps of {cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples, "
        f"task '{cfg.task}' ({cfg.min_digits}-{cfg.max_digits} digits), Megatron-Core GPT hidden {cfg.hidden_size} x "
        f"{cfg.num_layers} layers, vocabulary {cfg.vocab_size}\n"
        f"  rollouts: {rollout}; trainer: fp32 pi_old recompute; correction: {runs}\n"
        f"  layout: {layout}" + _mechanisms(cfg)
    )


def _mechanisms(cfg) -> str:
    """The dose-response mechanisms switched on (an empty string by default)."""
    parts = []
    if cfg.staleness:
        share = "" if cfg.stale_fraction == 1 else f" for {cfg.stale_fraction:g} of the prompt groups (the rest fresh)"
        parts.append(f"rollouts from the weights of {cfg.staleness} optimizer step(s) earlier{share}")
    if cfg.resolved_trainer_temperature != cfg.temperature:
        parts.append(f"rollout temperature {cfg.temperature:g}, trainer temperature {cfg.resolved_trainer_temperature:g}")
    if cfg.top_p < 1 or cfg.top_k:
        parts.append(f"rollout top_p {cfg.top_p:g} / top_k {cfg.top_k} ({cfg.rollout_logprobs} log-probs recorded), "
                     + (f"the trainer replays the rollout's support (entropy: {cfg.replay_entropy})" if cfg.trainer_truncation
                        else "no truncation in the trainer"))
    if cfg.scratchpad or cfg.distractors:
        parts.append(f"long-tail task: {cfg.scratchpad} scratchpad tokens {cfg.scratchpad_position} the answer, {cfg.distractors} distractors")
    return "".join(f"\n  mechanism: {p}" for p in parts)


def run(args: argparse.Namespace) -> int:
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = build_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)

    from megatron_mis.cli.stopping import Stopped, stop_on_sigterm, stopped_exit
    from megatron_mis.testbed.demo.launch import DemoError, launch

    print(describe(cfg), flush=True)
    try:
        with stop_on_sigterm():  # SIGTERM stops the ranks as Ctrl-C does, instead of orphaning them
            results = launch(cfg)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (Stopped, KeyboardInterrupt) as exc:
        run_dir = os.path.join(cfg.out_dir, cfg.name)
        status, message = stopped_exit("demo", exc, f"; its ranks were stopped (the steps it finished, if any, are in "
                                                    f"{os.path.join(run_dir, 'metrics.jsonl')}; no report was written)")
        print(message, file=sys.stderr)
        return status
    report(cfg, results)
    return 0
