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
``mis_is_ratio_{mean,min,max}_final``, ``mis_is_ratio_mean_after_tis_rs`` — each with the
definition of Miles' bundled ``mis.py`` example (docs/metrics.md). Added here: ``mis_tv``, ``mis_ess_token``,
``mis_ess_seq``, ``mis_nonfinite_token_fraction``, ``mis_prob_veto_{token,seq}_fraction``,
``mis_rejected_token_fraction``, ``mis_rejected_seq_fraction``; with ``mis_metrics: full`` also
``mis_weight_after_bound_kept`` and ``mis_kept_weight_{mean,min,max}_final`` (our definitions of
what the hosts' names measure differently).

Cost: token metrics are one pass each, and reuse the ``[T]`` columns the per-sequence statistics
were reduced from; every sequence metric is expanded to ``[T]`` in one
:meth:`~megatron_mis.core.segments.SegmentLayout.expand` of an ``[S, N]`` block (each metric a
contiguous row of the ``[S, T]`` result); batch metrics are stride-0 views of one value. Values
that do not fit float32 (chi-square at ``log_ratio_bound`` 80, KL of log-probs near +-3e38)
saturate at +-3.4e38 in the ``[T]`` tensors; the float64 summaries stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

import torch

from megatron_mis.config.mis import RSCriterion
from megatron_mis.core.compiling import index_by_identity, is_compiling
from megatron_mis.core.flags import as_factor, finite_or_zero
from megatron_mis.core.statistics import BIG, SequenceExtremum, Plan, SequenceDecisions, SequenceStatistics, SequenceSum, TokenQuantities


__all__ = ["masked_log_ratio", "k3_from_log_ratio", "build_metrics", "bucket_table", "check_bucket_edges", "METRIC_DOCS", "HOST_METRIC_NAMES"]

#: The count column of each token-level divergence criterion.
_TOKEN_CRITERION_COUNT = {"token_k1": SequenceSum.N_TOKEN_K1, "token_k2": SequenceSum.N_TOKEN_K2, "token_k3": SequenceSum.N_TOKEN_K3}

#: Exponents of ppl-like metrics are capped here so exp() stays finite in float32.
_EXP_CAP = 80.0
#: Largest float32.
F32_MAX = 3.4028234663852886e38

#: Metric names that slime's / Miles' bundled ``mis.py`` example also emits, with its definition.
HOST_METRIC_NAMES = frozenset({
    "mis_training_log_ppl", "mis_training_ppl", "mis_rollout_log_ppl", "mis_rollout_ppl", "mis_kl", "mis_k3_kl",
    "mis_log_ppl_diff", "mis_log_ppl_abs_diff", "mis_ppl_ratio", "mis_chi2_token", "mis_chi2_seq",
    "mis_tis_weight_before_bound", "mis_tis_weight_after_bound", "mis_tis_truncate_fraction",
    "mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high", "mis_tis_mask_fraction_low",
    "mis_tis_mask_fraction_high", "mis_rs_mask_fraction_low", "mis_rs_mask_fraction_high",
    "mis_rs_catastrophic_token_fraction", "mis_rs_catastrophic_seq_fraction", "mis_is_ratio_mean_after_tis_rs",
    "mis_batch_norm_factor", "mis_is_ratio_mean_final", "mis_is_ratio_min_final", "mis_is_ratio_max_final",
})

#: What each metric means (used by ``megatron-mis analyze`` and the README).
METRIC_DOCS: dict[str, str] = {
    "mis_training_log_ppl": "sequence: -mean log pi_train over the sequence's tokens",
    "mis_training_ppl": "sequence: exp(training log-ppl)",
    "mis_rollout_log_ppl": "sequence: -mean log pi_rollout",
    "mis_rollout_ppl": "sequence: exp(rollout log-ppl)",
    "mis_kl": "token: k1 = log pi_rollout - log pi_train, estimates KL(rollout || train)",
    "mis_k3_kl": "token: k3 = r - 1 - log r, r = pi_train/pi_rollout; >= 0, the mismatch indicator of Let Speed Be With Stability (docs/references.md)",
    "mis_log_ppl_diff": "sequence: rollout mean log-prob - training mean log-prob",
    "mis_log_ppl_abs_diff": "sequence: |log-ppl diff|, the mismatch indicator of Beyond Precision (arXiv:2602.01826)",
    "mis_ppl_ratio": "sequence: training ppl / rollout ppl",
    "mis_chi2_token": "sequence: mean r^2 - 1 over the sequence (variance of token IS)",
    "mis_chi2_seq": "sequence: (prod r)^2 - 1 (variance of sequence IS)",
    "mis_tv": "token: |r - 1| / 2, a total-variation estimate (bias of ignoring the mismatch)",
    "mis_ess_token": "batch: (sum r)^2 / (n sum r^2) over tokens, effective sample size ratio in (0, 1]",
    "mis_ess_seq": "batch: effective sample size ratio of the sequence ratios prod r",
    "mis_nonfinite_token_fraction": "token: 1 where a log-prob was NaN or inf",
    "mis_tis_weight_before_bound": "host name: IS weight at tis_level before truncation / clipping / masking",
    "mis_tis_weight_after_bound": "host name: IS weight after truncation / clipping, before normalisation; in mask "
    "mode the unbounded weight (the hosts keep it at masked tokens)",
    "mis_is_ratio_mean_after_tis_rs": "host name: the weight after TIS, before normalisation (RS changes the mask, "
    "not the weight): the same values as mis_tis_weight_after_bound",
    "mis_tis_truncate_fraction": "fraction of weights above tis_upper_bound (from unbounded weights)",
    "mis_tis_clip_fraction_low": "fraction of weights below tis_lower_bound (clip mode)",
    "mis_tis_clip_fraction_high": "fraction of weights above tis_upper_bound (clip mode)",
    "mis_tis_mask_fraction_low": "fraction masked below tis_lower_bound (mask mode)",
    "mis_tis_mask_fraction_high": "fraction masked above tis_upper_bound (mask mode)",
    "mis_rs_mask_fraction_low": "fraction rejected by RS below rs_lower_bound",
    "mis_rs_mask_fraction_high": "fraction rejected by RS above rs_upper_bound",
    "mis_tis_zero_weight_fraction_low": "icepop mode: fraction of loss-mask tokens weighted 0 below tis_lower_bound "
    "(they stay in the loss mask)",
    "mis_tis_zero_weight_fraction_high": "icepop mode: fraction of loss-mask tokens weighted 0 above tis_upper_bound",
    **{
        f"mis_rs_{name}_fraction": (
            f"token: 1 where the token fails the {name} criterion of rs_criteria" if name.startswith("token_")
            else f"sequence: 1 where the sequence fails the {name} criterion of rs_criteria"
        )
        for name in get_args(RSCriterion)
    },
    "mis_rs_catastrophic_token_fraction": "token: r below rs_veto_threshold",
    "mis_rs_catastrophic_seq_fraction": "sequence: vetoed by the ratio veto",
    "mis_prob_veto_token_fraction": "token: probability below prob_veto_threshold",
    "mis_prob_veto_seq_fraction": "sequence: vetoed by the probability veto",
    "mis_rejected_token_fraction": "token: in the loss mask but removed by any rejection",
    "mis_rejected_seq_fraction": "sequence: no token left after rejection",
    "mis_batch_norm_factor": "batch: the self-normalisation mean the weights were divided by",
    "mis_is_ratio_mean_final": "host name: sequence: mean over ALL loss-mask tokens of mis_tis_weight_after_bound / "
    "the normalisation mean (the hosts' definition; rejected tokens included)",
    "mis_is_ratio_min_final": "host name: sequence: min of the same over loss-mask tokens (0 without any)",
    "mis_is_ratio_max_final": "host name: sequence: max of the same over loss-mask tokens (0 without any)",
    "mis_weight_after_bound_kept": "full only: token: the bounded weight, 0 where IS-masked (what is multiplied "
    "into the loss before normalisation)",
    "mis_kept_weight_mean_final": "full only: sequence: mean final weight over KEPT tokens (0 if none kept): the "
    "weight the loss actually uses",
    "mis_kept_weight_min_final": "full only: sequence: min final weight over kept tokens",
    "mis_kept_weight_max_final": "full only: sequence: max final weight over kept tokens",
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




def masked_log_ratio(
    maskf: torch.Tensor, train: torch.Tensor, rollout: torch.Tensor, bound: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``maskf [T]`` float32 0/1, float32 log-probs ``[T]`` -> ``(valid, train_v, rollout_v, diff,
    log_r)`` ``[T]`` float32: ``valid`` 1 at loss-mask tokens whose two log-probs are finite;
    the log-probs zeroed off ``valid``; their difference (``+-inf`` beyond the float32 range);
    that difference clamped to ``+-bound``. The engine's token stage and the bucket table's
    recomputation share this, so both see the same values."""
    # mask + 0 * train + 0 * rollout is the mask where both are finite and NaN elsewhere (0 * inf
    # and NaN give NaN); one [T] buffer, three passes
    validf = torch.add(maskf, train, alpha=0.0).add_(rollout, alpha=0.0)
    # inductor evaluates isnan (nan_to_num) element by element; a comparison vectorises
    validf = torch.where(validf == validf, validf, 0.0) if is_compiling() else validf.nan_to_num_(nan=0.0)
    train_v = finite_or_zero(train).mul_(validf)
    rollout_v = finite_or_zero(rollout).mul_(validf)
    diff = train_v - rollout_v
    return validf, train_v, rollout_v, diff, diff.clamp(-bound, bound)


def k3_from_log_ratio(x: torch.Tensor, expm1_x: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(x) - 1 - x`` to float32 relative accuracy: a Taylor series for ``|x| < 0.5`` (the
    literal form cancels catastrophically near 0: ``r - 1`` rounds to the float32 grid, a floor of
    ~6e-8 under a true value of ~1e-13), ``expm1(x) - x`` elsewhere (``expm1_x`` if the caller
    has it). Truncation error of the series at ``|x| = 0.5``: ``x^8/8! / (x^2/2) < 1e-7``.
    Evaluated in place in two ``[T]`` buffers (allocation is a large share of the cost on CPU)."""
    p = x * (1.0 / 5040.0)
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5):
        p.add_(c).mul_(x)
    p.mul_(x)  # x^2 (1/2 + x/6 + ...)
    direct = torch.expm1(x).sub_(x) if expm1_x is None else expm1_x - x
    return torch.where(x.abs() < 0.5, p, direct)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, 0 where ``den <= 0`` (``den`` broadcasts to ``num``)."""
    return (num / den.clamp_min(1e-300)).masked_fill_(den <= 0, 0.0)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-_EXP_CAP, _EXP_CAP))


def _f32(x: torch.Tensor) -> torch.Tensor:
    """float32 with saturation (float64 values beyond the float32 range become +-3.4e38, not inf)."""
    return x.clamp(-F32_MAX, F32_MAX).to(torch.float32)


def check_bucket_edges(edges: Any) -> tuple[float, ...]:
    """Validate rollout-probability bucket edges; returns them as floats.

    Raises:
        TypeError / ValueError: naming ``prob_bucket_edges``, the value and what is allowed.
    """
    import math

    if isinstance(edges, (str, bytes)) or not hasattr(edges, "__iter__"):
        raise TypeError(f"prob_bucket_edges must be a sequence of floats in [0, 1], got {type(edges).__name__} ({edges!r:.60})")
    try:
        values = [float(e) for e in edges]
    except (TypeError, ValueError):
        raise TypeError(f"prob_bucket_edges must hold numbers, got {list(edges)!r:.80}") from None
    if (
        len(values) < 2
        or not all(math.isfinite(v) for v in values)
        or any(b <= a for a, b in zip(values, values[1:]))
        or values[0] < 0
        or values[-1] > 1
    ):
        raise ValueError(f"prob_bucket_edges must increase strictly within [0, 1] with >= 2 finite entries, got {list(edges)}")
    return tuple(values)


def build_metrics(
    tokens: TokenQuantities,
    stats: SequenceStatistics,
    seqs: SequenceDecisions,
    plan: Plan,
    normalizer: torch.Tensor,
    norm_stats: Any,
    total: Sequence[torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Token-aligned ``[T]`` float32 metrics, 0-dim float64 batch summaries (see module
    docstring) and ``keepf`` ``[T]`` float32 — the loss-mask tokens kept at token level whose
    sequence is alive (``seqs.alive``, expanded to the tokens as one more row of the sequence
    metrics: one expansion for both). ``norm_stats`` is the call's ``NormalizationStatistics``
    (its sums are shared with the summaries); ``total`` the batch totals of every statistic
    column (0-dim float64 each: one reduction of ``stats.sums``, shared with the caller).

    Pure tensor code (compilable); the op count does not depend on ``N`` and is kept small (every
    op is a kernel launch on an accelerator, issue 28): statistics that share a formula are
    stacked and computed together — one division for every per-sequence mean, one reduction for
    every batch total (the column sums of the statistics), one conversion for every sequence
    flag, one block of sequence metrics expanded to ``[T]`` at once."""
    f64 = torch.float64
    layout = tokens.layout
    num_tokens = layout.num_tokens
    columns = tokens.columns
    col = stats.col
    n_mask, n_valid = seqs.n_mask, seqs.n_valid
    full = plan.metrics == "full"
    token_is = plan.token_is
    total_mask, nv = total[int(SequenceSum.N_MASK)], total[int(SequenceSum.N_VALID)]
    has_mask = n_mask > 0
    has_valid = seqs.has_valid

    token_metrics: dict[str, torch.Tensor] = {}
    # every summary key is placed when its metric is defined (the summary keeps that order);
    # the values are filled from the batched computations at the end
    summary: dict[str, torch.Tensor | None] = {}
    tok_totals: list[tuple[str, torch.Tensor]] = []  # token metrics: (name, batch total) / loss tokens
    seq_rows: list[tuple[str, Any, int]] = []  # sequence metrics: (name, [k, N] part or [N] row, row)
    batch_values: list[tuple[str, torch.Tensor]] = []  # batch metrics: 0-dim float64

    def tok(name: str, values: torch.Tensor, batch_total: torch.Tensor | None) -> None:
        token_metrics[name] = values if values.dtype == torch.float32 else values.to(torch.float32)
        if batch_total is not None:
            summary[name] = None
            tok_totals.append((name, batch_total))

    def seq(name: str, values: torch.Tensor, row: int = -1) -> None:
        """A sequence metric: ``values`` is ``[N]`` (float64 or bool), or row ``row`` of a ``[k, N]``
        float64 part."""
        seq_rows.append((name, values, row))
        summary[name] = None

    def batch(name: str, value: torch.Tensor) -> None:
        batch_values.append((name, value))
        token_metrics[name] = None  # placed now: a stride-0 view of its value, made at the end
        summary[name] = None

    def indicator(name: str, flags: torch.Tensor | None, count: SequenceSum) -> None:
        tok(name, tokens.flags.get(count, flags), total[int(count)])

    # ---- per-sequence means: one division for every (sum, count) pair -----------------------
    pairs = [
        (SequenceSum.SUM_TRAIN_LP, n_valid), (SequenceSum.SUM_ROLLOUT_LP, n_valid), (SequenceSum.SUM_LOG_R, n_valid),
        (SequenceSum.SUM_R2, n_valid),
    ]
    if token_is:
        pairs.append((SequenceSum.SUM_W_HOST, n_mask))  # the hosts' mean: over ALL loss-mask tokens
        if full:
            pairs.append((SequenceSum.SUM_W_KEPT, col(SequenceSum.N_TOK_KEPT)))
    means = _safe_div(torch.stack([col(c) for c, _ in pairs]), torch.stack([d for _, d in pairs]))
    # rows: -mean log pi_train, -mean log pi_rollout, the log-ppl diff -mean log r (the exact
    # float64 log-ratio sum, not the difference of two rounded means: they cancel)
    log_ppl = means[:3].neg()
    ppl = _exp(log_ppl)  # training ppl, rollout ppl, ppl ratio

    # ---- mismatch metrics (always) -------------------------------------------------------
    seq("mis_training_log_ppl", log_ppl, 0)
    seq("mis_training_ppl", ppl, 0)
    seq("mis_rollout_log_ppl", log_ppl, 1)
    seq("mis_rollout_ppl", ppl, 1)
    # k1 per token: rollout - train (0 where invalid); float32 overflow of extreme log-probs saturates
    tok("mis_kl", tokens.kl, -total[int(SequenceSum.SUM_LOG_R)])
    tok("mis_k3_kl", tokens.k3, total[int(SequenceSum.SUM_K3)])  # k3 is 0 where invalid (log r = 0)
    seq("mis_log_ppl_diff", log_ppl, 2)
    seq("mis_log_ppl_abs_diff", log_ppl[2].abs())
    seq("mis_ppl_ratio", ppl, 2)
    seq("mis_chi2_token", means[3])  # 0 without a valid token (the safe division's 0)
    seq_log = seqs.level_log_r["sequence"]
    # float64: exp(2 * 80) is finite there; a sequence without a valid token has log r sum 0: 0
    seq("mis_chi2_seq", torch.expm1(2.0 * seq_log))
    tok("mis_tv", columns[SequenceSum.SUM_ABS_R1], 0.5 * total[int(SequenceSum.SUM_ABS_R1)])  # |r - 1| / 2, 0 where invalid
    # effective sample sizes of the token ratios and of the sequence ratios, together:
    # (sum w)^2 / (n sum w^2), 1 without a valid token / sequence
    has_valid_f = has_valid.to(f64)
    w_seq_raw = torch.exp(seq_log) * has_valid_f  # float64: e^80 squared stays finite
    seq_totals = torch.stack([w_seq_raw, w_seq_raw.square(), has_valid_f]).sum(1).unbind(0)
    ess_n = torch.stack([nv, seq_totals[2]])
    ess_den = ess_n * torch.stack([total[int(SequenceSum.SUM_R2)] + nv, seq_totals[1]])
    ess_num = torch.stack([total[int(SequenceSum.SUM_R)], seq_totals[0]]).square()
    # den > 0: the ratio; den = 0 with n > 0: 0; n = 0 (so den = 0): 1
    ess = torch.where(ess_den > 0, ess_num / ess_den.clamp_min(1e-300), (ess_n <= 0).to(f64)).unbind(0)
    batch("mis_ess_token", ess[0])
    batch("mis_ess_seq", ess[1])
    indicator("mis_nonfinite_token_fraction", tokens.nonfinite, SequenceSum.N_NONFINITE)

    # ---- importance sampling (the hosts emit these only with use_tis) --------------------------
    if plan.use_tis:
        frac_names = {
            "truncate": (None, "mis_tis_truncate_fraction"),
            "clip": ("mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high"),
            "mask": ("mis_tis_mask_fraction_low", "mis_tis_mask_fraction_high"),
            "icepop": ("mis_tis_zero_weight_fraction_low", "mis_tis_zero_weight_fraction_high"),
        }[plan.tis_mode]
        if token_is:
            tok("mis_tis_weight_before_bound", columns[SequenceSum.SUM_W_BEFORE], total[int(SequenceSum.SUM_W_BEFORE)])
            host_after = columns[SequenceSum.SUM_W_HOST]
            tok("mis_tis_weight_after_bound", host_after, total[int(SequenceSum.SUM_W_HOST)])
            tok("mis_is_ratio_mean_after_tis_rs", host_after, total[int(SequenceSum.SUM_W_HOST)])
            if full:
                tok("mis_weight_after_bound_kept", columns[SequenceSum.SUM_W_AFTER], total[int(SequenceSum.SUM_W_AFTER)])
            if frac_names[0]:
                indicator(frac_names[0], tokens.is_low, SequenceSum.N_IS_LOW)
            indicator(frac_names[1], tokens.is_high, SequenceSum.N_IS_HIGH)
        else:
            seq("mis_tis_weight_before_bound", seqs.w_seq_unbounded)
            host_after = seqs.w_seq_unbounded if plan.tis_mode == "mask" else seqs.w_seq
            seq("mis_tis_weight_after_bound", host_after)
            seq("mis_is_ratio_mean_after_tis_rs", host_after)
            if full:
                seq("mis_weight_after_bound_kept", seqs.w_seq)
            if frac_names[0]:
                seq(frac_names[0], seqs.is_low)
            seq(frac_names[1], seqs.is_high)
        if plan.normalizes:
            batch("mis_batch_norm_factor", normalizer)

    # ---- rejection sampling and veto -----------------------------------------------------
    if plan.use_rs:
        if plan.rs_level == "token":
            indicator("mis_rs_mask_fraction_low", tokens.rs_low, SequenceSum.N_RS_LOW)
            indicator("mis_rs_mask_fraction_high", tokens.rs_high, SequenceSum.N_RS_HIGH)
        else:
            seq("mis_rs_mask_fraction_low", seqs.rs_low)
            seq("mis_rs_mask_fraction_high", seqs.rs_high)
    for name, _, _ in plan.rs_criteria:  # divergence criteria: the fraction each one fails
        if name.startswith("token_"):
            count = _TOKEN_CRITERION_COUNT[name]
            indicator(f"mis_rs_{name}_fraction", tokens.flags.get(count), count)
        else:
            seq(f"mis_rs_{name}_fraction", seqs.criteria[name])
    if plan.log_ratio_veto is not None:
        indicator("mis_rs_catastrophic_token_fraction", tokens.ratio_veto, SequenceSum.N_RATIO_VETO)
        seq("mis_rs_catastrophic_seq_fraction", seqs.ratio_vetoed)
    if plan.log_prob_veto is not None:
        indicator("mis_prob_veto_token_fraction", tokens.prob_veto, SequenceSum.N_PROB_VETO)
        seq("mis_prob_veto_seq_fraction", seqs.prob_vetoed)

    # kept loss-mask tokens of alive sequences (exact integers: any summation order): from the
    # normalisation's own sum where it is that count
    if token_is or not plan.use_tis:
        num_kept_tokens = norm_stats.count
    else:
        num_kept_tokens = (col(SequenceSum.N_TOK_KEPT) * seqs.alive.to(f64)).sum()
    # mis_rejected_token_fraction: its [T] values are set below, once keepf is expanded
    tok("mis_rejected_token_fraction", tokens.flags[SequenceSum.N_MASK], total_mask - num_kept_tokens)
    kept = seqs.kept
    seq("mis_rejected_seq_fraction", has_mask ^ kept)  # has_mask & ~kept (kept sequences have loss tokens)

    # ---- final weights -------------------------------------------------------------------
    if plan.use_tis:
        # the hosts' definition: over ALL loss-mask tokens of the after-bound weight / normaliser
        if token_is and plan.tis_mode == "icepop":
            # icepop's weight (0 out of band) is not monotone in r: its own extrema over the loss mask
            host_ext = torch.stack([stats.mins, stats.maxs]).select(2, SequenceExtremum.W_HOST)
        elif token_is:
            # [2, N]: smallest and largest ratio of the valid tokens
            ratio = torch.exp(torch.stack([stats.mins, stats.maxs]).select(2, SequenceExtremum.LOG_R).clamp(-_EXP_CAP, _EXP_CAP))
            one = 1.0
            if plan.tis_mode != "mask":  # truncate / clip are monotone in r
                ratio = _bound_values(ratio, plan)
                one = min(1.0, plan.tis_hi) if plan.tis_mode == "truncate" else min(max(1.0, plan.tis_lo), plan.tis_hi)
            # neutralised tokens count with ratio 1. A sequence without a valid token has only
            # those (then its extrema hold +-BIG: ratios e^80 / e^-80, bounded beyond `one` on
            # either side, so both become `one`), or no loss-mask token (zeroed below)
            lo_r, hi_r = ratio.unbind(0)
            with_one = torch.stack([lo_r.clamp(max=one), hi_r.clamp(min=one)])
            host_ext = torch.where(col(SequenceSum.N_NONFINITE) > 0, with_one, ratio)
        if token_is:  # [3, N] mean / min / max (the mean is 0 without a loss-mask token already)
            host = torch.cat([means[4:5] / normalizer, torch.where(has_mask, host_ext / normalizer, 0.0)])
        else:  # [1, N]: the sequence weight
            host = (seqs.w_seq_unbounded if plan.tis_mode == "mask" else seqs.w_seq).unsqueeze(0)
            host = torch.where(has_mask, host / normalizer, 0.0)
        for i, part in enumerate(("mean", "min", "max")):
            seq(f"mis_is_ratio_{part}_final", host, i if host.shape[0] > 1 else 0)
        if full:
            if token_is:
                final = torch.cat([means[5:6], torch.stack([stats.mins, stats.maxs]).select(2, SequenceExtremum.W_KEPT)])
            else:
                final = seqs.w_seq.unsqueeze(0)
            final = torch.where(kept, final / normalizer, 0.0)
            for i, part in enumerate(("mean", "min", "max")):
                seq(f"mis_kept_weight_{part}_final", final, i if final.shape[0] > 1 else 0)

    # ---- every sequence metric (and alive) expanded to [T] together: rows of one block -------
    parts: list[torch.Tensor] = []  # [k, N] float64 parts of the block, in order of first use
    offsets: list[int] = []  # the block row of each part's first row
    rows: list[torch.Tensor] = []  # single [N] float64 rows
    flags: list[torch.Tensor] = [seqs.alive]  # single [N] bool rows; the first is alive (not a metric)
    where: list[tuple[str, int]] = []  # (kind, index) of every metric
    for name, values, row in seq_rows:
        if row >= 0:
            k = index_by_identity(parts, values)  # by `is`: compile_engine traces this too
            if k is None:
                k = len(parts)
                offsets.append(sum(p.shape[0] for p in parts))
                parts.append(values)
            where.append(("part", offsets[k] + row))
        elif values.dtype == torch.bool:
            where.append(("flag", len(flags)))
            flags.append(values)
        else:
            where.append(("row", len(rows)))
            rows.append(values if values.dtype == f64 else values.to(f64))
    num_part_rows = sum(p.shape[0] for p in parts)
    block = torch.cat(parts + ([torch.stack(rows)] if rows else []) + [torch.stack(flags).to(f64)])  # [S, N] float64
    base = {"part": 0, "row": num_part_rows, "flag": num_part_rows + len(rows)}
    index = [base[kind] + i for kind, i in where]
    expanded = layout.expand(_f32(block)).unbind(0)  # [S, T]
    keepf = tokens.tok_kept * expanded[base["flag"]]  # alive, 0/1 (exact in float32)
    token_metrics["mis_rejected_token_fraction"] = tokens.flags[SequenceSum.N_MASK] - keepf  # 1 at loss-mask tokens not kept
    for (name, _, _), i in zip(seq_rows, index):
        token_metrics[name] = expanded[i]
    # batch metrics: one value for every token, a stride-0 view (no [T] buffer)
    values64 = torch.stack([v for _, v in batch_values])  # 0-dim float64 each
    values32 = _f32(values64).unsqueeze(1).expand(len(batch_values), num_tokens).unbind(0)
    for (name, _), v64, v32 in zip(batch_values, values64.unbind(0), values32):
        token_metrics[name] = v32
        summary[name] = v64

    # ---- the weights' batch statistics (use_tis): before bound over the valid tokens /
    # sequences, after bound over the kept tokens of alive sequences (the normalisation's own sum
    # and count) / the kept sequences; sums and counts here, divided with the summaries below
    weight_sums: list[torch.Tensor] = []
    weight_counts: list[torch.Tensor] = []
    if plan.use_tis:
        if token_is:
            count = norm_stats.count
            weight_sums = [total[int(SequenceSum.SUM_W_BEFORE)], norm_stats.weight_sum]
            weight_counts = [nv, count]
            # per-sequence extrema of log r (every sequence: empty ones hold +-BIG) and of the
            # bounded weight (alive sequences), as rows
            over = torch.stack([has_valid, seqs.alive, has_mask])
            low = _batch_extreme(torch.where(over, stats.mins.t(), BIG), "amin")  # [3]
            high = _batch_extreme(torch.where(over, stats.maxs.t(), -BIG), "amax")
            ext = torch.stack([low, high], 1)  # [3, 2]: rows log r, bounded weight, (icepop weight)
            before, after = torch.exp(ext[int(SequenceExtremum.LOG_R)].clamp(-_EXP_CAP, _EXP_CAP)), ext[int(SequenceExtremum.W_KEPT)]
            present = torch.stack([nv > 0, count > 0])
        else:
            hv, wu, wb = has_valid_f, seqs.w_seq_unbounded, seqs.w_seq
            keptf = kept.to(f64)
            weight_sums = [(wu * hv).sum(), (wb * keptf).sum()]
            weight_counts = [hv.sum(), keptf.sum()]
            rows_b = torch.stack([wu, wb])
            over = torch.stack([has_valid, kept])
            low = _batch_extreme(torch.where(over, rows_b, BIG), "amin")  # [2]: before, after
            high = _batch_extreme(torch.where(over, rows_b, -BIG), "amax")
            before, after = torch.stack([low, high], 1).unbind(0)
            present = torch.stack([has_valid.any(), kept.any()])
        # [[before min, before max], [after min, after max]], 0 where there is nothing to take
        extrema = torch.where(present.view(2, 1), torch.stack([before, after]), 0.0).view(4).unbind(0)

    # ---- every summary mean in one division: sequence metrics over sequences with loss tokens,
    # token metrics over loss-mask tokens, the weights over their counts
    has_mask_f = has_mask.to(f64)
    num_seq_with_mask = has_mask_f.sum()
    means_all = _safe_div(
        torch.cat([(block * has_mask_f).sum(1), torch.stack([v for _, v in tok_totals] + weight_sums)]),
        torch.stack([num_seq_with_mask] * block.shape[0] + [total_mask] * len(tok_totals) + weight_counts),
    ).unbind(0)
    for (name, _, _), i in zip(seq_rows, index):
        summary[name] = means_all[i]
    for k, (name, _) in enumerate(tok_totals):
        summary[name] = means_all[block.shape[0] + k]

    # ---- summary-only batch statistics ---------------------------------------------------
    summary["num_sequences"] = torch.full((), float(stats.num_sequences), dtype=f64, device=n_mask.device)
    summary["num_loss_tokens"] = total_mask
    summary["num_kept_tokens"] = num_kept_tokens
    summary["num_kept_sequences"] = norm_stats.count if plan.use_tis and not token_is else kept.to(f64).sum()
    if plan.use_tis:
        mean_before, mean_after = means_all[-2:]
        final = (torch.stack([mean_after, extrema[2], extrema[3]]) / normalizer).unbind(0)
        summary["mis_weight_before_bound_mean"] = mean_before
        summary["mis_weight_before_bound_min"], summary["mis_weight_before_bound_max"] = extrema[0], extrema[1]
        summary["mis_weight_after_bound_mean"] = mean_after
        summary["mis_weight_after_bound_min"], summary["mis_weight_after_bound_max"] = extrema[2], extrema[3]
        for part, value in zip(("mean", "min", "max"), final):
            summary[f"mis_weight_final_{part}"] = value
    return token_metrics, summary, keepf


def _batch_extreme(rows: torch.Tensor, how: str) -> torch.Tensor:
    """``[k, N] -> [k]`` row minima (``how="amin"``) or maxima (``"amax"``); ``+-BIG`` for ``N = 0``."""
    fill = rows.new_full((rows.shape[0], 1), BIG if how == "amin" else -BIG)
    return getattr(torch, how)(torch.cat([rows, fill], 1), 1)


def _bound_values(w: torch.Tensor, plan: Plan) -> torch.Tensor:
    return w.clamp(max=plan.tis_hi) if plan.tis_mode == "truncate" else w.clamp(plan.tis_lo, plan.tis_hi)


def bucket_table(tokens: TokenQuantities, edges: Sequence[float]) -> dict[str, torch.Tensor]:
    """Mismatch by rollout-probability bucket over this call's valid loss-mask tokens.

    Buckets are ``[edges[i], edges[i+1])`` on ``p = exp(log pi_rollout)`` (the last includes 1).

    Returns:
        ``edges [B+1]``, ``num_tokens [B]``, ``mean_abs_log_ratio [B]`` (mean |log r|),
        ``mean_k3 [B]`` (mean k3) — float64.
    """
    edges_t = torch.tensor([float(e) for e in edges], dtype=torch.float64, device=tokens.train.device)
    num_buckets = edges_t.numel() - 1
    validf, log_r = tokens.valid, tokens.log_r
    if validf is None or log_r is None:  # a call without metrics keeps neither: recompute them
        if tokens.bound is None:
            raise ValueError("the token quantities carry neither log_r nor the bound to recompute it")
        validf, _, _, _, log_r = masked_log_ratio(as_factor(tokens.mask), tokens.train, tokens.rollout, tokens.bound)
    valid = validf > 0
    p = torch.exp(tokens.rollout.to(torch.float64))
    idx = torch.bucketize(p, edges_t[1:-1], right=True).clamp(0, num_buckets - 1)
    idx = torch.where(valid, idx, torch.full_like(idx, num_buckets))  # invalid -> dropped bucket
    k3 = (tokens.k3 if tokens.k3 is not None else k3_from_log_ratio(log_r)).to(torch.float64)
    absl = (tokens.train.to(torch.float64) - tokens.rollout.to(torch.float64)).abs()
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
