"""The benchmark's naive per-sequence baseline computes what the engine computes, so
``benchmarks/bench_mis.py`` compares equal work."""

from __future__ import annotations

import sys
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from naive_mis import naive_mis  # noqa: E402

from megatron_mis import MISConfig  # noqa: E402
from megatron_mis.core.engine import compute_mis_from_lists  # noqa: E402
from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp  # noqa: E402


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


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mis.py"


def test_floor_does_the_whole_pass():
    """The floor the engine is compared with computes a real result: the truncated token ratio
    over the loss mask and the keep mask (a floor that skipped work would make every ratio to it
    meaningless)."""
    from bench_mis import floor_fn

    g = torch.Generator().manual_seed(5)
    train = -torch.rand(1000, generator=g) * 4
    rollout = train + torch.randn(1000, generator=g) * 0.5
    mask = (torch.rand(1000, generator=g) > 0.3).long()
    w, keep = floor_fn(train, rollout, mask, 1.5)
    want = torch.where(mask > 0, torch.exp(train - rollout).clamp(max=1.5), torch.zeros(()))
    assert torch.equal(keep, mask > 0)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    assert bool((w[~keep] == 0).all()) and bool((w[keep] > 0).all())


def test_dropin_floor_returns_what_the_dropin_returns():
    """The drop-in floor does the host contract's work and no more: with plain token truncation
    (no rejection, no normalisation) its loss and masks are the drop-in's, a NaN loss at a
    token out of the mask included."""
    from bench_mis import dropin_floor_fn

    g = torch.Generator().manual_seed(6)
    lengths = [7, 1, 30, 12]
    train = [-torch.rand(n, generator=g) * 4 for n in lengths]
    rollout = [t + torch.randn(n, generator=g) * 0.5 for t, n in zip(train, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.3).long() for n in lengths]
    masks[2][3] = 0
    pg = torch.randn(sum(lengths), generator=g)
    pg[7 + 1 + 3] = float("nan")
    loss, out_masks = dropin_floor_fn(train, rollout, masks, lengths, pg, 1.5)
    args = Namespace(custom_config_path=None, use_tis=True, tis_upper_bound=1.5, tis_level="token", tis_mode="truncate")
    want_loss, want_masks, _ = compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert [m.dtype for m in out_masks] == [torch.int64] * 4
    assert all(torch.equal(a, b) for a, b in zip(out_masks, want_masks))
    assert loss[11] == 0 and bool(torch.isfinite(loss).all())
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)


def _bench(*args: str):
    import subprocess

    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)


def test_bench_runs_and_prints_every_ratio():
    """One tiny run of the benchmark as a user runs it: every timed function is printed, and each
    engine row carries its ratio to the per-sequence implementation and to the floor."""
    proc = _bench("--repeats", "1", "--threads", "1", "--shapes", "6:4:20")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "6 sequences of 4-20 tokens" in out
    for name in ("per-sequence (every statistic)", "floor (one pass)", "floor (one pass), back to back",
                 "drop-in floor (lists in and out)", "drop-in floor (lists in and out), back to back"):
        assert f"  {name} " in out, name
    for name in ("engine", "weights only"):
        row = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert row.count("per-sequence") == 1 and "] fastest floor, " in row and "] floor of the round, " in row and row.endswith("] drop-in floor"), row
        row = next(line for line in out.splitlines() if line.startswith(f"  {name}, back to back "))
        assert row.endswith("] floor back to back") and "per-sequence" not in row, row


@pytest.mark.parametrize("shape, why", [("long", "three integers"), ("4:8:2", "MIN_LEN <= MAX_LEN"), ("0:1:2", "SEQUENCES >= 1")])
def test_bench_refuses_a_bad_shape_naming_it(shape, why):
    proc = _bench("--shapes", shape)
    assert proc.returncode == 2
    assert repr(shape) in proc.stderr and why in proc.stderr and "Traceback" not in proc.stderr
