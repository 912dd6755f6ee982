"""Run Megatron-Core models on a CPU-only PyTorch build.

Megatron-Core assumes CUDA in a handful of places that matter for small CPU runs (tests, the
demo): ``torch.cuda.current_device()`` when placing buffers and router weights,
``torch.cuda.synchronize()`` in the pipeline-parallel p2p shape exchange, hard-coded
``device="cuda"`` tensors in the pipeline schedules and in Megatron's optimizer (its loss scale,
gradient-norm buffers and a CUDA-only assert in gradient clipping), and (without Transformer Engine) an
undefined ``te_general_gemm`` name in the MoE router gating path, and a pinned-memory CUDA
index in the rotary-embedding slice for context parallelism (bshd). :func:`cpu_compat` installs
small, explicit shims for exactly these, and removes them again on exit. It is re-entrant (safe
to apply twice) and installs the same shims on a machine where CUDA is available (the models
built inside run on the CPU there too).

:func:`cpu_gpt_layer_spec` is Megatron-Core's local GPT layer spec with
:class:`megatron_mis.testing.attention.SDPACoreAttention` as the core attention: Megatron's local
``DotProductAttention`` refuses packed (thd) sequences, which the RL loss feeds the model.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cpu_compat", "cpu_compat_active", "cpu_gpt_layer_spec"]

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


def _clip_grad_by_total_norm_cpu(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """CPU twin of ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (which
    asserts ``torch.cuda.FloatTensor`` gradients): scale every gradient by
    ``max_norm / (total_norm + 1e-6)`` when that is below 1, in place."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(coeff)


def _grad_norm_cpu(grads_for_norm: Any, norm_type: float = 2, grad_stats_parallel_group: Any = None) -> float:
    """CPU twin of ``megatron.core.optimizer.clip_grads.get_grad_norm_fp32`` (whose L2 path runs
    a CUDA multi-tensor kernel): the ``norm_type`` norm of the local gradients, combined over
    ``grad_stats_parallel_group`` by one all-reduce (SUM of the p-th powers, or MAX for inf).
    DTensor (FSDP) gradients are not supported here."""
    import math

    import torch.distributed as dist

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    total = torch.zeros(1, dtype=torch.float64)
    for grad in grads_for_norm:
        g = grad.detach().double()
        if norm_type == math.inf:
            total = torch.maximum(total, g.abs().max().reshape(1))
        else:
            total += g.abs().pow(norm_type).sum()
    if dist.is_initialized():
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=grad_stats_parallel_group)
    return float(total) if norm_type == math.inf else float(total) ** (1.0 / norm_type)


def _current_device_for_cpu_models(real: Any) -> Any:
    """``torch.cuda.current_device`` while the shims are on: ``"cpu"`` for Megatron (and every
    other caller outside torch), so it places its buffers and router weights on the CPU; torch's
    own modules keep the real device index where CUDA is available. TorchDynamo asks for it
    (``torch._dynamo.device_interface``) to index the device properties when it compiles
    Megatron's ``jit_fuser`` functions (the MoE router's ``_apply_expert_bias``): given ``"cpu"``
    it failed with "list indices must be integers or slices, not str", which broke every MoE
    model of the testbed on an H100 (32 tests, 2026-11-27)."""

    def current_device() -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if (caller == "torch" or caller.startswith("torch.")) and torch.cuda.is_available():
            return real()
        return "cpu"

    return current_device


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

    Shims (installed whether or not CUDA is available: the models built inside run on the CPU,
    and on a GPU machine without the shims Megatron's schedules and optimizer put their buffers on
    the GPU; the demo failed so, with a device mismatch, on an H100 on 2026-11-27):

    - ``torch.cuda.current_device()`` returns ``"cpu"`` to callers outside torch (torch's own
      modules get the real index where CUDA is available: :func:`_current_device_for_cpu_models`);
    - ``torch.cuda.synchronize()`` does nothing (the pipeline-parallel p2p shape exchange calls
      it; CPU work is synchronous);
    - ``megatron.core.pipeline_parallel.schedules`` and Megatron's optimizer
      (``megatron.core.optimizer.optimizer``, ``.clip_grads``) see a ``torch`` whose
      ``zeros/empty/tensor`` map ``device="cuda"`` to the CPU, and the optimizer clips gradients
      with :func:`_clip_grad_by_total_norm_cpu` and measures their norm with
      :func:`_grad_norm_cpu` (Megatron's assert CUDA gradients / run a CUDA kernel), so
      ``get_megatron_optimizer`` works on a CPU (it falls back to torch's Adam without
      Transformer Engine and Apex);
    - ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is defined as ``None`` when
      Transformer Engine is absent, so the router uses its plain ``torch.mm`` path;
    - the rotary-embedding modules slice their table per CP rank with a CPU index
      (:func:`_pos_emb_on_this_cp_rank_cpu`) instead of a pinned CUDA one.
    """
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            _patch(torch.cuda, "current_device", _current_device_for_cpu_models(torch.cuda.current_device))
            _patch(torch.cuda, "synchronize", lambda device=None: None)
            for module_name in ("pipeline_parallel.schedules", "optimizer.optimizer", "optimizer.clip_grads"):
                try:
                    module = importlib.import_module(f"megatron.core.{module_name}")
                except ImportError:  # pragma: no cover - megatron-core is a hard requirement
                    continue
                _patch(module, "torch", _CudaDeviceToCpuTorch())
                for name, twin in (("clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu),
                                   ("get_grad_norm_fp32", _grad_norm_cpu)):
                    if hasattr(module, name):
                        _patch(module, name, twin)
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


def cpu_gpt_layer_spec(
    *,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
):
    """Megatron-Core's local GPT layer spec with
    :class:`~megatron_mis.testing.attention.SDPACoreAttention` as core attention (packed thd
    sequences and context parallelism on a CPU); the arguments are
    ``get_gpt_layer_local_spec``'s."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mis.testing.attention import SDPACoreAttention

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        normalization=normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
