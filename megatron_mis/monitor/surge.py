"""Detectors of a surge in the mean response length (Beyond Precision (arXiv:2602.01826), section 3.3).

A detector consumes one value per step: the step's mean response length over the *global* batch
(every data-parallel rank must feed the same number, see
:func:`megatron_mis.monitor.distributed.global_mean_response_length`). It smooths the values
over ``length_surge_smoothing`` observations and compares the smoothed length ``S_n`` with a
reference ``R_n``; the surge condition ``S_n >= length_surge_ratio * R_n`` must hold on
``length_surge_patience`` consecutive observations, and never before ``length_surge_min_steps``
observations. Once fired, a detector stays fired (its :attr:`event` keeps the details) until
:meth:`SurgeDetector.rearm`.

The reference is a baseline a dip cannot lower: each detector produces a baseline value ``B_n``
per observation, and ``R_n = max(B_n, Q_n)`` with ``Q_n`` the upper quartile (75th percentile,
nearest rank) of ``B_{n-H+1}, ..., B_n``, ``H = length_surge_baseline_window`` (default 50). A
dip can only lower ``Q_n`` once it fills three quarters of those ``H`` values, so the recovery
from any dip shorter than about ``0.75 H`` observations (37 steps by default) does not fire; a
quartile rather than the maximum, because the maximum of 50 noisy values sits well above the
level (about +25 % at a coefficient of variation of 0.2) and then missed real triplings. Beyond Precision (arXiv:2602.01826)'s signal is a surge to a *new* level (1000 -> 3000-4000
tokens); lengths that dip and come back to where they were are not one. Comparing with the
value ``W`` steps earlier alone fired on such a recovery (1000 for 30 steps, 450 for 5, back to
1000 fired at step 44: the reference was the dip).

Registered detectors (:data:`SURGE_DETECTORS`):

``window_ratio`` (default)
    ``B_n = S_{n-W}``, the smoothed length ``W = length_surge_window`` observations earlier, so
    ``R_n`` is the larger of that value and the upper quartile of the smoothed lengths between
    ``W + H - 1`` and ``W`` observations ago: the length rose ``ratio``-fold above the level it
    held before the last ``W`` steps (Beyond Precision (arXiv:2602.01826): "can triple in just a few steps"). A slow drift
    rises far less than 2-fold within ``W`` steps.

``ema_jump``
    ``B_n`` is an exponential moving average (``length_surge_ema_beta``) of the lengths observed
    before the smoothing window: a relative jump against a smoothed baseline. The average stops
    following the lengths while the smoothed length is above ``sqrt(ratio)`` times it (for at most
    ``length_surge_window`` observations), so a ramping surge cannot drag its own reference up. It
    tolerates noisier traces than ``window_ratio`` at the same smoothing.

Onset. A detector fires a few steps after the run-up began (smoothing, patience, a ramp). The
event also carries :attr:`SurgeEvent.onset_step`, the first step of the run-up: the first step of
the run of raw lengths above ``R * ratio ** 0.25`` (a quarter of the way, in log scale, from the
reference to a surge) that leads up to the firing observation, looked for among the last
``W + smoothing + patience`` observations. Beyond Precision (arXiv:2602.01826)'s decay period is a multiple of the step
*where the surge happens*, so the LR schedule takes it from the onset (a tripling starting at step
110 fires at 112; the period is 1.8 x 110 = 198, not 1.8 x 112 = 202). Noise-free, the onset of a
jump or of a ramp is exact; under noise a step just before the run-up that happens to exceed the
threshold moves it one step early now and then.

Detection delay (noise-free): if the length jumps at observation ``s`` to at least
``length_surge_ratio`` times a flat level, ``window_ratio`` fires at the latest on observation
``s + length_surge_smoothing + length_surge_patience - 2`` (provided ``length_surge_window >=
length_surge_smoothing + length_surge_patience`` and the minimum steps have passed); with the
defaults and a tripling it fires on ``s + 2``. A ramp adds its length.

Noise: with the defaults, 100 simulated 1000-step traces of stationary log-normal noise with a
coefficient of variation of 0.2 per step (a batch mean of a few dozen responses; Beyond Precision (arXiv:2602.01826)'s
1024-response batches are far quieter), and 100 with the level doubling slowly over the run,
gave no false alarm, while a tripling ramped over 5 steps was detected within 8 steps every
time. Noisier traces need more ``length_surge_smoothing`` (5 for a variation of 0.3).

Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_mis.monitor.config import SURGE_DETECTORS as _SURGE_REGISTRY
from megatron_mis.monitor.config import SurgeConfig
from megatron_mis.registry import Registry

__all__ = [
    "EmaJumpDetector",
    "SURGE_DETECTORS",
    "SurgeDetector",
    "SurgeEvent",
    "WindowRatioDetector",
    "build_surge_detector",
]

#: Name -> detector class; every class takes a :class:`SurgeConfig`. (The registry object is
#: defined with the config, which checks names without importing this module.)
SURGE_DETECTORS: Registry[type["SurgeDetector"]] = _SURGE_REGISTRY


@dataclass(frozen=True, slots=True)
class SurgeEvent:
    """A detected response-length surge.

    Attributes:
        step: step label of the observation on which the detector fired.
        num_observations: observations the detector had seen by then (this one included).
        smoothed_length: the smoothed mean response length ``S_n`` at that observation.
        reference_length: the reference ``R_n`` it was compared with.
        ratio: ``smoothed_length / reference_length``.
        detector: the registered detector name.
        onset_step: estimated first step of the run-up (module docstring); ``None`` only in
            events restored from states saved before it existed.
    """

    step: int
    num_observations: int
    smoothed_length: float
    reference_length: float
    ratio: float
    detector: str
    onset_step: int | None = None


class SurgeDetector:
    """Base class: smoothing, patience, minimum steps, the baseline maximum, latching, the onset
    and state. Subclasses implement :meth:`_reference` (the baseline ``B_n`` for the current
    smoothed value; the base class takes the maximum over ``length_surge_baseline_window``) and
    :meth:`_after` (update their baseline state with the new observation)."""

    name: ClassVar[str] = ""

    def __init__(self, config: SurgeConfig) -> None:
        if not isinstance(config, SurgeConfig):
            raise TypeError(f"config must be a SurgeConfig, got {type(config).__name__}")
        self.config = config
        self._values: deque[float] = deque(maxlen=config.length_surge_smoothing)
        self.num_observations = 0
        self.last_step: int | None = None
        self._streak = 0
        self.event: SurgeEvent | None = None
        # B_{n-H+1} .. B_n, the baseline values whose maximum is the reference
        self._baselines: deque[float] = deque(maxlen=config.length_surge_baseline_window)
        # (step, raw length) of the last observations, to locate the onset of a run-up
        self._raw: deque[tuple[int, float]] = deque(
            maxlen=config.length_surge_window + config.length_surge_smoothing + config.length_surge_patience
        )

    # ------------------------------------------------------------------------------- interface
    @property
    def fired(self) -> bool:
        """Whether a surge has been detected (since construction or the last :meth:`rearm`)."""
        return self.event is not None

    @property
    def smoothed(self) -> float | None:
        """The current smoothed length ``S_n`` (``None`` before ``length_surge_smoothing`` values)."""
        if len(self._values) < self.config.length_surge_smoothing:
            return None
        return math.fsum(self._values) / len(self._values)

    def update(self, step: int, length: float) -> SurgeEvent | None:
        """Observe step ``step``'s global mean response length.

        Args:
            step: step label, an int greater than the previous one (gaps allowed; windows count
                observations).
            length: mean response length in tokens, finite and >= 0.

        Returns:
            The :class:`SurgeEvent` on the observation on which the detector fires, else ``None``
            (also on every observation after it has fired).

        Raises:
            ValueError: for a non-increasing step or a negative / non-finite length.
        """
        step = _check_step(step, self.last_step)
        if isinstance(length, bool) or not isinstance(length, (int, float)):
            try:
                length = float(length)  # a 0-dim tensor or numpy scalar
            except (TypeError, ValueError):
                raise ValueError(f"response length must be a number, got {length!r}") from None
        length = float(length)
        if not math.isfinite(length) or length < 0.0:
            raise ValueError(f"response length must be finite and >= 0, got {length!r} at step {step}")
        self.last_step = step
        self.num_observations += 1
        self._values.append(length)
        self._raw.append((step, length))
        smoothed = self.smoothed
        fired_now = None
        if smoothed is not None:
            baseline = self._reference()
            if baseline is not None:
                self._baselines.append(baseline)
            reference = _upper_quartile_or_last(self._baselines) if self._baselines else None
            holds = (
                self.num_observations >= self.config.length_surge_min_steps
                and reference is not None
                and reference > 0.0
                and smoothed >= self.config.length_surge_ratio * reference
            )
            self._streak = self._streak + 1 if holds else 0
            if holds and self.event is None and self._streak >= self.config.length_surge_patience:
                self.event = SurgeEvent(
                    step=step,
                    num_observations=self.num_observations,
                    smoothed_length=smoothed,
                    reference_length=reference,
                    ratio=smoothed / reference,
                    detector=self.name,
                    onset_step=self._onset(reference),
                )
                fired_now = self.event
        self._after(length, smoothed)
        return fired_now

    def _onset(self, reference: float) -> int:
        """First step of the run of raw lengths above ``reference * ratio ** 0.25`` that ends at
        (or, if the last value fell back under noise, just before) this observation."""
        threshold = reference * self.config.length_surge_ratio**0.25
        raw = list(self._raw)
        i = len(raw) - 1
        while i > 0 and raw[i][1] <= threshold:  # S_n >= ratio * R: some recent value is above
            i -= 1
        while i > 0 and raw[i - 1][1] > threshold:
            i -= 1
        return raw[i][0]

    def rearm(self) -> None:
        """Forget the history and the event, so a later surge (relative to the new level) can be
        detected again. The step counter is kept: later steps must still increase."""
        last_step = self.last_step
        self.__init__(self.config)  # type: ignore[misc]
        self.last_step = last_step

    # ------------------------------------------------------------------------------- subclasses
    def _reference(self) -> float | None:
        raise NotImplementedError

    def _after(self, length: float, smoothed: float | None) -> None:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (plain Python types: JSON- and pickle-safe)."""
        return {
            "detector": self.name,
            "config": self.config.to_dict(),
            "values": list(self._values),
            "num_observations": self.num_observations,
            "last_step": self.last_step,
            "streak": self._streak,
            "event": dataclasses.asdict(self.event) if self.event is not None else None,
            "baselines": list(self._baselines),
            "raw": [list(x) for x in self._raw],
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: if the state belongs to a different detector.
        """
        if state.get("detector") != self.name:
            raise ValueError(
                f"surge detector state is for {state.get('detector')!r}, this detector is {self.name!r}"
            )
        if state.get("config") != self.config.to_dict():
            warnings.warn(
                f"restoring {self.name!r} surge-detector state saved under a different config "
                f"({state.get('config')}); continuing with the current one ({self.config.to_dict()})",
                UserWarning,
                stacklevel=2,
            )
        self._values = deque(state["values"], maxlen=self.config.length_surge_smoothing)
        self.num_observations = int(state["num_observations"])
        self.last_step = state["last_step"]
        self._streak = int(state["streak"])
        self.event = SurgeEvent(**state["event"]) if state["event"] is not None else None
        self._baselines = deque(state.get("baselines", []), maxlen=self.config.length_surge_baseline_window)
        self._raw = deque((tuple(x) for x in state.get("raw", [])), maxlen=self._raw.maxlen)
        self._load_extra_state(state)


@SURGE_DETECTORS.register("window_ratio")
class WindowRatioDetector(SurgeDetector):
    """Fires when the smoothed length ``S_n`` reaches ``ratio`` x ``max(S_{n-W}, upper quartile of
    S_{n-W-H+1} .. S_{n-W})`` (``W = length_surge_window``, ``H = length_surge_baseline_window``;
    see the module docstring) on ``length_surge_patience`` consecutive observations: a rise within
    ``W`` steps above the level held before, which a dip cannot lower."""

    name = "window_ratio"

    def __init__(self, config: SurgeConfig) -> None:
        super().__init__(config)
        # Smoothed values of the last `window` observations before this one: [0] is S_{n-W}.
        self._past: deque[float] = deque(maxlen=config.length_surge_window)

    def _reference(self) -> float | None:
        if len(self._past) < self.config.length_surge_window:
            return None
        return self._past[0]

    def _after(self, length: float, smoothed: float | None) -> None:
        if smoothed is not None:
            self._past.append(smoothed)

    def _extra_state(self) -> dict[str, Any]:
        return {"past_smoothed": list(self._past)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._past = deque(state["past_smoothed"], maxlen=self.config.length_surge_window)


@SURGE_DETECTORS.register("ema_jump")
class EmaJumpDetector(SurgeDetector):
    """Fires when the smoothed length reaches ``ratio`` x ``max(E, upper quartile of E over the last
    length_surge_baseline_window observations)``, ``E`` an exponential moving average of the
    lengths observed before the smoothing window (see the module docstring)."""

    name = "ema_jump"

    def __init__(self, config: SurgeConfig) -> None:
        super().__init__(config)
        self._ema: float | None = None
        self._frozen_for = 0
        # EMA after each of the last k = smoothing observations. At observation n, before it is
        # added, [0] is E_{n-k}: the EMA of L_1..L_{n-k}, i.e. of everything before the k values
        # that S_n averages.
        self._ema_history: deque[float] = deque(maxlen=config.length_surge_smoothing)

    def _reference(self) -> float | None:
        if len(self._ema_history) < self.config.length_surge_smoothing:
            return None
        return self._ema_history[0]

    def _after(self, length: float, smoothed: float | None) -> None:
        cfg = self.config
        if self._ema is None:
            self._ema = length
        elif (
            smoothed is not None
            and smoothed >= math.sqrt(cfg.length_surge_ratio) * self._ema
            and self._frozen_for < cfg.length_surge_window
        ):
            # Half-way (in log scale) to a surge: stop following the lengths, so a rising surge
            # does not become its own reference; for at most `window` observations, so a lasting
            # moderate level shift is eventually adopted as the new baseline.
            self._frozen_for += 1
        else:
            self._ema = cfg.length_surge_ema_beta * self._ema + (1.0 - cfg.length_surge_ema_beta) * length
            self._frozen_for = 0
        self._ema_history.append(self._ema)

    def _extra_state(self) -> dict[str, Any]:
        return {"ema": self._ema, "ema_history": list(self._ema_history), "frozen_for": self._frozen_for}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._frozen_for = int(state["frozen_for"])
        self._ema = state["ema"]
        self._ema_history = deque(state["ema_history"], maxlen=self.config.length_surge_smoothing)


def _upper_quartile_or_last(values: deque[float]) -> float:
    """``max(values[-1], 75th percentile of values)`` (nearest rank)."""
    ordered = sorted(values)
    q = ordered[max(0, math.ceil(0.75 * len(ordered)) - 1)]
    return max(values[-1], q)


def build_surge_detector(config: SurgeConfig) -> SurgeDetector:
    """The detector named by ``config.length_surge_detector``."""
    return SURGE_DETECTORS.get(config.length_surge_detector)(config)


def _check_step(step: Any, last_step: int | None) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        try:
            as_int = int(step)
        except (TypeError, ValueError):
            raise ValueError(f"step must be an integer, got {step!r}") from None
        if as_int != step:
            raise ValueError(f"step must be an integer, got {step!r}")
        step = as_int
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if last_step is not None and step <= last_step:
        raise ValueError(f"steps must increase: got step {step} after step {last_step}")
    return step
