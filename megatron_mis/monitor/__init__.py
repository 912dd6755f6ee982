"""Mismatch monitoring and the response-length surge detector.

Importing this package is cheap: no torch, no Megatron. See ``docs/monitor.md``.

- :class:`SurgeConfig`, :class:`LengthDecayConfig`, :class:`MonitorConfig`,
  :func:`load_schedule_configs` (``configs/lr_schedule.yaml``);
- :data:`SURGE_DETECTORS` (``window_ratio``, ``ema_jump``), :func:`build_surge_detector`;
- :class:`MismatchMonitor`, :class:`MonitorWarning`, :class:`MismatchWarning`;
- :func:`global_mean_response_length` (one all-reduce over an explicit data-parallel group).

The learning-rate schedule driven by the surge detector lives in :mod:`megatron_mis.lr_schedule`.
"""

from __future__ import annotations

from typing import Any

from megatron_mis.monitor.config import (
    SCHEDULE_KEYS,
    LengthDecayConfig,
    MonitorConfig,
    ScheduleConfigs,
    SurgeConfig,
    load_schedule_configs,
)
from megatron_mis.monitor.monitor import MismatchMonitor, MismatchWarning, MonitorWarning
from megatron_mis.monitor.surge import (
    SURGE_DETECTORS,
    EmaJumpDetector,
    SurgeDetector,
    SurgeEvent,
    WindowRatioDetector,
    build_surge_detector,
)

__all__ = [
    "EmaJumpDetector",
    "LengthDecayConfig",
    "MismatchMonitor",
    "MismatchWarning",
    "MonitorConfig",
    "MonitorWarning",
    "SCHEDULE_KEYS",
    "SURGE_DETECTORS",
    "ScheduleConfigs",
    "SurgeConfig",
    "SurgeDetector",
    "SurgeEvent",
    "WindowRatioDetector",
    "build_surge_detector",
    "global_mean_response_length",
    "load_schedule_configs",
]


def __getattr__(name: str) -> Any:
    if name == "global_mean_response_length":  # imports torch: resolved lazily
        from megatron_mis.monitor.distributed import global_mean_response_length

        return global_mean_response_length
    raise AttributeError(f"module 'megatron_mis.monitor' has no attribute {name!r}")

