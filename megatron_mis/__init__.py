"""megatron-mis: training-inference mismatch correction for Megatron-Core based RL.

Importing the package is cheap: nothing here imports Megatron-Core, Transformer Engine or
SGLang. The host drop-ins are resolved lazily, so slime / Miles can load
``--custom-tis-function-path megatron_mis.compute_mis_weights_with_cp``.
"""

from __future__ import annotations

from typing import Any

from megatron_mis._version import __version__
from megatron_mis.config import ConfigError, MISConfig

__all__ = [
    "__version__",
    "ConfigError",
    "MISConfig",
    "compute_mis",
    "compute_mis_from_lists",
    "compute_mis_weights_with_cp",
    "compute_mis_weights_fsdp",
    "LossConfig",
    "MegatronRLLoss",
    "RoutingReplay",
    "RoutingReplayConfig",
]

_LAZY = {
    "compute_mis": "megatron_mis.core.engine",
    "compute_mis_from_lists": "megatron_mis.core.engine",
    "compute_mis_weights_with_cp": "megatron_mis.integrations.tis_functions",
    "compute_mis_weights_fsdp": "megatron_mis.integrations.tis_functions",
    "LossConfig": "megatron_mis.config.loss",
    "MegatronRLLoss": "megatron_mis.integrations.megatron_loss",
    "RoutingReplay": "megatron_mis.routing.replay",
    "RoutingReplayConfig": "megatron_mis.routing.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_mis' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
