"""Vocab-parallel log-probs and entropy: equal to a full log-softmax (forward and gradient) on one
process, and on a real Megatron-Core GPT with TP=2 equal to the unsharded log-softmax and to
Megatron's ``vocab_parallel_cross_entropy``."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.testbed.models.gpt import GPTSpec
from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("chunk_size", [-1, 1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_single_rank_matches_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 13, generator=g)).requires_grad_()
    targets = torch.randint(0, 13, (2, 5), generator=g)
    lp, ent = vocab_parallel_log_probs(logits, targets, temperature=temperature, with_entropy=True, chunk_size=chunk_size)
    assert lp.shape == ent.shape == (2, 5) and lp.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits.detach(), targets, temperature)
    # float32 log-softmax of logits of size ~10: rounding ~1e-6.
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-6)

    w1, w2 = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    (grad,) = torch.autograd.grad((w1 * lp).sum() + (w2 * ent).sum(), logits)
    x = logits.detach().double().requires_grad_()
    r_lp, r_ent = _reference(x, targets, temperature)
    (ref_grad,) = torch.autograd.grad((w1.double() * r_lp).sum() + (w2.double() * r_ent).sum(), x)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=2e-6)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 9, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (6,), generator=g)
    fn = lambda z: vocab_parallel_log_probs(z, t, temperature=0.7, with_entropy=True, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


def test_bf16_logits_are_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(64, 50, generator=g)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 50, (64,), generator=g)
    lp, ent = vocab_parallel_log_probs(logits, t, with_entropy=True, chunk_size=16)
    assert lp.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits.detach().float(), t)
    # Same bf16 inputs, float32 arithmetic in both: only float32 rounding differs.
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_size", [3, -1])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_rows_equal_the_gathered_copy_without_making_it(chunk_size, with_entropy):
    """rows= gives the log-probs, entropy and logits gradient of the index_select path (exactly:
    the same chunk arithmetic on the same rows), and no gradient outside the rows."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 9, 13, generator=g, dtype=torch.float64)
    rows = torch.tensor([0, 3, 4, 5, 8, 9, 10, 17])
    targets = torch.randint(0, 13, (rows.numel(),), generator=g)
    a = logits.clone().requires_grad_()
    lp_a, ent_a = vocab_parallel_log_probs(a.reshape(-1, 13).index_select(0, rows), targets, with_entropy=with_entropy, chunk_size=chunk_size)
    b = logits.clone().requires_grad_()
    lp_b, ent_b = vocab_parallel_log_probs(b, targets, rows=rows, with_entropy=with_entropy, chunk_size=chunk_size)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=0)
    w = torch.randn(rows.numel(), generator=g, dtype=torch.float64)
    ((lp_a * w).sum() + (ent_a.sum() if with_entropy else 0)).backward()
    ((lp_b * w).sum() + (ent_b.sum() if with_entropy else 0)).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-15)
    outside = torch.ones(18, dtype=torch.bool)
    outside[rows] = False
    assert torch.count_nonzero(b.grad.reshape(-1, 13)[outside]) == 0
    with pytest.raises(ValueError, match="rows must be a 1-D integer index"):
        vocab_parallel_log_probs(logits, targets[:3], rows=rows)


def test_empty_and_bad_inputs():
    lp, ent = vocab_parallel_log_probs(torch.zeros(0, 7, requires_grad=True), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent is None
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 7\)"):
        vocab_parallel_log_probs(torch.zeros(3, 7), torch.tensor([0, 7, 1]))
    with pytest.raises(ValueError, match="same shape|shape of logits"):
        vocab_parallel_log_probs(torch.zeros(3, 7), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(3, 7), torch.tensor([0, 1, 2]), temperature=0.0)
    with pytest.raises(ValueError, match="integer"):
        vocab_parallel_log_probs(torch.zeros(3, 7), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_log_probs(torch.zeros(3, 7), torch.tensor([0, 1, 2]), chunk_size=0)


# ----------------------------------------------------------------------------- TP=2 on GPTModel
SPEC = GPTSpec(vocab_size=48, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=64)


def _gpt_logprobs(tp: int, tokens: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, temperature: float):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=tp, seed=11):
        model = build_gpt(SPEC)
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None)  # [b, s, V/tp]
        shard = out.detach().requires_grad_()
        group = ps.get_tensor_model_parallel_group()
        lp, ent = vocab_parallel_log_probs(
            shard, targets, group=group, temperature=temperature, with_entropy=True, chunk_size=5
        )
        (lp_grad,) = torch.autograd.grad((weights * lp).sum(), shard, retain_graph=True)
        objective = (weights * lp).sum() + 0.5 * (weights * ent).sum()
        (shard_grad,) = torch.autograd.grad(objective, shard)
        # Megatron's own vocab-parallel cross entropy ([s, b, V/tp] layout) on the same shard.
        x = (shard.detach() / temperature).transpose(0, 1).contiguous().requires_grad_()
        ce = vocab_parallel_cross_entropy(x, targets.transpose(0, 1).contiguous()).transpose(0, 1)
        (ce_grad,) = torch.autograd.grad((weights * -ce).sum(), x)
        # Gradient into the model: parameters see the same full-vocabulary objective at any TP size.
        model.zero_grad()
        lp2, _ = vocab_parallel_log_probs(out, targets, group=group, temperature=temperature)
        (weights * lp2).sum().backward()
        emb_grad = model.embedding.word_embeddings.weight.grad
        full_emb_grad = gather_from_tensor_model_parallel_region(emb_grad.t().contiguous()).t()
        result = {
            "rank": dist.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "full_logits": gather_from_tensor_model_parallel_region(out.detach()),
            "lp": lp.detach(),
            "ent": ent.detach(),
            "shard_grad": shard_grad,
            "ce": ce.detach(),
            "lp_grad": lp_grad,
            "ce_grad": ce_grad.transpose(0, 1) / temperature,  # d/d(shard) = d/d(shard / T) / T
            "full_emb_grad": full_emb_grad,
        }
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_gpt_tp2_log_probs_equal_unsharded_log_softmax(pool2, temperature):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 12), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    weights = torch.randn(2, 12, generator=g)
    ref = pool2.run(_gpt_logprobs, 1, tokens, targets, weights, temperature)[0]
    tp2 = pool2.run(_gpt_logprobs, 2, tokens, targets, weights, temperature)

    full = tp2[0]["full_logits"]
    # CPU init from one seed gives the same full model at TP=1 and TP=2 (tests/distributed/test_models_cpu.py).
    torch.testing.assert_close(full, ref["full_logits"], rtol=1e-5, atol=1e-5)
    x = full.double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    want_lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    (want_grad,) = torch.autograd.grad((weights.double() * want_lp).sum() + 0.5 * (weights.double() * want_ent).sum(), x)
    half = SPEC.vocab_size // 2
    for r in tp2:
        # Same float32 logits, different reduction split over the vocabulary: rounding only.
        torch.testing.assert_close(r["lp"].double(), want_lp.detach(), rtol=0, atol=3e-6)
        torch.testing.assert_close(r["ent"].double(), want_ent.detach(), rtol=0, atol=3e-6)
        k = r["tp_rank"]
        torch.testing.assert_close(r["shard_grad"].double(), want_grad[..., k * half : (k + 1) * half], rtol=0, atol=3e-6)
        # Megatron-Core's vocab_parallel_cross_entropy is -log p: same values and gradients.
        torch.testing.assert_close(-r["ce"], r["lp"], rtol=0, atol=3e-6)
        torch.testing.assert_close(r["ce_grad"], r["lp_grad"], rtol=0, atol=3e-6)
        # Parameter gradients through the whole GPT equal the TP=1 model's: the same full-model
        # objective, reductions split differently over TP ranks (float32 rounding, relative).
        torch.testing.assert_close(r["full_emb_grad"], ref["full_emb_grad"], rtol=1e-4, atol=1e-6)



# ------------------------------------------------------------ top-p / top-k replay under TP
def _support_shard(logits: torch.Tensor, targets: torch.Tensor, supports: list, weights: torch.Tensor):
    """This rank's vocabulary shard of ``logits`` over an explicit group of all ranks."""
    import torch.distributed as dist

    from megatron_mis.parallel.tp_logprobs import TokenSupport

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    width = logits.shape[1] // world
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(shard, targets, group=group, with_entropy=True, chunk_size=3, temperature=0.8,
                                       support=TokenSupport.from_lists(supports))
    (grad,) = torch.autograd.grad((weights * lp).sum() + 0.5 * (weights * ent).sum(), shard)
    dist.destroy_process_group(group)
    return {"rank": rank, "lp": lp.detach(), "ent": ent.detach(), "grad": grad}


@pytest.mark.parametrize("pool", ["pool2", "pool4"])
def test_support_under_tp_equals_one_process(request, pool):
    """Each TP rank builds its shard of the support mask from the same sparse ids: the log-probs,
    entropy and each shard's gradient equal the one-process computation (float64: rounding of
    the split sums only)."""
    pool = request.getfixturevalue(pool)
    g = torch.Generator().manual_seed(9)
    logits = 2 * torch.randn(10, 16, generator=g, dtype=torch.float64)
    supports = [sorted(torch.randperm(16, generator=g)[: 1 + t % 5].tolist()) if t % 3 else [] for t in range(10)]
    targets = torch.tensor([s[0] if s else t for t, s in enumerate(supports)])
    weights = torch.randn(10, generator=g, dtype=torch.float64)
    from megatron_mis.parallel.tp_logprobs import TokenSupport

    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(x, targets, with_entropy=True, temperature=0.8, support=TokenSupport.from_lists(supports))
    (want,) = torch.autograd.grad((weights * lp).sum() + 0.5 * (weights * ent).sum(), x)
    results = pool.run(_support_shard, logits, targets, supports, weights)
    width = 16 // len(results)
    for r in results:
        torch.testing.assert_close(r["lp"], lp.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(r["ent"], ent.detach(), rtol=0, atol=1e-12)
        k = r["rank"]
        torch.testing.assert_close(r["grad"], want[:, k * width : (k + 1) * width], rtol=0, atol=1e-12)
