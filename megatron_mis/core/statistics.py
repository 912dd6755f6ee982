"""The data the MIS engine's stages hand to each other (pure torch; no logic beyond accessors).

Kept apart from :mod:`megatron_mis.core.engine` and :mod:`megatron_mis.core.metrics` so that
both import it and neither imports the other (no import cycle).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from megatron_mis.config.mis import MISConfig

__all__ = ["Plan", "SequenceSum", "SequenceExtremum", "SumCol", "ExtCol", "SequenceStatistics", "StatsReducer", "TokenQuantities", "SequenceDecisions", "BIG"]


class SequenceSum(IntEnum):
    """Columns of :attr:`SequenceStatistics.sums` (per-sequence sums over the held tokens)."""

    N_MASK = 0  # loss-mask tokens
    N_VALID = 1  # loss-mask tokens with finite train and rollout log-probs
    N_NONFINITE = 2  # loss-mask tokens with a NaN / inf log-prob (N_MASK - N_VALID)
    SUM_LOG_R = 3  # sum of raw log r over valid tokens (float64 difference: never overflows)
    SUM_TRAIN_LP = 4
    SUM_ROLLOUT_LP = 5
    SUM_K3 = 6  # r - 1 - log r (clamped log r)
    SUM_R = 7
    SUM_R2 = 8  # r^2 - 1 = expm1(log r) (expm1(log r) + 2) summed in float64 (finite up to e^160)
    SUM_ABS_R1 = 9  # |r - 1| = |expm1(log r)|
    N_TOK_REJECTED = 10  # loss-mask tokens rejected by a token-level decision (N_MASK - N_TOK_KEPT)
    N_TOK_KEPT = 11  # loss-mask tokens not rejected at token level
    SUM_W_KEPT = 12  # token-level IS: bounded weight over token-kept tokens
    N_IS_LOW = 13  # token-level IS: unbounded weight < L (over loss-mask tokens, neutralised ones as ratio 1)
    N_IS_HIGH = 14  # token-level IS: unbounded weight > U
    N_RS_LOW = 15  # token-level RS
    N_RS_HIGH = 16
    N_RATIO_VETO = 17  # tokens with r < rs_veto_threshold
    N_PROB_VETO = 18  # tokens with probability < prob_veto_threshold
    SUM_W_BEFORE = 19  # token-level IS: unbounded weight over valid tokens
    SUM_W_AFTER = 20  # token-level IS: bounded weight over loss-mask tokens (0 where IS-masked)
    SUM_W_HOST = 21  # token-level IS: the hosts' after-bound weight over loss-mask tokens (raw in mask mode)
    SUM_K2 = 22  # (log r)^2 / 2 (clamped log r) over valid tokens: seq_sum_k2 / seq_mean_k2 criteria only
    N_TOKEN_K1 = 23  # loss-mask tokens rejected by the token_k1 criterion (with metrics)
    N_TOKEN_K2 = 24  # ... by token_k2
    N_TOKEN_K3 = 25  # ... by token_k3


class SequenceExtremum(IntEnum):
    """Columns of :attr:`SequenceStatistics.mins` / ``maxs``."""

    LOG_R = 0  # clamped token log r over valid tokens (token-level IS metrics, seq_max_k2 / seq_max_k3)
    W_KEPT = 1  # token-level IS: bounded weight over token-kept tokens
    W_HOST = 2  # token-level icepop: the weight (0 out of band) over loss-mask tokens


#: Former names of :class:`SequenceSum` and :class:`SequenceExtremum`.
SumCol = SequenceSum
ExtCol = SequenceExtremum

#: fill for empty minima / maxima (finite, so sums of fills never make NaN)
BIG = 1e30


@dataclass
class SequenceStatistics:
    """Per-sequence statistics of the tokens one rank holds; the only data that must cross
    context-parallel ranks.

    Attributes:
        sums: ``[N, len(SequenceSum)]`` float64 — summed across ranks.
        mins: ``[N, len(SequenceExtremum)]`` float64 — minimum across ranks (``+1e30`` where empty).
        maxs: ``[N, len(SequenceExtremum)]`` float64 — maximum across ranks (``-1e30`` where empty).
    """

    sums: torch.Tensor
    mins: torch.Tensor
    maxs: torch.Tensor
    _columns: tuple[torch.Tensor, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def col(self, c: SequenceSum) -> torch.Tensor:
        """``[N]`` column of the sums (views made by one ``unbind`` on first use: the metrics read
        some thirty columns, and every separate index is a dispatched op)."""
        if self._columns is None:
            self._columns = self.sums.unbind(1)
        return self._columns[int(c)]

    @property
    def num_sequences(self) -> int:
        return int(self.sums.shape[0])


#: ``reduce_stats(local) -> whole-sequence statistics``; must be identical on every rank that
#: shares the sequences.
StatsReducer = Callable[[SequenceStatistics], SequenceStatistics]


@dataclass
class TokenQuantities:
    """Per-token quantities of one call, ``[T]`` each (``None`` where the configuration does not
    need them). Only what the outputs, the metrics and the lazy bucket table read is kept, so
    the call's temporaries are freed (and their memory reused) as early as possible. Without
    metrics (``mis_metrics: none``) that is the inputs, ``tok_kept``, ``w_kept`` and the
    ``N_TOK_KEPT`` flag: ``valid`` and ``log_r`` are ``None`` (the bucket table recomputes them
    from the inputs), so a compiled token stage does not write them."""

    mask: torch.Tensor  # bool; every other flag is a float32 0/1 factor (megatron_mis.core.flags)
    valid: torch.Tensor | None  # float32 0/1: loss-mask token with finite log-probs (None without metrics)
    nonfinite: torch.Tensor | None  # float32 0/1: loss-mask token with a NaN / inf log-prob (None unless read)
    train: torch.Tensor  # float32 as given (NaN / inf where given; read where ``valid``)
    rollout: torch.Tensor
    log_r: torch.Tensor | None  # clamped to +-bound, 0 where invalid (None without metrics)
    r: torch.Tensor | None  # exp(log_r); None without metrics (nothing reads it after the weights)
    k3: torch.Tensor | None  # r - 1 - log r to float32 relative accuracy (series near r = 1), 0 where invalid
    tok_kept: torch.Tensor  # float32 0/1: loss-mask token not rejected at token level
    w_kept: torch.Tensor | None  # token-level IS: the bounded weight, 0 where not kept (IS-masked, rejected, or out of the loss)
    is_low: torch.Tensor | None  # float32 0/1 factors; is_low / is_high only with metrics or mask mode
    is_high: torch.Tensor | None
    rs_low: torch.Tensor | None
    rs_high: torch.Tensor | None
    ratio_veto: torch.Tensor | None
    prob_veto: torch.Tensor | None
    #: float32 0/1 factors of the flags, keyed by :class:`SequenceSum`, made once and shared by the
    #: per-sequence counts, the weights and the indicator metrics
    flags: dict = field(default_factory=dict)
    #: how the tokens fall into sequences (:class:`megatron_mis.core.segments.SegmentLayout`)
    layout: Any = None
    #: the k1 token metric ``rollout - train`` (0 where invalid, saturated at +-3.4e38); ``None``
    #: without metrics
    kl: torch.Tensor | None = None
    #: reduced columns that are also token metrics, keyed by :class:`SequenceSum`: ``SUM_W_BEFORE``,
    #: ``SUM_W_AFTER``, ``SUM_W_HOST`` and ``SUM_ABS_R1`` (which holds ``|r - 1| / 2``, the TV)
    columns: dict = field(default_factory=dict)
    #: the log-ratio clamp ``log_r`` was (or is to be) computed with (the plan's ``bound``)
    bound: float | None = None


@dataclass
class SequenceDecisions:
    """Per-sequence decisions after the statistics are reduced, ``[N]`` each (float64 unless
    noted)."""

    n_mask: torch.Tensor
    n_valid: torch.Tensor
    has_valid: torch.Tensor  # bool: n_valid > 0
    level_log_r: dict[str, torch.Tensor]  # "sequence" / "geometric" clamped log-ratios (the levels read)
    w_seq_unbounded: torch.Tensor | None
    w_seq: torch.Tensor | None  # bounded, 0 where IS-masked
    is_low: torch.Tensor | None
    is_high: torch.Tensor | None
    rs_low: torch.Tensor | None
    rs_high: torch.Tensor | None
    ratio_vetoed: torch.Tensor | None  # bool; None without the ratio veto
    prob_vetoed: torch.Tensor | None  # bool; None without the probability veto
    rejected: torch.Tensor  # bool: whole sequence out
    kept: torch.Tensor  # bool: not rejected and at least one kept token
    #: sequence-level divergence criteria: name -> [N] bool, the sequence fails the criterion
    criteria: dict = field(default_factory=dict)
    #: bool: not rejected (``~rejected``, made once for its readers)
    alive: torch.Tensor | None = None


class Plan(NamedTuple):
    """The configuration as plain constants (what the compiled stages specialise on)."""

    bound: float
    use_tis: bool
    tis_level: str
    tis_mode: str
    tis_lo: float
    tis_hi: float
    use_rs: bool  # the ratio band at rs_level (use_rs without rs_criteria)
    rs_level: str
    rs_lo: float
    rs_hi: float
    log_ratio_veto: float | None
    log_prob_veto: float | None
    prob_veto_train: bool
    reject_nonfinite: bool
    normalizes: bool
    metrics: str  # "standard" / "full" / "none"
    #: divergence criteria ``(name, lower, upper)`` (MISConfig.rs_bounds), empty without them
    rs_criteria: tuple = ()

    @staticmethod
    def of(cfg: MISConfig) -> "Plan":
        return Plan(
            bound=float(cfg.log_ratio_bound), use_tis=bool(cfg.use_tis and cfg.apply_is_weights), tis_level=cfg.tis_level, tis_mode=cfg.tis_mode,
            tis_lo=float(cfg.tis_lower), tis_hi=float(cfg.tis_upper_bound), use_rs=bool(cfg.rs_band),
            rs_level=cfg.rs_level, rs_lo=float(cfg.rs_lower), rs_hi=float(cfg.rs_upper),
            log_ratio_veto=None if cfg.rs_veto_threshold is None else math.log(cfg.rs_veto_threshold),
            log_prob_veto=None if cfg.prob_veto_threshold is None else math.log(cfg.prob_veto_threshold),
            prob_veto_train=cfg.prob_veto_source == "train", reject_nonfinite=cfg.nonfinite_policy == "reject",
            normalizes=bool(cfg.normalizes), metrics=getattr(cfg, "mis_metrics", "standard"),
            rs_criteria=tuple((b.name, b.lower, b.upper) for b in cfg.rs_bounds()),
        )

    @property
    def token_is(self) -> bool:
        return self.use_tis and self.tis_level == "token"

    def criteria_of(self, reduce: str | None = None, k: int | None = None) -> tuple:
        """The ``(name, lower, upper)`` criteria whose name starts with the reduction's prefix
        (``token``, ``seq_sum``, ``seq_mean``, ``seq_max``) and ends with ``k{k}``."""
        return tuple(
            c for c in self.rs_criteria
            if (reduce is None or c[0].rsplit("_k", 1)[0] == reduce) and (k is None or c[0].endswith(f"_k{k}"))
        )
