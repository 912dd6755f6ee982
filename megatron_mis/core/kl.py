"""KL estimators between the current policy and a reference policy, per token.

With ``log r = log pi_theta(y) - log pi_ref(y)`` for a sampled token ``y``
(http://joschu.net/blog/kl-approx.html, names as in slime's ``--kl-loss-type``):

- ``k1``: ``log r``; unbiased for KL(pi_theta || pi_ref) under samples from pi_theta, high variance,
  can be negative;
- ``k2``: ``(log r)^2 / 2``; biased, low variance;
- ``k3``: ``q - 1 - log q`` with ``q = pi_ref / pi_theta``; unbiased, non-negative;
- ``low_var_kl``: ``k3`` clamped to ``[-10, 10]`` (verl's name).

Only the estimator's *value* is unbiased under on-policy samples. Its *gradient* taken through
``log pi_theta`` alone is not the gradient of the KL (sampling is not differentiated): for ``k3``
it is the gradient of KL(pi_ref || pi_theta) instead, for ``k1`` it is zero in expectation.
DeepSeek-V3.2's unbiased estimator multiplies the estimate by ``pi_theta / pi_old`` (the sampling
policy), the ratio *not* detached: then ``E_{y~pi_old}[pi_theta/pi_old * k(y)] =
E_{y~pi_theta}[k(y)]`` and its autograd gradient is exactly the gradient of KL(pi_theta || pi_ref)
for ``k1`` and ``k3`` (``tests/test_kl.py`` checks this by exact enumeration).

Every log-ratio that goes into ``exp`` is clamped to ``[-log_ratio_bound, log_ratio_bound]``
first, so nothing overflows; a clamped token gets no gradient through that ``exp``.

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_mis.registry import Registry

__all__ = ["KL_ESTIMATORS", "kl_estimate", "KLEstimator", "LOW_VAR_KL_CLAMP"]

#: A KL estimator maps ``(log_probs [T], ref_log_probs [T], log_ratio_bound)`` to ``[T]``.
KLEstimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

#: ``low_var_kl`` clamps the k3 estimate to ``[-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP]`` (as verl).
LOW_VAR_KL_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> torch.Tensor:
    """``log pi_theta - log pi_ref`` per token. Shapes ``[T], [T] -> [T]``."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("k2")
def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> torch.Tensor:
    """``(log pi_theta - log pi_ref)^2 / 2`` per token. Shapes ``[T], [T] -> [T]``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3")
def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> torch.Tensor:
    """``q - 1 - log q`` with ``log q = log pi_ref - log pi_theta`` (clamped before exp).
    Shapes ``[T], [T] -> [T]``."""
    log_q = (ref_log_probs - log_probs).clamp(-log_ratio_bound, log_ratio_bound)
    return torch.expm1(log_q) - log_q


@KL_ESTIMATORS.register("low_var_kl")
def low_var_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> torch.Tensor:
    """``k3`` clamped to ``[-10, 10]``. Shapes ``[T], [T] -> [T]``."""
    return k3(log_probs, ref_log_probs, log_ratio_bound).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str = "k3",
    *,
    old_log_probs: torch.Tensor | None = None,
    unbiased: bool = False,
    log_ratio_bound: float = 20.0,
) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate.

    Args:
        log_probs: ``[T]`` log pi_theta of the sampled tokens (with grad).
        ref_log_probs: ``[T]`` log pi_ref of the same tokens.
        kind: a registered estimator name (``k1``, ``k2``, ``k3``, ``low_var_kl``).
        old_log_probs: ``[T]`` log-probs of the sampling (old) policy; needed when ``unbiased``.
        unbiased: multiply by ``pi_theta / pi_old`` (not detached; DeepSeek-V3.2).
        log_ratio_bound: clamp for every log-ratio that goes into ``exp``.

    Returns:
        ``[T]`` float tensor, differentiable in ``log_probs``.

    Raises:
        KeyError: for an unknown ``kind`` (listing the valid names).
        ValueError: for mismatched shapes or ``unbiased`` without ``old_log_probs``.
    """
    estimator = KL_ESTIMATORS.get(kind)
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must have the same shape"
        )
    kl = estimator(log_probs, ref_log_probs.to(log_probs.dtype), log_ratio_bound)
    if unbiased:
        if old_log_probs is None:
            raise ValueError("unbiased KL needs old_log_probs (the sampling policy's log-probs)")
        if old_log_probs.shape != log_probs.shape:
            raise ValueError(
                f"old_log_probs {tuple(old_log_probs.shape)} and log_probs {tuple(log_probs.shape)} must have the same shape"
            )
        log_ratio = (log_probs - old_log_probs.to(log_probs.dtype).detach()).clamp(-log_ratio_bound, log_ratio_bound)
        kl = torch.exp(log_ratio) * kl
    return kl
