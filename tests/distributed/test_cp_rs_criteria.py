"""Divergence criteria (``rs_criteria``) and ``tis_mode: icepop`` under context parallelism
(gloo, CP = 2 and 4): every rank gets its zigzag pieces, the reassembled weights, keep masks,
full-length modified masks and metrics equal the single-process engine on whole sequences, and
the number of collectives per call is the documented one — the sequence sums of k2 / k3 and the
extrema of log r behind ``seq_max_*`` ride in the one statistics all-gather (no MAX collective),
as does every rank's status.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis_from_lists
from megatron_mis.parallel.layout import local_response_layout

CONFIGS = {
    "seq_criteria": dict(use_rs=True, rs_criteria={"seq_mean_k3": 0.01, "seq_max_k3": 0.08, "seq_sum_k2": 0.1,
                                                   "seq_mean_k1": [0.95, 1.06], "seq_max_k2": 0.09, "seq_sum_k3": 0.1,
                                                   "seq_mean_k2": 0.012, "seq_sum_k1": 1.6}),
    "token_and_seq_criteria_tis": dict(use_tis=True, tis_batch_normalize=True, use_rs=True,
                                       rs_criteria={"token_k1": [0.7, 1.4], "token_k2": 0.04, "token_k3": 0.05,
                                                    "seq_mean_k3": 0.012}),
    "icepop_seq_max": dict(use_tis=True, tis_mode="icepop", tis_lower_bound=0.75, tis_upper_bound=1.3,
                           use_rs=True, rs_criteria={"seq_max_k3": 0.1}, mis_metrics="full"),
    # the length-scaled geometric band: a fixed K3, and K3 measured on the call (with metrics off
    # the per-sequence k3 sums exist for this criterion alone: they must ride in the all-gather)
    "zscore_fixed_tis": dict(use_tis=True, tis_batch_normalize=True, use_rs=True,
                             rs_criteria={"seq_zscore_k1": {"k3": 0.003, "z": 1.5}}),
    "zscore_batch_no_metrics": dict(use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch", "z": 0.5}}, mis_metrics="none"),
    "icepop_alone": dict(use_tis=True, tis_mode="icepop", tis_lower_bound=0.8, tis_upper_bound=1.25),
}


def _cfg(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**CONFIGS[name])


@pytest.fixture(scope="module")
def light_pool4():
    """4 ranks without the Megatron CPU shims: the CP drop-in never imports Megatron."""
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(4, timeout=300.0, cpu_compat=False) as pool:
        yield pool


def make_batch(seed: int):
    """Awkward sequences: lengths not multiples of 2 cp, a prompt longer than a chunk (ranks with
    no response token), a zero-length response, multi-turn holes, a NaN log-prob, and a mismatch
    that differs per sequence (so that every criterion rejects some sequences and keeps others)."""
    g = torch.Generator().manual_seed(seed)
    totals, resps = [], []
    for _ in range(9):
        r = int(torch.randint(1, 30, (1,), generator=g))
        p = int(torch.randint(1, 9, (1,), generator=g))
        totals.append(p + r)
        resps.append(r)
    totals += [40, 13, 6]
    resps += [5, 0, 5]
    train, rollout, masks = [], [], []
    for i, r in enumerate(resps):
        a = -torch.rand(r, generator=g) * 3
        scale = (0.02, 0.1, 0.25, 0.05)[i % 4]
        b = a + torch.randn(r, generator=g) * scale
        if i == 3 and r > 2:
            a[1] = float("nan")
        train.append(a)
        rollout.append(b)
        masks.append((torch.rand(r, generator=g) > 0.2).to(torch.int64))
    return totals, resps, train, rollout, masks


def _slice(full, lay, i):
    pieces = [full[i][s:e] for s, e in lay.ranges[i].tolist()]
    return torch.cat(pieces) if pieces else full[i][:0]


def run_case(cp: int, cfg_name: str, seed: int):
    from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp
    from megatron_mis.parallel.state import GroupView

    rank = dist.get_rank()
    groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, dist.get_world_size(), cp)]
    group = groups[rank // cp]
    view = GroupView(rank=rank % cp, size=cp, group=group)
    totals, resps, train, rollout, masks = make_batch(seed)
    lay = local_response_layout(totals, resps, cp, rank % cp)
    inputs = CPInputs(
        train_log_probs=[_slice(train, lay, i) for i in range(len(resps))],
        rollout_log_probs=[_slice(rollout, lay, i) for i in range(len(resps))],
        loss_masks=masks, total_lengths=totals, response_lengths=resps,
    )
    from megatron_mis.testing.distributed import collective_calls

    with collective_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compute_mis_cp(inputs, _cfg(cfg_name), view)
        summary = out.result.scalars()
    return dict(
        rank=rank, index=lay.local_to_full_index(), weights=out.result.weights, keep=out.result.keep_mask,
        masks=out.modified_masks, metrics=out.result.token_metrics, summary=summary,
        collectives=out.num_collectives, calls=calls,
    )


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_cp_equals_one_process(light_pool4, cfg_name):
    cfg = _cfg(cfg_name)
    seed = 31
    totals, resps, train, rollout, masks = make_batch(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = compute_mis_from_lists(train, rollout, masks, cfg)
        ref_summary = ref.scalars()
    # not vacuous: something is rejected (or zero-weighted) and something kept
    kept, loss_tokens = int(ref.keep_mask.sum()), sum(int(m.sum()) for m in masks)
    assert 0 < kept and (kept < loss_tokens or ref_summary.get("mis_tis_zero_weight_fraction_high", 0) > 0)
    expected_masks = [m * k.long() for m, k in zip(masks, ref.split(ref.keep_mask, resps))]
    for cp in (2, 4):
        results = light_pool4.run(run_case, cp, cfg_name, seed)
        for start in range(0, 4, cp):
            group = results[start:start + cp]
            full_w = torch.zeros_like(ref.weights)
            full_k = torch.zeros_like(ref.keep_mask)
            full_metrics = {k: torch.zeros_like(v) for k, v in ref.token_metrics.items()}
            for r in group:
                idx = r["index"]
                full_w[idx] = r["weights"]
                full_k[idx] = r["keep"]
                for k in full_metrics:
                    full_metrics[k][idx] = r["metrics"][k]
                for got, want in zip(r["masks"], expected_masks):  # full length, right on every rank
                    assert torch.equal(got, want), (cp, r["rank"])
                # one all-gather of statistics and status (+ the uint8 all-reduce only with
                # token-level rejection): seq_max needs no second (MAX) collective
                expected = 2 if cfg.token_rejects else 1
                assert r["collectives"] == expected and len(r["calls"]) == expected, (r["calls"], cp)
                for k, v in r["summary"].items():
                    assert v == pytest.approx(ref_summary[k], rel=1e-5, abs=1e-6), (k, cp)
            assert torch.equal(full_k, ref.keep_mask), cp
            torch.testing.assert_close(full_w, ref.weights, rtol=1e-6, atol=1e-7, msg=f"cp={cp}")
            for k, v in full_metrics.items():
                torch.testing.assert_close(v, ref.token_metrics[k], rtol=1e-5, atol=1e-6, msg=f"{k} cp={cp}")


def test_token_criteria_need_the_bit_exchange_and_sequence_criteria_do_not():
    assert _cfg("token_and_seq_criteria_tis").token_rejects
    assert not _cfg("seq_criteria").token_rejects
    assert not _cfg("icepop_alone").token_rejects and not _cfg("icepop_seq_max").token_rejects
