"""Global self-normalisation: one mean for the whole step's batch across data-parallel ranks.

The IS weights pi_old / pi_rollout do not depend on the parameters being trained, so their mean
over the global batch can be computed once per step, before the micro-batches run, and handed to
every micro-batch's call (``tis_batch_normalize_scope: global``).

Collectives: with the thd / bshd layouts, one CP all-gather for all the step's sequences on this
rank together, then one all-reduce of two float64 numbers over the data-parallel group WITHOUT
context parallelism (CP ranks already hold identical statistics after the all-gather; summing
over them would count every sequence ``cp`` times). With the allgather-CP layout the statistics
are gathered once per micro-batch (its packing defines the split).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import NormalizationStatistics
from megatron_mis.parallel.cp_mis import CPInputs, cp_normalization_statistics
from megatron_mis.parallel.state import GroupView

__all__ = ["compute_global_normalizer", "merge_inputs"]


def merge_inputs(batches: Sequence[CPInputs]) -> list[CPInputs]:
    """Concatenate micro-batches whose layout is per sequence (thd / bshd) into one; allgather
    micro-batches stay separate."""
    if not batches:
        return []
    per_sequence = [b for b in batches if b.layout != "allgather"]
    out = [b for b in batches if b.layout == "allgather"]
    for layout in ("thd", "bshd"):
        group = [b for b in per_sequence if b.layout == layout]
        if not group:
            continue
        has_train = [b.train_log_probs is not None for b in group]
        if any(has_train) and not all(has_train):
            raise ValueError("either every micro-batch has train_log_probs or none does")
        msl = None
        if layout == "bshd":
            msl = []
            for b in group:
                if b.max_seq_lens is None:
                    raise ValueError("layout='bshd' needs max_seq_lens for every micro-batch")
                msl += [b.max_seq_lens] * len(b.rollout_log_probs) if isinstance(b.max_seq_lens, int) else list(b.max_seq_lens)
        out.append(
            CPInputs(
                train_log_probs=[t for b in group for t in b.train_log_probs] if all(has_train) else None,
                rollout_log_probs=[t for b in group for t in b.rollout_log_probs],
                loss_masks=[m for b in group for m in b.loss_masks],
                total_lengths=[int(x) for b in group for x in b.total_lengths],
                response_lengths=[int(x) for b in group for x in b.response_lengths],
                layout=layout,
                max_seq_lens=msl,
            )
        )
    return out


def compute_global_normalizer(
    batches: Sequence[CPInputs],
    config: MISConfig,
    *,
    cp: GroupView,
    dp: GroupView,
) -> torch.Tensor:
    """The global self-normalisation mean (0-dim float64) of the step's micro-batches on every
    data-parallel rank. Call it on every rank of the DP x CP groups (a rank with no micro-batch
    passes ``[]`` and still takes part). Returns 1 where nothing is kept anywhere.
    """
    merged = merge_inputs(batches)
    total: NormalizationStatistics | None = None
    for inputs in merged:
        part = cp_normalization_statistics(inputs, config, cp)
        total = part if total is None else total + part
    device = _device_of(batches)
    packed = torch.zeros(2, dtype=torch.float64, device=device)
    if total is not None:
        packed = torch.stack([total.weight_sum, total.count]).to(device=device, dtype=torch.float64)
    if dp.size > 1:
        dist.all_reduce(packed, group=dp.group)
    return NormalizationStatistics(packed[0], packed[1]).mean()


def _device_of(batches: Sequence[CPInputs]) -> torch.device:
    for b in batches:
        if b.rollout_log_probs:
            return b.rollout_log_probs[0].device
    return torch.device("cpu")
