"""The report of a dose-response sweep (``megatron-mis study --sweep NAME``): per dose and arm the
measured K3 KL, the outcome (the final reward, or the greedy reward where the sweep's reference
samples differently: :attr:`Sweep.outcome`), its paired differences against the no-mismatch
reference and against ``none``, collapse rate, steps to threshold, mean gradient norm and the fraction of runs the
mismatch monitor flagged; the paired SD of ``none - reference``, the seeds a 0.05 difference needs
and the minimal detectable effect at the seeds run; the first dose where ``none`` falls measurably
behind the reference. Written to ``OUT_DIR/sweep-NAME/`` (``report.md``, ``summary.json``,
``report.png``); each dose keeps its own study report in ``OUT_DIR/NAME-LABEL/``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from megatron_mis.testbed.study.config import OUTCOMES, SWEEPS, StudyConfig
from megatron_mis.testbed.study.report import (
    BASELINE,
    REFERENCES,
    _fmt_ci,
    _fmt_count,
    _fmt_diff,
    _machine,
    collect,
    summarize_study,
)
from megatron_mis.testbed.study.runner import machine_label
from megatron_mis.testbed.study.stats import minimal_detectable_effect, seeds_for_effect

__all__ = ["TARGET_EFFECT", "summarize_sweep", "format_sweep_markdown", "plot_sweep", "write_sweep_report", "sweep_dir"]

#: The reward difference the seed count is chosen to detect (issue 29).
TARGET_EFFECT = 0.05


def sweep_dir(study: StudyConfig) -> Path:
    return Path(study.out_dir) / f"sweep-{study.sweep}"


def _run_extras(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean gradient norm over steps and seeds; the mean share of sequences a rejection rule
    dropped (over steps and seeds, ``rejected_seq_fraction``); the runs the mismatch monitor
    flagged on a mismatch metric (K3 KL, log-ppl gap: warnings whose message starts with ``mis_``)
    and on any metric (gradient norm included)."""
    norms = [r["grad_norm"] for run in runs.values() for r in run["records"] if r.get("grad_norm") is not None]
    rejected = [r["rejected_seq_fraction"] for run in runs.values() for r in run["records"]
                if r.get("rejected_seq_fraction") is not None]
    warned = [[w for r in run["records"] for w in (r.get("monitor_warnings") or [])] for run in runs.values()]
    return {
        "grad_norm_mean": float(np.mean(norms)) if norms else None,
        "rejected_seq_mean": float(np.mean(rejected)) if rejected else None,
        "monitor_flagged": {"k": sum(any(w.startswith("mis_") for w in ws) for ws in warned), "n": len(warned)},
        "monitor_any": {"k": sum(bool(ws) for ws in warned), "n": len(warned)},
    }


def _fmt_reached(t: dict[str, Any]) -> str:
    """``"k/n"``, and the mean first step of the ``k`` runs that reached the threshold with its CI."""
    return f"{t['reached']}/{t['n']}" + (f" ({_fmt_ci(t['mean'], '{:.0f}')})" if t["mean"] else "")


def _fmt_paired_steps(d: dict[str, Any] | None) -> str:
    """The paired steps-to-threshold difference, its CI and the seeds paired."""
    return "-" if d is None else f"{_fmt_diff(d, '{:+.0f}')} (n {d['n']})"


def _per_dose_mde(summary: dict[str, Any]) -> str:
    """``""`` when every dose ran the same number of paired seeds; otherwise, since ``seeds_run`` is
    the fewest, the minimal detectable effect at each other seed count and the doses that ran it, e.g.
    ``" (k16, k64: 16 seeds, 0.123)"``."""
    by_n: dict[int, list[str]] = {}
    for d in summary["doses"]:
        if d["none_vs_reference"]:
            by_n.setdefault(d["none_vs_reference"]["n"], []).append(str(d["label"]))
    others = sorted(n for n in by_n if n != summary["seeds_run"])
    if not others:
        return ""
    sd = summary["paired_sd"]
    return " (" + "; ".join(f"{', '.join(by_n[n])}: {n} seeds, {minimal_detectable_effect(sd, n):.3f}"
                            for n in others) + ")"


def summarize_sweep(study: StudyConfig, *, write_dose_reports: bool = True) -> dict[str, Any]:
    """Per dose the study summary's rows (plus gradient norm and monitor flags), the paired SD
    and the seed rule; also writes each dose's own report when ``write_dose_reports``."""
    from megatron_mis.testbed.study.report import write_report

    sweep = SWEEPS[study.sweep]
    doses = []
    made_on: dict[str, int] = {}  # machine label -> runs
    for label in study.dose_labels:
        sub = study.for_dose(label)
        runs = collect(sub)
        if not runs:
            continue
        summary = write_report(sub) if write_dose_reports else summarize_study(sub, runs)
        for arm, row in summary["arms"].items():
            row.update(_run_extras(runs.get(arm, {})))
            row.pop("per_seed", None)
        ref = next((r for r in REFERENCES if r in summary["arms"]), None)
        diff = summary["arms"].get(BASELINE, {}).get("vs_reference", {}).get(sweep.outcome) if ref else None
        for arm_runs in runs.values():
            for run in arm_runs.values():
                label_of_run = machine_label(run)
                made_on[label_of_run] = made_on.get(label_of_run, 0) + 1
        doses.append({"label": label, "dose": sweep.dose_value(label), "setting": sub.setting, "reference": ref,
                      "arms": summary["arms"], "none_vs_reference": diff})
    diffs = [v for d in doses if d["none_vs_reference"] for v in d["none_vs_reference"]["diffs"].values()]
    # paired SD of none - reference, pooled over doses (each dose's differences centred on its mean)
    centred = [v - d["none_vs_reference"]["mean"] for d in doses if d["none_vs_reference"]
               for v in d["none_vs_reference"]["diffs"].values()]
    dof = len(centred) - sum(1 for d in doses if d["none_vs_reference"])
    paired_sd = math.sqrt(sum(c * c for c in centred) / dof) if dof > 0 else None
    n_seeds = min((d["none_vs_reference"]["n"] for d in doses if d["none_vs_reference"]), default=0)
    first_hurt = next((d["label"] for d in doses if d["none_vs_reference"] and d["none_vs_reference"]["excludes_zero"]
                       and d["none_vs_reference"]["high"] < 0), None)
    return {
        "sweep": sweep.name,
        "description": sweep.description,
        "measure": sweep.measure,
        "study": study.to_dict(),
        "steps": study.resolved_steps,
        "threshold": study.resolved_threshold,
        "outcome": sweep.outcome,
        "machine": _machine(),
        "runs_made_on": made_on,
        "threads_per_run": study.threads,
        "parallel_runs": study.num_jobs,
        "doses": doses,
        "paired_sd": paired_sd,
        "paired_differences": len(diffs),
        "seeds_run": n_seeds,
        "target_effect": TARGET_EFFECT,
        "seeds_for_target": seeds_for_effect(paired_sd, TARGET_EFFECT) if paired_sd is not None else None,
        "minimal_detectable_effect": minimal_detectable_effect(paired_sd, n_seeds) if paired_sd is not None and n_seeds else None,
        "first_dose_none_behind_reference": first_hurt,
    }


def format_sweep_markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    key = summary["outcome"]
    name = OUTCOMES[key]
    outcome_note = [] if key == "final_reward" else [
        f"Arms are compared on the {name} after training: the reference samples from another distribution than "
        "the arms, so its training reward (and the collapse, ended-low and threshold columns, which read the "
        "training reward) is not comparable with theirs.",
        "",
    ]
    lines = [
        f"# Dose-response sweep `{summary['sweep']}`",
        "",
        f"{summary['description']}.",
        "",
        f"Dose: `{summary['measure']}`; {summary['steps']} steps per run; {summary['threads_per_run']} thread(s) per run. "
        f"This report was written on {m['cores']} core(s) ({m['cpu']}) by a command with {summary['parallel_runs']} "
        "run(s) in parallel; the runs themselves may have been made elsewhere (below).",
        "",
        "Runs made on: " + ("; ".join(f"{k} ({v} runs)" for k, v in summary.get("runs_made_on", {}).items()) or "-")
        + ". The same seed follows the same trajectory only on the same software and CPU kernels.",
        "",
        *outcome_note,
        f"| dose | arm | n | K3 KL mean | {name} | vs reference | vs none | collapse | ended low "
        "| reached threshold (mean steps) | steps to threshold vs reference | grad norm | monitor: mismatch / any |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in summary["doses"]:
        for arm, row in d["arms"].items():
            k3 = row["k3_mean"]
            gn = row.get("grad_norm_mean")
            mon = row.get("monitor_flagged", {"k": 0, "n": 0})
            anyw = row.get("monitor_any", {"k": 0, "n": 0})
            flip = row.get("route_flip_mean")
            rej = row.get("rejected_seq_mean")
            lines.append(
                f"| {d['dose']} | {arm} | {row['n']} | {'-' if k3 is None else f'{k3[0]:.2e}'}"
                f"{'' if not flip else f' (flips {flip[0]:.1%})'}{'' if not rej else f' (rejects {rej:.1%} of seqs)'} "
                f"| {_fmt_ci(row[key])} "
                f"| {_fmt_diff(row['vs_reference'][key])} | {_fmt_diff(row['vs_none'][key])} "
                f"| {row['collapse']['k']}/{row['collapse']['n']} | {_fmt_count(row.get('ended_low'))} "
                f"| {_fmt_reached(row['steps_to_threshold'])} "
                f"| {_fmt_paired_steps(row['vs_reference'].get('steps_to_threshold'))} "
                f"| {'-' if gn is None else f'{gn:.3f}'} | {mon['k']}/{mon['n']} / {anyw['k']}/{anyw['n']} |"
            )
    sd = summary["paired_sd"]
    frac = summary["study"]["collapse_fraction"]
    lines += ["", "`*`: the paired bootstrap interval excludes 0. Collapse: gained >= 0.1, then lost more than "
              f"{frac:.0%} of it. Ended low: kept less than {1 - frac:.0%} of the dose's reference's mean gain (final - "
              "start), which also counts a run that never reached the plateau. Reached threshold: runs whose "
              f"{min(summary['study']['last_k'], summary['steps'])}-step mean reward reached {summary['threshold']}, and "
              "the mean of their first such step. Steps to threshold vs reference: that step minus the reference's, "
              "paired over the n seeds on which both reached it (a run that never did is not in it). Monitor: runs "
              "with a warning on K3 KL or the log-ppl gap / runs with any warning (the gradient norm's included).", ""]
    if sd is None:
        lines.append("Paired SD of none - reference: not measured (needs >= 2 seeds of none and the reference at a dose).")
    else:
        lines.append(
            f"Paired SD of the {name}, none - reference (pooled over doses, {summary['paired_differences']} pairs): "
            f"{sd:.3f}. Seeds per dose for a {summary['target_effect']} difference (two-sided 5%, power 80%): "
            f"{summary['seeds_for_target']}. Minimal detectable effect with the {summary['seeds_run']} seeds run: "
            f"{summary['minimal_detectable_effect']:.3f}{_per_dose_mde(summary)}."
        )
    first = summary["first_dose_none_behind_reference"]
    lines.append("")
    lines.append(
        f"First dose where none falls measurably behind the reference: {first}." if first
        else "At no dose run does none fall measurably behind the reference (paired CI excludes 0 below)."
    )
    return "\n".join(lines) + "\n"


#: K3 at fp32 rounding (1e-14) is no mismatch: the reward-against-K3 panel starts above this.
K3_PLOT_FLOOR = 1e-9


def plot_sweep(summary: dict[str, Any], path: str | Path) -> None:
    """Three panels: over the doses (in the sweep's order), the outcome (final or greedy reward) per
    arm (mean and bootstrap interval) and K3 KL per arm (log axis); and the outcome against the measured K3 KL
    (each arm's point per dose, log axis; the reference's band across), the dose-response curve
    in the mismatch that a user can measure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    doses = summary["doses"]
    key = summary["outcome"]
    name = OUTCOMES[key]
    arms = list(dict.fromkeys(a for d in doses for a in d["arms"]))
    x = np.arange(len(doses))
    fig = Figure(figsize=(19, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax_r, ax_k, ax_rk = fig.subplots(1, 3)
    for j, arm in enumerate(arms):
        shift = (j - (len(arms) - 1) / 2) * 0.04
        pts = [(i, d["arms"][arm]) for i, d in enumerate(doses) if arm in d["arms"]]
        fr = [(i, r[key]) for i, r in pts if r[key]]
        if fr:
            xs = np.array([i for i, _ in fr]) + shift
            mean = np.array([c[0] for _, c in fr])
            err = np.array([[c[0] - c[1], c[2] - c[0]] for _, c in fr]).T
            ax_r.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=arm, color=f"C{j}")
        k3 = [(i, r["k3_mean"][0]) for i, r in pts if r["k3_mean"] and r["k3_mean"][0] > 0]
        if k3:
            ax_k.plot([i + shift for i, _ in k3], [v for _, v in k3], marker="o", label=arm, color=f"C{j}")
        both = [(r["k3_mean"][0], r[key][0]) for _, r in pts
                if r["k3_mean"] and r["k3_mean"][0] > K3_PLOT_FLOOR and r[key]]
        if arm in REFERENCES and fr:
            ref = [c for _, c in fr]
            ax_rk.axhspan(min(c[1] for c in ref), max(c[2] for c in ref), color="0.85", zorder=0,
                          label=f"{arm} (CI)")
        elif both:  # in dose order
            ax_rk.plot([k for k, _ in both], [v for _, v in both], marker="o", label=arm, color=f"C{j}")
    labels = [str(d["dose"]) for d in doses]
    for ax, title in ((ax_r, f"{name} (mean, bootstrap CI)"), (ax_k, "K3 KL, mean over steps and seeds")):
        ax.set_xticks(x, labels)
        ax.set_xlabel(summary["measure"])
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if ax_k.lines:
        ax_k.set_yscale("log")
    ax_rk.set_title(f"{name} against measured K3 KL (K3 > {K3_PLOT_FLOOR:g})")
    ax_rk.set_xlabel("K3 KL (mean over steps and seeds)")
    ax_rk.grid(alpha=0.3)
    if ax_rk.lines:
        ax_rk.set_xscale("log")
        ax_rk.legend(fontsize=8)
    ax_r.legend(fontsize=8)
    fig.suptitle(f"sweep {summary['sweep']}: {summary['steps']} steps per run")
    fig.tight_layout()
    fig.savefig(str(path))


def write_sweep_report(study: StudyConfig) -> dict[str, Any]:
    """Write ``summary.json``, ``report.md`` (and ``report.png``) into ``OUT_DIR/sweep-NAME/``;
    returns the summary."""
    summary = summarize_sweep(study)
    out = sweep_dir(study)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n", encoding="utf-8")
    (out / "report.md").write_text(format_sweep_markdown(summary), encoding="utf-8")
    if study.plot and summary["doses"]:
        plot_sweep(summary, out / "report.png")
    return summary
