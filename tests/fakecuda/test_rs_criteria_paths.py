"""The fake-CUDA tier for ``tis_mode: icepop`` and the divergence criteria (``rs_criteria``):
``compute_mis`` on fake ``cuda:0`` tensors reads nothing back to the host, returns no CPU tensor,
and gives the CPU run's values."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.config.mis import RS_CRITERIA
from megatron_mis.core.engine import compute_mis
from megatron_mis.testing.fake_cuda import shadow

ALL = {name: (1.3 if name.endswith("k1") else 0.02) for name in RS_CRITERIA.names()}

CONFIGS = [
    dict(use_tis=True, tis_mode="icepop", tis_lower_bound=0.8, tis_upper_bound=1.25),
    dict(use_tis=True, tis_mode="icepop", tis_lower_bound=0.8, tis_upper_bound=1.25, mis_metrics="full", tis_batch_normalize=True),
    dict(use_tis=True, tis_mode="icepop", mis_metrics="none"),
    dict(use_rs=True, rs_criteria={"seq_mean_k3": 0.005}),
    dict(use_rs=True, rs_criteria={"seq_max_k3": 0.05}, mis_metrics="none"),
    dict(use_rs=True, rs_criteria={"token_k1": [0.8, 1.25], "token_k2": 0.02, "token_k3": 0.02}),
    dict(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": 0.01, "z": 1.0}}),
    dict(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch", "z": 1.0}}, mis_metrics="none"),
    dict(use_tis=True, tis_batch_normalize=True, use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch"}}),
    dict(use_rs=True, rs_criteria=ALL),
    dict(use_rs=True, rs_criteria=ALL, mis_metrics="none"),
    dict(use_tis=True, tis_mode="icepop", use_rs=True, rs_criteria=ALL, mis_metrics="full"),
]


def _batch(n=6, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = n * length
    train = torch.randn(t, generator=g) * 0.3 - 1.5
    rollout = train + torch.randn(t, generator=g) * 0.2
    mask = torch.rand(t, generator=g) > 0.15
    return train, rollout, mask, torch.tensor([0] + list(itertools.accumulate([length] * n)))


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items() if k != "rs_criteria")
                         + (",criteria=" + "+".join(o["rs_criteria"]) if "rs_criteria" in o else ""))
def test_compute_mis_has_no_host_synchronisation(probe, overrides):
    cfg = MISConfig(**overrides)
    train, rollout, mask, cu = _batch()
    with probe.paused():
        ref = compute_mis(train, rollout, mask, cu, cfg)
    for offsets in (probe.cuda(cu), cu.tolist()):
        probe.clear()
        out = compute_mis(*probe.cuda((train, rollout, mask)), offsets, cfg)
        probe.check_outputs([out.weights, out.keep_mask, out.seq_weights, out.token_metrics, out.summary])
        probe.assert_clean(what=f"compute_mis({overrides})")
        probe.assert_matches(out.weights, ref.weights)
        assert torch.equal(shadow(out.keep_mask), ref.keep_mask)
        for name, value in ref.summary.items():
            probe.assert_matches(out.summary[name], value, equal_nan=True)
