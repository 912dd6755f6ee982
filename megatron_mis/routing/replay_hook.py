"""The per-router replay object both backends use, and the probe for Megatron-Core's native hook.

:class:`_ReplayHook` speaks Megatron-Core's ``router.router_replay.get_replay_topk`` protocol (the
hook behind ``moe_enable_routing_replay``, core >= 0.16): the native backend puts one on each
router; the legacy backend (:mod:`megatron_mis.routing.replay_legacy`) calls it from its patched
top-k. It subclasses ``RouterReplay`` when that exists, so the native record / replay code runs,
but it does not register in ``RouterReplay``'s global instance list. Managed by
:class:`megatron_mis.routing.replay.RoutingReplay`.
"""

from __future__ import annotations

import inspect

import torch

from megatron_mis.routing.agreement import agreement_counts

__all__ = ["native_replay_available"]

_RECORD = "record"
_REPLAY = "replay"


def _router_module():
    from megatron.core.transformer.moe import router

    return router


def native_replay_available() -> bool:
    """Whether the installed Megatron-Core routes top-k through ``router.router_replay``
    (core >= 0.16, or an older core with ``patches/`` applied)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron-core is a hard requirement
        return False
    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    return fn is not None and "router_replay" in inspect.signature(fn).parameters


def _replay_base():
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        return RouterReplay, RouterReplayAction
    except ImportError:
        return None, None


_NativeRouterReplay, _NativeAction = _replay_base()


class _ReplayHook(_NativeRouterReplay or object):  # type: ignore[misc]
    """One router's replay object; speaks the ``router_replay.get_replay_topk`` protocol.

    ``action`` is set by the manager before each router call: ``None`` (natural routing),
    ``"record"`` or ``"replay"`` (with ``target``: ``[N, k]`` int64 on the router's device).
    """

    def __init__(self, layer_id: int) -> None:  # no super().__init__(): it registers globally
        self.layer_id = layer_id
        self.action: str | None = None
        self.target: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.fallback: torch.Tensor | None = None  # [N] bool: the router's own top-k here
        self.fallback_count = None  # [1] float64 on the device, this call's fallback tokens
        self.recorded: torch.Tensor | None = None
        self.collect_agreement = False
        self.count_fallback = False
        self.agreement = None  # [2] float64 accumulated on the device
        self.used = False  # set when the router consulted the hook during the current call
        # attributes the native RouterReplay code reads
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        self.used = True
        if self.action is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        if self.action == _RECORD:
            if _NativeAction is not None:
                self.router_replay_action = _NativeAction.RECORD
                probs, idx = _NativeRouterReplay.get_replay_topk(
                    self, scores, topk, num_groups, group_topk, default_compute_topk
                )
            else:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.recorded = idx.detach()
            return probs, idx
        target = self.target
        if target.shape != (scores.shape[0], topk):
            raise RuntimeError(
                f"layer {self.layer_id}: replay routes have shape {tuple(target.shape)} but the router "
                f"scores {scores.shape[0]} tokens with topk={topk}"
            )
        fallback = self.fallback
        if fallback is not None or self.collect_agreement:
            with torch.no_grad():
                _, natural = default_compute_topk(scores.detach(), topk, num_groups, group_topk)
            natural = natural.to(target.dtype)
        if self.collect_agreement:
            with torch.no_grad():
                valid = self.valid
                if fallback is not None:
                    valid = ~fallback if valid is None else valid.to(fallback.device) & ~fallback
                stats = agreement_counts(target, natural, valid)
                if fallback is not None:
                    self.fallback_count = fallback.sum().to(torch.float64).view(1)
            self.agreement = stats if self.agreement is None else self.agreement + stats
        if fallback is not None:
            target = torch.where(fallback.unsqueeze(1), natural, target)
        if _NativeAction is not None:
            self.router_replay_action = _NativeAction.REPLAY_FORWARD
            self.target_topk_idx = target
            probs, idx = _NativeRouterReplay.get_replay_topk(
                self, scores, topk, num_groups, group_topk, default_compute_topk
            )
            self.target_topk_idx = None
            return probs, idx
        return scores.gather(1, target), target


