"""The metrics of :class:`~megatron_mis.integrations.megatron_loss.MegatronRLLoss`: what its
``loss_func`` puts in Megatron's forward-data store (``share/ | sum/ | lsum/ | count/ | max/ | min/``
0-dim tensors per micro-batch) and how a step's store becomes one dict of floats."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_mis.core.aggregation import Denominators
from megatron_mis.core.losses import finalize_metrics

__all__ = ["engine_metrics", "is_store_key", "masked_extreme", "reduce_metric_store"]


def is_store_key(name: str) -> bool:
    return name.partition("/")[0] in ("share", "sum", "lsum", "count", "max", "min")


def reduce_metric_store(
    forward_data_store: Sequence[Mapping[str, torch.Tensor]],
    denominators: Denominators,
    all_reduce: Callable[..., torch.Tensor],
) -> dict[str, float]:
    """The body of :meth:`MegatronRLLoss.reduce_metrics`: sum the store over micro-batches, one
    ``all_reduce(buf)`` (SUM over the data-parallel group) plus one ``all_reduce(buf, op="max")``
    when there are ``max/`` / ``min/`` entries, then :func:`finalize_metrics`.

    The sums and extremes are formed where the values are (no read per entry) and the host
    reads them once, after the all-reduces: one synchronisation per step.

    Raises:
        ValueError: if the counted denominator tokens / sequences differ from ``denominators``.
    """
    keys = sorted({k for d in forward_data_store for k in d if is_store_key(k)})
    sum_keys = [k for k in keys if k.partition("/")[0] not in ("max", "min")]
    ext_keys = [k for k in keys if k.partition("/")[0] in ("max", "min")]
    device = next(
        (v.device for d in forward_data_store for k, v in d.items() if k in keys and isinstance(v, torch.Tensor) and v.device.type != "cpu"),
        torch.device("cpu"),
    )
    f64 = torch.float64
    # a host 0-dim value in a device op is read as a scalar on the host: no synchronisation
    local = [torch.zeros((), dtype=f64, device=device) for _ in sum_keys]
    ext = [torch.full((), float("-inf"), dtype=f64, device=device) for _ in ext_keys]
    for d in forward_data_store:
        for i, k in enumerate(sum_keys):
            if k in d:
                local[i] = local[i] + torch.as_tensor(d[k]).to(f64)
        for i, k in enumerate(ext_keys):
            if k in d:
                v = torch.as_tensor(d[k]).to(f64)
                ext[i] = torch.fmax(ext[i], v if k.startswith("max/") else -v)  # NaN: no value there
    total = all_reduce(torch.stack(local)) if sum_keys else torch.zeros(0, dtype=f64)
    extremes = all_reduce(torch.stack(ext), op="max") if ext_keys else torch.zeros(0, dtype=f64)
    values = torch.cat([total.to(f64).reshape(-1), extremes.to(total.device, f64).reshape(-1)]).tolist()  # the one read
    summed = dict(zip(sum_keys, values[: len(sum_keys)]))
    got = (summed.get("count/num_denominator_tokens", 0.0), summed.get("count/num_denominator_sequences", 0.0))
    if got != (denominators.num_tokens, denominators.num_sequences):
        raise ValueError(
            f"the step counted {got[0]:g} denominator tokens and {got[1]:g} sequences but the loss was "
            f"normalised by {denominators.num_tokens:g} and {denominators.num_sequences:g}: the denominators "
            "were not computed from this step's micro-batches (use count_denominators on the same data)"
        )
    num_loss = summed.get("count/num_loss_tokens", 0.0)
    lsums = {k: summed.pop(k) for k in list(summed) if k.startswith("lsum/")}
    out = finalize_metrics(summed)
    for k, v in lsums.items():
        out[k.partition("/")[2]] = v / num_loss if num_loss > 0 else 0.0
    for k, v in zip(ext_keys, values[len(sum_keys):]):
        kind, _, name = k.partition("/")
        if v != float("-inf"):
            out[f"{name}_{kind}"] = v if kind == "max" else -v
    return out


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """0-dim float64 max / min of ``values [T]`` over ``mask``, on their device; NaN when the mask
    is empty (no read: a masked reduction, no boolean index)."""
    v = values.detach().to(torch.float64)
    fill = float("-inf") if kind == "max" else float("inf")
    pad = torch.full((1,), fill, dtype=torch.float64, device=v.device)
    # The fill value is appended so that an empty ``values`` (a CP rank or micro-batch with no
    # response token) reduces to it instead of raising in amax / amin.
    picked = torch.cat([torch.where(mask, v, pad).reshape(-1), pad])
    ext = picked.amax() if kind == "max" else picked.amin()
    return torch.where(mask.any(), ext, torch.full((), float("nan"), dtype=torch.float64, device=v.device))


def engine_metrics(res, train: torch.Tensor, rollout: torch.Tensor, lmask: torch.Tensor, keep: torch.Tensor, mis_config) -> dict[str, torch.Tensor]:
    """The engine's token metrics as loss-token sums (``lsum/``), and the extremes the demo and
    monitors plot: the largest token K3 KL and the raw token ratio pi_old / pi_rollout (before any
    bound) over valid loss tokens."""
    dev = lmask.device
    out: dict[str, torch.Tensor] = {}
    for name, values in res.token_metrics.items():
        v = values.detach().float().to(dev)
        ok = lmask & torch.isfinite(v)
        out[f"lsum/{name}"] = torch.where(ok, v, torch.zeros_like(v)).sum()
    valid = lmask & torch.isfinite(train) & torch.isfinite(rollout)
    log_r = torch.where(valid, train - rollout, torch.zeros_like(train)).clamp(-mis_config.log_ratio_bound, mis_config.log_ratio_bound)
    ratio = log_r.exp()
    out["lsum/mis_ratio"] = torch.where(lmask, ratio, torch.zeros_like(ratio)).sum()
    out["max/mis_ratio"] = masked_extreme(ratio, valid, "max")
    out["min/mis_ratio"] = masked_extreme(ratio, valid, "min")
    k3 = res.token_metrics.get("mis_k3_kl")
    if k3 is not None:
        out["max/mis_k3_kl"] = masked_extreme(k3.float().to(dev), valid, "max")
    return out
