"""The vectorised MIS engine: importance-sampling weights, rejection masks and mismatch metrics
for packed sequences (pure torch; no Megatron, no torch.distributed).

With ``log r_t = log pi_train(y_t) - log pi_rollout(y_t)`` on the loss-mask tokens:

- levels: token ``w_t = r_t``; sequence ``w = exp(sum log r_t)``; geometric ``w = exp(mean log r_t)``
  (every exponent clamped to ``[-log_ratio_bound, log_ratio_bound]``);
- IS modes: truncate ``min(w, U)``; clip ``clamp(w, L, U)``; mask ``w`` inside ``[L, U]``, else the
  token (token level) or sequence (sequence / geometric level) is rejected;
- RS at its own level: reject where the level's ratio lies outside ``[L_rs, U_rs]``;
- veto: reject the whole sequence if any kept token has ``r_t < rs_veto_threshold``, or a token
  probability below ``prob_veto_threshold``;
- self-normalisation: divide the weights by their mean over kept tokens (token level) or kept
  sequences (sequence / geometric level), over this call or a passed-in global mean.

How it is organised (and why it is exact under context parallelism): every sequence-level
decision needs only per-sequence sums, counts, minima and maxima. :func:`compute_mis` therefore

1. computes per-token quantities and the per-sequence partial statistics of the tokens it holds
   (:class:`SequenceStatistics`, ``[N, K]`` float64);
2. hands them to ``reduce_stats`` — the identity for a single process, one collective across the
   CP group in :mod:`megatron_mis.parallel` — so every rank sees the statistics of the whole
   sequences;
3. derives sequence weights, rejections, normalisation and metrics from the reduced statistics.

No step loops over sequences in Python or synchronises with the device (the optional
``nonfinite_policy="error"`` check is the one exception, and says so).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.segments import (
    as_cu_seqlens,
    expand,
    segment_max,
    segment_min,
    segment_sum,
    sequence_ids,
)

__all__ = [
    "DEFAULT_PROB_BUCKET_EDGES",
    "MISResult",
    "NormalizationStatistics",
    "SequenceStatistics",
    "StatsReducer",
    "compute_mis",
    "compute_mis_from_lists",
    "normalization_statistics",
]


class SumCol(IntEnum):
    """Columns of :attr:`SequenceStatistics.sums` (per-sequence sums over the held tokens)."""

    N_MASK = 0  # loss-mask tokens
    N_VALID = 1  # loss-mask tokens with finite train and rollout log-probs
    N_NONFINITE = 2  # loss-mask tokens with a NaN / inf log-prob
    SUM_LOG_R = 3  # sum of raw log r over valid tokens
    SUM_TRAIN_LP = 4
    SUM_ROLLOUT_LP = 5
    SUM_K3 = 6  # r - 1 - log r (clamped log r)
    SUM_R = 7
    SUM_R2 = 8
    SUM_ABS_R1 = 9  # |r - 1|
    N_TOK_REJECTED = 10  # loss-mask tokens rejected by a token-level decision
    N_TOK_KEPT = 11  # loss-mask tokens not rejected at token level
    SUM_W_KEPT = 12  # token-level IS: bounded weight over token-kept tokens
    N_IS_LOW = 13  # token-level IS: unbounded weight < L
    N_IS_HIGH = 14  # token-level IS: unbounded weight > U
    N_RS_LOW = 15  # token-level RS
    N_RS_HIGH = 16
    N_RATIO_VETO = 17  # tokens with r < rs_veto_threshold
    N_PROB_VETO = 18  # tokens with probability < prob_veto_threshold
    SUM_W_BEFORE = 19  # token-level IS: unbounded weight over valid tokens
    SUM_W_AFTER = 20  # token-level IS: bounded weight over loss-mask tokens (0 where IS-masked)


class ExtCol(IntEnum):
    """Columns of :attr:`SequenceStatistics.mins` / ``maxs``."""

    LOG_R = 0  # clamped token log r over valid tokens
    W_KEPT = 1  # token-level IS: bounded weight over token-kept tokens


_BIG = 1e30  # fill for empty minima / maxima (finite, so sums of fills never make NaN)


@dataclass
class SequenceStatistics:
    """Per-sequence statistics of the tokens one rank holds; the only data that must cross
    context-parallel ranks.

    Attributes:
        sums: ``[N, len(SumCol)]`` float64 — summed across ranks.
        mins: ``[N, len(ExtCol)]`` float64 — minimum across ranks (``+1e30`` where empty).
        maxs: ``[N, len(ExtCol)]`` float64 — maximum across ranks (``-1e30`` where empty).
    """

    sums: torch.Tensor
    mins: torch.Tensor
    maxs: torch.Tensor

    def col(self, c: SumCol) -> torch.Tensor:
        """``[N]`` column of the sums."""
        return self.sums[:, int(c)]

    @property
    def num_sequences(self) -> int:
        return int(self.sums.shape[0])


#: ``reduce_stats(local) -> whole-sequence statistics``; must be identical on every rank that
#: shares the sequences.
StatsReducer = Callable[[SequenceStatistics], SequenceStatistics]


@dataclass
class NormalizationStatistics:
    """The sum and count behind a self-normalisation mean (0-dim float64 tensors).

    Token level: sum of bounded weights over kept tokens, and their number. Sequence / geometric
    level: sum of bounded sequence weights over kept sequences, and their number. Add these over
    micro-batches and data-parallel ranks to get the global mean ``weight_sum / count``.
    """

    weight_sum: torch.Tensor
    count: torch.Tensor

    def __add__(self, other: "NormalizationStatistics") -> "NormalizationStatistics":
        return NormalizationStatistics(self.weight_sum + other.weight_sum, self.count + other.count)

    def mean(self) -> torch.Tensor:
        """The normalising mean (1 where nothing is kept, so nothing is scaled)."""
        return torch.where(self.count > 0, self.weight_sum / self.count.clamp_min(1), torch.ones_like(self.weight_sum))


#: Bucket edges on the rollout probability (seed 001: the mismatch grows as probabilities fall).
DEFAULT_PROB_BUCKET_EDGES: tuple[float, ...] = (0.0, 1e-6, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


@dataclass
class MISResult:
    """Everything :func:`compute_mis` computes for one batch of ``N`` sequences, ``T`` tokens.

    Attributes:
        weights: ``[T]`` float32, detached — the IS weight of every token after bounds, rejection
            and normalisation; exactly 0 where the token is not kept. All ones at kept tokens when
            ``use_tis`` is off.
        keep_mask: ``[T]`` bool — loss-mask tokens that survive every rejection.
        seq_weights: ``[N]`` float32 — sequence / geometric IS weight after bounds and normalisation
            (0 for rejected sequences); for token-level IS the mean final weight of the sequence.
        seq_rejected: ``[N]`` bool — whole sequence rejected (sequence-level IS mask, sequence-level
            RS, veto, or no token left).
        stats: the reduced :class:`SequenceStatistics`.
        normalization: :class:`NormalizationStatistics` of this call (before any global mean).
        normalizer: 0-dim float32 — the mean the weights were divided by (1 without normalisation).
        token_metrics: ``{name: [T] float32}`` aligned with the input tokens (sequence values
            repeated over their tokens, batch values over all tokens), Miles' ``mis_`` names. Hosts
            reduce them over the ORIGINAL loss mask.
        summary: ``{name: 0-dim tensor}`` batch summaries (token metrics averaged over loss-mask
            tokens, sequence metrics over sequences with loss-mask tokens). Exact under context
            parallelism (built from the reduced statistics) except the bucket table.
        num_nonfinite: 0-dim int64 — loss-mask tokens with NaN / inf log-probs.

    The mismatch by rollout-probability bucket (:attr:`bucket_table`) is computed on first access,
    so callers that do not read it (the host drop-ins) do not pay for it.
    """

    weights: torch.Tensor
    keep_mask: torch.Tensor
    seq_weights: torch.Tensor
    seq_rejected: torch.Tensor
    stats: SequenceStatistics
    normalization: NormalizationStatistics
    normalizer: torch.Tensor
    token_metrics: dict[str, torch.Tensor]
    summary: dict[str, torch.Tensor]
    num_nonfinite: torch.Tensor
    config: MISConfig = field(repr=False)
    _tokens: "_Tokens | None" = field(default=None, repr=False)
    _bucket_edges: tuple[float, ...] = field(default=DEFAULT_PROB_BUCKET_EDGES, repr=False)
    _bucket_table: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _warned: bool = field(default=False, repr=False)

    @property
    def bucket_table(self) -> dict[str, torch.Tensor]:
        """``{"edges": [B+1], "num_tokens": [B], "mean_abs_log_ratio": [B], "mean_k3": [B]}``
        (float64) — mismatch by rollout-probability bucket over this call's tokens (local to the
        rank under context parallelism)."""
        if self._bucket_table is None:
            from megatron_mis.core import metrics as _metrics

            self._bucket_table = _metrics.bucket_table(self._tokens, self._bucket_edges)
        return self._bucket_table

    def check_nonfinite(self) -> int:
        """Synchronise once, warn (or raise for ``nonfinite_policy="error"``) about non-finite
        log-probs; returns their count. Called by :meth:`scalars` and the host drop-ins."""
        count = int(self.num_nonfinite)
        if count and not self._warned:
            self._warned = True
            action = "rejected" if self.config.nonfinite_policy == "reject" else "neutralised (ratio 1)"
            warnings.warn(
                f"megatron-mis: {count} loss-mask token(s) had NaN or inf train/rollout log-probs; "
                f"they were {action} and counted in mis_nonfinite_token_fraction",
                RuntimeWarning,
                stacklevel=2,
            )
        return count

    def scalars(self) -> dict[str, float]:
        """The summary as Python floats (one synchronisation)."""
        self.check_nonfinite()
        names = list(self.summary)
        if not names:
            return {}
        values = torch.stack([self.summary[n].to(torch.float64).reshape(()) for n in names]).tolist()
        return dict(zip(names, values))

    def split(self, tensor: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Split a ``[T]`` tensor (``weights``, ``keep_mask``, a metric) into per-sequence pieces."""
        return list(torch.split(tensor, [int(x) for x in lengths]))


# ===================================================================================== engine
@dataclass
class _Tokens:
    """Per-token quantities of one call, ``[T]`` each."""

    seq_ids: torch.Tensor
    mask: torch.Tensor  # bool
    valid: torch.Tensor  # bool
    nonfinite: torch.Tensor  # bool
    train: torch.Tensor  # float32, neutral where invalid
    rollout: torch.Tensor
    log_r: torch.Tensor  # clamped, 0 where invalid
    r: torch.Tensor
    k3: torch.Tensor  # r - 1 - log r, computed as expm1(log r) - log r in float64 (no cancellation near r = 1)
    tok_rejected: torch.Tensor  # bool, subset of mask
    tok_kept: torch.Tensor  # bool
    w_tok_unbounded: torch.Tensor | None  # token-level IS only
    w_tok: torch.Tensor | None  # bounded (0 where IS-masked)
    is_low: torch.Tensor | None
    is_high: torch.Tensor | None
    rs_low: torch.Tensor | None
    rs_high: torch.Tensor | None
    ratio_veto: torch.Tensor | None
    prob_veto: torch.Tensor | None
    #: float32 copies of the 0/1 flags, made once and shared by the per-sequence counts and the
    #: indicator metrics (each conversion is a full pass over the tokens)
    flags: dict = field(default_factory=dict)


@dataclass
class _Sequences:
    """Per-sequence decisions after the statistics are reduced, ``[N]`` each (float64 unless
    noted)."""

    n_mask: torch.Tensor
    n_valid: torch.Tensor
    level_log_r: dict[str, torch.Tensor]  # "sequence" / "geometric" clamped log-ratios
    w_seq_unbounded: torch.Tensor | None
    w_seq: torch.Tensor | None  # bounded, 0 where IS-masked
    is_low: torch.Tensor | None
    is_high: torch.Tensor | None
    rs_low: torch.Tensor | None
    rs_high: torch.Tensor | None
    ratio_vetoed: torch.Tensor  # bool
    prob_vetoed: torch.Tensor  # bool
    rejected: torch.Tensor  # bool: whole sequence out
    kept: torch.Tensor  # bool: not rejected and at least one kept token


def _prepare(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [T] (sequences concatenated), got shape {tuple(t.shape)}")
    shapes = {tuple(train_log_probs.shape), tuple(rollout_log_probs.shape), tuple(loss_mask.shape)}
    if len(shapes) != 1:
        raise ValueError(
            "train_log_probs, rollout_log_probs and loss_mask must have the same shape [T], got "
            f"{tuple(train_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(loss_mask.shape)}"
        )
    if not train_log_probs.is_floating_point() or not rollout_log_probs.is_floating_point():
        raise ValueError(
            f"log-probs must be floating point, got {train_log_probs.dtype} and {rollout_log_probs.dtype}"
        )
    num_tokens = int(train_log_probs.shape[0])
    device = train_log_probs.device
    cu = as_cu_seqlens(cu_seqlens, num_tokens, device)
    train = train_log_probs.detach().to(torch.float32)
    rollout = rollout_log_probs.detach().to(device=device, dtype=torch.float32)
    mask = loss_mask.detach().to(device) != 0
    return train, rollout, mask, cu, num_tokens


def _token_stage(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, lengths: torch.Tensor, cfg: MISConfig
) -> tuple[_Tokens, SequenceStatistics]:
    bound = cfg.log_ratio_bound
    finite = torch.isfinite(train) & torch.isfinite(rollout)
    valid = mask & finite
    nonfinite = mask & ~finite
    zero = torch.zeros_like(train)
    train_v = torch.where(valid, train, zero)
    rollout_v = torch.where(valid, rollout, zero)
    log_r_raw = train_v - rollout_v  # 0 where invalid
    log_r = log_r_raw.clamp(-bound, bound)
    r = torch.exp(log_r)
    # k3 = r - 1 - log r. Written in float32 it is a multiple of 6e-8 near r = 1 (r - 1 rounds to
    # the float32 grid): a floor of ~1e-8 under a true k3 of ~1e-13 for an fp32-vs-fp32 mismatch.
    # expm1(x) - x in float64 is exact to ~1e-16 / |x| relative; the result fits float32 again.
    log_r64 = log_r.double()
    k3 = (torch.expm1(log_r64) - log_r64).to(torch.float32)

    tok_rejected = torch.zeros_like(mask)
    if cfg.nonfinite_policy == "reject":
        tok_rejected = tok_rejected | nonfinite

    w_unb = w_tok = is_low = is_high = None
    if cfg.use_tis and cfg.tis_level == "token":
        w_unb = r
        lo, hi = cfg.tis_lower, cfg.tis_upper_bound
        is_low = valid & (w_unb < lo)
        is_high = valid & (w_unb > hi)
        if cfg.tis_mode == "truncate":
            w_tok = w_unb.clamp(max=hi)
        elif cfg.tis_mode == "clip":
            w_tok = w_unb.clamp(lo, hi)
        else:  # mask
            outside = is_low | is_high
            w_tok = torch.where(outside, zero, w_unb)
            tok_rejected = tok_rejected | outside

    rs_low = rs_high = None
    if cfg.use_rs and cfg.rs_level == "token":
        rs_low = valid & (r < cfg.rs_lower)
        rs_high = valid & (r > cfg.rs_upper)
        tok_rejected = tok_rejected | rs_low | rs_high

    ratio_veto = prob_veto = None
    if cfg.rs_veto_threshold is not None:
        ratio_veto = valid & (log_r_raw < math.log(cfg.rs_veto_threshold))
    if cfg.prob_veto_threshold is not None:
        source = rollout if cfg.prob_veto_source == "rollout" else train
        # -inf log-probs (probability 0) are vetoed too; NaN never compares below.
        prob_veto = mask & (source < math.log(cfg.prob_veto_threshold))

    tok_rejected = tok_rejected & mask
    tok_kept = mask & ~tok_rejected

    tokens = _Tokens(
        seq_ids=seq_ids, mask=mask, valid=valid, nonfinite=nonfinite, train=train_v, rollout=rollout_v,
        log_r=log_r, r=r, k3=k3, tok_rejected=tok_rejected, tok_kept=tok_kept, w_tok_unbounded=w_unb, w_tok=w_tok,
        is_low=is_low, is_high=is_high, rs_low=rs_low, rs_high=rs_high, ratio_veto=ratio_veto, prob_veto=prob_veto,
    )

    # ---- per-sequence partial statistics: one segment reduction per active column ----------
    # Columns are summed in float32 (counts are exact below 2^24 tokens per sequence); the
    # log-ratio sum, which feeds exp() at sequence level, is summed in float64.
    num_seqs = int(lengths.numel())
    f64 = torch.float64
    columns: dict[SumCol, torch.Tensor] = {
        SumCol.N_MASK: mask,
        SumCol.N_VALID: valid,
        SumCol.SUM_LOG_R: log_r_raw.to(f64),
        SumCol.SUM_TRAIN_LP: train_v,
        SumCol.SUM_ROLLOUT_LP: rollout_v,
        SumCol.SUM_K3: torch.where(valid, k3, zero),
        SumCol.SUM_R: torch.where(valid, r, zero),
        SumCol.SUM_ABS_R1: torch.where(valid, (r - 1.0).abs(), zero),
        SumCol.N_TOK_KEPT: tok_kept,
    }
    columns[SumCol.SUM_R2] = columns[SumCol.SUM_R].square()
    optional = {
        SumCol.N_RS_LOW: rs_low,
        SumCol.N_RS_HIGH: rs_high,
        SumCol.N_RATIO_VETO: ratio_veto,
        SumCol.N_PROB_VETO: prob_veto,
    }
    w_kept = None
    if w_tok is not None:
        w_kept = torch.where(tok_kept, w_tok, zero)
        optional.update({
            SumCol.SUM_W_KEPT: w_kept,
            SumCol.N_IS_LOW: is_low,
            SumCol.N_IS_HIGH: is_high,
            SumCol.SUM_W_BEFORE: torch.where(valid, w_unb, zero),
            SumCol.SUM_W_AFTER: torch.where(mask, w_tok, zero),
        })
    columns.update({c: v for c, v in optional.items() if v is not None})
    for c, values in columns.items():
        if values.dtype == torch.bool:
            columns[c] = tokens.flags[c] = values.to(torch.float32)
    sums = torch.zeros(num_seqs, len(SumCol), dtype=f64, device=train.device)
    for c, values in columns.items():
        sums[:, int(c)] = segment_sum(values, lengths).to(f64)
    # exact differences of counted columns (nonfinite = mask & ~valid, rejected = mask & ~kept)
    sums[:, SumCol.N_NONFINITE] = sums[:, SumCol.N_MASK] - sums[:, SumCol.N_VALID]
    sums[:, SumCol.N_TOK_REJECTED] = sums[:, SumCol.N_MASK] - sums[:, SumCol.N_TOK_KEPT]

    mins = torch.full((num_seqs, len(ExtCol)), _BIG, dtype=f64, device=train.device)
    maxs = torch.full((num_seqs, len(ExtCol)), -_BIG, dtype=f64, device=train.device)
    big = torch.full_like(r, 3e38)
    mins[:, ExtCol.LOG_R] = segment_min(torch.where(valid, log_r, big), lengths, 3e38).to(f64)
    maxs[:, ExtCol.LOG_R] = segment_max(torch.where(valid, log_r, -big), lengths, -3e38).to(f64)
    if w_kept is not None:
        mins[:, ExtCol.W_KEPT] = segment_min(torch.where(tok_kept, w_tok, big), lengths, 3e38).to(f64)
        maxs[:, ExtCol.W_KEPT] = segment_max(torch.where(tok_kept, w_tok, -big), lengths, -3e38).to(f64)
    mins = torch.where(mins >= 3e38, torch.full_like(mins, _BIG), mins)
    maxs = torch.where(maxs <= -3e38, torch.full_like(maxs, -_BIG), maxs)
    return tokens, SequenceStatistics(sums, mins, maxs)


def _bound(w: torch.Tensor, cfg: MISConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the IS mode to unbounded weights; returns (bounded, below L, above U)."""
    lo, hi = cfg.tis_lower, cfg.tis_upper_bound
    low, high = w < lo, w > hi
    if cfg.tis_mode == "truncate":
        return w.clamp(max=hi), low, high
    if cfg.tis_mode == "clip":
        return w.clamp(lo, hi), low, high
    return torch.where(low | high, torch.zeros_like(w), w), low, high


def _sequence_stage(stats: SequenceStatistics, cfg: MISConfig) -> _Sequences:
    bound = cfg.log_ratio_bound
    n_mask = stats.col(SumCol.N_MASK)
    n_valid = stats.col(SumCol.N_VALID)
    has_valid = n_valid > 0
    log_sum = stats.col(SumCol.SUM_LOG_R)
    level_log_r = {
        "sequence": log_sum.clamp(-bound, bound),
        "geometric": (log_sum / n_valid.clamp_min(1)).clamp(-bound, bound),
    }
    rejected = torch.zeros_like(has_valid)

    w_unb = w_seq = is_low = is_high = None
    if cfg.use_tis and cfg.tis_level != "token":
        w_unb = torch.exp(level_log_r[cfg.tis_level])
        w_seq, is_low, is_high = _bound(w_unb, cfg)
        is_low, is_high = is_low & has_valid, is_high & has_valid
        if cfg.tis_mode == "mask":
            rejected = rejected | is_low | is_high

    rs_low = rs_high = None
    if cfg.use_rs and cfg.rs_level != "token":
        rs_ratio = torch.exp(level_log_r[cfg.rs_level])
        rs_low = has_valid & (rs_ratio < cfg.rs_lower)
        rs_high = has_valid & (rs_ratio > cfg.rs_upper)
        rejected = rejected | rs_low | rs_high

    ratio_vetoed = stats.col(SumCol.N_RATIO_VETO) > 0
    prob_vetoed = stats.col(SumCol.N_PROB_VETO) > 0
    rejected = rejected | ratio_vetoed | prob_vetoed
    kept = ~rejected & (stats.col(SumCol.N_TOK_KEPT) > 0)
    return _Sequences(
        n_mask=n_mask, n_valid=n_valid, level_log_r=level_log_r, w_seq_unbounded=w_unb, w_seq=w_seq,
        is_low=is_low, is_high=is_high, rs_low=rs_low, rs_high=rs_high, ratio_vetoed=ratio_vetoed,
        prob_vetoed=prob_vetoed, rejected=rejected, kept=kept,
    )


def _normalization(stats: SequenceStatistics, seqs: _Sequences, cfg: MISConfig) -> NormalizationStatistics:
    if cfg.use_tis and cfg.tis_level == "token":
        alive = (~seqs.rejected).to(torch.float64)
        weight_sum = (stats.col(SumCol.SUM_W_KEPT) * alive).sum()
        count = (stats.col(SumCol.N_TOK_KEPT) * alive).sum()
    elif cfg.use_tis:
        keptf = seqs.kept.to(torch.float64)
        weight_sum = (seqs.w_seq * keptf).sum()
        count = keptf.sum()
    else:
        count = (stats.col(SumCol.N_TOK_KEPT) * (~seqs.rejected).to(torch.float64)).sum()
        weight_sum = count.clone()
    return NormalizationStatistics(weight_sum, count)


def _run_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reduce_stats):
    if not isinstance(config, MISConfig):
        raise TypeError(f"config must be a MISConfig, got {type(config).__name__}")
    train, rollout, mask, cu, num_tokens = _prepare(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    seq_ids = sequence_ids(cu, num_tokens)
    if config.nonfinite_policy == "error":
        # The one documented host synchronisation: raising needs to know.
        bad = (mask & ~(torch.isfinite(train) & torch.isfinite(rollout))).nonzero()
        if bad.numel():
            first = int(bad[0, 0])
            raise ValueError(
                f"{bad.shape[0]} loss-mask token(s) have NaN or inf log-probs (first at flat index {first}, "
                f"sequence {int(seq_ids[first])}: train={float(train[first])}, rollout={float(rollout[first])}); "
                "nonfinite_policy='error' (use 'neutralize' or 'reject' to continue)"
            )
    tokens, stats = _token_stage(train, rollout, mask, seq_ids, lengths, config)
    if reduce_stats is not None:
        stats = reduce_stats(stats)
    seqs = _sequence_stage(stats, config)
    return tokens, stats, seqs


def normalization_statistics(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    config: MISConfig,
    *,
    reduce_stats: StatsReducer | None = None,
) -> NormalizationStatistics:
    """The self-normalisation sum and count of one micro-batch, without building weights or
    metrics — the building block of the global (per-step, all data-parallel ranks) mean. The IS
    weights depend only on pi_old and pi_rollout, not on the parameters being trained, so the
    global mean can be computed once per step before the micro-batches run."""
    _, stats, seqs = _run_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reduce_stats)
    return _normalization(stats, seqs, config)


def compute_mis(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    config: MISConfig,
    *,
    reduce_stats: StatsReducer | None = None,
    global_normalizer: torch.Tensor | float | None = None,
    prob_bucket_edges: Sequence[float] = DEFAULT_PROB_BUCKET_EDGES,
) -> MISResult:
    """Compute IS weights, rejection masks and mismatch metrics for a packed batch.

    Args:
        train_log_probs: ``[T]`` log pi_train (the trainer's pi_old); any float dtype, computed in
            fp32; detached.
        rollout_log_probs: ``[T]`` log pi_rollout recorded by the rollout engine.
        loss_mask: ``[T]`` bool / int / float; nonzero marks a token that is in the loss.
        cu_seqlens: ``[N+1]`` offsets of the sequences in the flat tensors (list or tensor). A
            context-parallel rank passes the offsets of its local pieces (a piece may be empty).
        config: the :class:`MISConfig`.
        reduce_stats: combines per-sequence statistics across ranks holding pieces of the same
            sequences (see :mod:`megatron_mis.parallel.cp_mis`); ``None`` for whole sequences.
        global_normalizer: the precomputed global self-normalisation mean (0-dim); required when
            ``tis_batch_normalize_scope == "global"``.
        prob_bucket_edges: rollout-probability bucket edges for :attr:`MISResult.bucket_table`.

    Returns:
        :class:`MISResult`.

    Raises:
        ValueError / TypeError: mismatched shapes, bad ``cu_seqlens``, non-finite log-probs with
            ``nonfinite_policy="error"``, or global normalisation without a normaliser.
    """
    if config.normalizes and config.tis_batch_normalize_scope == "global" and global_normalizer is None:
        raise ValueError(
            "tis_batch_normalize_scope='global' needs the step's global mean: compute it once per step with "
            "megatron_mis.parallel.global_norm (GlobalNormalizer) and pass global_normalizer=..., or use "
            "tis_batch_normalize_scope='micro_batch'"
        )
    _metrics_check_edges(prob_bucket_edges)
    tokens, stats, seqs = _run_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reduce_stats)
    norm_stats = _normalization(stats, seqs, config)
    if config.normalizes:
        if config.tis_batch_normalize_scope == "global":
            if not isinstance(global_normalizer, torch.Tensor) or global_normalizer.device.type == "cpu":
                value = float(global_normalizer)  # host data: checking costs no device sync
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"global_normalizer must be a positive finite mean, got {value}")
            normalizer = torch.as_tensor(global_normalizer, dtype=torch.float64).to(stats.sums.device).reshape(())
        else:
            normalizer = norm_stats.mean()
    else:
        normalizer = torch.ones((), dtype=torch.float64, device=stats.sums.device)

    return _finalize(tokens, stats, seqs, norm_stats, normalizer, config, prob_bucket_edges)


def _metrics_check_edges(edges: Sequence[float]) -> None:
    values = [float(e) for e in edges]
    if len(values) < 2 or any(b <= a for a, b in zip(values, values[1:])) or values[0] < 0 or values[-1] > 1:
        raise ValueError(f"prob_bucket_edges must increase within [0, 1] with >= 2 entries, got {list(edges)}")


def _finalize(
    tokens: _Tokens,
    stats: SequenceStatistics,
    seqs: _Sequences,
    norm_stats: NormalizationStatistics,
    normalizer: torch.Tensor,
    cfg: MISConfig,
    prob_bucket_edges: Sequence[float],
) -> MISResult:
    from megatron_mis.core import metrics as _metrics

    sid = tokens.seq_ids
    f32 = torch.float32
    keep = tokens.tok_kept & ~expand(seqs.rejected, sid)
    norm32 = normalizer.to(f32)
    if cfg.use_tis and cfg.tis_level == "token":
        level_w = tokens.w_tok
    elif cfg.use_tis:
        level_w = expand(seqs.w_seq.to(f32), sid)
    else:
        level_w = torch.ones_like(tokens.r)
    weights = torch.where(keep, level_w / norm32, torch.zeros_like(tokens.r))

    if cfg.use_tis and cfg.tis_level != "token":
        seq_weights = torch.where(seqs.kept, seqs.w_seq / normalizer, torch.zeros_like(seqs.w_seq)).to(f32)
    else:
        kept_count = stats.col(SumCol.N_TOK_KEPT)
        if cfg.use_tis:
            seq_mean = stats.col(SumCol.SUM_W_KEPT) / kept_count.clamp_min(1) / normalizer
        else:
            seq_mean = torch.ones_like(kept_count)
        seq_weights = torch.where(seqs.kept, seq_mean, torch.zeros_like(seq_mean)).to(f32)

    token_metrics, summary = _metrics.build_metrics(tokens, stats, seqs, cfg, normalizer, keep, weights)
    return MISResult(
        weights=weights,
        keep_mask=keep,
        seq_weights=seq_weights,
        seq_rejected=seqs.rejected,
        stats=stats,
        normalization=norm_stats,
        normalizer=norm32,
        token_metrics=token_metrics,
        summary=summary,
        num_nonfinite=stats.col(SumCol.N_NONFINITE).sum().to(torch.int64),
        config=cfg,
        _tokens=tokens,
        _bucket_edges=tuple(prob_bucket_edges),
    )


def compute_mis_from_lists(
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    config: MISConfig,
    **kwargs,
) -> MISResult:
    """:func:`compute_mis` for per-sequence lists of 1-D tensors (one entry per sequence).

    Raises:
        ValueError: if the lists differ in length, or a sequence's three tensors differ in shape
            (naming the sequence and the shapes).
    """
    n = len(train_log_probs)
    if not (len(rollout_log_probs) == n == len(loss_masks)):
        raise ValueError(
            f"got {n} train_log_probs, {len(rollout_log_probs)} rollout_log_probs and {len(loss_masks)} "
            "loss_masks; one entry per sequence is needed in each"
        )
    for i, (a, b, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
        if a.dim() != 1 or a.shape != b.shape or a.shape != m.shape:
            raise ValueError(
                f"sequence {i}: train {tuple(a.shape)}, rollout {tuple(b.shape)} and loss_mask "
                f"{tuple(m.shape)} must be equal 1-D shapes"
            )
    lengths = [int(a.shape[0]) for a in train_log_probs]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    if n == 0:
        empty = torch.zeros(0)
        return compute_mis(empty, empty, empty, [0], config, **kwargs)
    device = train_log_probs[0].device
    train = torch.cat([t.to(device) for t in train_log_probs])
    rollout = torch.cat([t.to(device) for t in rollout_log_probs])
    mask = torch.cat([m.to(device).to(torch.float32) if m.dtype != torch.bool else m.to(device) for m in loss_masks])
    return compute_mis(train, rollout, mask, cu, config, **kwargs)
