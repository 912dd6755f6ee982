"""The MIS engine on context-parallel shards: exact, and cheap in communication.

Each CP rank holds pieces of every sequence (see :mod:`megatron_mis.parallel.layout`). Sequence
weights, vetoes, rejections, self-normalisation and sequence metrics need only per-sequence sums,
counts, minima and maxima, so :func:`compute_mis_cp` runs the engine on the local pieces and
exchanges the per-sequence statistics in **one all-gather** over the CP group (``N x 25``
float64 values per rank, whatever the sequence lengths). Every rank then reduces the gathered
statistics in the same rank order, so all CP ranks derive bitwise-identical sequence decisions.

The host needs the modified loss masks at FULL response length on every rank. Sequence-level
rejections are known everywhere after the statistics exchange; token-level rejections (token RS,
token-level IS masking, rejected non-finite tokens) are known only where the token lives, so
when such rejection is configured and ``cp > 1`` one more collective — an all-reduce of a
``uint8`` bit per response token — completes the masks. Nothing else crosses ranks; nothing runs
per sequence.

Gradients: none. The weights and masks are detached; the caller multiplies its local per-token
loss by the local weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import (
    MISResult,
    NormalizationStatistics,
    SequenceStatistics,
    StatsReducer,
    compute_mis,
    normalization_statistics,
)
from megatron_mis.parallel.layout import CPLayout, LocalResponseLayout, local_response_layout
from megatron_mis.parallel.state import GroupView

__all__ = ["CPInputs", "CPMISResult", "cp_stats_reducer", "compute_mis_cp", "cp_normalization_statistics"]


def _all_gather_into(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def cp_stats_reducer(cp: GroupView) -> StatsReducer | None:
    """A reducer that all-gathers per-sequence statistics over ``cp.group`` (one collective) and
    combines them identically on every rank. ``None`` when ``cp.size == 1``.

    All CP ranks of a micro-batch hold the same sequences, so ``N`` agrees across the group; a
    rank holding no token of a sequence contributes zeros / empty extrema and still takes part.
    """
    if cp.size == 1:
        return None

    def reduce(stats: SequenceStatistics) -> SequenceStatistics:
        if stats.num_sequences == 0:  # the same on every rank of the group: nobody communicates
            return stats
        k, e = stats.sums.shape[1], stats.mins.shape[1]
        local = torch.cat([stats.sums, stats.mins, stats.maxs], 1).contiguous()  # [N, k + 2e]
        gathered = local.new_empty((cp.size,) + tuple(local.shape))
        _all_gather_into(gathered.view(cp.size * local.shape[0], local.shape[1]), local, cp.group)
        return SequenceStatistics(
            sums=gathered[..., :k].sum(0),
            mins=gathered[..., k : k + e].amin(0),
            maxs=gathered[..., k + e :].amax(0),
        )

    return reduce


@dataclass
class CPInputs:
    """One micro-batch as a CP rank sees it.

    Attributes:
        train_log_probs: per sequence, this rank's local piece ``[t_i]`` of log pi_train, or
            ``None`` (no recomputed log-probs: pi_train := pi_rollout, every ratio is 1).
        rollout_log_probs: per sequence, this rank's local piece ``[t_i]`` of log pi_rollout.
        loss_masks: per sequence, the FULL response mask ``[R_i]`` (not CP-sliced).
        total_lengths: ``[N]`` prompt + response lengths.
        response_lengths: ``[N]`` response lengths.
        layout: ``"thd"``, ``"bshd"`` or ``"allgather"``.
        max_seq_lens: bshd only, per sequence (or one int).
        local_length: allgather only, tokens per rank of the padded packed stream.
    """

    train_log_probs: Sequence[torch.Tensor] | None
    rollout_log_probs: Sequence[torch.Tensor]
    loss_masks: Sequence[torch.Tensor]
    total_lengths: Sequence[int]
    response_lengths: Sequence[int]
    layout: CPLayout = "thd"
    max_seq_lens: Sequence[int] | int | None = None
    local_length: int | None = None

    def resolve(self, cp: GroupView) -> tuple[LocalResponseLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate and flatten: ``(layout, train [T], rollout [T], local mask [T],
        full mask [R], local->full index [T])``.

        Raises:
            ValueError: naming the sequence whose pieces or masks have the wrong length.
        """
        n = len(self.rollout_log_probs)
        for name, seq in (("loss_masks", self.loss_masks), ("total_lengths", self.total_lengths),
                          ("response_lengths", self.response_lengths)):
            if len(seq) != n:
                raise ValueError(f"got {n} rollout_log_probs but {len(seq)} {name}; one entry per sequence is needed")
        if self.train_log_probs is not None and len(self.train_log_probs) != n:
            raise ValueError(f"got {n} rollout_log_probs but {len(self.train_log_probs)} train_log_probs")
        lay = local_response_layout(
            self.total_lengths, self.response_lengths, cp.size, cp.rank,
            layout=self.layout, max_seq_lens=self.max_seq_lens, local_length=self.local_length,
        )
        expected = lay.local_lengths.tolist()
        for i in range(n):
            got = int(self.rollout_log_probs[i].numel())
            if got != expected[i]:
                raise ValueError(
                    f"sequence {i}: rollout_log_probs has {got} values but CP rank {cp.rank}/{cp.size} "
                    f"({self.layout}) holds {expected[i]} response tokens (total_length="
                    f"{int(self.total_lengths[i])}, response_length={int(self.response_lengths[i])})"
                )
            if self.train_log_probs is not None and self.train_log_probs[i].numel() != got:
                raise ValueError(
                    f"sequence {i}: train_log_probs has {self.train_log_probs[i].numel()} values, "
                    f"rollout_log_probs {got}"
                )
            if int(self.loss_masks[i].numel()) != int(self.response_lengths[i]):
                raise ValueError(
                    f"sequence {i}: loss_mask has {self.loss_masks[i].numel()} values but response_length is "
                    f"{int(self.response_lengths[i])} (masks are full length, not CP-sliced)"
                )
        device = self.rollout_log_probs[0].device if n else torch.device("cpu")
        rollout = _cat(self.rollout_log_probs, device)
        train = rollout if self.train_log_probs is None else _cat(self.train_log_probs, device)
        full_mask = _cat(self.loss_masks, device)
        index = lay.local_to_full_index().to(device)
        local_mask = full_mask.index_select(0, index) if full_mask.numel() else full_mask[:0]
        return lay, train, rollout, local_mask, full_mask, index


def _cat(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, device=device)
    return torch.cat([p.reshape(-1).to(device) for p in parts])


@dataclass
class CPMISResult:
    """:class:`MISResult` of this rank's tokens plus what the hosts need.

    Attributes:
        result: the engine result over the local tokens (weights ``[T_local]`` aligned with the
            host's local ``pg_loss``; ``token_metrics`` likewise).
        modified_masks: per sequence, the FULL-length mask after rejection, identical on every
            CP rank, same dtype as the given mask.
        layout: the local layout used.
        num_collectives: collectives this call ran (for tests and benchmarks).
    """

    result: MISResult
    modified_masks: list[torch.Tensor]
    layout: LocalResponseLayout
    num_collectives: int


def compute_mis_cp(
    inputs: CPInputs,
    config: MISConfig,
    cp: GroupView,
    *,
    global_normalizer: torch.Tensor | float | None = None,
) -> CPMISResult:
    """Run the MIS engine on CP shards.

    Collectives over ``cp.group`` (none when ``cp.size == 1``): one all-gather of the
    per-sequence statistics; plus, only if ``config.token_rejects``, one ``uint8`` all-reduce of
    the full-length rejection bits. Every rank of the CP group must call this with the same
    sequences (their own pieces); ranks holding no token of a sequence still take part.
    """
    lay, train, rollout, local_mask, full_mask, index = inputs.resolve(cp)
    cu = lay.local_cu_seqlens().to(train.device)
    result = compute_mis(
        train, rollout, local_mask, cu, config,
        reduce_stats=cp_stats_reducer(cp), global_normalizer=global_normalizer,
    )
    collectives = 1 if cp.size > 1 and lay.num_sequences else 0

    resp = lay.response_lengths.tolist()
    full_keep = full_mask != 0
    if lay.num_sequences:
        full_seq_ids = torch.repeat_interleave(
            torch.arange(lay.num_sequences, device=full_mask.device), lay.response_lengths.to(full_mask.device),
            output_size=int(full_mask.numel()),
        )
        full_keep = full_keep & ~result.seq_rejected.to(full_mask.device).index_select(0, full_seq_ids)
    local_token_rejected = (local_mask != 0) & ~result.keep_mask
    if cp.size == 1:
        full_keep = full_keep & ~_scatter_bits(local_token_rejected, index, full_mask.numel())
    elif config.token_rejects and full_mask.numel():
        bits = _scatter_bits(local_token_rejected, index, full_mask.numel()).to(torch.uint8)
        dist.all_reduce(bits, group=cp.group)  # each position is set by exactly one rank
        collectives += 1
        full_keep = full_keep & (bits == 0)
    modified = full_mask * full_keep.to(full_mask.dtype) if full_mask.dtype != torch.bool else full_mask & full_keep
    masks = list(torch.split(modified, resp)) if resp else []
    return CPMISResult(result=result, modified_masks=masks, layout=lay, num_collectives=collectives)


def _scatter_bits(local_bits: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.bool, device=local_bits.device)
    if index.numel():
        out.index_copy_(0, index, local_bits)
    return out


def cp_normalization_statistics(inputs: CPInputs, config: MISConfig, cp: GroupView) -> NormalizationStatistics:
    """Self-normalisation sum and count of these sequences (one CP all-gather). The result is
    identical on every CP rank; add it over micro-batches, then all-reduce over the
    data-parallel group WITHOUT context parallelism (see :mod:`megatron_mis.parallel.global_norm`)."""
    lay, train, rollout, local_mask, _, _ = inputs.resolve(cp)
    cu = lay.local_cu_seqlens().to(train.device)
    return normalization_statistics(train, rollout, local_mask, cu, config, reduce_stats=cp_stats_reducer(cp))
