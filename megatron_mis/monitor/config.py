"""Configs of the response-length surge detector, the length-decay LR schedule and the mismatch
monitor (no torch, no Megatron).

The three configs share one flat key space so they can live in the same YAML as the MIS keys
(slime / Miles ``--custom-config-path`` sets every key on ``args``). Their prefixes are
``length_surge_``, ``length_decay_`` and ``monitor_``: none collides with a Megatron / slime /
Miles argument, and none starts with a MIS key prefix (``tis_``, ``rs_``, ``mis_``, ...), which
the MIS config treats as typos. :func:`load_schedule_configs` builds all three from one mapping
and reports every problem of all three at once.

Counting convention used by every key below: a *step* is one RL step (one rollout batch and the
optimizer update(s) trained on it), numbered from 1; an *observation* is one value handed to
a detector or the monitor (one per step in the usual loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from megatron_mis.config.base import ConfigBase, ConfigError, doc, read_yaml_mapping
from megatron_mis.registry import Registry, suggest

#: Name -> surge-detector class. Defined here so that the config validates names without
#: importing the detectors; :mod:`megatron_mis.monitor.surge` registers the built-in ones (the
#: package ``megatron_mis.monitor`` imports it, so they are present whenever this module is).
SURGE_DETECTORS: Registry[Any] = Registry("length surge detector")

__all__ = [
    "SCHEDULE_KEYS",
    "SURGE_DETECTORS",
    "LengthDecayConfig",
    "MonitorConfig",
    "ScheduleConfigs",
    "SurgeConfig",
    "load_schedule_configs",
]


@dataclass(kw_only=True, slots=True)
class SurgeConfig(ConfigBase):
    """Detector of a surge in the mean response length (Beyond Precision (arXiv:2602.01826): "the average length can triple
    in just a few steps", e.g. 1000 -> 3000-4000 tokens around step 100).

    The detector smooths the per-step global-batch mean length over ``length_surge_smoothing``
    observations and fires when the smoothed value has risen ``length_surge_ratio``-fold against
    its reference for ``length_surge_patience`` consecutive observations, never before
    ``length_surge_min_steps`` observations. For short runs (tens of steps) use e.g. smoothing 2,
    window 5, min steps 5.
    """

    length_surge_detector: str = doc(
        "window_ratio",
        "Registered detector name. window_ratio: the smoothed length reached ratio x the smoothed "
        "length length_surge_window observations earlier, or x the upper quartile of the earlier "
        "such values (Beyond Precision (arXiv:2602.01826)'s 'triples within a few steps'). ema_jump: the smoothed length reached ratio x a slow exponential moving average "
        "of the lengths before the smoothing window (frozen during a rise, see docs).",
    )
    length_surge_ratio: float = doc(
        2.0,
        "Fold increase that counts as a surge (> 1). Beyond Precision (arXiv:2602.01826) describes tripling; 2.0 fires while a "
        "tripling is under way, 3.0 is the literal reading.",
    )
    length_surge_window: int = doc(
        10,
        "window_ratio: the rise is measured over this many observations (>= 1; keep it >= "
        "length_surge_smoothing + length_surge_patience so a jump is seen long enough). ema_jump: "
        "the longest time the baseline stays frozen during a rise.",
    )
    length_surge_smoothing: int = doc(
        3, "Observations averaged into the smoothed length (>= 1; 1 = raw per-step means)."
    )
    length_surge_patience: int = doc(
        2, "Consecutive observations on which the surge condition must hold before it fires (>= 1)."
    )
    length_surge_min_steps: int = doc(
        10,
        "Observations before the detector may fire (>= length_surge_smoothing); ignores the "
        "start-up transient of RL. Use a small value (e.g. 5) for short runs.",
    )
    length_surge_baseline_window: int = doc(
        50,
        "The reference is the larger of the detector's baseline value (window_ratio: the smoothed "
        "length length_surge_window observations earlier; ema_jump: the moving average) and its "
        "upper quartile over this many observations (>= 1; 1 = the baseline value itself). A dip "
        "shorter than about 3/4 of this cannot lower the reference, so the recovery from it does "
        "not fire.",
    )
    length_surge_ema_beta: float = doc(
        0.9,
        "ema_jump: baseline <- beta * baseline + (1 - beta) * length, in (0, 1); 0.9 averages over "
        "roughly 10 observations. Unused by window_ratio.",
    )

    def _check(self) -> list[str]:
        problems = []
        if self.length_surge_detector not in SURGE_DETECTORS:
            names = SURGE_DETECTORS.names()
            problems.append(
                f"length_surge_detector={self.length_surge_detector!r} is not a registered detector"
                f"{suggest(self.length_surge_detector, names)}; valid: {', '.join(names)}"
            )
        if not self.length_surge_ratio > 1.0:
            problems.append(f"length_surge_ratio={self.length_surge_ratio!r} must be > 1")
        for name in ("length_surge_window", "length_surge_smoothing", "length_surge_patience", "length_surge_baseline_window"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.length_surge_min_steps < self.length_surge_smoothing:
            problems.append(
                f"length_surge_min_steps={self.length_surge_min_steps!r} must be >= "
                f"length_surge_smoothing={self.length_surge_smoothing!r} (a smoothed value needs that many)"
            )
        if not 0.0 < self.length_surge_ema_beta < 1.0:
            problems.append(f"length_surge_ema_beta={self.length_surge_ema_beta!r} must lie in (0, 1)")
        return problems


@dataclass(kw_only=True, slots=True)
class LengthDecayConfig(ConfigBase):
    """The length-decay learning-rate schedule of Beyond Precision (arXiv:2602.01826) (Algorithm 1).

    The schedule is a multiplier on the base learning rate (Megatron's warm-up / decay schedule
    when wrapped, a constant otherwise): 1 until the trigger step s, then multiplied by
    ``length_decay_factor`` (one half) at each halving step, never below ``length_decay_min_ratio``.
    Halving steps are the steps t > s with t mod T == 0 (anchor ``start``: Algorithm 1's loop
    counter runs from the start of training) or t = s + k*T, k >= 1 (anchor ``trigger``). The
    trigger step itself always runs at the undecayed rate.
    """

    length_decay_enabled: bool = doc(
        False,
        "Apply the decay. false: the learning rate is left to the base schedule (the surge detector "
        "still runs, so the step at which the decay would have triggered is reported).",
    )
    length_decay_trigger: Literal["length_surge", "start"] = doc(
        "length_surge",
        "length_surge: trigger when the surge detector fires (or at length_decay_surge_step). "
        "start: triggered before step 1, i.e. Algorithm 1 verbatim with a fixed length_decay_period.",
    )
    length_decay_period: int | None = doc(
        None,
        "T_decay in steps (>= 1). null: derived as round(length_decay_period_multiple x the surge "
        "step), the surge step being the detector's estimate of the run-up's first step (its "
        "onset, not the later step on which it fired) or length_decay_surge_step; e.g. a surge "
        "starting at step 110 -> T = 198.",
    )
    length_decay_period_multiple: float = doc(
        1.8,
        "Multiple of the surge (onset) step that gives T_decay when length_decay_period is null "
        "(Beyond Precision (arXiv:2602.01826) section 4.2: about 1.8). Rounded half up, at least 1.",
    )
    length_decay_anchor: Literal["start", "trigger"] = doc(
        "start",
        "start: halve at the steps t > trigger with t mod T == 0 (Algorithm 1, whose step counter "
        "starts with training; with the derived period the first halving is at step T). trigger: "
        "halve at trigger + T, trigger + 2T, ...",
    )
    length_decay_factor: float = doc(
        0.5, "Multiplier applied at each halving step, in (0, 1) (Algorithm 1: one half)."
    )
    length_decay_min_ratio: float = doc(
        0.1,
        "Floor of the multiplier, eta_inf / eta_0, in [0, 1] (Beyond Precision (arXiv:2602.01826): 10% of the initial rate).",
    )
    length_decay_surge_step: int | None = doc(
        None,
        "Pin the trigger to this step (>= 1) instead of detecting it: a surge step known from an "
        "earlier run, or the one logged before a resume that did not restore the schedule's state.",
    )

    def _check(self) -> list[str]:
        problems = []
        if self.length_decay_period is not None and self.length_decay_period < 1:
            problems.append(f"length_decay_period={self.length_decay_period!r} must be >= 1 or null")
        if not self.length_decay_period_multiple > 0.0:
            problems.append(
                f"length_decay_period_multiple={self.length_decay_period_multiple!r} must be > 0"
            )
        if not 0.0 < self.length_decay_factor < 1.0:
            problems.append(f"length_decay_factor={self.length_decay_factor!r} must lie in (0, 1)")
        if not 0.0 <= self.length_decay_min_ratio <= 1.0:
            problems.append(f"length_decay_min_ratio={self.length_decay_min_ratio!r} must lie in [0, 1]")
        if self.length_decay_surge_step is not None and self.length_decay_surge_step < 1:
            problems.append(f"length_decay_surge_step={self.length_decay_surge_step!r} must be >= 1 or null")
        if self.length_decay_trigger == "start":
            if self.length_decay_period is None:
                problems.append(
                    "length_decay_trigger='start' needs a fixed length_decay_period (there is no "
                    "surge step to derive it from)"
                )
            if self.length_decay_surge_step is not None:
                problems.append(
                    "length_decay_surge_step is set but length_decay_trigger='start' triggers before "
                    "step 1; use one or the other"
                )
        return problems

    def _warnings(self) -> list[str]:
        out = []
        defaults = {name: info[1] for name, info in self.field_docs().items()}
        if not self.length_decay_enabled:
            changed = [
                name
                for name in self.field_names()
                if name != "length_decay_enabled" and getattr(self, name) != defaults[name]
            ]
            if changed:
                out.append(
                    f"length_decay_enabled is false, so {', '.join(changed)} only affect(s) what is "
                    "reported, not the learning rate"
                )
        if (
            self.length_decay_period is not None
            and self.length_decay_period_multiple != defaults["length_decay_period_multiple"]
        ):
            out.append(
                "length_decay_period is fixed, so length_decay_period_multiple="
                f"{self.length_decay_period_multiple!r} is unused"
            )
        return out

    def resolve_period(self, trigger_step: int) -> int:
        """T_decay for a surge at ``trigger_step`` (the schedule passes the surge's onset): the
        fixed period, or ``max(1, floor(multiple * trigger_step + 0.5))`` (110 -> 198 with the
        default 1.8)."""
        if self.length_decay_period is not None:
            return self.length_decay_period
        # 1.8 * 110 is 198.00000000000003 in binary floating point: round half up, then int.
        return max(1, int(self.length_decay_period_multiple * trigger_step + 0.5))


@dataclass(kw_only=True, slots=True)
class MonitorConfig(ConfigBase):
    """The mismatch monitor: smoothed histories of per-step metrics and structured warnings when
    the mismatch grows (trend over a window), spikes, crosses a threshold, or the response length
    surges. Metric names are those passed to ``MismatchMonitor.update``; the defaults are the
    megatron-mis engine's names (``mis_k3_kl``, ``mis_log_ppl_abs_diff``; the Miles example
    function calls them ``k3_kl``, ``log_ppl_abs_diff``) plus ``grad_norm`` and
    ``response_length``."""

    monitor_enabled: bool = doc(
        False,
        "Host integrations (the slime / Miles patches): feed each training step's logged metrics to "
        "a monitor on the logging rank. A MismatchMonitor you construct yourself always runs.",
    )
    monitor_trend_metrics: list[str] = doc(
        ["mis_k3_kl", "mis_log_ppl_abs_diff", "grad_norm"],
        "Metrics watched for a sustained rise over monitor_window observations.",
    )
    monitor_spike_metrics: list[str] = doc(
        ["mis_k3_kl"], "Metrics watched for single-step spikes (When Speed Kills Stability (docs/references.md): K3 KL spikes come first)."
    )
    monitor_length_metric: str | None = doc(
        "response_length",
        "Metric holding the step's global mean response length, fed to a surge detector configured "
        "by the length_surge_* keys. null: no surge warnings.",
    )
    monitor_thresholds: dict = doc(
        {"mis_k3_kl": 1e-2, "mis_rejected_token_fraction": 0.5},
        "Absolute upper bounds, metric name -> value; a value above its bound gives a 'threshold' "
        "warning. The default flags a mean K3 above 1e-2, more than any numeric path gave in the study "
        "(bf16 / fp16 / int8 / int4 <= 2.6e-3) and what a stale policy or a rollout-only temperature give, "
        "and processed top-p 0.8 log-probs early in training (docs/study.md), steady or not; and a "
        "correction that removes more than half of the loss tokens from the gradient (tight geometric "
        "bands rejected 67-93% and hurt; token MIS over processed top-k log-probs rejected every token "
        "and trained nothing). A mapping you set replaces the default (name the metrics in it to keep "
        "their bounds); {}: none.",
    )
    monitor_floors: dict = doc(
        {"mis_k3_kl": 1e-8, "mis_log_ppl_abs_diff": 1e-5},
        "Noise floors, metric name -> value: while a metric is at or below its floor (the value for a "
        "spike, the newest half-window's median for a trend) it gives no trend or spike warning. The "
        "defaults keep K3 and the log-ppl gap at fp32 rounding (K3 1e-14 .. 1e-12, the gap up to 1e-6), "
        "whose relative wobble fired the trend rule in the study, from warning, and sit below bf16's "
        "(K3 1e-7 and up, the gap 3e-4 and up). A mapping you set replaces the default. {}: no floor.",
    )
    monitor_window: int = doc(
        30,
        "Observations in the trend window and in the spike baseline (>= 4). A trend is seen once "
        "the metric grows by monitor_trend_min_growth over half a window.",
    )
    monitor_trend_min_growth: float = doc(
        1.5,
        "Trend warning: the median of the newest half of the window must be at least this multiple "
        "of the median of the oldest half (> 1).",
    )
    monitor_trend_min_tau: float = doc(
        0.5,
        "Trend warning: Kendall's rank correlation between step and value over the window must be at "
        "least this (in (0, 1]); stationary noise gives about 0 +- 0.13 for a 30-step window.",
    )
    monitor_spike_factor: float = doc(
        10.0,
        "Spike warning: value above this multiple of the median of the previous window (> 1).",
    )
    monitor_cooldown: int = doc(
        20,
        "Steps after a warning during which the same kind of warning on the same metric is not "
        "repeated (>= 0).",
    )
    monitor_ema_beta: float = doc(
        0.9, "Smoothing of the kept histories: ema <- beta * ema + (1 - beta) * value, in [0, 1)."
    )
    monitor_history_size: int = doc(
        2000, "Records of (step, value, smoothed value) kept per metric (>= monitor_window)."
    )
    monitor_emit: Literal["logging", "warnings", "both", "none"] = doc(
        "logging",
        "How warnings are emitted besides being returned by update(): the 'megatron_mis.monitor' "
        "logger, warnings.warn (category MismatchWarning), both, or none.",
    )
    monitor_jsonl_path: str = doc(
        "mis_monitor/metrics.jsonl",
        "JSON-lines file that receives one record per step (metrics, smoothed values, warnings). "
        "Always written; appended to on resume.",
    )
    monitor_tensorboard_dir: str | None = doc(
        None, "Also write scalars to TensorBoard here (needs the tensorboard package). null: off."
    )
    monitor_wandb: bool = doc(
        False,
        "Also log to Weights & Biases (needs wandb) into the active run. When no run is active (slime / "
        "Miles training ranks: the driver owns the run, only the Megatron main rank joins it with "
        "--use-wandb), W&B logging is dropped with one warning, unless monitor_wandb_new_run is true. "
        "The JSONL file is written either way.",
    )
    monitor_wandb_new_run: bool = doc(
        False,
        "With monitor_wandb: start a W&B run (in monitor_wandb_project) when none is active, and "
        "finish it on close. Off by default: inside slime / Miles it would open one stray run per "
        "training rank. Turn it on only in a single-process loop of your own.",
    )
    monitor_wandb_project: str | None = doc(
        None,
        "W&B project of the run started under monitor_wandb_new_run. null: wandb's default.",
    )
    monitor_log_prefix: str = doc(
        "mis_monitor/", "Prefix of the scalar names written to TensorBoard and W&B."
    )

    def _check(self) -> list[str]:
        problems = []
        if self.monitor_window < 4:
            problems.append(f"monitor_window={self.monitor_window!r} must be >= 4")
        if not self.monitor_trend_min_growth > 1.0:
            problems.append(f"monitor_trend_min_growth={self.monitor_trend_min_growth!r} must be > 1")
        if not 0.0 < self.monitor_trend_min_tau <= 1.0:
            problems.append(f"monitor_trend_min_tau={self.monitor_trend_min_tau!r} must lie in (0, 1]")
        if not self.monitor_spike_factor > 1.0:
            problems.append(f"monitor_spike_factor={self.monitor_spike_factor!r} must be > 1")
        if self.monitor_cooldown < 0:
            problems.append(f"monitor_cooldown={self.monitor_cooldown!r} must be >= 0")
        if not 0.0 <= self.monitor_ema_beta < 1.0:
            problems.append(f"monitor_ema_beta={self.monitor_ema_beta!r} must lie in [0, 1)")
        if self.monitor_history_size < self.monitor_window:
            problems.append(
                f"monitor_history_size={self.monitor_history_size!r} must be >= "
                f"monitor_window={self.monitor_window!r}"
            )
        if not self.monitor_jsonl_path:
            problems.append("monitor_jsonl_path must be a non-empty path")
        for key in ("monitor_thresholds", "monitor_floors"):
            for name, bound in getattr(self, key).items():  # a non-mapping is a type problem (base)
                if not isinstance(name, str):
                    problems.append(f"{key} key {name!r} must be a metric name (a string)")
                if isinstance(bound, bool) or not isinstance(bound, (int, float)) or bound != bound:
                    problems.append(f"{key}[{name!r}]={bound!r} must be a number")
        return problems

    def _warnings(self) -> list[str]:
        out = []
        if not self.monitor_wandb:
            for name in ("monitor_wandb_new_run", "monitor_wandb_project"):
                if getattr(self, name) not in (None, False):
                    out.append(f"{name} is set but monitor_wandb is false: nothing goes to W&B")
        elif self.monitor_wandb_project is not None and not self.monitor_wandb_new_run:
            out.append(
                "monitor_wandb_project is set but monitor_wandb_new_run is false: the monitor logs only "
                "into an already active run (whose project is not its to choose)"
            )
        return out


#: Every key of the three configs: pass it as ``ignore=`` when validating a shared host YAML with
#: another component's config (e.g. ``MISConfig.from_yaml(path, ignore=SCHEDULE_KEYS)``).
SCHEDULE_KEYS: tuple[str, ...] = tuple(
    SurgeConfig.field_names() + LengthDecayConfig.field_names() + MonitorConfig.field_names()
)


class ScheduleConfigs(NamedTuple):
    """The three configs read from one flat mapping."""

    surge: SurgeConfig
    decay: LengthDecayConfig
    monitor: MonitorConfig


def load_schedule_configs(
    data: Mapping[str, Any] | str | Path, *, ignore: tuple[str, ...] = (), source: str | None = None
) -> ScheduleConfigs:
    """Build :class:`SurgeConfig`, :class:`LengthDecayConfig` and :class:`MonitorConfig` from one
    flat mapping or YAML file (``configs/lr_schedule.yaml``).

    Args:
        data: key -> value, or the path of a YAML file holding such a mapping.
        ignore: keys that belong to someone else in a shared file (the MIS keys, say) and are
            skipped silently. Every other key must belong to one of the three configs.
        source: where ``data`` came from, for error messages.

    Raises:
        ConfigError: listing every unknown key and every invalid value of all three configs.
    """
    duplicates: list[str] = []
    if isinstance(data, (str, Path)):
        source = source or str(data)
        data, duplicates = read_yaml_mapping(data)
    classes = (SurgeConfig, LengthDecayConfig, MonitorConfig)
    owned = {name for cls in classes for name in cls.field_names()}
    problems: list[str] = list(duplicates)  # reported with every other problem of the file
    if not isinstance(data, Mapping):
        raise ConfigError(source or "schedule configs", [f"expected a mapping, got {type(data).__name__}"])
    from megatron_mis.config.base import _closest

    for key in data:
        if key not in owned and key not in ignore:
            problems.append(
                f"unknown key {key!r}{_closest(str(key), sorted(owned))}; valid keys start with "
                "length_surge_, length_decay_ or monitor_"
            )
    built = []
    for cls in classes:
        mine = {k: v for k, v in data.items() if k in cls.field_names()}
        try:
            built.append(cls.from_dict(mine))
        except ConfigError as exc:
            problems.extend(exc.problems)
            built.append(None)
    if problems:
        raise ConfigError(source or "schedule configs", problems)
    return ScheduleConfigs(*built)
