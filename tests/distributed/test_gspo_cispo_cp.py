"""GSPO and CISPO under context parallelism on gloo, without Megatron: every sequence split
zigzag (the "thd" layout of DESIGN.md section 3) over CP = 2 and CP = 4 ranks, each rank calling
``compute_rl_loss`` on its own response tokens with ``cp_sum`` an all-reduce over an EXPLICIT CP
group. The ranks' shares add up to the one-process loss, each rank's gradient equals the
one-process gradient at its tokens, and the sequence-level counts of CP rank 0 equal the
one-process counts. float64 throughout: the only difference is the order of float64 sums
(1e-12 relative tolerance); a wrong ratio (local instead of CP-summed statistics) is off by
1e-3 or more (checked)."""

from __future__ import annotations

import warnings

import pytest
import torch

CASES = {
    "gspo_token_mean_dual_clip": dict(policy_loss="gspo", eps_clip=0.03, eps_clip_high=0.04, eps_clip_c=3.0),
    "gspo_seq_mean_opsm_rejected_out": dict(
        policy_loss="gspo", eps_clip=0.03, eps_clip_high=0.04, loss_aggregation="seq_mean_token_mean",
        use_opsm=True, opsm_delta=0.02, rejected_in_denominator=False,
    ),
    "cispo_seq_sum": dict(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.1, loss_aggregation="seq_mean_token_sum"),
}


def _batch(seed: int = 0):
    """12 sequences: prompts 1-5 tokens, responses 1-17 (some shorter than 2 x CP, so a rank
    can hold none of a sequence's response), GRPO-like advantages constant per sequence, some
    tokens outside the loss mask or rejected."""
    g = torch.Generator().manual_seed(seed)
    n = 12
    prompts = torch.randint(1, 6, (n,), generator=g)
    responses = torch.randint(1, 18, (n,), generator=g)
    responses[3] = 1
    totals = prompts + responses
    t = int(responses.sum())
    seq = torch.repeat_interleave(torch.arange(n), responses)
    old = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    lp = old + 0.1 * torch.randn(t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)[seq]
    w = (0.5 + torch.rand(n, generator=g, dtype=torch.float64))[seq]  # one IS weight per sequence
    mask = (torch.rand(t, generator=g) < 0.9).double()
    keep = torch.rand(t, generator=g) < 0.9
    return dict(totals=totals.tolist(), responses=responses.tolist(), old=old, lp=lp, adv=adv, w=w, mask=mask, keep=keep)


def _loss_args(b, cfg_kw):
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.core.aggregation import denominator_mask, local_denominators
    from megatron_mis.core.segments import cu_seqlens_from_lengths

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = LossConfig(**cfg_kw)
    cu = cu_seqlens_from_lengths(b["responses"])
    den_mask = denominator_mask(b["mask"], b["keep"], cfg.rejected_in_denominator)
    return cfg, cu, den_mask, local_denominators(den_mask, cu)


def _single(b, cfg_kw):
    from megatron_mis.core.losses import compute_rl_loss

    cfg, cu, _, den = _loss_args(b, cfg_kw)
    lp = b["lp"].clone().requires_grad_()
    out = compute_rl_loss(lp, b["adv"], b["mask"], cu, cfg, den, old_log_probs=b["old"], is_weights=b["w"], keep_mask=b["keep"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    return float(out.loss.detach()), grad, {k: float(v) for k, v in out.counts.items()}


def _cp_rank(b, cfg_kw, exact: bool = True):
    """On every rank of the pool (the CP group): this rank's zigzag share through compute_rl_loss."""
    import torch.distributed as dist

    from megatron_mis.core.aggregation import segment_sum
    from megatron_mis.core.losses import compute_rl_loss
    from megatron_mis.parallel.layout import local_response_layout

    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))  # explicit group; never the default one
    cfg, cu, den_mask, den = _loss_args(b, cfg_kw)
    lay = local_response_layout(b["totals"], b["responses"], size, rank, layout="thd")
    idx = lay.local_to_full_index()
    calls = []

    def cp_sum(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        if exact:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    lp = b["lp"][idx].clone().requires_grad_()
    out = compute_rl_loss(
        lp, b["adv"][idx], b["mask"][idx], lay.local_cu_seqlens(), cfg, den,
        old_log_probs=b["old"][idx], is_weights=b["w"][idx], keep_mask=b["keep"][idx],
        seq_token_counts=segment_sum(den_mask.double(), cu), cp_sum=cp_sum,
    )
    (g,) = torch.autograd.grad(out.loss, lp)
    grad = torch.zeros_like(b["lp"])
    grad[idx] = g
    return {
        "loss": float(out.loss.detach()), "grad": grad, "counts": {k: float(v) for k, v in out.counts.items()},
        "calls": calls, "local_tokens": int(idx.numel()),
        "empty_sequences": int((lay.local_lengths == 0).sum()),
    }


def _check(runs, b, cfg_kw, what):
    loss, grad, counts = _single(b, cfg_kw)
    assert sum(r["local_tokens"] for r in runs) == len(b["lp"])
    assert any(r["empty_sequences"] > 0 for r in runs), "no rank without tokens of some sequence: the case is too easy"
    assert sum(r["loss"] for r in runs) == pytest.approx(loss, rel=1e-12, abs=1e-15), what
    torch.testing.assert_close(sum(r["grad"] for r in runs), grad, rtol=1e-12, atol=1e-15, msg=lambda m: f"{what}: {m}")
    for key in ("num_valid_tokens", "num_opsm_tokens", "num_rejected_tokens", "num_denominator_tokens"):
        assert sum(r["counts"][key] for r in runs) == counts[key], f"{what}: {key}"
    for key in ("num_seq_ratio_sequences", "num_seq_clipped_low", "num_seq_clipped_high"):
        if key in counts:  # sequence counts: every CP rank sees every sequence; rank 0's are the count
            assert all(r["counts"][key] == counts[key] for r in runs), f"{what}: {key}"
    return loss, counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_cp2_and_cp4_equal_one_process(pool2, pool4, case):
    cfg_kw = CASES[case]
    b = _batch()
    needs_sum = cfg_kw["policy_loss"] == "gspo" or cfg_kw.get("use_opsm", False)
    for pool, cp in ((pool2, 2), (pool4, 4)):
        runs = pool.run(_cp_rank, b, cfg_kw)
        loss, counts = _check(runs, b, cfg_kw, f"{case} CP={cp}")
        n = len(b["responses"])
        k = (4 if cfg_kw["policy_loss"] == "gspo" else 0) + (2 if cfg_kw.get("use_opsm") else 0)
        assert all(r["calls"] == ([(n, k)] if needs_sum else []) for r in runs), f"{case} CP={cp}: one cp_sum per call"
    if cfg_kw.get("use_opsm"):
        assert counts["num_opsm_tokens"] > 0  # OPSM really dropped tokens, decided from CP-summed sums
    if cfg_kw["policy_loss"] == "gspo":
        # the clip really acts on some sequences and not on others
        assert 0 < counts["num_seq_clipped_low"] + counts["num_seq_clipped_high"] < counts["num_seq_ratio_sequences"]
        # without the CP sum every rank would form its own ratio: visibly wrong
        local_only = pool4.run(_cp_rank, b, cfg_kw, False)
        assert abs(sum(r["loss"] for r in local_only) - loss) > 1e-3 * abs(loss)
