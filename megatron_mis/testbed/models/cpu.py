"""Run Megatron-Core models on a CPU-only PyTorch build.

Megatron-Core assumes CUDA in a handful of places that matter for small CPU runs (tests, the
demo): ``torch.cuda.current_device()`` when placing buffers and router weights,
``torch.cuda.synchronize()`` in the pipeline-parallel p2p shape exchange, a hard-coded
``device="cuda"`` token counter in the pipeline schedules, and (without Transformer Engine) an
undefined ``te_general_gemm`` name in the MoE router gating path, and a pinned-memory CUDA
index in the rotary-embedding slice for context parallelism (bshd). :func:`cpu_compat` installs
small, explicit shims for exactly these, and removes them again on exit. It is re-entrant (safe
to apply twice) and does nothing on a machine where CUDA is available.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cpu_compat", "cpu_compat_active"]

_lock = threading.Lock()
_depth = 0
_restore: list[tuple[Any, str, Any, bool]] = []


class _CudaDeviceToCpuTorch:
    """Proxy for the ``torch`` module inside Megatron's schedules: tensor factories asked for
    ``device="cuda"`` get the CPU instead. Everything else is plain ``torch``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _fix(kwargs: dict[str, Any]) -> dict[str, Any]:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **self._fix(kwargs))

    def tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **self._fix(kwargs))

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **self._fix(kwargs))


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """CPU twin of ``megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank``
    (which builds its index in pinned memory and moves it to CUDA): keep chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of ``2*cp_size`` along ``seq_dim`` (the zigzag layout)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])


def _patch(obj: Any, name: str, value: Any) -> None:
    existed = hasattr(obj, name)
    _restore.append((obj, name, getattr(obj, name, None), existed))
    setattr(obj, name, value)


def cpu_compat_active() -> bool:
    """Whether :func:`cpu_compat` shims are currently installed."""
    return _depth > 0


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Install the CPU shims for Megatron-Core for the duration of the block.

    Shims (only when ``torch.cuda.is_available()`` is false):

    - ``torch.cuda.current_device()`` returns ``"cpu"``;
    - ``torch.cuda.synchronize()`` does nothing (the pipeline-parallel p2p shape exchange calls
      it; CPU work is synchronous);
    - ``megatron.core.pipeline_parallel.schedules`` sees a ``torch`` whose ``zeros/empty/tensor``
      map ``device="cuda"`` to the CPU;
    - ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is defined as ``None`` when
      Transformer Engine is absent, so the router uses its plain ``torch.mm`` path;
    - the rotary-embedding modules slice their table per CP rank with a CPU index
      (:func:`_pos_emb_on_this_cp_rank_cpu`) instead of a pinned CUDA one.
    """
    global _depth
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _patch(torch.cuda, "current_device", lambda: "cpu")
            _patch(torch.cuda, "synchronize", lambda device=None: None)
            try:
                from megatron.core.pipeline_parallel import schedules

                _patch(schedules, "torch", _CudaDeviceToCpuTorch())
            except ImportError:  # pragma: no cover - megatron-core is a hard requirement
                pass
            try:
                from megatron.core.transformer.moe import moe_utils

                if not hasattr(moe_utils, "te_general_gemm"):
                    _patch(moe_utils, "te_general_gemm", None)
            except ImportError:  # pragma: no cover
                pass
            for module_name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding"):
                try:
                    module = importlib.import_module(f"megatron.core.models.common.embeddings.{module_name}")
                except ImportError:  # pragma: no cover - optional modules of older cores
                    continue
                if hasattr(module, "get_pos_emb_on_this_cp_rank"):
                    _patch(module, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank_cpu)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _restore:
                    obj, name, old, existed = _restore.pop()
                    if existed:
                        setattr(obj, name, old)
                    else:
                        delattr(obj, name)
