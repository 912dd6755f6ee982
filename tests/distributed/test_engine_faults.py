"""Bad input and faults at the engine and the host drop-ins (issue 12, engine side): no silent
result, no overflow for any accepted input, errors that name the parameter, and every CP rank
raising the same error when any one rank's input is at fault (2 and 4 gloo ranks)."""

from __future__ import annotations

import json
import math
import warnings
from argparse import Namespace

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists
from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp, compute_mis_weights_with_cp


def _cfg(**kw) -> MISConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**kw)


def test_mask_mode_treats_a_neutralised_token_like_ratio_one():
    """tis_mode mask, bounds [1.5, 3]: the NaN token is neutralised to ratio 1, so it is rejected
    exactly like the finite ratio-1 token (it used to be kept while the finite one was not)."""
    cfg = _cfg(use_tis=True, tis_mode="mask", tis_lower_bound=1.5, tis_upper_bound=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compute_mis_from_lists([torch.tensor([float("nan"), -1.0])], [torch.tensor([-1.0, -1.0])],
                                     [torch.ones(2)], cfg)
    assert res.keep_mask.tolist() == [False, False]
    assert res.weights.tolist() == [0.0, 0.0]
    rs = _cfg(use_rs=True, rs_lower_bound=1.5, rs_upper_bound=3.0)
    res = compute_mis_from_lists([torch.tensor([float("nan"), -1.0])], [torch.tensor([-1.0, -1.0])], [torch.ones(2)], rs)
    assert res.keep_mask.tolist() == [False, False]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_log_ratio_bound_80_and_extreme_log_probs_stay_finite(level):
    cfg = _cfg(use_tis=True, tis_level=level, tis_upper_bound=1e30, log_ratio_bound=80.0, mis_metrics="full")
    train = [torch.tensor([-0.01] * 4), torch.tensor([-3.0e38, -1.0, 3.0e38])]
    rollout = [torch.tensor([-90.0] * 4), torch.tensor([3.0e38, -2.0, -3.0e38])]
    res = compute_mis_from_lists(train, rollout, [torch.ones(4), torch.ones(3)], cfg)
    s = res.scalars()
    assert all(math.isfinite(v) for v in s.values()), {k: v for k, v in s.items() if not math.isfinite(v)}
    json.loads(json.dumps(s, allow_nan=False))  # valid JSON
    for name, t in res.token_metrics.items():
        assert bool(torch.isfinite(t).all()), name
    assert bool(torch.isfinite(res.weights).all())
    assert s["mis_kl"] != 0 and math.isfinite(s["mis_log_ppl_diff"])


def test_chi2_at_the_bound_is_exact_in_the_summary():
    cfg = _cfg(log_ratio_bound=80.0)
    res = compute_mis_from_lists([torch.zeros(3)], [torch.full((3,), -100.0)], [torch.ones(3)], cfg)
    assert res.scalars()["mis_chi2_token"] == pytest.approx(math.expm1(160.0), rel=1e-6)


def test_loss_mask_values_are_converted_exactly_never_passed_through():
    values = [float("nan"), 1.0, 0.0, 2.0, -1.0, 0.5, float("inf"), 255.0]
    n = len(values)
    args = Namespace(custom_config_path=None, use_tis=True, tis_upper_bound=2.0)
    pg = torch.ones(n)
    _, masks, _ = compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=[torch.full((n,), -1.0)],
                                           rollout_log_probs=[torch.full((n,), -1.0)],
                                           loss_masks=[torch.tensor(values)])
    assert masks[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert masks[0].dtype == torch.float32
    ints = torch.tensor([1, 0, 2, -1, 255])
    _, masks, _ = compute_mis_weights_fsdp(args, pg_loss=torch.ones(5), train_log_probs=[torch.zeros(5)],
                                           rollout_log_probs=[torch.zeros(5)], loss_masks=[ints])
    assert masks[0].tolist() == [1, 0, 1, 0, 1] and masks[0].dtype == ints.dtype
    # metrics-only calls convert too
    args = Namespace(custom_config_path=None, use_tis=False)
    loss, masks, _ = compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=[torch.full((n,), -1.0)],
                                              rollout_log_probs=[torch.full((n,), -1.0)],
                                              loss_masks=[torch.tensor(values)])
    assert masks[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]


T3 = torch.zeros(3)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: compute_mis(T3, T3, T3, [0, 1.5, 3], MISConfig()), ValueError, r"cu_seqlens\[1\]=1.5 must be an integer"),
        (lambda: compute_mis(T3, T3, T3, [0, float("nan"), 3], MISConfig()), ValueError, r"cu_seqlens\[1\]=nan"),
        (lambda: compute_mis(T3, T3, T3, "03", MISConfig()), TypeError, "cu_seqlens must be a list"),
        (lambda: compute_mis(T3, T3, T3, None, MISConfig()), TypeError, "cu_seqlens must be a list"),
        (lambda: compute_mis(T3, T3, T3, [0, 2**70], MISConfig()), ValueError, r"cu_seqlens\[-1\]=.* must equal"),
        (lambda: compute_mis(T3, T3, T3, torch.tensor([0.0, 3.5]), MISConfig()), ValueError, "must be an integer"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], None), TypeError, "config must be a megatron_mis.MISConfig, got NoneType"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], {"use_tis": True}), TypeError, "got dict"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], "mis.yaml"), TypeError, "got str"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], MISConfig(), reduce_stats=5), TypeError, "reduce_stats must be None or a callable"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], MISConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="global"),
                             global_normalizer="abc"), TypeError, "global_normalizer must be a positive finite number"),
        (lambda: compute_mis(T3, T3, T3, [0, 3], MISConfig(), prob_bucket_edges=[0.0, float("nan"), 1.0]), ValueError, "prob_bucket_edges"),
        (lambda: compute_mis_from_lists([T3, None], [T3, T3], [T3, T3], MISConfig()), TypeError, r"train_log_probs\[1\] must be a torch.Tensor"),
        (lambda: compute_mis_from_lists(torch.zeros(2, 3), [T3, T3], [T3, T3], MISConfig()), TypeError, "train_log_probs must be a list"),
    ],
)
def test_engine_errors_name_the_parameter(call, error, message):
    with pytest.raises(error, match=message):
        call()


_KW = dict(train_log_probs=[torch.zeros(3)], rollout_log_probs=[torch.zeros(3)], loss_masks=[torch.ones(3)])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda a: compute_mis_weights_fsdp({"use_tis": True}, pg_loss=torch.zeros(3), **_KW), TypeError, "got a dict"),
        (lambda a: compute_mis_weights_fsdp(a, pg_loss=[0.0, 0.0, 0.0], **_KW), TypeError, "pg_loss must be a 1-D tensor"),
        (lambda a: compute_mis_weights_fsdp(a, pg_loss=torch.zeros(3), train_log_probs=torch.zeros(1, 3),
                                            rollout_log_probs=[torch.zeros(3)], loss_masks=[torch.ones(3)]), TypeError, "train_log_probs must be a list"),
        (lambda a: compute_mis_weights_fsdp(a, pg_loss=torch.zeros(3), train_log_probs=[torch.zeros(3)],
                                            rollout_log_probs=torch.zeros(3), loss_masks=[torch.ones(3)]), TypeError, "rollout_log_probs must be a list"),
        (lambda a: compute_mis_weights_fsdp(a, pg_loss=torch.zeros(3), train_log_probs=[torch.zeros(3)],
                                            rollout_log_probs=[None], loss_masks=[torch.ones(3)]), TypeError, r"rollout_log_probs\[0\] must be a torch.Tensor"),
        (lambda a: compute_mis_weights_with_cp(a, pg_loss=torch.zeros(3), total_lengths=[3.7], response_lengths=[3], **_KW),
         ValueError, r"total_lengths\[0\]=3.7 must be an integer"),
        (lambda a: compute_mis_weights_with_cp(a, pg_loss=torch.zeros(3), total_lengths=["5"], response_lengths=[3], **_KW),
         TypeError, r"total_lengths\[0\]='5' must be an integer"),
        (lambda a: compute_mis_weights_with_cp(a, pg_loss=torch.zeros(3), total_lengths=[5], response_lengths=[None], **_KW),
         TypeError, r"response_lengths\[0\]=None must be an integer"),
        (lambda a: compute_mis_weights_with_cp(a, pg_loss=torch.zeros(3), total_lengths=[5], response_lengths=[3],
                                               cp_layout="foo", **_KW), ValueError, "cp_layout='foo' is not supported"),
    ],
)
def test_drop_in_errors_name_the_parameter(call, error, message):
    args = Namespace(custom_config_path=None, use_tis=True)
    with pytest.raises(error, match=message):
        call(args)


# ------------------------------------------------------------------- faults across CP ranks
@pytest.fixture(scope="module")
def fault_pool4():
    """Four gloo ranks with a SHORT process-group timeout: a rank left waiting in a collective
    fails within the pool timeout (150 s, start-up on a loaded 2-core machine included) instead of
    after the 30-minute default."""
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(4, timeout=150.0, cpu_compat=False) as pool:
        yield pool


def _subgroup(size: int):
    import torch.distributed as dist

    from megatron_mis.parallel.state import GroupView

    key = f"_fault_group_{size}"
    groups = globals().setdefault("_FAULT_GROUPS", {})
    if key not in groups:
        groups[key] = dist.new_group(list(range(size)))  # every rank creates it (torch requires it)
    rank = dist.get_rank()
    if rank >= size:
        return None
    return GroupView(rank=rank, size=size, group=groups[key])


def fault_case(size: int, bad_rank: int, kind: str, debug: bool = False):
    import os

    from megatron_mis.core.checks import DEBUG_ENV
    from megatron_mis.parallel.cp_mis import CPFaultError, CPInputs, compute_mis_cp
    from megatron_mis.parallel.layout import local_response_layout

    cp = _subgroup(size)
    if cp is None:
        return None
    totals, resps = [12, 30, 9], [5, 20, 4]
    lay = local_response_layout(totals, resps, cp.size, cp.rank)
    g = torch.Generator().manual_seed(0)
    full = [-torch.rand(r, generator=g) for r in resps]
    pieces = [torch.cat([f[s:e] for s, e in lay.ranges[i].tolist()]) for i, f in enumerate(full)]
    train = [p.clone() for p in pieces]
    rollout = [p + 0.01 for p in pieces]
    masks = [torch.ones(r) for r in resps]
    cfg = MISConfig(use_tis=True, nonfinite_policy="error")
    if cp.rank == bad_rank:
        if kind == "nan":
            i = max(range(3), key=lambda j: train[j].numel())
            train[i][0] = float("nan")
        elif kind == "length":
            rollout[1] = torch.cat([rollout[1], torch.zeros(1)])
            train[1] = rollout[1].clone()
        elif kind == "empty":  # no pieces on this rank; the micro-batch's lengths are the host's
            train, rollout, masks = [], [], []
        elif kind == "empty_metadata":  # a host bug: this rank's lengths say 0 sequences
            train, rollout, masks, totals, resps = [], [], [], [], []
        elif kind == "mask_nan":  # a host bug: this rank's copy of the full masks differs
            masks[2][1] = float("nan")
        elif kind == "lengths":  # a host bug: same number of sequences, other lengths
            totals = [12, 30, 10]
            resps = [5, 20, 5]
            lay = local_response_layout(totals, resps, cp.size, cp.rank)
            full = [-torch.rand(r, generator=g) for r in resps]
            train = [torch.cat([f[s:e] for s, e in lay.ranges[i].tolist()]) for i, f in enumerate(full)]
            rollout, masks = [t + 0.01 for t in train], [torch.ones(r) for r in resps]
        elif kind == "int_log_probs":
            train = [t.to(torch.int64) for t in train]
    saved = os.environ.get(DEBUG_ENV)
    os.environ[DEBUG_ENV] = "1" if debug else "0"
    try:
        compute_mis_cp(CPInputs(train, rollout, masks, totals, resps), cfg, cp)
    except CPFaultError as exc:
        return str(exc)
    finally:
        if saved is None:
            del os.environ[DEBUG_ENV]
        else:
            os.environ[DEBUG_ENV] = saved
    return "no error"


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["nan", "length", "empty", "mask_nan", "lengths", "int_log_probs", "empty_metadata"])
def test_a_fault_on_one_cp_rank_raises_the_same_error_on_every_rank(fault_pool4, size, kind):
    """One all-gather carries the statistics and every rank's status (issue 28): a rank at fault
    still sends a buffer of the size the host's lengths give, so nobody is left waiting. Ranks
    given different NUMBERS of sequences ("empty_metadata", a host bug) would send different sizes:
    that case is guarded only under MEGATRON_MIS_DEBUG_CHECKS=1 (a fixed-size count exchange)."""
    debug = kind == "empty_metadata"
    for bad in range(size):
        out = [r for r in fault_pool4.run(fault_case, size, bad, kind, debug) if r is not None]
        assert len(out) == size
        for rank, message in enumerate(out):
            assert message != "no error", (kind, size, bad, rank)
            if kind in ("empty", "empty_metadata"):
                assert f"rank {bad} has 0" in message, message
            elif kind == "lengths":
                assert "different total_lengths / response_lengths" in message and f"ranks {bad}" in message, message
            elif kind == "int_log_probs":
                assert f"CP rank {bad}: invalid input" in message, message
            else:
                assert f"CP rank {bad}:" in message and "sequence" in message, message
            if kind == "nan":
                assert "NaN or inf" in message
            if kind == "mask_nan":
                assert f"CP rank {bad}: sequence 2: loss_masks[2] holds a NaN or inf value at token 1" in message
            if kind == "int_log_probs" and rank == bad:
                assert "floating point" in message
        # the same text on every rank, up to "this is rank r" and the rank's own error
        if kind in ("nan", "mask_nan", "lengths"):
            assert len({m.split("): ", 1)[1] for m in out}) == 1, out


def error_policy_case(size: int, seed: int):
    """nonfinite_policy='error' under CP with finite data: the engine runs with its local check
    off (the count rides in the status), so the result must equal the single-process engine's."""
    from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp, cp_normalization_statistics
    from megatron_mis.parallel.layout import local_response_layout

    cp = _subgroup(size)
    if cp is None:
        return None
    g = torch.Generator().manual_seed(seed)
    resps = [int(x) for x in torch.randint(0, 25, (9,), generator=g)]
    totals = [r + int(p) for r, p in zip(resps, torch.randint(1, 9, (9,), generator=g))]
    train = [-torch.rand(r, generator=g) * 2 for r in resps]
    rollout = [t + torch.randn(t.shape, generator=g) * 0.2 for t in train]
    masks = [(torch.rand(r, generator=g) > 0.2).float() for r in resps]
    cfg = _cfg(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25,
               use_rs=True, rs_level="token", rs_lower_bound=0.6, rs_upper_bound=1.6, tis_batch_normalize=True,
               nonfinite_policy="error")
    lay = local_response_layout(totals, resps, cp.size, cp.rank)
    piece = lambda full, i: torch.cat([full[i][s:e] for s, e in lay.ranges[i].tolist()] or [full[i][:0]])  # noqa: E731
    inputs = CPInputs([piece(train, i) for i in range(9)], [piece(rollout, i) for i in range(9)], masks, totals, resps)
    out = compute_mis_cp(inputs, cfg, cp)
    norm = cp_normalization_statistics(inputs, cfg, cp)
    ref = compute_mis_from_lists(train, rollout, masks, cfg)
    idx = lay.local_to_full_index()
    return dict(
        config_kept=out.result.config is cfg,
        weights=torch.allclose(out.result.weights, ref.weights[idx], rtol=1e-6, atol=1e-7),
        keep=torch.equal(out.result.keep_mask, ref.keep_mask[idx]),
        masks=all(torch.equal(a, m * k.float()) for a, m, k in zip(out.modified_masks, masks, ref.split(ref.keep_mask, resps))),
        norm=torch.allclose(norm.weight_sum, ref.normalization.weight_sum) and torch.equal(norm.count, ref.normalization.count),
        collectives=out.num_collectives,
    )


@pytest.mark.parametrize("size", [2, 4])
def test_error_policy_without_a_nonfinite_value_equals_one_process(fault_pool4, size):
    out = [r for r in fault_pool4.run(error_policy_case, size, 3) if r is not None]
    assert len(out) == size
    for r in out:
        assert r == dict(config_kept=True, weights=True, keep=True, masks=True, norm=True, collectives=2), r


def normalization_fault_case(size: int, bad_rank: int):
    """cp_normalization_statistics (the global normaliser's path) under a fault on one rank."""
    from megatron_mis.parallel.cp_mis import CPFaultError, CPInputs, cp_normalization_statistics

    cp = _subgroup(size)
    if cp is None:
        return None
    from megatron_mis.parallel.layout import local_response_layout

    totals, resps = [12, 30, 9], [5, 20, 4]
    lay = local_response_layout(totals, resps, cp.size, cp.rank)
    pieces = [torch.full((int(n),), -1.0) for n in lay.local_lengths.tolist()]
    if cp.rank == bad_rank:
        pieces[1] = torch.cat([pieces[1], torch.zeros(2)])
    try:
        cp_normalization_statistics(CPInputs(pieces, [p - 0.1 for p in pieces], [torch.ones(r) for r in resps], totals, resps),
                                    _cfg(use_tis=True, tis_batch_normalize=True), cp)
    except CPFaultError as exc:
        return str(exc)
    return "no error"


def test_normalization_statistics_fault_raises_on_every_rank(fault_pool4):
    for bad in range(2):
        out = [r for r in fault_pool4.run(normalization_fault_case, 2, bad) if r is not None]
        assert len(out) == 2 and all(f"CP rank {bad}: sequence 1" in m for m in out), out
