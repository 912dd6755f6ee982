"""``integrations/rl_metrics.py``: the per-micro-batch extremes and the step's reduction, with
values derived by hand.

A CP rank or micro-batch with no response token on it is normal (short answers, a CP shard that
holds only prompt): its extremes must be "no value" (NaN), never an exception. CI failed on exactly
that case (``amax()`` of an empty tensor in ``examples/megatron/train_grpo.py --cp 2``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from megatron_mis.config import MISConfig
from megatron_mis.core.aggregation import Denominators
from megatron_mis.integrations.rl_metrics import engine_metrics, masked_extreme, reduce_metric_store


def test_masked_extreme_picks_over_the_mask_only():
    v = torch.tensor([1.0, 7.0, 2.0, -3.0])
    m = torch.tensor([True, False, True, False])
    assert masked_extreme(v, m, "max").item() == 2.0
    assert masked_extreme(v, m, "min").item() == 1.0


def test_masked_extreme_of_an_empty_or_fully_masked_tensor_is_nan():
    for v, m in ((torch.zeros(0), torch.zeros(0, dtype=torch.bool)), (torch.ones(3), torch.zeros(3, dtype=torch.bool))):
        for kind in ("max", "min"):
            out = masked_extreme(v, m, kind)
            assert out.dim() == 0 and out.dtype == torch.float64 and math.isnan(out.item())


def test_engine_metrics_on_a_micro_batch_without_tokens():
    empty = torch.zeros(0)
    res = SimpleNamespace(token_metrics={"mis_k3_kl": torch.zeros(0)})
    out = engine_metrics(res, empty, empty, torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), MISConfig())
    assert out["lsum/mis_ratio"].item() == 0.0 and out["lsum/mis_k3_kl"].item() == 0.0
    for key in ("max/mis_ratio", "min/mis_ratio", "max/mis_k3_kl"):
        assert math.isnan(out[key].item()), key


def test_a_rank_without_tokens_does_not_change_the_step_extremes():
    """Two micro-batches, one empty: the step's extremes are the other one's (ratios e^0.5, e^-0.25)."""
    mis = MISConfig()
    train = torch.tensor([0.5, -0.25])
    roll = torch.zeros(2)
    lmask = torch.ones(2, dtype=torch.bool)
    full = engine_metrics(SimpleNamespace(token_metrics={}), train, roll, lmask, lmask, mis)
    empty = engine_metrics(SimpleNamespace(token_metrics={}), torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), mis)
    counts = {"count/num_loss_tokens": 2.0, "count/num_denominator_tokens": 2.0, "count/num_denominator_sequences": 1.0}
    zero = {k: 0.0 for k in counts}
    store = [dict(full, **{k: torch.tensor(v) for k, v in counts.items()}), dict(empty, **{k: torch.tensor(v) for k, v in zero.items()})]

    def all_reduce(t, op="sum"):
        return t

    out = reduce_metric_store(store, Denominators(num_tokens=2.0, num_sequences=1.0), all_reduce)
    assert math.isclose(out["mis_ratio_max"], math.exp(0.5), rel_tol=1e-6)
    assert math.isclose(out["mis_ratio_min"], math.exp(-0.25), rel_tol=1e-6)
    assert math.isclose(out["mis_ratio"], (math.exp(0.5) + math.exp(-0.25)) / 2, rel_tol=1e-6)
