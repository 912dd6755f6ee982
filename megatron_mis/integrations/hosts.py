"""Deprecated: renamed :mod:`megatron_mis.integrations.tis_functions` (the drop-in TIS functions).

Host flags pointing here (``megatron_mis.integrations.hosts.compute_mis_weights_with_cp``,
``megatron_mis.integrations.hosts.prepare_global_normalizer``) keep working for one release with
a ``DeprecationWarning``; point them at :mod:`megatron_mis.integrations.slime` or
:mod:`megatron_mis.integrations.miles` instead.
"""

from megatron_mis._deprecated import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"megatron_mis.integrations.tis_functions.{name}"
        for name in (
            "compute_mis_weights_with_cp",
            "compute_mis_weights_fsdp",
            "prepare_global_normalizer",
            "config_from_args",
        )
    },
)
