"""When a check may read a tensor's values (pure torch; no Megatron).

Per-micro-batch code never waits for the device (docs/engine.md, "Host synchronisation"): a
check that must read a value (``int(t)``, ``bool(t.any())``) runs only where reading costs no
device synchronisation — every tensor it reads is host memory — or when the debug flag is set:
the environment variable ``MEGATRON_MIS_DEBUG_CHECKS=1`` turns every value check on for
accelerator tensors too (each then costs one synchronisation). Checks of shapes, dtypes and
configuration never read a value and always run. Under context parallelism the flag also adds a
fixed-size all-gather of the number of sequences before the statistics (``parallel.cp_mis``), so
CP ranks given different numbers of sequences (a host contract violation) raise the same error
instead of aborting (gloo) or hanging (nccl).
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEBUG_ENV", "debug_checks", "reads_values"]

#: The debug flag: ``MEGATRON_MIS_DEBUG_CHECKS=1`` runs value checks on accelerator tensors too.
DEBUG_ENV = "MEGATRON_MIS_DEBUG_CHECKS"


def debug_checks() -> bool:
    """Whether the debug flag is set (read at every call: no state is cached)."""
    value = os.environ.get(DEBUG_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{DEBUG_ENV}={value!r}: allowed values are '1' (value checks everywhere) and '0' or unset")
    return value == "1"


def reads_values(*tensors: torch.Tensor | None) -> bool:
    """True when a check may read the values of ``tensors``: all of them are host (CPU) memory, or
    the debug flag is set. ``None`` entries are ignored."""
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return True
    return debug_checks()
