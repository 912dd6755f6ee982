"""The one per-rollout hook megatron-mis needs in slime.

slime accepts a single ``--rollout-data-postprocess-path`` (called on every training rank after
the old-policy log-probs are recomputed, before training). Point it here:

    --rollout-data-postprocess-path megatron_mis.integrations.slime.rollout_data_postprocess

and every per-rollout task of megatron-mis runs from it, each only when its keys switch it on:

- the global self-normalisation mean (``tis_batch_normalize_scope: global``);
- the rollout's global mean response length for the length-decay LR schedule and the monitor
  (``length_decay_enabled`` / ``monitor_enabled``).

If you already use that hook for something else, call this function from yours.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rollout_data_postprocess"]


def rollout_data_postprocess(args: Any, rollout_id: int, rollout_data: dict) -> None:
    """slime's rollout-data hook for megatron-mis (see module docstring). Collectives: one CP
    all-gather + one DP all-reduce for the global mean (when on), one DP all-reduce for the
    response length (when on); all over explicit Megatron groups."""
    from megatron_mis.integrations.hosts import prepare_global_normalizer
    from megatron_mis.integrations.scheduler_hooks import configs_from_args, observe_rollout

    schedule = configs_from_args(args)
    if schedule.decay.length_decay_enabled or schedule.monitor.monitor_enabled:
        observe_rollout(args, rollout_id, rollout_data)
    prepare_global_normalizer(args, rollout_id, rollout_data)
