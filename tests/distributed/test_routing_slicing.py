"""Routes are sliced exactly like the tokens.

Tier 1: hand-derived token indices. Tier 2: :func:`local_token_index` equals an independent
reference slicer (written from the host frameworks' token slicing: per-sample zigzag with 2*cp
equal chunks, contiguous allgather chunks, bshd zigzag, sequence-parallel chunks) over many
layouts. Tier 3 (4 gloo ranks, real Megatron-Core MoE GPT): for CP in {1, 2}, TP with sequence
parallel in {1, 2}, PP in {1, 2} (also virtual pipeline with dense first layers), packing and the
allgather / bshd layouts, the experts every router of every rank selects under R3 are the
reference slice of the full routes, padding rows are spread, and a source rank sends each rank
only its own shard.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_mis.routing.slicing import RouteShardSpec, local_token_index, moe_layer_pattern, shard_routes


# ----------------------------------------------------------------------------- reference slicer
def ref_local_index(total_lengths, *, layout, cp, cr, tp=1, tr=0, sp=False, pad_multiple=1, max_seq_len=None):
    """Index of each router token in the concatenated samples (-1: padding), by direct slicing."""
    ids, off = [], 0
    for t in total_lengths:
        ids.append(torch.arange(off, off + t))
        off += t

    def pad_to(x, multiple):
        extra = (-x.numel()) % multiple
        return torch.cat([x, torch.full((extra,), -1, dtype=torch.long)])

    if layout == "thd":
        if cp == 1:
            stream = torch.cat(ids)
        else:
            parts = []
            for x in ids:
                chunks = pad_to(x, 2 * cp).chunk(2 * cp)
                parts += [chunks[cr], chunks[2 * cp - 1 - cr]]
            stream = torch.cat(parts)
        grid = pad_to(stream, pad_multiple)[:, None]
    elif layout == "allgather":
        grid = pad_to(torch.cat(ids), cp * pad_multiple).chunk(cp)[cr][:, None]
    else:
        mat = torch.stack([torch.cat([x, torch.full((max_seq_len - x.numel(),), -1)]) for x in ids])  # [B, S]
        if cp > 1:
            mat = mat.view(mat.shape[0], 2 * cp, -1)[:, [cr, 2 * cp - 1 - cr]].reshape(mat.shape[0], -1)
        grid = mat.T  # router order: position-major
    if sp and tp > 1:
        grid = grid.chunk(tp, dim=0)[tr]
    return grid.reshape(-1)


# ----------------------------------------------------------------------------------- tier 1
def test_hand_derived_indices():
    spec = lambda r, **kw: RouteShardSpec(layer_ids=(0,), num_experts=4, cp_size=2, cp_rank=r, **kw)  # noqa: E731
    # T=5: chunk 2, rank 0 holds [0,2)+[6,8), rank 1 [2,4)+[4,6); T=3: chunk 1, [0,1)+[3,4) / [1,2)+[2,3)
    assert local_token_index([5, 3], spec(0)).tolist() == [0, 1, -1, -1, 5, -1]
    assert local_token_index([5, 3], spec(1)).tolist() == [2, 3, 4, -1, 6, 7]
    assert local_token_index([5, 3], spec(1, pad_multiple=4)).tolist() == [2, 3, 4, -1, 6, 7, -1, -1]
    assert local_token_index([5, 3], spec(0, layout="allgather")).tolist() == [0, 1, 2, 3]
    assert local_token_index([5, 3], spec(1, layout="allgather", pad_multiple=3)).tolist() == [6, 7, -1, -1, -1, -1]
    one = RouteShardSpec(layer_ids=(0,), num_experts=4, layout="bshd", max_seq_len=4)
    assert local_token_index([3, 4], one).tolist() == [0, 3, 1, 4, 2, 5, -1, 6]
    sp = RouteShardSpec(layer_ids=(0,), num_experts=4, tp_size=2, tp_rank=1, sequence_parallel=True)
    assert local_token_index([3, 3], sp).tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="does not divide it"):
        local_token_index([3, 2], sp)
    with pytest.raises(ValueError, match="exceeds max_seq_len=4"):
        local_token_index([5], one)


def test_moe_layer_pattern():
    assert moe_layer_pattern(4, 1) == [True] * 4
    assert moe_layer_pattern(4, 2) == [True, False, True, False]
    assert moe_layer_pattern(3, [0, 1, 1]) == [False, True, True]
    with pytest.raises(ValueError, match="2 entries for num_layers=3"):
        moe_layer_pattern(3, [0, 1])


# ----------------------------------------------------------------------------------- tier 2
def test_local_token_index_equals_reference():
    rng = random.Random(0)
    for _ in range(300):
        layout = rng.choice(["thd", "allgather", "bshd"])
        cp, tp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4])
        sp = rng.random() < 0.6
        lengths = [rng.randint(1, 23) for _ in range(rng.randint(1, 5))]
        pad_multiple = tp if sp else rng.choice([1, 2, 3])
        max_seq_len = None
        if layout == "bshd":
            unit = 2 * cp * (tp if sp else 1)
            max_seq_len = -(-max(lengths) // unit) * unit
        for cr, tr in itertools.product(range(cp), range(tp)):
            spec = RouteShardSpec(
                layer_ids=(0,), num_experts=4, layout=layout, cp_size=cp, cp_rank=cr, tp_size=tp, tp_rank=tr,
                sequence_parallel=sp, pad_multiple=pad_multiple, max_seq_len=max_seq_len,
            )
            want = ref_local_index(lengths, layout=layout, cp=cp, cr=cr, tp=tp, tr=tr, sp=sp,
                                   pad_multiple=pad_multiple, max_seq_len=max_seq_len)
            assert torch.equal(local_token_index(lengths, spec), want), (layout, cp, cr, tp, tr, sp, lengths)


def test_shard_routes_rows_columns_and_padding():
    lengths = [5, 3]
    routes = [torch.randint(0, 16, (t - 1, 6, 2)) for t in lengths]  # SGLang rows: T-1
    for r in routes:
        r[:, :, 1] = (r[:, :, 0] + 1) % 16
    spec = RouteShardSpec(layer_ids=(4, 1), num_experts=16, cp_size=2, cp_rank=0, pad_multiple=4)
    shard = shard_routes(routes, lengths, spec)
    idx = local_token_index(lengths, spec)
    assert shard.routes.dtype == torch.uint8 and shard.routes.shape == (idx.numel(), 2, 2)
    assert torch.equal(shard.valid, idx >= 0)
    flat = torch.cat([torch.cat([r, torch.zeros(1, 6, 2, dtype=r.dtype)]) for r in routes])  # last rows: padding
    last = torch.tensor([4, 7])  # the last token of each sample has no SGLang row
    for row, g in enumerate(idx.tolist()):
        if g >= 0 and g not in last.tolist():
            assert torch.equal(shard.routes[row].long(), flat[g][[4, 1]])
    pads = shard.routes[~shard.valid].long()
    assert pads.numel() and all(len(set(p.tolist())) == 2 for p in pads.reshape(-1, 2))
    assert len(set(pads[:, 0, 0].tolist())) > 1  # padding rows not all sent to one expert
    with pytest.raises(ValueError, match="routes cover 6 layers but layer id 7"):
        shard_routes(routes, lengths, RouteShardSpec(layer_ids=(7,), num_experts=16))
    with pytest.raises(ValueError, match="sample 1: routes have 1 rows for a sample of 3 tokens"):
        shard_routes([routes[0], routes[1][:1]], lengths, RouteShardSpec(layer_ids=(0,), num_experts=16))


# ----------------------------------------------------------------------------------- tier 3
LENGTHS = [7, 5, 10]
NUM_LAYERS, NUM_EXPERTS, TOPK = 4, 8, 2


def _full_routes(seed=11):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in LENGTHS:
        perm = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range((t - 1) * NUM_LAYERS)])
        out.append(perm.view(t - 1, NUM_LAYERS, TOPK))
    return out


def _replayed_vs_reference(tp, sp, cp, pp, vpp, layout, moe_layer_freq, check_scatter=False):
    """On every rank: build the model, slice this rank's shard, run a forward under R3, and
    compare every router's selected experts with the reference slice of the full routes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_mis.testbed.models.gpt import GPTSpec
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt, cpu_rng_shims
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.routing.slicing import scatter_route_shards, shard_spec_from_megatron
    from megatron_mis.testing.distributed import megatron_parallel

    spec = GPTSpec(vocab_size=32, hidden_size=16, num_layers=NUM_LAYERS, num_attention_heads=2,
                   max_sequence_length=64, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK)
    overrides = dict(sequence_parallel=sp, moe_layer_freq=moe_layer_freq)
    if vpp:
        overrides["virtual_pipeline_model_parallel_size"] = vpp
    with megatron_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, seed=5):
        chunks = [build_cpu_moe_gpt(spec, routing_only_attention=True, position_embedding_type="none", vp_stage=v if vpp else None, **overrides)
                  for v in range(vpp or 1)]
        if tp > 1 and not sp:  # Megatron refuses MoE + TP without SP in training mode only
            for c in chunks:
                c.eval()
        config = chunks[0].config
        cr, tr = ps.get_context_parallel_rank(), ps.get_tensor_model_parallel_rank()
        max_seq_len = 16 if layout == "bshd" else None
        pad_multiple = tp if sp else 1
        sspec = shard_spec_from_megatron(config, layout=layout, pad_multiple=pad_multiple, max_seq_len=max_seq_len)
        full = _full_routes()
        shard = shard_routes(full, LENGTHS, sspec)

        received_bytes = None
        if check_scatter:
            world = dist.group.WORLD
            coords = [None] * dist.get_world_size()
            dist.all_gather_object(coords, (tr, cr, ps.get_pipeline_model_parallel_rank()), group=world)
            shards = None
            if dist.get_rank() == 0:
                shards = [shard_routes(full, LENGTHS, shard_spec_from_megatron(
                    config, layout=layout, pad_multiple=pad_multiple, max_seq_len=max_seq_len,
                    tp_rank=t, cp_rank=c, pp_rank=p)) for (t, c, p) in coords]
            got = scatter_route_shards(shards, src=0, group=world)
            assert torch.equal(got.routes, shard.routes) and torch.equal(got.valid, shard.valid)
            assert got.layer_ids == shard.layer_ids
            received_bytes = got.nbytes

        # this CP rank's tokens (before the sequence-parallel split, which the model does itself)
        tokens_flat = torch.randint(0, 32, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
        kw = dict(layout=layout, cp=cp, cr=cr, max_seq_len=max_seq_len, pad_multiple=pad_multiple)
        tok_idx = ref_local_index(LENGTHS, **kw)
        if layout == "bshd":
            grid = tok_idx.view(-1, len(LENGTHS)).T  # [B, s_local]
        else:
            grid = tok_idx.view(1, -1)
        tokens = torch.where(grid >= 0, tokens_flat[grid.clamp_min(0)], torch.zeros_like(grid))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

        seen = []
        for c in chunks:
            for _, m in c.named_modules():
                if isinstance(m, TopKRouter):
                    m.register_forward_hook(lambda mod, i, o: seen.append((mod.layer_number - 1, o[1].detach().clone())))
        with cpu_rng_shims(), RoutingReplay(chunks if vpp else chunks[0], routing_replay_mode="r3") as replay:
            num_mb = 2 if vpp else 1  # the interleaved schedule needs >= pp micro-batches
            replay.load_routes([shard] * num_mb)
            replay.begin_pass()
            if pp == 1:
                chunks[0](tokens, positions, None)
            else:
                def step(it, model):
                    out = model(tokens, positions, None)
                    return out, lambda o: (o.float().sum(), {})
                get_forward_backward_func()(
                    forward_step_func=step,
                    data_iterator=[iter(range(num_mb)) for _ in chunks] if vpp else iter(range(num_mb)),
                    model=chunks if vpp else chunks[0], num_microbatches=num_mb,
                    seq_length=tokens.shape[1] * cp, micro_batch_size=tokens.shape[0], forward_only=True,
                )

        # reference: rows of the full routes at the reference indices (after the SP split)
        ref_idx = ref_local_index(LENGTHS, **kw, tp=tp, tr=tr, sp=sp)
        flat = torch.cat([torch.cat([r, torch.full((1, NUM_LAYERS, TOPK), -1)]) for r in full])
        checked, pad_rows = 0, []
        assert sorted({l for l, _ in seen}) == sorted(sspec.layer_ids) and len(seen) == num_mb * len(sspec.layer_ids)
        for layer, routing_map in seen:
            assert routing_map.shape == (ref_idx.numel(), NUM_EXPERTS)
            assert bool((routing_map.sum(1) == TOPK).all())
            for row, g in enumerate(ref_idx.tolist()):
                want = flat[g, layer] if g >= 0 else torch.tensor([-1])
                if g >= 0 and int(want[0]) >= 0:
                    assert routing_map[row].nonzero().view(-1).tolist() == sorted(want.tolist()), (layer, row, g)
                    checked += 1
                else:  # padding row or a sample's last token: spread padding
                    pad_rows.append(tuple(routing_map[row].nonzero().view(-1).tolist()))
        spread = len(set(pad_rows)) > 1 or len(pad_rows) <= 1
        return checked, len(pad_rows), spread, received_bytes, tuple(sspec.layer_ids)


CASES = [
    # tp, sp, cp, pp, vpp, layout, moe_layer_freq
    (1, False, 1, 1, None, "thd", 1),
    (2, False, 1, 1, None, "thd", 1),
    (2, True, 1, 1, None, "thd", 1),
    (1, False, 2, 1, None, "thd", 1),
    (2, True, 2, 1, None, "thd", 1),
    (1, False, 1, 2, None, "thd", [0, 1, 1, 1]),
    (2, True, 1, 2, None, "thd", 1),
    (1, False, 2, 2, None, "thd", [0, 1, 1, 1]),
    (1, False, 1, 2, 2, "thd", [0, 1, 1, 1]),
    (2, True, 2, 1, None, "allgather", 1),
    (1, False, 2, 1, None, "bshd", 1),
    (2, True, 2, 1, None, "bshd", 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "tp{}{}-cp{}-pp{}{}-{}{}".format(
    c[0], "sp" if c[1] else "", c[2], c[3], f"v{c[4]}" if c[4] else "", c[5], "-dense0" if c[6] != 1 else ""))
def test_replayed_routes_equal_reference_slice(pool4, case):
    results = pool4.run(_replayed_vs_reference, *case)
    tp, sp, cp, pp, vpp, layout, freq = case
    for checked, num_pad, spread, _, layer_ids in results:
        assert spread  # (a rank may hold only padding: bshd tails under CP x SP)
        assert 0 not in layer_ids or freq == 1  # the dense first layer has no router
    assert sum(r[0] for r in results) > 0
    # the layers of all pipeline stages together are exactly the MoE layers
    all_layers = sorted({i for r in results for i in r[4]})
    assert all_layers == [i for i, moe in enumerate(moe_layer_pattern(NUM_LAYERS, freq)) if moe]


def test_each_rank_receives_only_its_shard(pool4):
    results = pool4.run(_replayed_vs_reference, 2, True, 2, 1, None, "thd", 1, True)
    full_int32 = sum((t - 1) * NUM_LAYERS * TOPK * 4 for t in LENGTHS)
    for checked, _, _, received, _ in results:
        assert checked > 0
        assert received < full_int32 / 4  # a quarter of the tokens, 1 byte per id (+ mask)


def test_filler_row_of_the_last_token_is_not_valid():
    """Issue 13's repro: SGLang gives T-1 rows; the filled last row is not a rollout route."""
    shard = shard_routes([torch.tensor([[[0, 1]], [[2, 3]]])], [3], RouteShardSpec(layer_ids=(0,), num_experts=8))
    assert shard.valid.tolist() == [True, True, False]
    assert shard.replayed.tolist() == [[True], [True], [False]]  # the router chooses for the last token
    # with padding: padding rows replay their filler (replayed) but are not valid either
    shard = shard_routes([torch.tensor([[[0, 1]], [[2, 3]]]), torch.tensor([[[4, 5]]])], [3, 2],
                         RouteShardSpec(layer_ids=(0,), num_experts=8, pad_multiple=4))
    assert shard.valid.tolist() == [True, True, False, True, False, False, False, False]
    assert shard.replayed.view(-1).tolist() == [True, True, False, True, False, True, True, True]
    # full rows (T rows given): everything valid and replayed, no mask sent
    shard = shard_routes([torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]])], [3], RouteShardSpec(layer_ids=(0,), num_experts=8))
    assert shard.valid.tolist() == [True, True, True] and shard.replayed is None
