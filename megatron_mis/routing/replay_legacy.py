"""The legacy routing-replay backend for megatron-core 0.13 - 0.15: a runtime patch of the
router's top-k (``topk_routing_with_score_function`` of 0.14 / 0.15, ``topk_softmax_with_capacity``
of 0.13) that runs the same routing with the replayed top-k while a router is being replayed, and
the original otherwise. Installed with the first legacy :class:`~megatron_mis.routing.replay.RoutingReplay`,
removed with the last; ``patches/`` holds the same change as a source patch.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from megatron_mis.routing.replay_hook import _ReplayHook, _router_module

__all__ = ["LEGACY_PATCH", "LegacyTopkPatch", "legacy_routing_call"]


def _routing_with_hook(
    hook: _ReplayHook,
    logits: torch.Tensor,
    topk: int,
    *,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing whose expert choice goes through ``hook`` (the math of Megatron-Core's
    score-function routing; only the top-k call differs).

    Returns ``(routing_probs [N, E], routing_map [N, E] bool, top_indices [N, k])``.
    """
    from megatron.core.transformer.moe import moe_utils

    if logits.dim() != 2:
        raise ValueError(f"expected [num_tokens, num_experts] logits, got {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape

    def natural_topk(scores, k, num_groups=None, group_topk=None):
        if group_topk:
            return moe_utils.group_limited_topk(
                scores=scores, topk=k, num_tokens=num_tokens, num_experts=num_experts,
                num_groups=num_groups, group_topk=group_topk,
            )
        return torch.topk(scores, k=k, dim=1)

    def choose(scores):
        return hook.get_replay_topk(scores, topk, num_groups, group_topk, natural_topk)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, idx = choose(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            chosen_logits, idx = choose(logits)
            probs = torch.softmax(chosen_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        sig = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is None:
            chosen, idx = choose(sig)
        else:  # the bias steers the choice; the weights come from the unbiased scores
            _, idx = choose(sig + expert_bias)
            chosen = torch.gather(sig, 1, idx).type_as(logits)
        probs = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    else:
        raise ValueError(f"unknown score_function {score_function!r}; valid: softmax, sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    if torch.are_deterministic_algorithms_enabled():
        rows = torch.arange(num_tokens, device=logits.device).unsqueeze(1)
        routing_probs = torch.zeros_like(logits).index_put((rows, idx), probs, accumulate=False)
        routing_map = torch.zeros_like(logits).index_put((rows, idx), torch.ones_like(probs), accumulate=False).bool()
    else:
        routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
    return routing_probs, routing_map, idx


def _apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    topk: int,
    capacity_factor: float | None,
    pad_to_capacity: bool,
    drop_policy: str,
):
    """Megatron-Core 0.13's token dropping after top-k (``topk_softmax_with_capacity``)."""
    import math

    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return probs, routing_map, tokens_per_expert
    num_tokens, num_experts = probs.shape
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)  # 0.13's get_capacity
    if drop_policy == "probs":
        _, keep = torch.topk(probs, k=capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        _, keep = torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"unknown drop_policy {drop_policy!r}; valid: probs, position")
    capacity_mask = torch.zeros_like(probs).scatter(0, keep, 1).bool()
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return probs * final_map, final_map, tokens_per_expert


class LegacyTopkPatch:
    """The runtime patch of the router's top-k for megatron-core 0.13 - 0.15 (module docstring).

    One instance per process (:data:`LEGACY_PATCH`); :meth:`acquire` / :meth:`release` count
    users, the wrapper is installed with the first and the original restored with the last.
    ``active`` is the hook of the router being called right now (set by the manager's router
    pre-hook, cleared after the call); with no active hook the original function runs.
    """

    _NAMES = ("topk_routing_with_score_function", "topk_softmax_with_capacity")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._name: str | None = None
        self._original = None
        self._signature = None
        self._installed = None
        self.active: _ReplayHook | None = None

    @property
    def installed(self) -> bool:
        return self._users > 0

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                module = _router_module()
                name = next((n for n in self._NAMES if hasattr(module, n)), None)
                if name is None:
                    raise RuntimeError(
                        "megatron.core.transformer.moe.router has neither topk_routing_with_score_function "
                        "nor topk_softmax_with_capacity: this megatron-core version is not supported"
                    )
                self._name, self._original = name, getattr(module, name)
                self._signature = inspect.signature(self._original)
                self._installed = self._wrapper  # one bound-method object, compared by identity
                setattr(module, name, self._installed)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                module = _router_module()
                if getattr(module, self._name) is not self._installed:
                    raise RuntimeError(
                        f"megatron.core.transformer.moe.router.{self._name} was replaced by someone else "
                        "while the routing-replay patch was installed; not restoring over it"
                    )
                setattr(module, self._name, self._original)
                self._name = self._original = self._signature = self._installed = None
                self.active = None

    def _wrapper(self, *args: Any, **kwargs: Any):
        hook = self.active
        if hook is None or hook.action is None:
            return self._original(*args, **kwargs)
        return legacy_routing_call(self._name, self._signature, hook, args, kwargs)


def legacy_routing_call(name: str, signature: inspect.Signature, hook: _ReplayHook, args: tuple, kwargs: dict):
    """Run Megatron-Core's routing function ``name`` (``topk_routing_with_score_function`` of
    0.14 - 0.16 or ``topk_softmax_with_capacity`` of 0.13), called with ``args`` / ``kwargs``
    against its ``signature``, with the expert choice going through ``hook``. Returns what the
    original returns: ``(probs, routing_map)``, plus ``tokens_per_expert`` for 0.13."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("fused"):
        raise RuntimeError("routing replay cannot run through the fused (TE) top-k; set moe_router_fusion=False")
    probs, routing_map, _ = _routing_with_hook(
        hook,
        a["logits"],
        a["topk"],
        use_pre_softmax=a.get("use_pre_softmax", False),
        num_groups=a.get("num_groups"),
        group_topk=a.get("group_topk"),
        scaling_factor=a.get("scaling_factor"),
        score_function=a.get("score_function", "softmax"),
        expert_bias=a.get("expert_bias"),
    )
    if name == "topk_softmax_with_capacity":
        return _apply_capacity(
            probs,
            routing_map,
            topk=a["topk"],
            capacity_factor=a.get("capacity_factor"),
            pad_to_capacity=a.get("pad_to_capacity", False),
            drop_policy=a.get("drop_policy", "probs"),
        )
    if name != "topk_routing_with_score_function":
        raise ValueError(f"unknown routing function {name!r}")
    return probs, routing_map


LEGACY_PATCH = LegacyTopkPatch()


