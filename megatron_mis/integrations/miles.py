"""Everything a Miles job points its flags and patches at (read in Miles 31f1ca96).

One module, one dotted prefix: every value below is ``megatron_mis.integrations.miles.<name>``.

==============================================  ===============================================
Miles flag / patch                              value
==============================================  ===============================================
``--custom-tis-function-path``                  :func:`compute_mis_weights_with_cp` (Megatron
                                                backend; Miles passes ``parallel_state`` and, for
                                                ``qkv_format: bshd``, ``max_seq_lens``) or
                                                :func:`compute_mis_weights_fsdp` (FSDP backend)
``--custom-megatron-before-train-step-hook-path``  :func:`before_train_step`
``patches/miles-31f1ca96-global-mis-normalizer.patch``  calls :func:`prepare_global_normalizer`
``patches/miles-31f1ca96-length-decay.patch``   calls :func:`wrap_opt_param_scheduler`,
                                                :func:`observe_rollout` and
                                                :func:`monitor_train_step`
==============================================  ===============================================

plus ``--use-tis --custom-config-path mis.yaml`` (the YAML's keys land on ``args``). Miles calls
``--rollout-data-postprocess-path`` as ``fn(args)``, without the rollout data, so the per-rollout
tasks (the global self-normalisation mean, the response length for the length-decay schedule and
the monitor) need the patches, which call the functions above with the data and Miles' own
``parallel_state`` / ``effective_dp`` group.
"""

from __future__ import annotations

from megatron_mis.integrations.scheduler_hooks import (
    before_train_step,
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
    "wrap_opt_param_scheduler",
]
