"""Weight sync into the rollout engine: the architecture it mirrors, the full float32 weights of
a (TP / PP sharded) GPTModel, per-channel weight-only quantisation, and :func:`layer_tensors`, the
one reader of Megatron's parameter names that both numeric paths use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "ModelArch",
    "RolloutWeights",
    "weights_from_megatron",
    "quantize_int8_per_channel",
    "quantize_int4_per_channel",
    "layer_tensors",
]


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
    #: MoE: routed experts per MoE layer (None: a dense model), experts per token, the global ids
    #: of the MoE layers (the others are dense) and the experts' MLP width
    num_moe_experts: int | None = None
    moe_router_topk: int = 0
    moe_layers: tuple[int, ...] = ()
    moe_ffn_hidden_size: int | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)


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
    moe = _moe_arch(model, problems)
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
        **moe,
    )


def _moe_arch(model: Any, problems: list[str]) -> dict[str, Any]:
    """The MoE fields of :class:`ModelArch` (empty for a dense model); what the engine cannot
    mirror is appended to ``problems``. Supported: Megatron's TopKRouter with softmax scores
    over the top-k logits (``moe_router_pre_softmax`` False, no expert bias, no groups, no
    scaling), ``SequentialMLP`` experts without biases, no shared experts, no capacity drop."""
    cfg = model.config
    if not getattr(cfg, "num_moe_experts", None):
        return {}
    from megatron_mis.routing.slicing import moe_layer_pattern

    checks = (
        ("moe_router_score_function", "softmax"),
        ("moe_router_pre_softmax", False),
        ("moe_router_num_groups", None),
        ("moe_router_topk_scaling_factor", None),
        ("moe_router_enable_expert_bias", False),
        ("moe_expert_capacity_factor", None),
        ("moe_shared_expert_intermediate_size", None),
        ("moe_input_jitter_eps", None),
        ("moe_apply_probs_on_input", False),
        ("moe_grouped_gemm", False),
        ("add_bias_linear", False),
    )
    for name, want in checks:
        if getattr(cfg, name, want) != want:
            problems.append(f"MoE: {name}={getattr(cfg, name)!r} is not supported (need {want!r})")
    if getattr(cfg, "expert_model_parallel_size", 1) != 1 or (getattr(cfg, "expert_tensor_parallel_size", None) or 1) != 1:
        problems.append("MoE: expert model / expert tensor parallelism is not supported (sizes must be 1)")
    if cfg.tensor_model_parallel_size != 1:
        problems.append(f"MoE: tensor_model_parallel_size={cfg.tensor_model_parallel_size}; the MoE path gathers no shards (need 1)")
    pattern = moe_layer_pattern(cfg.num_layers, cfg.moe_layer_freq)
    return dict(
        num_moe_experts=int(cfg.num_moe_experts),
        moe_router_topk=int(cfg.moe_router_topk),
        moe_layers=tuple(i for i, is_moe in enumerate(pattern) if is_moe),
        moe_ffn_hidden_size=int(cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size),
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



# ------------------------------------------------------------------------- per-layer tensors
_ATTENTION = {
    "ln1_w": "input_layernorm.weight",
    "ln1_b": "input_layernorm.bias",
    "qkv_w": "self_attention.linear_qkv.weight",
    "qkv_b": "self_attention.linear_qkv.bias",
    "proj_w": "self_attention.linear_proj.weight",
    "proj_b": "self_attention.linear_proj.bias",
    "ln2_w": "pre_mlp_layernorm.weight",
    "ln2_b": "pre_mlp_layernorm.bias",
}
_DENSE_MLP = {
    "fc1_w": "mlp.linear_fc1.weight",
    "fc1_b": "mlp.linear_fc1.bias",
    "fc2_w": "mlp.linear_fc2.weight",
    "fc2_b": "mlp.linear_fc2.bias",
}


def layer_tensors(weights: RolloutWeights, i: int) -> dict[str, Any]:
    """Layer ``i``'s tensors under short role names (``None`` where the model has none): the
    attention block (``ln1_w/b``, ``qkv_w/b``, ``proj_w/b``, ``ln2_w/b``) and either the dense
    MLP (``fc1_w/b``, ``fc2_w/b``) or, for an MoE layer, ``router_w [E, h]`` and ``experts``:
    ``E`` dicts of ``fc1_w [f, h]`` / ``fc2_w [h, f]``. The one place both numeric paths read
    Megatron's parameter names."""
    out: dict[str, Any] = {role: weights.layer(i, name) for role, name in _ATTENTION.items()}
    a = weights.arch
    if a.is_moe and i in a.moe_layers:
        out["router_w"] = weights.layer(i, "mlp.router.weight")
        out["experts"] = [
            {
                "fc1_w": weights.layer(i, f"mlp.experts.local_experts.{e}.linear_fc1.weight"),
                "fc2_w": weights.layer(i, f"mlp.experts.local_experts.{e}.linear_fc2.weight"),
            }
            for e in range(int(a.num_moe_experts))
        ]
        missing = [e for e, ex in enumerate(out["experts"]) if ex["fc1_w"] is None or ex["fc2_w"] is None]
        if out["router_w"] is None or missing:
            raise ValueError(
                f"layer {i}: MoE weights missing (router: {out['router_w'] is not None}, experts without "
                f"weights: {missing[:4]}); only SequentialMLP experts (moe_grouped_gemm=False) are supported"
            )
    else:
        out.update({role: weights.layer(i, name) for role, name in _DENSE_MLP.items()})
    return out
