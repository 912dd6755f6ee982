"""A core-attention module for Megatron-Core layer specs built on ``torch.nn.functional.
scaled_dot_product_attention``: runs on CPU, supports padded ("bshd") and packed ("thd")
sequences and grouped-query attention.

Megatron's local ``DotProductAttention`` refuses packed sequences and context parallelism and
asks for a CUDA memory buffer; Transformer Engine needs CUDA. This module is what the CPU layer
spec (:mod:`megatron_mis.models.gpt`) plugs in as ``core_attention``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention", "packed_causal_mask"]


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[T, T]`` bool mask (True = attend) for packed sequences: causal within each sequence,
    nothing across sequences. Positions past ``cu_seqlens[-1]`` (padding) attend to themselves
    only, so their rows stay finite."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    pos = torch.arange(total, device=device)
    seq = torch.searchsorted(cu[1:], pos, right=True)  # sequence id per position, N for padding
    causal = pos[None, :] <= pos[:, None]
    same = seq[None, :] == seq[:, None]
    return (causal & same) | torch.eye(total, dtype=torch.bool, device=device)


class SDPACoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron-Core ``SelfAttention`` (causal masks only).

    Shapes: bshd ``q [sq, b, np, hn]``, ``k/v [sk, b, ng, hn]`` -> ``[sq, b, np*hn]``;
    thd (``packed_seq_params.qkv_format == "thd"``) ``q [t, np, hn]`` -> ``[t, np*hn]``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError(
                "SDPACoreAttention does not support context parallelism "
                f"(context_parallel_size={config.context_parallel_size})"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            t = query.shape[0]
            mask = packed_causal_mask(cu, t, query.device)
            q, k, v = (x.permute(1, 0, 2) for x in (query, key, value))  # [h, t, d]
            k, v = self._expand_groups(q, k, v, head_dim=0)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.softmax_scale
            )  # [h, t, d]
            return out.permute(1, 0, 2).reshape(t, -1)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        k, v = self._expand_groups(q, k, v, head_dim=1)
        mask = None
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            # Megatron convention: True = masked out. Combine with causal.
            causal = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            mask = causal & ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    @staticmethod
    def _expand_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
        rep = q.shape[head_dim] // k.shape[head_dim]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=head_dim)
            v = v.repeat_interleave(rep, dim=head_dim)
        return k, v
