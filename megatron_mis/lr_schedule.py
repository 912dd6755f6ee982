"""The response-length-surge learning-rate schedule (Beyond Precision (arXiv:2602.01826), Algorithm 1).

Three layers:

:class:`LengthDecaySchedule` (pure Python)
    Owns a surge detector, the trigger step ``s`` and the decay period ``T``, and maps a step ``t``
    to a multiplier of the base learning rate::

        factor(t) = 1                                        if not triggered or t <= s
                  = max(length_decay_factor ** n(t), length_decay_min_ratio)   otherwise
        n(t) = floor(t / T) - floor(s / T)   (anchor 'start': the multiples of T in (s, t])
             = floor((t - s) / T)             (anchor 'trigger': s + T, s + 2T, ...)

    Algorithm 1 sets ``eta_t <- max(eta_{t-1} / 2, eta_inf)`` whenever ``t mod T == 0``; by
    induction that is ``max(eta_0 / 2**n, eta_inf)`` with ``n`` the number of such ``t`` so far,
    which is the formula above with ``s = 0`` (trigger ``start``). The period comes from the
    surge's *onset* ``o`` (the first step of the run-up, estimated by the detector, see
    :mod:`megatron_mis.monitor.surge`): ``T = round(length_decay_period_multiple * o)``; the
    trigger ``s`` is the step on which the detector fired (the decay cannot start before the
    surge is seen). With a tripling that starts at step ``o = 110`` (detected at ``s = 112``) and
    the default multiple 1.8, ``T = 198``: steps 1..197 run at ``eta_0``, 198..395
    at ``eta_0 / 2``, 396..593 at ``eta_0 / 4``, 594..791 at ``eta_0 / 8``, and from 792 on at the
    floor ``0.1 eta_0`` (``1/16 < 0.1``). This matches the paper's figures, where the decay
    starts at step ``T`` itself (the dotted lines at steps 204 and 160).

    Steps are RL steps numbered from 1. ``factor(t)`` only depends on observations of steps before
    ``t`` (the trigger step itself runs undecayed), so it makes no difference whether the caller
    applies it before or after observing step ``t``'s response length.

:class:`LengthDecayScheduler`
    Standalone: ``lr = scheduler.step(response_length_mean)`` once per step, optionally setting a
    torch optimizer's learning rates.

:class:`LengthDecayParamScheduler`
    Wraps Megatron-Core's ``OptimizerParamScheduler``: its warm-up and decay still produce the base
    learning rate, the length-decay multiplies it. Drop-in for the host's ``step(increment)``,
    ``get_lr(param_group)``, ``state_dict()`` and ``load_state_dict()``.

Distributed use: every rank must feed the same number, the mean response length over the global
batch (all data-parallel ranks); then every rank computes the same multiplier without further
communication. :func:`megatron_mis.monitor.distributed.global_mean_response_length` computes it
with one all-reduce over an explicit data-parallel group.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

from megatron_mis.monitor.config import LengthDecayConfig, SurgeConfig
from megatron_mis.monitor.surge import SurgeDetector, SurgeEvent, _check_step, build_surge_detector
from megatron_mis.registry import Registry

__all__ = [
    "ConstantSchedule",
    "LR_SCHEDULES",
    "LengthDecayParamScheduler",
    "LengthDecaySchedule",
    "LengthDecayScheduler",
    "build_lr_schedule",
]

#: Name -> schedule class; every class takes ``(LengthDecayConfig, SurgeConfig)``.
LR_SCHEDULES: Registry[type["LengthDecaySchedule"]] = Registry("learning-rate schedule")


@LR_SCHEDULES.register("length_decay")
class LengthDecaySchedule:
    """Beyond Precision (arXiv:2602.01826)'s length-decay multiplier (see the module docstring for the exact formula).

    Args:
        decay: the decay settings.
        surge: the surge-detector settings (defaults when omitted).
        detector: a ready detector instead of one built from ``surge``.
    """

    name: ClassVar[str] = "length_decay"

    def __init__(
        self,
        decay: LengthDecayConfig | None = None,
        surge: SurgeConfig | None = None,
        *,
        detector: SurgeDetector | None = None,
    ) -> None:
        self.decay = decay if decay is not None else LengthDecayConfig()
        if not isinstance(self.decay, LengthDecayConfig):
            raise TypeError(f"decay must be a LengthDecayConfig, got {type(self.decay).__name__}")
        if detector is not None and surge is not None:
            raise ValueError("pass either surge (a SurgeConfig) or detector, not both")
        self.detector = detector if detector is not None else build_surge_detector(surge or SurgeConfig())
        self.last_step: int | None = None
        self.trigger_step: int | None = None
        self.onset_step: int | None = None
        self.decay_period: int | None = None
        if self.decay.length_decay_trigger == "start":
            self._set_trigger(0)
        elif self.decay.length_decay_surge_step is not None:
            self._set_trigger(self.decay.length_decay_surge_step)

    # ------------------------------------------------------------------------------- observing
    def observe(self, step: int, response_length_mean: float | None) -> SurgeEvent | None:
        """Record step ``step``'s global mean response length.

        Args:
            step: the RL step (>= 1, increasing; gaps allowed).
            response_length_mean: mean response length over the global batch, or ``None`` to
                advance the step without feeding the detector.

        Returns:
            The surge event if the detector fired on this observation (it triggers the decay
            unless the trigger is pinned or ``start``), else ``None``.
        """
        step = _check_step(step, self.last_step)
        if step < 1:
            raise ValueError(f"steps are numbered from 1, got {step}")
        event = None
        if response_length_mean is not None:
            event = self.detector.update(step, response_length_mean)
        self.last_step = step
        if event is not None and self.trigger_step is None:
            onset = event.onset_step if event.onset_step is not None else event.step
            self._set_trigger(event.step, onset=max(1, min(onset, event.step)))
        return event

    def _set_trigger(self, step: int, *, onset: int | None = None) -> None:
        """Trigger the decay at ``step``; the period comes from ``onset`` (default ``step``)."""
        self.trigger_step = step
        self.onset_step = step if onset is None else onset
        # step 0 only comes from trigger 'start', which the config requires to have a fixed period.
        self.decay_period = self.decay.resolve_period(self.onset_step)

    @property
    def triggered(self) -> bool:
        return self.trigger_step is not None

    @property
    def surge_event(self) -> SurgeEvent | None:
        """The detector's event (also when the trigger was pinned and the detector only reports)."""
        return self.detector.event

    # -------------------------------------------------------------------------------- the rule
    def num_decays(self, step: int) -> int:
        """Decay steps in ``(trigger, step]`` (0 before the trigger)."""
        s, period = self.trigger_step, self.decay_period
        if s is None or period is None or step <= s:
            return 0
        if self.decay.length_decay_anchor == "start":
            return step // period - s // period
        return (step - s) // period

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate for the update(s) of step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_decays(step)
        if n == 0:
            return 1.0
        # factor**n underflows to 0 for huge n, which the floor then replaces.
        return max(self.decay.length_decay_factor**n, self.decay.length_decay_min_ratio)

    def next_decay_step(self, step: int) -> int | None:
        """The first step after ``step`` at which the multiplier drops, or ``None`` (not triggered,
        or already at the floor)."""
        if self.trigger_step is None or self.decay_period is None:
            return None
        if self.factor(step) <= self.decay.length_decay_min_ratio:
            return None
        s, period = self.trigger_step, self.decay_period
        base = max(step, s)
        if self.decay.length_decay_anchor == "start":
            return (base // period + 1) * period
        return s + ((base - s) // period + 1) * period

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (plain Python types)."""
        return {
            "schedule": self.name,
            "decay_config": self.decay.to_dict(),
            "last_step": self.last_step,
            "trigger_step": self.trigger_step,
            "onset_step": self.onset_step,
            "decay_period": self.decay_period,
            "detector": self.detector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The saved trigger step and period are kept even if
        the config changed since (with a warning), so a resumed run continues the same schedule."""
        if state.get("schedule") != self.name:
            raise ValueError(f"schedule state is for {state.get('schedule')!r}, this schedule is {self.name!r}")
        if state.get("decay_config") != self.decay.to_dict():
            warnings.warn(
                f"restoring {self.name!r} schedule state saved under a different config "
                f"({state.get('decay_config')}); the saved trigger step and period are kept",
                UserWarning,
                stacklevel=2,
            )
        self.last_step = state["last_step"]
        self.trigger_step = state["trigger_step"]
        self.onset_step = state.get("onset_step", self.trigger_step)
        self.decay_period = state["decay_period"]
        self.detector.load_state_dict(state["detector"])

    def describe(self) -> str:
        """One line for logs."""
        if self.trigger_step is None:
            return f"{self.name}: not triggered (last step {self.last_step})"
        return (
            f"{self.name}: triggered at step {self.trigger_step}, period {self.decay_period}, "
            f"anchor {self.decay.length_decay_anchor}, surge onset {self.onset_step}"
        )


@LR_SCHEDULES.register("constant")
class ConstantSchedule(LengthDecaySchedule):
    """Multiplier 1 at every step, with the same detector and trigger bookkeeping: the baseline
    arm of an A/B comparison still reports where the decay would have started. Chosen by
    :func:`build_lr_schedule` when ``length_decay_enabled`` is false."""

    name = "constant"

    def factor(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return 1.0

    def next_decay_step(self, step: int) -> int | None:
        return None


def build_lr_schedule(decay: LengthDecayConfig, surge: SurgeConfig | None = None) -> LengthDecaySchedule:
    """``length_decay`` when ``decay.length_decay_enabled`` is true, else ``constant``."""
    name = "length_decay" if decay.length_decay_enabled else "constant"
    return LR_SCHEDULES.get(name)(decay, surge)


# --------------------------------------------------------------------------------- standalone
class LengthDecayScheduler:
    """Standalone per-step API: ``lr = scheduler.step(response_length_mean)``.

    Args:
        schedule: the multiplier rule (see :func:`build_lr_schedule`).
        base_lr: the initial learning rate eta_0. Optional when ``optimizer`` is given (then the
            first parameter group's learning rate).
        optimizer: optional torch optimizer; each ``step`` sets every parameter group's ``lr`` to
            its initial rate (kept in ``param_group['initial_lr']``, as torch schedulers do) times
            the multiplier.
    """

    def __init__(self, schedule: LengthDecaySchedule, base_lr: float | None = None, optimizer: Any = None) -> None:
        if not isinstance(schedule, LengthDecaySchedule):
            raise TypeError(f"schedule must be a LengthDecaySchedule, got {type(schedule).__name__}")
        self.schedule = schedule
        self.optimizer = optimizer
        if optimizer is not None:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
            if base_lr is None:
                base_lr = optimizer.param_groups[0]["initial_lr"]
        if base_lr is None or isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)):
            raise ValueError(f"base_lr must be a number (or give an optimizer), got {base_lr!r}")
        if not math.isfinite(base_lr) or base_lr < 0:
            raise ValueError(f"base_lr must be finite and >= 0, got {base_lr!r}")
        self.base_lr = float(base_lr)
        self.current_step = 0

    def step(self, response_length_mean: float | None = None, *, step: int | None = None) -> float:
        """Advance to the next step (or to ``step``), observe its global mean response length and
        return the learning rate for its update(s)."""
        step = self.current_step + 1 if step is None else step
        self.schedule.observe(step, response_length_mean)
        self.current_step = step
        factor = self.schedule.factor(step)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
        return self.base_lr * factor

    @property
    def lr(self) -> float:
        """The learning rate of the current step."""
        return self.base_lr * self.schedule.factor(self.current_step)

    def state_dict(self) -> dict[str, Any]:
        return {"current_step": self.current_step, "base_lr": self.base_lr, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_step = int(state["current_step"])
        self.base_lr = float(state["base_lr"])
        self.schedule.load_state_dict(state["schedule"])
        if self.optimizer is not None:
            factor = self.schedule.factor(self.current_step)
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor


# ------------------------------------------------------------------------------ Megatron-Core
class LengthDecayParamScheduler:
    """Composes the length-decay multiplier with a Megatron-Core ``OptimizerParamScheduler``.

    The wrapped scheduler still owns warm-up, decay style and weight decay; after each of its
    updates the wrapper multiplies every parameter group's ``lr`` by ``factor(current_step)``.
    Nothing of Megatron is imported: ``inner`` only needs ``step(increment)``, ``get_lr(group)``,
    ``state_dict()``, ``load_state_dict()``, ``optimizer.param_groups`` and ``num_steps`` (all
    present in megatron-core 0.13-0.16).

    Call order per RL step ``t`` (a plain Megatron-Core loop)::

        sched.observe(t, global_mean_response_length)   # before optimizer.step()
        optimizer.step()
        sched.step(increment)                            # as for OptimizerParamScheduler

    ``observe`` may also come after the update: ``factor(t)`` does not depend on step ``t``'s
    length. Steps without ``observe`` keep the last step's multiplier.

    Args:
        inner: the ``OptimizerParamScheduler`` (or a compatible object).
        schedule: the multiplier rule.

    Attributes:
        current_step: the RL step whose multiplier is applied (0 before the first ``observe``).
    """

    #: Key of the length-decay state inside :meth:`state_dict` (the rest is the inner scheduler's
    #: own dict, so a plain ``OptimizerParamScheduler`` can still load the checkpoint).
    STATE_KEY: ClassVar[str] = "megatron_mis_length_decay"

    def __init__(self, inner: Any, schedule: LengthDecaySchedule) -> None:
        for attr in ("step", "get_lr", "state_dict", "load_state_dict", "optimizer"):
            if not hasattr(inner, attr):
                raise TypeError(f"inner scheduler {type(inner).__name__} has no {attr!r}; expected an OptimizerParamScheduler")
        if isinstance(inner, LengthDecayParamScheduler):
            raise TypeError("inner scheduler is already a LengthDecayParamScheduler; wrap it only once")
        if not isinstance(schedule, LengthDecaySchedule):
            raise TypeError(f"schedule must be a LengthDecaySchedule, got {type(schedule).__name__}")
        self.inner = inner
        self.schedule = schedule
        self.current_step = 0
        self._base_lrs: list[float] | None = None
        self._applied_lrs: list[float] | None = None
        self._seen_num_steps: Any = None
        self.apply()

    # ------------------------------------------------------------------------- host interface
    def observe(self, step: int, response_length_mean: float | None) -> SurgeEvent | None:
        """Observe RL step ``step`` and apply its multiplier to the parameter groups now."""
        event = self.schedule.observe(step, response_length_mean)
        self.current_step = step
        self.apply()
        return event

    def step(self, increment: int) -> None:
        """The inner scheduler's ``step(increment)``, then the multiplier."""
        self.inner.step(increment)
        self.apply()

    def get_lr(self, param_group: dict) -> float:
        """The learning rate this group gets (the inner schedule's times the multiplier); hosts log
        this value."""
        return self.inner.get_lr(param_group) * self.factor

    @property
    def factor(self) -> float:
        """The multiplier of :attr:`current_step`."""
        return self.schedule.factor(self.current_step)

    def apply(self) -> float:
        """Set every group's ``lr`` to its base rate times the multiplier; returns the multiplier.

        The base rate is what the inner scheduler last wrote into the group. It is re-read when the
        inner scheduler has stepped (its ``num_steps`` changed) or someone else changed the ``lr``
        since this wrapper set it; otherwise the remembered base is reused, so calling ``apply``
        repeatedly never compounds the multiplier. Safe to call at any time.
        """
        factor = self.factor
        groups = list(self.inner.optimizer.param_groups)
        num_steps = getattr(self.inner, "num_steps", None)
        if (
            self._base_lrs is None
            or len(groups) != len(self._base_lrs)
            or num_steps != self._seen_num_steps
        ):
            self._base_lrs = [float(g["lr"]) for g in groups]
        else:
            for i, group in enumerate(groups):
                if group["lr"] != self._applied_lrs[i]:
                    self._base_lrs[i] = float(group["lr"])
        for group, base in zip(groups, self._base_lrs):
            group["lr"] = base * factor
        self._applied_lrs = [g["lr"] for g in groups]
        self._seen_num_steps = num_steps
        return factor

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The inner scheduler's dict plus :attr:`STATE_KEY` holding the length-decay state."""
        state = dict(self.inner.state_dict())
        state[self.STATE_KEY] = {"current_step": self.current_step, "schedule": self.schedule.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the inner scheduler, then the length-decay state, then re-apply the multiplier.

        A dict without :attr:`STATE_KEY` (a checkpoint written by a plain scheduler) restores the
        inner scheduler and keeps the length-decay state as it is, with a warning.
        """
        state = dict(state_dict)
        ours = state.pop(self.STATE_KEY, None)
        self.inner.load_state_dict(state)
        if ours is None:
            warnings.warn(
                "the scheduler checkpoint holds no length-decay state (written without megatron-mis "
                "wrapping?): the length-decay schedule starts from its current state; pin a known "
                "surge step with length_decay_surge_step to continue a decay",
                UserWarning,
                stacklevel=2,
            )
        else:
            self.schedule.load_state_dict(ours["schedule"])
            self.current_step = int(ours["current_step"])
        self._base_lrs = None  # the inner load stepped it: re-read the base rates
        self.apply()

    def __getattr__(self, name: str) -> Any:
        # Everything else (num_steps, max_lr, get_wd, ...) is the inner scheduler's.
        if name in ("inner", "__setstate__", "__getstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)
