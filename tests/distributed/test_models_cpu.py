"""The CPU model path: a tiny Megatron-Core GPTModel runs forward and backward over gloo, gives
the same logits under TP=1 and TP=2, and the CPU shims install and remove themselves."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.testbed.models.gpt import GPTSpec

SPEC = GPTSpec(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=64)


def _logits(tp: int, tokens: torch.Tensor, packed: bool):
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_mis.testbed.models.gpt import build_gpt
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=tp, seed=7):
        model = build_gpt(SPEC)
        if packed:
            lengths = [5, 9, 2]
            cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
            flat = tokens[:, :16].reshape(1, -1)[:, :16]
            pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            out = model(flat, pos, None, packed_seq_params=params)
        else:
            pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            out = model(tokens, pos, None)
        out.sum().backward()
        grad_norm = sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)
        full = gather_from_tensor_model_parallel_region(out.detach())
        return full, dist.get_rank(), float(grad_norm) > 0


@pytest.mark.parametrize("packed", [False, True])
def test_gpt_tp2_equals_tp1(pool2, packed):
    tokens = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = pool2.run(_logits, 1, tokens, packed)
    tp2 = pool2.run(_logits, 2, tokens, packed)
    # Same full weights (CPU init from one seed), different reduction split: fp32 rounding only.
    torch.testing.assert_close(tp2[0][0], ref[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2[1][0], ref[0][0], rtol=1e-5, atol=1e-5)
    assert all(r[2] for r in ref + tp2)


def test_packed_equals_separate_sequences(pool2):
    """thd packing through SDPACoreAttention = running each sequence alone."""
    tokens = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    packed = pool2.run(_logits, 1, tokens, True)[0][0]  # [1, 16, V]
    flat = tokens.reshape(-1)[:16]
    starts, lengths = [0, 5, 14], [5, 9, 2]
    for s, n in zip(starts, lengths):
        single = pool2.run(_logits, 1, flat[s : s + n].unsqueeze(0).expand(2, -1).contiguous(), False)[0][0]
        torch.testing.assert_close(packed[0, s : s + n], single[0], rtol=1e-5, atol=1e-5)


def test_cpu_compat_installs_and_removes():
    from megatron.core.pipeline_parallel import schedules

    from megatron_mis.testing.cpu import cpu_compat, cpu_compat_active

    original = torch.cuda.current_device
    original_sync = torch.cuda.synchronize
    original_torch = schedules.torch
    with cpu_compat():
        with cpu_compat():  # re-entrant
            assert cpu_compat_active()
            assert torch.cuda.current_device() == "cpu"
            torch.cuda.synchronize()  # no CUDA needed
            assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        assert cpu_compat_active()
    assert not cpu_compat_active()
    assert torch.cuda.current_device is original
    assert torch.cuda.synchronize is original_sync
    assert schedules.torch is original_torch
