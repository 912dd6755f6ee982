"""Everything a plain Megatron-Core training loop uses from megatron-mis, in one module.

The loss (with TP, CP, DP and PP; see :mod:`megatron_mis.integrations.megatron_loss` for the
scaling the schedule and DDP apply)::

    from megatron_mis.integrations.megatron import MegatronRLLoss, RLMicroBatch

    rl = MegatronRLLoss(loss_config, mis_config)
    den = rl.count_denominators(batches)                      # once per optimizer step
    get_forward_backward_func()(forward_step_func=rl.forward_step(den, num_microbatches=len(batches)), ...)
    metrics = rl.reduce_metrics(store, den)

``rl.loss_func`` is the ``loss_func`` for a forward step of your own (:meth:`MegatronRLLoss.loss_func`).

- :class:`MegatronRLLoss`, :class:`RLMicroBatch`, :func:`response_positions`: the loss, its
  micro-batch (whole sequences, full-length per-token tensors) and the response-token positions;
- :func:`compute_global_normalizer`: the step's global self-normalisation mean
  (``tis_batch_normalize_scope: global``) from the step's :class:`CPInputs` (one CP all-gather
  + one DP all-reduce), before the micro-batches run;
- :class:`RoutingReplay`, :class:`RoutingReplayConfig`: rollout routing replay (R3) / R2 in
  Megatron's MoE routers (a context manager around the forward-backward passes);
- :class:`LengthDecayParamScheduler` wraps Megatron's ``OptimizerParamScheduler`` with the
  length-decay schedule (:func:`build_lr_schedule`), fed with
  :func:`global_mean_response_length` (one DP all-reduce); :class:`MismatchMonitor` watches the
  logged metrics.
"""

from __future__ import annotations

from megatron_mis.integrations.megatron_loss import MegatronRLLoss, RLMicroBatch, response_positions
from megatron_mis.lr_schedule import LengthDecayParamScheduler, build_lr_schedule
from megatron_mis.monitor.distributed import global_mean_response_length
from megatron_mis.monitor.monitor import MismatchMonitor
from megatron_mis.parallel.cp_mis import CPInputs
from megatron_mis.parallel.global_norm import compute_global_normalizer
from megatron_mis.routing.config import RoutingReplayConfig
from megatron_mis.routing.replay import RoutingReplay

__all__ = [
    "CPInputs",
    "LengthDecayParamScheduler",
    "MegatronRLLoss",
    "MismatchMonitor",
    "RLMicroBatch",
    "RoutingReplay",
    "RoutingReplayConfig",
    "build_lr_schedule",
    "compute_global_normalizer",
    "global_mean_response_length",
    "response_positions",
]
