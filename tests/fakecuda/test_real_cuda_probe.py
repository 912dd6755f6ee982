"""The real-GPU probe's bookkeeping (megatron_mis/testing/real_cuda.py), on a CPU build: the
CUDA calls it makes are replaced by recorders, and the sync-debug mode's warning is raised as
the CUDA runtime raises it (a Python warning). On a GPU the tier itself exercises it
(``MEGATRON_MIS_REAL_CUDA_TIER=1 python -m pytest tests/fakecuda``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_mis.testing import real_cuda as rc


@pytest.fixture
def fake_runtime(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def _synchronising_op():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)  # what TORCH_WARN raises in Python


def test_a_synchronisation_is_recorded_where_it_happens_and_not_while_paused(fake_runtime):
    with rc.real_cuda() as probe:
        assert fake_runtime == ["warn"]
        _synchronising_op()
        with probe.paused():
            assert fake_runtime[-1] == "default"
            _synchronising_op()  # set-up / reference code: not recorded
        assert fake_runtime[-1] == "warn"
        with pytest.warns(DeprecationWarning, match="unrelated"):
            warnings.warn("unrelated", DeprecationWarning)  # other warnings pass through
        assert probe.count() == 1 and probe.count(rc.SYNC) == 1
        (v,) = probe.violations
        assert "test_real_cuda_probe.py" in v.where and "_synchronising_op" in v.where
        with pytest.raises(AssertionError, match="1 host synchronisation"):
            probe.assert_clean(what="x")
        probe.assert_clean(allowed=1)
        probe.check_outputs([torch.zeros(3), torch.tensor(1.0)])  # a CPU tensor with elements is recorded
        assert probe.count() == 2 and "shape (3,)" in probe.report()
        probe.clear()
        probe.assert_clean()
    assert fake_runtime[-1] == "default" and rc.RealCudaProbe.current is None


def test_real_cuda_refuses_without_a_device_and_when_nested(fake_runtime, monkeypatch):
    with rc.real_cuda():
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with rc.real_cuda():
                pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with rc.real_cuda():
            pass
