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


# ------------------------------------------------------------------ clamps: true gradient or exactly 0
def test_issue_examples_clamped_tokens_get_zero_gradient():
    # low_var_kl, log pi = 0, log ref = 3, log old = 1: k3 = e^3 - 4 = 16.09 > 10 (clamped).
    lp = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    out = kl_estimate(lp, torch.tensor([3.0], dtype=torch.float64), "low_var_kl",
                      old_log_probs=torch.tensor([1.0], dtype=torch.float64), unbiased=True)
    assert out.item() == pytest.approx(math.exp(-1) * 10.0, rel=1e-12)  # value: ratio * clamp(k3)
    out.sum().backward()
    assert lp.grad.item() == 0.0  # was +3.679 (ratio * 10), the wrong sign
    # k3, log pi = -25, log ref = -3, log old = -25: |log q| = 22 > 20 (exp guard active).
    lp = torch.tensor([-25.0], dtype=torch.float64, requires_grad=True)
    out = kl_estimate(lp, torch.tensor([-3.0], dtype=torch.float64), "k3",
                      old_log_probs=torch.tensor([-25.0], dtype=torch.float64), unbiased=True)
    assert out.item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-12)
    out.sum().backward()
    assert lp.grad.item() == 0.0  # was +4.85e8


def _per_token_true_grad(kind, lp, ref, old):
    """d/d log pi of ratio * k, derived by hand: k1 -> ratio (k1 + 1); k2 -> ratio (k2 + log r);
    k3 / low_var_kl (unclamped) -> ratio * (log pi - log ref)."""
    ratio = (lp - old).exp()
    d = lp - ref
    if kind == "k1":
        return ratio * (d + 1)
    if kind == "k2":
        return ratio * (0.5 * d * d + d)
    return ratio * d


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_every_token_gets_the_true_gradient_or_zero(kind):
    g = torch.Generator().manual_seed(7)
    n = 4000
    # Wide log-ratios so that both clamps (|log q| > 20 and k3 > 10) and the ratio clamp are hit.
    lp = -torch.rand(n, dtype=torch.float64, generator=g) * 30
    ref = -torch.rand(n, dtype=torch.float64, generator=g) * 30
    old = lp + torch.randn(n, dtype=torch.float64, generator=g) * 8
    x = lp.clone().requires_grad_()
    out = kl_estimate(x, ref, kind, old_log_probs=old, unbiased=True, log_ratio_bound=20.0)
    (grad,) = torch.autograd.grad(out.sum(), x)
    true = _per_token_true_grad(kind, lp, ref, old)
    k3 = torch.expm1(ref - lp) - (ref - lp)
    # every estimator clamps its log-ratio log pi_theta - log pi_ref to +-20 (k1 and k2 too)
    cut = ((lp - old).abs() > 20) | ((ref - lp).abs() > 20)
    if kind == "low_var_kl":
        cut |= k3.abs() > 10
    assert 50 < int(cut.sum()) < n - 50  # the clamps are really active on many tokens
    assert bool((grad[cut] == 0).all())
    # autograd's k3 derivative cancels ratio*(q - 1) against ratio*(1 - q), q up to e^20: the
    # float64 rounding of that is ~1e-16 * q / |log q| relative, below 1e-8 here.
    torch.testing.assert_close(grad[~cut], true[~cut], rtol=1e-8, atol=0)
    # never the wrong sign against the true per-token gradient
    assert bool((grad * true >= 0).all())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_unbiased_kl_gradient_with_active_clamps_by_enumeration(seed, kind):
    """A reference that puts large mass where pi_theta puts little makes k3 > 10 (and for one
    outcome |log q| > bound); the expected gradient must be the KL gradient of the unclamped
    outcomes alone, derived here without kl_estimate."""
    theta, log_old, _ = _policies(seed, k=8)
    with torch.no_grad():
        theta[0] -= 12.0  # pi_theta(0) tiny
        theta[1] -= 30.0  # pi_theta(1) below e^-20 of ref: the exp guard is active
    log_ref = torch.log_softmax(torch.tensor([4.0, 4.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64), 0)
    log_old = torch.log_softmax(theta.detach() + torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)), 0)
    bound = 20.0
    log_pi = torch.log_softmax(theta, 0)
    lp_d = log_pi.detach()
    k3 = torch.expm1(log_ref - lp_d) - (log_ref - lp_d)
    cut = ((log_ref - lp_d).abs() > bound) | ((lp_d - log_old).abs() > bound)
    if kind == "low_var_kl":
        cut |= k3 > 10
    assert bool(cut[1]) and bool(cut[0]) == (kind == "low_var_kl") and not bool(cut[2:].any())
    got = _expected_estimator_grad(theta, log_old, log_ref, kind, unbiased=True)
    # sum over unclamped outcomes of old(y) * d/dtheta[pi/old * k3]: pi(y) (log pi - log ref) dlog pi.
    keep = (~cut).to(torch.float64)
    (want,) = torch.autograd.grad((keep * lp_d.exp() * (lp_d - log_ref) * log_pi).sum(), theta)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k2"])
def test_k1_k2_log_ratio_is_clamped_finite_and_zero_gradient_there(kind):
    lp = torch.tensor([0.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1e20, -1.5])
    out = kl_estimate(lp, ref, kind, log_ratio_bound=20.0)
    assert torch.isfinite(out).all()
    # token 0: log r = 1e20 clamped to 20 -> k1 = 20, k2 = 200; token 1: log r = 0.5
    expected = [20.0, 0.5] if kind == "k1" else [200.0, 0.125]
    assert out.tolist() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    assert grad[0].item() == 0.0  # the clamp decided the value: no gradient
    assert grad[1].item() == pytest.approx(1.0 if kind == "k1" else 0.5)


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), -1.0, 0.0, 81.0, "20", True, None])
def test_log_ratio_bound_must_be_a_number_in_range(bound):
    lp, ref = torch.zeros(2), torch.zeros(2)
    with pytest.raises(ValueError, match=r"log_ratio_bound=.* must be a number in \(0, 80\]"):
        kl_estimate(lp, ref, "k3", log_ratio_bound=bound)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ref_log_probs=[0.0, 0.0]), r"ref_log_probs must be a torch.Tensor, got list"),
        (dict(ref_log_probs=None), r"ref_log_probs must be a torch.Tensor, got NoneType"),
        (dict(log_probs=(0.0, 0.0)), r"log_probs must be a torch.Tensor, got tuple"),
        (dict(log_probs=torch.zeros(2, dtype=torch.long)), r"log_probs must be a floating-point tensor.*int64"),
        (dict(old_log_probs=[0.0, 0.0], unbiased=True), r"old_log_probs must be a torch.Tensor or None, got list"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, match):
    args = dict(log_probs=torch.zeros(2), ref_log_probs=torch.zeros(2))
    args.update(kwargs)
    lp, ref = args.pop("log_probs"), args.pop("ref_log_probs")
    with pytest.raises(TypeError, match=match):
        kl_estimate(lp, ref, "k3", **args)


def test_unbiased_k3_stays_finite_at_the_largest_bound():
    # log ratio pi_theta/pi_old and log q both far beyond 80: with the bound 80 the product was
    # e^80 * e^80 = inf in float32; the KL caps its log-ratios at 40 (e^40 * (e^40 - 41) finite).
    from megatron_mis.core.kl import KL_LOG_RATIO_CAP

    lp = torch.tensor([0.0, -1.0], requires_grad=True)
    ref = torch.tensor([100.0, -1.5])
    old = torch.tensor([-100.0, -1.2])
    out = kl_estimate(lp, ref, "k3", old_log_probs=old, unbiased=True, log_ratio_bound=80.0)
    assert torch.isfinite(out).all()
    cap = KL_LOG_RATIO_CAP
    assert out[0].item() == pytest.approx(math.exp(cap) * (math.expm1(cap) - cap), rel=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    assert grad[0].item() == 0.0 and math.isfinite(grad[1].item())
