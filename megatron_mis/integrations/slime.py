"""Everything a slime job points its flags at (read in slime 624b824a).

One module, one dotted prefix: every value below is ``megatron_mis.integrations.slime.<name>``.

==============================================  ===============================================
slime flag                                      value
==============================================  ===============================================
``--custom-tis-function-path``                  :func:`compute_mis_weights_with_cp` (Megatron
                                                backend, any CP size; also
                                                ``megatron_mis.compute_mis_weights_with_cp``)
                                                or :func:`compute_mis_weights_fsdp` (FSDP
                                                backend, no context parallelism)
``--rollout-data-postprocess-path``             :func:`rollout_data_postprocess`
``--custom-megatron-before-train-step-hook-path``  :func:`before_train_step`
==============================================  ===============================================

plus ``--use-tis --custom-config-path mis.yaml`` (the YAML's keys land on ``args``, where every
function here reads them). slime accepts a single ``--rollout-data-postprocess-path``, called on
every training rank after the old-policy log-probs are recomputed, before training;
:func:`rollout_data_postprocess` runs every per-rollout task of megatron-mis from it, each only
when its keys switch it on:

- the global self-normalisation mean (``tis_batch_normalize_scope: global``,
  :func:`prepare_global_normalizer`);
- the rollout's global mean response length for the length-decay LR schedule and the monitor
  (``length_decay_enabled`` / ``monitor_enabled``, :func:`observe_rollout`).

If you already use that hook for something else, call :func:`rollout_data_postprocess` from yours.

The patch ``patches/slime-624b824a-length-decay.patch`` (checkpointed schedule, the monitor)
calls :func:`wrap_opt_param_scheduler` and :func:`monitor_train_step` from this module.
"""

from __future__ import annotations

from typing import Any

from megatron_mis.integrations.scheduler_hooks import (
    before_train_step,
    configs_from_args,
    monitor_train_step,
    observe_rollout,
    wrap_opt_param_scheduler,
)
from megatron_mis.integrations.tis_functions import (
    compute_mis_weights_fsdp,
    compute_mis_weights_with_cp,
    prepare_global_normalizer,
)

__all__ = [
    "before_train_step",
    "compute_mis_weights_fsdp",
    "compute_mis_weights_with_cp",
    "monitor_train_step",
    "observe_rollout",
    "prepare_global_normalizer",
    "rollout_data_postprocess",
    "wrap_opt_param_scheduler",
]


def rollout_data_postprocess(args: Any, rollout_id: int, rollout_data: dict) -> None:
    """slime's ``--rollout-data-postprocess-path`` hook for megatron-mis (see module docstring).

    Collectives: one CP all-gather + one DP all-reduce for the global mean (when on), one DP
    all-reduce for the response length (when on); all over explicit Megatron groups."""
    schedule = configs_from_args(args)
    if schedule.decay.length_decay_enabled or schedule.monitor.monitor_enabled:
        observe_rollout(args, rollout_id, rollout_data)
    prepare_global_normalizer(args, rollout_id, rollout_data)
