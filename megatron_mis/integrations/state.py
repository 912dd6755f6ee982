"""The per-process state of the host drop-ins, kept OFF the host's ``args``.

Megatron pickles ``args`` into every checkpoint (``state_dict['args'] = args``) and slime / Miles
use that object as Megatron's global args, so nothing of megatron-mis may live on it: a CUDA
event, a scheduler or an open file there breaks the first checkpoint save. Everything the
drop-ins remember between calls lives in a :class:`DropInState` owned by this module's
:class:`StateRegistry`, keyed by the identity of the ``args`` object:

- an ``args`` that takes weak references (``argparse.Namespace``) is forgotten when it dies;
- one that does not (``types.SimpleNamespace``) is held strongly, so its id cannot be reused by
  another object while the entry exists (:meth:`StateRegistry.forget` drops it).

The registry is an object (``REGISTRY``), not hidden module globals: tests and embedders can
make their own and hand it in. What must survive a restart (the length-decay schedule) has
``state_dict`` / ``load_state_dict`` on the object that owns it; the scheduler wrapper itself is
checkpointed by the host through the patches (see :mod:`megatron_mis.integrations.scheduler_hooks`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DropInState", "GlobalMean", "REGISTRY", "StateRegistry", "state_of"]


@dataclass
class GlobalMean:
    """The global self-normalisation mean of one rollout, as computed by
    :func:`~megatron_mis.integrations.tis_functions.prepare_global_normalizer`.

    Attributes:
        rollout_id: the rollout it belongs to.
        mean: 0-dim float64 tensor (on the device of the rollout data).
        num_samples: samples of that rollout on this rank (what the micro-batches may consume).
        consumed: samples already trained with it.
    """

    rollout_id: int
    mean: Any
    num_samples: int
    consumed: int = 0


@dataclass
class DropInState:
    """What the drop-ins of one ``args`` remember between calls.

    Attributes:
        config: ``(snapshot of the MIS keys on args, validated MISConfig)``.
        pending_nonfinite: the previous call's :class:`~megatron_mis.core.engine.DeferredCount`.
        nonfinite_backlog: earlier calls' counts whose CUDA event had not completed when polled.
        global_mean: the current rollout's :class:`GlobalMean`.
        warned: keys of the warn-once messages already given.
        lr: the length-decay / monitor hooks' ``HostState`` (see scheduler_hooks).
    """

    config: tuple | None = None
    pending_nonfinite: Any = None
    nonfinite_backlog: list = field(default_factory=list)
    global_mean: GlobalMean | None = None
    warned: set[str] = field(default_factory=set)
    lr: Any = None

    def state_dict(self) -> dict[str, Any]:
        """What must survive a restart: the length-decay schedule (when the hooks made one).
        The config is re-read from ``args``, the global mean recomputed every rollout, warnings
        given again."""
        out: dict[str, Any] = {}
        if self.lr is not None and getattr(self.lr, "scheduler", None) is not None:
            out["lr_schedule"] = self.lr.scheduler.schedule.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the schedule is loaded once the hooks attach it."""
        unknown = set(state) - {"lr_schedule"}
        if unknown:
            raise KeyError(f"unknown DropInState keys {sorted(unknown)}; valid: ['lr_schedule']")
        if "lr_schedule" in state:
            if self.lr is None or getattr(self.lr, "scheduler", None) is None:
                raise RuntimeError(
                    "load_state_dict: no length-decay scheduler is attached to these args yet; call it after "
                    "wrap_opt_param_scheduler / the first before_train_step"
                )
            self.lr.scheduler.schedule.load_state_dict(state["lr_schedule"])


class StateRegistry:
    """``args`` object -> :class:`DropInState`, by identity (``args`` need not be hashable)."""

    def __init__(self) -> None:
        self._states: dict[int, DropInState] = {}
        self._strong: dict[int, Any] = {}  # args that take no weak reference, kept alive

    def get(self, args: Any) -> DropInState:
        """The state of ``args``, created on first use."""
        key = id(args)
        state = self._states.get(key)
        if state is not None:
            return state
        state = DropInState()
        try:
            weakref.finalize(args, self._states.pop, key, None)
        except TypeError:
            self._strong[key] = args
        self._states[key] = state
        return state

    def peek(self, args: Any) -> DropInState | None:
        """The state of ``args`` if it has one (creates nothing)."""
        return self._states.get(id(args))

    def forget(self, args: Any) -> None:
        """Drop the state of ``args`` (a no-op if it has none)."""
        self._states.pop(id(args), None)
        self._strong.pop(id(args), None)

    def __len__(self) -> int:
        return len(self._states)


#: The registry the host entry points use.
REGISTRY = StateRegistry()


def state_of(args: Any) -> DropInState:
    """The :class:`DropInState` of ``args`` in :data:`REGISTRY`."""
    return REGISTRY.get(args)
