"""Reading the process groups a host framework set up, without hidden global state.

:class:`GroupView` is one process group with this rank's position in it; :class:`HostGroups`
bundles the ones the MIS code needs. :func:`host_groups` builds them from (in order of
preference) explicit groups, Miles' ``ParallelState`` object (``.cp`` / ``.tp`` / ``.intra_dp``
with ``.rank`` / ``.size`` / ``.group``), or Megatron-Core's ``parallel_state`` module. Without any
of these (a single process), every group is trivial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["GroupView", "HostGroups", "host_groups", "group_view"]


@dataclass(frozen=True)
class GroupView:
    """A process group and this rank's place in it (``group`` is ``None`` when ``size == 1``)."""

    rank: int
    size: int
    group: Any | None

    @staticmethod
    def trivial() -> "GroupView":
        return GroupView(rank=0, size=1, group=None)


def group_view(group: Any | None) -> GroupView:
    """A :class:`GroupView` for an explicit ``ProcessGroup`` (``None``: trivial)."""
    if group is None:
        return GroupView.trivial()
    size = dist.get_world_size(group)
    return GroupView(rank=dist.get_rank(group), size=size, group=group if size > 1 else None)


@dataclass(frozen=True)
class HostGroups:
    """The groups the MIS code uses.

    Attributes:
        cp: context-parallel group (sequences are split across it).
        dp: data-parallel group WITHOUT context parallelism (different samples).
        tp: tensor-parallel group (log-probs are identical across it).
        is_last_pp_stage: whether this rank computes the loss.
    """

    cp: GroupView
    dp: GroupView
    tp: GroupView
    is_last_pp_stage: bool = True


def _from_miles(ps: Any) -> HostGroups:
    def view(info: Any) -> GroupView:
        if info is None:
            return GroupView.trivial()
        size = int(getattr(info, "size", 1))
        return GroupView(rank=int(getattr(info, "rank", 0)), size=size, group=getattr(info, "group", None) if size > 1 else None)

    dp_info = getattr(ps, "intra_dp", None)
    try:  # Miles' effective DP (intra or independent) when available
        dp_info = ps.effective_dp
    except Exception:  # noqa: BLE001 - older ParallelState without the property
        pass
    return HostGroups(
        cp=view(getattr(ps, "cp", None)),
        dp=view(dp_info),
        tp=view(getattr(ps, "tp", None)),
        is_last_pp_stage=bool(getattr(ps, "is_pp_last_stage", True)),
    )


def _from_megatron() -> HostGroups | None:
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:  # pragma: no cover - megatron-core is a hard requirement
        return None
    if not mpu.model_parallel_is_initialized():
        return None
    return HostGroups(
        cp=group_view(mpu.get_context_parallel_group()),
        dp=group_view(mpu.get_data_parallel_group(with_context_parallel=False)),
        tp=group_view(mpu.get_tensor_model_parallel_group()),
        is_last_pp_stage=bool(mpu.is_pipeline_last_stage(ignore_virtual=True)),
    )


def host_groups(
    parallel_state: Any | None = None,
    *,
    cp_group: Any | None = None,
    dp_group: Any | None = None,
    tp_group: Any | None = None,
) -> HostGroups:
    """Resolve the groups: explicit arguments win, then Miles' ``parallel_state``, then
    Megatron-Core's initialised parallel state, then trivial groups.

    Raises:
        RuntimeError: if torch.distributed runs with several ranks but no parallel state or
            explicit group says how they are arranged (guessing the WORLD group would be wrong
            under tensor / pipeline parallelism).
    """
    base: HostGroups | None
    if parallel_state is not None:
        base = _from_miles(parallel_state)
    else:
        base = _from_megatron()
    if base is None:
        if cp_group is None and dp_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "megatron-mis: torch.distributed has several ranks but neither Megatron-Core's parallel state "
                "nor a parallel_state / cp_group argument describes them; pass cp_group= (and dp_group=) "
                "explicitly. The WORLD group is never assumed."
            )
        base = HostGroups(GroupView.trivial(), GroupView.trivial(), GroupView.trivial(), True)
    return HostGroups(
        cp=group_view(cp_group) if cp_group is not None else base.cp,
        dp=group_view(dp_group) if dp_group is not None else base.dp,
        tp=group_view(tp_group) if tp_group is not None else base.tp,
        is_last_pp_stage=base.is_last_pp_stage,
    )
