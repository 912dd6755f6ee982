"""The benchmark's naive per-sequence baseline computes what the engine computes, so
``benchmarks/bench_mis.py`` compares equal work."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from naive_mis import naive_mis  # noqa: E402

from megatron_mis import MISConfig  # noqa: E402
from megatron_mis.core.engine import compute_mis_from_lists  # noqa: E402


@pytest.mark.parametrize(
    "cfg",
    [
        dict(use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5, rs_lower_bound=0.99,
             rs_upper_bound=1.01, rs_veto_threshold=0.3, tis_batch_normalize=True),
        dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_lower_bound=1e-8, tis_upper_bound=2.0,
             tis_batch_normalize=True),
        dict(use_tis=True, tis_mode="clip", use_rs=True, rs_level="token"),
    ],
)
def test_naive_baseline_matches_engine(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = MISConfig(**cfg)
    g = torch.Generator().manual_seed(3)
    lengths = [0, 5, 17, 40, 3, 64]
    train = [-torch.rand(n, generator=g) * 3 for n in lengths]
    rollout = [t + torch.randn(n, generator=g) * 0.08 for t, n in zip(train, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.1).long() for n in lengths]
    res = compute_mis_from_lists(train, rollout, masks, cfg)
    weights, keeps, metrics = naive_mis(train, rollout, masks, cfg)
    assert torch.equal(torch.cat(keeps), res.keep_mask)
    torch.testing.assert_close(torch.cat(weights), res.weights, rtol=2e-6, atol=1e-7)
    assert set(metrics) == set(res.token_metrics)  # the full metric set: equal work
    for name, values in metrics.items():
        # float64 per-sequence sums in both; fp32 token values -> fp32-level agreement
        torch.testing.assert_close(torch.cat(values), res.token_metrics[name], rtol=1e-5, atol=1e-6, msg=name)
