"""Small Megatron-Core GPT models that run on CPU (tests, benchmarks, the demo).

:func:`build_gpt` builds a ``GPTModel`` (with the CPU layer spec
:func:`megatron_mis.testing.cpu.cpu_gpt_layer_spec`) for the parallel state that is already
initialised (tensor / pipeline parallel sizes are read from Megatron's ``parallel_state``).

Weights are initialised on the CPU from the global torch seed: Megatron's CPU initialisation
draws every full weight and then keeps this rank's shard, so the same seed gives the same full
model under any tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_mis.config.base import ConfigBase, doc

__all__ = ["GPTSpec", "build_gpt", "transformer_config"]


@dataclass(kw_only=True, slots=True)
class GPTSpec(ConfigBase):
    """Shape of a small GPT model."""

    vocab_size: int = doc(64, "Vocabulary size (must divide by the tensor-parallel size).")
    hidden_size: int = doc(64, "Model width.")
    num_layers: int = doc(2, "Transformer layers.")
    num_attention_heads: int = doc(4, "Attention heads.")
    num_query_groups: int | None = doc(None, "Key/value heads for grouped-query attention; null: = heads.")
    ffn_hidden_size: int | None = doc(None, "MLP width; null: 4 x hidden_size.")
    max_sequence_length: int = doc(256, "Longest sequence (rotary table size).")
    normalization: Literal["LayerNorm", "RMSNorm"] = doc("RMSNorm", "Normalisation layer.")
    num_moe_experts: int | None = doc(None, "Experts per MoE layer; null: dense MLP.")
    moe_router_topk: int = doc(2, "Experts chosen per token.")
    moe_layer_freq: int = doc(1, "Every k-th layer is MoE (1: all).")
    untie_embeddings: bool = doc(True, "Separate output layer (no weight tying).")

    def _check(self) -> list[str]:
        out = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_sequence_length"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.hidden_size % max(self.num_attention_heads, 1):
            out.append(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_moe_experts is not None and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            out.append(
                f"moe_router_topk={self.moe_router_topk} must lie in [1, num_moe_experts={self.num_moe_experts}]"
            )
        return out


def transformer_config(spec: GPTSpec, *, params_dtype: torch.dtype = torch.float32, **overrides):
    """A ``TransformerConfig`` for ``spec`` matching the initialised Megatron parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size or 4 * spec.hidden_size,
        normalization=spec.normalization,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )
    if spec.num_moe_experts is not None:
        kwargs.update(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            # alltoall builds a torch.cuda.Stream in its constructor; allgather runs on CPU (and EP over gloo)
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
        if spec.moe_layer_freq != 1:
            kwargs["moe_layer_freq"] = spec.moe_layer_freq
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(spec: GPTSpec, *, params_dtype: torch.dtype = torch.float32, layer_spec=None, **config_overrides):
    """Build a ``GPTModel`` for the current Megatron parallel state (call inside
    :func:`megatron_mis.testing.cpu.cpu_compat` on a CPU-only build).

    Args:
        spec: model shape.
        params_dtype: parameter dtype.
        layer_spec: a transformer layer spec; default :func:`cpu_gpt_layer_spec`.
        **config_overrides: extra ``TransformerConfig`` fields (``sequence_parallel=True``,
            ``moe_enable_routing_replay=True``, ...).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec, params_dtype=params_dtype, **config_overrides)
    if layer_spec is None:
        from megatron_mis.testing.cpu import cpu_gpt_layer_spec

        layer_spec = cpu_gpt_layer_spec(num_experts=spec.num_moe_experts, normalization=spec.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not spec.untie_embeddings,
        position_embedding_type="rope",
    )
