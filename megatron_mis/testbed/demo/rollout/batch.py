"""``RolloutBatch``: the sampled responses, the engine's log-probs and (MoE) its routes."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RolloutBatch"]


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
        routed_experts: MoE models only — per sequence ``[P_n + R_n - 1, num_layers, topk]``
            expert ids in the compact dtype (:func:`megatron_mis.routing.compact_route_dtype`), the
            layout SGLang returns in ``meta_info["routed_experts"]``: row ``p`` holds, for every
            decoder layer (global id), the experts that processed token ``p`` (the one that predicts
            token ``p + 1``); the last token (sampled, never fed back) has no row. Columns of dense
            layers hold spread filler ids (never replayed: those layers have no router).
        moe_layers: the global ids of the MoE layers (the columns that are real routes).
        num_experts: routed experts per MoE layer (``None`` for a dense model).
        support: with ``record_support`` only — per sequence, per response token, the sorted ids
            top-k / top-p kept (``[]``: no truncation at that token); what the trainer replays.
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    finished: torch.Tensor
    precision: str
    true_on_policy: bool = False
    slot_length: int | None = None
    micro_batch_size: int | None = None
    routed_experts: list[torch.Tensor] | None = None
    moe_layers: tuple[int, ...] = ()
    num_experts: int | None = None
    support: list[list[list[int]]] | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.prompts)

    @classmethod
    def concat(cls, batches: "list[RolloutBatch]") -> "RolloutBatch":
        """The sequences of ``batches`` in order, as one batch (the fast path's batches of one
        engine configuration: same precision, MoE layout and support recording)."""
        first = batches[0]
        for b in batches[1:]:
            if (b.precision, b.true_on_policy, b.moe_layers, b.num_experts) != (
                    first.precision, first.true_on_policy, first.moe_layers, first.num_experts):
                raise ValueError("RolloutBatch.concat: the batches come from different engine configurations")
            if (b.routed_experts is None) != (first.routed_experts is None) or (b.support is None) != (first.support is None):
                raise ValueError("RolloutBatch.concat: some batches carry routes or supports and others do not")
        if first.true_on_policy:
            raise ValueError("RolloutBatch.concat: an aligned (true on-policy) batch's slots belong to its micro-batches")
        return cls(
            prompts=[x for b in batches for x in b.prompts],
            responses=[x for b in batches for x in b.responses],
            rollout_log_probs=[x for b in batches for x in b.rollout_log_probs],
            finished=torch.cat([b.finished for b in batches]),
            precision=first.precision,
            routed_experts=None if first.routed_experts is None else [x for b in batches for x in b.routed_experts],
            moe_layers=first.moe_layers,
            num_experts=first.num_experts,
            support=None if first.support is None else [x for b in batches for x in b.support],
        )

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


    def sglang_meta_info(self, i: int) -> dict[str, Any]:
        """Sequence ``i``'s routes as an SGLang ``/generate`` response carries them
        (``meta_info["routed_experts"]``: base64 of the row-major int32 array,
        ``routed_experts_dtype`` naming it), for :func:`megatron_mis.routing.decode_routed_experts`."""
        if self.routed_experts is None:
            raise ValueError("this batch has no routes (a dense model)")
        raw = self.routed_experts[i].to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
        return {"routed_experts": base64.b64encode(raw).decode("ascii"), "routed_experts_dtype": "int32"}
