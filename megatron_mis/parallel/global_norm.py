"""Global self-normalisation: one mean for the whole step's batch across data-parallel ranks.

The IS weights pi_old / pi_rollout do not depend on the parameters being trained, so their mean
over the global batch can be computed once per step, before the micro-batches run, and handed to
every micro-batch's call (``tis_batch_normalize_scope: global``).

Collectives: with the thd / bshd layouts, one CP all-gather for all the step's sequences on this
rank together (every CP rank's fault status rides in it, read once: see
:mod:`megatron_mis.parallel.cp_mis`), then one all-reduce of two float64 numbers over the data-parallel group WITHOUT
context parallelism (CP ranks already hold identical statistics after the all-gather; summing
over them would count every sequence ``cp`` times). With the allgather-CP layout the statistics
are gathered once per micro-batch (its packing defines the split).

Which weights the mean is taken over is ``tis_batch_normalize_over``: ``loss_mask`` (the default,
slime's and Miles' ``mis.py``: every loss-mask token at token level, every sequence with one at
sequence / geometric level, rejected ones included with their bounded weight) or ``kept`` (only
what survives rejection). :func:`normalization_config` gives the engine configuration whose
normalisation statistics are the ``loss_mask`` ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import NormalizationStatistics
from megatron_mis.parallel.cp_mis import CPInputs, cp_normalization_statistics
from megatron_mis.parallel.state import GroupView

__all__ = ["HOST_MIN_MEAN", "compute_global_normalizer", "merge_inputs", "normalization_config", "usable_mean"]

#: slime's and Miles' ``mis.py`` divide by the mean only when it exceeds this (else by 1).
HOST_MIN_MEAN = 1e-8

_F32_MAX = 3.4028234663852886e38


def normalization_config(config: MISConfig) -> MISConfig:
    """The configuration whose engine normalisation statistics are the ones
    ``config.tis_batch_normalize_over`` asks for: ``config`` itself for ``kept``; for
    ``loss_mask`` the same weights with nothing rejected (no RS, no veto, mask mode replaced by an
    upper bound no weight reaches, so an out-of-band weight counts with its value as in the hosts'
    ``mis.py``; a non-finite token counts with ratio 1)."""
    import warnings

    if config.tis_batch_normalize_over == "kept":
        return config
    changes: dict = dict(use_rs=False, rs_veto_threshold=None, prob_veto_threshold=None, mis_metrics="none")
    if config.nonfinite_policy == "reject":
        changes["nonfinite_policy"] = "neutralize"
    if config.tis_mode == "mask":
        changes.update(tis_mode="truncate", tis_upper_bound=_F32_MAX, tis_lower_bound=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config.replace(**changes)


def usable_mean(stats: NormalizationStatistics) -> torch.Tensor:
    """The mean of ``stats`` as the hosts use it: 1 where nothing counts or where the mean is not
    above :data:`HOST_MIN_MEAN` (0-dim float64, no host synchronisation)."""
    mean = stats.mean()
    return torch.where(mean > HOST_MIN_MEAN, mean, torch.ones_like(mean))


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
    passes ``[]`` and still takes part). The mean is over the weights
    ``config.tis_batch_normalize_over`` names; 1 where nothing counts anywhere.
    """
    merged = merge_inputs(batches)
    stats_config = normalization_config(config)
    total: NormalizationStatistics | None = None
    for inputs in merged:
        part = cp_normalization_statistics(inputs, stats_config, cp)
        total = part if total is None else total + part
    device = _device_of(batches)
    packed = torch.zeros(2, dtype=torch.float64, device=device)
    if total is not None:
        packed = torch.stack([total.weight_sum, total.count]).to(device=device, dtype=torch.float64)
    if dp.size > 1:
        dist.all_reduce(packed, group=dp.group)
    return usable_mean(NormalizationStatistics(packed[0], packed[1]))


def _device_of(batches: Sequence[CPInputs]) -> torch.device:
    for b in batches:
        if b.rollout_log_probs:
            return b.rollout_log_probs[0].device
    return torch.device("cpu")
