"""The CPU twins that :func:`megatron_mis.testing.cpu.cpu_compat` installs in Megatron's optimizer
(gradient norm and clipping), on hand-derived values, and their installation and removal.
(The shims at work: ``tests/e2e/test_examples_megatron.py`` trains with ``get_megatron_optimizer``.)"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mis.testing.cpu import _clip_grad_by_total_norm_cpu, _grad_norm_cpu, cpu_compat


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def test_grad_norm_hand_values():
    grads = [torch.tensor([3.0, -4.0]), torch.tensor([12.0])]
    assert _grad_norm_cpu(grads) == pytest.approx(13.0)  # sqrt(9 + 16 + 144)
    assert _grad_norm_cpu(grads, norm_type=math.inf) == 12.0
    assert _grad_norm_cpu(grads, norm_type=1) == pytest.approx(19.0)
    assert _grad_norm_cpu([]) == 0.0


def test_clip_scales_only_above_the_bound():
    params = _params([3.0, -4.0], [12.0])
    _clip_grad_by_total_norm_cpu(params, max_norm=6.5, total_norm=13.0)
    coeff = 6.5 / (13.0 + 1e-6)
    assert torch.allclose(params[0].grad, torch.tensor([3.0, -4.0]) * coeff)
    assert torch.allclose(params[1].grad, torch.tensor([12.0]) * coeff)
    params = _params([3.0, -4.0])
    _clip_grad_by_total_norm_cpu(params, max_norm=10.0, total_norm=5.0)
    assert torch.equal(params[0].grad, torch.tensor([3.0, -4.0]))


def test_cpu_compat_installs_and_removes_the_optimizer_twins():
    from megatron.core.optimizer import clip_grads, optimizer

    before = (clip_grads.get_grad_norm_fp32, optimizer.clip_grad_by_total_norm_fp32, optimizer.torch)
    with cpu_compat():
        assert clip_grads.get_grad_norm_fp32 is _grad_norm_cpu
        assert optimizer.get_grad_norm_fp32 is _grad_norm_cpu
        assert optimizer.clip_grad_by_total_norm_fp32 is _clip_grad_by_total_norm_cpu
        assert optimizer.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert (clip_grads.get_grad_norm_fp32, optimizer.clip_grad_by_total_norm_fp32, optimizer.torch) == before


def test_cpu_compat_installs_its_shims_where_cuda_is_available_too(monkeypatch):
    """The testbed's models run on the CPU on a GPU machine too: cpu_compat once returned early
    there, and Megatron's schedule put its buffers on the GPU ('megatron-mis demo' failed with a
    cuda:0 / cpu device mismatch on an H100, 2026-11-27). torch.cuda.is_available() is made True
    and torch.cuda.current_device() returns device 0, as on a one-GPU machine.

    torch's own modules still get the device index: TorchDynamo reads it
    (``torch._dynamo.device_interface``) when it compiles Megatron's MoE router, and with ``"cpu"``
    every MoE model of the testbed failed on an H100 ("list indices must be integers or slices,
    not str", 32 tests, 2026-11-27)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from torch._dynamo.device_interface import CudaInterface

    from megatron_mis.testbed.cpu_moe import cpu_rng_shims

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fork = mrandom.CudaRNGStatesTracker.fork
    with cpu_compat(), cpu_rng_shims():
        assert torch.cuda.current_device() == "cpu"
        assert CudaInterface.Worker.current_device() == 0
        assert schedules.torch.zeros(1, device="cuda").device.type == "cpu"
        assert mrandom.CudaRNGStatesTracker.fork is not fork
    assert mrandom.CudaRNGStatesTracker.fork is fork and schedules.torch is torch
