"""How slime and Miles drive the length-decay scheduler and the mismatch monitor.

Read in slime 624b824a898ab0ec1fcb4d373004c7f3852bf515 and Miles
31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (``backends/megatron_utils``):

- Both build a Megatron-Core ``OptimizerParamScheduler`` in ``model.get_optimizer_param_scheduler``
  and call ``opt_param_scheduler.step(increment=<samples>)`` after each ``optimizer.step()`` in
  ``model.train_one_step``; its ``state_dict`` goes into their Megatron checkpoints; they log
  ``opt_param_scheduler.get_lr(param_group)`` as the learning rate. Neither lets a user replace
  that scheduler.
- Both call ``--custom-megatron-before-train-step-hook-path`` as
  ``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` on every training rank
  before each step's forward pass (so before ``optimizer.step()``).
- slime calls ``--rollout-data-postprocess-path`` as ``fn(args, rollout_id, rollout_data)`` on
  every training rank before ``train()``; ``rollout_data["response_lengths"]`` holds the samples
  of this data-parallel rank (its TP / PP / CP peers hold the same ones). Miles calls the same
  option as ``fn(args)``, without the data.
- ``--custom-config-path`` sets every YAML key on ``args``.

Hence two ways to run the length-decay scheduler (configs from the ``length_surge_*`` /
``length_decay_*`` keys on ``args``; a step is a rollout, ``step = rollout_id + 1``):

Hooks only (slime, no patch)
    ``--rollout-data-postprocess-path megatron_mis.integrations.slime.rollout_data_postprocess``
    ``--custom-megatron-before-train-step-hook-path megatron_mis.integrations.slime.before_train_step``
    The first hook computes the global-batch mean response length (one all-reduce over the
    data-parallel group); the second attaches a :class:`LengthDecayParamScheduler` to the host's
    scheduler object (without replacing it) and rescales the learning rates before every step.
    Limits: the schedule's state is not in the host's checkpoints (after a resume the detector
    starts afresh; pin the logged surge step with ``length_decay_surge_step`` to continue a
    decay), and the host logs the undecayed rate (the monitor logs the applied one).

Patched (slime or Miles; ``patches/*.patch``)
    The patch wraps the scheduler where the host creates it (:func:`wrap_opt_param_scheduler`), so
    the host's ``step``, ``get_lr`` (its logs), ``state_dict`` and ``load_state_dict`` (its
    checkpoints) go through the wrapper and a resumed run continues exactly. For Miles the patch
    also feeds the response lengths (:func:`observe_rollout`), and for both it feeds the monitor
    (:func:`monitor_train_step`) when ``monitor_enabled`` is set.

The hooks' state (:class:`HostState`) lives in the drop-ins' per-process registry
(:mod:`megatron_mis.integrations.state`), keyed by the ``args`` object the host passes to every
hook; nothing is stored on ``args``, which Megatron pickles into every checkpoint.

Users point their flags at the host's entry module (:mod:`megatron_mis.integrations.slime`,
:mod:`megatron_mis.integrations.miles`), which re-exports these hooks; this module implements them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from megatron_mis.monitor.config import LengthDecayConfig, MonitorConfig, ScheduleConfigs, SurgeConfig
from megatron_mis.lr_schedule import LengthDecayParamScheduler, build_lr_schedule
from megatron_mis.integrations.state import state_of

__all__ = [
    "HostState",
    "before_train_step",
    "configs_from_args",
    "host_state",
    "monitor_train_step",
    "observe_rollout",
    "wrap_opt_param_scheduler",
]

@dataclass
class HostState:
    """What the hooks share between calls (kept in the drop-in registry, never on ``args``).

    Attributes:
        configs: the three configs read from ``args``.
        scheduler: the wrapper, once created (by the patch or the first train-step hook).
        patched: whether the host itself calls the wrapper (patched mode).
        pending: ``(rollout_id, mean length)`` observed before the wrapper existed.
        last_response_length: the latest global mean response length (the monitor's input).
        monitor: the monitor of the logging rank, once created.
    """

    configs: ScheduleConfigs
    scheduler: LengthDecayParamScheduler | None = None
    patched: bool = False
    pending: tuple[int, float | None] | None = None
    last_response_length: float | None = None
    monitor: Any = None


def configs_from_args(args: Any) -> ScheduleConfigs:
    """The surge / decay / monitor configs from the keys the host set on ``args`` (absent keys
    take their defaults; every problem of the three is reported at once)."""
    from megatron_mis.config.base import ConfigError

    problems, built = [], []
    for cls in (SurgeConfig, LengthDecayConfig, MonitorConfig):
        try:
            built.append(cls.from_namespace(args))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError("length-decay / monitor keys on args", problems)
    return ScheduleConfigs(*built)


def host_state(args: Any) -> HostState:
    """The :class:`HostState` of ``args`` (in :mod:`megatron_mis.integrations.state`), created on
    first use."""
    holder = state_of(args)
    if holder.lr is None:
        holder.lr = HostState(configs=configs_from_args(args))
    return holder.lr


def wrap_opt_param_scheduler(args: Any, opt_param_scheduler: Any) -> LengthDecayParamScheduler:
    """Wrap the host's ``OptimizerParamScheduler`` (called by the patches where the host creates
    it). Returns the wrapper, which the host then uses in place of the scheduler. Wrapping a
    wrapper returns it unchanged."""
    state = host_state(args)
    if isinstance(opt_param_scheduler, LengthDecayParamScheduler):
        return opt_param_scheduler
    if state.scheduler is not None:
        raise RuntimeError(
            "a length-decay scheduler already exists for these args; wrap_opt_param_scheduler must be "
            "called once per training process"
        )
    schedule = build_lr_schedule(state.configs.decay, state.configs.surge)
    state.scheduler = LengthDecayParamScheduler(opt_param_scheduler, schedule)
    state.patched = True
    _flush_pending(state)
    return state.scheduler


def _default_dp_group() -> Any:
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_group(with_context_parallel=False)


def observe_rollout(args: Any, rollout_id: int, rollout_data: dict, *, group: Any = None) -> float | None:
    """Feed rollout ``rollout_id``'s global mean response length to the scheduler (as step
    ``rollout_id + 1``) and keep it for the monitor.

    Every training rank must call it (it runs one all-reduce of two float64 numbers over
    ``group``). ``group`` is the data-parallel group over which the host split the rollout:
    Megatron's ``get_data_parallel_group(with_context_parallel=False)`` by default (slime); Miles
    passes its ``effective_dp`` group.

    Returns:
        The global mean response length (``None`` for an empty batch).
    """
    from megatron_mis.monitor.distributed import global_mean_response_length

    if "response_lengths" not in rollout_data:
        raise KeyError(
            f"rollout_data has no 'response_lengths' (keys: {', '.join(sorted(rollout_data))}); "
            "the length-decay scheduler needs the per-sample response lengths"
        )
    mean = global_mean_response_length(
        rollout_data["response_lengths"], group=group if group is not None else _default_dp_group()
    )
    state = host_state(args)
    state.last_response_length = mean
    state.pending = (int(rollout_id), mean)
    _flush_pending(state)
    return mean


def before_train_step(
    args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any, opt_param_scheduler: Any
) -> None:
    """``--custom-megatron-before-train-step-hook-path`` hook (slime and Miles): attach the
    length-decay to the host's scheduler on first use and set this step's learning rates.

    No communication. In patched mode the host already calls the wrapper; this only re-applies
    the multiplier (harmless)."""
    state = host_state(args)
    if isinstance(opt_param_scheduler, LengthDecayParamScheduler):
        state.scheduler = opt_param_scheduler
    elif state.scheduler is None:
        schedule = build_lr_schedule(state.configs.decay, state.configs.surge)
        if getattr(opt_param_scheduler, "num_steps", 0):
            warnings.warn(
                "megatron-mis length decay attached by hooks to a resumed scheduler "
                f"(num_steps={opt_param_scheduler.num_steps}): its state is not in the host's "
                "checkpoint, so the surge detector starts afresh at rollout "
                f"{rollout_id}. Pin an already detected surge with length_decay_surge_step, or use "
                "the patch in patches/ to checkpoint the schedule.",
                UserWarning,
                stacklevel=2,
            )
        state.scheduler = LengthDecayParamScheduler(opt_param_scheduler, schedule)
    elif state.scheduler.inner is not opt_param_scheduler:
        raise RuntimeError(
            "before_train_step got a different OptimizerParamScheduler than the one the length decay "
            "is attached to; one training process must own one scheduler"
        )
    _flush_pending(state)
    state.scheduler.apply()


def _flush_pending(state: HostState) -> None:
    if state.scheduler is None or state.pending is None:
        return
    rollout_id, mean = state.pending
    state.pending = None
    step = rollout_id + 1
    last = state.scheduler.schedule.last_step
    if last is not None and step <= last:
        # Already observed (e.g. the hook ran twice for one rollout): keep the first observation.
        return
    event = state.scheduler.observe(step, mean)
    if event is not None:
        import logging

        logging.getLogger("megatron_mis.monitor").warning(
            "[megatron-mis] response length surge detected at step %d (smoothed %.1f, %.2fx the "
            "reference); %s",
            event.step,
            event.smoothed_length,
            event.ratio,
            state.scheduler.schedule.describe(),
        )


def monitor_train_step(args: Any, step: int, log_dict: dict[str, Any], *, strip_prefix: str = "train/") -> list:
    """Feed one training step's logged metrics to the monitor (call it where the host logs, i.e.
    on its main rank only; the monitor writes files).

    Metric names are the host's log keys without ``strip_prefix``; ``response_length`` (the global
    mean from :func:`observe_rollout`) and ``lr`` (the rate of the first parameter group as the
    wrapper applies it) are added when known.

    Returns:
        The monitor's warnings for this step.
    """
    from megatron_mis.monitor.monitor import MismatchMonitor

    state = host_state(args)
    if state.monitor is None:
        state.monitor = MismatchMonitor(state.configs.monitor, state.configs.surge)
    metrics = {}
    for key, value in log_dict.items():
        name = key[len(strip_prefix):] if strip_prefix and key.startswith(strip_prefix) else key
        if name == "step" or isinstance(value, bool) or value is None:
            continue
        try:
            metrics[name] = float(value)
        except (TypeError, ValueError):
            continue  # strings and other non-scalars are not metrics
    if state.last_response_length is not None:
        metrics.setdefault("response_length", state.last_response_length)
    if state.scheduler is not None:
        groups = state.scheduler.inner.optimizer.param_groups
        if groups:
            metrics["lr"] = float(groups[0]["lr"])
            metrics["length_decay_factor"] = state.scheduler.factor
    return state.monitor.update(step, metrics)
