"""The demo's outputs besides ``metrics.jsonl``: the PNG report (matplotlib's Agg canvas, no
pyplot) and the side-by-side table of ``--compare``.

The report has six panels over the RL steps: reward, K3 KL (mean and max), log-ppl abs diff,
importance-weight statistics (the raw token ratio pi_old / pi_rollout and the weight the loss
applied), rejected fraction, and learning rate. Under ``--compare`` both runs are overlaid.
Metrics that are exactly 0 throughout (true on-policy) are drawn on a linear axis and labelled
"exactly 0"; the others use a log axis where their range calls for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "draw_report", "format_table", "load_metrics", "plot_report"]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")

#: (summary key, column title, format) of the comparison table.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reward_start", "reward (first 10%)", "{:.3f}"),
    ("reward_final", "reward (last 10%)", "{:.3f}"),
    ("reward_peak", "peak reward", "{:.3f}"),
    ("accuracy_final", "exact answers (last 10%)", "{:.1%}"),
    ("greedy_reward", "greedy reward after", "{:.3f}"),
    ("greedy_exact", "greedy exact after", "{:.1%}"),
    ("k3_kl_mean", "K3 KL mean", "{:.2e}"),
    ("k3_kl_max", "K3 KL max", "{:.2e}"),
    ("log_ppl_abs_diff_mean", "log-ppl abs diff", "{:.2e}"),
    ("rejected_fraction_mean", "rejected tokens", "{:.2%}"),
    ("logprob_abs_diff_max", "max |logp diff|", "{:.2e}"),
    ("wall_s", "wall time", "{:.1f} s"),
)


def load_metrics(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Read a ``metrics.jsonl`` back: ``{run label: [records in step order]}``."""
    import json

    runs: dict[str, list[dict[str, Any]]] = {}
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                runs.setdefault(rec["run"], []).append(rec)
    return runs


def format_table(summaries: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table: one row per metric, one column per run."""
    labels = list(summaries)
    rows = [["", *labels]]
    for key, title, fmt in COLUMNS:
        cells = []
        for label in labels:
            v = summaries[label].get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        rows.append([title, *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _scale(ax, values: list[float], *, label_zero: bool = True) -> None:
    """Log axis for positive values spanning more than a factor of 20; linear (labelled, with
    ``label_zero``) when every value is exactly 0."""
    if label_zero and values and all(v == 0.0 for v in values):
        ax.text(0.5, 0.7, "exactly 0", transform=ax.transAxes, ha="center", va="center", fontsize=11, color="#555")
        return
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 20:
        ax.set_yscale("log")


def plot_report(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *, title: str = "") -> Path:
    """Draw the six-panel report of one or more runs (``{label: records}``) into ``path`` (PNG)."""
    fig = draw_report(runs, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def draw_report(runs: Mapping[str, Sequence[Mapping[str, Any]]], *, title: str = ""):
    """The six-panel report of :func:`plot_report` as a matplotlib ``Figure`` (axes row by row:
    reward, K3, log-ppl gap; IS weights, rejected fraction, learning rate). A panel of positive
    values spanning more than a factor of 20 (K3, the log-ppl gap, the IS weights and raw ratios:
    stale rollouts put raw ratios in the thousands) gets a log axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # a Figure with its own Agg canvas: no pyplot, no global backend switch
    fig = Figure(figsize=(13, 7), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    (ax_r, ax_k, ax_p), (ax_w, ax_rej, ax_lr) = axes
    collected: dict[Any, list[float]] = {ax: [] for ax in (ax_k, ax_p, ax_w, ax_rej)}
    for i, (label, records) in enumerate(runs.items()):
        c = _COLORS[i % len(_COLORS)]
        n = max(1, len(records) // 20)
        xs, ys = _series(records, "reward_mean")
        ax_r.plot(xs, ys, color=c, alpha=0.25, lw=1)
        ax_r.plot(xs, _smooth(ys, n), color=c, lw=2, label=f"{label}")
        xs, ys = _series(records, "mis_k3_kl")
        ax_k.plot(xs, ys, color=c, lw=1.6, label=f"{label} mean")
        collected[ax_k] += ys
        xs, ys = _series(records, "mis_k3_kl_max")
        ax_k.plot(xs, ys, color=c, lw=0.8, ls=":", label=f"{label} max")
        collected[ax_k] += ys
        xs, ys = _series(records, "mis_log_ppl_abs_diff")
        ax_p.plot(xs, ys, color=c, lw=1.6, label=label)
        collected[ax_p] += ys
        xs, lo = _series(records, "mis_ratio_min")
        _, hi = _series(records, "mis_ratio_max")
        if xs and len(lo) == len(hi):
            ax_w.fill_between(xs, lo, hi, color=c, alpha=0.15, lw=0, label=f"{label} raw ratio min-max")
            collected[ax_w] += lo + hi
        xs, ys = _series(records, "is_weight_mean")
        ax_w.plot(xs, ys, color=c, lw=1.6, label=f"{label} applied weight mean")
        collected[ax_w] += ys
        xs, lo = _series(records, "is_weight_min")
        _, hi = _series(records, "is_weight_max")
        ax_w.plot(xs, lo, color=c, lw=0.8, ls=":")
        ax_w.plot(xs, hi, color=c, lw=0.8, ls=":")
        collected[ax_w] += lo + hi
        xs, ys = _series(records, "rejected_token_fraction")
        ax_rej.plot(xs, ys, color=c, lw=1.6, label=label)
        collected[ax_rej] += ys
        xs, ys = _series(records, "lr")
        ax_lr.plot(xs, ys, color=c, lw=1.6, label=label)
    for ax in (ax_k, ax_p):
        _scale(ax, collected[ax])
    _scale(ax_w, collected[ax_w], label_zero=False)
    if collected[ax_rej] and all(v == 0.0 for v in collected[ax_rej]):
        ax_rej.text(0.5, 0.7, "nothing rejected", transform=ax_rej.transAxes, ha="center", va="center", fontsize=11, color="#555")
    lrs = [float(r["lr"]) for records in runs.values() for r in records if r.get("lr") is not None]
    if lrs:
        ax_lr.set_ylim(0.0, 1.15 * max(lrs))
    ax_r.set_title("reward (mean per step, smoothed)")
    ax_k.set_title("K3 KL(rollout || trainer) per token")
    ax_p.set_title("|log-ppl diff| rollout vs trainer")
    ax_w.set_title("IS weights: raw pi_old/pi_rollout, applied")
    ax_rej.set_title("rejected token fraction")
    ax_lr.set_title("learning rate")
    for ax in axes.flat:
        ax.set_xlabel("RL step")
        ax.grid(True, alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
