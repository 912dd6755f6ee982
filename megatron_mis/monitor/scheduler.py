"""Deprecated: the learning-rate schedule moved to :mod:`megatron_mis.lr_schedule` (it is not a
monitor). The names below keep working from here and from :mod:`megatron_mis.monitor` for one
release, with a ``DeprecationWarning``."""

from megatron_mis._deprecated import moved_names

#: Old name -> new dotted path; :mod:`megatron_mis.monitor` forwards the same names.
MOVED = {
    name: f"megatron_mis.lr_schedule.{name}"
    for name in (
        "ConstantSchedule",
        "LR_SCHEDULES",
        "LengthDecayParamScheduler",
        "LengthDecaySchedule",
        "LengthDecayScheduler",
        "build_lr_schedule",
    )
}

__getattr__ = moved_names(__name__, MOVED)
