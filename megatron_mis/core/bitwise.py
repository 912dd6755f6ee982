"""Are rollout and training log-probs bitwise identical? (Let Speed Be With Stability (lmsys.org/blog/2026-01-16-training-inference-mismatch)'s true on-policy check)

Point :func:`compare_log_probs` at the log-probs your rollout engine recorded and the ones your
trainer recomputed for the same tokens. It compares BIT PATTERNS, not values: ``-0.0`` and
``0.0`` differ, two NaNs with the same payload are equal, and tensors of different dtypes are
never bitwise equal (the report says so instead of silently casting). Numeric differences are
reported alongside, in float64.

Pure torch: no Megatron, no torch.distributed. Under context parallelism compare each rank's
local pieces (or gather them first); the report is per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BitwiseReport", "compare_log_probs", "assert_bitwise_equal"]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@dataclass(frozen=True)
class BitwiseReport:
    """Result of :func:`compare_log_probs`.

    Attributes:
        bitwise_equal: same dtype and identical bits on every compared token.
        dtype_match: both inputs have the same dtype (``train_dtype`` / ``rollout_dtype``).
        num_tokens: tokens compared (after the mask).
        num_different: tokens whose bit patterns differ (every token if the dtypes differ and
            the values do; values equal after casting to float64 are not counted then).
        max_abs_diff / mean_abs_diff: over compared tokens, in float64 (``inf`` where exactly
            one side is NaN or the infinities differ; NaN on both sides counts as 0).
        first_mismatch: ``[N]`` int64, per sequence the index (within the sequence, before
            masking) of the first compared token that differs; -1 if none.
        num_sequences_different: sequences with at least one differing token.
    """

    bitwise_equal: bool
    dtype_match: bool
    train_dtype: torch.dtype
    rollout_dtype: torch.dtype
    num_tokens: int
    num_different: int
    max_abs_diff: float
    mean_abs_diff: float
    first_mismatch: torch.Tensor
    num_sequences_different: int

    @property
    def num_sequences(self) -> int:
        return int(self.first_mismatch.numel())

    @property
    def fraction_different(self) -> float:
        return self.num_different / self.num_tokens if self.num_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (for JSON metrics)."""
        return {
            "bitwise_equal": self.bitwise_equal,
            "dtype_match": self.dtype_match,
            "train_dtype": str(self.train_dtype).replace("torch.", ""),
            "rollout_dtype": str(self.rollout_dtype).replace("torch.", ""),
            "num_tokens": self.num_tokens,
            "num_different": self.num_different,
            "fraction_different": self.fraction_different,
            "max_abs_diff": self.max_abs_diff,
            "mean_abs_diff": self.mean_abs_diff,
            "num_sequences": self.num_sequences,
            "num_sequences_different": self.num_sequences_different,
            "first_mismatch": self.first_mismatch.tolist(),
        }

    def summary(self) -> str:
        """One line, e.g. for a log."""
        if self.bitwise_equal:
            return f"bitwise equal: {self.num_tokens} tokens in {self.num_sequences} sequences, max |diff| = 0"
        dtypes = "" if self.dtype_match else f" (dtypes differ: train {self.train_dtype}, rollout {self.rollout_dtype})"
        return (
            f"NOT bitwise equal{dtypes}: {self.num_different}/{self.num_tokens} tokens differ "
            f"({100 * self.fraction_different:.2f}%) in {self.num_sequences_different}/{self.num_sequences} "
            f"sequences; max |diff| = {self.max_abs_diff:.3g}, mean |diff| = {self.mean_abs_diff:.3g}"
        )


def _split(x: Any, cu_seqlens: torch.Tensor | None, what: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{what}: a tensor must be flat [T], got shape {tuple(x.shape)}; pass a list per sequence")
        if cu_seqlens is None:
            return [x]
        cu = cu_seqlens.detach().to("cpu", torch.long)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != x.numel() or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"{what}: cu_seqlens must be non-decreasing offsets from 0 to {x.numel()}, got {cu.tolist()}"
            )
        return list(torch.split(x, (cu[1:] - cu[:-1]).tolist()))
    if isinstance(x, Sequence):
        out = []
        for i, t in enumerate(x):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"{what}[{i}] must be a 1-D tensor")
            out.append(t)
        return out
    raise ValueError(f"{what} must be a flat tensor [T] or a list of 1-D tensors, got {type(x).__name__}")


def _bits(x: torch.Tensor) -> torch.Tensor:
    if not x.dtype.is_floating_point:
        return x
    return x.contiguous().view(_INT_VIEW[x.element_size()])


def compare_log_probs(
    train_log_probs: Sequence[torch.Tensor] | torch.Tensor,
    rollout_log_probs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    mask: Sequence[torch.Tensor] | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> BitwiseReport:
    """Compare training and rollout log-probs bit for bit.

    Args:
        train_log_probs: per-sequence ``[R_n]`` tensors, or one flat ``[T]`` tensor (then
            ``cu_seqlens`` splits it into sequences; without it it is one sequence).
        rollout_log_probs: the same layout.
        mask: optional, the same layout; only tokens where it is nonzero are compared (a loss
            mask).
        cu_seqlens: ``[N+1]`` offsets for flat inputs.

    Returns:
        :class:`BitwiseReport`.

    Raises:
        ValueError: different numbers of sequences or lengths, naming the first bad sequence.
    """
    train = _split(train_log_probs, cu_seqlens, "train_log_probs")
    roll = _split(rollout_log_probs, cu_seqlens, "rollout_log_probs")
    masks = None if mask is None else _split(mask, cu_seqlens, "mask")
    if len(train) != len(roll) or (masks is not None and len(masks) != len(train)):
        raise ValueError(
            f"got {len(train)} train, {len(roll)} rollout" + ("" if masks is None else f" and {len(masks)} mask")
            + " sequences"
        )
    train_dtype = train[0].dtype if train else torch.float32
    roll_dtype = roll[0].dtype if roll else torch.float32
    for name, seqs, dt in (("train_log_probs", train, train_dtype), ("rollout_log_probs", roll, roll_dtype)):
        for i, t in enumerate(seqs):
            if t.dtype != dt:
                raise ValueError(f"{name}[{i}] has dtype {t.dtype}, sequence 0 has {dt}")
    dtype_match = train_dtype == roll_dtype
    first = torch.full((len(train),), -1, dtype=torch.long)
    num_tokens = num_diff = 0
    max_abs = 0.0
    sum_abs = 0.0
    for i, (a, b) in enumerate(zip(train, roll)):
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: train has {a.numel()} log-probs, rollout {b.numel()}")
        a, b = a.detach().cpu(), b.detach().cpu()
        keep = torch.ones(a.shape, dtype=torch.bool)
        if masks is not None:
            if masks[i].shape != a.shape:
                raise ValueError(f"sequence {i}: mask has {masks[i].numel()} entries, log-probs {a.numel()}")
            keep = masks[i].detach().cpu() != 0
        a64, b64 = a.double(), b.double()
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        absdiff = torch.where(both_nan, torch.zeros_like(a64), (a64 - b64).abs())
        # inf - inf of the same sign gives NaN but the values are equal; what is still NaN
        # after that (exactly one side NaN) counts as an infinite difference
        same_inf = torch.isinf(a64) & (a64 == b64)
        absdiff = torch.where(same_inf, torch.zeros_like(absdiff), absdiff)
        absdiff = torch.nan_to_num(absdiff, nan=float("inf"))
        if dtype_match:
            differ = _bits(a) != _bits(b)
        else:
            differ = absdiff != 0
        differ &= keep
        num_tokens += int(keep.sum())
        n_diff = int(differ.sum())
        num_diff += n_diff
        if n_diff:
            first[i] = int(torch.nonzero(differ).flatten()[0])
        if bool(keep.any()):
            kept = absdiff[keep]
            max_abs = max(max_abs, float(kept.max()))
            sum_abs += float(kept.sum())
    return BitwiseReport(
        bitwise_equal=dtype_match and num_diff == 0,
        dtype_match=dtype_match,
        train_dtype=train_dtype,
        rollout_dtype=roll_dtype,
        num_tokens=num_tokens,
        num_different=num_diff,
        max_abs_diff=max_abs,
        mean_abs_diff=sum_abs / num_tokens if num_tokens else 0.0,
        first_mismatch=first,
        num_sequences_different=int((first >= 0).sum()),
    )


def assert_bitwise_equal(
    train_log_probs: Sequence[torch.Tensor] | torch.Tensor,
    rollout_log_probs: Sequence[torch.Tensor] | torch.Tensor,
    **kwargs: Any,
) -> BitwiseReport:
    """:func:`compare_log_probs`, raising ``AssertionError`` with the summary unless bitwise
    equal. Returns the report."""
    report = compare_log_probs(train_log_probs, rollout_log_probs, **kwargs)
    if not report.bitwise_equal:
        raise AssertionError(report.summary())
    return report
