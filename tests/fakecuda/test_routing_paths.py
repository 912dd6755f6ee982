"""Routing replay per router call on fake ``cuda:0`` tensors: the manager's pre-hook (host
routes, valid and replayed flags moved to the router's device), the replay top-k with
fallback and agreement, and the post-hook bookkeeping — no host synchronisation. The per-step
read of the agreement statistics is one read."""

from __future__ import annotations

import torch

from megatron_mis.routing.replay import RoutingReplay, _RouterEntry
from megatron_mis.routing.replay_hook import _ReplayHook
from megatron_mis.routing.slicing import RouteShard
from megatron_mis.testing.fake_cuda import shadow


def _topk(scores, topk, num_groups=None, group_topk=None):
    probs, idx = torch.topk(scores, topk, dim=1)
    return probs, idx


class _Router:
    def __init__(self, weight):
        self.weight = weight


def test_router_call_with_replay_fallback_and_agreement(probe):
    g = torch.Generator().manual_seed(0)
    tokens, experts, k, layer = 10, 6, 2, 3
    routes = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.uint8)[:, None, :]
    replayed = torch.ones(tokens, 1, dtype=torch.bool)
    replayed[[1, 4]] = False  # two tokens fall back to the router's own choice
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[-1] = False  # padding
    shard = RouteShard(routes, (layer,), valid, replayed)  # host data, as the rollout delivers it

    replay = RoutingReplay([], routing_replay_mode="r3", routing_replay_agreement=True)
    entry = _RouterEntry(name="router", layer_id=layer, router=_Router(probe.cuda(torch.zeros(experts, 4))), hook=_ReplayHook(layer))
    replay._entries[layer] = entry  # as install() leaves it: set_routes moves the shard to the router's device
    replay.set_routes(0, shard)
    replay._current_key = 0
    hidden = probe.cuda(torch.randn(tokens, 4, generator=g))
    scores = probe.cuda(torch.randn(tokens, experts, generator=g))
    for _ in range(2):  # two calls: the agreement accumulates on the device
        replay._router_pre(entry, None, (hidden,), {})
        probs, idx = entry.hook.get_replay_topk(scores, k, default_compute_topk=_topk)
        replay._router_post(entry, None, (hidden,), (probs, idx))
    probe.check_outputs([probs, idx, replay._agreement, replay._fallback])
    probe.assert_clean(what="routing replay per router call")
    expected = routes[:, 0].long()
    natural = torch.topk(shadow(scores), k, dim=1).indices
    expected[[1, 4]] = natural[[1, 4]]
    assert torch.equal(shadow(idx), expected)
    # per step: one read of every layer's statistics
    ids, stats = replay.agreement_stats()
    probe.assert_clean(allowed=1, what="agreement_stats")
    assert ids == [layer] and stats.shape == (1, 2) and float(stats[0, 1]) == 2 * 7  # 9 valid minus 2 fallbacks, twice


def test_agreement_counts_without_valid_flags(probe):
    from megatron_mis.routing.agreement import agreement_counts

    out = agreement_counts(probe.cuda(torch.tensor([[0, 1], [2, 3]])), probe.cuda(torch.tensor([[1, 0], [2, 4]])))
    probe.check_outputs([out])
    probe.assert_clean(what="agreement_counts(valid=None)")
    assert shadow(out).tolist() == [1.5, 2.0]  # row 0 agrees on both experts, row 1 on one of two
