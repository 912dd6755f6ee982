"""Tiny Megatron-Core MoE GPT models for CPU tests and benchmarks of routing replay.

Builds on :mod:`megatron_mis.testbed.models.gpt` with the extra CPU facts MoE needs (checked on
megatron-core 0.16.1, torch CPU, gloo):

- the ``alltoall`` token dispatcher creates a ``torch.cuda.Stream`` in its constructor, so it
  cannot be built on CPU at all; the ``allgather`` dispatcher runs (also with expert
  parallelism over gloo);
- Megatron's torch-norm wrapper refuses ``sequence_parallel``; :class:`SequenceParallelRMSNorm`
  is a plain ``torch.nn.RMSNorm`` that marks its weight sequence-parallel (what the fused norms
  do), so tensor + sequence parallel models build;
- pipeline schedules call ``torch.cuda.synchronize()`` after batched p2p unless
  ``batch_p2p_sync=False``;
- :class:`RoutingOnlyAttention` lets a model run under context parallelism: it returns the
  values unmixed (no attention across positions). Only for tests of token/route layout, where
  attention math does not matter; never for numerics.
- ``add_bias_linear=False``: MoE biases need expert-tensor-parallel size 1;
- with sequence parallelism the embedding forks Megatron's CUDA RNG tracker around its dropout,
  and activation recomputation saves and restores the CUDA RNG state: :func:`cpu_rng_shims`
  makes the fork a no-op (dropout is 0 in these models) and reads the CPU RNG state instead of
  the CUDA one while active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_mis.testbed.models.gpt import GPTSpec, transformer_config

__all__ = ["SequenceParallelRMSNorm", "RoutingOnlyAttention", "cpu_moe_config", "build_cpu_moe_gpt", "cpu_rng_shims"]


@contextlib.contextmanager
def cpu_rng_shims() -> Iterator[None]:
    """While active (also where CUDA is available: the models it serves run on the CPU):
    ``CudaRNGStatesTracker.fork`` yields without touching CUDA RNG states, and Megatron's
    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (used by activation recomputation) read /
    leave the CPU generator (recomputation restores the CPU state itself). Everything is restored
    on exit."""
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CudaRNGStatesTracker
    saved = [(cls, "fork", cls.fork)]
    saved += [(mrandom, n, getattr(mrandom, n)) for n in ("_get_cuda_rng_state", "_set_cuda_rng_state")]

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    cls.fork = fork
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor signature; its weight carries
    ``sequence_parallel`` so Megatron all-reduces its gradient over TP ranks."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


class RoutingOnlyAttention(MegatronModule):
    """Core attention that returns the values ``[s, b, heads * dim]`` (or ``[t, heads * dim]``)
    without mixing positions. Runs under any context-parallel size. Tests of layout only."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self", **kwargs: Any) -> None:
        super().__init__(config=config)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, packed_seq_params=None, **kwargs):
        if value.shape[-2] != query.shape[-2]:  # grouped-query attention: repeat the kv heads
            value = value.repeat_interleave(query.shape[-2] // value.shape[-2], dim=-2)
        return value.reshape(*value.shape[:-2], -1)


def cpu_moe_config(spec: GPTSpec, **overrides: Any):
    """A ``TransformerConfig`` for a CPU MoE model (allgather dispatcher, no biases, no p2p sync)."""
    kwargs = dict(add_bias_linear=False, moe_token_dispatcher_type="allgather", batch_p2p_sync=False)
    kwargs.update(overrides)
    return transformer_config(spec, **kwargs)


def build_cpu_moe_gpt(
    spec: GPTSpec,
    *,
    routing_only_attention: bool = False,
    position_embedding_type: str = "rope",
    vp_stage: int | None = None,
    **config_overrides: Any,
):
    """A ``GPTModel`` chunk for the current parallel state (inside ``cpu_compat()``).

    ``spec.moe_layer_freq`` or a ``moe_layer_freq=[0, 1, ...]`` override picks dense and MoE
    layers (Megatron's block spec rules); ``vp_stage`` builds one virtual-pipeline chunk
    (pass ``virtual_pipeline_model_parallel_size`` in the overrides). Rotary embeddings under
    context parallelism ask for pinned memory (CUDA only): use ``position_embedding_type="none"``
    with ``routing_only_attention`` there.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mis.testing.attention import SDPACoreAttention

    config = cpu_moe_config(spec, **config_overrides)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=spec.normalization, vp_stage=vp_stage)
    core = RoutingOnlyAttention if routing_only_attention else SDPACoreAttention
    seen = set()
    for layer in block.layer_specs:
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        layer.submodules.self_attention.submodules.core_attention = core
        if config.sequence_parallel:
            layer.submodules.input_layernorm = SequenceParallelRMSNorm
            layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if config.sequence_parallel:
        block.layer_norm = SequenceParallelRMSNorm
    kwargs = {}
    if vp_stage is not None:
        kwargs = dict(
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
    else:
        kwargs = dict(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        share_embeddings_and_output_weights=not spec.untie_embeddings,
        position_embedding_type=position_embedding_type,
        **kwargs,
    )
