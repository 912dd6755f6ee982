"""Where a GPU is lent: the synchronisation-free paths run for real under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronising CUDA call raises). Skipped
without CUDA; the fake-CUDA tests in this folder cover the same paths on a CPU-only build."""

from __future__ import annotations

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs under set_sync_debug_mode('error'))")


def test_compute_mis_does_not_synchronise_on_a_gpu():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, length = 8, 32
    train = (torch.randn(n * length, device=dev) * 0.1 - 1.0)
    rollout = train + torch.randn(n * length, device=dev) * 0.05
    mask = torch.rand(n * length, device=dev) > 0.2
    cu = torch.arange(0, n * length + 1, length, device=dev)
    compute_mis(train, rollout, mask, cu, MISConfig())  # warm-up (allocator, lazy init)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compute_mis(train, rollout, mask, cu, MISConfig())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.weights.device.type == "cuda"
