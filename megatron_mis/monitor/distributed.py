"""The one collective of the monitor package: the global-batch mean response length.

The surge detector and the length-decay schedule must see the same number on every rank, or
ranks would pick different learning rates. Each data-parallel rank holds its own share of the
batch, so the mean is taken over the data-parallel group (tensor-, context- and pipeline-parallel
peers of a rank hold the same samples and must not be counted again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["global_mean_response_length"]


def global_mean_response_length(
    response_lengths: Sequence[int] | Sequence[float] | Any,
    *,
    group: Any,
    device: Any = None,
) -> float | None:
    """Mean of the response lengths over every sample of the global batch.

    One ``all_reduce`` (SUM) of a float64 tensor ``[2]`` = (sum of lengths, number of samples)
    over ``group``. No gradient flows (the inputs are plain numbers). Every rank of ``group`` must
    call it, also a rank that holds no samples (pass an empty list).

    Args:
        response_lengths: this rank's per-sample response lengths ``[N_local]`` (a list, or a 1-D
            tensor), in tokens.
        group: the data-parallel process group (without context parallelism: CP peers hold the
            same samples). Required; there is no WORLD default.
        device: where the reduction tensor lives; default CUDA's current device for an NCCL group,
            else CPU.

    Returns:
        The global mean as a Python float, identical on every rank; ``None`` if the global batch is
        empty.

    Raises:
        ValueError: if ``group`` is None or a length is negative or not finite.
    """
    import torch
    import torch.distributed as dist

    if group is None:
        raise ValueError(
            "group must be the data-parallel process group (e.g. "
            "mpu.get_data_parallel_group(with_context_parallel=False)); there is no WORLD default"
        )
    if isinstance(response_lengths, torch.Tensor):
        lengths = response_lengths.detach().to("cpu", torch.float64).reshape(-1)
    else:
        lengths = torch.tensor([float(x) for x in response_lengths], dtype=torch.float64)
    if lengths.numel() and (not torch.isfinite(lengths).all() or (lengths < 0).any()):
        raise ValueError(f"response lengths must be finite and >= 0, got {lengths.tolist()}")
    if device is None:
        backend = str(dist.get_backend(group))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    stats = torch.stack([lengths.sum(), torch.tensor(float(lengths.numel()), dtype=torch.float64)]).to(device)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, count = stats.tolist()
    if count == 0:
        return None
    return total / count
