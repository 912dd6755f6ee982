"""Outputs of ``megatron-mis analyze`` over training: the terminal table, always-valid JSON and
the PNG report (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_mis.analysis.single import fmt

__all__ = ["format_compare", "format_history", "to_json", "json_safe", "plot_history", "recommendation"]

_COLUMNS = (
    ("rollout", "rollout_id", 7),
    ("samples", "num_samples", 7),
    ("resp_len", "response_length", 9),
    ("k3_mean", "k3_mean", 10),
    ("k3_p99", "k3_p99", 10),
    ("k3_max", "k3_max", 10),
    ("|dlogppl|", "log_ppl_abs_diff", 10),
    ("chi2_tok", "chi2_token", 10),
    ("tv", "tv", 10),
    ("ess_tok", "ess_token", 8),
    ("ess_seq", "ess_seq", 8),
    ("rej_tok", "rejected_token_fraction", 8),
    ("rej_seq", "rejected_seq_fraction", 8),
    ("veto_seq", "vetoed_seq_fraction", 8),
)

_COMPARE_COLUMNS = (
    ("kept_tok", "kept_tokens", 10),
    ("tok_share", "kept_token_share", 9),
    ("kept_seq", "kept_sequences", 9),
    ("seq_share", "kept_sequence_share", 9),
    ("ess", "ess", 8),
    ("w_min", "weight_min", 10),
    ("w_max", "weight_max", 10),
    ("eff_share", "effective_sample_share", 9),
)


def _cell(value: Any, width: int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:>{width}d}"
    text = fmt(value)
    if len(text) > width and value is not None:
        text = f"{float(value):.2e}"
    return f"{text:>{width}}"


def format_history(report: dict[str, Any]) -> str:
    """The terminal table: one row per rollout id, the monitor's warnings, the surge verdict and
    (with ``--compare``) one row per configuration."""
    rows = report["rows"]
    kinds: dict[int, list[str]] = {}
    for w in report["monitor"]["warnings"]:
        kinds.setdefault(w["rollout_id"], []).append(f"{w['kind']}:{w['metric']}")
    lines = [
        "megatron-mis mismatch over training",
        f"  data:   {report['num_files_analysed']} of {report['num_files']} file(s), format {report['format']}",
        f"  config: {report['config']}",
        "",
    ]
    header = " ".join(f"{name:>{w}}" for name, _, w in _COLUMNS) + "  warnings"
    lines.append(header)
    lines.append("-" * len(header))
    for row in rows:
        cells = " ".join(_cell(row.get(key), w) for _, key, w in _COLUMNS)
        lines.append(cells + ("  " + ", ".join(kinds.get(row["rollout_id"], [])) if row["rollout_id"] in kinds else ""))
    if rows:
        overall = report["overall"]
        lines.append("-" * len(header))
        lines.append(" ".join(("  all".rjust(w) if key == "rollout_id" else _cell(overall.get(key), w)) for _, key, w in _COLUMNS))
    lines += [
        "",
        "k3 = r - 1 - log r per loss token (mean, p99, max); |dlogppl| = |rollout - training log-ppl| per sequence;",
        "ess = (sum r)^2 / (n sum r^2); rej / veto = fractions rejected / vetoed by the config above.",
    ]
    rec = recommendation(report)
    if rec is not None:
        band = f", geometric band [{rec['geometric_band'][0]:.4f}, {rec['geometric_band'][1]:.4f}] at the mean length" if rec["geometric_band"] else ""
        lines += ["", f"Recommended correction: {rec['correction']}{band} ({rec['regime']}): {rec['reason']}.",
                  f"  basis: {rec['basis']} (docs/study.md, 'Which correction for which K3 and length')"]
    surge = report["surge"]
    lines.append("")
    if surge["fired"]:
        decay = ""
        if surge.get("decay_period") is not None:
            decay = (
                f"; the length-decay schedule triggers at step {surge['trigger_step']}, period T = "
                f"{surge['decay_period']}, first halving at step {surge['first_decay_step']}"
                f" (rollout {surge['first_decay_rollout_id']})"
            )
        lines.append(
            f"Length surge ({surge['detector']}): fired at rollout {surge['rollout_id']} (step {surge['step']}; "
            f"run-up from rollout {surge['onset_rollout_id']}): "
            f"smoothed length {surge['smoothed_length']:.1f} = {surge['ratio']:.2f}x reference "
            f"{surge['reference_length']:.1f}{decay}"
        )
    else:
        lines.append(f"Length surge ({surge['detector']}): not detected over {len(rows)} rollout(s)")
    warnings = report["monitor"]["warnings"]
    lines.append(f"Monitor warnings replayed: {len(warnings)}")
    for w in warnings:
        lines.append(f"  rollout {w['rollout_id']}: [{w['kind']}] {w['message']}")
    if report.get("compare"):
        lines += ["", format_compare(report)]
    if report["errors"]:
        lines += ["", f"Skipped {len(report['errors'])} bad file(s) / sample group(s):"]
        lines += [f"  {e['error']}" for e in report["errors"]]
    if report.get("notes"):
        lines += [""] + [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def format_compare(report: dict[str, Any]) -> str:
    """The what-if table: one row per ``--compare`` configuration, over all rollouts."""
    lines = ["What-if: each configuration on the same data (all rollouts)"]
    head = f"{'config':<24}" + " ".join(f"{name:>{w}}" for name, _, w in _COMPARE_COLUMNS)
    lines.append(head)
    lines.append("-" * len(head))
    for entry in report["compare"]:
        lines.append(f"{entry['config'][:24]:<24}" + " ".join(_cell(entry.get(key), w) for _, key, w in _COMPARE_COLUMNS))
    lines.append("ess = ESS of the kept tokens' final weights; eff_share = (sum w)^2 / (loss tokens x sum w^2) = ess x tok_share.")
    return "\n".join(lines)


def json_safe(value: Any, path: str = "$", replaced: list[str] | None = None) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (its JSON path appended to
    ``replaced``), tensors and tuples turned into lists."""
    if replaced is None:
        replaced = []
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        replaced.append(path)
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v, f"{path}.{k}", replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{path}[{i}]", replaced) for i, v in enumerate(value)]
    if hasattr(value, "tolist"):
        return json_safe(value.tolist(), path, replaced)
    return value


def recommendation(report: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`megatron_mis.analysis.recommend.recommend` on the report's overall mean K3, mean
    response length and (from its ratio histogram) share of tokens with pi_train / pi_rollout
    above about 1.12, as a dict; ``None`` when K3 or the length is missing or not finite."""
    from dataclasses import asdict

    from megatron_mis.analysis.recommend import recommend, share_ratio_above

    overall = report.get("overall") or {}
    k3, length = overall.get("k3_mean"), overall.get("response_length")
    if k3 is None or length is None or not (math.isfinite(k3) and math.isfinite(length)) or k3 < 0 or length < 1:
        return None
    weights = report.get("weights") or {}
    above = None
    if weights.get("log10_edges") is not None and weights.get("ratio_counts") is not None:
        above = share_ratio_above(weights["log10_edges"], weights["ratio_counts"])
    return asdict(recommend(k3, length, share_ratio_above=above))


def to_json(report: dict[str, Any]) -> str:
    """Strict JSON (no NaN / Infinity): non-finite values become ``null`` and their paths are
    listed under ``non_finite_values_as_null``."""
    replaced: list[str] = []
    if "overall" in report and "recommendation" not in report:
        report = {**report, "recommendation": recommendation(report)}
    safe = json_safe(report, "$", replaced)
    if replaced:
        safe["non_finite_values_as_null"] = replaced
    return json.dumps(safe, indent=2, allow_nan=False)


def plot_history(report: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG: K3 trends with the log-ppl gap, response length with the surge verdict, the
    mismatch by rollout-probability bucket (When Speed Kills Stability (docs/references.md)) and the IS-weight distribution."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    rows = report["rows"]
    ids = [r["rollout_id"] for r in rows]

    def series(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=110)
    surge = report["surge"]

    ax = axes[0, 0]
    for key, label, style in (("k3_max", "K3 max", ":"), ("k3_p99", "K3 p99", "--"), ("k3_mean", "K3 mean", "-")):
        vals = series(key)
        ax.plot(ids, [v if v > 0 else float("nan") for v in vals], style, marker="." if len(ids) < 60 else None, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("rollout id")
    ax.set_ylabel("K3 KL per token (rollout vs trainer)")
    ax2 = ax.twinx()
    ax2.plot(ids, series("log_ppl_abs_diff"), color="tab:red", alpha=0.7, label="|log-ppl gap|")
    ax2.set_ylabel("|rollout - training log-ppl| (mean per sequence)", color="tab:red")
    warn_ids = sorted({w["rollout_id"] for w in report["monitor"]["warnings"] if w["kind"] in ("trend", "spike", "threshold")})
    for i, wid in enumerate(warn_ids):
        ax.axvline(wid, color="tab:orange", alpha=0.4, lw=1, label="monitor warning" if i == 0 else None)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="upper left")
    ax.set_title("Mismatch over training")

    ax = axes[0, 1]
    ax.plot(ids, series("response_length"), color="tab:green", marker="." if len(ids) < 60 else None, label="mean response length")
    ax.set_xlabel("rollout id")
    ax.set_ylabel("tokens")
    if surge["fired"]:
        ax.axvline(surge["rollout_id"], color="k", ls="--", label=f"surge detected (rollout {surge['rollout_id']})")
        if surge.get("first_decay_rollout_id") is not None and ids and surge["first_decay_rollout_id"] <= max(ids) * 1.5:
            ax.axvline(surge["first_decay_rollout_id"], color="tab:purple", ls=":", label=f"first LR halving (rollout {surge['first_decay_rollout_id']})")
    ax3 = ax.twinx()
    ax3.plot(ids, series("rejected_token_fraction"), color="tab:gray", alpha=0.7, label="rejected token fraction")
    ax3.set_ylabel("rejected token fraction (config)", color="tab:gray")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title("Response length and Beyond Precision (arXiv:2602.01826)'s surge detector")

    ax = axes[1, 0]
    buckets = report["buckets"]
    edges = buckets["all"]["edges"]
    xs_b = list(range(len(edges) - 1))
    labels = [
        f"[{lo:g}, {hi:g}{']' if i == len(edges) - 2 else ')'}\n{int(c)} tok"
        for i, (lo, hi, c) in enumerate(zip(edges[:-1], edges[1:], buckets["all"]["num_tokens"]))
    ]
    for name, style in (("all", "-"), ("first_third", "--"), ("last_third", ":")):
        b = buckets.get(name)
        if not b:
            continue
        y = [float("nan") if v is None or v <= 0 else v for v in b["mean_abs_log_ratio"]]
        ax.plot(xs_b, y, style, marker="o", label=f"mean |log r|, {name.replace('_', ' ')} of rollouts")
    ax.set_yscale("log")
    ax.set_xlabel("rollout probability of the token (bucket), tokens in the bucket")
    ax.set_ylabel("mean |log pi_train - log pi_rollout|")
    ax.set_xticks(xs_b)
    ax.set_xticklabels(labels, rotation=30, fontsize=7, ha="right")
    ax.set_xlim(-0.5, len(xs_b) - 0.5)
    ax.legend(fontsize=8)
    ax.set_title("Mismatch vs rollout probability (When Speed Kills Stability (docs/references.md): grows as p -> 0)")

    ax = axes[1, 1]
    w = report["weights"]
    log_edges = w["log10_edges"]
    width = log_edges[1] - log_edges[0]
    xs = [log_edges[0] - width] + list(log_edges)
    for key, label, color in (("ratio_counts", "token ratio r = pi_train / pi_rollout", "tab:blue"),
                              ("final_weight_counts", "final IS weight (kept tokens, config)", "tab:red")):
        counts = w[key]
        ax.step(xs, [c if c > 0 else float("nan") for c in counts], where="post", color=color, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("log10 weight (first / last bin: below / above the range)")
    ax.set_ylabel("tokens")
    ax.axvline(0.0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_title("IS-weight distribution (all rollouts)")

    fig.suptitle(f"megatron-mis analyze: {report['num_files_analysed']} file(s), {len(rows)} rollout(s), config {str(report['config']).split(' (')[0]}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
