"""A core-attention module for Megatron-Core layer specs built on ``torch.nn.functional.
scaled_dot_product_attention``: runs on CPU, supports padded ("bshd") and packed ("thd")
sequences, grouped-query attention and context parallelism (zigzag split).

Megatron's local ``DotProductAttention`` refuses packed sequences and context parallelism and
asks for a CUDA memory buffer; Transformer Engine needs CUDA. This module is what the CPU layer
spec (:func:`megatron_mis.testing.cpu.cpu_gpt_layer_spec`) plugs in as ``core_attention``.

Context parallelism (``context_parallel_size = cp > 1``) follows the zigzag layout of
DESIGN section 3 and of Megatron / Transformer Engine: every sequence (thd) or the padded batch
(bshd) is cut into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``. The
module all-gathers keys and values over the CP group (one collective per layer, differentiable:
the gradient of every key / value goes back to the rank that owns it), puts them back in global
order and applies the causal mask from GLOBAL positions. This costs ``O(local x global)``
attention memory per rank, which is fine for the small models it is meant for; it is the
reference against which faster ring-attention implementations can be checked, not one of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_mis.parallel.packing import zigzag_bshd_global_index, zigzag_thd_global_index

__all__ = [
    "SDPACoreAttention",
    "packed_causal_mask",
    "sdpa_packed",
    "gather_along_first_dim",
]


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


def sdpa_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention over packed sequences (no context parallelism): ``query [t, np, hn]``,
    ``key / value [t, ng, hn]``, ``cu_seqlens [N+1]`` -> ``[t, np*hn]``. This is exactly what
    :class:`SDPACoreAttention` runs for thd input with CP = 1 (the rollout engine's
    true-on-policy path calls it to stay bitwise identical to the trainer)."""
    t = query.shape[0]
    mask = packed_causal_mask(cu_seqlens, t, query.device)
    q, k, v = (x.permute(1, 0, 2) for x in (query, key, value))  # [h, t, d]
    k, v = SDPACoreAttention._expand_groups(q, k, v, head_dim=0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)  # [h, t, d]
    return out.permute(1, 0, 2).reshape(t, -1)


class _GatherFirstDim(torch.autograd.Function):
    """``[...] -> [group_size, ...]`` all-gather whose backward returns each rank the SUM over
    the group of the gradients of its own slot."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty((group.size(), *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # gloo has no reduce-scatter: sum everything, keep this rank's slot.
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad[group.rank()], None


def gather_along_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather ``x`` over ``group`` (explicit) and stack: ``[...] -> [group_size, ...]`` in
    group-rank order. Differentiable: each rank receives the SUM over the group of the gradients
    that flowed into its own slot.

    Collectives: one ``all_gather`` forward; one ``reduce_scatter`` backward on NCCL, one
    ``all_reduce`` of the gathered gradient on gloo (which has no reduce-scatter).
    """
    return _GatherFirstDim.apply(x, group)


class SDPACoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron-Core ``SelfAttention`` (causal masks only).

    Shapes: bshd ``q [sq, b, np, hn]``, ``k/v [sk, b, ng, hn]`` -> ``[sq, b, np*hn]``;
    thd (``packed_seq_params.qkv_format == "thd"``) ``q [t, np, hn]`` -> ``[t, np*hn]``.

    Under context parallelism the inputs are this rank's zigzag slice: bshd ``sq = S / cp``
    of the padded length ``S``; thd ``t = cu_seqlens_q_padded[-1] / cp`` with
    ``cu_seqlens_q_padded`` the GLOBAL padded offsets (each sequence a multiple of ``2*cp``).
    The CP group is ``pg_collection.cp`` when Megatron passes a process-group collection, else
    ``megatron.core.parallel_state.get_context_parallel_group()``. One ``all_gather`` of the
    concatenated keys and values runs per forward, one ``all_reduce`` (gloo) or
    ``reduce_scatter`` (NCCL) per backward.
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
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        if attention_type != "self":
            raise ValueError(f"SDPACoreAttention supports self-attention only, got attention_type={attention_type!r}")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
        self._pg_collection = pg_collection

    # ----------------------------------------------------------------------------- groups
    def _cp_group(self) -> Any:
        group = getattr(self._pg_collection, "cp", None) if self._pg_collection is not None else None
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        size = group.size()
        if size != self.cp_size:
            raise ValueError(
                f"SDPACoreAttention: the CP process group has {size} ranks but "
                f"config.context_parallel_size={self.cp_size}"
            )
        return group

    # ---------------------------------------------------------------------------- forward
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
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.cp_size > 1:
            if thd:
                return self._forward_thd_cp(query, key, value, packed_seq_params, dropout)
            return self._forward_bshd_cp(query, key, value, attention_mask, dropout)
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            return sdpa_packed(query, key, value, cu, scale=self.softmax_scale, dropout_p=dropout)
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

    def _gather_kv(self, key: torch.Tensor, value: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [s_local, ...]`` -> ``[cp, s_local, ...]`` each, with ONE all-gather."""
        kv = torch.cat([key, value], dim=-1)
        gathered = gather_along_first_dim(kv, group)
        hn = key.shape[-1]
        return gathered[..., :hn], gathered[..., hn:]

    def _forward_thd_cp(self, query, key, value, packed_seq_params, dropout) -> torch.Tensor:
        group = self._cp_group()
        cp, rank = self.cp_size, group.rank()
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        t = query.shape[0]
        total = int(cu[-1])
        if total != t * cp:
            raise ValueError(
                f"thd under context parallelism: {t} local tokens x cp={cp} != global padded "
                f"length cu_seqlens_q_padded[-1]={total} (cu_seqlens must be GLOBAL offsets)"
            )
        index = torch.stack([zigzag_thd_global_index(cu, cp, r) for r in range(cp)])  # [cp, t]
        order = torch.argsort(index.flatten()).to(query.device)  # global position -> gathered slot
        k_all, v_all = self._gather_kv(key, value, group)  # [cp, t, g, d]
        k_glob = k_all.reshape(cp * t, *key.shape[1:]).index_select(0, order)  # [T, g, d]
        v_glob = v_all.reshape(cp * t, *value.shape[1:]).index_select(0, order)
        q_index = index[rank]  # [t] global stream index of each local query
        cu_l = cu.detach().to(device="cpu", dtype=torch.long)
        seq_start = cu_l[:-1][torch.searchsorted(cu_l[1:], q_index, right=True)]  # [t]
        keys = torch.arange(total)
        mask = (keys[None, :] >= seq_start[:, None]) & (keys[None, :] <= q_index[:, None])  # [t, T]
        q = query.permute(1, 0, 2)  # [h, t, d]
        k, v = (x.permute(1, 0, 2) for x in (k_glob, v_glob))  # [g, T, d]
        k, v = self._expand_groups(q, k, v, head_dim=0)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.to(query.device), dropout_p=dropout, scale=self.softmax_scale
        )
        return out.permute(1, 0, 2).reshape(t, -1)

    def _forward_bshd_cp(self, query, key, value, attention_mask, dropout) -> torch.Tensor:
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            raise ValueError(
                "SDPACoreAttention: padding masks are not supported under context parallelism; "
                "pass attention_mask=None (causal) or use the packed thd format"
            )
        group = self._cp_group()
        cp, rank = self.cp_size, group.rank()
        sq, b = query.shape[0], query.shape[1]
        index = torch.stack([zigzag_bshd_global_index(sq, cp, r) for r in range(cp)])  # [cp, sq]
        order = torch.argsort(index.flatten()).to(query.device)
        k_all, v_all = self._gather_kv(key, value, group)  # [cp, sq, b, g, d]
        k_glob = k_all.reshape(cp * sq, *key.shape[1:]).index_select(0, order)  # [S, b, g, d]
        v_glob = v_all.reshape(cp * sq, *value.shape[1:]).index_select(0, order)
        mask = torch.arange(cp * sq)[None, :] <= index[rank][:, None]  # [sq, S]
        q = query.permute(1, 2, 0, 3)  # [b, h, sq, d]
        k, v = (x.permute(1, 2, 0, 3) for x in (k_glob, v_glob))  # [b, g, S, d]
        k, v = self._expand_groups(q, k, v, head_dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.to(query.device), dropout_p=dropout, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    @staticmethod
    def _expand_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
        rep = q.shape[head_dim] // k.shape[head_dim]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=head_dim)
            v = v.repeat_interleave(rep, dim=head_dim)
        return k, v
