"""Imported once by the fork server that starts :class:`~megatron_mis.testing.distributed.ProcessGroupPool`'s
workers, so that every worker begins as a fork of a process that already holds torch and
Megatron-Core, instead of importing them itself (about 3.5 s of torch and 4 s of Megatron-Core
per rank on a 2-core VM: 30 s to start 8 ranks).

Nothing here runs a collective, touches CUDA or starts a thread: a fork of this process is as
clean as a fresh interpreter that ran these imports. Megatron-Core is optional (the pool serves
machines without it); a failed import leaves the workers to import it themselves.
"""

import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

try:
    import megatron.core.parallel_state  # noqa: F401
except Exception:  # noqa: BLE001 - not installed, or an import that fails on this machine: workers retry
    pass
