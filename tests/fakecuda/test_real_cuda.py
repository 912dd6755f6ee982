"""Where a GPU is lent: the synchronisation-free paths run for real under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronising CUDA call raises). Skipped
without CUDA; the fake-CUDA tests in this folder cover the same paths on a CPU-only build."""

from __future__ import annotations

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs under set_sync_debug_mode('error'))")]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile_engine"])
def test_compute_mis_does_not_synchronise_on_a_gpu(compiled):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, length = 8, 32
    train = (torch.randn(n * length, device=dev) * 0.1 - 1.0)
    rollout = train + torch.randn(n * length, device=dev) * 0.05
    mask = torch.rand(n * length, device=dev) > 0.2
    cu = torch.arange(0, n * length + 1, length, device=dev)
    cfg = MISConfig(use_tis=True, use_rs=True, rs_level="geometric", compile_engine=compiled)
    compute_mis(train, rollout, mask, cu, cfg)  # warm-up (allocator, lazy init, compilation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compute_mis(train, rollout, mask, cu, cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.weights.device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs_and_autocast_give_the_float32_result_on_a_gpu(dtype):
    """Log-probs handed over in bf16 / fp16 (a bf16 trainer's output), and the engine called
    inside ``torch.autocast``: the engine computes in float32 either way, so the weights and
    summaries equal those of the same values given in float32; no host synchronisation."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, length = 8, 32
    train = (torch.randn(n * length, device=dev) * 0.1 - 1.0).to(dtype)
    rollout = (train.float() + torch.randn(n * length, device=dev) * 0.05).to(dtype)
    mask = torch.rand(n * length, device=dev) > 0.2
    cu = torch.arange(0, n * length + 1, length, device=dev)
    cfg = MISConfig(use_tis=True, use_rs=True, rs_level="geometric", tis_batch_normalize=True)
    ref = compute_mis(train.float(), rollout.float(), mask, cu, cfg)
    compute_mis(train, rollout, mask, cu, cfg)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        half = compute_mis(train, rollout, mask, cu, cfg)
        with torch.autocast("cuda", dtype=dtype):
            auto = compute_mis(train.float(), rollout.float(), mask, cu, cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in (half, auto):
        assert out.weights.dtype == torch.float32
        torch.testing.assert_close(out.weights, ref.weights, rtol=0, atol=0)
        for name, value in ref.summary.items():
            torch.testing.assert_close(out.summary[name], value, rtol=0, atol=0, equal_nan=True)
