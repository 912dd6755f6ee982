"""``RolloutConfig``: how the rollout engine samples and which numeric path it takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_mis.config.base import ConfigBase, doc

__all__ = ["Precision", "RolloutConfig", "DTYPES"]

Precision = Literal["fp32", "bf16", "fp16", "int8", "int4"]
#: the activation dtype of each numeric path (int8 / int4: dequantised float32 matmuls)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32, "int4": torch.float32}


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
    logprobs: Literal["raw", "processed"] = doc(
        "raw",
        "Which log-probs are recorded with top_k / top_p: raw, those of softmax(logits / temperature) before "
        "truncation (SGLang's default); processed, those of the truncated, renormalised distribution the "
        "tokens were drawn from.",
    )
    record_support: bool = doc(
        False,
        "With top_k / top_p: also record, for every response token, the ids the truncation kept (the "
        "support it was drawn from), so that the trainer can replay the truncation "
        "(megatron_mis.parallel.tp_logprobs.TokenSupport; slime's top-p replay).",
    )
    router_noise: float = doc(
        0.0,
        "MoE, fast path: before each router's top-k, add Gaussian noise of this many standard deviations of the "
        "token's router logits (over its experts), drawn from the sampling generator, so expert choices near a "
        "tie flip against the trainer's noiseless router at a rate that grows with it (a dose for routing "
        "mismatch). 0: off. score() has no random source and applies none.",
    )
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
        if not 0.0 <= self.router_noise <= 10.0:
            out.append(f"router_noise={self.router_noise!r} must lie in [0, 10] (standard deviations of the router logits)")
        if self.router_noise > 0 and self.true_on_policy:
            out.append("router_noise with true_on_policy: the aligned path is the trainer's own forward, noiseless by design")
        if not self.temperature > 0:
            out.append(f"temperature={self.temperature!r} must be > 0")
        if self.top_k < 0:
            out.append(f"top_k={self.top_k!r} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must lie in (0, 1]")
        if self.logprobs not in ("raw", "processed"):
            out.append(f"logprobs={self.logprobs!r} must be 'raw' or 'processed'")
        if self.true_on_policy and self.logprobs == "processed" and (self.top_k or self.top_p < 1):
            out.append("logprobs='processed' with true_on_policy: the aligned path records the trainer's (raw) log-probs")
        if self.true_on_policy and self.precision != "fp32":
            out.append(
                f"true_on_policy=True needs precision='fp32' (the trainer's dtype), got {self.precision!r}"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            out.append(f"micro_batch_size={self.micro_batch_size!r} must be >= 1 or null")
        if self.record_support and self.true_on_policy:
            out.append("record_support with true_on_policy: the aligned path samples untruncated log-probs; nothing to replay")
        return out

    def _warnings(self) -> list[str]:
        out = []
        if self.micro_batch_size is not None and not self.true_on_policy:
            out.append("micro_batch_size only shapes the true-on-policy path; it has no effect with true_on_policy=False")
        if self.record_support and not (self.top_k or self.top_p < 1):
            out.append("record_support without top_k / top_p: every token's support is the whole vocabulary (recorded as empty)")
        if self.true_on_policy and (self.top_k or self.top_p < 1):
            out.append(
                "top_k / top_p with true_on_policy: tokens are drawn from the filtered distribution while the "
                "(bitwise-equal) log-probs are those of the unfiltered one, as in SGLang"
            )
        return out

