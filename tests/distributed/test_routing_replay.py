"""Training side of R3 on a real Megatron-Core MoE GPT (CPU, gloo).

- every router selects exactly the given experts (native hook and legacy top-k patch, with and
  without ``moe_enable_routing_replay``); the output differs from natural routing when the routes
  differ and is bit-identical when they are the natural ones; router weights get gradients;
- removing the replay restores natural routing and leaves no hook, patch or global instance;
- R2: recorded routes replayed give bit-identical router outputs, also after the weights move;
- the agreement metric has the hand-derived values;
- backward recomputation replays the right micro-batch when backwards run in reverse order and
  under the 1F1B and interleaved pipeline schedules (gradients equal a run without recompute);
- MTP routers are left alone by default; bad input gives clear errors.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.routing.replay import RoutingReplayConfig

E, K, L = 8, 2, 2


@pytest.fixture(scope="module")
def pool1():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(1) as pool:
        yield pool


def _spec(num_layers=L):
    from megatron_mis.testbed.models.gpt import GPTSpec

    return GPTSpec(vocab_size=32, hidden_size=32, num_layers=num_layers, num_attention_heads=4,
                   max_sequence_length=64, num_moe_experts=E, moe_router_topk=K)


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number - 1: m for _, m in model.named_modules() if isinstance(m, TopKRouter)}


def _capture(model, store):
    hooks = []
    for layer, r in _routers(model).items():
        hooks.append(r.register_forward_hook(
            lambda mod, i, o, layer=layer: store.append(
                (layer, o[0].detach().to("cpu", copy=True), o[1].detach().to("cpu", copy=True)))))
    return hooks


def _random_routes(n, seed, num_layers=L):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * num_layers)]).view(n, num_layers, K)


def _batch():
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(8).unsqueeze(0).expand(2, -1)


def _shard(routes, valid=None):
    from megatron_mis.routing.slicing import RouteShard

    return RouteShard(routes.to(torch.uint8), tuple(range(routes.shape[1])), valid)


def _as_routes(maps):
    """[N, E] bool maps (one per layer) -> [N, L, K] sorted expert ids."""
    return torch.stack([m.nonzero()[:, 1].view(m.shape[0], K) for m in maps], 1)


# ----------------------------------------------------------------------------- worker bodies
def _select_and_restore(backend, native_flag, device="cpu"):
    """R3 on the MoE GPT on ``device`` with the routes given on the host (as they come from
    SGLang). Returns CPU values only: flags, and the largest differences from the natural
    output (``*_gap``; bit-identical on the CPU, float32 rounding on a GPU, whose MoE scatter may
    add in another order from run to run)."""
    import contextlib

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as router_mod
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import LEGACY_PATCH, RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    out = {}
    with contextlib.ExitStack() as stack:
        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 defines it only with Transformer Engine
            moe_utils.te_general_gemm = None  # (cpu_compat defines it on the CPU)
            stack.callback(delattr, moe_utils, "te_general_gemm")
        stack.enter_context(megatron_parallel(seed=3))
        model = build_cpu_moe_gpt(_spec(), moe_enable_routing_replay=native_flag).to(device)
        tokens, pos = (t.to(device) for t in _batch())
        routers = _routers(model)
        before = {l: (dict(r._forward_pre_hooks), dict(r._forward_hooks), r.router_replay) for l, r in routers.items()}
        n_global = len(RouterReplay.global_router_replay_instances)
        original_fn = router_mod.topk_routing_with_score_function

        seen = []
        hooks = _capture(model, seen)
        natural = model(tokens, pos, None)
        natural.sum().backward()
        natural_grads = {l: r.weight.grad.clone() for l, r in routers.items()}
        natural_routes = _as_routes([m for _, _, m in sorted(seen, key=lambda x: x[0])])
        model.zero_grad()

        routes = _random_routes(16, seed=9)
        replay = RoutingReplay(model, routing_replay_mode="r3", routing_replay_backend=backend)
        with replay:
            with replay:  # re-entrant
                out["backend"] = replay.backend
                out["legacy_installed"] = LEGACY_PATCH.installed
                seen.clear()
                replay.set_routes(0, _shard(routes))
                replay.begin_pass()
                replayed = model(tokens, pos, None)
                replayed.sum().backward()
                out["output_device"] = replayed.device.type
                out["selects_given"] = len(seen) == L and all(
                    torch.equal(m, torch.zeros(16, E, dtype=torch.bool).scatter(1, routes[:, l], True)) for l, _, m in seen
                )
                out["output_differs"] = not torch.equal(replayed, natural)
                out["router_grads"] = all(bool(r.weight.grad.abs().sum() > 0) and bool(r.weight.grad.isfinite().all())
                                          for r in routers.values())
                model.zero_grad()
                # the natural routes replayed: bit-identical output and router gradients
                replay.clear()
                replay.reset_agreement()
                replay.set_routes(0, _shard(natural_routes))
                same = model(tokens, pos, None)
                same.sum().backward()
                out["natural_identical"] = torch.equal(same, natural)
                out["natural_gap"] = float((same - natural).detach().abs().max())
                out["natural_grads_identical"] = all(torch.equal(r.weight.grad, natural_grads[l]) for l, r in routers.items())
                out["agreement_natural"] = replay.agreement()
                model.zero_grad()
            out["still_installed_after_inner_exit"] = replay.installed
            try:
                RoutingReplay(model, routing_replay_mode="r3").install()
                out["second_manager_refused"] = False
            except RuntimeError as exc:
                out["second_manager_refused"] = "already managed" in str(exc)
        restored = model(tokens, pos, None)
        out["restored_output"] = torch.equal(restored, natural)
        out["restored_gap"] = float((restored - natural).detach().abs().max())
        out["natural_scale"] = float(natural.detach().abs().max())
        for h in hooks:
            h.remove()
        after = {l: (dict(r._forward_pre_hooks), dict(r._forward_hooks), r.router_replay) for l, r in routers.items()}
        out["hooks_removed"] = all(before[l][0].keys() == after[l][0].keys() and after[l][1].keys() == before[l][1].keys()
                                   for l in routers)
        out["router_replay_restored"] = all(after[l][2] is before[l][2] for l in routers)
        out["no_global_instances"] = len(RouterReplay.global_router_replay_instances) == n_global
        out["patch_removed"] = router_mod.topk_routing_with_score_function is original_fn and not LEGACY_PATCH.installed
        out["no_chunk_hooks"] = not model._forward_pre_hooks and not model._forward_hooks
        out["no_marker"] = not any(hasattr(r, "_mis_routing_replay") for r in routers.values())
    return out


def _r2_roundtrip(backend):
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(seed=4):
        model = build_cpu_moe_gpt(_spec())
        tokens, pos = _batch()
        seen = []
        _capture(model, seen)
        with RoutingReplay(model, routing_replay_mode="r2", routing_replay_backend=backend) as replay:
            replay.begin_pass()
            with torch.no_grad():
                model(tokens, pos, None)  # first pass: records
            recorded = sorted(seen, key=lambda x: x[0])
            seen.clear()
            replay.begin_pass()
            model(tokens, pos, None).sum().backward()  # replays
            replayed = sorted(seen, key=lambda x: x[0])
            identical = all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(recorded, replayed))
            rec = replay.recorded_routes(0)
            # move the router weights: replay keeps the recorded experts, natural routing changes
            with torch.no_grad():
                for r in _routers(model).values():
                    r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)))
            seen.clear()
            replay.begin_pass()
            with torch.no_grad():
                model(tokens, pos, None)
            kept = all(torch.equal(m, recorded[i][2]) for i, (_, _, m) in enumerate(sorted(seen, key=lambda x: x[0])))
            moved_agreement = replay.agreement()
        seen.clear()
        with torch.no_grad():
            model(tokens, pos, None)
        natural_moved = any(not torch.equal(m, recorded[i][2]) for i, (_, _, m) in enumerate(sorted(seen, key=lambda x: x[0])))
    return identical, sorted(rec), kept, natural_moved, moved_agreement


def _natural_routes(model, tokens, pos, seen):
    """One forward without replay, captured into ``seen``: ``(output, natural routes [16, L, K],
    for each token K experts it did not choose [16, L, K])``."""
    with torch.no_grad():
        out = model(tokens, pos, None)
    nat = _as_routes([m for _, _, m in sorted(seen, key=lambda x: x[0])])
    others = torch.stack([torch.tensor([e for e in range(E) if e not in row.tolist()][:K])
                          for row in nat.view(-1, K)]).view_as(nat)
    return out, nat, others


def _agreement_values():
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    results = {}
    with megatron_parallel(seed=5):
        model = build_cpu_moe_gpt(_spec())
        tokens, pos = _batch()
        seen = []
        hooks = _capture(model, seen)
        _, nat, others = _natural_routes(model, tokens, pos, seen)
        for h in hooks:
            h.remove()
        half = torch.stack([nat[..., 0], others[..., 0]], -1)
        valid = torch.arange(16) % 2 == 0
        mixed = torch.where(valid.view(-1, 1, 1), nat, others)  # valid tokens natural, padding disjoint
        for name, routes, v in (("same", nat, None), ("disjoint", others, None), ("half", half, None), ("masked", mixed, valid)):
            with RoutingReplay(model, routing_replay_mode="r3") as replay:
                replay.set_routes(0, _shard(routes, v))
                replay.begin_pass()
                with torch.no_grad():
                    model(tokens, pos, None)
                results[name] = replay.agreement()
                results[name + "_stats"] = replay.agreement_stats()[1]
    return results


def _fallback_values(backend):
    """Tokens whose RouteShard.replayed is False route by the router's own top-k."""
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.routing.slicing import RouteShard
    from megatron_mis.testing.distributed import megatron_parallel

    out = {}
    with megatron_parallel(seed=5):
        model = build_cpu_moe_gpt(_spec())
        tokens, pos = _batch()
        seen = []
        hooks = _capture(model, seen)
        natural_out, nat, others = _natural_routes(model, tokens, pos, seen)
        fall = torch.arange(16) % 2 == 1  # odd tokens: no rollout route
        replayed = (~fall).view(-1, 1).expand(16, L).clone()
        for agreement in (True, False):
            seen.clear()
            with RoutingReplay(model, routing_replay_mode="r3", routing_replay_backend=backend,
                               routing_replay_agreement=agreement) as replay:
                replay.set_routes(0, RouteShard(others.to(torch.uint8), (0, 1), None, replayed))
                replay.begin_pass()
                with torch.no_grad():
                    model(tokens, pos, None)
                layer0 = [m for l, _, m in seen if l == 0][0]
                want = torch.where(fall.view(-1, 1), nat[:, 0], others[:, 0])
                out[f"layer0_choice_{agreement}"] = torch.equal(
                    layer0, torch.zeros(16, E, dtype=torch.bool).scatter(1, want, True))
                out[f"fallback_{agreement}"] = replay.fallback_counts()
                out[f"agreement_{agreement}"] = replay.agreement()
                if agreement:
                    out["stats"] = replay.agreement_stats()[1]
        # no token has a rollout route: exactly the natural model
        with RoutingReplay(model, routing_replay_mode="r3", routing_replay_backend=backend) as replay:
            replay.set_routes(0, RouteShard(others.to(torch.uint8), (0, 1), None, torch.zeros(16, L, dtype=torch.bool)))
            replay.begin_pass()
            with torch.no_grad():
                out["all_fallback_identical"] = torch.equal(model(tokens, pos, None), natural_out)
            out["all_fallback_agreement"] = replay.agreement()
            out["all_fallback_counts"] = replay.fallback_counts()
        for h in hooks:
            h.remove()
    return out


def _recompute_reverse_order(backend, recompute):
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    from megatron_mis.testbed.cpu_moe import cpu_rng_shims

    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    with cpu_rng_shims(), megatron_parallel(seed=6):
        model = build_cpu_moe_gpt(_spec(), **kw)
        tokens, pos = _batch()
        routes = [_random_routes(16, seed=20 + i) for i in range(2)]
        seen = []
        _capture(model, seen)
        with RoutingReplay(model, routing_replay_mode="r3", routing_replay_backend=backend) as replay:
            replay.load_routes([_shard(r) for r in routes])
            replay.begin_pass()
            outs = [model(tokens, pos, None) for _ in range(2)]  # keys 0, 1
            n_fwd = len(seen)
            outs[1].sum().backward()  # backward of micro-batch 1 first
            during_mb1 = seen[n_fwd:]
            outs[0].float().pow(2).mean().backward()
            during_mb0 = seen[n_fwd + len(during_mb1):]
        want = lambda r, l: torch.zeros(16, E, dtype=torch.bool).scatter(1, r[:, l], True)  # noqa: E731
        ok1 = all(torch.equal(m, want(routes[1], l)) for l, _, m in during_mb1)
        ok0 = all(torch.equal(m, want(routes[0], l)) for l, _, m in during_mb0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return len(during_mb1), len(during_mb0), ok1, ok0, grads


def _pipeline_recompute(vpp, recompute, backend):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    if vpp:
        kw["virtual_pipeline_model_parallel_size"] = vpp
    from megatron_mis.testbed.cpu_moe import cpu_rng_shims

    num_mb, n_tok = 4, 8
    with cpu_rng_shims(), megatron_parallel(pp=2, vpp=vpp, seed=7):
        chunks = [build_cpu_moe_gpt(_spec(num_layers=4), vp_stage=v if vpp else None, **kw) for v in range(vpp or 1)]
        for c in chunks:
            c.config.finalize_model_grads_func = None
        routes = [_random_routes(n_tok, seed=40 + i, num_layers=4) for i in range(num_mb)]
        from megatron_mis.routing.slicing import RouteShard

        seen = []
        for c in chunks:
            _capture(c, seen)
        tokens = torch.randint(0, 32, (num_mb, 1, n_tok), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(n_tok).unsqueeze(0)

        def step(it, model):
            i = next(it)
            return model(tokens[i], pos, None), lambda o: (o.float().pow(2).mean() * (i + 1), {})

        with RoutingReplay(chunks if vpp else chunks[0], routing_replay_mode="r3", routing_replay_backend=backend) as replay:
            replay.load_routes([RouteShard(r.to(torch.uint8), (0, 1, 2, 3)) for r in routes])
            replay.begin_pass()
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=[iter(range(num_mb)) for _ in chunks] if vpp else iter(range(num_mb)),
                model=chunks if vpp else chunks[0], num_microbatches=num_mb, seq_length=n_tok,
                micro_batch_size=1, forward_only=False,
            )
        uses = {}
        for layer, _, m in seen:
            matches = [i for i in range(num_mb)
                       if torch.equal(m, torch.zeros(n_tok, E, dtype=torch.bool).scatter(1, routes[i][:, layer], True))]
            assert len(matches) == 1, (layer, matches)
            uses[(layer, matches[0])] = uses.get((layer, matches[0]), 0) + 1
        grads = {f"{ci}.{n}": p.grad.clone() for ci, c in enumerate(chunks) for n, p in c.named_parameters() if p.grad is not None}
    return uses, grads


def _mtp_excluded():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mis.testbed.cpu_moe import cpu_moe_config
    from megatron_mis.testing.cpu import cpu_gpt_layer_spec
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.testing.distributed import megatron_parallel

    with megatron_parallel(seed=8):
        config = cpu_moe_config(_spec(), mtp_num_layers=1)
        layer_spec = cpu_gpt_layer_spec(num_experts=E)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=32, max_sequence_length=64,
                         mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False),
                         position_embedding_type="rope")
        names = sorted(n for n, m in model.named_modules() if n.endswith(".router"))
        with RoutingReplay(model, routing_replay_mode="r3") as a:
            default_layers = a.layer_ids
        with RoutingReplay(model, routing_replay_mode="r3", routing_replay_exclude_mtp=False) as b:
            all_layers = b.layer_ids
    return names, default_layers, all_layers


def _errors():
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.routing.slicing import RouteShard
    from megatron_mis.testing.distributed import megatron_parallel

    msgs = {}
    with megatron_parallel(seed=3):
        model = build_cpu_moe_gpt(_spec())
        tokens, pos = _batch()
        with RoutingReplay(model, routing_replay_mode="r3") as replay:
            replay.set_routes(0, _shard(_random_routes(15, seed=1)))
            replay.begin_pass()
            try:
                model(tokens, pos, None)
            except ValueError as exc:
                msgs["rows"] = str(exc)
            replay.begin_pass()
            replay.set_micro_batch(7)
            try:
                model(tokens, pos, None)
            except KeyError as exc:
                msgs["missing"] = str(exc)
            try:
                replay.set_routes(1, RouteShard(torch.zeros(16, 1, K, dtype=torch.uint8), (0,)))
            except ValueError as exc:
                msgs["layers"] = str(exc)
        fused = build_cpu_moe_gpt(_spec())
        for r in _routers(fused).values():
            r.config.moe_router_fusion = True
        try:
            RoutingReplay(fused, routing_replay_mode="r3").install()
        except ValueError as exc:
            msgs["fusion"] = str(exc)
    return msgs


# --------------------------------------------------------------------------------------- tests
def test_config_validation():
    with pytest.raises(ConfigError, match="routing_replay_mode='r4' is not one of 'off', 'r3', 'r2'"):
        RoutingReplayConfig(routing_replay_mode="r4")
    with pytest.warns(UserWarning, match="routing_replay_backend='legacy' has no effect"):
        RoutingReplayConfig(routing_replay_backend="legacy")
    cfg = RoutingReplayConfig.from_dict({"routing_replay_mode": "r3", "routing_replay_exclude_mtp": False})
    assert cfg.routing_replay_mode == "r3" and not cfg.routing_replay_exclude_mtp
    assert not any(k.startswith(("tis_", "rs_", "mis_")) for k in RoutingReplayConfig.field_names())


@pytest.mark.parametrize("backend,native_flag", [("native", False), ("native", True), ("legacy", False), ("legacy", True)])
def test_replay_selects_given_experts_and_removes_itself(pool1, backend, native_flag):
    out = pool1.run(_select_and_restore, backend, native_flag)[0]
    assert out["backend"] == backend and out["legacy_installed"] == (backend == "legacy")
    assert out["output_device"] == "cpu" and out["natural_gap"] == 0 and out["restored_gap"] == 0
    for key in ("selects_given", "output_differs", "router_grads", "natural_identical", "natural_grads_identical",
                "still_installed_after_inner_exit", "second_manager_refused", "restored_output", "hooks_removed",
                "router_replay_restored", "no_global_instances", "patch_removed", "no_chunk_hooks", "no_marker"):
        assert out[key], key
    assert out["agreement_natural"] == {0: 1.0, 1: 1.0}


@pytest.mark.parametrize("backend", ["native", "legacy"])
def test_r2_round_trip_bit_identical(pool1, backend):
    identical, recorded_layers, kept, natural_moved, moved_agreement = pool1.run(_r2_roundtrip, backend)[0]
    assert identical and recorded_layers == [0, 1]
    assert kept and natural_moved
    assert all(v < 1.0 for v in moved_agreement.values())  # the moved router disagrees with the recording


def test_agreement_metric_values(pool1):
    r = pool1.run(_agreement_values)[0]
    assert r["same"] == {0: 1.0, 1: 1.0}  # natural routes: the whole model is unchanged
    # other routes at layer 0 change the input of layer 1 (and so its natural choice): the
    # hand-derived values hold for layer 0, whose input does not depend on any route
    assert r["disjoint"][0] == 0.0
    assert r["half"][0] == 0.5
    assert r["masked"][0] == 1.0  # padding rows (disjoint) are left out
    assert r["masked_stats"][:, 1].tolist() == [8.0, 8.0]


@pytest.mark.parametrize("backend", ["native", "legacy"])
def test_tokens_without_rollout_route_use_the_routers_choice(pool1, backend):
    r = pool1.run(_fallback_values, backend)[0]
    for agreement in (True, False):
        assert r[f"layer0_choice_{agreement}"]  # odd tokens natural, even tokens the given (disjoint) routes
        assert r[f"fallback_{agreement}"] == {0: 8, 1: 8}
    assert r["agreement_True"][0] == 0.0  # only the 8 replayed (disjoint) tokens are compared
    assert r["stats"][:, 1].tolist() == [8.0, 8.0]
    assert r["agreement_False"] == {}
    assert r["all_fallback_identical"] and r["all_fallback_agreement"] == {}
    assert r["all_fallback_counts"] == {0: 16, 1: 16}


@pytest.mark.parametrize("backend", ["native", "legacy"])
def test_backward_recompute_replays_right_micro_batch(pool1, backend):
    n1, n0, ok1, ok0, grads = pool1.run(_recompute_reverse_order, backend, True)[0]
    assert n1 == L and n0 == L  # one recomputation per layer in each backward
    assert ok1 and ok0
    _, _, _, _, ref = pool1.run(_recompute_reverse_order, backend, False)[0]
    assert grads.keys() == ref.keys()
    for name in ref:  # recomputation reruns the same CPU ops: exactly equal
        assert torch.equal(grads[name], ref[name]), name


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_pipeline_schedules_replay_keyed(pool2, vpp):
    res = pool2.run(_pipeline_recompute, vpp, True, "native")
    ref = pool2.run(_pipeline_recompute, vpp, False, "native")
    for (uses, grads), (ref_uses, ref_grads) in zip(res, ref):
        assert uses and set(uses.values()) == {2}  # each micro-batch's routes: forward + recompute
        assert set(ref_uses.values()) == {1}
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            assert torch.equal(grads[name], ref_grads[name]), name


def test_mtp_routers_excluded_by_default(pool1):
    names, default_layers, all_layers = pool1.run(_mtp_excluded)[0]
    assert any(n.startswith("mtp.") for n in names)
    assert default_layers == [0, 1]
    assert all_layers == [0, 1, 2]  # the MTP router sits at layer number num_layers + 1


def test_clear_errors(pool1):
    msgs = pool1.run(_errors)[0]
    assert "15 route rows for a router input of 16 tokens" in msgs["rows"]
    assert "no routes for micro-batch 7" in msgs["missing"]
    assert "replays routers of layers [1] too" in msgs["layers"]
    assert "moe_router_fusion=True" in msgs["fusion"]


@pytest.fixture(scope="module")
def pool_nccl():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(1, cpu_compat=False, backend="nccl") as pool:
        yield pool


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the MoE GPT on the GPU, NCCL)")
@pytest.mark.parametrize("backend", ["native", "legacy"])
def test_replay_on_the_gpu_with_host_routes(pool_nccl, backend):
    """R3 on a CUDA MoE model: the given experts selected, finite router gradients, the replay
    removed without a trace, and the natural routes replayed give the natural output to float32
    rounding (the GPU's MoE scatter may add in another order from run to run: not bit-identical
    as on the CPU, so the ``*_identical`` flags are not asserted here)."""
    out = pool_nccl.run(_select_and_restore, backend, False, "cuda")[0]
    assert out["output_device"] == "cuda"
    for key in ("selects_given", "output_differs", "router_grads", "still_installed_after_inner_exit",
                "second_manager_refused", "hooks_removed", "router_replay_restored", "no_global_instances",
                "patch_removed", "no_chunk_hooks", "no_marker"):
        assert out[key], key
    assert out["agreement_natural"] == {0: 1.0, 1: 1.0}
    bound = 1e-5 * out["natural_scale"] + 1e-6
    assert out["natural_gap"] <= bound and out["restored_gap"] <= bound, out
