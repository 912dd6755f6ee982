"""The micro-batch :class:`~megatron_mis.integrations.megatron_loss.MegatronRLLoss` consumes:
whole packed sequences with full-length per-token tensors, and where their response tokens are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RLMicroBatch", "response_positions"]


def response_positions(cu_seqlens: torch.Tensor, response_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the response tokens of packed sequences are, and which logit predicts each.

    Args:
        cu_seqlens: ``[N+1]`` boundaries of the packed (prompt + response) sequences.
        response_lengths: ``[N]`` response tokens at the end of each sequence (each sequence
            needs at least one prompt token before its response).

    Returns:
        ``(logit_rows [R], target_positions [R])`` long, ``R = sum(response_lengths)``: token
        ``t`` is predicted by the logits at position ``t - 1``.
    """
    cu = cu_seqlens.to(torch.long).cpu()
    resp = torch.as_tensor(response_lengths, dtype=torch.long).cpu()
    totals = cu[1:] - cu[:-1]
    if resp.shape != totals.shape:
        raise ValueError(f"response_lengths has {resp.numel()} entries, expected {totals.numel()} (one per sequence)")
    if bool((resp < 0).any()) or bool((resp > totals - 1).any()):
        bad = torch.nonzero((resp < 0) | (resp > totals - 1)).flatten().tolist()[:8]
        raise ValueError(
            f"response_lengths must lie in [0, total_length - 1] (at least one prompt token), violated by sequence(s) {bad}"
        )
    starts = cu[1:] - resp  # first response token of each sequence
    offsets = torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
    targets = torch.repeat_interleave(starts, resp) + offsets
    return targets - 1, targets


@dataclass(slots=True)
class RLMicroBatch:
    """One micro-batch of whole packed sequences (``thd`` format, micro-batch size 1). Under
    context parallelism every CP rank gets the same micro-batch; the forward step packs this
    rank's share.

    Attributes:
        tokens: ``[S]`` the packed prompt + response tokens of ``N`` sequences.
        cu_seqlens: ``[N+1]`` sequence boundaries in ``tokens``.
        response_lengths: ``[N]`` response tokens at the end of each sequence.
        loss_mask: ``[R]`` over the concatenated responses, ``R = sum(response_lengths)``.
        advantages: ``[R]``.
        rollout_log_probs: ``[R]`` pi_rollout from the rollout engine, or ``None``.
        old_log_probs: ``[R]`` pi_old recomputed by the trainer, or ``None`` (pi_theta detached).
        ref_log_probs: ``[R]`` reference policy, or ``None``.
        rollout_support: the rollout's sampling support per response token (top-p / top-k replay,
            :class:`~megatron_mis.parallel.tp_logprobs.TokenSupport` over the ``[R]`` responses,
            on the host), or ``None``: log-probs over the whole vocabulary.
        slot_length: pad every sequence to this many tokens when packing (the fixed layout the
            true-on-policy rollout path reproduces; context-parallel size 1 only); ``None``:
            sequences are packed back to back (padded to a multiple of ``2cp`` under CP).
        pad_token_id: token written into padding.
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_support: Any = None
    slot_length: int | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        self.response_lengths = torch.as_tensor(self.response_lengths, dtype=torch.long)
        if self.tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D [S] (packed sequences), got shape {tuple(self.tokens.shape)}")
        if self.cu_seqlens.dim() != 1 or int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != self.tokens.numel():
            raise ValueError(f"cu_seqlens must be [N+1] from 0 to len(tokens)={self.tokens.numel()}")
        num_resp = int(self.response_lengths.sum())
        for name in ("loss_mask", "advantages", "rollout_log_probs", "old_log_probs", "ref_log_probs"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 1 or t.numel() != num_resp):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected [{num_resp}] (one per response token, "
                    f"sum of response_lengths)"
                )
        response_positions(self.cu_seqlens, self.response_lengths)  # validates the lengths
        if self.rollout_support is not None:
            from megatron_mis.parallel.tp_logprobs import TokenSupport

            if not isinstance(self.rollout_support, TokenSupport):
                raise ValueError(f"rollout_support must be a TokenSupport, got {type(self.rollout_support).__name__}")
            if self.rollout_support.ids.device.type != "cpu":
                raise ValueError("rollout_support must be on the host (CPU), like the other per-token metadata")
            if self.rollout_support.num_tokens != num_resp:
                raise ValueError(
                    f"rollout_support covers {self.rollout_support.num_tokens} tokens, expected {num_resp} "
                    "(one support per response token)"
                )
        if self.slot_length is not None:
            longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max()) if self.num_sequences else 0
            if self.slot_length < max(longest, 1):
                raise ValueError(f"slot_length={self.slot_length!r} is shorter than the longest sequence ({longest} tokens)")

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def total_lengths(self) -> torch.Tensor:
        """``[N]`` prompt + response lengths."""
        cu = self.cu_seqlens.to(torch.long).cpu()
        return cu[1:] - cu[:-1]

    @property
    def response_cu_seqlens(self) -> torch.Tensor:
        """``[N+1]`` boundaries of the sequences in the ``[R]`` response tensors."""
        return torch.nn.functional.pad(torch.cumsum(self.response_lengths, 0), (1, 0))

    def sequences(self) -> list[torch.Tensor]:
        """``N`` int64 ``[L_n]`` token sequences."""
        cu = self.cu_seqlens.tolist()
        return [self.tokens[a:b] for a, b in zip(cu[:-1], cu[1:])]

    def with_old_log_probs(self, old_log_probs: torch.Tensor | None) -> "RLMicroBatch":
        """A copy with ``old_log_probs`` replaced (e.g. by :meth:`MegatronRLLoss.recompute_log_probs`)."""
        return dataclasses.replace(self, old_log_probs=old_log_probs)


@dataclass
class _LocalView:
    """One micro-batch as this CP rank sees it.

    Attributes:
        pack: this rank's packed model input.
        rows: ``[R_local]`` local positions whose labels are response tokens (``local_response_layout``
            order: per sequence chunk 0, then chunk 1).
        targets: ``[R_local]`` the response token ids predicted at ``rows``.
        full_index: ``[R_local]`` index of every local response token in the full ``[R]`` tensors.
        cu: ``[N+1]`` boundaries of the sequences in the local ``[R_local]`` tensors.
        support: the rollout support of the ``[R_local]`` tokens (host), or ``None``.
    """

    pack: Any
    rows: torch.Tensor
    targets: torch.Tensor
    full_index: torch.Tensor
    cu: torch.Tensor
    support: Any = None
