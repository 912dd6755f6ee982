"""KL estimators between the current policy and a reference policy, per token.

With ``log r = log pi_theta(y) - log pi_ref(y)`` for a sampled token ``y``
(http://joschu.net/blog/kl-approx.html, names as in slime's ``--kl-loss-type``):

- ``k1``: ``log r`` (clamped to ``+-log_ratio_bound`` like every log-ratio here); unbiased for KL(pi_theta || pi_ref) under samples from pi_theta, high variance,
  can be negative;
- ``k2``: ``(log r)^2 / 2`` (``log r`` clamped likewise); biased, low variance;
- ``k3``: ``q - 1 - log q`` with ``q = pi_ref / pi_theta``; unbiased, non-negative;
- ``low_var_kl``: ``k3`` clamped to ``[-10, 10]`` (verl's name).

Only the estimator's *value* is unbiased under on-policy samples. Its *gradient* taken through
``log pi_theta`` alone is not the gradient of the KL (sampling is not differentiated): for ``k3``
it is the gradient of KL(pi_ref || pi_theta) instead, for ``k1`` it is zero in expectation.
DeepSeek-V3.2's unbiased estimator multiplies the estimate by ``pi_theta / pi_old`` (the sampling
policy), the ratio *not* detached: then ``E_{y~pi_old}[pi_theta/pi_old * k(y)] =
E_{y~pi_theta}[k(y)]`` and its autograd gradient is exactly the gradient of KL(pi_theta || pi_ref)
for ``k1`` and ``k3`` (``tests/unit/test_kl.py`` checks this by exact enumeration).

Clamps and gradients. Every log-ratio (the one that goes into ``exp``, and k1's and k2's) is clamped to
``[-log_ratio_bound, log_ratio_bound]`` first, so nothing overflows, and ``low_var_kl`` clamps its
value to ``[-10, 10]``. A token on which any of these clamps is active gets **exactly zero
gradient** from the KL term, with or without the unbiased ratio; every other token gets the exact
derivative of its term. Without the ratio this is what autograd gives anyway (a clamped value is
constant). With the ratio it is not: ``ratio * constant`` would still have the gradient
``ratio * constant`` through the ratio, which pushes ``log pi_theta`` *down* on a clamped token,
away from the reference (``low_var_kl`` at log pi = 0, log ref = 3, log old = 1: +3.68 where the
KL gradient is -1.10). :func:`kl_estimate` therefore detaches the whole term on clamped tokens. The
*value* keeps the form ``ratio * clamp(k3)``; slime and Miles clamp after multiplying,
``clamp(ratio * k3)`` (docs/losses.md compares the two).

Each registered estimator returns :class:`KLTerms`: the values and the mask of tokens on which a
clamp is active. A plain ``[T]`` tensor is accepted from a user-registered estimator and means "no
clamp" (its autograd gradient is then used everywhere).

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from megatron_mis.config.loss import KL_ESTIMATORS as _KL_REGISTRY
from megatron_mis.registry import Registry

__all__ = ["KL_ESTIMATORS", "kl_estimate", "kl_estimate_terms", "KLEstimator", "KLTerms", "LOW_VAR_KL_CLAMP", "MAX_LOG_RATIO_BOUND", "KL_LOG_RATIO_CAP"]


class KLTerms(NamedTuple):
    """Per-token estimates and where a clamp decided them.

    Attributes:
        values: ``[T]`` float, the estimate per token.
        clamped: ``[T]`` bool, tokens on which a clamp is active (their value is a constant).
    """

    values: torch.Tensor
    clamped: torch.Tensor


#: A KL estimator maps ``(log_probs [T], ref_log_probs [T], log_ratio_bound)`` to
#: :class:`KLTerms` (or, for user estimators without a clamp, a ``[T]`` tensor).
KLEstimator = Callable[[torch.Tensor, torch.Tensor, float], "KLTerms | torch.Tensor"]

#: The registry is defined with the config (names only there); the estimators register here.
KL_ESTIMATORS: Registry[KLEstimator] = _KL_REGISTRY

#: Largest accepted ``log_ratio_bound`` (the loss config's ``ratio_log_bound`` goes up to 80).
MAX_LOG_RATIO_BOUND = 80.0

#: The KL clamps its log-ratios at ``min(log_ratio_bound, KL_LOG_RATIO_CAP)``: with the unbiased
#: ratio the term is ``exp(log ratio) * k3 <= e^40 * e^40 ~ 5.5e34``, inside float32 (at 80 it was
#: ``e^160``, inf).
KL_LOG_RATIO_CAP = 40.0

#: ``low_var_kl`` clamps the k3 estimate to ``[-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP]`` (as verl).
LOW_VAR_KL_CLAMP = 10.0


def _no_clamp(values: torch.Tensor) -> KLTerms:
    return KLTerms(values, torch.zeros(values.shape, dtype=torch.bool, device=values.device))


def _bounded_log_ratio(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> KLTerms:
    """``log pi_theta - log pi_ref`` clamped to ``+-log_ratio_bound`` and where the clamp is active."""
    raw = log_probs - ref_log_probs
    return KLTerms(raw.clamp(-log_ratio_bound, log_ratio_bound), ~(raw.detach().abs() <= log_ratio_bound))


@KL_ESTIMATORS.register("k1")
def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> KLTerms:
    """``log pi_theta - log pi_ref`` per token, clamped to ``+-log_ratio_bound`` (like every
    log-ratio here, so the value stays finite for any finite input). Shapes ``[T], [T] -> [T]``."""
    return _bounded_log_ratio(log_probs, ref_log_probs, log_ratio_bound)


@KL_ESTIMATORS.register("k2")
def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> KLTerms:
    """``(log pi_theta - log pi_ref)^2 / 2`` per token, the log-ratio clamped to
    ``+-log_ratio_bound`` before squaring (finite for any finite input). Shapes ``[T], [T] -> [T]``."""
    log_r, clamped = _bounded_log_ratio(log_probs, ref_log_probs, log_ratio_bound)
    return KLTerms(0.5 * log_r.square(), clamped)


@KL_ESTIMATORS.register("k3")
def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> KLTerms:
    """``q - 1 - log q`` with ``log q = log pi_ref - log pi_theta``, ``log q`` clamped to
    ``+-log_ratio_bound`` before ``exp`` (clamped where ``|log q| > log_ratio_bound``).
    Shapes ``[T], [T] -> [T]``."""
    raw = ref_log_probs - log_probs
    log_q = raw.clamp(-log_ratio_bound, log_ratio_bound)
    return KLTerms(torch.expm1(log_q) - log_q, raw.detach().abs() > log_ratio_bound)


@KL_ESTIMATORS.register("low_var_kl")
def low_var_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_bound: float) -> KLTerms:
    """``k3`` clamped to ``[-10, 10]`` (clamped where k3's ``log q`` clamp is active or
    ``k3 > 10``). Shapes ``[T], [T] -> [T]``."""
    values, clamped = k3(log_probs, ref_log_probs, log_ratio_bound)
    out_of_range = values.detach().abs() > LOW_VAR_KL_CLAMP
    return KLTerms(values.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP), clamped | out_of_range)


def kl_estimate_terms(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str = "k3",
    *,
    old_log_probs: torch.Tensor | None = None,
    unbiased: bool = False,
    log_ratio_bound: float = 20.0,
) -> KLTerms:
    """:func:`kl_estimate` and the ``[T]`` bool mask of tokens whose gradient was cut to 0 (an
    estimator clamp, or with ``unbiased`` the ratio's ``log_ratio_bound`` clamp)."""
    estimator = KL_ESTIMATORS.get(kind)
    for name, value, optional in (
        ("log_probs", log_probs, False),
        ("ref_log_probs", ref_log_probs, False),
        ("old_log_probs", old_log_probs, True),
    ):
        if not (isinstance(value, torch.Tensor) or (optional and value is None)):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(value).__name__}")
        if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor of log-probs, got dtype {value.dtype}")
    if (
        isinstance(log_ratio_bound, bool)
        or not isinstance(log_ratio_bound, (int, float))
        or not (0.0 < log_ratio_bound <= MAX_LOG_RATIO_BOUND)
    ):
        raise ValueError(
            f"log_ratio_bound={log_ratio_bound!r} must be a number in (0, {MAX_LOG_RATIO_BOUND:g}] "
            "(exp of it must fit float32)"
        )
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must have the same shape"
        )
    if unbiased:
        if old_log_probs is None:
            raise ValueError("unbiased KL needs old_log_probs (the sampling policy's log-probs)")
        if old_log_probs.shape != log_probs.shape:
            raise ValueError(
                f"old_log_probs {tuple(old_log_probs.shape)} and log_probs {tuple(log_probs.shape)} must have the same shape"
            )
    log_ratio_bound = min(float(log_ratio_bound), KL_LOG_RATIO_CAP)
    out = estimator(log_probs, ref_log_probs.to(log_probs.dtype), log_ratio_bound)
    kl, clamped = out if isinstance(out, tuple) else _no_clamp(out)
    if kl.shape != log_probs.shape or clamped.shape != log_probs.shape:
        raise ValueError(
            f"KL estimator {kind!r} returned shapes {tuple(kl.shape)} / {tuple(clamped.shape)}, "
            f"expected {tuple(log_probs.shape)}"
        )
    clamped = clamped.bool()
    if unbiased:
        raw = log_probs - old_log_probs.to(log_probs.dtype).detach()
        clamped = clamped | (raw.detach().abs() > log_ratio_bound)
        kl = torch.exp(raw.clamp(-log_ratio_bound, log_ratio_bound)) * kl
        # On a clamped token the term is ratio * constant: its gradient through the ratio is not
        # the KL's (it has the wrong sign for k3 > 10). Cut it to exactly 0 instead.
        kl = torch.where(clamped, kl.detach(), kl)
    return KLTerms(kl, clamped)


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
        log_ratio_bound: clamp for every log-ratio (capped at ``KL_LOG_RATIO_CAP`` = 40 so that
            the unbiased product cannot overflow float32).

    Returns:
        ``[T]`` float tensor, differentiable in ``log_probs``: the exact derivative of each
        token's term, except exactly 0 on tokens where a clamp is active (module docstring).

    Raises:
        KeyError: for an unknown ``kind`` (listing the valid names).
        TypeError: a log-prob argument that is not a floating-point tensor.
        ValueError: for mismatched shapes, ``unbiased`` without ``old_log_probs``, or a
            ``log_ratio_bound`` outside ``(0, 80]``.
    """
    return kl_estimate_terms(
        log_probs,
        ref_log_probs,
        kind,
        old_log_probs=old_log_probs,
        unbiased=unbiased,
        log_ratio_bound=log_ratio_bound,
    ).values
