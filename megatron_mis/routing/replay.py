"""Replay MoE routing decisions inside Megatron-Core's routers (R3 / R2).

:class:`RoutingReplay` is an object that installs itself on a model (a module or the list of
virtual-pipeline chunks) and removes itself again; it is re-entrant and leaves nothing behind.

Modes (``routing_replay_mode``):

``r3``
    every router uses the experts the rollout engine chose (per micro-batch
    :class:`~megatron_mis.routing.slicing.RouteShard`, given with :meth:`RoutingReplay.set_routes`
    or :meth:`RoutingReplay.load_routes`).
``r2``
    the first forward of a micro-batch records the trainer's own choices; every later forward of
    that micro-batch (and every backward recomputation) replays them.
``off``
    nothing is installed.

Replay gathers the router's scores at the given experts, so the router weights still receive
gradients through the gathered probabilities; only the discrete choice is fixed.

Tokens without a rollout route (``RouteShard.replayed`` False: a sample's last token, tokens
appended after the last request, negative ids from SGLang) are routed by the router's own top-k,
exactly as without replay; they are left out of the agreement metric and counted per layer
(:meth:`RoutingReplay.fallback_counts`). Padding rows replay their spread filler routes.

Backends (``routing_replay_backend``):

``native`` (megatron-core >= 0.16, or an older core patched with ``patches/``)
    Megatron's top-k routing consults ``router.router_replay`` (the hook behind
    ``moe_enable_routing_replay``). The manager puts a per-router replay object of its own there
    — a :class:`megatron.core.transformer.moe.router_replay.RouterReplay` subclass that runs the
    native record / replay code but is not added to ``RouterReplay``'s global instance list and
    does not pop backward routes first-in-first-out — and restores the original on removal.
``legacy`` (megatron-core 0.13 - 0.15)
    A runtime patch of the router's top-k: the name ``topk_routing_with_score_function``
    (0.14, 0.15) or ``topk_softmax_with_capacity`` (0.13) in ``megatron.core.transformer.moe.router``
    is replaced by a wrapper that runs the same routing with the replayed top-k while a router
    is being replayed, and calls the original otherwise. Installed with the first legacy manager,
    removed with the last. ``patches/`` holds the same change as a source patch.
``auto``
    native when the installed core has the hook, else legacy.

Micro-batch keys, not first-in-first-out: every forward of a model chunk belongs to a micro-batch
key (the chunk's forward count since :meth:`RoutingReplay.begin_pass`, or an explicit
:meth:`RoutingReplay.set_micro_batch`). The key is attached to the chunk's output autograd node;
when a micro-batch's backward starts there, the key becomes current again, so activation
recomputation inside that backward replays that micro-batch's routes under any pipeline schedule
(1F1B, interleaved, no pipelining) and any order of backward passes.

Layers are matched by global layer number (``router.layer_number``), so dense layers, pipeline
and virtual-pipeline offsets need no bookkeeping; MTP routers (inside ``mtp.``, layer numbers
beyond ``num_layers``) route naturally unless ``routing_replay_exclude_mtp`` is False.

Where the code is: this module holds the manager (:class:`RoutingReplay`);
:mod:`megatron_mis.routing.replay_hook` the per-router replay object and the native probe;
:mod:`megatron_mis.routing.replay_legacy` the legacy backend. Every name stays importable from
here.

Limits: routers with ``moe_router_fusion`` (TE fused top-k ignores the hook) or
``moe_router_load_balancing_type='sinkhorn'`` cannot be replayed and raise at install; the
combined-1F1B schedule (``build_schedule_plan``) bypasses the model's forward hooks and is not
supported.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_mis.core.checks import reads_values
from megatron_mis.core.segments import to_device
from megatron_mis.routing.config import RoutingReplayConfig  # noqa: F401
from megatron_mis.routing.agreement import agreement_fractions, reduce_agreement
from megatron_mis.routing.replay_hook import _RECORD, _REPLAY, _ReplayHook, native_replay_available
from megatron_mis.routing.replay_legacy import LEGACY_PATCH, LegacyTopkPatch, legacy_routing_call
from megatron_mis.routing.sglang import compact_route_dtype
from megatron_mis.routing.slicing import RouteShard

__all__ = ["RoutingReplayConfig", "RoutingReplay", "native_replay_available", "LegacyTopkPatch", "legacy_routing_call"]


# ------------------------------------------------------------------------------------ manager
@dataclass
class _RouterEntry:
    name: str
    layer_id: int  # global 0-based
    router: Any
    hook: _ReplayHook
    original_replay: Any = None


class RoutingReplay:
    """Routing replay for one model (see the module docstring).

    Args:
        model: a module or a list of modules (virtual-pipeline chunks). Each is one "chunk":
            micro-batch keys are counted per chunk.
        config: :class:`RoutingReplayConfig`; keyword ``overrides`` replace its fields.

    Typical use (plain Megatron-Core loop)::

        replay = RoutingReplay(model_chunks, RoutingReplayConfig(routing_replay_mode="r3"))
        with replay:
            replay.load_routes(shards)          # one RouteShard per micro-batch (this rank's)
            replay.begin_pass()                 # before each forward_backward_func call
            forward_backward_func(...)          # forwards, backwards, recomputation all replay
            metrics = replay.agreement(group=dp_cp_group)
            replay.clear()
    """

    def __init__(self, model: Any, config: RoutingReplayConfig | None = None, **overrides: Any) -> None:
        config = config if config is not None else RoutingReplayConfig()
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self._depth = 0
        self._handles: list[Any] = []
        self._entries: dict[int, _RouterEntry] = {}
        self._backend: str | None = None
        self._routes: dict[Any, RouteShard] = {}
        self._recorded: dict[tuple[Any, int], torch.Tensor] = {}
        self._counters = [0] * len(self.chunks)
        self._explicit_key: Any = None
        self._current_key: Any = None
        self._in_backward = False
        self._agreement: dict[int, torch.Tensor] = {}
        self._fallback: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------------ install / remove
    @property
    def mode(self) -> str:
        return self.config.routing_replay_mode

    @property
    def installed(self) -> bool:
        return self._depth > 0

    @property
    def backend(self) -> str | None:
        """``"native"`` or ``"legacy"`` while installed (``None`` otherwise or in mode off)."""
        return self._backend

    @property
    def layer_ids(self) -> list[int]:
        """Global 0-based layer ids of the routers this manager replays on this rank."""
        return sorted(self._entries)

    def __enter__(self) -> "RoutingReplay":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def install(self) -> "RoutingReplay":
        """Install hooks (re-entrant: a second call only counts)."""
        self._depth += 1
        if self._depth > 1 or self.mode == "off":
            return self
        try:
            self._install()
        except BaseException:
            self._depth -= 1
            self._uninstall()
            raise
        return self

    def remove(self) -> None:
        """Undo one :meth:`install`; the last one removes every hook and patch."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._uninstall()

    def _resolve_backend(self) -> str:
        want = self.config.routing_replay_backend
        native = native_replay_available()
        if want == "native" and not native:
            raise RuntimeError(
                "routing_replay_backend='native' needs megatron-core >= 0.16 (or a core patched with "
                "patches/megatron-core-*-router-replay-hook.patch); use 'legacy' or 'auto'"
            )
        if want == "auto":
            return "native" if native else "legacy"
        return want

    def _find_routers(self) -> list[_RouterEntry]:
        from megatron.core.transformer.moe.router import TopKRouter

        found: list[_RouterEntry] = []
        for chunk in self.chunks:
            for name, module in chunk.named_modules():
                if not isinstance(module, TopKRouter):
                    continue
                cfg = module.config
                if module.layer_number is None:
                    raise RuntimeError(f"router {name!r} has no layer_number; cannot match it to a route column")
                is_mtp = name.startswith("mtp.") or ".mtp." in name or module.layer_number > cfg.num_layers
                if is_mtp and self.config.routing_replay_exclude_mtp:
                    continue
                if getattr(cfg, "moe_router_fusion", False):
                    raise ValueError(
                        f"router {name!r}: moe_router_fusion=True runs Transformer Engine's fused top-k, "
                        "which ignores the replay hook; set moe_router_fusion=False for routing replay"
                    )
                if getattr(module, "routing_type", None) == "sinkhorn":
                    raise ValueError(f"router {name!r}: sinkhorn routing has no top-k to replay")
                if getattr(cfg, "moe_expert_capacity_factor", None) is not None:
                    warnings.warn(
                        f"router {name!r}: moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} drops "
                        "tokens after replay, so some replayed experts are not used",
                        UserWarning,
                        stacklevel=3,
                    )
                layer_id = module.layer_number - 1
                found.append(_RouterEntry(name, layer_id, module, _ReplayHook(layer_id)))
        return found

    def _install(self) -> None:
        entries = self._find_routers()
        seen: dict[int, str] = {}
        for e in entries:
            if e.layer_id in seen:
                raise RuntimeError(f"routers {seen[e.layer_id]!r} and {e.name!r} share layer number {e.layer_id + 1}")
            if getattr(e.router, "_mis_routing_replay", None) is not None:
                raise RuntimeError(f"router {e.name!r} is already managed by another RoutingReplay")
            seen[e.layer_id] = e.name
        self._backend = self._resolve_backend()
        for e in entries:
            self._entries[e.layer_id] = e
            e.router._mis_routing_replay = self
            if self._backend == "native":
                e.original_replay = getattr(e.router, "router_replay", None)
                e.router.router_replay = e.hook
            self._handles.append(e.router.register_forward_pre_hook(partial(self._router_pre, e), with_kwargs=True))
            self._handles.append(e.router.register_forward_hook(partial(self._router_post, e)))
        if self._backend == "legacy":
            LEGACY_PATCH.acquire()
        for i, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(partial(self._chunk_pre, i)))
            self._handles.append(chunk.register_forward_hook(self._chunk_post))

    def _uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for e in self._entries.values():
            if self._backend == "native":
                e.router.router_replay = e.original_replay
            if getattr(e.router, "_mis_routing_replay", None) is self:
                del e.router._mis_routing_replay
        if self._backend == "legacy":
            LEGACY_PATCH.release()
        self._entries = {}
        self._backend = None
        self._current_key = None

    # ------------------------------------------------------------------------------- routes
    def begin_pass(self) -> None:
        """Start a pass over the micro-batches (before each ``forward_backward_func`` call):
        chunk forwards are counted from 0 again, so the i-th forward of a chunk is key ``i``."""
        self._counters = [0] * len(self.chunks)
        self._explicit_key = None

    def set_micro_batch(self, key: Any) -> None:
        """Use ``key`` (any hashable) for the next forward of a chunk instead of the count."""
        self._explicit_key = key

    def set_routes(self, key: Any, shard: RouteShard) -> None:
        """Give the routes (this rank's :class:`RouteShard`) of micro-batch ``key`` (r3)."""
        if not isinstance(shard, RouteShard):
            raise TypeError(f"expected a RouteShard, got {type(shard).__name__}")
        missing = [i for i in self._entries if i not in shard.layer_ids]
        if missing:
            raise ValueError(
                f"micro-batch {key!r}: the shard has layers {shard.layer_ids} but this rank replays "
                f"routers of layers {missing} too (slice with local_moe_layer_ids / shard_spec_from_megatron)"
            )
        # reading the flags is free on the host (where routes arrive); on a device it would synchronise
        if shard.replayed is not None and reads_values(shard.replayed) and bool(shard.replayed.all()):
            shard = RouteShard(shard.routes, shard.layer_ids, shard.valid)  # nothing falls back
        if self._entries:
            device = next(iter(self._entries.values())).router.weight.device
            replayed = None if shard.replayed is None else _on(shard.replayed, device)
            shard = RouteShard(_on(shard.routes, device), shard.layer_ids, _on(shard.valid, device), replayed)
        self._routes[key] = shard

    def load_routes(self, shards: Sequence[RouteShard], *, first_key: int = 0) -> None:
        """:meth:`set_routes` for keys ``first_key, first_key + 1, ...`` (one shard per micro-batch)."""
        for i, shard in enumerate(shards):
            self.set_routes(first_key + i, shard)

    def clear(self) -> None:
        """Forget routes and recordings (end of a step). Agreement statistics are kept."""
        self._routes.clear()
        self._recorded.clear()
        self.begin_pass()
        self._current_key = None

    def recorded_routes(self, key: Any) -> dict[int, torch.Tensor]:
        """R2: ``{layer_id: [N, k]}`` (compact dtype) recorded for micro-batch ``key``."""
        return {layer: idx for (k, layer), idx in self._recorded.items() if k == key}

    # ---------------------------------------------------------------------------- metrics
    def agreement_stats(self) -> tuple[list[int], torch.Tensor]:
        """``(layer_ids, [num_layers, 2] float64)`` local agreement sums and token counts."""
        ids = sorted(self._agreement)
        if not ids:
            return [], torch.zeros(0, 2, dtype=torch.float64)
        return ids, torch.stack([self._agreement[i].detach() for i in ids]).to("cpu")  # one read

    def agreement(self, group: Any = None, *, num_layers: int | None = None) -> dict[int, float]:
        """Per-layer routing agreement ``{layer_id: fraction}`` (forward passes only).

        Without ``group`` the figures are this rank's. With a process group the statistics are
        summed over it first (one all-reduce of a ``[num_layers, 2]`` tensor; every rank of the
        group must call, with the same ``num_layers`` — the model's layer count, needed because
        pipeline stages hold different layers).
        """
        ids, stats = self.agreement_stats()
        if group is None:
            return agreement_fractions(stats, ids)
        if num_layers is None:
            raise ValueError("agreement(group=...) needs num_layers (the model's layer count)")
        full = torch.zeros(num_layers, 2, dtype=torch.float64)
        for i, row in zip(ids, stats):
            full[i] = row
        device = next(iter(self._entries.values())).router.weight.device if self._entries else "cpu"
        return agreement_fractions(reduce_agreement(full.to(device), group))

    def reset_agreement(self) -> None:
        """Forget the agreement statistics and the fallback counts."""
        self._agreement.clear()
        self._fallback.clear()

    def fallback_counts(self) -> dict[int, int]:
        """``{layer_id: tokens}`` routed by the router's own top-k because they had no rollout
        route (``RouteShard.replayed`` False), summed over forward passes (not backward
        recomputation) since the last :meth:`reset_agreement`; this rank's figures. One host
        synchronisation per call."""
        return {i: int(round(float(v.sum()))) for i, v in sorted(self._fallback.items())}

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Routes, R2 recordings and agreement statistics (CPU tensors)."""
        return {
            "mode": self.mode,
            "routes": {
                k: (s.routes.cpu(), s.layer_ids, s.valid.cpu(), None if s.replayed is None else s.replayed.cpu())
                for k, s in self._routes.items()
            },
            "recorded": {k: v.cpu() for k, v in self._recorded.items()},
            "agreement": {k: v.cpu() for k, v in self._agreement.items()},
            "fallback": {k: v.cpu() for k, v in self._fallback.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["mode"] != self.mode:
            raise ValueError(f"state was saved in mode {state['mode']!r}, this replay runs {self.mode!r}")
        self._routes = {k: RouteShard(v[0], tuple(v[1]), *v[2:]) for k, v in state["routes"].items()}
        self._recorded = dict(state["recorded"])
        self._agreement = dict(state["agreement"])
        self._fallback = dict(state.get("fallback", {}))

    # ------------------------------------------------------------------------------ hooks
    def _chunk_pre(self, index: int, module: Any, args: Any) -> None:
        if self._explicit_key is not None:
            key, self._explicit_key = self._explicit_key, None
        else:
            key = self._counters[index]
            self._counters[index] += 1
        self._current_key = key
        self._in_backward = False

    def _chunk_post(self, module: Any, args: Any, output: Any) -> None:
        key = self._current_key
        for t in _tensors(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(partial(self._enter_backward, key))

    def _enter_backward(self, key: Any, grad_outputs: Any) -> None:
        # first node of this micro-batch's backward: recomputation below replays `key`
        self._current_key = key
        self._in_backward = True

    def _router_pre(self, entry: _RouterEntry, module: Any, args: Any, kwargs: Any) -> None:
        hook = entry.hook
        key = self._current_key
        if key is None:
            raise RuntimeError(
                f"router of layer {entry.layer_id} ran outside a model chunk forward known to this "
                "RoutingReplay (pass the model chunks you call to RoutingReplay)"
            )
        hidden = args[0] if args else kwargs.get("input")
        num_tokens = hidden.numel() // hidden.shape[-1]
        if self.mode == "r3" or (key, entry.layer_id) in self._recorded:
            if self.mode == "r3":
                shard = self._routes.get(key)
                if shard is None:
                    raise KeyError(
                        f"no routes for micro-batch {key!r} (routes loaded for {sorted(map(repr, self._routes))}); "
                        "call set_routes / load_routes before the forward"
                    )
                col = shard.column(entry.layer_id)
                target = shard.routes[:, col].long()
                valid = shard.valid
                fallback = None if shard.replayed is None else ~shard.replayed[:, col]
            else:
                target, valid, fallback = self._recorded[(key, entry.layer_id)].long(), None, None
            if target.shape[0] != num_tokens:
                raise ValueError(
                    f"micro-batch {key!r}, layer {entry.layer_id}: {target.shape[0]} route rows for a router "
                    f"input of {num_tokens} tokens; slice routes exactly like the tokens (CP layout, packing, "
                    "sequence parallel, padding)"
                )
            hook.action, hook.target = _REPLAY, _on(target, hidden.device)
            hook.valid = None if valid is None else _on(valid, hidden.device)
            hook.fallback = None if fallback is None else _on(fallback, hidden.device)
            hook.collect_agreement = self.config.routing_replay_agreement and not self._in_backward
            hook.count_fallback = not self._in_backward
        else:  # r2, first forward of this micro-batch
            hook.action, hook.target, hook.valid, hook.fallback = _RECORD, None, None, None
            hook.collect_agreement = False
            hook.count_fallback = False
        hook.fallback_count = None
        hook.agreement = None
        hook.recorded = None
        hook.used = False
        if self._backend == "legacy":
            LEGACY_PATCH.active = hook

    def _router_post(self, entry: _RouterEntry, module: Any, args: Any, output: Any) -> None:
        hook = entry.hook
        if self._backend == "legacy":
            LEGACY_PATCH.active = None
        if not hook.used:
            hook.action = None
            raise RuntimeError(
                f"layer {entry.layer_id}: the router's top-k never consulted the replay hook "
                f"(backend {self._backend!r}); its routes would be silently ignored"
            )
        if hook.action == _RECORD:
            num_experts = entry.router.config.num_moe_experts
            self._recorded[(self._current_key, entry.layer_id)] = hook.recorded.to(compact_route_dtype(num_experts))
        if hook.agreement is not None:
            prev = self._agreement.get(entry.layer_id)
            self._agreement[entry.layer_id] = hook.agreement if prev is None else prev + hook.agreement
        if hook.fallback is not None and hook.count_fallback:
            count = hook.fallback_count
            if count is None:  # agreement off: count here (no host synchronisation either way)
                count = hook.fallback.sum().to(torch.float64).view(1)
            prev = self._fallback.get(entry.layer_id)
            self._fallback[entry.layer_id] = count if prev is None else prev + count
        hook.action = hook.target = hook.valid = hook.recorded = hook.agreement = None
        hook.fallback = hook.fallback_count = None


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host tensors through pinned memory and a non-blocking copy (per
    router call: a blocking copy would wait for the device)."""
    if t.device.type == "cpu" and torch.device(device).type != "cpu":
        return to_device(t, device)
    return t.to(device)


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from _tensors(o)
