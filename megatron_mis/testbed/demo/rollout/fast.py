"""The fast numeric path: batch-first inference with a KV cache in the rollout precision.

``fp32`` / ``bf16`` / ``fp16`` keep weights and activations in that dtype; ``int8`` / ``int4``
quantise every linear weight per output channel (weight-only) and multiply with the dequantised
weight in float32. RMSNorm accumulates in float32 and casts back, as fused inference kernels do.

MoE layers route like an inference engine: the router's logits come from this path's hidden
state and weight (bf16 / fp16: in that dtype; int8 / int4: the router stays unquantised, as
weight-only quantisers leave the gate in high precision, but its input already carries the
quantised attention and experts), the top-k is taken on those logits, and the ``k`` chosen scores
are soft-maxed in float32 (Megatron's ``softmax`` score function without pre-softmax). Each
token's output is the probability-weighted sum of its experts' MLPs. So the expert choices flip
relative to the trainer's float32 router through the mechanism real engines have, and
:meth:`_FastModel.forward` reports the choices (``routes``) per MoE layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_mis.testbed.demo.rollout.config import DTYPES
from megatron_mis.testbed.demo.rollout.weights import (
    RolloutWeights,
    layer_tensors,
    quantize_int4_per_channel,
    quantize_int8_per_channel,
)

__all__ = ["_Linear", "_FastModel", "_rotate_half"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Linear:
    """``y = x W^T + b`` in the engine's numeric path (``quantize=False``: the weight is only
    cast to the path's dtype, never quantised)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str, *, quantize: bool = True) -> None:
        dtype = DTYPES[precision]
        if quantize and precision in ("int8", "int4"):
            q, scale = (quantize_int8_per_channel if precision == "int8" else quantize_int4_per_channel)(weight)
            self.qweight, self.scale = q, scale
            # dequantised once: numerically what a dequantise-in-the-GEMM kernel computes
            self.weight = q.float() * scale[:, None]
        else:
            self.weight = weight.to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _FastModel:
    """Batch-first inference with a KV cache in ``precision``."""

    def __init__(self, weights: RolloutWeights, precision: str, *, router_noise: float = 0.0) -> None:
        a = weights.arch
        self.arch, self.precision, self.router_noise = a, precision, float(router_noise)
        self.dtype = DTYPES[precision]
        self.embedding = weights.tensors["embedding.word_embeddings.weight"].to(self.dtype)
        self.inv_freq = weights.inv_freq.float()
        self.layers = []
        for i in range(a.num_layers):
            t = layer_tensors(weights, i)
            layer = dict(
                ln1_w=t["ln1_w"],
                ln1_b=t["ln1_b"],
                qkv=_Linear(t["qkv_w"], t["qkv_b"], precision),
                proj=_Linear(t["proj_w"], t["proj_b"], precision),
                ln2_w=t["ln2_w"],
                ln2_b=t["ln2_b"],
            )
            if "experts" in t:
                layer["router"] = _Linear(t["router_w"], None, precision, quantize=False)
                layer["experts"] = [
                    (_Linear(e["fc1_w"], None, precision), _Linear(e["fc2_w"], None, precision)) for e in t["experts"]
                ]
            else:
                layer["fc1"] = _Linear(t["fc1_w"], t["fc1_b"], precision)
                layer["fc2"] = _Linear(t["fc2_w"], t["fc2_b"], precision)
            self.layers.append(layer)
        self.final_w = weights.tensors["decoder.final_layernorm.weight"]
        self.final_b = weights.tensors.get("decoder.final_layernorm.bias")
        self.output = _Linear(weights.output_weight(), None, precision)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        # accumulate in fp32 and cast back, as fused inference norm kernels do
        xf = x.float()
        if self.arch.normalization == "RMSNorm":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.arch.norm_eps) * w
        else:
            y = F.layer_norm(xf, (xf.shape[-1],), w, b, self.arch.norm_eps)
        return y.to(self.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [B, s, h, d]``, ``positions [B, s]``."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, s, d_rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        rot = emb.shape[-1]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        head, tail = x[..., :rot], x[..., rot:]
        return torch.cat((head * cos + _rotate_half(head) * sin, tail), dim=-1)

    def _act(self, inter: torch.Tensor) -> torch.Tensor:
        act = F.gelu if self.arch.activation == "gelu" else F.silu
        if self.arch.gated_linear_unit:
            gate, up = inter.chunk(2, dim=-1)
            return act(gate) * up
        return act(inter)

    def _moe(
        self, layer: dict[str, Any], h: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [B, s, hidden]`` -> (output ``[B, s, hidden]``, chosen experts ``[B, s, k]`` int64 in
        descending score order). With ``router_noise`` (and a ``generator``) the top-k is taken on
        the logits plus ``router_noise`` x their per-token standard deviation x N(0, 1), and the
        chosen experts' noiseless logits are soft-maxed: only the choice is perturbed."""
        b, s, d = h.shape
        x = h.reshape(-1, d)
        logits = layer["router"](x).float()  # [n, E], computed in this path's dtype
        if self.router_noise > 0 and generator is not None:
            noise = torch.randn(logits.shape, generator=generator, dtype=logits.dtype)
            scale = logits.std(dim=-1, keepdim=True) * self.router_noise
            idx = torch.topk(logits + noise * scale, self.arch.moe_router_topk, dim=-1).indices
            top = logits.gather(-1, idx)
        else:
            top, idx = torch.topk(logits, self.arch.moe_router_topk, dim=-1)
        probs = torch.softmax(top, dim=-1).to(self.dtype)  # [n, k]
        out = torch.zeros_like(x)
        for e, (fc1, fc2) in enumerate(layer["experts"]):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            y = fc2(self._act(fc1(x.index_select(0, tok))))
            out.index_add_(0, tok, y * probs[tok, slot].unsqueeze(-1))
        return out.view(b, s, d), idx.view(b, s, -1)

    def new_cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        a = self.arch
        shape = (batch, a.num_query_groups, length, a.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)) for _ in range(a.num_layers)]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        mask: torch.Tensor,
        routes: list[torch.Tensor | None] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``tokens / positions [B, s]`` written at cache columns ``[start, start+s)``;
        ``mask [B, 1, s, start+s]`` bool (True = attend). Returns float32 logits ``[B, s, V]``.
        ``routes``, when given, receives one entry per layer: the chosen experts ``[B, s, k]``
        of an MoE layer, ``None`` for a dense one. ``generator``: the router noise's source."""
        a = self.arch
        b, s = tokens.shape
        rep = a.num_attention_heads // a.num_query_groups
        end = start + s
        x = F.embedding(tokens, self.embedding)  # [B, s, h]
        for layer, (k_cache, v_cache) in zip(self.layers, cache):
            h = self._norm(x, layer["ln1_w"], layer["ln1_b"])
            qkv = layer["qkv"](h).view(b, s, a.num_query_groups, rep + 2, a.head_dim)
            q = qkv[:, :, :, :rep].reshape(b, s, a.num_attention_heads, a.head_dim)
            k, v = qkv[:, :, :, rep], qkv[:, :, :, rep + 1]  # [B, s, g, d]
            q, k = self._rope(q, positions), self._rope(k, positions)
            k_cache[:, :, start:end] = k.transpose(1, 2)
            v_cache[:, :, start:end] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_cache[:, :, :end],
                v_cache[:, :, :end],
                attn_mask=mask,
                scale=a.softmax_scale,
                enable_gqa=True,
            )  # [B, np, s, d]
            x = x + layer["proj"](out.transpose(1, 2).reshape(b, s, -1))
            h = self._norm(x, layer["ln2_w"], layer["ln2_b"])
            if "experts" in layer:
                out, chosen = self._moe(layer, h, generator)
                x = x + out
                if routes is not None:
                    routes.append(chosen)
            else:
                x = x + layer["fc2"](self._act(layer["fc1"](h)))
                if routes is not None:
                    routes.append(None)
        x = self._norm(x, self.final_w, self.final_b)
        return self.output(x).float()
