"""Context / tensor / data parallel exactness of the MIS drop-in (multi-process, gloo).

For CP in {1, 2, 4} x TP in {1, 2} x DP in {1, 2} (at most 8 ranks), every rank receives its
CP-local pieces of its DP rank's sequences, exactly as slime / Miles hand them to the TIS
function; the reassembled weights, keep masks, full-length modified masks and metrics must equal
the single-process engine on the whole sequences, and TP replicas must agree bitwise.
"""

from __future__ import annotations

import itertools
import math
import warnings
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis_from_lists
from megatron_mis.parallel.layout import local_response_layout

# ------------------------------------------------------------------------ shared helpers
_GROUPS: dict = {}


@pytest.fixture(scope="module")
def light_pool8():
    """8 ranks without the Megatron CPU shims: the CP drop-in itself never imports Megatron."""
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(8, timeout=300.0, cpu_compat=False) as pool:
        yield pool


def _grid(cp: int, tp: int, dp: int):
    """Groups for a cp x tp x dp grid on the first cp*tp*dp ranks (TP fastest, then CP, then DP,
    as Megatron orders them). Every rank creates every group (torch requires it); ranks outside
    the grid get ``None``. Cached per worker process."""
    key = (cp, tp, dp)
    if key not in _GROUPS:
        size = cp * tp * dp
        rank = dist.get_rank()

        def coord(r):
            return r % tp, (r // tp) % cp, r // (tp * cp)

        mine = {}
        for kind in ("tp", "cp", "dp"):
            buckets: dict = {}
            for r in range(size):
                t, c, d = coord(r)
                k = {"tp": (c, d), "cp": (t, d), "dp": (t, c)}[kind]
                buckets.setdefault(k, []).append(r)
            for k in sorted(buckets):
                g = dist.new_group(buckets[k])
                if rank in buckets[k]:
                    mine[kind] = (g, buckets[k])
        _GROUPS[key] = (coord(rank) if rank < size else None, mine)
    return _GROUPS[key]


def _view(entry):
    from megatron_mis.parallel.state import GroupView

    g, ranks = entry
    return GroupView(rank=ranks.index(dist.get_rank()), size=len(ranks), group=g if len(ranks) > 1 else None)


def make_batch(seed: int, cp: int):
    """Sequences with every awkward case: lengths not multiples of 2*cp, a prompt longer than a
    chunk (some ranks hold no response token), a zero-length response, multi-turn mask holes."""
    g = torch.Generator().manual_seed(seed)
    totals, resps = [], []
    for _ in range(7):
        r = int(torch.randint(1, 23, (1,), generator=g))
        p = int(torch.randint(1, 9, (1,), generator=g))
        totals.append(p + r)
        resps.append(r)
    totals += [40, 13, 6]  # a long prompt (35 tokens) with a 5-token response; a zero response
    resps += [5, 0, 5]
    train, rollout, masks = [], [], []
    for r in resps:
        a = -torch.rand(r, generator=g) * 3
        train.append(a)
        rollout.append(a + torch.randn(r, generator=g) * 0.3)
        m = (torch.rand(r, generator=g) > 0.25).to(torch.int64)
        masks.append(m)
    return totals, resps, train, rollout, masks


def _slice(full: list[torch.Tensor], lay, i: int) -> torch.Tensor:
    pieces = [full[i][s:e] for s, e in lay.ranges[i].tolist()]
    return torch.cat(pieces) if pieces else full[i][:0]


CONFIGS = {
    "token_tis_bn": dict(use_tis=True, tis_upper_bound=1.5, tis_batch_normalize=True),
    "geo_rs_token_mask_veto": dict(use_tis=True, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=1.6,
                                   use_rs=True, rs_level="geometric", rs_lower_bound=0.8, rs_upper_bound=1.25,
                                   rs_veto_threshold=0.3),
    "sequence_clip_bn_token_rs": dict(use_tis=True, tis_level="sequence", tis_mode="clip", tis_lower_bound=0.3,
                                      tis_upper_bound=3.0, tis_batch_normalize=True, use_rs=True, rs_level="token",
                                      rs_lower_bound=0.5, rs_upper_bound=2.0),
    "geometric_mask_global": dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.7,
                                  tis_upper_bound=1.4, tis_batch_normalize=True, tis_batch_normalize_scope="global"),
}


def _cfg(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**CONFIGS[name])


# -------------------------------------------------------------------- worker functions
def run_grid_case(cp: int, tp: int, dp: int, cfg_name: str, seed: int):
    from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp
    from megatron_mis.parallel.global_norm import compute_global_normalizer

    coords, mine = _grid(cp, tp, dp)
    if coords is None:
        return None
    tp_rank, cp_rank, dp_rank = coords
    cpv, dpv = _view(mine["cp"]), _view(mine["dp"])
    totals, resps, train, rollout, masks = make_batch(seed + dp_rank, cp)
    lay = local_response_layout(totals, resps, cp, cp_rank)
    inputs = CPInputs(
        train_log_probs=[_slice(train, lay, i) for i in range(len(resps))],
        rollout_log_probs=[_slice(rollout, lay, i) for i in range(len(resps))],
        loss_masks=masks,
        total_lengths=totals,
        response_lengths=resps,
    )
    cfg = _cfg(cfg_name)
    normalizer = None
    if cfg.tis_batch_normalize_scope == "global":
        normalizer = compute_global_normalizer([inputs], cfg, cp=cpv, dp=dpv)
    out = compute_mis_cp(inputs, cfg, cpv, global_normalizer=normalizer)
    res = out.result
    return dict(
        coords=coords,
        index=lay.local_to_full_index(),
        weights=res.weights,
        keep=res.keep_mask,
        masks=out.modified_masks,
        metrics=res.token_metrics,
        summary=res.scalars(),
        normalizer=float(res.normalizer),
        collectives=out.num_collectives,
    )


GRID = [(cp, tp, dp) for cp, tp, dp in itertools.product([1, 2, 4], [1, 2], [1, 2]) if cp * tp * dp <= 8]


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_sharded_equals_unsharded(light_pool8, cfg_name):
    cfg = _cfg(cfg_name)
    seed = 100
    for cp, tp, dp in GRID:
        results = [r for r in light_pool8.run(run_grid_case, cp, tp, dp, cfg_name, seed) if r is not None]
        assert len(results) == cp * tp * dp
        batches = [make_batch(seed + d, cp) for d in range(dp)]
        ref_norm = None
        if cfg.tis_batch_normalize_scope == "global":
            # reference: the mean over the concatenated global batch
            cat = [sum((b[k] for b in batches), []) for k in (2, 3, 4)]
            local_cfg = cfg.replace(tis_batch_normalize_scope="micro_batch")
            ref_norm = float(compute_mis_from_lists(*cat, local_cfg).normalizer)
        by_coords = {r["coords"]: r for r in results}
        for d in range(dp):
            totals, resps, train, rollout, masks = batches[d]
            ref = compute_mis_from_lists(train, rollout, masks, cfg, global_normalizer=ref_norm)
            full_w = torch.zeros_like(ref.weights)
            full_k = torch.zeros_like(ref.keep_mask)
            full_metrics = {k: torch.zeros_like(v) for k, v in ref.token_metrics.items()}
            for c in range(cp):
                r0 = by_coords[(0, c, d)]
                for t in range(1, tp):  # TP replicas compute the identical thing
                    rt = by_coords[(t, c, d)]
                    assert torch.equal(rt["weights"], r0["weights"]) and torch.equal(rt["keep"], r0["keep"])
                idx = r0["index"]
                full_w[idx] = r0["weights"]
                full_k[idx] = r0["keep"]
                for k in full_metrics:
                    full_metrics[k][idx] = r0["metrics"][k]
                # the full-length masks are right on EVERY CP rank, not only on the local chunk
                expected_masks = [m * k.long() for m, k in zip(masks, ref.split(ref.keep_mask, resps))]
                for got, want in zip(r0["masks"], expected_masks):
                    assert torch.equal(got, want), (cp, tp, dp, c)
                # statistics cross CP ranks in one all-gather that carries every rank's status too
                # (issue 28), plus one uint8 all-reduce only for token-level rejection
                expected = 0 if cp == 1 else (2 if cfg.token_rejects else 1)
                assert r0["collectives"] == expected
            assert torch.equal(full_k, ref.keep_mask), (cp, tp, dp)
            # fp32 per-sequence partial sums across ranks vs one pass: rounding only (~1e-7)
            torch.testing.assert_close(full_w, ref.weights, rtol=1e-6, atol=1e-7, msg=f"{(cp, tp, dp)}")
            for k, v in full_metrics.items():
                torch.testing.assert_close(v, ref.token_metrics[k], rtol=1e-5, atol=1e-6, msg=f"{k} {(cp, tp, dp)}")
            ref_summary = ref.scalars()
            for k, v in by_coords[(0, 0, d)]["summary"].items():
                assert v == pytest.approx(ref_summary[k], rel=1e-5, abs=1e-6), (k, cp, tp, dp)
            if ref_norm is not None:
                assert by_coords[(0, 0, d)]["normalizer"] == pytest.approx(ref_norm, rel=1e-6)


# ------------------------------------------------------------------ collective counting
def count_collectives(n: int, cfg_name: str):
    from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp
    from megatron_mis.parallel.state import group_view

    cp = group_view(dist.group.WORLD)  # a 2-rank pool: the whole world is the CP group here
    g = torch.Generator().manual_seed(n)
    totals = [int(x) for x in torch.randint(20, 200, (n,), generator=g)]
    resps = [int(t * 0.7) for t in totals]
    lay = local_response_layout(totals, resps, cp.size, cp.rank)
    full = [-torch.rand(r, generator=g) for r in resps]
    pieces = [_slice(full, lay, i) for i in range(n)]
    inputs = CPInputs(pieces, [p + 0.01 for p in pieces], [torch.ones(r) for r in resps], totals, resps)
    from megatron_mis.testing.distributed import collective_calls

    with collective_calls() as calls:
        compute_mis_cp(inputs, _cfg(cfg_name), cp)
    return calls


@pytest.mark.parametrize("cfg_name, expected", [("token_tis_bn", 1), ("geo_rs_token_mask_veto", 2)])
def test_collectives_do_not_grow_with_batch(pool2, cfg_name, expected):
    """1 collective per call for sequence-level statistics (the status rides in it), 2 with
    token-level rejection, at N = 0, 8 and 256 (issue 28: it was 2 and 3)."""
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    for n in (0, 8, 256):
        for calls in pool2.run(count_collectives, n, cfg_name):
            want = [gather] + (["all_reduce"] if expected == 2 and n else [])
            assert calls == want, (n, calls)


# ------------------------------------------------ real Megatron parallel state, slime-style
def slime_style_call(yaml_path: str, seed: int):
    """Initialise Megatron-Core's parallel state (TP=2, CP=2) for real and call the drop-in the
    way slime's policy loss does; then reduce the loss the way slime's sum_of_sample_mean does
    (each rank: its local chunk of the returned masks in the numerator, the full original mask
    sum as the denominator)."""
    from megatron.core import parallel_state as mpu

    import megatron_mis
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(tp=2, cp=2):
        cp_rank, cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
        totals, resps, train, rollout, masks = make_batch(seed, cp_size)
        lay = local_response_layout(totals, resps, cp_size, cp_rank)
        local_train = [_slice(train, lay, i) for i in range(len(resps))]
        local_rollout = [_slice(rollout, lay, i) for i in range(len(resps))]
        pg_full = [torch.randn(r, generator=torch.Generator().manual_seed(7 + i)) for i, r in enumerate(resps)]
        pg_loss = torch.cat([_slice(pg_full, lay, i) for i in range(len(resps))])
        args = Namespace(custom_config_path=yaml_path, qkv_format="thd", calculate_per_token_loss=False)
        import yaml

        with open(yaml_path) as fh:
            for k, v in yaml.safe_load(fh).items():
                setattr(args, k, v)  # what slime does with --custom-config-path
        new_pg, new_masks, metrics = megatron_mis.compute_mis_weights_with_cp(
            args, pg_loss=pg_loss, train_log_probs=local_train, rollout_log_probs=local_rollout,
            loss_masks=masks, total_lengths=totals, response_lengths=resps,
        )
        # slime's reducer, written out: per sample, local chunk of the modified mask, full denominators
        loss = torch.zeros((), dtype=torch.float64)
        offset = 0
        for i in range(len(resps)):
            n_local = int(lay.local_lengths[i])
            local_mask = _slice(new_masks, lay, i).double()
            x = new_pg[offset:offset + n_local].double()
            loss = loss + (x * local_mask).sum() / max(float(masks[i].sum()), 1.0)
            offset += n_local
        dist.all_reduce(loss, group=mpu.get_context_parallel_group())
        return float(loss), [m.tolist() for m in new_masks], sorted(metrics)


def test_slime_style_call_with_real_megatron_state(pool4, tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text(
        "use_tis: true\nuse_rs: true\ntis_level: token\nrs_level: geometric\ntis_mode: truncate\n"
        "tis_upper_bound: 1.5\nrs_lower_bound: 0.8\nrs_upper_bound: 1.25\nrs_veto_threshold: 1.0e-4\n"
        "tis_batch_normalize: true\ntis_batch_normalize_over: kept\n"  # the engine's meaning (the reference below)
    )
    out = pool4.run(slime_style_call, str(path), 5)
    totals, resps, train, rollout, masks = make_batch(5, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = MISConfig.from_yaml(path)
    ref = compute_mis_from_lists(train, rollout, masks, cfg)
    pg_full = [torch.randn(r, generator=torch.Generator().manual_seed(7 + i)) for i, r in enumerate(resps)]
    w = ref.split(ref.weights, resps)
    k = ref.split(ref.keep_mask, resps)
    expected = sum(float((p * wi * ki).double().sum()) / max(float(m.sum()), 1.0) for p, wi, ki, m in zip(pg_full, w, k, masks))
    for loss, got_masks, names in out:
        assert loss == pytest.approx(expected, rel=1e-5)
        assert got_masks == [(m * ki.long()).tolist() for m, ki in zip(masks, k)]
        assert "mis_k3_kl" in names and "mis_rs_catastrophic_seq_fraction" in names
    assert not math.isnan(expected)


# --------------------------------------------------------------------- bad input (1 rank)
def test_wrong_piece_length_names_the_sequence():
    from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp
    from megatron_mis.parallel.state import GroupView

    cp = GroupView(rank=0, size=2, group=None)
    inputs = CPInputs([torch.zeros(3)], [torch.zeros(3)], [torch.ones(4)], [10], [4])
    with pytest.raises(ValueError, match=r"sequence 0: rollout_log_probs has 3 values but CP rank 0/2"):
        compute_mis_cp(inputs, MISConfig(), cp)
    inputs = CPInputs(None, [torch.zeros(4)], [torch.ones(3)], [10], [4])
    with pytest.raises(ValueError, match="loss_mask has 3 values but response_length is 4"):
        compute_mis_cp(inputs, MISConfig(), GroupView.trivial())


def test_drop_in_rejects_misaligned_pg_loss_and_reports_config_errors(tmp_path):
    import megatron_mis

    args = Namespace(use_tis=True, custom_config_path=None)
    kw = dict(train_log_probs=[torch.zeros(3)], rollout_log_probs=[torch.zeros(3)], loss_masks=[torch.ones(3)],
              total_lengths=[5], response_lengths=[3])
    with pytest.raises(ValueError, match=r"pg_loss has shape \(4,\) but this rank holds 3"):
        megatron_mis.compute_mis_weights_with_cp(args, pg_loss=torch.zeros(4), **kw)
    bad = Namespace(use_tis=True, tis_mode="trunc", tis_upper_bound=-2, custom_config_path=None)
    with pytest.raises(megatron_mis.ConfigError, match="2 problem"):
        megatron_mis.compute_mis_weights_with_cp(bad, pg_loss=torch.zeros(3), **kw)


def test_rejected_tokens_get_zero_loss_even_if_nan():
    import megatron_mis

    args = Namespace(use_tis=True, tis_mode="mask", tis_lower_bound=0.9, tis_upper_bound=1.1, custom_config_path=None)
    out, masks, _ = megatron_mis.compute_mis_weights_fsdp(
        args, pg_loss=torch.tensor([float("nan"), 1.0]), train_log_probs=[torch.tensor([-1.0, -1.0])],
        rollout_log_probs=[torch.tensor([-2.0, -1.0])], loss_masks=[torch.ones(2, dtype=torch.long)],
    )
    assert out.tolist() == [0.0, 1.0]
    assert masks[0].tolist() == [0, 1]


# ----------------------------------------- global normalisation through the host hook (slime)
def slime_global_norm(seed: int):
    """CP=2 x DP=2 on real Megatron parallel state: the rollout-data hook computes the global mean
    once, then two micro-batches call the drop-in; returns the weights of each micro-batch."""
    from megatron.core import parallel_state as mpu

    import megatron_mis
    from megatron_mis.integrations.tis_functions import prepare_global_normalizer
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(cp=2):
        cp_rank = mpu.get_context_parallel_rank()
        dp_rank = mpu.get_data_parallel_rank()
        totals, resps, train, rollout, masks = make_batch(seed + dp_rank, 2)
        lay = local_response_layout(totals, resps, 2, cp_rank)
        args = Namespace(use_tis=True, tis_level="geometric", tis_upper_bound=1.3, tis_batch_normalize=True,
                         tis_batch_normalize_scope="global", custom_config_path=None, qkv_format="thd")
        rollout_data = dict(
            log_probs=[_slice(train, lay, i) for i in range(len(resps))],
            rollout_log_probs=[_slice(rollout, lay, i) for i in range(len(resps))],
            loss_masks=masks, total_lengths=totals, response_lengths=resps,
        )
        prepare_global_normalizer(args, 7, rollout_data)
        out = []
        for part in (slice(0, 4), slice(4, None)):  # two micro-batches
            idx = list(range(len(resps)))[part]
            local_n = int(sum(int(lay.local_lengths[i]) for i in idx))
            pg, _, _ = megatron_mis.compute_mis_weights_with_cp(
                args, pg_loss=torch.ones(local_n),
                train_log_probs=[rollout_data["log_probs"][i] for i in idx],
                rollout_log_probs=[rollout_data["rollout_log_probs"][i] for i in idx],
                loss_masks=[masks[i] for i in idx], total_lengths=[totals[i] for i in idx],
                response_lengths=[resps[i] for i in idx],
            )
            out.append((idx, pg))
        return dict(cp_rank=cp_rank, dp_rank=dp_rank, index=lay, out=out)


def test_global_normalizer_hook_matches_concatenated_global_batch(pool4):
    results = pool4.run(slime_global_norm, 21)
    batches = [make_batch(21 + d, 2) for d in range(2)]
    cfg = MISConfig(use_tis=True, tis_level="geometric", tis_upper_bound=1.3, tis_batch_normalize=True)
    global_mean = float(compute_mis_from_lists(*[sum((b[k] for b in batches), []) for k in (2, 3, 4)], cfg).normalizer)
    unnormalised = cfg.replace(tis_batch_normalize=False)
    for r in results:
        totals, resps, train, rollout, masks = batches[r["dp_rank"]]
        for idx, pg in r["out"]:
            ref = compute_mis_from_lists([train[i] for i in idx], [rollout[i] for i in idx], [masks[i] for i in idx], unnormalised)
            lay = local_response_layout([totals[i] for i in idx], [resps[i] for i in idx], 2, r["cp_rank"])
            expected = ref.weights.index_select(0, lay.local_to_full_index()) / global_mean
            torch.testing.assert_close(pg, expected, rtol=1e-6, atol=1e-7)
