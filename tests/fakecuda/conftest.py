"""The fake-CUDA tier: public entry points on ``cuda:0`` tensors (megatron_mis.testing.fake_cuda)
must not synchronise with the host on a per-micro-batch path. Skipped, with the reason, where
the harness cannot run (on a CUDA machine the real-device tests in test_real_cuda.py run instead)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_mis.testing.fake_cuda import fake_cuda, fake_cuda_unavailable_reason


@pytest.fixture
def probe():
    if os.environ.get("MEGATRON_MIS_REAL_CUDA_TIER") == "1" and torch.cuda.is_available():
        # the same tests on a GPU under set_sync_debug_mode (megatron_mis/testing/real_cuda.py)
        from megatron_mis.testing.real_cuda import real_cuda

        with real_cuda() as p:
            yield p
        return
    reason = fake_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"fake CUDA unavailable: {reason}")
    with fake_cuda() as p:
        yield p


@pytest.fixture
def fake_probe():
    """The fake device's probe only: for tests of the fake probe itself (its kinds, its op hook),
    skipped where it cannot run, the real-GPU tier included."""
    reason = fake_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"fake CUDA unavailable: {reason}")
    with fake_cuda() as p:
        yield p
