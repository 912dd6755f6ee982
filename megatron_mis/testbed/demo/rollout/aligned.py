"""The true-on-policy numeric path: the trainer's forward, operation for operation, over the
trainer's packed shapes (see the package docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_mis.testbed.demo.rollout.fast import _rotate_half
from megatron_mis.testbed.demo.rollout.weights import RolloutWeights, layer_tensors

__all__ = ["_AlignedModel"]


class _AlignedModel:
    """The trainer's forward, op for op (Megatron-Core GPTModel, local spec with
    :class:`~megatron_mis.testing.attention.SDPACoreAttention`, packed thd, CP = 1), with the
    tensor-parallel shards computed one after the other on this process and the row-parallel
    all-reduce replaced by the same sum."""

    def __init__(self, weights: RolloutWeights) -> None:
        a = weights.arch
        if a.tp_size > 2:
            raise ValueError(
                f"true_on_policy: the trainer's tensor-parallel size is {a.tp_size}; the aligned path "
                "reproduces the all-reduce sum exactly only for 1 or 2 ranks (with more, the summation "
                "order belongs to the communication backend)"
            )
        if a.is_moe:
            raise ValueError(
                "true_on_policy: the aligned path mirrors dense GPT layers only; this model has MoE layers "
                f"{list(a.moe_layers)} (roll out MoE models on the fast path)"
            )
        self.arch, self.tp = a, a.tp_size
        t = weights.tensors
        self.embedding = t["embedding.word_embeddings.weight"]
        self.inv_freq = weights.inv_freq.float()
        self.layers = []
        for i in range(a.num_layers):
            L = layer_tensors(weights, i)
            self.layers.append(
                dict(
                    ln1_w=L["ln1_w"],
                    ln1_b=L["ln1_b"],
                    qkv_w=self._split(L["qkv_w"], 0),
                    qkv_b=self._split(L["qkv_b"], 0),
                    proj_w=self._split(L["proj_w"], 1),
                    proj_b=L["proj_b"],
                    ln2_w=L["ln2_w"],
                    ln2_b=L["ln2_b"],
                    fc1_w=self._split(L["fc1_w"], 0, gated=a.gated_linear_unit),
                    fc1_b=self._split(L["fc1_b"], 0, gated=a.gated_linear_unit),
                    fc2_w=self._split(L["fc2_w"], 1),
                    fc2_b=L["fc2_b"],
                )
            )
        self.final_w = t["decoder.final_layernorm.weight"]
        self.final_b = t.get("decoder.final_layernorm.bias")
        self.output_w = self._split(weights.output_weight(), 0)

    def _split(self, w: torch.Tensor | None, dim: int, gated: bool = False) -> list[torch.Tensor] | None:
        """The trainer's TP shards, each its own allocation, flagged ``requires_grad`` like the
        trainer's parameters: ``torch.matmul`` of a ``[s, 1, h]`` activation folds it into one
        ``mm`` when the weight requires grad and takes a batched path otherwise, and the two
        round differently. (The forward itself runs under ``torch.no_grad``.)"""
        if w is None:
            return None
        if gated:
            gate, up = w.chunk(2, dim=dim)
            parts = [torch.cat([g, u], dim=dim) for g, u in zip(gate.chunk(self.tp, dim), up.chunk(self.tp, dim))]
        else:
            parts = list(w.chunk(self.tp, dim=dim))
        return [p.clone().contiguous().requires_grad_(True) for p in parts]

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.arch.normalization == "RMSNorm":  # torch.nn.RMSNorm (Megatron's WrappedTorchNorm)
            return F.rms_norm(x, (x.shape[-1],), w, self.arch.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.arch.norm_eps)

    @staticmethod
    def _allreduce_sum(parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def _rope_thd(self, t: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """Megatron's RotaryEmbedding.get_emb + _apply_rotary_pos_emb_thd (unfused, CP = 1)."""
        seq = torch.arange(max_seqlen, dtype=self.inv_freq.dtype) + 0
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        seqlens = (cu[1:] - cu[:-1]).tolist()
        splits = torch.split(t, seqlens)
        if emb.size(0) == int(cu[-1]):
            packed = torch.cat([emb[int(cu[i]) : int(cu[i]) + x.size(0)] for i, x in enumerate(splits)])
        else:
            packed = torch.cat([emb[: x.size(0)] for x in splits])
        x = t.unsqueeze(1)
        rot = packed.shape[-1]
        head, tail = x[..., :rot], x[..., rot:]
        cos_ = (torch.cos(packed) * 1.0).to(x.dtype)
        sin_ = (torch.sin(packed) * 1.0).to(x.dtype)
        head = (head * cos_) + (_rotate_half(head) * sin_)
        return torch.cat((head, tail), dim=-1).squeeze(1)

    def forward(self, tokens: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> list[torch.Tensor]:
        """``tokens [1, T]``, GLOBAL padded ``cu [N+1]`` -> per-TP-shard logits ``[1, T, V/tp]``."""
        from megatron_mis.testing.attention import sdpa_packed

        a = self.arch
        ng_r = a.num_query_groups // self.tp
        rep = a.num_attention_heads // a.num_query_groups
        d = a.head_dim
        x = F.embedding(tokens, self.embedding).transpose(0, 1).contiguous()  # [T, 1, h]
        t = x.shape[0]
        for layer in self.layers:
            residual = x
            h = self._norm(x, layer["ln1_w"], layer["ln1_b"])
            partials = []
            for r in range(self.tp):
                mixed = torch.matmul(h, layer["qkv_w"][r].t())
                if layer["qkv_b"] is not None:
                    mixed = mixed + layer["qkv_b"][r]
                mixed = mixed.view(t, 1, ng_r, (rep + 2) * d)
                q, k, v = torch.split(mixed, [rep * d, d, d], dim=3)
                q = q.reshape(t, 1, -1, d)
                q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
                q, k = self._rope_thd(q, cu, max_seqlen), self._rope_thd(k, cu, max_seqlen)
                ctx = sdpa_packed(q, k, v, cu, scale=a.softmax_scale).reshape(t, 1, -1)
                partials.append(torch.matmul(ctx, layer["proj_w"][r].t()))
            out = self._allreduce_sum(partials)
            if layer["proj_b"] is not None:
                out = out + layer["proj_b"]
            x = residual + out
            residual = x
            h = self._norm(x, layer["ln2_w"], layer["ln2_b"])
            partials = []
            for r in range(self.tp):
                inter = torch.matmul(h, layer["fc1_w"][r].t())
                if layer["fc1_b"] is not None:
                    inter = inter + layer["fc1_b"][r]
                act = F.gelu if a.activation == "gelu" else F.silu
                if a.gated_linear_unit:
                    g, u = torch.chunk(inter, 2, dim=-1)
                    inter = act(g) * (u + 0.0)
                else:
                    inter = act(inter)
                partials.append(torch.matmul(inter, layer["fc2_w"][r].t()))
            out = self._allreduce_sum(partials)
            if layer["fc2_b"] is not None:
                out = out + layer["fc2_b"]
            x = residual + out
        x = self._norm(x, self.final_w, self.final_b)
        return [torch.matmul(x, w.t()).transpose(0, 1).contiguous() for w in self.output_w]

