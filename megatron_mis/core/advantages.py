"""Advantage estimators for outcome rewards (one reward per sequence), as used by the seeds'
experiments: GRPO (Let Speed Be With Stability (lmsys.org/blog/2026-01-16-training-inference-mismatch)), RLOO (Beyond Precision (arXiv:2602.01826)) and REINFORCE with a baseline.

Each sequence belongs to a group (the samples drawn for one prompt). An estimator maps the
rewards ``[N]``, the group ids ``[N]`` and a validity mask ``[N]`` to one advantage per sequence;
:meth:`AdvantageResult.token_advantages` repeats it over the sequence's tokens.

What happens to rejected, empty or broken sequences (never a silent change of the group's
statistics):

- a sequence marked invalid (``valid=False``: rejected by the MIS engine, an empty response, an
  aborted sample) or with a non-finite reward (``nonfinite_policy="neutralize"``) is *excluded*
  from its group's mean / std / leave-one-out baseline and gets advantage 0; it is counted in
  ``num_excluded_sequences`` (non-finite rewards also in ``num_nonfinite_rewards``, with a
  warning). With ``nonfinite_policy="error"`` a non-finite reward raises instead.
- a group left with fewer than two valid members has no baseline to compare with: its members
  get advantage 0 and the group is counted in ``num_degenerate_groups``. (GRPO's unbiased std of
  one sample is undefined; slime sets ``grpo_std_normalization`` off when
  ``n_samples_per_prompt == 1`` for this reason.)
- a group whose valid rewards are all equal (a *tied* group: no signal) gets advantage exactly 0
  from every estimator, and is counted in ``num_tied_groups``. Group statistics are computed in
  float64 from rewards shifted by the group's minimum, so a tie is detected exactly (its spread
  ``max - min`` is 0) and never turns into rounding noise divided by ``std + eps`` (with float32
  statistics 16 rewards of 7.7 gave +0.48 each).

Groups of size 1 (``group_size=1``, one sample per prompt) are degenerate for ``grpo`` and
``rloo`` (advantage 0 for everything, no learning signal); use ``reinforce_baseline`` there, which
compares with the batch mean. slime also gives ``r - mean = 0`` to a group of one (GRPO); verl
instead uses mean 0 and std 1 for a single-sample group, i.e. the raw reward as its advantage.

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_mis.core.segments import to_device
from megatron_mis.config.loss import ADVANTAGE_ESTIMATORS as _ADV_REGISTRY
from megatron_mis.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageResult",
    "compute_advantages",
    "compute_advantages_from_config",
    "group_ids_from_size",
    "expand_to_tokens",
]

#: An estimator maps ``(rewards [N], group [N] in 0..G-1, valid [N], num_groups, options)`` to
#: ``(advantages [N], degenerate [G] bool)``; invalid sequences must get 0.
AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

#: Defined with the config (names only there); the estimators register here.
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = _ADV_REGISTRY


@dataclass(slots=True)
class AdvantageResult:
    """Advantages of one rollout batch.

    Attributes:
        advantages: ``[N]`` float32, one per sequence (0 for excluded sequences and for the
            members of degenerate groups).
        valid: ``[N]`` bool, the sequences that entered the group statistics.
        num_excluded_sequences: sequences left out of the statistics (invalid or non-finite).
        num_nonfinite_rewards: sequences whose reward was NaN or +-inf.
        num_degenerate_groups: groups with fewer than two valid members.
        num_tied_groups: groups with two or more valid members whose valid rewards are all
            equal (advantage exactly 0, no learning signal).
    """

    advantages: torch.Tensor
    valid: torch.Tensor
    num_excluded_sequences: int
    num_nonfinite_rewards: int
    num_degenerate_groups: int
    num_tied_groups: int = 0

    def token_advantages(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``[T]``: each sequence's advantage repeated over its tokens (``cu_seqlens [N+1]``)."""
        return expand_to_tokens(self.advantages, cu_seqlens)

    def metrics(self) -> dict[str, float]:
        """Counts for logging."""
        return {
            "adv_num_excluded_sequences": float(self.num_excluded_sequences),
            "adv_num_nonfinite_rewards": float(self.num_nonfinite_rewards),
            "adv_num_degenerate_groups": float(self.num_degenerate_groups),
            "adv_num_tied_groups": float(self.num_tied_groups),
        }


def group_ids_from_size(num_sequences: int, group_size: int) -> torch.Tensor:
    """``[N]`` group ids for consecutive groups of ``group_size`` samples.

    Raises:
        ValueError: if ``group_size < 1`` or ``num_sequences`` is not a multiple of it.
    """
    if group_size < 1 or num_sequences % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be >= 1 and divide the number of sequences ({num_sequences})"
        )
    return torch.arange(num_sequences) // group_size


def expand_to_tokens(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]``: ``values [N]`` repeated over the tokens of each sequence of ``cu_seqlens [N+1]``."""
    if cu_seqlens.numel() != values.numel() + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries, expected {values.numel() + 1} (N+1)")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=values.device, dtype=torch.long)
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return torch.repeat_interleave(values, lengths)


class _GroupStats:
    """float64 statistics of the valid rewards of each group, from rewards shifted by the group's
    minimum valid reward (so a tied group has shifted rewards exactly 0).

    Attributes (``G`` groups, ``N`` sequences): ``shifted [N]`` (0 where invalid), ``count [G]``,
    ``total [G]`` (sum of shifted), ``mean [G]`` (of shifted), ``tied [G]`` (count >= 1 and
    max == min).
    """

    __slots__ = ("shifted", "count", "total", "mean", "tied")

    def __init__(self, rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int):
        r = rewards.to(torch.float64)
        inf = torch.full((num_groups,), float("inf"), dtype=torch.float64)
        lo = inf.scatter_reduce(0, group, torch.where(valid, r, torch.full_like(r, float("inf"))), "amin")
        hi = (-inf).scatter_reduce(0, group, torch.where(valid, r, torch.full_like(r, float("-inf"))), "amax")
        w = valid.to(torch.float64)
        self.count = torch.zeros(num_groups, dtype=torch.float64).index_add(0, group, w)
        has = self.count > 0
        base = torch.where(has, lo, torch.zeros_like(lo))
        self.shifted = torch.where(valid, r - base[group], torch.zeros_like(r))
        self.total = torch.zeros(num_groups, dtype=torch.float64).index_add(0, group, self.shifted)
        self.mean = torch.where(has, self.total / self.count.clamp_min(1), torch.zeros_like(self.total))
        self.tied = has & (hi == lo)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    rewards: torch.Tensor,
    group: torch.Tensor,
    valid: torch.Tensor,
    num_groups: int,
    *,
    std_normalization: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(r - mean_g) / (std_g + eps)`` with the unbiased (Bessel) std of the group's
    valid rewards, or ``r - mean_g`` without std normalisation (Dr. GRPO). float64; exactly 0
    for a tied group. Returns ``(advantages [N] float64, degenerate [G] bool)``."""
    st = _GroupStats(rewards, group, valid, num_groups)
    centred = torch.where(valid, st.shifted - st.mean[group], torch.zeros_like(st.shifted))
    degenerate = st.count < 2
    if std_normalization:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add(0, group, centred.square())
        std = torch.sqrt(sq / (st.count - 1).clamp_min(1))
        centred = centred / (std[group] + eps)
    adv = torch.where((degenerate | st.tied)[group], torch.zeros_like(centred), centred)
    return adv, degenerate


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int, **_: object):
    """RLOO: ``r_i - mean_{j != i} r_j`` over the valid members of the group (float64; exactly 0
    for a tied group). Returns ``(advantages [N] float64, degenerate [G] bool)``."""
    st = _GroupStats(rewards, group, valid, num_groups)
    degenerate = st.count < 2
    loo = (st.total[group] - st.shifted) / (st.count[group] - 1).clamp_min(1)
    keep = valid & ~(degenerate | st.tied)[group]
    adv = torch.where(keep, st.shifted - loo, torch.zeros_like(st.shifted))
    return adv, degenerate


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
def reinforce_baseline(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int, **_: object):
    """REINFORCE with a baseline: ``r - b`` with ``b`` the mean reward of the valid sequences of
    the whole batch (groups are ignored; the batch counts as one group for ``degenerate`` and a
    tie). Returns ``(advantages [N] float64, degenerate [1] bool)``."""
    whole = torch.zeros_like(group)
    st = _GroupStats(rewards, whole, valid, 1)
    degenerate = st.count < 2
    keep = valid & ~(degenerate[0] | st.tied[0])
    adv = torch.where(keep, st.shifted - st.mean[0], torch.zeros_like(st.shifted))
    return adv, degenerate


def compute_advantages(
    rewards: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    group_size: int | None = None,
    valid: torch.Tensor | None = None,
    estimator: str = "grpo",
    grpo_std_normalization: bool = True,
    grpo_std_eps: float = 1e-6,
    nonfinite_policy: Literal["neutralize", "error"] = "neutralize",
) -> AdvantageResult:
    """Per-sequence advantages (see the module docstring for invalid sequences and groups).

    Args:
        rewards: ``[N]`` one scalar reward per sequence.
        group_ids: ``[N]`` integer group of each sequence (any labels); or give ``group_size``.
        group_size: consecutive groups of this many samples (``N`` must be a multiple).
        valid: ``[N]`` bool, sequences allowed into the statistics; default all.
        estimator: a registered name (``grpo``, ``rloo``, ``reinforce_baseline``).
        grpo_std_normalization / grpo_std_eps: GRPO options.
        nonfinite_policy: ``neutralize`` (exclude and count, warn) or ``error``.

    Synchronisation: a per-step function that runs on the host (the group statistics are tiny);
    inputs on an accelerator come over in one copy (the one host synchronisation), the results
    go back pinned and non-blocking.

    Raises:
        KeyError: unknown estimator (listing the valid names).
        ValueError: shape mismatches, both or neither of ``group_ids`` / ``group_size``, or a
            non-finite reward with ``nonfinite_policy="error"``.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    for name, value, optional in (("rewards", rewards, False), ("group_ids", group_ids, True), ("valid", valid, True)):
        if not (isinstance(value, torch.Tensor) or (optional and value is None)):
            raise TypeError(
                f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(value).__name__}"
            )
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise TypeError(f"rewards must be a real-valued tensor, got dtype {rewards.dtype}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise TypeError(f"group_size must be an int >= 1, got {group_size!r} ({type(group_size).__name__})")
    if isinstance(grpo_std_eps, bool) or not isinstance(grpo_std_eps, (int, float)) or not (
        math.isfinite(grpo_std_eps) and grpo_std_eps >= 0
    ):
        raise ValueError(f"grpo_std_eps={grpo_std_eps!r} must be a finite number >= 0")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids [N] and group_size")
    if group_ids is None:
        group_ids = group_ids_from_size(n, int(group_size))
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected [{n}] (one per reward)")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool)
    if valid.shape != (n,):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected [{n}] (one per reward)")
    if nonfinite_policy not in ("neutralize", "error"):
        raise ValueError(f"nonfinite_policy={nonfinite_policy!r} must be 'neutralize' or 'error'")

    device = rewards.device
    r, valid, group_ids = _to_host(rewards, valid, group_ids)
    finite = torch.isfinite(r)
    num_nonfinite = int((~finite).sum())
    if num_nonfinite:
        bad = torch.nonzero(~finite).flatten()[:8].tolist()
        if nonfinite_policy == "error":
            raise ValueError(
                f"{num_nonfinite} non-finite reward(s) (NaN or inf) at sequence(s) {bad}"
                f"{' ...' if num_nonfinite > 8 else ''}; set nonfinite_input_policy='neutralize' to exclude them"
            )
        warnings.warn(
            f"{num_nonfinite} non-finite reward(s) at sequence(s) {bad}: excluded from their groups' "
            "statistics with advantage 0 (counted in adv_num_nonfinite_rewards)",
            RuntimeWarning,
            stacklevel=2,
        )
    used = valid & finite
    r = torch.where(finite, r, torch.zeros_like(r))
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if n else 0
    adv, degenerate = fn(r, group, used, num_groups, std_normalization=grpo_std_normalization, eps=grpo_std_eps)
    adv32 = adv.to(torch.float32)
    if not bool(torch.isfinite(adv32).all()):
        raise ValueError(
            f"rewards span {float(r[used].min()) if bool(used.any()) else 0.0!r} .. "
            f"{float(r[used].max()) if bool(used.any()) else 0.0!r}: their advantages do not fit float32 "
            "(rewards must differ within a group by less than about 3.4e38)"
        )
    stats = _GroupStats(r, group, used, num_groups)
    tied = stats.tied & (stats.count >= 2)
    return AdvantageResult(
        advantages=to_device(adv32, device),
        valid=to_device(used, device),
        num_excluded_sequences=int((~used).sum()),
        num_nonfinite_rewards=num_nonfinite,
        num_degenerate_groups=int(degenerate.sum()),
        num_tied_groups=int(tied.sum()),
    )


def _to_host(rewards: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards float64, valid bool, group ids int64)`` on the host: device data comes over in
    ONE copy (the three as the rows of an ``[3, N]`` int64 block, the rewards bit for bit through
    an int64 view) — the documented synchronisation of this per-step function; host data costs
    none."""
    r = rewards.detach().to(torch.float64)
    if all(t.device.type == "cpu" for t in (r, valid, group_ids)):
        return r, valid.detach().bool(), group_ids.detach().long()
    device = next(t.device for t in (r, valid, group_ids) if t.device.type != "cpu")
    parts = [x if x.device == device else to_device(x, device) for x in (r.view(torch.int64), valid.detach().long(), group_ids.detach().long())]
    host = torch.stack(parts).cpu()  # the one read
    return host[0].view(torch.float64), host[1].bool(), host[2]


def compute_advantages_from_config(rewards: torch.Tensor, config, **kwargs) -> AdvantageResult:
    """:func:`compute_advantages` with the estimator options of a
    :class:`megatron_mis.config.loss.LossConfig`."""
    return compute_advantages(
        rewards,
        estimator=config.advantage_estimator,
        grpo_std_normalization=config.grpo_std_normalization,
        grpo_std_eps=config.grpo_std_eps,
        nonfinite_policy=config.nonfinite_input_policy,
        **kwargs,
    )
