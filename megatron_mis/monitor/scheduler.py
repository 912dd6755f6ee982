"""Deprecated: the learning-rate schedule moved to :mod:`megatron_mis.lr_schedule` (it is not a
monitor). The names below keep working from here for one release with a ``DeprecationWarning``;
:mod:`megatron_mis.monitor` itself still exports them without one."""

from megatron_mis._deprecated import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"megatron_mis.lr_schedule.{name}"
        for name in (
            "ConstantSchedule",
            "LR_SCHEDULES",
            "LengthDecayParamScheduler",
            "LengthDecaySchedule",
            "LengthDecayScheduler",
            "build_lr_schedule",
        )
    },
)
