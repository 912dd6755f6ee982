"""Mismatch metrics of the MIS engine.

Every metric has a *kind*:

- ``token``: one value per token (``mis_k3_kl``, ``mis_tv`` ...);
- ``sequence``: one value per sequence, repeated over its tokens (``mis_training_log_ppl`` ...);
- ``batch``: one value for the whole batch, repeated over every token (``mis_ess_token`` ...).

:func:`build_metrics` returns both the ``[T]`` tensors hosts reduce over the ORIGINAL loss mask
(slime / Miles average them per sample, then over the batch) and a dict of batch summaries.
Summaries are built from the reduced per-sequence statistics, so they are exact under context
parallelism: token metrics are averaged over loss-mask tokens, sequence metrics over sequences
with at least one loss-mask token.

Names follow Miles (``mis_`` prefix) where the metric exists there: ``mis_training_log_ppl``,
``mis_training_ppl``, ``mis_rollout_log_ppl``, ``mis_rollout_ppl``, ``mis_kl``, ``mis_k3_kl``,
``mis_log_ppl_diff``, ``mis_log_ppl_abs_diff``, ``mis_ppl_ratio``, ``mis_chi2_token``,
``mis_chi2_seq``, ``mis_tis_weight_before_bound``, ``mis_tis_weight_after_bound``,
``mis_tis_{truncate,clip,mask}_fraction[_low|_high]``, ``mis_rs_mask_fraction_{low,high}``,
``mis_rs_catastrophic_{token,seq}_fraction``, ``mis_batch_norm_factor``,
``mis_is_ratio_{mean,min,max}_final``. Added here: ``mis_tv``, ``mis_ess_token``,
``mis_ess_seq``, ``mis_nonfinite_token_fraction``, ``mis_prob_veto_{token,seq}_fraction``,
``mis_rejected_token_fraction``, ``mis_rejected_seq_fraction``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.core.engine import SequenceStatistics, _Sequences, _Tokens

__all__ = ["build_metrics", "bucket_table", "METRIC_DOCS"]

#: Exponents of ppl-like metrics are capped here so exp() stays finite in float32.
_EXP_CAP = 80.0

#: What each metric means (used by ``megatron-mis analyze`` and the README).
METRIC_DOCS: dict[str, str] = {
    "mis_training_log_ppl": "sequence: -mean log pi_train over the sequence's tokens",
    "mis_training_ppl": "sequence: exp(training log-ppl)",
    "mis_rollout_log_ppl": "sequence: -mean log pi_rollout",
    "mis_rollout_ppl": "sequence: exp(rollout log-ppl)",
    "mis_kl": "token: k1 = log pi_rollout - log pi_train, estimates KL(rollout || train)",
    "mis_k3_kl": "token: k3 = r - 1 - log r, r = pi_train/pi_rollout; >= 0, the mismatch indicator of seed 000",
    "mis_log_ppl_diff": "sequence: rollout mean log-prob - training mean log-prob",
    "mis_log_ppl_abs_diff": "sequence: |log-ppl diff|, seed 002's mismatch indicator",
    "mis_ppl_ratio": "sequence: training ppl / rollout ppl",
    "mis_chi2_token": "sequence: mean r^2 - 1 over the sequence (variance of token IS)",
    "mis_chi2_seq": "sequence: (prod r)^2 - 1 (variance of sequence IS)",
    "mis_tv": "token: |r - 1| / 2, a total-variation estimate (bias of ignoring the mismatch)",
    "mis_ess_token": "batch: (sum r)^2 / (n sum r^2) over tokens, effective sample size ratio in (0, 1]",
    "mis_ess_seq": "batch: effective sample size ratio of the sequence ratios prod r",
    "mis_nonfinite_token_fraction": "token: 1 where a log-prob was NaN or inf",
    "mis_tis_weight_before_bound": "IS weight at tis_level before truncation / clipping / masking",
    "mis_tis_weight_after_bound": "IS weight after bounds, before normalisation (0 where IS-masked)",
    "mis_tis_truncate_fraction": "fraction of weights above tis_upper_bound (from unbounded weights)",
    "mis_tis_clip_fraction_low": "fraction of weights below tis_lower_bound (clip mode)",
    "mis_tis_clip_fraction_high": "fraction of weights above tis_upper_bound (clip mode)",
    "mis_tis_mask_fraction_low": "fraction masked below tis_lower_bound (mask mode)",
    "mis_tis_mask_fraction_high": "fraction masked above tis_upper_bound (mask mode)",
    "mis_rs_mask_fraction_low": "fraction rejected by RS below rs_lower_bound",
    "mis_rs_mask_fraction_high": "fraction rejected by RS above rs_upper_bound",
    "mis_rs_catastrophic_token_fraction": "token: r below rs_veto_threshold",
    "mis_rs_catastrophic_seq_fraction": "sequence: vetoed by the ratio veto",
    "mis_prob_veto_token_fraction": "token: probability below prob_veto_threshold",
    "mis_prob_veto_seq_fraction": "sequence: vetoed by the probability veto",
    "mis_rejected_token_fraction": "token: in the loss mask but removed by any rejection",
    "mis_rejected_seq_fraction": "sequence: no token left after rejection",
    "mis_batch_norm_factor": "batch: the self-normalisation mean the weights were divided by",
    "mis_is_ratio_mean_final": "sequence: mean final weight over kept tokens (0 if none kept)",
    "mis_is_ratio_min_final": "sequence: min final weight over kept tokens",
    "mis_is_ratio_max_final": "sequence: max final weight over kept tokens",
    # summary-only batch statistics
    "mis_weight_before_bound_mean": "batch: mean IS weight before bounds (tokens or sequences by tis_level)",
    "mis_weight_before_bound_min": "batch: smallest IS weight before bounds",
    "mis_weight_before_bound_max": "batch: largest IS weight before bounds",
    "mis_weight_after_bound_mean": "batch: mean bounded weight over kept tokens / sequences",
    "mis_weight_after_bound_min": "batch: smallest bounded weight kept",
    "mis_weight_after_bound_max": "batch: largest bounded weight kept",
    "mis_weight_final_mean": "batch: mean final weight (1 with self-normalisation)",
    "mis_weight_final_min": "batch: smallest final weight kept",
    "mis_weight_final_max": "batch: largest final weight kept",
    "num_sequences": "batch: sequences in the call",
    "num_loss_tokens": "batch: tokens in the loss mask",
    "num_kept_tokens": "batch: loss-mask tokens left after rejection",
    "num_kept_sequences": "batch: sequences with at least one kept token",
}


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-_EXP_CAP, _EXP_CAP))


def build_metrics(
    tokens: "_Tokens",
    stats: "SequenceStatistics",
    seqs: "_Sequences",
    cfg: "MISConfig",
    normalizer: torch.Tensor,
    keep: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Token-aligned ``[T]`` float32 metrics and 0-dim batch summaries (see module docstring)."""
    from megatron_mis.core.engine import ExtCol, SumCol
    from megatron_mis.core.segments import expand

    f32, f64 = torch.float32, torch.float64
    sid = tokens.seq_ids
    num_tokens = int(sid.shape[0])
    col = stats.col
    n_mask, n_valid = seqs.n_mask, seqs.n_valid
    has_mask = n_mask > 0
    total_mask = n_mask.sum()
    num_seq_with_mask = has_mask.to(f64).sum()

    token_metrics: dict[str, torch.Tensor] = {}
    summary: dict[str, torch.Tensor] = {}

    def tok(name: str, values: torch.Tensor, summary_sum: torch.Tensor | None, denom: torch.Tensor | None = None) -> None:
        token_metrics[name] = values.to(f32)
        if summary_sum is not None:
            summary[name] = _safe_div(summary_sum, total_mask if denom is None else denom)

    def seq(name: str, values: torch.Tensor) -> None:
        values = values.to(f64)
        token_metrics[name] = expand(values.to(f32), sid)
        summary[name] = _safe_div((values * has_mask.to(f64)).sum(), num_seq_with_mask)

    def batch(name: str, value: torch.Tensor) -> None:
        value = value.to(f64).reshape(())
        token_metrics[name] = value.to(f32).expand(num_tokens)
        summary[name] = value

    def indicator(name: str, flags: torch.Tensor, count: SumCol) -> None:
        tok(name, tokens.flags.get(count, flags), col(count).sum())

    # ---- mismatch metrics (always) -------------------------------------------------------
    train_mean = _safe_div(col(SumCol.SUM_TRAIN_LP), n_valid)
    rollout_mean = _safe_div(col(SumCol.SUM_ROLLOUT_LP), n_valid)
    seq("mis_training_log_ppl", -train_mean)
    seq("mis_training_ppl", _exp(-train_mean))
    seq("mis_rollout_log_ppl", -rollout_mean)
    seq("mis_rollout_ppl", _exp(-rollout_mean))
    raw_log_r = tokens.train - tokens.rollout  # 0 where invalid
    tok("mis_kl", -raw_log_r, -col(SumCol.SUM_LOG_R).sum())
    validf = tokens.flags.get(SumCol.N_VALID, tokens.valid)
    tok("mis_k3_kl", tokens.k3 * validf, col(SumCol.SUM_K3).sum())
    diff = rollout_mean - train_mean
    seq("mis_log_ppl_diff", diff)
    seq("mis_log_ppl_abs_diff", diff.abs())
    seq("mis_ppl_ratio", _exp(diff))
    seq("mis_chi2_token", torch.where(n_valid > 0, _safe_div(col(SumCol.SUM_R2), n_valid) - 1.0, torch.zeros_like(n_valid)))
    seq_log = seqs.level_log_r["sequence"]
    seq("mis_chi2_seq", torch.where(n_valid > 0, _exp(2.0 * seq_log) - 1.0, torch.zeros_like(n_valid)))
    tok("mis_tv", 0.5 * (tokens.r - 1.0).abs() * validf, 0.5 * col(SumCol.SUM_ABS_R1).sum())
    sum_r, sum_r2, nv = col(SumCol.SUM_R).sum(), col(SumCol.SUM_R2).sum(), n_valid.sum()
    batch("mis_ess_token", torch.where(nv > 0, _safe_div(sum_r.square(), nv * sum_r2), torch.ones_like(nv)))
    has_valid = (n_valid > 0).to(f64)
    w_seq_raw = _exp(seq_log) * has_valid
    nsv = has_valid.sum()
    batch(
        "mis_ess_seq",
        torch.where(nsv > 0, _safe_div(w_seq_raw.sum().square(), nsv * w_seq_raw.square().sum()), torch.ones_like(nsv)),
    )
    indicator("mis_nonfinite_token_fraction", tokens.nonfinite, SumCol.N_NONFINITE)

    # ---- importance sampling -------------------------------------------------------------
    if cfg.use_tis:
        frac_names = {
            "truncate": (None, "mis_tis_truncate_fraction"),
            "clip": ("mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high"),
            "mask": ("mis_tis_mask_fraction_low", "mis_tis_mask_fraction_high"),
        }[cfg.tis_mode]
        if cfg.tis_level == "token":
            tok("mis_tis_weight_before_bound", tokens.w_tok_unbounded * validf, col(SumCol.SUM_W_BEFORE).sum())
            tok("mis_tis_weight_after_bound", torch.where(tokens.mask, tokens.w_tok, torch.zeros_like(tokens.w_tok)), col(SumCol.SUM_W_AFTER).sum())
            if frac_names[0]:
                indicator(frac_names[0], tokens.is_low, SumCol.N_IS_LOW)
            indicator(frac_names[1], tokens.is_high, SumCol.N_IS_HIGH)
        else:
            seq("mis_tis_weight_before_bound", seqs.w_seq_unbounded)
            seq("mis_tis_weight_after_bound", seqs.w_seq)
            if frac_names[0]:
                seq(frac_names[0], seqs.is_low)
            seq(frac_names[1], seqs.is_high)
        if cfg.normalizes:
            batch("mis_batch_norm_factor", normalizer)

    # ---- rejection sampling and veto -----------------------------------------------------
    if cfg.use_rs:
        if cfg.rs_level == "token":
            indicator("mis_rs_mask_fraction_low", tokens.rs_low, SumCol.N_RS_LOW)
            indicator("mis_rs_mask_fraction_high", tokens.rs_high, SumCol.N_RS_HIGH)
        else:
            seq("mis_rs_mask_fraction_low", seqs.rs_low)
            seq("mis_rs_mask_fraction_high", seqs.rs_high)
    if cfg.rs_veto_threshold is not None:
        indicator("mis_rs_catastrophic_token_fraction", tokens.ratio_veto, SumCol.N_RATIO_VETO)
        seq("mis_rs_catastrophic_seq_fraction", seqs.ratio_vetoed)
    if cfg.prob_veto_threshold is not None:
        indicator("mis_prob_veto_token_fraction", tokens.prob_veto, SumCol.N_PROB_VETO)
        seq("mis_prob_veto_seq_fraction", seqs.prob_vetoed)

    rejected_tok = tokens.mask & ~keep
    n_rej = torch.where(seqs.rejected, n_mask, col(SumCol.N_TOK_REJECTED))
    tok("mis_rejected_token_fraction", rejected_tok, n_rej.sum())
    seq("mis_rejected_seq_fraction", has_mask & ~seqs.kept)

    # ---- final weights -------------------------------------------------------------------
    kept = seqs.kept
    keptf = kept.to(f64)
    if cfg.use_tis and cfg.tis_level == "token":
        n_kept = col(SumCol.N_TOK_KEPT)
        mean_final = torch.where(kept, _safe_div(col(SumCol.SUM_W_KEPT), n_kept) / normalizer, torch.zeros_like(n_kept))
        min_final = torch.where(kept, stats.mins[:, ExtCol.W_KEPT] / normalizer, torch.zeros_like(n_kept))
        max_final = torch.where(kept, stats.maxs[:, ExtCol.W_KEPT] / normalizer, torch.zeros_like(n_kept))
    elif cfg.use_tis:
        w = torch.where(kept, seqs.w_seq / normalizer, torch.zeros_like(seqs.w_seq))
        mean_final = min_final = max_final = w
    else:
        mean_final = min_final = max_final = keptf
    seq("mis_is_ratio_mean_final", mean_final)
    seq("mis_is_ratio_min_final", min_final)
    seq("mis_is_ratio_max_final", max_final)

    # ---- summary-only batch statistics ---------------------------------------------------
    summary["num_sequences"] = torch.tensor(float(stats.num_sequences), dtype=f64, device=n_mask.device)
    summary["num_loss_tokens"] = total_mask
    alive = (~seqs.rejected).to(f64)
    summary["num_kept_tokens"] = (col(SumCol.N_TOK_KEPT) * alive).sum()
    summary["num_kept_sequences"] = keptf.sum()
    if cfg.use_tis:
        big = torch.tensor(1e30, dtype=f64, device=n_mask.device)
        if cfg.tis_level == "token":
            min_lr = stats.mins[:, ExtCol.LOG_R].min() if stats.num_sequences else big
            max_lr = stats.maxs[:, ExtCol.LOG_R].max() if stats.num_sequences else -big
            any_valid = nv > 0
            summary["mis_weight_before_bound_mean"] = _safe_div(col(SumCol.SUM_W_BEFORE).sum(), nv)
            summary["mis_weight_before_bound_min"] = torch.where(any_valid, torch.exp(min_lr.clamp(-_EXP_CAP, _EXP_CAP)), torch.zeros_like(nv))
            summary["mis_weight_before_bound_max"] = torch.where(any_valid, torch.exp(max_lr.clamp(-_EXP_CAP, _EXP_CAP)), torch.zeros_like(nv))
            n_alive = (col(SumCol.N_TOK_KEPT) * alive).sum()
            any_kept = n_alive > 0
            alive_b = alive > 0
            wmin = torch.where(alive_b, stats.mins[:, ExtCol.W_KEPT], big).min() if stats.num_sequences else big
            wmax = torch.where(alive_b, stats.maxs[:, ExtCol.W_KEPT], -big).max() if stats.num_sequences else -big
            summary["mis_weight_after_bound_mean"] = _safe_div((col(SumCol.SUM_W_KEPT) * alive).sum(), n_alive)
            summary["mis_weight_after_bound_min"] = torch.where(any_kept, wmin, torch.zeros_like(n_alive))
            summary["mis_weight_after_bound_max"] = torch.where(any_kept, wmax, torch.zeros_like(n_alive))
        else:
            hv = n_valid > 0
            any_valid = hv.any()
            wu = seqs.w_seq_unbounded
            summary["mis_weight_before_bound_mean"] = _safe_div((wu * hv).sum(), hv.to(f64).sum())
            summary["mis_weight_before_bound_min"] = torch.where(any_valid, torch.where(hv, wu, big).min() if stats.num_sequences else big, torch.zeros((), dtype=f64, device=wu.device))
            summary["mis_weight_before_bound_max"] = torch.where(any_valid, torch.where(hv, wu, -big).max() if stats.num_sequences else -big, torch.zeros((), dtype=f64, device=wu.device))
            any_kept = kept.any()
            wb = seqs.w_seq
            summary["mis_weight_after_bound_mean"] = _safe_div((wb * keptf).sum(), keptf.sum())
            summary["mis_weight_after_bound_min"] = torch.where(any_kept, torch.where(kept, wb, big).min() if stats.num_sequences else big, torch.zeros((), dtype=f64, device=wb.device))
            summary["mis_weight_after_bound_max"] = torch.where(any_kept, torch.where(kept, wb, -big).max() if stats.num_sequences else -big, torch.zeros((), dtype=f64, device=wb.device))
        for part in ("mean", "min", "max"):
            after = summary[f"mis_weight_after_bound_{part}"]
            summary[f"mis_weight_final_{part}"] = after / normalizer
    return token_metrics, summary


def bucket_table(tokens: "_Tokens", edges: Sequence[float]) -> dict[str, torch.Tensor]:
    """Mismatch by rollout-probability bucket over this call's valid loss-mask tokens.

    Buckets are ``[edges[i], edges[i+1])`` on ``p = exp(log pi_rollout)`` (the last includes 1).

    Returns:
        ``edges [B+1]``, ``num_tokens [B]``, ``mean_abs_log_ratio [B]`` (mean |log r|),
        ``mean_k3 [B]`` (mean k3) — float64.
    """
    edges_t = torch.tensor([float(e) for e in edges], dtype=torch.float64, device=tokens.r.device)
    num_buckets = edges_t.numel() - 1
    valid = tokens.valid
    p = torch.exp(tokens.rollout.to(torch.float64))
    idx = torch.bucketize(p, edges_t[1:-1], right=True).clamp(0, num_buckets - 1)
    idx = torch.where(valid, idx, torch.full_like(idx, num_buckets))  # invalid -> dropped bucket
    k3 = tokens.k3.to(torch.float64)
    absl = (tokens.train - tokens.rollout).abs().to(torch.float64)
    acc = torch.zeros(num_buckets + 1, 3, dtype=torch.float64, device=p.device)
    acc.index_add_(0, idx, torch.stack([torch.ones_like(p), absl, k3], 1))
    acc = acc[:num_buckets]
    count = acc[:, 0]
    return {
        "edges": edges_t,
        "num_tokens": count,
        "mean_abs_log_ratio": _safe_div(acc[:, 1], count),
        "mean_k3": _safe_div(acc[:, 2], count),
    }
