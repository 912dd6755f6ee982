"""Context parallelism in the CPU core attention: a tiny Megatron-Core GPT under CP=2 (and
TP=2 x CP=2) gives the same logits and the same parameter gradients as the unsharded model, for
packed thd sequences whose lengths are not multiples of 2*cp and for the zigzag bshd split."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.testbed.models.gpt import GPTSpec

# Grouped-query attention (2 key/value heads for 4 query heads) so the group expansion after the
# K/V all-gather is exercised too.
SPEC = GPTSpec(
    vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, max_sequence_length=64
)
LENGTHS = [5, 9, 2, 7]  # none a multiple of 2*cp = 4


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, SPEC.vocab_size, (n,), generator=g) for n in LENGTHS]


def _loss_weights() -> list[torch.Tensor]:
    """A fixed random linear functional of the logits per (sequence, position): the same loss in
    every layout, so gradients can be compared."""
    g = torch.Generator().manual_seed(4)
    return [torch.randn(n, SPEC.vocab_size, generator=g) for n in LENGTHS]


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the CP group (what DDP does over dp x cp) and gathered
    over TP to full shape."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cp_group, tp_group = ps.get_context_parallel_group(), ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=cp_group)
        if getattr(p, "tensor_model_parallel", False) and tp_group.size() > 1:
            parts = [torch.empty_like(g) for _ in range(tp_group.size())]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g
    return out


def _run(tp: int, cp: int, fmt: str):
    """Forward + backward of a fixed loss; returns (per-sequence logits on this rank's
    positions as {(seq, pos): [V]}, full gradients)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.parallel.packing import pack_sequences, pad_sequences, zigzag_bshd_global_index, zigzag_split
    from megatron_mis.testing.distributed import megatron_parallel

    seqs, weights = _sequences(), _loss_weights()
    with megatron_parallel(tp=tp, cp=cp, seed=11):
        rank = ps.get_context_parallel_rank()
        model = build_gpt(SPEC)
        rows: dict[tuple[int, int], torch.Tensor] = {}
        if fmt == "thd":
            batch = pack_sequences(seqs, cp_size=cp, cp_rank=rank, pad_to_multiple_of=2)
            logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
            logits = gather_from_tensor_model_parallel_region(logits)[0]  # [T_local, V]
            loss = logits.new_zeros(())
            for i in range(logits.shape[0]):
                n, pos = int(batch.sequence_ids[i]), int(batch.position_ids[0, i])
                if n < len(seqs) and pos < LENGTHS[n]:
                    loss = loss + (logits[i] * weights[n][pos]).sum()
                    rows[(n, pos)] = logits[i].detach()
        else:
            tokens, lengths = pad_sequences(seqs, pad_to_multiple_of=2 * cp)  # [B, S]
            local = zigzag_split(tokens, cp, rank, dim=1)
            gpos = zigzag_bshd_global_index(local.shape[1], cp, rank)
            positions = gpos.unsqueeze(0).expand_as(local).contiguous()
            logits = model(local, positions, None)
            logits = gather_from_tensor_model_parallel_region(logits)  # [B, S_local, V]
            loss = logits.new_zeros(())
            for n in range(len(seqs)):
                for j, pos in enumerate(gpos.tolist()):
                    if pos < int(lengths[n]):
                        loss = loss + (logits[n, j] * weights[n][pos]).sum()
                        rows[(n, pos)] = logits[n, j].detach()
        loss.backward()
        return rows, _full_grads(model)


def _merge(results) -> dict[tuple[int, int], torch.Tensor]:
    merged: dict[tuple[int, int], torch.Tensor] = {}
    for rows, _ in results:
        merged.update(rows)
    return merged


def _check(results, reference, tp: int) -> None:
    ref_rows, ref_grads = reference[0]
    rows = _merge(results)
    assert set(rows) == set(ref_rows) == {(n, p) for n, length in enumerate(LENGTHS) for p in range(length)}
    for key, value in ref_rows.items():
        # Same weights; CP alone reproduces the unsharded keys bit for bit (measured max diff 0),
        # TP splits the matmul reductions: fp32 rounding only (measured 9e-8 on logits ~1).
        torch.testing.assert_close(rows[key], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for _, grads in results:
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            # Gradients sum over positions in a different order per layout (measured <= 5e-7 of
            # the largest entry).
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
            assert g.abs().sum() > 0 or ref_grads[name].abs().sum() == 0


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_cp2_equals_cp1(pool2, fmt):
    reference = pool2.run(_run, 1, 1, fmt)
    results = pool2.run(_run, 1, 2, fmt)
    _check(results, reference, tp=1)
    # each CP rank really holds only part of the positions
    assert all(0 < len(rows) < sum(LENGTHS) for rows, _ in results)


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_tp2_cp2_equals_unsharded(pool4, fmt):
    reference = pool4.run(_run, 1, 1, fmt)
    results = pool4.run(_run, 2, 2, fmt)
    _check(results, reference, tp=2)


def _bad_cu(cp: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(cp=cp, seed=1):
        core = build_gpt(SPEC).decoder.layers[0].self_attention.core_attention
        cu = torch.tensor([0, 6, 12], dtype=torch.int32)  # 6 is not a multiple of 2*cp=4
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
        q = torch.zeros(6, 4, 8)
        kv = torch.zeros(6, 2, 8)
        try:
            core(q, kv, kv, None, packed_seq_params=params)
        except ValueError as e:
            return str(e)
        return None


def test_unpadded_thd_under_cp_is_rejected(pool2):
    """Megatron's own rotary embedding fails on such input with a shape error; the core attention
    says what is wrong."""
    messages = pool2.run(_bad_cu, 2)
    assert all(m is not None and "multiple of 2*cp_size=4" in m for m in messages)
