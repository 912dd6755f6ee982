"""The mismatch monitor: per-step metrics in, smoothed histories and structured warnings out.

When Speed Kills Stability (docs/references.md): the warning signs of a collapse come in order: K3 KL (training vs rollout) spikes and
rises, then the gradient norm and the training perplexity follow. Beyond Precision (arXiv:2602.01826): the mismatch
(``log_ppl_abs_diff``) grows together with the gradient noise, and a surge of the response length
comes before it. The monitor watches exactly that::

    monitor = MismatchMonitor(MonitorConfig(...), SurgeConfig(...))
    for step in range(1, num_steps + 1):
        ...
        for w in monitor.update(step, {"mis_k3_kl": ..., "mis_log_ppl_abs_diff": ...,
                                        "grad_norm": ..., "entropy": ...,
                                        "response_length": ..., "lr": ...}):
            ...  # w.kind, w.metric, w.value, w.threshold, w.trend, w.message

Warning kinds (:class:`MonitorWarning`):

``trend``
    Over the last ``monitor_window`` values of a ``monitor_trend_metrics`` metric, the median of
    the newest half is at least ``monitor_trend_min_growth`` times the median of the oldest half
    AND Kendall's rank correlation with the step is at least ``monitor_trend_min_tau``. Both are
    rank / median statistics: one spike cannot make a trend, and stationary noise (tau about 0)
    does not either. Nor does a rise that stays at or below the metric's ``monitor_floors`` entry.
``spike``
    A ``monitor_spike_metrics`` value above ``monitor_spike_factor`` times the median of the
    previous window (needs half a window of history), and above the metric's ``monitor_floors``
    entry.
``threshold``
    A value above its bound in ``monitor_thresholds`` (by default mean K3 above 1e-2, and more
    than half of the loss tokens rejected by the correction).
``length_surge``
    The surge detector (``length_surge_*`` keys) fired on ``monitor_length_metric``; it is then
    re-armed, so a later surge relative to the new level is reported again.
``non_finite``
    A NaN or infinite value (it is kept out of the histories).
``missing_metric``
    A configured metric was absent from an ``update`` (reported once per metric).

A warning of one kind on one metric is not repeated within ``monitor_cooldown`` steps.
Every update writes one record to the sinks (JSON lines always, TensorBoard / W&B if configured).
Run one monitor per job (the rank that logs), fed with global-batch values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_mis.monitor.config import MonitorConfig, SurgeConfig
from megatron_mis.monitor.sinks import Sink, build_sinks
from megatron_mis.monitor.surge import _check_step, build_surge_detector

__all__ = ["MismatchMonitor", "MismatchWarning", "MonitorWarning", "WarningKind", "kendall_tau", "trend_statistics"]

logger = logging.getLogger("megatron_mis.monitor")

WarningKind = Literal["trend", "spike", "threshold", "length_surge", "non_finite", "missing_metric"]

#: What a threshold warning on a metric means, appended to its message.
_THRESHOLD_HINTS = {
    "mis_k3_kl": (
        ": more than numeric precision gave in the study (bf16 / fp16 / int8 / int4 rollouts: mean K3 at most "
        "2.6e-3); the measured causes above it are stale weights (asynchronous rollouts, a missed weight sync), "
        "a temperature the rollout applies and the trainer does not, and processed top-p / top-k log-probs "
        "(docs/study.md). `megatron-mis analyze` on the step's --save-debug-train-data dump tells a one-sided "
        "mismatch (processed top-p / top-k log-probs) from a two-sided one (stale weights, a rollout-only "
        "temperature) and says what to do"
    ),
    "mis_rejected_token_fraction": (
        ": the correction removes most of the loss tokens from the gradient (its mask or rejection band "
        "does not fit the ratios: one-sided ratios from processed top-p / top-k log-probs, the wide two-sided "
        "ones of stale rollouts or a rollout-only temperature, or a band too tight for the response length)"
    ),
}


class MismatchWarning(UserWarning):
    """Category of the monitor's ``warnings.warn`` messages (filter it like any warning)."""


@dataclass(frozen=True, slots=True)
class MonitorWarning:
    """One structured warning.

    Attributes:
        kind: see the module docstring.
        step: the step of the update that raised it.
        metric: the metric concerned.
        value: the metric's value at that step (``None`` for missing / non-finite values).
        threshold: the bound that was crossed (growth / spike factor / absolute bound / surge
            ratio), ``None`` where there is none.
        trend: the measured statistic compared with ``threshold`` (growth ratio for ``trend``,
            value / baseline for ``spike``, smoothed length / reference for ``length_surge``).
        message: a human-readable sentence.
        details: further numbers (Kendall tau, baseline, window, ...).
    """

    kind: WarningKind
    step: int
    metric: str
    value: float | None
    threshold: float | None
    trend: float | None
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kendall_tau(values: list[float]) -> float:
    """Kendall's tau-a between position and value: (concordant - discordant) / (n (n - 1) / 2);
    ties count as neither, so a constant series gives 0. O(n^2), for windows of tens of values."""
    n = len(values)
    if n < 2:
        return 0.0
    score = 0
    for i in range(n - 1):
        vi = values[i]
        for j in range(i + 1, n):
            vj = values[j]
            score += (vj > vi) - (vj < vi)
    return score / (n * (n - 1) / 2)


def trend_statistics(values: list[float]) -> tuple[float, float]:
    """``(growth, tau)`` of a window: median of the newest half over the median of the oldest half
    (``inf`` if the oldest median is <= 0 and the newest is > 0, ``1`` if both are <= 0), and
    :func:`kendall_tau`."""
    half = len(values) // 2
    old = statistics.median(values[:half])
    new = statistics.median(values[-half:])
    if old > 0:
        growth = new / old
    else:
        growth = math.inf if new > 0 else 1.0
    return growth, kendall_tau(values)


class _Series:
    """Per-metric state: EMA, the raw trend window and the bounded history."""

    __slots__ = ("ema", "window", "history")

    def __init__(self, window: int, history: int) -> None:
        self.ema: float | None = None
        self.window: deque[float] = deque(maxlen=window)
        self.history: deque[tuple[int, float, float]] = deque(maxlen=history)


class MismatchMonitor:
    """Watches per-step metrics and raises :class:`MonitorWarning` s (see the module docstring).

    Args:
        config: thresholds, windows, outputs.
        surge: settings of the response-length surge detector (defaults when omitted).
        sinks: where records go; default :func:`~megatron_mis.monitor.sinks.build_sinks` (JSON
            lines always, TensorBoard / W&B as configured). Pass ``[]`` to write nothing (e.g. on
            ranks that do not log).
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        surge: SurgeConfig | None = None,
        *,
        sinks: list[Sink] | None = None,
    ) -> None:
        self.config = config if config is not None else MonitorConfig()
        if not isinstance(self.config, MonitorConfig):
            raise TypeError(f"config must be a MonitorConfig, got {type(self.config).__name__}")
        self.surge_config = surge if surge is not None else SurgeConfig()
        self.detector = build_surge_detector(self.surge_config) if self.config.monitor_length_metric else None
        self.sinks: list[Sink] = build_sinks(self.config) if sinks is None else list(sinks)
        self.last_step: int | None = None
        self._series: dict[str, _Series] = {}
        self._last_warned: dict[tuple[str, str], int] = {}
        self._missing_reported: set[str] = set()

    # ---------------------------------------------------------------------------------- update
    def update(self, step: int, metrics: Mapping[str, Any]) -> list[MonitorWarning]:
        """Record step ``step``'s metrics, write them to the sinks, and return the warnings raised.

        Args:
            step: increasing step label (int >= 0).
            metrics: metric name -> scalar (float, int, 0-dim / 1-element tensor or numpy value);
                ``None`` values count as absent.

        Raises:
            ValueError: for a non-increasing step, a non-string name or a non-scalar value.
        """
        step = _check_step(step, self.last_step)
        values = self._scalars(metrics)
        cfg = self.config
        found: list[MonitorWarning] = []

        watched = set(cfg.monitor_trend_metrics) | set(cfg.monitor_spike_metrics) | set(cfg.monitor_thresholds)
        if cfg.monitor_length_metric:
            watched.add(cfg.monitor_length_metric)
        for name in sorted(watched - set(values) - self._missing_reported):
            self._missing_reported.add(name)
            found.append(
                MonitorWarning(
                    kind="missing_metric",
                    step=step,
                    metric=name,
                    value=None,
                    threshold=None,
                    trend=None,
                    message=(
                        f"the monitor is configured to watch {name!r} but update() got no such metric "
                        f"(got: {', '.join(sorted(values)) or 'nothing'}); reported once"
                    ),
                )
            )

        for name, value in values.items():
            if not math.isfinite(value):
                found.append(
                    MonitorWarning(
                        kind="non_finite",
                        step=step,
                        metric=name,
                        value=None,
                        threshold=None,
                        trend=None,
                        message=f"{name} is {value} at step {step}; kept out of the histories",
                    )
                )
                continue
            series = self._series.get(name)
            if series is None:
                series = self._series[name] = _Series(cfg.monitor_window, cfg.monitor_history_size)
            found.extend(self._check_before(step, name, value, series))
            series.window.append(value)
            beta = cfg.monitor_ema_beta
            series.ema = value if series.ema is None else beta * series.ema + (1.0 - beta) * value
            series.history.append((step, value, series.ema))
            found.extend(self._check_after(step, name, value, series))

        length_name = cfg.monitor_length_metric
        if self.detector is not None and length_name in values and math.isfinite(values[length_name]):
            event = self.detector.update(step, values[length_name])
            if event is not None:
                self.detector.rearm()
                found.append(
                    MonitorWarning(
                        kind="length_surge",
                        step=step,
                        metric=length_name,
                        value=values[length_name],
                        threshold=self.surge_config.length_surge_ratio,
                        trend=event.ratio,
                        message=(
                            f"response length surge at step {step}: smoothed mean {event.smoothed_length:.1f} "
                            f"is {event.ratio:.2f}x the reference {event.reference_length:.1f} "
                            f"({event.detector}); Beyond Precision (arXiv:2602.01826) decays the learning rate from here "
                            "(length_decay_enabled)"
                        ),
                        details={"smoothed_length": event.smoothed_length, "reference_length": event.reference_length},
                    )
                )

        emitted = [w for w in found if self._not_cooling_down(w)]
        self.last_step = step
        self._emit(emitted)
        record = {
            "step": step,
            "metrics": {k: (v if math.isfinite(v) else None) for k, v in values.items()},
            "smoothed": {k: self._series[k].ema for k, v in values.items() if math.isfinite(v)},
            "warnings": [w.to_dict() for w in emitted],
        }
        non_finite = sorted(k for k, v in values.items() if not math.isfinite(v))
        if non_finite:
            record["non_finite"] = non_finite
        for sink in self.sinks:
            sink.write(record)
        return emitted

    def _check_before(self, step: int, name: str, value: float, series: _Series) -> list[MonitorWarning]:
        cfg = self.config
        out = []
        min_history = max(3, cfg.monitor_window // 2)
        floor = cfg.monitor_floors.get(name)
        above_floor = floor is None or value > floor
        if name in cfg.monitor_spike_metrics and above_floor and len(series.window) >= min_history:
            baseline = statistics.median(series.window)
            if baseline > 0 and value > cfg.monitor_spike_factor * baseline:
                out.append(
                    MonitorWarning(
                        kind="spike",
                        step=step,
                        metric=name,
                        value=value,
                        threshold=cfg.monitor_spike_factor,
                        trend=value / baseline,
                        message=(
                            f"{name}={value:.4g} at step {step} is {value / baseline:.1f}x the median "
                            f"{baseline:.4g} of the previous {len(series.window)} steps"
                        ),
                        details={"baseline": baseline, "num_values": len(series.window)},
                    )
                )
        bound = cfg.monitor_thresholds.get(name)
        if bound is not None and value > bound:
            out.append(
                MonitorWarning(
                    kind="threshold",
                    step=step,
                    metric=name,
                    value=value,
                    threshold=float(bound),
                    trend=None,
                    message=(f"{name}={value:.4g} at step {step} exceeds its bound {bound:.4g}"
                             f"{_THRESHOLD_HINTS.get(name, '')}"),
                )
            )
        return out

    def _check_after(self, step: int, name: str, value: float, series: _Series) -> list[MonitorWarning]:
        cfg = self.config
        if name not in cfg.monitor_trend_metrics or len(series.window) < cfg.monitor_window:
            return []
        window = list(series.window)
        growth, tau = trend_statistics(window)
        floor = cfg.monitor_floors.get(name)
        if floor is not None and statistics.median(window[-(len(window) // 2) :]) <= floor:
            return []  # a rise within the noise floor (e.g. K3 at fp32 rounding) is no warning
        if growth >= cfg.monitor_trend_min_growth and tau >= cfg.monitor_trend_min_tau:
            return [
                MonitorWarning(
                    kind="trend",
                    step=step,
                    metric=name,
                    value=value,
                    threshold=cfg.monitor_trend_min_growth,
                    trend=growth,
                    message=(
                        f"{name} is rising: over the last {len(window)} steps the median of the newest "
                        f"half is {growth:.2f}x that of the oldest half (Kendall tau {tau:.2f})"
                    ),
                    details={"tau": tau, "window": len(window)},
                )
            ]
        return []

    def _not_cooling_down(self, w: MonitorWarning) -> bool:
        if w.kind == "missing_metric":
            return True
        key = (w.kind, w.metric)
        last = self._last_warned.get(key)
        if last is not None and w.step - last < self.config.monitor_cooldown:
            return False
        self._last_warned[key] = w.step
        return True

    def _emit(self, found: list[MonitorWarning]) -> None:
        mode = self.config.monitor_emit
        for w in found:
            text = f"[megatron-mis monitor] {w.kind} on {w.metric}: {w.message}"
            if mode in ("logging", "both"):
                logger.warning(text)
            if mode in ("warnings", "both"):
                warnings.warn(text, MismatchWarning, stacklevel=3)

    @staticmethod
    def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics must be a mapping of name -> scalar, got {type(metrics).__name__}")
        out = {}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise ValueError(f"metric names must be strings, got {name!r}")
            if value is None:
                continue
            if isinstance(value, bool):
                raise ValueError(f"metric {name!r} must be a number, got {value!r}")
            if hasattr(value, "numel") and hasattr(value, "item"):  # a torch tensor
                if value.numel() != 1:
                    raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
                value = value.item()
            try:
                out[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {name!r} must be a number, got {value!r}") from None
        return out

    # ---------------------------------------------------------------------------------- access
    def smoothed(self, metric: str) -> float | None:
        """The EMA of ``metric`` (``None`` if never seen)."""
        series = self._series.get(metric)
        return None if series is None else series.ema

    def history(self, metric: str) -> list[tuple[int, float, float]]:
        """``[(step, value, ema), ...]`` of ``metric`` (the last ``monitor_history_size``)."""
        series = self._series.get(metric)
        return [] if series is None else list(series.history)

    def metrics(self) -> list[str]:
        """Names seen so far."""
        return sorted(self._series)

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Histories, windows, EMAs, cool-downs and the surge detector (plain Python types)."""
        return {
            "config": self.config.to_dict(),
            "last_step": self.last_step,
            "series": {
                name: {"ema": s.ema, "window": list(s.window), "history": [list(h) for h in s.history]}
                for name, s in self._series.items()
            },
            "last_warned": [[kind, metric, step] for (kind, metric), step in self._last_warned.items()],
            "missing_reported": sorted(self._missing_reported),
            "detector": self.detector.state_dict() if self.detector is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a changed config is allowed, with a warning: windows
        are refilled up to the new sizes)."""
        if state.get("config") != self.config.to_dict():
            warnings.warn(
                "restoring monitor state saved under a different MonitorConfig; histories are cut to "
                "the current window / history sizes",
                UserWarning,
                stacklevel=2,
            )
        cfg = self.config
        self.last_step = state["last_step"]
        self._series = {}
        for name, data in state["series"].items():
            series = _Series(cfg.monitor_window, cfg.monitor_history_size)
            series.ema = data["ema"]
            series.window.extend(data["window"])
            series.history.extend(tuple(h) for h in data["history"])
            self._series[name] = series
        self._last_warned = {(kind, metric): step for kind, metric, step in state["last_warned"]}
        self._missing_reported = set(state["missing_reported"])
        if self.detector is not None and state.get("detector") is not None:
            self.detector.load_state_dict(state["detector"])

    # ------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the sinks (flushes TensorBoard, finishes a W&B run the monitor started)."""
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MismatchMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
