"""The engine's performance contract and drop-in fidelity (issue 11), checked without timing:
zero host synchronisations per call, an aten op count constant in the number of sequences, a
full graph under torch.compile(fullgraph=True, dynamic=True), float32 token work as accurate as a
float64 computation, the hosts' metric definitions under the hosts' names, and metrics-only calls
that leave the loss alone."""

from __future__ import annotations

import math
import warnings
from argparse import Namespace

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.core import engine
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists
from megatron_mis.core.statistics import Plan, SequenceStatistics
from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp, compute_mis_weights_with_cp

SEED000 = dict(use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5, rs_lower_bound=0.99,
               rs_upper_bound=1.001, rs_veto_threshold=1e-4, tis_batch_normalize=True)
CONFIGS = {
    "seed000": SEED000,
    "token_mask_token_rs_prob_veto": dict(use_tis=True, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=1.6,
                                          use_rs=True, rs_level="token", rs_lower_bound=0.5, rs_upper_bound=2.0,
                                          prob_veto_threshold=1e-6),
    "sequence_mask_bn_full": dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_lower_bound=1e-8,
                                  tis_upper_bound=2.0, tis_batch_normalize=True, mis_metrics="full"),
    "geometric_clip_reject": dict(use_tis=True, tis_level="geometric", tis_mode="clip", nonfinite_policy="reject"),
    "weights_only": dict(SEED000, mis_metrics="none"),
    # the length-scaled geometric band with K3 measured in the call (a batch-wide reduction
    # inside the compiled output stage), metrics off
    "zscore_batch_weights_only": dict(use_tis=True, use_rs=True, rs_criteria={"seq_zscore_k1": {"k3": "batch", "z": 1.0}},
                                      mis_metrics="none"),
}


def _cfg(**kw) -> MISConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**kw)


def _lists(n: int, lo: int = 4, hi: int = 40, seed: int = 0, nonfinite: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g)]
    train = [-torch.rand(k, generator=g) * 3 for k in lengths]
    rollout = [t + torch.randn(k, generator=g) * 0.1 for t, k in zip(train, lengths)]
    masks = [(torch.rand(k, generator=g) > 0.1).long() for k in lengths]
    if nonfinite:
        rollout[0][0] = float("nan")
    return lengths, train, rollout, masks


# ------------------------------------------------------------------------- host syncs
_SYNCING = [
    (torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"), (torch.Tensor, "__index__"), (torch.Tensor, "nonzero"), (torch, "nonzero"),
    (torch.Tensor, "masked_select"), (torch, "masked_select"), (torch, "segment_reduce"), (torch, "unique"),
    (torch.Tensor, "unique"), (torch.Tensor, "cpu"), (torch, "repeat_interleave"),
]


class SyncCounter:
    """Patches the Python entry points that read device values on the host (or sync to size an
    output) and records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: list = []

    def __enter__(self) -> "SyncCounter":
        for owner, name in _SYNCING:
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))

            def wrapper(*a, _fn=fn, _name=name, **k):
                self.calls.append(_name)
                return _fn(*a, **k)

            setattr(owner, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_synchronisation_per_call(name):
    cfg = _cfg(**CONFIGS[name])
    lengths, train, rollout, masks = _lists(12, nonfinite=True)
    flat = [torch.cat(x) for x in (train, rollout, masks)]
    cu = [0]
    for k in lengths:
        cu.append(cu[-1] + k)
    args = Namespace(custom_config_path=None, **CONFIGS[name])
    pg = torch.randn(sum(lengths))
    kw = dict(pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compute_mis_weights_fsdp(args, **kw)  # validates and caches the config outside the count
        with SyncCounter() as counter:
            compute_mis(*flat, cu, cfg)
            compute_mis_from_lists(train, rollout, masks, cfg)
            for _ in range(2):  # the second call polls the first call's deferred non-finite count
                compute_mis_weights_fsdp(args, **kw)
                compute_mis_weights_with_cp(args, total_lengths=[k + 3 for k in lengths], response_lengths=lengths,
                                            cp_group=None, **kw)
    assert counter.calls == []


def test_sync_counter_counts():
    """The counter itself sees the syncing entry points (so the test above can fail)."""
    with SyncCounter() as counter:
        torch.ones(3).sum().item()
        torch.ones(2).nonzero()
        bool(torch.ones(()))
    assert counter.calls == ["item", "nonzero", "__bool__"]


def test_nonfinite_warning_arrives_without_a_sync():
    args = Namespace(custom_config_path=None, use_tis=True)
    lengths, train, rollout, masks = _lists(3, nonfinite=True)
    kw = dict(pg_loss=torch.zeros(sum(lengths)), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compute_mis_weights_fsdp(args, **kw)
        compute_mis_weights_fsdp(args, **kw)
    assert any("1 loss-mask token(s) had NaN" in str(w.message) for w in caught)


# ------------------------------------------------------------------------- op counts
def _aten_ops(fn) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("aten::"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


@pytest.mark.parametrize("name", list(CONFIGS))
def test_aten_op_count_is_constant_in_the_number_of_sequences(name):
    cfg = _cfg(**CONFIGS[name])
    args = Namespace(custom_config_path=None, **CONFIGS[name])
    counts = {}
    for n in (8, 256):
        lengths, train, rollout, masks = _lists(n, seed=n)
        pg = torch.randn(sum(lengths))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine_ops = _aten_ops(lambda: compute_mis_from_lists(train, rollout, masks, cfg))
            host_ops = _aten_ops(lambda: compute_mis_weights_fsdp(
                args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks))
        # the host contract returns one mask view per sample: split's per-output views are the
        # only ops allowed to scale with N
        per_view = {"aten::narrow", "aten::slice", "aten::as_strided", "aten::split_with_sizes", "aten::alias"}
        host_ops = {k: v for k, v in host_ops.items() if k not in per_view}
        counts[n] = (engine_ops, host_ops)
    assert counts[8][0] == counts[256][0]
    assert counts[8][1] == counts[256][1]
    assert sum(counts[8][0].values()) > 50  # the profiler saw the engine


# ---------------------------------------------------------------------------- compile
@pytest.mark.parametrize("name", ["seed000", "token_mask_token_rs_prob_veto", "sequence_mask_bn_full"])
def test_stages_compile_fullgraph_dynamic_and_agree(name):
    """fullgraph=True raises on any graph break or data-dependent guard; dynamic=True with two
    batch shapes. The dynamo trace (backend 'eager') is what proves it; inductor is benchmarked."""
    import torch._dynamo

    torch._dynamo.reset()
    plan = Plan.of(_cfg(**CONFIGS[name]))
    tok = torch.compile(engine._token_stage, fullgraph=True, dynamic=True, backend="eager")
    out = torch.compile(engine._outputs, fullgraph=True, dynamic=True, backend="eager")
    from megatron_mis.core.segments import segment_layout

    for n, length in ((5, 7), (9, 13)):
        total = n * length
        cu = torch.arange(n + 1) * length
        lay = segment_layout(cu, total)
        g = torch.Generator().manual_seed(n)
        tr = -torch.rand(total, generator=g)
        ro = tr + 0.2 * torch.randn(total, generator=g)
        m = torch.rand(total, generator=g) > 0.1
        tokens, sums, mins, maxs = tok(tr, ro, m, lay, plan)
        got = out(tokens, SequenceStatistics(sums, mins, maxs), None, plan)
        ref_tokens, *ref_stats = engine._token_stage(tr, ro, m, lay, plan)
        ref = engine._outputs(ref_tokens, SequenceStatistics(*ref_stats), None, plan)
        assert torch.equal(got["keep"], ref["keep"])
        torch.testing.assert_close(got["weights"], ref["weights"])
        for k, v in ref["token_metrics"].items():
            torch.testing.assert_close(got["token_metrics"][k], v, msg=k)


def _nonfinite_batch(n: int, length: int, seed: int):
    total = n * length
    g = torch.Generator().manual_seed(seed)
    tr = -torch.rand(total, generator=g)
    ro = tr + 0.2 * torch.randn(total, generator=g)
    m = torch.rand(total, generator=g) > 0.1
    tr[3], ro[4], tr[5], ro[5], tr[8], ro[9] = float("nan"), float("inf"), float("-inf"), float("nan"), float("inf"), -float("inf")
    return torch.arange(n + 1) * length, tr, ro, m


def _compare_compiled(backend: str, name: str) -> None:
    """The compiled stages (the forms inductor vectorises, the opaque ops) against eager, with
    NaN / inf log-probs in the batch and a batch length that no chunk divides."""
    import torch._dynamo

    from megatron_mis.core.segments import segment_layout

    torch._dynamo.reset()
    plan = Plan.of(_cfg(**CONFIGS[name]))
    tok = torch.compile(engine._token_stage, fullgraph=True, dynamic=True, backend=backend)
    out = torch.compile(engine._outputs, fullgraph=True, dynamic=True, backend=backend)
    for n, length in ((5, 7), (9, 13)):
        cu, tr, ro, m = _nonfinite_batch(n, length, n)
        lay = segment_layout(cu, n * length)
        tokens, sums, mins, maxs = tok(tr, ro, m, lay, plan)
        got = out(tokens, SequenceStatistics(sums, mins, maxs), None, plan)
        ref_tokens, *ref_stats = engine._token_stage(tr, ro, m, lay, plan)
        ref = engine._outputs(ref_tokens, SequenceStatistics(*ref_stats), None, plan)
        # the dynamo trace runs the same kernels: float64 sums agree to float64 rounding. Inductor
        # fuses the float32 token work differently (~1 ulp per value, values of order 1, up to 13
        # per sequence here; r^2 - 1 sums cancel, so the bound is absolute)
        if backend == "eager":
            torch.testing.assert_close(sums, ref_stats[0], rtol=1e-12, atol=0)
        else:
            torch.testing.assert_close(sums, ref_stats[0], rtol=2e-6, atol=2e-6)
        assert got["keep"].dtype == torch.bool and torch.equal(got["keep"], ref["keep"])
        torch.testing.assert_close(got["weights"], ref["weights"])
        assert set(got["token_metrics"]) == set(ref["token_metrics"])
        for k, v in ref["token_metrics"].items():
            torch.testing.assert_close(got["token_metrics"][k], v, msg=k)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_forms_agree_with_eager_on_nonfinite_inputs(name):
    _compare_compiled("eager", name)


def test_inductor_compiled_stages_agree_with_eager():
    """One real inductor build (the opaque ops' shape functions must match what they return);
    about a minute on 2 cores with a cold inductor cache."""
    import shutil

    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler; none is on PATH")
    _compare_compiled("inductor", "seed000")


def test_compiled_stages_have_no_host_synchronising_op():
    """compile_engine, as far as it can be checked without a GPU: the aten graphs of both
    compiled stages (captured by an aot_autograd backend, dynamic shapes) hold no op that reads
    a value on the host (_local_scalar_dense, a copy to the CPU) or whose output shape depends on
    the data (nonzero, masked_select, ...): those synchronise on any device. The graphs are
    traced on the CPU, so device copies cannot show here; which copies inductor issues for CUDA
    (the statistic index moved from pinned memory) needs a GPU: tests/fakecuda/test_real_cuda.py runs
    compile_engine under set_sync_debug_mode('error') there (dynamo cannot trace the fake-CUDA
    wrapper tensors, and inductor emits Triton for CUDA)."""
    import torch._dynamo
    from torch._functorch.aot_autograd import aot_module_simplified

    from megatron_mis.core.segments import segment_layout

    graphs = []

    def capture(gm, example_inputs):
        def fw(graph, inputs):
            graphs.append(graph)
            return graph
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    torch._dynamo.reset()
    plan = Plan.of(_cfg(**SEED000))
    tok = torch.compile(engine._token_stage, fullgraph=True, dynamic=True, backend=capture)
    out = torch.compile(engine._outputs, fullgraph=True, dynamic=True, backend=capture)
    cu, tr, ro, m = _nonfinite_batch(9, 13, 9)
    lay = segment_layout(cu, 9 * 13)
    tokens, sums, mins, maxs = tok(tr, ro, m, lay, plan)
    out(tokens, SequenceStatistics(sums, mins, maxs), None, plan)
    try:
        assert len(graphs) == 2, f"expected one graph per stage, got {len(graphs)}"
        bad = []
        for graph in graphs:
            for node in graph.graph.nodes:
                target = node.target
                if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                    continue
                reads = target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
                dynamic = torch.Tag.dynamic_output_shape in target.tags or torch.Tag.data_dependent_output in target.tags
                to_host = target is torch.ops.aten._to_copy.default and str(node.kwargs.get("device", "")) == "cpu"
                if reads or dynamic or to_host:
                    bad.append(f"{target} ({node.format_node()[:120]})")
        assert not bad, "compiled stages hold host-synchronising ops:\n" + "\n".join(bad)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- accuracy
def test_float32_token_work_is_as_accurate_as_float64():
    """Long sequences (up to 4096 tokens), small mismatches: the engine's float32 token work
    with float64 sums gives the float64 computation's values to float32 accuracy."""
    lengths, train, rollout, masks = _lists(24, lo=1024, hi=4096, seed=3)
    rollout = [t + torch.randn(len(t), generator=torch.Generator().manual_seed(i)) * 1e-3 for i, t in enumerate(train)]
    cfg = _cfg(use_tis=True, tis_level="sequence", tis_upper_bound=1e6, mis_metrics="full")
    res = compute_mis_from_lists(train, rollout, masks, cfg)
    s = res.scalars()
    seq_log, k3_sum, chi2, n_mask = [], 0.0, [], 0
    for a, b, m in zip(train, rollout, masks):
        v = m.bool()
        d = a.double()[v] - b.double()[v]  # float64 differences of the same float32 inputs
        seq_log.append(float(d.sum()))
        k3_sum += float((torch.expm1(d) - d).sum())
        chi2.append(float(torch.exp(2 * d).mean()) - 1)
        n_mask += int(v.sum())
    want_w = torch.tensor([math.exp(x) for x in seq_log], dtype=torch.float64)
    torch.testing.assert_close(res.seq_weights.double(), want_w.float().double(), rtol=2e-7, atol=0)
    assert s["mis_k3_kl"] == pytest.approx(k3_sum / n_mask, rel=2e-5)  # ~5e-7 per token, fp32 inputs
    assert s["mis_chi2_token"] == pytest.approx(sum(chi2) / len(chi2), rel=1e-4, abs=1e-9)
    assert s["mis_log_ppl_diff"] == pytest.approx(
        sum(-x / int(m.sum()) for x, m in zip(seq_log, masks)) / len(masks), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("metrics", ["standard", "none"])
@pytest.mark.parametrize("scale, noise", [(3.0, 1.0), (20.0, 1e-3), (1e4, 1.0)])
def test_sequence_log_ratio_sum_is_float64_exact(metrics, scale, noise):
    """The sum of log r that feeds exp() at sequence level equals the float64 sum of the float64
    differences to float64 rounding, with metrics and without (both the difference of the two
    float64 log-prob sums). In the first case most operands are more than 2x apart, so their
    float32 differences round: summing those fails this test."""
    g = torch.Generator().manual_seed(11)
    lengths = [int(x) for x in torch.randint(1, 6000, (16,), generator=g)]
    train = [-torch.rand(k, generator=g) * scale for k in lengths]
    rollout = [t + torch.randn(k, generator=g) * noise for t, k in zip(train, lengths)]
    masks = [(torch.rand(k, generator=g) > 0.1).long() for k in lengths]
    res = compute_mis_from_lists(train, rollout, masks, _cfg(use_tis=True, tis_level="sequence", mis_metrics=metrics))
    got = res.stats.col(engine.SequenceSum.SUM_LOG_R)
    for i, (a, b, m) in enumerate(zip(train, rollout, masks)):
        v = m.bool()
        want = (a.double()[v] - b.double()[v]).sum()
        magnitude = float((a.double()[v].abs() + b.double()[v].abs()).sum())
        assert abs(float(got[i]) - float(want)) <= 1e-13 * magnitude, (i, float(got[i]), float(want))


def test_k3_series_matches_float64_across_the_switch():
    x = torch.linspace(-3, 3, 20001)
    got = engine._metrics.k3_from_log_ratio(x).double()
    want = torch.expm1(x.double()) - x.double()
    rel = ((got - want).abs() / want.clamp_min(1e-30))[x.abs() > 1e-6]
    assert float(rel.max()) < 1e-6


# ------------------------------------------------------------------ drop-in fidelity
def _host_reference(train, rollout, masks, cfg):
    """The hosts' (Miles' bundled mis.py) definitions of the host-named metrics, token level."""
    out = {"after": [], "mean": [], "min": [], "max": []}
    for a, b, m in zip(train, rollout, masks):
        r = torch.exp((a - b).clamp(-20, 20))
        if cfg.tis_mode == "truncate":
            w = r.clamp(0, cfg.tis_upper_bound) * m
        elif cfg.tis_mode == "clip":
            w = r.clamp(cfg.tis_lower, cfg.tis_upper_bound) * m
        else:
            w = r * m
        out["after"].append(w)
        v = m.bool()
        out["mean"].append(torch.full_like(w, float((w * m).sum() / m.sum().clamp_min(1))))
        out["min"].append(torch.full_like(w, float(w[v].min()) if v.any() else 0.0))
        out["max"].append(torch.full_like(w, float(w[v].max()) if v.any() else 0.0))
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
def test_host_named_metrics_keep_the_hosts_definitions(mode):
    cfg = _cfg(use_tis=True, tis_mode=mode, tis_lower_bound=0.9, tis_upper_bound=1.05, use_rs=True,
               rs_level="token", rs_lower_bound=0.95, rs_upper_bound=1.2, mis_metrics="full")
    lengths, train, rollout, masks = _lists(6, seed=5)
    res = compute_mis_from_lists(train, rollout, masks, cfg)
    host = _host_reference(train, rollout, masks, cfg)
    m = torch.cat(masks).bool()
    tm = res.token_metrics
    torch.testing.assert_close(tm["mis_tis_weight_after_bound"][m], host["after"][m])
    torch.testing.assert_close(tm["mis_is_ratio_mean_after_tis_rs"][m], host["after"][m])
    for part in ("mean", "min", "max"):
        torch.testing.assert_close(tm[f"mis_is_ratio_{part}_final"], host[part], rtol=1e-6, atol=1e-7, msg=part)
    # ours, under our own names: over KEPT tokens; the rejected tokens make them differ here
    kept_mean = tm["mis_kept_weight_mean_final"]
    assert not torch.allclose(kept_mean, tm["mis_is_ratio_mean_final"])
    w = res.split(res.weights, lengths)
    k = res.split(res.keep_mask, lengths)
    for i, (wi, ki) in enumerate(zip(w, k)):
        want = float(wi[ki].double().mean()) if ki.any() else 0.0
        assert float(res.split(kept_mean, lengths)[i][0]) == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_metrics_only_call_leaves_the_loss_and_masks_alone_and_warns():
    lengths, train, rollout, masks = _lists(5, seed=7)
    pg = torch.randn(sum(lengths))
    yaml_keys = dict(use_tis=False, use_rs=True, rs_level="token", rs_lower_bound=0.99, rs_upper_bound=1.01,
                     rs_veto_threshold=0.9)
    args = Namespace(custom_config_path=None, **yaml_keys)
    with pytest.warns(RuntimeWarning, match="use_rs, rs_veto_threshold has no effect without use_tis"):
        loss, got_masks, metrics = compute_mis_weights_fsdp(
            args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert torch.equal(loss, pg)
    assert all(torch.equal(a, b) for a, b in zip(got_masks, masks))
    assert "mis_k3_kl" in metrics and "mis_training_log_ppl" in metrics
    assert not any(k.startswith(("mis_is_ratio", "mis_tis_", "mis_rs_mask")) for k in metrics)
    # the explicit key: rejection sampling without IS
    args = Namespace(custom_config_path=None, rs_without_tis=True, **yaml_keys)
    loss, got_masks, _ = compute_mis_weights_fsdp(
        args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    ref = compute_mis_from_lists(train, rollout, masks, _cfg(**yaml_keys))
    assert not ref.keep_mask.all()
    assert torch.equal(loss, torch.where(ref.keep_mask, pg, torch.zeros_like(pg)))
    assert [g.tolist() for g in got_masks] == [(m * k.long()).tolist() for m, k in zip(masks, ref.split(ref.keep_mask, lengths))]


def test_weights_only_mode_returns_no_metrics_and_the_same_weights():
    lengths, train, rollout, masks = _lists(9, seed=2)
    full = compute_mis_from_lists(train, rollout, masks, _cfg(**SEED000))
    bare = compute_mis_from_lists(train, rollout, masks, _cfg(**SEED000, mis_metrics="none"))
    assert bare.token_metrics == {} and bare.summary == {}
    assert torch.equal(bare.keep_mask, full.keep_mask) and torch.equal(bare.weights, full.weights)


def test_bshd_max_seq_lens_below_a_sample_length_is_rejected_at_cp1():
    """Issue 27 backlog: bshd pads every sample to max_seq_lens, so a max_seq_len below a sample's
    total length is a host bug at every CP size, CP = 1 included (it used to pass there)."""
    from megatron_mis.parallel.layout import local_response_layout

    lengths = [3, 5, 4]
    totals = [k + 3 for k in lengths]  # 6, 8, 7
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(k, generator=g) for k in lengths]
    kw = dict(pg_loss=torch.zeros(sum(lengths)), train_log_probs=parts, rollout_log_probs=parts,
              loss_masks=[torch.ones(k) for k in lengths], total_lengths=totals, response_lengths=lengths,
              cp_group=None, cp_layout="bshd")
    msg = r"sample 1: total_length=8 \(prompt \+ response\) exceeds max_seq_len=7 \(max_seq_lens=\[8, 7, 8\]\)"
    with pytest.raises(ValueError, match=msg):
        compute_mis_weights_with_cp(Namespace(custom_config_path=None, use_tis=True), max_seq_lens=[8, 7, 8], **kw)
    with pytest.raises(ValueError, match=r"sample 1: total_length=8 .* exceeds max_seq_len=7 \(max_seq_lens=7\)"):
        local_response_layout(totals, lengths, 1, 0, layout="bshd", max_seq_lens=7)
    # enough room: accepted, and the layout at CP = 1 is the whole responses
    out = compute_mis_weights_with_cp(Namespace(custom_config_path=None, use_tis=True), max_seq_lens=8, **kw)
    assert [m.numel() for m in out[1]] == lengths
    assert local_response_layout(totals, lengths, 1, 0, layout="bshd", max_seq_lens=8).local_lengths.tolist() == lengths


# ------------------------------------------------------------------------ kernel launches
def _dispatched_ops(num_seqs: int, cfg: MISConfig) -> int:
    """aten ops dispatched by one compute_mis call on num_seqs sequences of 64 tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(num_seqs)
    t = num_seqs * 64
    train = torch.randn(t, generator=g) * 0.3 - 1.0
    rollout = train + torch.randn(t, generator=g) * 0.1
    mask = torch.rand(t, generator=g) > 0.1
    cu = list(range(0, t + 1, 64))
    with Count():
        compute_mis(train, rollout, mask, cu, cfg)
    return Count.n


#: Dispatched aten ops per compute_mis call, seed-000 config: (standard metrics, mis_metrics none).
#: 702 / 241 before issue 28, 529 / 195 after its first round; a rise is a regression (each op is a kernel launch on a GPU).
OPS_STANDARD, OPS_NONE = 299, 131


@pytest.mark.parametrize("metrics", ["standard", "none"])
def test_dispatched_ops_per_call_are_flat_in_n_and_do_not_grow(metrics):
    cfg = _cfg(**SEED000, mis_metrics=metrics)
    at_8, at_256 = _dispatched_ops(8, cfg), _dispatched_ops(256, cfg)
    assert at_8 == at_256, f"op count depends on N: {at_8} at N=8, {at_256} at N=256"
    ceiling = OPS_STANDARD if metrics == "standard" else OPS_NONE
    assert at_8 <= ceiling, f"{at_8} aten ops per call, more than the recorded {ceiling}"


def test_dispatched_ops_reach_the_issue_28_target():
    """Issue 28: at most 300 ops per seed-000 call with the standard metrics, at N = 8 and N = 256."""
    cfg = _cfg(**SEED000)
    assert _dispatched_ops(8, cfg) <= 300
    assert _dispatched_ops(256, cfg) <= 300


def test_index_by_identity_tells_equal_tensors_apart():
    """The engine's column and metric-block deduplication is by identity (``is``: dynamo cannot
    take ``id()`` of an intermediate tensor), never by value."""
    from megatron_mis.core.compiling import index_by_identity

    a, b = torch.zeros(3), torch.zeros(3)  # equal values, distinct tensors
    items = [a, b]
    assert index_by_identity(items, a) == 0 and index_by_identity(items, b) == 1
    assert index_by_identity(items, torch.zeros(3)) is None and index_by_identity([], a) is None
