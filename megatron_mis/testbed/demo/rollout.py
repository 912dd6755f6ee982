"""A rollout engine separate from the trainer: pure-torch inference for the architecture of a
Megatron-Core GPTModel (local layer spec), with its own numeric paths.

The trainer (Megatron-Core, float32) and this engine share weights, not code:

- **fast path** (``precision`` = ``fp32`` / ``bf16`` / ``fp16`` / ``int8`` / ``int4``): batched
  autoregressive sampling with a KV cache, batch-first layout, fused ``F.linear``, grouped-query
  SDPA, RMSNorm accumulated in float32 and cast back, rotary embedding from the positions.
  ``bf16`` / ``fp16`` keep weights and activations in that dtype; ``int8`` / ``int4`` quantise
  every linear weight per output channel (symmetric, weight-only; 255 / 15 levels) and multiplies with the dequantised
  weight in float32. Log-probs are recorded the way SGLang returns them: the log-softmax, in
  float32, of ``logits / temperature`` at the sampled token, from the same forward that sampled
  it (before top-k / top-p filtering). The prefill runs the prompt as one block and every new
  token is a ``[B, 1]`` step, so even in fp32 the matmul shapes (and hence reduction orders)
  differ from the trainer's full-sequence forward: a small, real mismatch.
- **true-on-policy path** (``true_on_policy=True``, seed 000's first solution at this scale):
  every decoding step runs a forward that is the trainer's, operation for operation — the same
  ``[s, b, h]`` layout, ``torch.matmul`` per tensor-parallel shard with the shard-sum of the
  row-parallel all-reduce, the same rotary table, the same packed SDPA kernel, and the
  trainer's own log-prob arithmetic (:func:`megatron_mis.parallel.tp_logprobs.
  log_probs_from_shards`, the code of ``vocab_parallel_log_probs``) — over the SAME shapes as
  the trainer's recompute: all sequences packed in fixed slots of ``max prompt + max_new_tokens``
  tokens, tokens not yet generated filled with padding (causal attention never lets position
  ``t`` see them). Identical kernels on identical shapes give identical reduction orders, so the
  recorded log-probs equal the trainer's bit for bit. The price is the KV cache: each new token
  costs a forward of the whole batch. The trainer must recompute with
  ``pack_sequences(batch.sequences, slot_length=batch.slot_length)`` in micro-batches of
  ``batch.micro_batch_size`` sequences, with the same intra-op thread count.

Weights come from the GPTModel (:func:`weights_from_megatron`): under tensor parallelism the
shards are all-gathered over the explicit TP group and the engine runs unsharded on one
process; Megatron's fused QKV layout (per query group: the group's query heads, then one key
and one value head), RMSNorm / LayerNorm, non-interleaved rotary embedding, GeLU / SwiGLU MLP
and untied output layer are handled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from megatron_mis.config.base import ConfigBase, doc
from megatron_mis.parallel.tp_logprobs import log_probs_from_shards, log_softmax_from_shards

__all__ = [
    "Precision",
    "RolloutConfig",
    "ModelArch",
    "RolloutWeights",
    "RolloutBatch",
    "RolloutEngine",
    "weights_from_megatron",
    "quantize_int8_per_channel",
    "quantize_int4_per_channel",
]

Precision = Literal["fp32", "bf16", "fp16", "int8", "int4"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32, "int4": torch.float32}


@dataclass(kw_only=True, slots=True)
class RolloutConfig(ConfigBase):
    """How the rollout engine samples and which numeric path it takes."""

    precision: Precision = doc(
        "bf16",
        "Numeric path of the fast engine: fp32, bf16 / fp16 (weights and activations in that dtype, "
        "log-softmax in fp32), int8 / int4 (per-channel weight-only quantisation, dequantised fp32 matmul).",
    )
    max_new_tokens: int = doc(16, "Most tokens generated per prompt.")
    temperature: float = doc(1.0, "Sampling temperature (> 0); log-probs are those of logits / temperature.")
    top_k: int = doc(0, "Sample among the k most likely tokens (0: off).")
    top_p: float = doc(1.0, "Nucleus sampling: smallest set with probability >= top_p (1: off).")
    eos_token_id: int | None = doc(None, "Token that ends a response (kept in it); null: always max_new_tokens.")
    pad_token_id: int = doc(0, "Token written into padding and not-yet-generated positions.")
    true_on_policy: bool = doc(
        False,
        "Sample through the trainer's exact kernels and shapes so rollout log-probs equal the trainer's "
        "bit for bit (needs precision fp32; costs a full-batch forward per generated token).",
    )
    micro_batch_size: int | None = doc(
        None,
        "true_on_policy only: sequences per trainer forward, reproduced by the aligned path; null: the "
        "whole rollout batch in one forward.",
    )

    def _check(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens={self.max_new_tokens!r} must be >= 1")
        if not self.temperature > 0:
            out.append(f"temperature={self.temperature!r} must be > 0")
        if self.top_k < 0:
            out.append(f"top_k={self.top_k!r} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must lie in (0, 1]")
        if self.true_on_policy and self.precision != "fp32":
            out.append(
                f"true_on_policy=True needs precision='fp32' (the trainer's dtype), got {self.precision!r}"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            out.append(f"micro_batch_size={self.micro_batch_size!r} must be >= 1 or null")
        return out

    def _warnings(self) -> list[str]:
        out = []
        if self.micro_batch_size is not None and not self.true_on_policy:
            out.append("micro_batch_size only shapes the true-on-policy path; it has no effect with true_on_policy=False")
        if self.true_on_policy and (self.top_k or self.top_p < 1):
            out.append(
                "top_k / top_p with true_on_policy: tokens are drawn from the filtered distribution while the "
                "(bitwise-equal) log-probs are those of the unfiltered one, as in SGLang"
            )
        return out


# --------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class ModelArch:
    """What the engine needs to know about the GPTModel besides its tensors."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    normalization: Literal["RMSNorm", "LayerNorm"]
    norm_eps: float
    activation: Literal["gelu", "silu"]
    gated_linear_unit: bool
    softmax_scale: float | None
    tp_size: int


@dataclass
class RolloutWeights:
    """Full (unsharded) float32 weights under Megatron's parameter names, plus the rotary
    ``inv_freq [head_dim*rotary_percent/2]`` and the architecture."""

    arch: ModelArch
    tensors: dict[str, torch.Tensor]
    inv_freq: torch.Tensor

    def layer(self, i: int, name: str) -> torch.Tensor | None:
        return self.tensors.get(f"decoder.layers.{i}.{name}")

    def output_weight(self) -> torch.Tensor:
        w = self.tensors.get("output_layer.weight")
        return self.tensors["embedding.word_embeddings.weight"] if w is None else w


def _activation_name(fn: Any) -> str:
    if fn is F.gelu:
        return "gelu"
    if fn is F.silu:
        return "silu"
    raise ValueError(f"rollout engine: unsupported MLP activation {fn!r}; supported: F.gelu, F.silu")


def _arch_from_model(model: Any, tp_size: int, pp_size: int = 1) -> ModelArch:
    cfg = model.config
    problems = []
    if getattr(cfg, "num_moe_experts", None):
        problems.append("MoE layers (num_moe_experts) are not supported by the rollout engine")
    if getattr(model, "position_embedding_type", "rope") != "rope":
        problems.append(f"position_embedding_type={model.position_embedding_type!r}; only 'rope' is supported")
    if type(getattr(model, "rotary_pos_emb", None)).__name__ != "RotaryEmbedding":
        problems.append("only the plain RotaryEmbedding is supported (no YaRN / multimodal rope)")
    elif getattr(model.rotary_pos_emb, "seq_len_interpolation_factor", None) is not None:
        problems.append("rotary seq_len_interpolation_factor is not supported")
    for flag in ("rotary_interleaved", "qk_layernorm", "multi_latent_attention", "attention_output_gate",
                 "apply_residual_connection_post_layernorm", "sequence_parallel"):
        if getattr(cfg, flag, False):
            problems.append(f"{flag}=True is not supported")
    if getattr(cfg, "pipeline_model_parallel_size", 1) != pp_size:
        problems.append(
            f"pipeline_model_parallel_size={cfg.pipeline_model_parallel_size} but the pipeline group given has "
            f"{pp_size} rank(s): pass pp_group=parallel_state.get_pipeline_model_parallel_group()"
        )
    if getattr(cfg, "virtual_pipeline_model_parallel_size", None):
        problems.append("virtual pipeline stages (virtual_pipeline_model_parallel_size) are not supported")
    if getattr(cfg, "activation_func_clamp_value", None) is not None or getattr(cfg, "glu_linear_offset", 0.0):
        problems.append("activation_func_clamp_value / glu_linear_offset are not supported")
    if cfg.normalization not in ("RMSNorm", "LayerNorm"):
        problems.append(f"normalization={cfg.normalization!r}; supported: RMSNorm, LayerNorm")
    if problems:
        raise ValueError("rollout engine cannot mirror this GPTModel: " + "; ".join(problems))
    return ModelArch(
        vocab_size=int(model.vocab_size),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        norm_eps=float(cfg.layernorm_epsilon),
        activation=_activation_name(cfg.activation_func),
        gated_linear_unit=bool(cfg.gated_linear_unit),
        softmax_scale=cfg.softmax_scale,
        tp_size=tp_size,
    )


def _global_layer_names(model: Any) -> dict[str, str]:
    """``decoder.layers.{local}.`` -> ``decoder.layers.{global}.`` prefixes of this pipeline stage
    (Megatron numbers a stage's layers from 0; ``layer_number`` is global and 1-based)."""
    out = {}
    for i, layer in enumerate(getattr(getattr(model, "decoder", None), "layers", [])):
        out[f"decoder.layers.{i}."] = f"decoder.layers.{int(layer.layer_number) - 1}."
    return out


@torch.no_grad()
def weights_from_megatron(model: Any, *, tp_group: Any = None, pp_group: Any = None) -> RolloutWeights:
    """Copy a GPTModel's weights into full float32 tensors (a weight sync, as slime's
    ``update_weights``).

    Args:
        model: the (unwrapped) GPTModel (stage) of this rank.
        tp_group: the tensor-parallel group (explicit). Every TP rank must call this; each gets
            the full weights.
        pp_group: the pipeline-parallel group when the model is split into stages (explicit;
            ``None``: one stage). Every stage must call this; each gets all layers.

    Collectives: one ``all_gather`` over ``tp_group`` per tensor-parallel parameter (none with
    TP = 1), then one ``all_gather_object`` of the stage's tensors over ``pp_group`` (none with
    PP = 1). No gradients.
    """
    import torch.distributed as dist

    tp = 1 if tp_group is None else tp_group.size()
    pp = 1 if pp_group is None else pp_group.size()
    arch = _arch_from_model(model, tp, pp)
    rename = _global_layer_names(model) if pp > 1 else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        data = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(parts, data.contiguous(), group=tp_group)
            dim = p.partition_dim
            if arch.gated_linear_unit and ".mlp.linear_fc1." in name:
                # each shard is [gate_r; up_r]: regroup to [gate; up] of the full layer
                halves = [q.chunk(2, dim=dim) for q in parts]
                data = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
            else:
                data = torch.cat(parts, dim=dim)
        for local, glob in rename.items():
            if name.startswith(local):
                name = glob + name[len(local):]
                break
        tensors[name] = data.to(dtype=torch.float32, device="cpu").clone().contiguous()
    if pp > 1:
        stages: list[Any] = [None] * pp
        dist.all_gather_object(stages, tensors, group=pp_group)
        tensors = {}
        for stage in stages:
            overlap = set(tensors) & set(stage)
            if overlap:
                raise ValueError(f"pipeline stages hold the same parameters {sorted(overlap)[:4]} (tied embeddings are not supported)")
            tensors.update(stage)
    inv_freq = model.rotary_pos_emb.inv_freq.detach().to(device="cpu").clone()
    return RolloutWeights(arch=arch, tensors=tensors, inv_freq=inv_freq)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantisation of ``weight [out, in]``.

    Returns ``(q [out, in] int8, scale [out] float32)`` with ``weight ~ q * scale[:, None]``;
    an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel 4-bit quantisation of ``weight [out, in]`` (levels -7 .. 7,
    what weight-only W4 rollout kernels store; held in an int8 tensor here).

    Returns ``(q [out, in] int8 in [-7, 7], scale [out] float32)`` with ``weight ~ q * scale[:, None]``;
    an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-7, 7).to(torch.int8)
    return q, scale


# ----------------------------------------------------------------------------- batch type
@dataclass
class RolloutBatch:
    """Sampled responses and the engine's log-probs.

    Attributes:
        prompts: ``N`` int64 ``[P_n]`` prompt tokens.
        responses: ``N`` int64 ``[R_n]`` generated tokens (an EOS token is kept).
        rollout_log_probs: ``N`` float32 ``[R_n]`` engine log-probs of the response tokens.
        finished: ``[N]`` bool, the response ended with EOS (else it hit ``max_new_tokens``).
        precision: the numeric path that produced it.
        true_on_policy: produced by the aligned path.
        slot_length: aligned path only — the per-sequence slot the trainer must pack with.
        micro_batch_size: aligned path only — sequences per trainer forward.
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    finished: torch.Tensor
    precision: str
    true_on_policy: bool = False
    slot_length: int | None = None
    micro_batch_size: int | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.prompts)

    @property
    def sequences(self) -> list[torch.Tensor]:
        """``N`` int64 ``[P_n + R_n]`` prompt + response."""
        return [torch.cat([p, r]) for p, r in zip(self.prompts, self.responses)]

    @property
    def total_lengths(self) -> torch.Tensor:
        return torch.tensor([p.numel() + r.numel() for p, r in zip(self.prompts, self.responses)], dtype=torch.long)

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([r.numel() for r in self.responses], dtype=torch.long)

    def micro_batches(self) -> list[range]:
        """Index ranges of the trainer micro-batches the aligned path reproduced (one range for
        the fast path)."""
        size = self.micro_batch_size or self.num_sequences
        return [range(i, min(i + size, self.num_sequences)) for i in range(0, self.num_sequences, size)]


# ------------------------------------------------------------------------------ fast path
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Linear:
    """``y = x W^T + b`` in the engine's numeric path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> None:
        dtype = _DTYPES[precision]
        if precision in ("int8", "int4"):
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

    def __init__(self, weights: RolloutWeights, precision: str) -> None:
        a = weights.arch
        self.arch, self.precision = a, precision
        self.dtype = _DTYPES[precision]
        self.embedding = weights.tensors["embedding.word_embeddings.weight"].to(self.dtype)
        self.inv_freq = weights.inv_freq.float()
        self.layers = []
        for i in range(a.num_layers):
            L = lambda n: weights.layer(i, n)  # noqa: E731
            self.layers.append(
                dict(
                    ln1_w=L("input_layernorm.weight"),
                    ln1_b=L("input_layernorm.bias"),
                    qkv=_Linear(L("self_attention.linear_qkv.weight"), L("self_attention.linear_qkv.bias"), precision),
                    proj=_Linear(L("self_attention.linear_proj.weight"), L("self_attention.linear_proj.bias"), precision),
                    ln2_w=L("pre_mlp_layernorm.weight"),
                    ln2_b=L("pre_mlp_layernorm.bias"),
                    fc1=_Linear(L("mlp.linear_fc1.weight"), L("mlp.linear_fc1.bias"), precision),
                    fc2=_Linear(L("mlp.linear_fc2.weight"), L("mlp.linear_fc2.bias"), precision),
                )
            )
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
    ) -> torch.Tensor:
        """``tokens / positions [B, s]`` written at cache columns ``[start, start+s)``;
        ``mask [B, 1, s, start+s]`` bool (True = attend). Returns float32 logits ``[B, s, V]``."""
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
            inter = layer["fc1"](h)
            act = F.gelu if a.activation == "gelu" else F.silu
            if a.gated_linear_unit:
                gate, up = inter.chunk(2, dim=-1)
                inter = act(gate) * up
            else:
                inter = act(inter)
            x = x + layer["fc2"](inter)
        x = self._norm(x, self.final_w, self.final_b)
        return self.output(x).float()


# ---------------------------------------------------------------------- true-on-policy path
class _AlignedModel:
    """The trainer's forward, op for op (Megatron-Core GPTModel, local spec with
    :class:`~megatron_mis.testbed.models.attention.SDPACoreAttention`, packed thd, CP = 1), with the
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
        self.arch, self.tp = a, a.tp_size
        t = weights.tensors
        self.embedding = t["embedding.word_embeddings.weight"]
        self.inv_freq = weights.inv_freq.float()
        self.layers = []
        for i in range(a.num_layers):
            L = lambda n: weights.layer(i, n)  # noqa: E731
            self.layers.append(
                dict(
                    ln1_w=L("input_layernorm.weight"),
                    ln1_b=L("input_layernorm.bias"),
                    qkv_w=self._split(L("self_attention.linear_qkv.weight"), 0),
                    qkv_b=self._split(L("self_attention.linear_qkv.bias"), 0),
                    proj_w=self._split(L("self_attention.linear_proj.weight"), 1),
                    proj_b=L("self_attention.linear_proj.bias"),
                    ln2_w=L("pre_mlp_layernorm.weight"),
                    ln2_b=L("pre_mlp_layernorm.bias"),
                    fc1_w=self._split(L("mlp.linear_fc1.weight"), 0, gated=a.gated_linear_unit),
                    fc1_b=self._split(L("mlp.linear_fc1.bias"), 0, gated=a.gated_linear_unit),
                    fc2_w=self._split(L("mlp.linear_fc2.weight"), 1),
                    fc2_b=L("mlp.linear_fc2.bias"),
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
        from megatron_mis.testbed.models.attention import sdpa_packed

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


# ------------------------------------------------------------------------------- sampling
def _filter(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude from ``logp [B, V]``."""
    if top_k and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_lp.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp


def _sample(logp: torch.Tensor, config: RolloutConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``logp [B, V]`` float32 -> ``[B]`` int64 sampled ids."""
    probs = _filter(logp, config.top_k, config.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _as_prompt(p: Any, vocab: int) -> torch.Tensor:
    t = (p if isinstance(p, torch.Tensor) else torch.as_tensor(p)).detach().to("cpu", torch.long).flatten()
    if t.numel() == 0:
        raise ValueError("prompts must hold at least one token")
    if int(t.min()) < 0 or int(t.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got [{int(t.min())}, {int(t.max())}]")
    return t


# --------------------------------------------------------------------------------- engine
class RolloutEngine:
    """Sample responses and record rollout log-probs; see the module docstring.

    Args:
        weights: from :func:`weights_from_megatron` (refresh with :meth:`load_weights` after every
            optimiser step).
        config: :class:`RolloutConfig`.
    """

    def __init__(self, weights: RolloutWeights, config: RolloutConfig) -> None:
        self.config = config
        self.load_weights(weights)

    @classmethod
    def from_megatron(cls, model: Any, config: RolloutConfig, *, tp_group: Any = None, pp_group: Any = None) -> "RolloutEngine":
        """Build from a GPTModel (collectives over ``tp_group`` / ``pp_group``, see
        :func:`weights_from_megatron`)."""
        return cls(weights_from_megatron(model, tp_group=tp_group, pp_group=pp_group), config)

    def load_weights(self, weights: RolloutWeights) -> None:
        self.weights = weights
        self.arch = weights.arch
        if self.config.true_on_policy:
            self._model: Any = _AlignedModel(weights)
        else:
            self._model = _FastModel(weights, self.config.precision)

    # ------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Any], *, generator: torch.Generator | None = None) -> RolloutBatch:
        """Sample one response per prompt.

        Args:
            prompts: ``N`` token sequences (1-D int tensors or lists), lengths may differ.
            generator: the random source for sampling (reproducible runs).
        """
        cfg = self.config
        ps = [_as_prompt(p, self.arch.vocab_size) for p in prompts]
        if not ps:
            raise ValueError("generate needs at least one prompt")
        if cfg.eos_token_id is not None and not 0 <= cfg.eos_token_id < self.arch.vocab_size:
            raise ValueError(f"eos_token_id={cfg.eos_token_id} outside the vocabulary [0, {self.arch.vocab_size})")
        if cfg.true_on_policy:
            return self._generate_aligned(ps, generator)
        return self._generate_fast(ps, generator)

    def _step_bookkeeping(self, tok, logp_tok, alive, out_tokens, out_logps, finished) -> None:
        cfg = self.config
        for i in torch.nonzero(alive).flatten().tolist():
            out_tokens[i].append(int(tok[i]))
            out_logps[i].append(logp_tok[i])
        if cfg.eos_token_id is not None:
            hit = alive & (tok == cfg.eos_token_id)
            finished |= hit
            alive &= ~hit

    def _result(self, ps, out_tokens, out_logps, finished, **extra) -> RolloutBatch:
        return RolloutBatch(
            prompts=ps,
            responses=[torch.tensor(t, dtype=torch.long) for t in out_tokens],
            rollout_log_probs=[torch.stack(lp).float() if lp else torch.zeros(0) for lp in out_logps],
            finished=finished,
            precision=self.config.precision,
            true_on_policy=self.config.true_on_policy,
            **extra,
        )

    def _generate_fast(self, ps: list[torch.Tensor], generator) -> RolloutBatch:
        cfg, model = self.config, self._model
        n = len(ps)
        lengths = torch.tensor([p.numel() for p in ps])
        p_max = int(lengths.max())
        pad = p_max - lengths  # left padding per row
        total = p_max + cfg.max_new_tokens
        tokens = torch.full((n, p_max), cfg.pad_token_id, dtype=torch.long)
        for i, p in enumerate(ps):
            tokens[i, int(pad[i]) :] = p
        cols = torch.arange(total)
        key_ok = cols[None, :] >= pad[:, None]  # [N, total]
        positions = (torch.arange(p_max)[None, :] - pad[:, None]).clamp_min(0)
        causal = cols[None, :p_max] <= cols[:p_max, None]  # [P, P]
        mask = (causal[None] & key_ok[:, None, :p_max]) | torch.eye(p_max, dtype=torch.bool)[None]
        cache = model.new_cache(n, total)
        logits = model.forward(tokens, positions, cache, 0, mask[:, None])[:, -1]  # [N, V]
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
        alive = torch.ones(n, dtype=torch.bool)
        finished = torch.zeros(n, dtype=torch.bool)
        for step in range(cfg.max_new_tokens):
            logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)  # SGLang: fp32 log-softmax
            tok = _sample(logp, cfg, generator)
            logp_tok = logp.gather(-1, tok[:, None]).squeeze(-1)
            self._step_bookkeeping(tok, logp_tok, alive, out_tokens, out_logps, finished)
            if not bool(alive.any()) or step == cfg.max_new_tokens - 1:
                break
            col = p_max + step
            feed = torch.where(alive, tok, torch.full_like(tok, cfg.pad_token_id))
            pos = (lengths + step)[:, None]
            step_mask = key_ok[:, None, None, : col + 1]
            logits = model.forward(feed[:, None], pos, cache, col, step_mask)[:, -1]
        return self._result(ps, out_tokens, out_logps, finished)

    def _generate_aligned(self, ps: list[torch.Tensor], generator) -> RolloutBatch:
        cfg, model = self.config, self._model
        n = len(ps)
        slot = max(p.numel() for p in ps) + cfg.max_new_tokens
        mbs = cfg.micro_batch_size or n
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
        finished = torch.zeros(n, dtype=torch.bool)
        for lo in range(0, n, mbs):
            idx = list(range(lo, min(lo + mbs, n)))
            b = len(idx)
            grid = torch.full((b, slot), cfg.pad_token_id, dtype=torch.long)
            cur = torch.tensor([ps[i].numel() for i in idx])  # next position to fill
            for j, i in enumerate(idx):
                grid[j, : ps[i].numel()] = ps[i]
            cu = torch.arange(b + 1, dtype=torch.int32) * slot  # the trainer's cu_seqlens_q_padded
            alive = torch.ones(b, dtype=torch.bool)
            fin = torch.zeros(b, dtype=torch.bool)
            toks: list[list[int]] = [[] for _ in range(b)]
            lps: list[list[torch.Tensor]] = [[] for _ in range(b)]
            for _ in range(cfg.max_new_tokens):
                shards = model.forward(grid.view(1, -1), cu, slot)
                rows = torch.arange(b) * slot + cur - 1  # logit positions of the next tokens
                row_shards = [s[0].index_select(0, rows) for s in shards]  # [b, V/tp], as the trainer selects
                tok = _sample(log_softmax_from_shards(row_shards, temperature=cfg.temperature), cfg, generator)
                # recorded through the trainer's own log-prob arithmetic (parallel.tp_logprobs)
                logp_tok = log_probs_from_shards(row_shards, tok, temperature=cfg.temperature)
                took = alive.clone()
                self._step_bookkeeping(tok, logp_tok, alive, toks, lps, fin)
                for j in torch.nonzero(took).flatten().tolist():
                    grid[j, int(cur[j])] = int(tok[j])
                    cur[j] += 1
                if not bool(alive.any()):
                    break
            for j, i in enumerate(idx):
                out_tokens[i], out_logps[i] = toks[j], lps[j]
            finished[idx] = fin
        return self._result(ps, out_tokens, out_logps, finished, slot_length=slot, micro_batch_size=cfg.micro_batch_size)

    # --------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def score(
        self,
        sequences: Sequence[Any],
        response_lengths: Sequence[int] | torch.Tensor,
        *,
        slot_length: int | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced log-probs of the last ``response_lengths[n]`` tokens of each sequence
        through this engine's numeric path: one prefill (fast path) or the trainer's forward in
        slots of ``slot_length`` tokens (true-on-policy path; default the longest sequence).
        Returns ``N`` float32 ``[R_n]``."""
        cfg = self.config
        seqs = [_as_prompt(s, self.arch.vocab_size) for s in sequences]
        resp = [int(r) for r in response_lengths]
        if len(resp) != len(seqs):
            raise ValueError(f"got {len(resp)} response lengths for {len(seqs)} sequences")
        for i, (s, r) in enumerate(zip(seqs, resp)):
            if not 0 <= r <= s.numel() - 1:
                raise ValueError(f"sequence {i}: response_length={r} must lie in [0, {s.numel() - 1}]")
        if cfg.true_on_policy:
            from megatron_mis.parallel.packing import pack_sequences

            slot = slot_length or max(s.numel() for s in seqs)
            out = []
            mbs = cfg.micro_batch_size or len(seqs)
            for lo in range(0, len(seqs), mbs):
                part = seqs[lo : lo + mbs]
                batch = pack_sequences(part, slot_length=slot, pad_token_id=cfg.pad_token_id)
                shards = self._model.forward(batch.tokens, batch.cu_seqlens_padded.to(torch.int32), slot)
                idx = batch.response_index(resp[lo : lo + mbs])
                logp = log_probs_from_shards(
                    [s[0].index_select(0, idx) for s in shards], batch.labels[0][idx], temperature=cfg.temperature
                )
                counts = torch.bincount(batch.sequence_ids[idx], minlength=len(part))[: len(part)]
                out.extend(torch.split(logp, counts.tolist()))
            return out
        model = self._model
        n = len(seqs)
        lengths = torch.tensor([s.numel() for s in seqs])
        s_max = int(lengths.max())
        tokens = torch.full((n, s_max), cfg.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : s.numel()] = s
        positions = torch.arange(s_max)[None, :].expand(n, -1)
        cols = torch.arange(s_max)
        mask = (cols[None, :] <= cols[:, None])[None, None].expand(n, 1, -1, -1)
        cache = model.new_cache(n, s_max)
        logits = model.forward(tokens, positions, cache, 0, mask)
        logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
        out = []
        for i, (s, r) in enumerate(zip(seqs, resp)):
            t = s.numel()
            out.append(logp[i, t - r - 1 : t - 1].gather(-1, s[t - r :, None]).squeeze(-1))
        return out
