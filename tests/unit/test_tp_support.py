"""Top-p / top-k replay in :func:`vocab_parallel_log_probs` (``support=TokenSupport``): the
log-probs, entropy and gradients of the distribution renormalised over each token's rollout
support. Hand-derived values, a per-token reference (log-softmax of the kept logits only, so
nothing outside the support can reach the gradient), TP shards equal to one process, bad input.
The TP = 2 gloo check and the fake-CUDA check are in tests/distributed/test_tp_logprobs.py and
tests/fakecuda/test_integration_paths.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mis.parallel.tp_logprobs import TokenSupport, vocab_parallel_log_probs


def test_hand_derived_values():
    # token 0: logits log([1, 2, 3, e^-1]) / support {1, 2}, target 2: p = 3 / (2 + 3) = 0.6
    # token 1: the same logits, no truncation, target 0: p = 1 / (1 + 2 + 3 + e^-1)
    z = torch.log(torch.tensor([1.0, 2.0, 3.0, math.exp(-1)], dtype=torch.float64)).repeat(2, 1)
    support = TokenSupport.from_lists([[1, 2], []])
    lp, ent = vocab_parallel_log_probs(z, torch.tensor([2, 0]), with_entropy=True, support=support)
    total = 6 + math.exp(-1)
    assert lp.tolist() == pytest.approx([math.log(0.6), math.log(1 / total)], abs=1e-12)
    want_ent0 = -(0.4 * math.log(0.4) + 0.6 * math.log(0.6))
    want_ent1 = -sum(q / total * math.log(q / total) for q in (1, 2, 3, math.exp(-1)))
    assert ent.tolist() == pytest.approx([want_ent0, want_ent1], abs=1e-12)


def test_the_sampled_token_is_always_supported():
    """A support that lacks the sampled id (a rollout engine that recorded the nucleus before a
    min-p / top-k step, say) gives the log-prob over support + sampled id, never -inf."""
    z = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64))
    lp, _ = vocab_parallel_log_probs(z, torch.tensor([0]), support=TokenSupport.from_lists([[2, 3]]))
    assert lp.item() == pytest.approx(math.log(1 / (1 + 3 + 4)), abs=1e-12)


def _random_case(seed, num_tokens=9, vocab=12, top_p=0.8):
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(num_tokens, vocab, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    supports = []
    for t in range(num_tokens):
        if t % 4 == 3:
            supports.append([])  # untruncated token
            continue
        order = torch.argsort(probs[t], descending=True)
        before = torch.cumsum(probs[t][order], 0) - probs[t][order]
        supports.append(sorted(order[before < top_p].tolist()))
    targets = torch.tensor([s[int(torch.randint(len(s), (1,), generator=g))] if s else int(torch.randint(vocab, (1,), generator=g))
                            for s in supports])
    return logits, targets, supports


def _reference(logits, targets, supports, temperature):
    """Per token: log-softmax over the kept ids only (support + the sampled id)."""
    lps, ents = [], []
    for t in range(logits.shape[0]):
        ids = sorted(set(supports[t]) | {int(targets[t])}) if supports[t] else list(range(logits.shape[1]))
        sub = torch.log_softmax(logits[t, ids] / temperature, -1)
        lps.append(sub[ids.index(int(targets[t]))])
        ents.append(-(sub.exp() * sub).sum())
    return torch.stack(lps), torch.stack(ents)


@pytest.mark.parametrize("chunk_size", [-1, 1, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_the_per_token_reference_with_gradients(chunk_size, temperature):
    logits, targets, supports = _random_case(1)
    w = torch.linspace(-1, 1, logits.shape[0], dtype=torch.float64)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(x, targets, temperature=temperature, with_entropy=True, chunk_size=chunk_size,
                                       support=TokenSupport.from_lists(supports))
    (gx,) = torch.autograd.grad((w * lp).sum() + 0.3 * (w * ent).sum(), x)
    y = logits.clone().requires_grad_()
    ref_lp, ref_ent = _reference(y, targets, supports, temperature)
    (gy,) = torch.autograd.grad((w * ref_lp).sum() + 0.3 * (w * ref_ent).sum(), y)
    # float64 throughout: agreement to rounding
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, gy, rtol=0, atol=1e-12)
    outside = torch.ones_like(gx, dtype=torch.bool)
    for t, s in enumerate(supports):
        if s:
            outside[t, s] = False
            outside[t, targets[t]] = False
        else:
            outside[t] = False
    assert (gx[outside] == 0).all() and outside.any()  # no gradient outside the support
    assert torch.isfinite(gx).all() and torch.isfinite(ent).all()


def test_rows_and_support_together():
    logits, targets, supports = _random_case(2, num_tokens=6)
    big = torch.zeros(10, logits.shape[1], dtype=torch.float64)
    rows = torch.tensor([7, 0, 3, 9, 2, 5])
    big[rows] = logits
    x = big.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(x, targets, rows=rows, with_entropy=True, chunk_size=4,
                                       support=TokenSupport.from_lists(supports))
    ref_lp, ref_ent = _reference(logits, targets, supports, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)


def test_an_all_empty_support_is_the_untruncated_computation():
    logits, targets, _ = _random_case(3)
    plain, plain_ent = vocab_parallel_log_probs(logits, targets, with_entropy=True, chunk_size=4)
    same, same_ent = vocab_parallel_log_probs(logits, targets, with_entropy=True, chunk_size=4,
                                              support=TokenSupport.from_lists([[]] * logits.shape[0]))
    assert torch.equal(plain, same) and torch.equal(plain_ent, same_ent)


def test_bad_supports_are_named():
    z = torch.zeros(2, 5)
    t = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"offsets has 2 entries, expected tokens \+ 1 = 3"):
        vocab_parallel_log_probs(z, t, support=TokenSupport.from_lists([[0]]))
    with pytest.raises(ValueError, match=r"support ids must lie in \[0, 5\).*max 7"):
        vocab_parallel_log_probs(z, t, support=TokenSupport.from_lists([[0, 7], []]))
    with pytest.raises(ValueError, match="support ids must be integers, got 1.5"):
        TokenSupport.from_lists([[1.5]])
    with pytest.raises(ValueError, match="support must be a TokenSupport"):
        vocab_parallel_log_probs(z, t, support=[[0], [1]])
    bad = TokenSupport(ids=torch.tensor([0, 1]), token_index=torch.tensor([1, 1]), offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="token_index does not match offsets"):
        vocab_parallel_log_probs(z, t, support=bad)


def test_select_picks_tokens_in_the_given_order():
    s = TokenSupport.from_lists([[1, 2], [], [4, 5, 6], [7]])
    sub = s.select(torch.tensor([3, 0, 1, 2]))
    assert sub.offsets.tolist() == [0, 1, 3, 3, 6]
    assert sub.ids.tolist() == [7, 1, 2, 4, 5, 6]
    assert sub.token_index.tolist() == [0, 1, 1, 3, 3, 3]
    assert s.select(torch.zeros(0, dtype=torch.long)).offsets.tolist() == [0]
    with pytest.raises(ValueError, match=r"token index out of \[0, 4\)"):
        s.select(torch.tensor([4]))
