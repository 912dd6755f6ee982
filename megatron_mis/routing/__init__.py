"""Rollout routing replay (R3) for MoE experts: rollout-side decoding, slicing, replay in Megatron.

Rollout side (no Megatron import): :mod:`~megatron_mis.routing.sglang` (request fields, decoding),
:mod:`~megatron_mis.routing.routes` (compact per-sample routes, multi-turn append).
Data wiring: :mod:`~megatron_mis.routing.slicing` (per-rank shards). Training side:
:mod:`~megatron_mis.routing.replay` (:class:`RoutingReplay`), :mod:`~megatron_mis.routing.agreement`.
Names are imported lazily so the rollout helpers never pull in megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SGLANG_SERVER_FLAG": "sglang",
    "request_routed_experts": "sglang",
    "decode_routed_experts": "sglang",
    "compact_route_dtype": "sglang",
    "SampleRoutes": "routes",
    "spread_padding_routes": "routes",
    "complete_sample_routes": "routes",
    "RouteShardSpec": "slicing",
    "RouteShard": "slicing",
    "shard_routes": "slicing",
    "local_token_index": "slicing",
    "local_moe_layer_ids": "slicing",
    "shard_spec_from_megatron": "slicing",
    "scatter_route_shards": "slicing",
    "RoutingReplay": "replay",
    "RoutingReplayConfig": "config",
    "native_replay_available": "replay",
    "agreement_counts": "agreement",
    "reduce_agreement": "agreement",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_mis.routing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatron_mis.routing.{_EXPORTS[name]}"), name)
