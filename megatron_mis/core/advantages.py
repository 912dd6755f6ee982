"""Advantage estimators for outcome rewards (one reward per sequence), as used by the seeds'
experiments: GRPO (seed 000), RLOO (seed 002) and REINFORCE with a baseline.

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
- a group whose valid rewards are all equal gets advantage 0 (GRPO divides 0 by ``std + eps``).

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

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

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


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
    """

    advantages: torch.Tensor
    valid: torch.Tensor
    num_excluded_sequences: int
    num_nonfinite_rewards: int
    num_degenerate_groups: int

    def token_advantages(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``[T]``: each sequence's advantage repeated over its tokens (``cu_seqlens [N+1]``)."""
        return expand_to_tokens(self.advantages, cu_seqlens)

    def metrics(self) -> dict[str, float]:
        """Counts for logging."""
        return {
            "adv_num_excluded_sequences": float(self.num_excluded_sequences),
            "adv_num_nonfinite_rewards": float(self.num_nonfinite_rewards),
            "adv_num_degenerate_groups": float(self.num_degenerate_groups),
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


def _group_stats(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int):
    w = valid.to(rewards.dtype)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, group, w)
    total = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, group, r)
    mean = torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
    return count, total, mean


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
    valid rewards, or ``r - mean_g`` without std normalisation (Dr. GRPO)."""
    count, _, mean = _group_stats(rewards, group, valid, num_groups)
    centred = torch.where(valid, rewards - mean[group], torch.zeros_like(rewards))
    degenerate = count < 2
    if std_normalization:
        sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, group, centred.square())
        std = torch.sqrt(sq / (count - 1).clamp_min(1))
        centred = centred / (std[group] + eps)
    adv = torch.where(degenerate[group], torch.zeros_like(centred), centred)
    return adv, degenerate


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int, **_: object):
    """RLOO: ``r_i - mean_{j != i} r_j`` over the valid members of the group."""
    count, total, _ = _group_stats(rewards, group, valid, num_groups)
    degenerate = count < 2
    loo = (total[group] - torch.where(valid, rewards, torch.zeros_like(rewards))) / (count[group] - 1).clamp_min(1)
    adv = torch.where(valid & ~degenerate[group], rewards - loo, torch.zeros_like(rewards))
    return adv, degenerate


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline")
def reinforce_baseline(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int, **_: object):
    """REINFORCE with a baseline: ``r - b`` with ``b`` the mean reward of the valid sequences of
    the whole batch (groups are ignored; the batch counts as one group for ``degenerate``)."""
    whole = torch.zeros_like(group)
    count, _, mean = _group_stats(rewards, whole, valid, 1)
    degenerate = count < 2
    adv = torch.where(valid & ~degenerate[0], rewards - mean[0], torch.zeros_like(rewards))
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

    Raises:
        KeyError: unknown estimator (listing the valid names).
        ValueError: shape mismatches, both or neither of ``group_ids`` / ``group_size``, or a
            non-finite reward with ``nonfinite_policy="error"``.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
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
    r = rewards.detach().to(torch.float32).cpu()
    valid = valid.detach().bool().cpu()
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
    _, group = torch.unique(group_ids.detach().cpu(), return_inverse=True)
    num_groups = int(group.max()) + 1 if n else 0
    adv, degenerate = fn(r, group, used, num_groups, std_normalization=grpo_std_normalization, eps=grpo_std_eps)
    assert bool(torch.isfinite(adv).all()), "advantage estimator produced a non-finite value"
    return AdvantageResult(
        advantages=adv.to(device),
        valid=used.to(device),
        num_excluded_sequences=int((~used).sum()),
        num_nonfinite_rewards=num_nonfinite,
        num_degenerate_groups=int(degenerate.sum()),
    )


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
