"""Policy losses with training-inference mismatch correction, and the assembly of the full RL
loss (policy term, OPSM, KL to a reference, entropy bonus) for one micro-batch.

Three policies meet in the loss (Let Speed Be With Stability (lmsys.org/blog/2026-01-16-training-inference-mismatch)): the target pi_theta (being trained, with grad), the
proximal pi_old (the trainer's recomputed log-probs at the start of the step) and the behaviour
pi_rollout (the rollout engine's log-probs). The registered policy losses (all per token, with
``r = pi_theta / pi_old``, ``A`` the advantage, ``eps_low = eps_clip``, ``eps_high =
eps_clip_high``):

- ``ppo``: standard PPO, ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``; pi_old is the trainer's
  policy and the mismatch to pi_rollout is silently ignored (the uncorrected baseline).
- ``decoupled_ppo``: 3-policy PPO, ``-w * min(r A, clip(r) A)`` with ``w = pi_old / pi_rollout``
  from the MIS engine (detached, after truncation / rejection / self-normalisation).
- ``bypass_ppo``: pi_old := pi_rollout, so ``r = pi_theta / pi_rollout`` and there is *no* extra
  IS factor (multiplying by ``w`` as well would count the correction twice). The engine's
  ``keep_mask`` still applies: rejection sampling, mask-mode IS, the veto and non-finite
  rejection remove tokens / sequences exactly as in the decoupled loss, so RS works in bypass
  mode too; the engine's weights are not used.
- ``reinforce``: policy gradient ``-w * A * log pi_theta`` with ``w`` from the engine against the
  rollout policy (no clipping).
- ``gspo`` (GSPO, arXiv:2507.18071; slime ``--advantage-estimator gspo``): the PPO clipped
  objective on the *sequence* ratio ``s_i = exp(mean_t (log pi_theta - log pi_old))`` over the
  sequence's valid tokens, in the paper's token form ``s_{i,t} = sg[s_i] * pi_theta(t) /
  sg[pi_theta(t)]`` (value ``s_i`` on every token, gradient ``s_i * d log pi_theta(t)``), times
  the engine's ``w``. The per-sequence sums come from :func:`sequence_ratio_stats`; under
  context parallelism they are summed over the CP group (``cp_sum``) before the ratio is formed.
- ``cispo`` (CISPO, MiniMax-M1 arXiv:2506.13585 Eq. 4-5; slime ``--advantage-estimator
  cispo``): ``-w * sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi_theta``: the IS ratio is
  clipped under stop-gradient, so every token keeps its gradient through ``log pi_theta``.

Dual-clip (``eps_clip_c = c > 1``): for ``A < 0`` the per-token PPO loss is capped at ``-c A``.

Each policy loss is a :class:`PolicyLoss` in the :data:`POLICY_LOSSES` registry; the IS weights
and keep mask are *inputs* (``MISResult.weights`` / ``.keep_mask`` of
:func:`megatron_mis.core.engine.compute_mis`), so nothing here depends on the engine's internals.

:func:`compute_rl_loss` assembles one micro-batch's share of the step loss with global
denominators (:mod:`megatron_mis.core.aggregation`), and returns metrics as shares, token sums
and counts that add up over micro-batches and ranks (:func:`finalize_metrics`).

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_mis.config.loss import POLICY_LOSSES as _POLICY_REGISTRY
from megatron_mis.config.loss import LossConfig
from megatron_mis.core.checks import reads_values
from megatron_mis.core.aggregation import Denominators, aggregate, denominator_mask, segment_ids, segment_sum
from megatron_mis.core.kl import kl_estimate
from megatron_mis.registry import Registry

__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossTerms",
    "RLLossOutput",
    "compute_rl_loss",
    "finalize_metrics",
    "opsm_keep_mask",
    "opsm_sequence_stats",
    "ppo_clip_terms",
    "sequence_log_ratio",
    "sequence_ratio_stats",
]


@dataclass(slots=True)
class PolicyLossTerms:
    """Per-token outputs of a policy loss (all ``[T]``).

    Attributes:
        loss: per-token loss (differentiable in pi_theta), before any mask.
        ratio: detached ``pi_theta / pi_old`` of this loss's old policy.
        clipped_low: the clipped branch was taken with ``r < 1 - eps_low``.
        clipped_high: the clipped branch was taken with ``r > 1 + eps_high``.
        dual_clipped: the dual-clip cap ``-c A`` was taken.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor

    @property
    def clipped(self) -> torch.Tensor:
        """``[T]`` bool: the PPO clip was active."""
        return self.clipped_low | self.clipped_high


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A registered policy loss.

    Attributes:
        name: registry name.
        old_policy: which log-probs play pi_old in the ratio: ``"old"`` (the trainer's pi_old,
            or pi_theta detached when none is given), ``"rollout"`` (bypass) or ``"none"``.
        uses_is_weights: multiplies by the engine's IS weights (which must then be given).
        fn: ``fn(log_probs, old_log_probs, advantages, is_weights, config) -> PolicyLossTerms``
            with ``old_log_probs`` already resolved per ``old_policy`` (all ``[T]``); a
            ``sequence_ratio`` loss also gets ``seq_log_ratio=`` ``[T]``.
        description: one line for docs and error messages.
        sequence_ratio: the ratio is per sequence (GSPO): ``fn`` receives ``seq_log_ratio``
            ``[T]``, each token's sequence mean of ``log pi_theta - log pi_old`` over the
            sequence's valid tokens (detached, CP-summed when ``cp_sum`` is given; limited to
            ``2 * ratio_log_bound``).
        log_prob_term: the per-token term is ``weight * A * log pi_theta`` (REINFORCE-type: its
            size depends on ``log pi_theta``), not ``ratio * weight * A``; for overflow messages.
    """

    name: str
    old_policy: Literal["old", "rollout", "none"]
    uses_is_weights: bool
    fn: Callable[..., PolicyLossTerms]
    description: str
    sequence_ratio: bool = False
    log_prob_term: bool = False


#: Defined with the config (names only there); the policy losses register here.
POLICY_LOSSES: Registry[PolicyLoss] = _POLICY_REGISTRY


def ppo_clip_terms(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    eps_c: float | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate loss per token, with asymmetric clipping and optional dual-clip.

    ``loss = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``; with ``eps_c = c``:
    ``loss = min(loss, -c A)`` where ``A < 0``.

    Args:
        log_ratio: ``[T]`` ``log pi_theta - log pi_old`` (with grad; already clamped).
        advantages: ``[T]``.
        eps_low, eps_high: clip ranges.
        eps_c: dual-clip constant (> 1) or ``None``.
    """
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype)
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    r = ratio.detach()
    clipped_low = took_clip & (r < 1.0 - eps_low)
    clipped_high = took_clip & (r > 1.0 + eps_high)
    dual = torch.zeros_like(took_clip)
    if eps_c is not None:
        cap = -eps_c * adv
        negative = adv < 0
        dual = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return PolicyLossTerms(loss=loss, ratio=r, clipped_low=clipped_low, clipped_high=clipped_high, dual_clipped=dual)


def _log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, bound: float) -> torch.Tensor:
    return (log_probs - old_log_probs.detach()).clamp(-bound, bound)


def _ppo(log_probs, old_log_probs, advantages, is_weights, config: LossConfig) -> PolicyLossTerms:
    return ppo_clip_terms(
        _log_ratio(log_probs, old_log_probs, config.ratio_log_bound),
        advantages,
        config.eps_clip,
        config.eps_high,
        config.eps_clip_c,
    )


def _decoupled_ppo(log_probs, old_log_probs, advantages, is_weights, config: LossConfig) -> PolicyLossTerms:
    terms = _ppo(log_probs, old_log_probs, advantages, None, config)
    terms.loss = is_weights.detach().to(terms.loss.dtype) * terms.loss
    return terms


def _reinforce(log_probs, old_log_probs, advantages, is_weights, config: LossConfig) -> PolicyLossTerms:
    w = is_weights.detach().to(log_probs.dtype)
    loss = -w * advantages.to(log_probs.dtype) * log_probs
    no = torch.zeros_like(log_probs, dtype=torch.bool)
    ratio = torch.exp(_log_ratio(log_probs, old_log_probs, config.ratio_log_bound)).detach()
    return PolicyLossTerms(loss=loss, ratio=ratio, clipped_low=no, clipped_high=no, dual_clipped=no)


def _gspo(log_probs, old_log_probs, advantages, is_weights, config: LossConfig, *, seq_log_ratio) -> PolicyLossTerms:
    """GSPO in the paper's token form (arXiv:2507.18071, GSPO-token):
    ``log s_{i,t} = sg[log s_i] + log pi_theta(t) - sg[log pi_theta(t)]``, so the value on every
    token is the sequence ratio ``s_i`` and ``d s_{i,t} / d log pi_theta(t) = s_i``; a sequence
    whose mean log-ratio lies outside ``[-ratio_log_bound, ratio_log_bound]`` gets the clamped
    ratio and no gradient (as a clamp does everywhere else). Then PPO's clipped objective (with
    the dual clip when ``eps_clip_c`` is set, as slime) times the engine's weights."""
    b = config.ratio_log_bound
    seq = seq_log_ratio.to(log_probs.dtype)
    inside = seq.abs() <= b
    log_ratio = torch.where(inside, seq + (log_probs - log_probs.detach()), seq.clamp(-b, b))
    terms = ppo_clip_terms(log_ratio, advantages, config.eps_clip, config.eps_high, config.eps_clip_c)
    terms.loss = is_weights.detach().to(terms.loss.dtype) * terms.loss
    return terms


def _cispo(log_probs, old_log_probs, advantages, is_weights, config: LossConfig) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, arXiv:2506.13585 Eq. 4-5; slime ``compute_cispo_loss``):
    ``-w * sg(clip(r, 1 - eps_clip, 1 + eps_high)) * A * log pi_theta``; ``eps_clip = 1`` is the
    paper's no-lower-bound form. Every token keeps the gradient ``-w * clip(r) * A``."""
    r = torch.exp(_log_ratio(log_probs, old_log_probs, config.ratio_log_bound)).detach()
    lo, hi = 1.0 - config.eps_clip, 1.0 + config.eps_high
    weight = is_weights.detach().to(log_probs.dtype) * r.clamp(lo, hi)
    loss = -(weight * advantages.to(log_probs.dtype)) * log_probs
    no = torch.zeros_like(r, dtype=torch.bool)
    return PolicyLossTerms(loss=loss, ratio=r, clipped_low=r < lo, clipped_high=r > hi, dual_clipped=no)


for _entry in (
    PolicyLoss("ppo", "old", False, _ppo, "standard PPO against pi_old; no mismatch correction"),
    PolicyLoss(
        "decoupled_ppo", "old", True, _decoupled_ppo,
        "3-policy PPO: (pi_old/pi_rollout) x clipped objective in pi_theta/pi_old",
    ),
    PolicyLoss("bypass_ppo", "rollout", False, _ppo, "PPO with pi_rollout as pi_old; no extra IS factor"),
    PolicyLoss("reinforce", "none", True, _reinforce, "-w x A x log pi_theta with w = pi_old/pi_rollout", log_prob_term=True),
    PolicyLoss(
        "gspo", "old", True, _gspo,
        "GSPO: w x clipped objective in the sequence ratio exp(mean log(pi_theta/pi_old))", sequence_ratio=True,
    ),
    PolicyLoss(
        "cispo", "old", True, _cispo,
        "CISPO: -w x sg(clip(pi_theta/pi_old)) x A x log pi_theta", log_prob_term=True,
    ),
):
    POLICY_LOSSES.register(_entry.name, _entry)
del _entry


# ------------------------------------------------------------------------------------------ OPSM
def opsm_sequence_stats(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of ``log pi_old - log pi_theta`` over ``mask`` and the token counts.

    Under context parallelism sum both outputs over the CP group before
    :func:`opsm_keep_mask` (a sequence's mean needs all its tokens).

    Args:
        log_probs: ``[T]`` log pi_theta (detached here).
        old_log_probs: ``[T]`` log pi_old.
        mask: ``[T]`` tokens that enter the mean.
        cu_seqlens: ``[N+1]``.

    Returns:
        ``(sums [N], counts [N])`` float32.
    """
    m = mask.bool()
    diff = (old_log_probs.detach().float() - log_probs.detach().float())
    diff = torch.where(m, diff, torch.zeros_like(diff))
    return segment_sum(diff, cu_seqlens), segment_sum(m.float(), cu_seqlens)


def opsm_keep_mask(
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_log_ratio_sums: torch.Tensor,
    seq_token_counts: torch.Tensor,
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking (DeepSeek-V3.2).

    A sequence is *off-policy* when ``mean_t log(pi_old/pi_theta) > delta`` over its tokens; the
    decision is taken once per sequence from the (CP-reduced) sums and counts. In an off-policy
    sequence the tokens with a negative advantage are dropped (``M_{i,t} = 0`` iff ``A_{i,t} < 0``
    and the sequence is off-policy); with one advantage per sequence (GRPO, RLOO) that drops the
    whole sequence.

    Args:
        advantages: ``[T]``.
        cu_seqlens: ``[N+1]``.
        seq_log_ratio_sums: ``[N]`` sums of ``log pi_old - log pi_theta`` (from
            :func:`opsm_sequence_stats`, summed over CP ranks).
        seq_token_counts: ``[N]`` the matching token counts.
        delta: threshold.

    Returns:
        ``(keep [T] bool, off_policy [N] bool)``.
    """
    n = cu_seqlens.numel() - 1
    if seq_log_ratio_sums.shape != (n,) or seq_token_counts.shape != (n,):
        raise ValueError(
            f"OPSM statistics must have shape [{n}] (one per sequence), got "
            f"{tuple(seq_log_ratio_sums.shape)} and {tuple(seq_token_counts.shape)}"
        )
    counts = seq_token_counts.float()
    mean = torch.where(counts > 0, seq_log_ratio_sums.float() / counts.clamp_min(1), torch.zeros_like(counts))
    off_policy = (counts > 0) & (mean > delta)
    seq = segment_ids(cu_seqlens, advantages.device, num_tokens=int(advantages.shape[0]))
    drop = off_policy.to(advantages.device)[seq] & (advantages < 0)
    return ~drop, off_policy


# ------------------------------------------------------------------------ GSPO sequence ratio
#: Columns of :func:`sequence_ratio_stats`.
SEQ_STAT_COLUMNS = ("log_ratio_sum", "num_tokens", "num_positive_adv", "num_negative_adv")


def sequence_ratio_stats(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """GSPO's per-sequence statistics of the tokens in this call, ``[N, 4]`` float64: the sum over
    ``mask`` of ``log pi_theta - log pi_old``, the number of ``mask`` tokens, and how many of
    them have ``A > 0`` / ``A < 0`` (:data:`SEQ_STAT_COLUMNS`; the last two decide the
    sequence-level clip fractions).

    Every column is a sum over tokens, so under context parallelism the SUM of the ranks' outputs
    over the CP group describes the whole sequences (one all-reduce of ``[N, 4]``, detached: no
    gradient crosses ranks).

    Args:
        log_probs: ``[T]`` log pi_theta (detached here).
        old_log_probs: ``[T]`` log pi_old.
        advantages: ``[T]``.
        mask: ``[T]`` the tokens of the sequence ratio (the policy term's valid tokens).
        cu_seqlens: ``[N+1]``.
    """
    m = mask.bool()
    f64 = torch.float64
    diff = log_probs.detach().to(f64) - old_log_probs.detach().to(f64)
    cols = torch.stack(
        [
            torch.where(m, diff, torch.zeros((), dtype=f64, device=diff.device)),
            m.to(f64),
            (m & (advantages > 0)).to(f64),
            (m & (advantages < 0)).to(f64),
        ],
        1,
    )
    return segment_sum(cols, cu_seqlens)


def sequence_log_ratio(stats: torch.Tensor) -> torch.Tensor:
    """``[N]`` float64: each sequence's mean ``log pi_theta - log pi_old`` from
    :func:`sequence_ratio_stats` ``[N, 4]`` (CP-summed); 0 for a sequence without tokens."""
    sums, counts = stats[:, 0], stats[:, 1]
    return torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.zeros_like(sums))


def _sequence_statistics(policy, lp, old, adv, lmask, finite, valid, cu_seqlens, config: LossConfig, opsm_seq_stats, cp_sum):
    """``(gspo_stats [N, 4] | None, opsm_seq_stats)``: GSPO's statistics over the valid tokens and,
    with OPSM under context parallelism (``cp_sum`` given and no precomputed statistics), OPSM's
    over the finite loss tokens — summed over the CP group by ONE ``cp_sum`` call."""
    parts = []
    if policy.sequence_ratio:
        parts.append(sequence_ratio_stats(lp, old, adv, valid, cu_seqlens))
    opsm_here = config.use_opsm and opsm_seq_stats is None and cp_sum is not None
    if opsm_here:
        sums, counts = opsm_sequence_stats(lp, old, lmask & finite, cu_seqlens)
        parts.append(torch.stack([sums, counts], 1).to(torch.float64))
    if not parts:
        return None, opsm_seq_stats
    stacked = torch.cat(parts, 1)
    if cp_sum is not None:
        stacked = cp_sum(stacked)
        if not isinstance(stacked, torch.Tensor) or stacked.shape != (cu_seqlens.numel() - 1, sum(p.shape[1] for p in parts)):
            raise ValueError(
                f"cp_sum must return the summed [N, k] tensor it was given (N={cu_seqlens.numel() - 1}), got "
                f"{type(stacked).__name__} {tuple(getattr(stacked, 'shape', ()))}"
            )
    gspo = stacked[:, :4] if policy.sequence_ratio else None
    if opsm_here:
        opsm_seq_stats = (stacked[:, -2].float(), stacked[:, -1].float())
    return gspo, opsm_seq_stats


def _sequence_clip_counts(stats: torch.Tensor, dtype: torch.dtype, config: LossConfig) -> dict[str, torch.Tensor]:
    """Sequence-level clip counts of a sequence-ratio loss: sequences with a ratio in the loss,
    and those whose clipped branch was taken by at least one token (``s < 1 - eps_low`` with a
    token of negative advantage, ``s > 1 + eps_high`` with one of positive advantage). The ratio
    is formed exactly as the loss forms it, so the decision matches the token flags."""
    b = config.ratio_log_bound
    s = torch.exp(sequence_log_ratio(stats).clamp(-2 * b, 2 * b).to(dtype).clamp(-b, b))
    has = stats[:, 1] > 0
    low = has & (stats[:, 3] > 0) & (s < 1.0 - config.eps_clip)
    high = has & (stats[:, 2] > 0) & (s > 1.0 + config.eps_high)
    return {
        "num_seq_ratio_sequences": has.sum().float(),
        "num_seq_clipped_low": low.sum().float(),
        "num_seq_clipped_high": high.sum().float(),
    }


# ------------------------------------------------------------------------------- full RL loss
@dataclass(slots=True)
class RLLossOutput:
    """One micro-batch's share of the RL loss and its metrics.

    Attributes:
        loss: 0-dim, differentiable: this micro-batch's share of the step loss (shares of all
            micro-batches and ranks sum to the step loss).
        shares: detached 0-dim shares of ``loss``, ``pg_loss``, ``kl_loss``, ``entropy_loss``
            (sum over micro-batches and ranks = global value).
        token_sums: detached sums over this micro-batch's valid tokens (``pg_clipfrac``,
            ``pg_clipfrac_low``, ``pg_clipfrac_high``, ``pg_dualclip_frac``, ``ppo_kl``,
            ``ratio``, ``is_weight``, ``entropy``, ``kl``); the global mean is the global sum
            over ``counts["num_valid_tokens"]`` (see :func:`finalize_metrics`).
        counts: local counts (float 0-dim tensors): ``num_loss_tokens``, ``num_valid_tokens``,
            ``num_rejected_tokens``, ``num_nonfinite_inputs``, ``num_opsm_tokens``,
            ``num_opsm_sequences``, ``num_denominator_tokens``, ``num_denominator_sequences``;
            sequence-ratio losses add ``num_seq_ratio_sequences``, ``num_seq_clipped_low``,
            ``num_seq_clipped_high``.
        pg_mask: ``[T]`` bool, the tokens in the policy-gradient numerator.
        valid_mask: ``[T]`` bool, loss tokens that were kept and finite (KL / entropy numerator).
    """

    loss: torch.Tensor
    shares: dict[str, torch.Tensor]
    token_sums: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]
    pg_mask: torch.Tensor
    valid_mask: torch.Tensor
    terms: PolicyLossTerms | None = field(default=None, repr=False)

    def flat_metrics(self) -> dict[str, torch.Tensor]:
        """``{"share/NAME" | "sum/NAME" | "count/NAME": 0-dim}``: what a loss function hands back
        per micro-batch; add these up over micro-batches and ranks, then :func:`finalize_metrics`."""
        out = {f"share/{k}": v for k, v in self.shares.items()}
        out.update({f"sum/{k}": v for k, v in self.token_sums.items()})
        out.update({f"count/{k}": v for k, v in self.counts.items()})
        return out


def finalize_metrics(summed: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Turn summed :meth:`RLLossOutput.flat_metrics` (over every micro-batch and rank) into the
    step's metrics: shares as they are, token sums divided by the global ``num_valid_tokens``
    (0 when there is none), counts as they are; with a sequence-ratio loss (``gspo``) also the
    sequence-level clip fractions ``pg_seq_clipfrac``, ``pg_seq_clipfrac_low`` and
    ``pg_seq_clipfrac_high`` (clipped sequences over ``num_seq_ratio_sequences``, 0 when none)."""
    out: dict[str, float] = {}
    valid = float(summed.get("count/num_valid_tokens", 0.0))
    for key, value in summed.items():
        kind, _, name = key.partition("/")
        v = float(value)
        if kind == "sum":
            out[name] = v / valid if valid > 0 else 0.0
        elif kind in ("share", "count"):
            out[name] = v
        else:
            raise ValueError(f"metric key {key!r} has no 'share/', 'sum/' or 'count/' prefix")
    if "num_seq_ratio_sequences" in out:
        n = out["num_seq_ratio_sequences"]
        low, high = out.get("num_seq_clipped_low", 0.0), out.get("num_seq_clipped_high", 0.0)
        for name, v in (("pg_seq_clipfrac", low + high), ("pg_seq_clipfrac_low", low), ("pg_seq_clipfrac_high", high)):
            out[name] = v / n if n > 0 else 0.0
    return out


def _check_1d(name: str, t: torch.Tensor | None, n: int) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{n}] (one value per token, like log_probs)")


def _check_loss_inputs(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: LossConfig,
    denominators: Denominators,
    old_log_probs: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    keep_mask: torch.Tensor | None,
):
    """Types, shapes and the inputs the configured terms need; returns the policy-loss entry.

    Raises:
        TypeError / ValueError: naming the argument, the value and what is allowed.
    """
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    if not isinstance(denominators, Denominators):
        raise TypeError(
            f"denominators must be a Denominators(num_tokens, num_sequences), got {type(denominators).__name__} "
            f"{denominators!r:.80}"
        )
    if not isinstance(log_probs, torch.Tensor):
        raise TypeError(f"log_probs must be a torch.Tensor, got {type(log_probs).__name__}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        got = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise TypeError(f"cu_seqlens must be an integer torch.Tensor [N+1], got {got} {cu_seqlens!r:.80}")
    policy = POLICY_LOSSES.get(config.policy_loss)
    if log_probs.dim() != 1:
        raise ValueError(f"log_probs must be 1-D [T], got shape {tuple(log_probs.shape)}")
    n = log_probs.shape[0]
    for name, t in (
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("old_log_probs", old_log_probs),
        ("rollout_log_probs", rollout_log_probs),
        ("ref_log_probs", ref_log_probs),
        ("entropy", entropy),
        ("is_weights", is_weights),
        ("keep_mask", keep_mask),
    ):
        _check_1d(name, t, n)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or (
        reads_values(cu_seqlens) and (int(cu_seqlens[-1]) != n or int(cu_seqlens[0]) != 0)
    ):  # offsets on an accelerator are trusted: reading them would synchronise
        raise ValueError(
            f"cu_seqlens must be [N+1] from 0 to the number of tokens ({n}), got {cu_seqlens.tolist()[:8]}"
        )
    if policy.old_policy == "rollout" and rollout_log_probs is None:
        raise ValueError(f"policy_loss={policy.name!r} needs rollout_log_probs (they play pi_old)")
    if policy.uses_is_weights and is_weights is None:
        raise ValueError(
            f"policy_loss={policy.name!r} needs is_weights (pi_old/pi_rollout, MISResult.weights); "
            "pass torch.ones_like(log_probs) to train without IS"
        )
    if not policy.uses_is_weights and is_weights is not None:
        why = (
            "its ratio pi_theta/pi_rollout already is the IS ratio (weights would count it twice)"
            if policy.old_policy == "rollout"
            else "it is the uncorrected baseline (use decoupled_ppo to apply IS weights)"
        )
        raise ValueError(f"policy_loss={policy.name!r} takes no is_weights: {why}")
    if config.kl_active and ref_log_probs is None:
        raise ValueError("the KL term is on (use_kl_loss, kl_loss_coef > 0) but ref_log_probs is None")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef!r} > 0 but entropy is None")

    return policy


def _screen_nonfinite(inputs: dict[str, torch.Tensor], lmask: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite [T], bad [T])``: tokens whose every input is finite, and loss tokens with a
    non-finite input — an error under ``nonfinite_input_policy="error"``, else a warning (they
    are dropped from the loss and counted).

    Raises:
        ValueError: a non-finite input on a loss token under the ``error`` policy.
    """
    finite = torch.ones_like(lmask)
    for t in inputs.values():
        finite &= torch.isfinite(t)
    bad = lmask & ~finite
    if config.nonfinite_input_policy != "error" and not reads_values(bad):
        # on an accelerator the tokens are dropped and counted (num_nonfinite_inputs) without a
        # read; the warning needs the count, so it is left to the host that reads the metrics
        return finite, bad
    num_bad = int(bad.sum())  # host data, the debug flag, or the opt-in "error" policy: one read
    if num_bad:
        detail = ", ".join(
            f"{k}: {int((lmask & ~torch.isfinite(t)).sum())}" for k, t in inputs.items() if bool((lmask & ~torch.isfinite(t)).any())
        )
        if config.nonfinite_input_policy == "error":
            raise ValueError(
                f"{num_bad} loss token(s) with a non-finite input ({detail}); "
                "set nonfinite_input_policy='neutralize' to drop them"
            )
        warnings.warn(
            f"{num_bad} loss token(s) with a non-finite input ({detail}) dropped from the loss "
            "(counted in num_nonfinite_inputs)",
            RuntimeWarning,
            stacklevel=3,
        )
    return finite, bad


def _finite_or_zero(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in ``dtype`` with non-finite entries 0 (``torch.where`` keeps the gradient of the
    finite ones)."""
    if t is None:
        return None
    t = t.to(dtype)
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype, device=t.device))


def _policy_term(policy, lp, old, adv, weights, valid, config: LossConfig, seq_log_ratio=None) -> PolicyLossTerms:
    """The per-token policy-loss terms (checked for overflow by :func:`_check_finite_loss`)."""
    # Tokens outside ``valid`` get advantage 0 and weight 0 in the policy term: torch.where below
    # would drop their value, but a huge advantage there still makes 0 * inf = NaN in the backward.
    nil = torch.zeros((), dtype=lp.dtype, device=lp.device)
    extra = {"seq_log_ratio": seq_log_ratio} if policy.sequence_ratio else {}
    return policy.fn(
        lp, old, torch.where(valid, adv, nil), None if weights is None else torch.where(valid, weights, nil), config, **extra
    )


def _check_finite_loss(policy, terms: PolicyLossTerms, lp, adv, weights, valid, shares: dict, config: LossConfig) -> None:
    """One host read (host tensors, or the debug flag ``MEGATRON_MIS_DEBUG_CHECKS=1``; skipped
    on an accelerator): every per-token policy term, every aggregated loss and the gradient's
    ``IS weight * A`` factor must be finite.

    The last one: the backward of ``IS weight * ratio * A`` forms ``IS weight * A`` (times the
    aggregation's ``1 / n``) before it multiplies by the ratio, so a ratio far below 1 can leave
    the loss finite while its gradient overflows to inf.

    Raises:
        ValueError: a per-token term beyond the float range (ratio * IS weight * A, or for
            REINFORCE-type losses IS weight * A * log pi), an IS weight * A beyond it, or finite
            terms whose aggregate is not (naming the advantages, the IS weights and what to
            change).
    """
    if not reads_values(valid):  # an accelerator: the check reads values (debug flag: MEGATRON_MIS_DEBUG_CHECKS=1)
        return
    overflow = valid & ~torch.isfinite(terms.loss.detach())
    # adv and weights are finite here (non-finite inputs are zeroed), so only the product can be inf
    reads_weights = weights is not None and policy.uses_is_weights
    grad_overflow = valid & ~torch.isfinite(adv * weights) if reads_weights else torch.zeros_like(valid)
    totals = torch.stack([v.detach().reshape(()).to(torch.float64) for v in shares.values()])
    if not bool(overflow.any() | grad_overflow.any() | ~torch.isfinite(totals).all()):
        return
    dtype = terms.loss.dtype
    any_valid = bool(valid.any())
    biggest = float(adv[valid].abs().max()) if any_valid else 0.0
    heaviest = "" if weights is None or not any_valid else f", IS weights reach {float(weights[valid].abs().max()):.3g}"
    if not bool(overflow.any()) and bool(grad_overflow.any()):
        raise ValueError(
            f"policy loss gradient overflows {dtype} on {int(grad_overflow.sum())} token(s): advantages reach "
            f"|A| = {biggest:.3g}{heaviest}, and IS weight * A exceeds the float range (the loss is finite only "
            "because the ratio is small there; its gradient passes through IS weight * A); normalise the "
            "advantages or bound the IS weights"
        )
    if bool(overflow.any()):
        if policy.old_policy == "none" or policy.log_prob_term:  # the term is IS weight * A * log pi_theta
            largest_lp = float(lp.detach()[overflow].abs().max())
            factor = "" if policy.old_policy == "none" else f" * clipped ratio (at most 1 + eps_clip_high = {1 + config.eps_high:g})"
            raise ValueError(
                f"policy loss overflows {dtype} on {int(overflow.sum())} token(s): advantages reach |A| = {biggest:.3g}"
                f"{heaviest}, and log_probs reach |log pi_theta| = {largest_lp:.3g} there, so IS weight{factor} * A * "
                "log pi_theta exceeds the float range; normalise the advantages, bound the IS weights, and check "
                "the log_probs (a log-probability is <= 0)"
            )
        raise ValueError(
            f"policy loss overflows {dtype} on {int(overflow.sum())} token(s): advantages reach |A| = {biggest:.3g}"
            f"{heaviest}, and ratio * IS weight * A exceeds the float range (ratio up to exp(ratio_log_bound="
            f"{config.ratio_log_bound}) = {math.exp(config.ratio_log_bound):.3g}); normalise the advantages, "
            "bound the IS weights or lower ratio_log_bound"
        )
    names = [name for name, ok in zip(shares, torch.isfinite(totals).tolist()) if not ok]
    verb = "is" if len(names) == 1 else "are"
    raise ValueError(
        f"the loss overflows {dtype} when aggregated (loss_aggregation={config.loss_aggregation!r}): every "
        f"per-token term is finite but {', '.join(names)} {verb} not; advantages reach |A| = {biggest:.3g}"
        f"{heaviest}; normalise the advantages or bound the IS weights"
    )


def _opsm_policy_mask(adv, lp, old, lmask, finite, valid, cu_seqlens, config: LossConfig, opsm_seq_stats):
    """``(pg_mask, num_opsm_tokens, num_opsm_sequences)``: the policy term's tokens after
    off-policy sequence masking (``valid`` when OPSM is off)."""
    pg_mask = valid
    num_opsm_tokens = torch.zeros((), dtype=torch.float32, device=lp.device)
    num_opsm_sequences = torch.zeros((), dtype=torch.float32, device=lp.device)
    if config.use_opsm:
        if opsm_seq_stats is None:
            opsm_seq_stats = opsm_sequence_stats(lp, old, lmask & finite, cu_seqlens)
        opsm_keep, off_policy = opsm_keep_mask(adv, cu_seqlens, *opsm_seq_stats, delta=config.opsm_delta)
        dropped = (valid & ~opsm_keep).float()
        num_opsm_tokens = dropped.sum()
        # sequences with a dropped token: a per-sequence sum, no boolean index (no synchronisation)
        num_opsm_sequences = (segment_sum(dropped, cu_seqlens) > 0).sum().float()
        pg_mask = valid & opsm_keep

    return pg_mask, num_opsm_tokens, num_opsm_sequences


def _token_sums(terms: PolicyLossTerms, valid, old, lp, weights, ent, kl_values, config: LossConfig) -> dict[str, torch.Tensor]:
    """Sums over this micro-batch's valid tokens of the per-token diagnostics (clip fractions,
    the PPO KL, the ratio, IS weight, entropy, KL); :func:`finalize_metrics` divides them."""
    def tsum(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float()
        return torch.where(valid, x, torch.zeros_like(x)).sum()

    token_sums = {
        "pg_clipfrac": tsum(terms.clipped.float()),
        "pg_clipfrac_low": tsum(terms.clipped_low.float()),
        "pg_clipfrac_high": tsum(terms.clipped_high.float()),
        "pg_dualclip_frac": tsum(terms.dual_clipped.float()),
        # log(pi_old / pi_theta) clamped like the policy ratio, so no finite input overflows the sum
        "ppo_kl": tsum((old - lp.detach()).clamp(-config.ratio_log_bound, config.ratio_log_bound)),
        "ratio": tsum(terms.ratio),
    }
    if weights is not None:
        token_sums["is_weight"] = tsum(weights)
    if ent is not None:
        token_sums["entropy"] = tsum(ent)
    if kl_values is not None:
        token_sums["kl"] = tsum(kl_values)
    return token_sums


def _counts(lmask, finite, keep, valid, bad, den_mask, cu_seqlens, seq_token_counts, num_opsm_tokens, num_opsm_sequences) -> dict[str, torch.Tensor]:
    """This micro-batch's token and sequence counts (loss, valid, rejected, non-finite, OPSM,
    denominator)."""
    device = valid.device
    den_counts = segment_sum(den_mask.float(), cu_seqlens) if seq_token_counts is None else seq_token_counts
    counts = {
        "num_loss_tokens": lmask.sum().float(),
        "num_valid_tokens": valid.sum().float(),
        "num_rejected_tokens": (lmask & finite & ~keep).sum().float(),
        "num_nonfinite_inputs": bad.sum().float(),
        "num_opsm_tokens": num_opsm_tokens.to(device),
        "num_opsm_sequences": num_opsm_sequences.to(device),
        "num_denominator_tokens": den_mask.sum().float(),
        "num_denominator_sequences": (den_counts > 0).sum().float(),
    }
    return counts


def compute_rl_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: LossConfig,
    denominators: Denominators,
    *,
    old_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    seq_token_counts: torch.Tensor | None = None,
    opsm_seq_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    cp_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> RLLossOutput:
    """One micro-batch's share of the RL loss:
    ``pg_loss + kl_loss_coef * kl_loss - entropy_coef * entropy_loss``, each term aggregated by
    ``config.loss_aggregation`` with the global ``denominators``.

    Token masks: ``valid = loss_mask & keep_mask & finite inputs`` is the numerator of every term;
    OPSM (``use_opsm``) further removes tokens from the policy-gradient term only (as in slime and
    DeepSeek-V3.2; KL and entropy keep them). The denominators count ``loss_mask`` tokens
    (``rejected_in_denominator``) or ``valid`` tokens (otherwise); OPSM-masked tokens always stay
    in the denominators (the decision depends on pi_theta and cannot be known before the step).

    Args:
        log_probs: ``[T]`` log pi_theta of this rank's response tokens (with grad).
        advantages: ``[T]``.
        loss_mask: ``[T]`` original loss mask (nonzero = in the loss).
        cu_seqlens: ``[N+1]`` sequence boundaries in the ``[T]`` tensors.
        config: loss settings.
        denominators: global counts of the step (see
            :func:`megatron_mis.core.aggregation.local_denominators`).
        old_log_probs: ``[T]`` pi_old (recomputed by the trainer); ``None``: pi_theta detached
            (one optimizer step per rollout batch).
        rollout_log_probs: ``[T]`` pi_rollout (needed by ``bypass_ppo``).
        ref_log_probs: ``[T]`` pi_ref (needed when the KL term is on).
        entropy: ``[T]`` per-token entropy (with grad; needed when ``entropy_coef > 0``, else
            only reported).
        is_weights: ``[T]`` detached IS weights ``pi_old/pi_rollout`` (needed by losses that use
            them: ``decoupled_ppo``, ``reinforce``).
        keep_mask: ``[T]`` bool, loss mask minus rejected tokens; ``None``: nothing rejected.
        seq_token_counts: ``[N]`` full per-sequence denominator counts (context parallelism).
        opsm_seq_stats: ``(sums [N], counts [N])`` CP-reduced :func:`opsm_sequence_stats`.
        cp_sum: context parallelism: a function that SUMS a ``[N, k]`` float64 tensor of
            per-sequence statistics over the CP group and returns it (e.g. an all-reduce over
            the explicit CP group). Called at most once per call, on every CP rank alike: when
            the policy loss has a sequence ratio (``gspo``: :func:`sequence_ratio_stats`, k = 4)
            and / or OPSM is on without ``opsm_seq_stats`` (k += 2). ``None``: every sequence is
            whole in this call. Its output is detached: each rank's tokens receive the
            gradient of their own terms only (for ``gspo`` that is the whole GSPO gradient of
            the token, ``s_i * d log pi_theta``; no collective runs in the backward).

    Sequence-ratio losses (``gspo``) also count ``num_seq_ratio_sequences``,
    ``num_seq_clipped_low`` and ``num_seq_clipped_high`` (from the CP-summed statistics, so
    under CP every rank counts every sequence: keep one CP rank's counts).

    Raises:
        ValueError: shape mismatches, a missing required input, IS weights given to a loss
            that must not use them, a non-finite input with
            ``nonfinite_input_policy="error"``, or a loss that does not fit its float type (a
            per-token policy term, or the aggregate of finite terms; one host read per call
            checks both). On an accelerator the value checks (non-finite inputs under
            ``neutralize``, overflow, ``cu_seqlens`` values) do not run unless
            ``MEGATRON_MIS_DEBUG_CHECKS=1`` (:mod:`megatron_mis.core.checks`): the call never
            waits for the device; ``nonfinite_input_policy="error"`` reads once.
        KeyError: unknown loss / KL names (listing the valid ones).
    """
    policy = _check_loss_inputs(
        log_probs, advantages, loss_mask, cu_seqlens, config, denominators,
        old_log_probs, rollout_log_probs, ref_log_probs, entropy, is_weights, keep_mask,
    )
    lmask = loss_mask.bool()
    dtype = torch.float32 if log_probs.dtype in (torch.float16, torch.bfloat16) else log_probs.dtype
    lp = log_probs.to(dtype)
    old_src = rollout_log_probs if policy.old_policy == "rollout" else old_log_probs

    # ---- non-finite inputs on loss tokens: error, or drop the token (counted), then sanitise
    inputs = {"log_probs": lp.detach(), "advantages": advantages}
    if old_src is not None:
        inputs["rollout_log_probs" if policy.old_policy == "rollout" else "old_log_probs"] = old_src
    if config.kl_active:
        inputs["ref_log_probs"] = ref_log_probs
    if entropy is not None:
        inputs["entropy"] = entropy.detach()
    if is_weights is not None:
        inputs["is_weights"] = is_weights
    finite, bad = _screen_nonfinite(inputs, lmask, config)

    def clean(t: torch.Tensor | None) -> torch.Tensor | None:
        return _finite_or_zero(t, dtype)

    lp = torch.where(torch.isfinite(lp.detach()), lp, torch.zeros((), dtype=dtype, device=lp.device))
    adv = clean(advantages)
    if policy.old_policy == "none":
        old = clean(old_log_probs) if old_log_probs is not None else lp.detach()
    else:
        old = clean(old_src) if old_src is not None else lp.detach()
    weights = clean(is_weights)
    ent = clean(entropy)  # torch.where keeps entropy's gradient on the finite entries

    keep = lmask if keep_mask is None else lmask & keep_mask.bool()
    valid = keep & finite
    den_mask = denominator_mask(lmask, valid, config.rejected_in_denominator)

    # ---- per-sequence statistics (GSPO's ratio, OPSM under CP): one cp_sum over the CP group
    gspo_stats, opsm_seq_stats = _sequence_statistics(
        policy, lp, old, adv, lmask, finite, valid, cu_seqlens, config, opsm_seq_stats, cp_sum
    )
    seq_log_ratio = None
    if gspo_stats is not None:
        seq = segment_ids(cu_seqlens, lp.device, num_tokens=int(lp.shape[0]))
        bound = 2.0 * config.ratio_log_bound  # keeps "beyond the bound" visible without an inf in float32
        seq_log_ratio = sequence_log_ratio(gspo_stats).clamp(-bound, bound).to(dtype)[seq]

    # ---- policy term, then off-policy sequence masking of it
    terms = _policy_term(policy, lp, old, adv, weights, valid, config, seq_log_ratio)
    pg_mask, num_opsm_tokens, num_opsm_sequences = _opsm_policy_mask(
        adv, lp, old, lmask, finite, valid, cu_seqlens, config, opsm_seq_stats
    )

    mode = config.loss_aggregation
    agg = dict(seq_token_counts=seq_token_counts, count_mask=den_mask)
    pg_loss = aggregate(terms.loss, pg_mask, cu_seqlens, mode, denominators, **agg)
    loss = pg_loss
    zero = torch.zeros_like(pg_loss.detach())  # not pg_loss * 0: an overflowed pg_loss would make it NaN
    kl_loss = zero
    entropy_loss = zero
    kl_values = None
    if config.kl_active:
        kl_values = kl_estimate(
            lp,
            clean(ref_log_probs),
            config.kl_loss_type,
            old_log_probs=old,
            unbiased=config.use_unbiased_kl,
            log_ratio_bound=config.ratio_log_bound,
        )
        kl_loss = aggregate(kl_values, valid, cu_seqlens, mode, denominators, **agg)
        loss = loss + config.kl_loss_coef * kl_loss
    if ent is not None:
        entropy_loss = aggregate(ent, valid, cu_seqlens, mode, denominators, **agg)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * entropy_loss

    token_sums = _token_sums(terms, valid, old, lp, weights, ent, kl_values, config)
    counts = _counts(lmask, finite, keep, valid, bad, den_mask, cu_seqlens, seq_token_counts, num_opsm_tokens, num_opsm_sequences)
    if gspo_stats is not None:
        counts.update(_sequence_clip_counts(gspo_stats, dtype, config))
    shares = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl_loss": kl_loss.detach(),
        "entropy_loss": entropy_loss.detach(),
    }
    _check_finite_loss(policy, terms, lp, adv, weights, valid, shares, config)
    return RLLossOutput(
        loss=loss,
        shares=shares,
        token_sums=token_sums,
        counts=counts,
        pg_mask=pg_mask,
        valid_mask=valid,
        terms=terms,
    )
