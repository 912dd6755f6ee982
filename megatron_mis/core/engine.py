"""The vectorised MIS engine: importance-sampling weights, rejection masks and mismatch metrics
for packed sequences (pure torch; no Megatron, no torch.distributed).

With ``log r_t = log pi_train(y_t) - log pi_rollout(y_t)`` on the loss-mask tokens:

- levels: token ``w_t = r_t``; sequence ``w = exp(sum log r_t)``; geometric ``w = exp(mean log r_t)``
  (every exponent clamped to ``[-log_ratio_bound, log_ratio_bound]``);
- IS modes: truncate ``min(w, U)``; clip ``clamp(w, L, U)``; mask ``w`` inside ``[L, U]``, else the
  token (token level) or sequence (sequence / geometric level) is rejected; icepop (token level)
  ``w`` inside ``[L, U]``, else weight 0 with the token kept in the mask;
- RS at its own level: reject where the level's ratio lies outside ``[L_rs, U_rs]`` — or, with
  ``rs_criteria``, where a divergence criterion fails (k1 / k2 / k3 per token, or their sum, mean
  or max over the sequence; the max from the sequence's log-ratio extrema; ``seq_zscore_k1``: the
  mean log-ratio more than z standard deviations of its own length from ``-K3``);
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

No step loops over sequences in Python or synchronises with the host: the per-sequence sums,
minima and maxima, and every expansion of a per-sequence value back to the tokens, go through
one :class:`~megatron_mis.core.segments.SegmentLayout` per call (contiguous ``[M, C]`` chunk
reductions, a scatter of the ``M`` chunk results, one gather of ``[2N, C]`` head and tail
windows); ``cu_seqlens`` given as host data is validated on the host and moved with a
non-blocking copy. The number of aten ops per call does not depend on ``N``
(``tests/unit/test_engine_contract.py`` counts them), and the token and sequence stages compile with
``torch.compile(fullgraph=True, dynamic=True)`` without a graph break (``compile_engine``). The
one documented synchronisation is ``nonfinite_policy="error"``, which must read the count to
raise.

Cost on a CPU is dominated by memory: every fresh ``[T]`` buffer costs its page faults, so the
token stage works in place where it can, turns masks into float32 factors once, reduces a tensor
that serves two statistics once, frees its temporaries early, and returns batch metrics as
stride-0 views.

Precision: per-token work is float32 (the ratio, its bounds and decisions, K3 through a series
near r = 1). Per-sequence sums of values are float64 sums of the float32 values (each column is
converted just before its reduction, one at a time), accumulated only within the sequence, so a
sequence's statistics depend on its place in the batch only by float64 rounding; the log-ratio sum that feeds exp
at sequence level is exact to float64 rounding (the difference of the float64 log-prob sums),
and r^2 - 1 is formed in
float64 when ``log_ratio_bound`` lets r^2 leave the float32 range. Counts are exact (float32
chunks of 0/1). ``tests/unit/test_engine_contract.py`` checks the values against a float64
computation.
"""

from __future__ import annotations

import itertools
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_mis.config.mis import ZSCORE_BATCH_K3, ZSCORE_K3_FLOOR, MISConfig
from megatron_mis.core import metrics as _metrics
from megatron_mis.core.compiling import index_by_identity
from megatron_mis.core.flags import above, as_bool, as_factor, below, scaled_complement
from megatron_mis.core.segments import SegmentLayout, as_cu_seqlens, concat_sequences, segment_layout, to_device
from megatron_mis.core.statistics import (
    BIG,
    Plan as _Plan,
    SequenceExtremum,
    SequenceDecisions,
    SequenceStatistics,
    StatsReducer,
    SequenceSum,
    TokenQuantities,
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

# Kept importable from here (older callers).
_Tokens = TokenQuantities
_Sequences = SequenceDecisions
_BIG = BIG


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
        """The normalising mean: 1 where nothing is kept, or where every kept weight is 0 (IcePop
        zero-weights every token: dividing by a mean of 0 would give 0 / 0), so nothing is scaled."""
        return (self.weight_sum / self.count.clamp_min(1)).masked_fill_(self.weight_sum <= 0, 1.0)  # nothing kept: the sum is 0 too


#: Bucket edges on the rollout probability (When Speed Kills Stability, docs/references.md: the mismatch grows as probabilities fall).
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
            repeated over their tokens, batch values over all tokens), Miles' ``mis_`` names with
            Miles' definitions (docs/metrics.md). Hosts reduce them over the ORIGINAL loss mask.
            Empty with ``mis_metrics: none``.
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
    _tokens: "TokenQuantities | None" = field(default=None, repr=False)
    _bucket_edges: tuple[float, ...] = field(default=DEFAULT_PROB_BUCKET_EDGES, repr=False)
    _bucket_table: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _warned: bool = field(default=False, repr=False)

    @property
    def bucket_table(self) -> dict[str, torch.Tensor]:
        """``{"edges": [B+1], "num_tokens": [B], "mean_abs_log_ratio": [B], "mean_k3": [B]}``
        (float64) — mismatch by rollout-probability bucket over this call's tokens (local to the
        rank under context parallelism)."""
        if self._bucket_table is None:
            self._bucket_table = _metrics.bucket_table(self._tokens, self._bucket_edges)
        return self._bucket_table

    def check_nonfinite(self) -> int:
        """Synchronise once, warn (or raise for ``nonfinite_policy="error"``) about non-finite
        log-probs; returns their count. Called by :meth:`scalars`; the host drop-ins use the
        synchronisation-free :class:`DeferredCount` instead."""
        count = int(self.num_nonfinite)
        if count and not self._warned:
            self._warned = True
            warnings.warn(nonfinite_message(count, self.config), RuntimeWarning, stacklevel=2)
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


def nonfinite_message(count: int, config: MISConfig) -> str:
    action = "rejected" if config.nonfinite_policy == "reject" else "neutralised (ratio 1)"
    return (
        f"megatron-mis: {count} loss-mask token(s) had NaN or inf train/rollout log-probs; "
        f"they were {action} and counted in mis_nonfinite_token_fraction"
    )


class DeferredCount:
    """Read a 0-dim device count later without synchronising: a non-blocking copy to pinned host
    memory and a CUDA event; :meth:`poll` returns the value once the event has completed (at once
    on the CPU, where the value is already host memory), else ``None``."""

    __slots__ = ("_host", "_event")

    def __init__(self, count: torch.Tensor) -> None:
        if count.device.type == "cuda":
            self._host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._host.copy_(count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = count.detach(), None

    def poll(self) -> int | None:
        if self._event is not None and not self._event.query():
            return None
        return int(self._host.numpy())  # host memory the device has finished writing: no sync


# ===================================================================================== engine
def _token_stage(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, layout: SegmentLayout, plan: _Plan
) -> tuple[TokenQuantities, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantities and this call's per-sequence partial statistics ``(sums [N, K],
    mins [N, E], maxs [N, E])``. Pure tensor code, no host synchronisation, compilable.

    Cost discipline (CPU and GPU alike are memory-bound here): every ``[T]`` pass counts, so
    masks become float32 factors once and are multiplied in (every multiplied value is finite:
    non-finite log-probs are zeroed first), columns shared by two statistics are reduced once,
    and nothing is stacked into ``[T, K]`` blocks."""
    f64 = torch.float64
    metrics_on = plan.metrics != "none"
    num_seqs = layout.num_segments
    # Flags are float32 0/1 factors, made by comparisons that write float32 (torch's CPU kernels
    # for bool results and bool operands are several times slower than float ones) and combined
    # arithmetically: AND is x * y, OR is max(x, y), NOT is 1 - x.
    maskf = as_factor(mask)
    # diff is float32: a difference beyond the float32 range is +-inf; log_r is 0 where invalid
    validf, train_v, rollout_v, diff, log_r = _metrics.masked_log_ratio(maskf, train, rollout, plan.bound)
    # read only by the rejection and the indicator metric (the count is N_MASK - N_VALID)
    nonfinitef = maskf - validf if metrics_on or plan.reject_nonfinite else None
    r = torch.exp(log_r)  # 1 where invalid

    rejected = [nonfinitef] if plan.reject_nonfinite else []  # token-level rejection factors
    # k3 (a token metric, and the statistic of the *_k3 criteria) and k2 (the *_k2 criteria), 0
    # where invalid (log r = 0 there); expm1(log r) is shared with the metrics below
    em1 = torch.expm1(log_r) if metrics_on else None  # 0 where invalid
    needs_k3 = (plan.criteria_of("token", 3) + plan.criteria_of("seq_sum", 3) + plan.criteria_of("seq_mean", 3)
                + _zscore_batch(plan))
    k3 = _metrics.k3_from_log_ratio(log_r, em1) if metrics_on or needs_k3 else None
    needs_k2 = plan.criteria_of("token", 2) + plan.criteria_of("seq_sum", 2) + plan.criteria_of("seq_mean", 2)
    k2 = log_r.square().mul_(0.5) if needs_k2 else None
    # ---- token-level divergence criteria (rs_criteria): each a rejection factor of its own,
    # counted per criterion for the metrics; k1 is the ratio band of token RS
    criterion_flags: dict[SequenceSum, torch.Tensor] = {}
    for name, lo, hi in plan.criteria_of("token"):
        k = int(name[-1])
        if k == 1:
            failed = torch.maximum(below(r, lo), above(r, hi)).mul_(maskf)
        else:  # k2 / k3 are 0 where invalid, and the bound is > 0: no mask pass needed
            failed = above(k2 if k == 2 else k3, hi)
        criterion_flags[_TOKEN_CRITERION_COUNT[k]] = failed
        rejected.append(failed)
    # Decisions on the ratio see a neutralised (non-finite) loss token as ratio 1 (r is exactly 1
    # there), like any finite ratio-1 token; a rejected one is out anyway.
    w_tok = is_low = is_high = None
    if plan.token_is:
        if metrics_on or plan.tis_mode in ("mask", "icepop"):
            is_low, is_high = _band_flags(r, maskf, plan.tis_lo, plan.tis_hi)
        # without metrics and token-level RS nothing reads r after the bound: bound it in place
        clamp = torch.clamp if metrics_on or (plan.use_rs and plan.rs_level == "token") else torch.clamp_
        if plan.tis_mode == "truncate":
            w_tok = clamp(r, max=plan.tis_hi)
        elif plan.tis_mode == "clip":
            w_tok = clamp(r, plan.tis_lo, plan.tis_hi)
        else:  # mask / icepop: weight 0 outside [L, U]
            outside = torch.maximum(is_low, is_high)
            w_tok = torch.addcmul(r, r, outside, value=-1.0)  # r - r * outside: r or exactly 0
            if plan.tis_mode == "mask":  # out of the loss mask; icepop keeps the token in it
                rejected.append(outside)
            del outside

    rs_low = rs_high = None
    if plan.use_rs and plan.rs_level == "token":
        rs_low, rs_high = _band_flags(r, maskf, plan.rs_lo, plan.rs_hi)
        rejected.append(torch.maximum(rs_low, rs_high))

    ratio_veto = prob_veto = None
    if plan.log_ratio_veto is not None:
        # the float32 difference against log(threshold); -inf (finite values far apart) vetoes.
        # diff is 0 at every token that is not valid, and log(threshold) < 0 (the config keeps
        # the threshold in (0, 1)), so those tokens never compare below: no mask pass needed
        ratio_veto = below(diff, plan.log_ratio_veto)
        if not plan.log_ratio_veto < 0.0:
            ratio_veto.mul_(validf)
    if plan.log_prob_veto is not None:
        source = train if plan.prob_veto_train else rollout
        # -inf log-probs (probability 0) are vetoed too; NaN never compares below.
        prob_veto = below(source, plan.log_prob_veto).mul_(maskf)

    # without any token-level rejection the kept tokens are the loss-mask tokens; the rejection
    # factors may overlap, so they are combined by a maximum (OR), then removed from the mask
    if not rejected:
        keptf = maskf
    else:
        tok_rejected = rejected[0]
        for extra in rejected[1:]:
            tok_rejected = torch.maximum(tok_rejected, extra)
        keptf = torch.addcmul(maskf, maskf, tok_rejected, value=-1.0)  # mask AND NOT rejected

    # ---- the columns to reduce per sequence (a tensor shared by two columns is reduced once;
    # columns that are also token metrics are kept for them) --------------------------------
    flags: dict[SequenceSum, torch.Tensor] = {SequenceSum.N_MASK: maskf, SequenceSum.N_VALID: validf, SequenceSum.N_TOK_KEPT: keptf}
    if metrics_on:
        for c, v in ((SequenceSum.N_IS_LOW, is_low), (SequenceSum.N_IS_HIGH, is_high), (SequenceSum.N_RS_LOW, rs_low), (SequenceSum.N_RS_HIGH, rs_high)):
            if v is not None:
                flags[c] = v
        flags.update(criterion_flags)
    for c, v in ((SequenceSum.N_RATIO_VETO, ratio_veto), (SequenceSum.N_PROB_VETO, prob_veto)):
        if v is not None:
            flags[c] = v
    columns: dict[SequenceSum, torch.Tensor] = dict(flags)
    # the log-ratio sum feeds exp() at sequence level, so it is not taken from the float32
    # difference (which rounds): it is the difference of the float64 log-prob sums (below),
    # exact to float64 rounding and finite for any float32 log-probs. (A float64 [T] column of
    # differences would be as exact but costs a mixed-dtype [T] pass, ~1.5 ms per 0.5M tokens
    # on a CPU: torch's kernels for float64 -= float32 are scalar.)
    columns[SequenceSum.SUM_TRAIN_LP] = train_v
    columns[SequenceSum.SUM_ROLLOUT_LP] = rollout_v
    w_kept = None
    if plan.token_is:
        # the bounded weight over kept tokens (w_tok is 0 where IS-masked); formed in w_tok's own
        # buffer unless the after-bound metric still reads w_tok over all loss-mask tokens
        w_kept = w_tok * keptf if metrics_on and keptf is not maskf else w_tok.mul_(keptf)
        columns[SequenceSum.SUM_W_KEPT] = w_kept
    if k2 is not None and (plan.criteria_of("seq_sum", 2) or plan.criteria_of("seq_mean", 2)):
        columns[SequenceSum.SUM_K2] = k2
    if k3 is not None and (metrics_on or plan.criteria_of("seq_sum", 3) or plan.criteria_of("seq_mean", 3) or _zscore_batch(plan)):
        columns[SequenceSum.SUM_K3] = k3
    del k2
    if metrics_on:
        # r - 1 to float32 RELATIVE accuracy (exp(x) - 1 rounds away everything below ~6e-8);
        # r^2 - 1 = (r - 1)(r + 1): the chi-square from log space, accurate for tiny mismatches
        # (float64 when e^(2 bound) exceeds the float32 range)
        em1_r2 = em1 if plan.bound <= _F32_SAFE_BOUND else em1.to(f64)
        abs_em1 = em1.abs()
        tv = abs_em1 * 0.5  # the TV token metric; exact halves of |r - 1|
        columns.update({
            SequenceSum.SUM_R2: (em1_r2 + 2.0).mul_(em1_r2), SequenceSum.SUM_ABS_R1: abs_em1,
        })
        del em1, em1_r2
        r_v = r * validf
        columns[SequenceSum.SUM_R] = r_v
        if plan.token_is:
            w_after = w_kept if keptf is maskf else w_tok * maskf  # over loss-mask tokens
            del w_tok
            columns[SequenceSum.SUM_W_BEFORE] = r_v  # the unbounded token weight is r
            columns[SequenceSum.SUM_W_AFTER] = w_after
            # the hosts' after-bound weight: bounded (truncate / clip), the raw ratio in mask mode
            # (the hosts keep it at masked tokens), 0 out of band in icepop mode (Miles' weight)
            columns[SequenceSum.SUM_W_HOST] = r * maskf if plan.tis_mode == "mask" else w_after
    order: list[SequenceSum] = []
    unique: list[torch.Tensor] = []
    slots: list[int] = []
    for c, v in columns.items():
        slot = index_by_identity(unique, v)  # a column that is another's tensor is reduced once
        if slot is None:
            slot = len(unique)
            unique.append(v)
        order.append(c)
        slots.append(slot)
    # one reduction call for every column: 0/1 counts (the flags, first) in float32 chunks (exact),
    # values in float64 so that a sequence's statistics do not depend on its place in the batch
    num_counts = sum(1 for v in unique if any(v is f for f in flags.values()))
    reduced = layout.sums(unique, exact=num_counts)  # [N, K]
    del unique
    # every statistic column from the reduced ones, as sums[:, c] = ext[:, a_c] - ext[:, b_c] over
    # ext = [reduced | 0]: a column is x - 0 (exactly x), an absent one 0 - 0, a difference x - y.
    # One index_select with a host-built index moved without blocking (a Python-list index on an
    # accelerator tensor would be a blocking copy), one subtraction.
    zero = reduced.shape[1]
    slot = dict(zip(order, slots))
    pick = {int(c): (slot[c], zero) for c in order}
    # sum(log r) = sum(train) - sum(rollout), float64 sums of float32 values (exact to float64 rounding)
    pick[int(SequenceSum.SUM_LOG_R)] = (slot[SequenceSum.SUM_TRAIN_LP], slot[SequenceSum.SUM_ROLLOUT_LP])
    # exact differences of counted columns (nonfinite = mask & ~valid, rejected = mask & ~kept)
    pick[int(SequenceSum.N_NONFINITE)] = (slot[SequenceSum.N_MASK], slot[SequenceSum.N_VALID])
    pick[int(SequenceSum.N_TOK_REJECTED)] = (slot[SequenceSum.N_MASK], slot[SequenceSum.N_TOK_KEPT])
    source = [pick.get(c, (zero, zero)) for c in range(len(SequenceSum))]
    index = to_device(torch.tensor([a for a, _ in source] + [b for _, b in source], dtype=torch.long), train.device)
    ext = torch.nn.functional.pad(reduced, (0, 1))  # the zero column
    plus, minus = ext.index_select(1, index).view(num_seqs, 2, len(SequenceSum)).unbind(1)
    sums = plus - minus

    # ---- per-sequence extrema (token-level IS metrics, seq_max_* criteria) -------------------
    big = 3e38
    if plan.token_is and metrics_on:
        # excluded tokens get +-big by arithmetic (x + 0 = x exactly; every x is finite): cheap
        # passes where a select costs one slow one
        out_valid = scaled_complement(validf, big)
        out_kept = scaled_complement(keptf, big)
        # log r is 0 where invalid and w_kept 0 where not kept, so adding +-big gives +-big there.
        # W_HOST: icepop's weight over the loss-mask tokens (0 out of band); in the other modes the
        # LOG_R column again (the same tensor: no extra pass; never read). The maxima are minima
        # of the negated values (x - big = -(big - x) exactly): one reduction for both
        lr_low, lr_high_neg = log_r + out_valid, out_valid - log_r
        if plan.tis_mode == "icepop":
            out_mask = scaled_complement(maskf, big)
            host = columns[SequenceSum.SUM_W_HOST]
            host_low, host_high_neg = host + out_mask, out_mask - host
            del out_mask
        else:
            host_low, host_high_neg = lr_low, lr_high_neg
        ext = layout.mins([lr_low, w_kept + out_kept, host_low, lr_high_neg, out_kept - w_kept, host_high_neg], big)
        del out_valid, out_kept, lr_low, lr_high_neg, host_low, host_high_neg
        ext = ext.to(f64)
        ext = ext.masked_fill_(ext >= big, BIG)  # [N, 6]: minima, negated maxima (+BIG where empty)
        # 0 - x, not -x: a maximum of 0 stays +0.0 (x - 0 in the direct form)
        mins, maxs = ext[:, :3], torch.rsub(ext[:, 3:], 0.0)
    elif plan.criteria_of("seq_max"):
        # the largest k2 / k3 of a sequence is that of its smallest or largest log r (k2 and k3
        # grow with |log r| on either side of 0), so the extrema of log r serve every seq_max_*
        out_valid = scaled_complement(validf, big)
        low = layout.mins([log_r + out_valid], big).to(f64)
        high = layout.maxs([log_r - out_valid], -big).to(f64)
        del out_valid
        mins = torch.full((num_seqs, len(SequenceExtremum)), BIG, dtype=f64, device=train.device)
        maxs = torch.full((num_seqs, len(SequenceExtremum)), -BIG, dtype=f64, device=train.device)
        mins[:, SequenceExtremum.LOG_R] = torch.where(low[:, 0] >= big, BIG, low[:, 0])
        maxs[:, SequenceExtremum.LOG_R] = torch.where(high[:, 0] <= -big, -BIG, high[:, 0])
    else:
        mins = torch.full((num_seqs, len(SequenceExtremum)), BIG, dtype=f64, device=train.device)
        maxs = torch.full((num_seqs, len(SequenceExtremum)), -BIG, dtype=f64, device=train.device)

    token_columns = {c: columns[c] for c in (SequenceSum.SUM_W_BEFORE, SequenceSum.SUM_W_AFTER, SequenceSum.SUM_W_HOST) if c in columns}
    if metrics_on:
        token_columns[SequenceSum.SUM_ABS_R1] = tv  # the TV, |r - 1| / 2
    # the k1 token metric (rollout - train), saturating where the float32 difference overflowed
    kl = diff.neg_().clamp_(-_metrics.F32_MAX, _metrics.F32_MAX) if metrics_on else None
    if metrics_on:
        tokens = TokenQuantities(
            mask=mask, valid=validf, nonfinite=nonfinitef, train=train, rollout=rollout,
            log_r=log_r, r=r, k3=k3, tok_kept=keptf, w_kept=w_kept,
            is_low=is_low, is_high=is_high, rs_low=rs_low, rs_high=rs_high, ratio_veto=ratio_veto, prob_veto=prob_veto,
            flags=flags, layout=layout, kl=kl, columns=token_columns, bound=plan.bound,
        )
    else:
        # what the weights and masks read, nothing more: a compiled stage writes only these [T]
        # buffers (the others live inside its kernel), and eager frees the rest now
        tokens = TokenQuantities(
            mask=mask, valid=None, nonfinite=None, train=train, rollout=rollout, log_r=None, r=None, k3=None,
            tok_kept=keptf, w_kept=w_kept, is_low=None, is_high=None, rs_low=None, rs_high=None, ratio_veto=None,
            prob_veto=None, flags={SequenceSum.N_TOK_KEPT: keptf}, layout=layout, bound=plan.bound,
        )
    return tokens, sums, mins, maxs


def _band_flags(r: torch.Tensor, maskf: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r < lo, r > hi)`` over the loss-mask tokens, float32 0/1 ``[T]``. ``r`` is exactly 1 at
    every other token (log r is 0 there), so a bound on the far side of 1 needs no mask pass."""
    low, high = below(r, lo), above(r, hi)
    if not lo <= 1.0:
        low.mul_(maskf)
    if not hi >= 1.0:
        high.mul_(maskf)
    return low, high


#: The count column of each token-level divergence criterion (token_k1, token_k2, token_k3).
_TOKEN_CRITERION_COUNT = {1: SequenceSum.N_TOKEN_K1, 2: SequenceSum.N_TOKEN_K2, 3: SequenceSum.N_TOKEN_K3}

#: Largest log-ratio bound whose r^2 = e^(2 bound) stays inside the float32 range (e^88.7).
_F32_SAFE_BOUND = 44.0


def _bound(w: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the IS mode to unbounded weights; returns (bounded, below L, above U)."""
    lo, hi = plan.tis_lo, plan.tis_hi
    low, high = w < lo, w > hi
    if plan.tis_mode == "truncate":
        return w.clamp(max=hi), low, high
    if plan.tis_mode == "clip":
        return w.clamp(lo, hi), low, high
    return torch.where(low | high, torch.zeros_like(w), w), low, high


def _sequence_stage(stats: SequenceStatistics, plan: _Plan) -> SequenceDecisions:
    bound = plan.bound
    n_mask = stats.col(SequenceSum.N_MASK)
    n_valid = stats.col(SequenceSum.N_VALID)
    has_valid = n_valid > 0
    log_sum = stats.col(SequenceSum.SUM_LOG_R)
    level_log_r = {}  # the levels something reads: the metrics read "sequence"
    for level in _levels_read(plan):
        mean = log_sum if level == "sequence" else log_sum / n_valid.clamp_min(1)
        level_log_r[level] = mean.clamp(-bound, bound)
    failing: list[torch.Tensor] = []  # [N] bool: the sequence-level rejections, OR-ed at the end

    w_unb = w_seq = is_low = is_high = None
    if plan.use_tis and plan.tis_level != "token":
        w_unb = torch.exp(level_log_r[plan.tis_level])
        w_seq, is_low, is_high = _bound(w_unb, plan)
        # a sequence without a valid token has ratio 1: flagged only by a band that excludes 1
        if not plan.tis_lo <= 1.0:
            is_low = is_low & has_valid
        if not plan.tis_hi >= 1.0:
            is_high = is_high & has_valid
        if plan.tis_mode == "mask":
            failing += [is_low, is_high]

    rs_low = rs_high = None
    if plan.use_rs and plan.rs_level != "token":
        rs_ratio = torch.exp(level_log_r[plan.rs_level])
        rs_low, rs_high = _sequence_band(rs_ratio, has_valid, plan.rs_lo, plan.rs_hi)
        failing += [rs_low, rs_high]

    criteria = _sequence_criteria(stats, plan, level_log_r, n_valid, has_valid)
    failing += list(criteria.values())

    # a veto column is all zeros without its veto: nothing to compare
    ratio_vetoed = stats.col(SequenceSum.N_RATIO_VETO) > 0 if plan.log_ratio_veto is not None else None
    prob_vetoed = stats.col(SequenceSum.N_PROB_VETO) > 0 if plan.log_prob_veto is not None else None
    failing += [v for v in (ratio_vetoed, prob_vetoed) if v is not None]
    if failing:
        rejected = failing[0]
        for failed in failing[1:]:
            rejected = rejected | failed
    else:
        rejected = torch.zeros_like(has_valid)
    alive = ~rejected
    kept = alive & (stats.col(SequenceSum.N_TOK_KEPT) > 0)
    return SequenceDecisions(
        n_mask=n_mask, n_valid=n_valid, has_valid=has_valid, level_log_r=level_log_r, w_seq_unbounded=w_unb, w_seq=w_seq,
        is_low=is_low, is_high=is_high, rs_low=rs_low, rs_high=rs_high, ratio_vetoed=ratio_vetoed,
        prob_vetoed=prob_vetoed, rejected=rejected, kept=kept, criteria=criteria, alive=alive,
    )


def _zscore_batch(plan: _Plan) -> tuple:
    """The ``seq_zscore_k1`` criteria that measure K3 on the call's own tokens (they need the
    per-sequence k3 sums)."""
    return tuple(c for c in plan.criteria_of("seq_zscore") if c[1] == ZSCORE_BATCH_K3)


def _sequence_band(ratio: torch.Tensor, has_valid: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio < lo, ratio > hi)`` over the sequences with a valid token, ``[N]`` bool. The ratio
    of a sequence without one is exactly 1 (its log-ratio sum is 0), so a band that contains 1
    needs no mask."""
    low, high = ratio < lo, ratio > hi
    return (low if lo <= 1.0 else has_valid & low), (high if hi >= 1.0 else has_valid & high)


def _levels_read(plan: _Plan) -> tuple[str, ...]:
    """The sequence-level log-ratios (``"sequence"``, ``"geometric"``) the decisions and metrics read."""
    levels = {plan.tis_level} if plan.use_tis else set()
    if plan.use_rs:
        levels.add(plan.rs_level)
    if plan.metrics != "none":
        levels.add("sequence")
    for name, _, _ in plan.rs_criteria:
        if name in ("seq_sum_k1", "seq_mean_k1", "seq_zscore_k1"):
            levels.add("sequence" if name == "seq_sum_k1" else "geometric")
    return tuple(level for level in ("sequence", "geometric") if level in levels)


def _sequence_criteria(
    stats: SequenceStatistics, plan: _Plan, level_log_r: dict[str, torch.Tensor], n_valid: torch.Tensor,
    has_valid: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``{name: [N] bool}``: the sequences failing each sequence-level divergence criterion of
    ``rs_criteria``, from the reduced statistics (float64). Over a sequence's valid loss-mask
    tokens: ``seq_sum_k1`` / ``seq_mean_k1`` compare ``prod r`` / ``exp(mean log r)`` with their
    band (exactly the sequence / geometric RS band); ``seq_sum_*`` / ``seq_mean_*`` of k2 / k3
    compare the sum / mean; ``seq_max_*`` the largest token value, which is that of the
    sequence's smallest or largest log r (k2 and k3 grow with ``|log r|`` on either side of 0).
    ``seq_zscore_k1`` (reference K3 ``lo``, bound ``hi``) compares ``|mean log r + K3|`` with
    ``hi x sqrt(2 K3 / n_valid)``: for a mismatch of mean per-token K3 the per-token log-ratio
    under the rollout policy has mean ``-KL(rollout || train) = -K3`` and variance about ``2 K3``,
    so this is a geometric band centred where the geometric mean lies, ``hi`` standard deviations
    wide at every length. ``lo`` = :data:`ZSCORE_BATCH_K3`: K3 is this call's mean over its valid
    tokens (every sequence's, so identical on every context-parallel rank), at least
    :data:`ZSCORE_K3_FLOOR`.
    A sequence without a valid token fails nothing."""
    out: dict[str, torch.Tensor] = {}
    for name, lo, hi in plan.rs_criteria:
        reduce, k = name.rsplit("_k", 1)
        if reduce == "token":
            continue
        if reduce == "seq_zscore":
            if lo == ZSCORE_BATCH_K3:  # the call's own K3: a [] float64 tensor, no host read
                k3 = (stats.col(SequenceSum.SUM_K3).sum() / n_valid.sum().clamp_min(1)).clamp_min(ZSCORE_K3_FLOOR)
                half = torch.sqrt(2.0 * k3 / n_valid.clamp_min(1)).mul_(hi)
            else:
                k3 = lo
                half = torch.rsqrt(n_valid.clamp_min(1)).mul_(hi * math.sqrt(2.0 * lo))
            out[name] = has_valid & ((level_log_r["geometric"] + k3).abs() > half)
            continue
        if k == "1":
            ratio = torch.exp(level_log_r["sequence" if reduce == "seq_sum" else "geometric"])
            out[name] = has_valid & ((ratio < lo) | (ratio > hi))
            continue
        if reduce == "seq_max":
            lr_min = stats.mins[:, SequenceExtremum.LOG_R]
            lr_max = stats.maxs[:, SequenceExtremum.LOG_R]
            # empty sequences hold +-1e30 there: made finite first (has_valid masks them below)
            lr_min, lr_max = torch.where(has_valid, lr_min, 0.0), torch.where(has_valid, lr_max, 0.0)
            if k == "2":
                value = 0.5 * torch.maximum(lr_min.square(), lr_max.square())
            else:  # float64 k3 of each end (|log r| <= log_ratio_bound <= 80: e^80 is finite)
                value = torch.maximum(torch.expm1(lr_min) - lr_min, torch.expm1(lr_max) - lr_max)
        else:
            total = stats.col(SequenceSum.SUM_K2 if k == "2" else SequenceSum.SUM_K3)
            value = total if reduce == "seq_sum" else total / n_valid.clamp_min(1)
        out[name] = has_valid & (value > hi)
    return out


def _normalization(stats: SequenceStatistics, seqs: SequenceDecisions, plan: _Plan) -> NormalizationStatistics:
    if plan.token_is:
        alive = seqs.alive.to(torch.float64)
        weight_sum = (stats.col(SequenceSum.SUM_W_KEPT) * alive).sum()
        count = (stats.col(SequenceSum.N_TOK_KEPT) * alive).sum()
    elif plan.use_tis:
        keptf = seqs.kept.to(torch.float64)
        weight_sum = (seqs.w_seq * keptf).sum()
        count = keptf.sum()
    else:
        count = (stats.col(SequenceSum.N_TOK_KEPT) * seqs.alive.to(torch.float64)).sum()
        weight_sum = count.clone()
    return NormalizationStatistics(weight_sum, count)


def sequence_decisions(
    stats: SequenceStatistics, normalizer: torch.Tensor | None, plan: _Plan
) -> tuple[SequenceDecisions, NormalizationStatistics, torch.Tensor]:
    """``(decisions, this call's normalisation statistics, the 0-dim float64 mean the weights are
    divided by)`` from the reduced statistics: ``normalizer`` (the global mean) if given, else this
    call's own mean, 1 without normalisation."""
    seqs = _sequence_stage(stats, plan)
    norm_stats = _normalization(stats, seqs, plan)
    if not plan.normalizes:
        norm = torch.ones((), dtype=torch.float64, device=stats.sums.device)
    elif normalizer is None:
        norm = norm_stats.mean()
    else:
        norm = normalizer
    return seqs, norm_stats, norm


def _outputs(
    tokens: TokenQuantities, stats: SequenceStatistics, normalizer: torch.Tensor | None, plan: _Plan
) -> dict[str, Any]:
    """Sequence decisions, normalisation, weights, masks and metrics from the reduced statistics
    (pure tensor code, compilable). ``normalizer`` is the global mean, or ``None`` to take this
    call's own (or 1 without normalisation)."""
    seqs, norm_stats, norm = sequence_decisions(stats, normalizer, plan)
    f32 = torch.float32
    layout = tokens.layout
    alive = seqs.alive
    metrics_on = plan.metrics != "none"
    if not metrics_on:
        token_metrics: dict[str, torch.Tensor] = {}
        summary: dict[str, torch.Tensor] = {}
        keepf = tokens.tok_kept * layout.expand(as_factor(alive))
    else:  # the metrics expand alive together with their sequence metrics (one expansion)
        # batch totals of every statistic: one reduction (0/1 counts sum exactly in any order)
        total = stats.sums.sum(0).unbind(0)
        token_metrics, summary, keepf = _metrics.build_metrics(tokens, stats, seqs, plan, norm, norm_stats, total)
    keep = as_bool(keepf)
    norm32 = norm.to(f32)
    # w * 1 and w * 0 are exact (every weight is finite): the same values as a select, fewer passes
    if plan.token_is:
        weights = (tokens.w_kept * keepf).div_(norm32)  # w_kept * keepf = w_tok * keepf: 0/1 factors
    elif plan.use_tis:
        seq_w = torch.where(alive, seqs.w_seq / norm, torch.zeros_like(seqs.w_seq)).to(f32)
        weights = layout.expand(seq_w).mul_(tokens.flags[SequenceSum.N_TOK_KEPT])
    else:
        weights = keepf

    if plan.use_tis and plan.tis_level != "token":
        seq_weights = torch.where(seqs.kept, seqs.w_seq / norm, torch.zeros_like(seqs.w_seq)).to(f32)
    else:
        kept_count = stats.col(SequenceSum.N_TOK_KEPT)
        if plan.use_tis:
            seq_mean = stats.col(SequenceSum.SUM_W_KEPT) / kept_count.clamp_min(1) / norm
        else:
            seq_mean = torch.ones_like(kept_count)
        seq_weights = torch.where(seqs.kept, seq_mean, 0.0).to(f32)

    return dict(
        seqs=seqs, norm_stats=norm_stats, normalizer=norm32, weights=weights, keep=keep, seq_weights=seq_weights,
        token_metrics=token_metrics, summary=summary,
        num_nonfinite=(total[int(SequenceSum.N_NONFINITE)] if metrics_on else stats.col(SequenceSum.N_NONFINITE).sum()).to(torch.int64),
    )


_COMPILED: dict[str, Any] = {}


def _stage_functions(compiled: bool):
    """``(token_stage, outputs)``: eager, or compiled once per process with
    ``torch.compile(fullgraph=True, dynamic=True)``."""
    if not compiled:
        return _token_stage, _outputs
    if not _COMPILED:
        _COMPILED["token"] = torch.compile(_token_stage, fullgraph=True, dynamic=True)
        _COMPILED["outputs"] = torch.compile(_outputs, fullgraph=True, dynamic=True)
    return _COMPILED["token"], _COMPILED["outputs"]


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
    if loss_mask.is_complex():
        raise ValueError(f"loss_mask must be bool, integer or real floating point, got {loss_mask.dtype}")
    num_tokens = int(train_log_probs.shape[0])
    device = train_log_probs.device
    cu = as_cu_seqlens(cu_seqlens, num_tokens, device)
    # detached (a detach is a dispatched op: only where there is a graph to leave)
    train = _detached(train_log_probs).to(torch.float32)
    rollout = _detached(rollout_log_probs).to(device=device, dtype=torch.float32)
    mask = _detached(loss_mask).to(device)
    # exact conversion: a token is in the loss iff its mask value is > 0 (NaN, 0 and negative
    # values are out); no value passes through to the returned masks
    mask = mask if mask.dtype == torch.bool else mask > 0
    return train, rollout, mask, cu, num_tokens


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _check_config(config: Any) -> MISConfig:
    if not isinstance(config, MISConfig):
        raise TypeError(
            f"config must be a megatron_mis.MISConfig, got {type(config).__name__} ({config!r:.80}); build one with "
            "MISConfig(...), MISConfig.from_yaml(path) or MISConfig.from_dict(mapping)"
        )
    return config


def _raise_nonfinite(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    # The one documented host synchronisation: raising needs to know.
    bad = (mask & ~(torch.isfinite(train) & torch.isfinite(rollout))).nonzero()
    if bad.numel():
        first = int(bad[0, 0])
        raise ValueError(
            f"{bad.shape[0]} loss-mask token(s) have NaN or inf log-probs (first at flat index {first}, "
            f"sequence {int(torch.searchsorted(cu_seqlens, bad[0, 0], right=True)) - 1}: train={float(train[first])}, rollout={float(rollout[first])}); "
            "nonfinite_policy='error' (use 'neutralize' or 'reject' to continue)"
        )


def _run_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reduce_stats, *, check_nonfinite=True):
    config = _check_config(config)
    plan = _Plan.of(config)
    train, rollout, mask, cu, num_tokens = _prepare(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    layout = segment_layout(cu, num_tokens)
    if config.nonfinite_policy == "error" and check_nonfinite:
        _raise_nonfinite(train, rollout, mask, cu)
    token_stage, outputs = _stage_functions(bool(getattr(config, "compile_engine", False)) and num_tokens > 0)
    tokens, sums, mins, maxs = token_stage(train, rollout, mask, layout, plan)
    stats = SequenceStatistics(sums, mins, maxs)
    if reduce_stats is not None:
        stats = reduce_stats(stats)
    return config, plan, tokens, stats, outputs


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
    config = _check_config(config)
    quiet = config.replace(mis_metrics="none") if getattr(config, "mis_metrics", "none") != "none" else config
    _, plan, _, stats, _ = _run_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, quiet, reduce_stats)
    return _normalization(stats, _sequence_stage(stats, plan), plan)


def check_normalizer(value: Any, device: torch.device) -> torch.Tensor:
    """A global self-normalisation mean as a 0-dim float64 tensor on ``device``; a host value (a
    number or a CPU tensor) must be positive and finite (checked without any device read)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(
            f"global_normalizer must be a positive finite number or a 0-dim tensor, got {type(value).__name__} ({value!r:.60})"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not (value.is_floating_point() or not value.dtype.is_complex):
            raise ValueError(f"global_normalizer must be a 0-dim real tensor, got shape {tuple(value.shape)} {value.dtype}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"global_normalizer must be a real number, got dtype {value.dtype}")
        if value.device.type != "cpu":  # device data: trusted, checking would synchronise
            return value.detach().to(dtype=torch.float64).reshape(())
    if isinstance(value, torch.Tensor):
        # host data: checked by a CPU op (no Python read of the value, which would be a device
        # read were the tensor on a GPU); the value is read only to word the error
        mean = value.detach().to(dtype=torch.float64).reshape(())
        try:
            torch._assert_async(torch.isfinite(mean) & (mean > 0), "global_normalizer")
        except RuntimeError:
            raise ValueError(f"global_normalizer must be a positive finite mean, got {float(mean)}") from None
        return mean.to(device, non_blocking=True)
    number = float(value)  # a Python number: no tensor is read
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"global_normalizer must be a positive finite mean, got {number}")
    return torch.tensor(number, dtype=torch.float64).to(device, non_blocking=True)


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
        loss_mask: ``[T]`` bool / int / float; a value > 0 marks a token that is in the loss
            (0, negative values and NaN are out).
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
            ``nonfinite_policy="error"``, or global normalisation without a normaliser (each naming
            the parameter, the value and what is allowed).
    """
    config = _check_config(config)
    if reduce_stats is not None and not callable(reduce_stats):
        raise TypeError(
            f"reduce_stats must be None or a callable SequenceStatistics -> SequenceStatistics "
            f"(megatron_mis.parallel.cp_mis.cp_stats_reducer), got {type(reduce_stats).__name__} ({reduce_stats!r:.40})"
        )
    if config.normalizes and config.tis_batch_normalize_scope == "global" and global_normalizer is None:
        raise ValueError(
            "tis_batch_normalize_scope='global' needs the step's global mean: compute it once per step with "
            "megatron_mis.parallel.global_norm (GlobalNormalizer) and pass global_normalizer=..., or use "
            "tis_batch_normalize_scope='micro_batch'"
        )
    edges = _metrics.check_bucket_edges(prob_bucket_edges)
    config, plan, tokens, stats, outputs = _run_stages(
        train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reduce_stats
    )
    normalizer = None
    if config.normalizes and config.tis_batch_normalize_scope == "global":
        normalizer = check_normalizer(global_normalizer, stats.sums.device)
    out = outputs(tokens, stats, normalizer, plan)
    return MISResult(
        weights=out["weights"],
        keep_mask=out["keep"],
        seq_weights=out["seq_weights"],
        seq_rejected=out["seqs"].rejected,
        stats=stats,
        normalization=out["norm_stats"],
        normalizer=out["normalizer"],
        token_metrics=out["token_metrics"],
        summary=out["summary"],
        num_nonfinite=out["num_nonfinite"],
        config=config,
        _tokens=tokens,
        _bucket_edges=edges,
    )


def compute_mis_from_lists(
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    config: MISConfig,
    **kwargs,
) -> MISResult:
    """:func:`compute_mis` for per-sequence lists of 1-D tensors (one entry per sequence).

    The per-sequence work is C-level: one comprehension of shapes per list, list comparisons, and
    one ``torch.cat`` per list.

    Raises:
        TypeError: an argument that is not a list / tuple of tensors (naming it and the entry).
        ValueError: if the lists differ in length, or a sequence's three tensors differ in shape
            (naming the sequence and the shapes).
    """
    try:
        n = len(train_log_probs)
        shapes = [t.shape for t in train_log_probs]
        shapes_r = [t.shape for t in rollout_log_probs]
        shapes_m = [t.shape for t in loss_masks]
        bad_type = isinstance(train_log_probs, torch.Tensor) or isinstance(rollout_log_probs, torch.Tensor) or isinstance(loss_masks, torch.Tensor)
    except (TypeError, AttributeError):
        bad_type = True
    if bad_type:  # the slow path only to name the culprit
        for name, value in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs), ("loss_masks", loss_masks)):
            _check_tensor_list(name, value)
    if not (len(rollout_log_probs) == n == len(loss_masks)):
        raise ValueError(
            f"got {n} train_log_probs, {len(rollout_log_probs)} rollout_log_probs and {len(loss_masks)} "
            "loss_masks; one entry per sequence is needed in each"
        )
    if shapes != shapes_r or shapes != shapes_m or any(len(s) != 1 for s in shapes):
        for i, (a, b, m) in enumerate(zip(shapes, shapes_r, shapes_m)):
            if len(a) != 1 or a != b or a != m:
                raise ValueError(
                    f"sequence {i}: train {tuple(a)}, rollout {tuple(b)} and loss_mask {tuple(m)} must be equal 1-D shapes"
                )
    _check_config(config)
    if n == 0:
        empty = torch.zeros(0)
        return compute_mis(empty, empty, empty, [0], config, **kwargs)
    cu = list(itertools.accumulate(map(operator.itemgetter(0), shapes), initial=0))  # C-level
    device = train_log_probs[0].device
    return compute_mis(
        concat_sequences(train_log_probs, device), concat_sequences(rollout_log_probs, device),
        concat_sequences(loss_masks, device), cu, config, **kwargs
    )


def _check_tensor_list(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be a list (one 1-D tensor per sequence), got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__} ({t!r:.40})")
