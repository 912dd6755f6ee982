"""``RoutingReplayConfig``: the routing-replay keys (light: no torch, no Megatron import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_mis.config.base import ConfigBase, doc

__all__ = ["RoutingReplayConfig"]


@dataclass(kw_only=True, slots=True)
class RoutingReplayConfig(ConfigBase):
    """Settings of :class:`RoutingReplay` (YAML / argparse keys)."""

    routing_replay_mode: Literal["off", "r3", "r2"] = doc(
        "off",
        "r3: routers use the rollout engine's experts; r2: the first forward of a micro-batch "
        "records the trainer's experts and later passes replay them; off: nothing is installed.",
    )
    routing_replay_backend: Literal["auto", "native", "legacy"] = doc(
        "auto",
        "native: Megatron-Core's router_replay hook (core >= 0.16 or patched); legacy: runtime "
        "patch of the router top-k (core 0.13-0.15); auto: native where available.",
    )
    routing_replay_exclude_mtp: bool = doc(
        True, "Leave multi-token-prediction routers on natural routing (the rollout engine returns no MTP routes)."
    )
    routing_replay_agreement: bool = doc(
        True,
        "Compute, in the same forward, the fraction of replayed experts the trainer's own "
        "router would have chosen, per layer (one extra top-k per router call).",
    )

    def _warnings(self) -> list[str]:
        out = []
        if self.routing_replay_mode == "off":
            for name, default in (("routing_replay_backend", "auto"), ("routing_replay_agreement", True)):
                if getattr(self, name) != default:
                    out.append(f"{name}={getattr(self, name)!r} has no effect with routing_replay_mode='off'")
        return out
