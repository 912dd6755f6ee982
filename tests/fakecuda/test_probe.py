"""Self-test of the fake-CUDA probe: every kind of synchronisation it promises to catch is caught
(with this file's line), and the synchronisation-free patterns the library uses are not flagged."""

from __future__ import annotations

import torch

from megatron_mis.testing import fake_cuda as fc


def _one(probe, kind, fn):
    probe.clear()
    fn()
    assert [v.kind for v in probe.violations] == [kind], probe.report()
    assert "tests/fakecuda/test_probe.py:" in probe.violations[0].where, probe.violations[0]
    probe.clear()


def test_each_kind_of_synchronisation_is_detected_with_its_line(fake_probe):
    probe = fake_probe
    a = probe.cuda(torch.arange(6.0))
    cpu_mask = torch.tensor([True, False] * 3)
    _one(probe, fc.BLOCKING_H2D, lambda: torch.ones(3).to("cuda"))
    _one(probe, fc.BLOCKING_H2D, lambda: torch.tensor([1, 2], device="cuda"))
    _one(probe, fc.BLOCKING_H2D, lambda: a[[0, 2]])  # a Python list index is copied blocking
    _one(probe, fc.CPU_INDEX, lambda: a[torch.tensor([0, 2])])
    _one(probe, fc.HOST_READ, lambda: a.sum().item())
    _one(probe, fc.HOST_READ, lambda: bool(a[1] > 0))
    _one(probe, fc.HOST_READ, lambda: int(a[1]))
    _one(probe, fc.HOST_READ, lambda: float(a[1]))
    _one(probe, fc.HOST_READ, lambda: a.tolist())
    _one(probe, fc.HOST_READ, lambda: a.cpu())
    _one(probe, fc.DATA_DEPENDENT, lambda: a[a > 2])
    _one(probe, fc.DATA_DEPENDENT, lambda: a.nonzero())
    _one(probe, fc.DATA_DEPENDENT, lambda: torch.masked_select(a, a > 2))
    _one(probe, fc.DATA_DEPENDENT, lambda: a.unique())
    _one(probe, fc.DATA_DEPENDENT, lambda: torch.repeat_interleave(probe.cuda(torch.tensor([1, 2]))))
    _one(probe, fc.DEVICE_MISMATCH, lambda: a + torch.ones(6))
    _one(probe, fc.DATA_DEPENDENT, lambda: a[probe.cuda(cpu_mask)])
    _one(probe, fc.EXPLICIT_SYNC, lambda: torch.cuda.synchronize())
    _one(probe, fc.CPU_OUTPUT, lambda: probe.check_outputs({"w": torch.ones(2)}))


def test_synchronisation_free_patterns_pass_and_values_are_real(probe):
    a = probe.cuda(torch.arange(6.0))
    host = torch.tensor([0, 2, 4])
    idx = host.pin_memory().to("cuda", non_blocking=True)  # pinned + non_blocking: no sync
    picked = a[idx]
    b = torch.where(a > 2, a, torch.zeros_like(a)) * torch.tensor(2.0)  # CPU 0-dim scalars are fine
    c = a.masked_fill(a > 4, 0.0).index_select(0, idx)
    reps = torch.repeat_interleave(probe.cuda(torch.tensor([1, 2])), output_size=3)  # size given: no read
    pinned = torch.empty((), dtype=torch.float32, pin_memory=True)
    pinned.copy_(a.sum(), non_blocking=True)  # the DeferredCount pattern
    ev = torch.cuda.Event()
    ev.record()
    assert ev.query()
    probe.check_outputs((picked, b, c, reps))
    probe.assert_clean(what="sync-free patterns")
    assert picked.device.type == "cuda" and b.device.type == "cuda"
    assert fc.shadow(picked).tolist() == [0.0, 2.0, 4.0]
    assert fc.shadow(b).tolist() == [0.0, 0.0, 0.0, 6.0, 8.0, 10.0]
    assert fc.shadow(c).tolist() == [0.0, 2.0, 4.0]
    assert fc.shadow(reps).tolist() == [0, 1, 1]
    assert float(pinned) == 15.0


def test_backward_walked_by_hand_matches_cpu_autograd(fake_probe):
    probe = fake_probe
    x_cpu = torch.linspace(-1.0, 2.0, 5, requires_grad=True)
    x = probe.cuda(x_cpu.detach().clone().requires_grad_())
    loss = (torch.log_softmax(x, 0) * x).sum() + x.pow(2).mean()
    fc.backward(loss)
    probe.assert_clean(what="backward")
    ref = (torch.log_softmax(x_cpu, 0) * x_cpu).sum() + x_cpu.pow(2).mean()
    ref.backward()
    torch.testing.assert_close(fc.shadow(x.grad), x_cpu.grad, rtol=0, atol=0)


def test_assert_clean_names_every_line(probe):
    a = probe.cuda(torch.ones(3))
    a.sum().item()
    torch.ones(2).to("cuda")
    try:
        probe.assert_clean(what="demo")
    except AssertionError as exc:
        text = str(exc)
    else:
        raise AssertionError("assert_clean passed with two synchronisations")
    assert "2 host synchronisation(s)" in text and text.count("tests/fakecuda/test_probe.py:") == 2


def test_nothing_stays_installed():
    reason = fc.fake_cuda_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)
    with fc.fake_cuda():
        pass
    assert fc.SyncProbe.current is None
    assert fc._guard_registry()[1] is None
    try:
        torch.ones(2).to("cuda")
    except (RuntimeError, AssertionError):
        pass
    else:
        raise AssertionError("CUDA still reachable after fake_cuda() exited")
