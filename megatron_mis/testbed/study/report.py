"""A study's summary (``summary.json``), its markdown report (``report.md``: the table, the paired
differences, the answers to the study's questions) and its PNG (reward curves with bootstrap
bands, K3 KL curves, forest plots of the paired differences against ``none``).

The PNG uses matplotlib's Agg canvas (no pyplot)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from megatron_mis.testbed.study.config import ARMS, OUTCOMES, SETTINGS, StudyConfig
from megatron_mis.testbed.study.runner import load_run, run_machine, run_path, study_dir
from megatron_mis.testbed.study.stats import (
    MIN_GAIN,
    bootstrap_ci,
    curve_band,
    moving_mean,
    paired_differences,
    run_metrics,
    wilson_interval,
)

__all__ = ["collect", "ended_low", "summarize_study", "format_markdown", "plot_study", "write_report"]

BASELINE = "none"
REFERENCES = ("ref_fp32", "ref_true_on_policy")


def collect(study: StudyConfig) -> dict[str, dict[int, dict[str, Any]]]:
    """``{arm: {seed: run}}`` of the finished runs (missing ones are skipped)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for arm in study.arm_names:
        for seed in study.seed_list:
            run = load_run(run_path(study, arm, seed))
            if run is not None:
                out.setdefault(arm, {})[seed] = run
    return out


def _ci(values: list[float], study: StudyConfig, seed: int = 0) -> list[float] | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return list(bootstrap_ci(vals, confidence=study.confidence, resamples=study.bootstrap, seed=seed))


def _machine() -> dict[str, Any]:
    """This machine, as the report's header gives it: :func:`run_machine` (CPU, cores, Python,
    torch) and the 1-minute load average when the report was written."""
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {**run_machine(), "load_average_1m_at_report": load}


def ended_low(metrics: dict[str, dict[int, dict[str, Any]]], collapse_fraction: float) -> dict[str, Any] | None:
    """The runs that kept less than ``1 - collapse_fraction`` of what the reference learned.

    The collapse count sees only a run that first gained ``MIN_GAIN`` and then lost part of it; a
    run that never reached the plateau (it learned a little, or nothing) does not count. This
    count does: with the reference arm's mean gain ``G = mean(peak - start)`` over its seeds, a
    run *ended low* when ``final - start < (1 - collapse_fraction) G``. ``None`` without a
    reference arm or when the reference itself gained less than ``MIN_GAIN`` (nothing to lose).
    Returns ``{"reference", "reference_gain", "bar", "arms": {arm: seeds that ended low}}``."""
    ref = next((r for r in REFERENCES if metrics.get(r)), None)
    if ref is None:
        return None
    gain = float(np.mean([m["peak_reward"] - m["start_reward"] for m in metrics[ref].values()]))
    if gain < MIN_GAIN:
        return None
    bar = (1.0 - collapse_fraction) * gain
    return {"reference": ref, "reference_gain": gain, "bar": bar,
            "arms": {arm: sorted(s for s, m in by_seed.items() if m["final_reward"] - m["start_reward"] < bar)
                     for arm, by_seed in metrics.items()}}


def summarize_study(study: StudyConfig, runs: dict[str, dict[int, dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Per-arm statistics and paired differences of a (possibly partial) study."""
    runs = collect(study) if runs is None else runs
    metrics = {
        arm: {
            seed: run_metrics(run["records"], run["end"], last_k=study.last_k, threshold=study.resolved_threshold,
                              collapse_fraction=study.collapse_fraction)
            for seed, run in by_seed.items()
        }
        for arm, by_seed in runs.items()
    }

    def per_seed(arm: str, key: str, transform=None) -> dict[int, float]:
        out = {}
        for seed, m in metrics.get(arm, {}).items():
            v = m.get(key)
            if v is not None:
                out[seed] = transform(v) if transform else v
        return out

    def paired(arm: str, base: str, key: str, transform=None) -> dict[str, Any] | None:
        if arm == base or base not in metrics:
            return None
        return paired_differences(per_seed(arm, key, transform), per_seed(base, key, transform),
                                  confidence=study.confidence, resamples=study.bootstrap)

    log10 = lambda v: math.log10(max(v, 1e-30))  # noqa: E731
    low = ended_low(metrics, study.collapse_fraction)
    arms: dict[str, Any] = {}
    for i, arm in enumerate(study.arm_names):
        ms = list(metrics.get(arm, {}).values())
        if not ms:
            continue
        n = len(ms)
        collapses = sum(m["collapsed"] for m in ms)
        reached = [m["steps_to_threshold"] for m in ms if m["steps_to_threshold"] is not None]
        ref = next((r for r in REFERENCES if r in metrics and r != arm), None)
        arms[arm] = {
            "description": ARMS[arm].description,
            "reference": ARMS[arm].reference,
            "n": n,
            "seeds": sorted(metrics[arm]),
            "final_reward": _ci([m["final_reward"] for m in ms], study, i),
            "greedy_reward": _ci([m["greedy_reward"] for m in ms], study, i),
            "greedy_exact": _ci([m["greedy_exact"] for m in ms], study, i),
            "peak_reward": _ci([m["peak_reward"] for m in ms], study, i),
            "collapse": {"k": collapses, "n": n, "rate": collapses / n,
                         "interval": list(wilson_interval(collapses, n, confidence=study.confidence))},
            "ended_low": None if low is None else {"k": len(low["arms"][arm]), "n": n, "seeds": low["arms"][arm],
                                                   "reference": low["reference"], "bar": low["bar"]},
            "steps_to_threshold": {"reached": len(reached), "n": n, "mean": _ci(reached, study, i)},
            "k3_mean": _ci([m["k3_mean"] for m in ms], study, i),
            "k3_max": _ci([m["k3_max"] for m in ms], study, i),
            "k3_token_max": max((m["k3_token_max"] or 0.0) for m in ms),
            "k3_late_early": _ci([m["k3_late_early"] for m in ms], study, i),
            "rejected_fraction": _ci([m["rejected_fraction"] for m in ms], study, i),
            "route_flip_mean": _ci([m.get("route_flip_mean") for m in ms], study, i),
            "wall_s": float(np.mean([m["wall_s"] for m in ms])),
            "vs_none": {
                "final_reward": paired(arm, BASELINE, "final_reward"),
                "greedy_reward": paired(arm, BASELINE, "greedy_reward"),
                "log10_k3_mean": paired(arm, BASELINE, "k3_mean", log10),
                "k3_late_early": paired(arm, BASELINE, "k3_late_early"),
                "steps_to_threshold": paired(arm, BASELINE, "steps_to_threshold"),
            },
            # steps to threshold: over the seeds on which both runs reached it
            "vs_reference": {"reference": ref, "final_reward": paired(arm, ref, "final_reward") if ref else None,
                             "greedy_reward": paired(arm, ref, "greedy_reward") if ref else None,
                             "steps_to_threshold": paired(arm, ref, "steps_to_threshold") if ref else None},
            "per_seed": {str(s): metrics[arm][s] for s in sorted(metrics[arm])},
        }
    summary = {
        "setting": study.setting,
        "setting_description": SETTINGS[study.setting].description,
        "study": study.to_dict(),
        "steps": study.resolved_steps,
        "threshold": study.resolved_threshold,
        "outcome": SETTINGS[study.setting].outcome,
        "machine": _machine(),
        "threads_per_run": study.threads,
        "parallel_runs": study.num_jobs,
        "arms": arms,
    }
    summary["answers"] = _answers(summary, metrics, study)
    return summary


def _fmt_ci(ci: list[float] | None, fmt: str = "{:.3f}") -> str:
    if ci is None:
        return "-"
    return f"{fmt.format(ci[0])} [{fmt.format(ci[1])}, {fmt.format(ci[2])}]"


def _fmt_count(c: dict[str, Any] | None) -> str:
    return "-" if c is None else f"{c['k']}/{c['n']}"


def _fmt_diff(d: dict[str, Any] | None, fmt: str = "{:+.3f}") -> str:
    if d is None:
        return "-"
    mark = " *" if d["excludes_zero"] else ""
    return f"{fmt.format(d['mean'])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]{mark}"


def _verdict(d: dict[str, Any], *, supported_if: str) -> str:
    """``supported`` / ``contradicted`` when the paired CI excludes 0 (on the claimed side / the
    other), else ``not resolved``."""
    if not d["excludes_zero"]:
        return f"not resolved (CI includes 0, n={d['n']})"
    above = d["low"] > 0
    return "supported" if above == (supported_if == "above") else "contradicted"


def _answers(summary: dict[str, Any], metrics: dict[str, Any], study: StudyConfig) -> dict[str, str]:
    """The study's questions, answered from the numbers (sentences for the report)."""
    arms = summary["arms"]
    key = summary["outcome"]  # the reward the arms are compared on
    name = OUTCOMES[key]
    out: dict[str, str] = {}
    refs = [r for r in REFERENCES if r in arms]
    if BASELINE in arms and refs:
        parts = []
        harmed = False
        for r in refs:
            d = paired_differences({s: m[key] for s, m in metrics[BASELINE].items()},
                                   {s: m[key] for s, m in metrics[r].items()},
                                   confidence=study.confidence, resamples=study.bootstrap)
            if d is None:
                continue
            worse = d["excludes_zero"] and d["high"] < 0
            harmed |= worse
            parts.append(f"none - {r} {name} {_fmt_diff(d)} over {d['n']} seeds "
                         f"({'CI below 0: measurably worse' if worse else 'CI includes 0 or is above it: not measurably worse'})")
        c = arms[BASELINE]["collapse"]
        majority = c["k"] > c["n"] / 2
        parts.append(f"none collapsed in {c['k']}/{c['n']} seeds" + (" (a clear majority)" if majority else ""))
        out["a_mismatch_hurts"] = ("YES: " if harmed or majority else "NO: ") + "; ".join(parts)
        ref = refs[0]
        ref_ci = arms[ref][key]
        within = [a for a, s in arms.items() if a not in (BASELINE, *REFERENCES) and s[key] and ref_ci
                  and ref_ci[1] <= s[key][0] <= ref_ci[2]]
        out["b_correction_recovers"] = (
            f"arms whose mean {name} lies within {ref}'s CI {_fmt_ci(ref_ci)}: "
            + (", ".join(f"{a} ({arms[a][key][0]:.3f})" for a in within) if within else "none")
        )
    if BASELINE in arms:
        worse = [a for a, v in arms.items() if (v["vs_none"][key] or {}).get("excludes_zero")
                 and v["vs_none"][key]["high"] < 0]
        better = [a for a, v in arms.items() if (v["vs_none"][key] or {}).get("excludes_zero")
                  and v["vs_none"][key]["low"] > 0]
        out["arms_vs_none"] = (
            f"measurably worse than none ({name}): "
            + (", ".join(f"{a} {_fmt_diff(arms[a]['vs_none'][key])}, rejected {arms[a]['rejected_fraction'][0]:.0%}"
                         for a in worse) or "none of them")
            + "; measurably better: " + (", ".join(f"{a} {_fmt_diff(arms[a]['vs_none'][key])}" for a in better)
                                        or "none of them")
        )
    if "sequence_mis" in arms and "token_mis" in arms:
        d = paired_differences({s: m["final_reward"] for s, m in metrics["sequence_mis"].items()},
                               {s: m["final_reward"] for s, m in metrics["token_mis"].items()},
                               confidence=study.confidence, resamples=study.bootstrap)
        if d:
            verdict = _verdict(d, supported_if="above")
            out["seed001_sequence_beats_token"] = f"sequence_mis - token_mis final reward {_fmt_diff(d)}: {verdict}"
    for arm in ("token_mis", "sequence_mis"):
        if arm in arms and BASELINE in arms:
            d = arms[arm]["vs_none"]["k3_late_early"]
            if d:
                verdict = _verdict(d, supported_if="below")
                out[f"seed000_{arm}_suppresses_late_k3"] = (
                    f"{arm}: late/early K3 ratio {_fmt_ci(arms[arm]['k3_late_early'], '{:.2f}')} vs none "
                    f"{_fmt_ci(arms[BASELINE]['k3_late_early'], '{:.2f}')}, paired {_fmt_diff(d, '{:+.2f}')}: {verdict}"
                )
    for arm in ("r3", "r3_token_tis"):
        if arm in arms and BASELINE in arms:
            a = arms[arm]
            ref = a["vs_reference"]["reference"]
            parts = [f"{arm} - none final reward {_fmt_diff(a['vs_none']['final_reward'])}"]
            if ref and a["vs_reference"]["final_reward"]:
                ref_ci = arms[ref]["final_reward"]
                inside = ref_ci[1] <= a["final_reward"][0] <= ref_ci[2]
                parts.append(f"{arm} - {ref} {_fmt_diff(a['vs_reference']['final_reward'])} (mean "
                             f"{a['final_reward'][0]:.3f} {'within' if inside else 'outside'} {ref}'s CI {_fmt_ci(ref_ci)})")
            parts.append(f"log10 mean K3 vs none {_fmt_diff(a['vs_none']['log10_k3_mean'], '{:+.2f}')} "
                         f"(K3 {_fmt_ci(a['k3_mean'], '{:.1e}')} vs none {_fmt_ci(arms[BASELINE]['k3_mean'], '{:.1e}')})")
            if arms[BASELINE]["route_flip_mean"]:
                parts.append(f"rollout experts the fp32 router does not choose (none): "
                             f"{_fmt_ci(arms[BASELINE]['route_flip_mean'], '{:.2%}')}")
            out[f"{arm}_recovers"] = "; ".join(parts)
    if "length_decay" in arms and BASELINE in arms:
        d = arms["length_decay"]["vs_none"]["log10_k3_mean"]
        if d:
            verdict = _verdict(d, supported_if="below")
            out["seed002_length_decay_keeps_k3_low"] = (
                f"length_decay - none, log10 mean K3 {_fmt_diff(d, '{:+.2f}')}: {verdict}"
            )
    return out


def format_markdown(summary: dict[str, Any]) -> str:
    """The report: setting, machine, the per-arm table, paired differences, answers."""
    s = summary
    st = s["study"]
    lines = [
        f"# Study: setting `{s['setting']}`",
        "",
        f"{s['setting_description']}. {s['steps']} RL steps per run, seeds {st['first_seed']}..{st['first_seed'] + st['seeds'] - 1}; "
        f"machine: {s['machine']['cpu']}, {s['machine']['cores']} cores, {s['parallel_runs']} runs in parallel x "
        f"{s['threads_per_run']} thread(s). Means with {int(st['confidence'] * 100)}% percentile-bootstrap CIs "
        f"({st['bootstrap']} resamples); final reward = mean of the last {st['last_k']} steps; collapse: gained >= 0.1 "
        f"then lost > {st['collapse_fraction']:.0%} of the gain; ended low: kept less than "
        f"{1 - st['collapse_fraction']:.0%} of the reference's mean gain (final - start), so also a run that never "
        f"reached the plateau; steps to threshold: the first step whose {min(st['last_k'], s['steps'])}-step mean reward reaches {s['threshold']}. "
        "Paired differences are per seed against `none`; `*` marks a CI that excludes 0."
        + ("" if s["outcome"] == "final_reward" else
           f" The answers compare the arms on the {OUTCOMES[s['outcome']]}: this setting's reference samples from "
           "another distribution than its arms, so its training reward is not comparable."),
        "",
    ]
    moe = any(a.get("route_flip_mean") for a in s["arms"].values())
    flip_head = " route flips |" if moe else ""
    lines += [
        "| arm | n | final reward | greedy reward | collapse | ended low | reached threshold (steps) | K3 mean | K3 max (step mean) | "
        f"late/early K3 | rejected |{flip_head} final - none | greedy - none |",
        "| --- " * (14 if moe else 13) + "|",
    ]
    for arm, a in s["arms"].items():
        c = a["collapse"]
        t = a["steps_to_threshold"]
        reach = f"{t['reached']}/{t['n']}" + (f" ({t['mean'][0]:.0f})" if t["mean"] else "")
        lines.append(
            f"| {arm} | {a['n']} | {_fmt_ci(a['final_reward'])} | {_fmt_ci(a['greedy_reward'])} | "
            f"{c['k']}/{c['n']} | {_fmt_count(a.get('ended_low'))} | {reach} | {_fmt_ci(a['k3_mean'], '{:.1e}')} | "
            f"{_fmt_ci(a['k3_max'], '{:.1e}')} | "
            f"{_fmt_ci(a['k3_late_early'], '{:.2f}')} | {a['rejected_fraction'][0]:.2%} | "
            + (f"{_fmt_ci(a.get('route_flip_mean'), '{:.2%}')} | " if moe else "")
            + f"{_fmt_diff(a['vs_none']['final_reward'])} | {_fmt_diff(a['vs_none']['greedy_reward'])} |"
        )
    lines += ["", "## Answers", ""]
    for key, text in s["answers"].items():
        lines.append(f"- **{key}**: {text}")
    lines += ["", "## Arms", ""]
    for arm, a in s["arms"].items():
        lines.append(f"- `{arm}`: {a['description']} (mean wall time per run {a['wall_s']:.0f} s)")
    return "\n".join(lines) + "\n"


def plot_study(summary: dict[str, Any], runs: dict[str, dict[int, dict[str, Any]]], path: str | Path,
               *, confidence: float = 0.95) -> None:
    """Four panels: reward per step (mean over seeds, bootstrap band), K3 KL per step (mean over
    seeds, log axis), and forest plots of the paired differences against none (final reward,
    greedy reward)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = [a for a in summary["arms"] if a in runs]
    fig = Figure(figsize=(15, 10), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    cmap = __import__("matplotlib").colormaps["tab20"]
    order = [0, 6, 4, 2, 8, 10, 12, 14, 16, 18, 1, 7, 5, 3, 9, 11, 13, 15, 17, 19]  # strong colours first
    colors = {a: cmap(order[i % 20]) for i, a in enumerate(arms)}
    emphasis = {BASELINE, *REFERENCES}

    def curves(arm: str, key: str) -> np.ndarray:
        rows = []
        for run in runs[arm].values():
            rows.append([r.get(key) if r.get(key) is not None else np.nan for r in run["records"]])
        width = min(len(r) for r in rows)
        return np.array([r[:width] for r in rows], dtype=np.float64)

    ax = axes[0, 0]
    smooth = 5
    for arm in arms:
        x = curves(arm, "reward_mean")
        if x.shape[1] >= smooth:  # each run's 5-step moving mean, then the band over runs
            x = np.stack([moving_mean(row, smooth) for row in x])
        mean, low, high = curve_band(x, confidence=confidence)
        steps = np.arange(1, mean.size + 1) + (smooth - 1 if curves(arm, "reward_mean").shape[1] >= smooth else 0)
        lw = 2.2 if arm in emphasis else 1.0
        ls = "--" if arm in REFERENCES else "-"
        ax.plot(steps, mean, color=colors[arm], lw=lw, ls=ls, label=f"{arm} (n={x.shape[0]})")
        if arm in emphasis or len(arms) <= 4:
            ax.fill_between(steps, low, high, color=colors[arm], alpha=0.15, lw=0)
    ax.set(title=f"reward ({smooth}-step moving mean): mean over seeds, {int(confidence * 100)}% bootstrap band (none, refs)",
           xlabel="RL step", ylabel="reward")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[0, 1]
    for arm in arms:
        x = curves(arm, "mis_k3_kl")
        mean = np.nanmean(x, axis=0)
        steps = np.arange(1, mean.size + 1)
        if np.nanmax(mean) <= 0:
            continue
        ax.plot(steps, np.where(mean > 0, mean, np.nan), color=colors[arm], lw=2.2 if arm in emphasis else 1.0,
                ls="--" if arm in REFERENCES else "-", label=arm)
    ax.set_yscale("log")
    zero = [a for a in arms if a in runs and np.nanmax(curves(a, "mis_k3_kl")) <= 0]
    ax.set(title="K3 KL(pi_old || pi_rollout) per step, mean over seeds" + (f" ({', '.join(zero)}: exactly 0)" if zero else ""),
           xlabel="RL step", ylabel="K3 KL")
    ax.legend(fontsize=7, ncol=2)
    for ax, key, title in ((axes[1, 0], "final_reward", "final reward"), (axes[1, 1], "greedy_reward", "greedy reward")):
        rows = [(a, summary["arms"][a]["vs_none"][key]) for a in arms if summary["arms"][a]["vs_none"].get(key)]
        for i, (arm, d) in enumerate(rows):
            y = len(rows) - 1 - i
            color = "#d62728" if d["excludes_zero"] and d["mean"] < 0 else ("#2ca02c" if d["excludes_zero"] else "#444444")
            ax.errorbar(d["mean"], y, xerr=[[d["mean"] - d["low"]], [d["high"] - d["mean"]]], fmt="o", color=color, capsize=3)
            ax.scatter(list(d["diffs"].values()), [y] * len(d["diffs"]), s=8, color=colors[arm], alpha=0.6)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_yticks(range(len(rows)), [a for a, _ in reversed(rows)], fontsize=8)
        ax.set(title=f"paired difference vs none, {title} (mean, {int(confidence * 100)}% CI, per-seed dots)",
               xlabel=f"{title} - none (same seed)")
    fig.suptitle(f"megatron-mis study: {summary['setting']} — {summary['setting_description']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path))


def write_report(study: StudyConfig) -> dict[str, Any]:
    """Write ``summary.json``, ``report.md`` (and ``report.png``) into the study's folder; returns
    the summary."""
    runs = collect(study)
    summary = summarize_study(study, runs)
    out = study_dir(study)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n", encoding="utf-8")
    (out / "report.md").write_text(format_markdown(summary), encoding="utf-8")
    if study.plot and runs:
        plot_study(summary, runs, out / "report.png", confidence=study.confidence)
    return summary
