"""Where the monitor writes: a JSON-lines file always; TensorBoard and Weights & Biases when
configured. The optional packages are imported only when configured, and a configured but missing
package is an ``ImportError`` that says how to install it or switch it off.

A record is ``{"step": int, "metrics": {name: float | null}, "smoothed": {name: float},
"warnings": [MonitorWarning as dict, ...], ...}``; non-finite values are written as ``null``
(JSON has no NaN) and named under ``"non_finite"``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Protocol

from megatron_mis.monitor.config import MonitorConfig

__all__ = ["JsonlSink", "Sink", "TensorBoardSink", "WandbSink", "build_sinks", "scalars_of"]


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The finite scalars of a record, flat: ``metric``, ``smoothed/metric``, ``num_warnings``."""
    out = {}
    for name, value in record.get("metrics", {}).items():
        if value is not None and math.isfinite(value):
            out[name] = float(value)
    for name, value in record.get("smoothed", {}).items():
        if value is not None and math.isfinite(value):
            out[f"smoothed/{name}"] = float(value)
    out["num_warnings"] = float(len(record.get("warnings", ())))
    return out


class JsonlSink:
    """Appends one JSON object per line to ``path`` (parent folders are created), flushed per
    record so a crashed run keeps everything up to its last step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the tensorboard package)."""

    def __init__(self, log_dir: str, prefix: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                f"monitor_tensorboard_dir={log_dir!r} is set but TensorBoard cannot be imported ({exc}); "
                "install it with `pip install 'megatron-mis[tensorboard]'` or set monitor_tensorboard_dir: null"
            ) from exc
        self.prefix = prefix
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for name, value in scalars_of(record).items():
            self.writer.add_scalar(self.prefix + name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Logs into the active W&B run. A run is started here only when ``new_run`` is true (the
    ``monitor_wandb_new_run`` key) and none is active; that run is finished on :meth:`close`.

    Without an active run and without ``new_run``, the sink warns once and logs nothing (the JSONL
    sink still writes every record): in slime / Miles the driver process owns the W&B run and every
    training actor sees ``wandb.run is None``, so starting a run there would open one stray run
    per rank. The run is looked up again at each write, so a run started later is used. The
    monitor's step is its own W&B step metric (``<prefix>step``), so it never conflicts with the
    host's step counter."""

    def __init__(self, project: str | None, prefix: str, *, new_run: bool = False) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                f"monitor_wandb is true but wandb cannot be imported ({exc}); install it with "
                "`pip install 'megatron-mis[wandb]'` or set monitor_wandb: false"
            ) from exc
        self.wandb = wandb
        self.prefix = prefix
        self._owns_run = False
        self._defined_in = None  # the run whose step metric has been defined
        self._warned = False
        if wandb.run is None and new_run:
            wandb.init(project=project)
            self._owns_run = True
        self._active_run()

    def _active_run(self) -> Any:
        """The active run (defining the monitor's step metric in it once), or None after one
        warning."""
        run = self.wandb.run
        if run is None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "monitor_wandb is true but no W&B run is active in this process (in slime / Miles "
                    "the driver owns the run; training actors have none): the monitor logs nothing to "
                    "W&B here; its JSONL file is written as usual. Set monitor_wandb_new_run: true to "
                    "start a run in a single-process loop of your own.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        if self._defined_in is not run:
            self.wandb.define_metric(self.prefix + "step")
            self.wandb.define_metric(self.prefix + "*", step_metric=self.prefix + "step")
            self._defined_in = run
        return run

    def write(self, record: dict[str, Any]) -> None:
        if self._active_run() is None:
            return
        data = {self.prefix + name: value for name, value in scalars_of(record).items()}
        data[self.prefix + "step"] = record["step"]
        self.wandb.log(data)

    def close(self) -> None:
        if self._owns_run:
            self.wandb.finish()
            self._owns_run = False


def build_sinks(config: MonitorConfig) -> list[Sink]:
    """JSON lines always, plus TensorBoard / W&B as configured (raises ``ImportError`` when one is
    configured and its package is missing; the already opened sinks are closed first)."""
    sinks: list[Sink] = [JsonlSink(config.monitor_jsonl_path)]
    try:
        if config.monitor_tensorboard_dir is not None:
            sinks.append(TensorBoardSink(config.monitor_tensorboard_dir, config.monitor_log_prefix))
        if config.monitor_wandb:
            sinks.append(
                WandbSink(
                    config.monitor_wandb_project,
                    config.monitor_log_prefix,
                    new_run=config.monitor_wandb_new_run,
                )
            )
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
