"""KL estimators: hand values, the registry's errors, and the DeepSeek-V3.2 unbiased estimator's
gradient checked by exact enumeration over small categorical policies."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mis.core.kl import KL_ESTIMATORS, kl_estimate

LP = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.9)], dtype=torch.float64)
REF = torch.tensor([math.log(0.25), math.log(0.4), math.log(0.9)], dtype=torch.float64)


def test_hand_values():
    # log r = log p - log ref = [log 2, log 0.5, 0]
    lr = [math.log(2), math.log(0.5), 0.0]
    torch.testing.assert_close(kl_estimate(LP, REF, "k1"), torch.tensor(lr, dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(LP, REF, "k2"), torch.tensor([x * x / 2 for x in lr], dtype=torch.float64))
    # k3 = q - 1 - log q with q = ref / p = [0.5, 2, 1]
    k3 = [0.5 - 1 - math.log(0.5), 2 - 1 - math.log(2), 0.0]
    torch.testing.assert_close(kl_estimate(LP, REF, "k3"), torch.tensor(k3, dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(LP, REF, "low_var_kl"), torch.tensor(k3, dtype=torch.float64))


def test_low_var_kl_clamps_and_k3_does_not_overflow():
    lp = torch.tensor([-60.0, 0.0])
    ref = torch.tensor([0.0, -60.0])
    k3 = kl_estimate(lp, ref, "k3", log_ratio_bound=20.0)
    assert torch.isfinite(k3).all()
    # log q clamped to +-20: q - 1 - log q at log q = 20 and -20.
    torch.testing.assert_close(k3, torch.tensor([math.expm1(20) - 20, math.expm1(-20) + 20]))
    assert kl_estimate(lp, ref, "low_var_kl").max().item() == 10.0


def test_unbiased_multiplies_by_ratio_with_gradient():
    lp = LP.clone().requires_grad_()
    old = torch.tensor([math.log(0.4), math.log(0.2), math.log(0.6)], dtype=torch.float64)
    out = kl_estimate(lp, REF, "k3", old_log_probs=old, unbiased=True)
    ratio = (LP - old).exp()
    torch.testing.assert_close(out, ratio * kl_estimate(LP, REF, "k3"))
    out.sum().backward()
    # d/dlp [e^(lp-old) * (e^(ref-lp) - 1 - ref + lp)] = ratio * k3 + ratio * (1 - e^(ref-lp))
    want = ratio * kl_estimate(LP, REF, "k3") + ratio * (1 - (REF - LP).exp())
    torch.testing.assert_close(lp.grad, want)


def test_errors():
    with pytest.raises(KeyError, match=r"unknown KL estimator 'k4' \(did you mean 'k3'\?\); valid: k1, k2, k3, low_var_kl"):
        kl_estimate(LP, REF, "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(LP, REF[:2], "k3")
    with pytest.raises(ValueError, match="needs old_log_probs"):
        kl_estimate(LP, REF, "k3", unbiased=True)
    with pytest.raises(ValueError, match="old_log_probs"):
        kl_estimate(LP, REF, "k3", old_log_probs=REF[:1], unbiased=True)
    with pytest.raises(ValueError, match="already registered"):
        KL_ESTIMATORS.register("k3", lambda a, b, c: a)


# ------------------------------------------------------------------ exact-enumeration gradient test
def _policies(seed: int, k: int = 6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(k, dtype=torch.float64, generator=g).requires_grad_()
    log_old = torch.log_softmax(torch.randn(k, dtype=torch.float64, generator=g), 0)
    log_ref = torch.log_softmax(torch.randn(k, dtype=torch.float64, generator=g), 0)
    return theta, log_old, log_ref


def _expected_estimator_grad(theta, log_old, log_ref, kind, unbiased, log_sampler=None):
    """grad_theta of E_{x ~ sampler}[estimator(x)], enumerated exactly over all outcomes x
    (the sampling distribution is data: it is not differentiated, as in training)."""
    log_pi = torch.log_softmax(theta, 0)
    sampler = (log_old if log_sampler is None else log_sampler).exp()
    est = kl_estimate(log_pi, log_ref, kind, old_log_probs=log_old, unbiased=unbiased)
    (grad,) = torch.autograd.grad((sampler * est).sum(), theta)
    return grad


def _true_kl_grad(theta, log_ref):
    log_pi = torch.log_softmax(theta, 0)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_unbiased_kl_gradient_is_exact_under_off_policy_samples(seed, kind):
    theta, log_old, log_ref = _policies(seed)
    true = _true_kl_grad(theta, log_ref)
    got = _expected_estimator_grad(theta, log_old, log_ref, kind, unbiased=True)
    # Exact identity E_old[grad(pi/old * k)] = grad E_pi[k] = grad KL; float64 rounding only.
    torch.testing.assert_close(got, true, rtol=1e-10, atol=1e-12)
    # ... and its expected value is the KL itself.
    log_pi = torch.log_softmax(theta.detach(), 0)
    value = (log_old.exp() * kl_estimate(log_pi, log_ref, kind, old_log_probs=log_old, unbiased=True)).sum()
    torch.testing.assert_close(value, (log_pi.exp() * (log_pi - log_ref)).sum(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_uncorrected_kl_gradient_is_biased(seed, kind):
    theta, log_old, log_ref = _policies(seed)
    true = _true_kl_grad(theta, log_ref)
    got = _expected_estimator_grad(theta, log_old, log_ref, kind, unbiased=False)
    # The random policies differ by O(1): the bias is of the order of the gradient itself.
    assert (got - true).norm() > 0.05 * true.norm()


@pytest.mark.parametrize("seed", [0, 1])
def test_k3_without_ratio_is_biased_even_on_policy(seed):
    """On-policy (samples from pi_theta itself, pi_old = pi_theta detached) the plain k3 gradient
    is the gradient of the *reverse* KL(pi_ref || pi_theta); the ratio form is exact."""
    theta, _, log_ref = _policies(seed)
    log_pi = torch.log_softmax(theta.detach(), 0)
    true = _true_kl_grad(theta, log_ref)
    plain = _expected_estimator_grad(theta, log_pi, log_ref, "k3", unbiased=False)
    ratio = _expected_estimator_grad(theta, log_pi, log_ref, "k3", unbiased=True)
    torch.testing.assert_close(ratio, true, rtol=1e-10, atol=1e-12)
    log_pi_g = torch.log_softmax(theta, 0)
    (reverse,) = torch.autograd.grad((log_ref.exp() * (log_ref - log_pi_g)).sum(), theta)
    torch.testing.assert_close(plain, reverse, rtol=1e-10, atol=1e-12)
    assert (plain - true).norm() > 0.05 * true.norm()
    # plain k1 on-policy: E_pi[grad log pi] = 0, no gradient at all (why slime's k1 default needs care)
    k1_plain = _expected_estimator_grad(theta, log_pi, log_ref, "k1", unbiased=False)
    torch.testing.assert_close(k1_plain, torch.zeros_like(k1_plain), rtol=0, atol=1e-12)


def test_unbiased_k2_is_not_the_kl_gradient():
    theta, log_old, log_ref = _policies(4)
    got = _expected_estimator_grad(theta, log_old, log_ref, "k2", unbiased=True)
    assert (got - _true_kl_grad(theta, log_ref)).norm() > 1e-3
