"""Context-parallel (CP) layout arithmetic, written once (pure: integers and index tensors, no
process groups, no Megatron import).

Three layouts are supported (DESIGN section 3):

``thd`` (zigzag, packed)
    A sequence of ``total_length`` tokens is cut into ``2*cp`` chunks of
    ``chunk = ceil(total_length / (2*cp))`` (the last ones padded); rank ``r`` holds chunks ``r``
    and ``2*cp-1-r``, concatenated.
``bshd`` (zigzag, padded batch)
    The same zigzag split, with ``chunk = ceil(max_seq_len / (2*cp))`` for the batch maximum.
``allgather`` (contiguous)
    The packed stream (sequences concatenated, padded to ``cp * local_length``) is split
    contiguously: rank ``r`` holds stream positions ``[r*local_length, (r+1)*local_length)``.

The log-prob of token ``t`` is computed at logit position ``t-1``, on the rank that holds that
position, so the response log-probs of a sequence with ``prompt = total - response`` are those of
tokens ``prompt .. total-1`` at positions ``prompt-1 .. total-2``. A rank's *local response piece*
is the response tokens whose position ``t-1`` lies in its chunks, in local order. A rank can hold
zero response tokens of a sequence.

Conventions: ``total_lengths`` / ``response_lengths`` are ``[N]`` integer sequences; response
coordinates ``j`` run over ``0 .. response_length-1``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "CPLayout",
    "LocalResponseLayout",
    "local_response_layout",
    "zigzag_chunk_size",
    "zigzag_position_ranges",
    "allgather_local_length",
    "check_max_seq_lens",
    "validate_lengths",
]

CPLayout = Literal["thd", "bshd", "allgather"]


def zigzag_chunk_size(length: int, cp_size: int) -> int:
    """``ceil(length / (2*cp_size))``: the zigzag chunk for a sequence (thd) or the padded batch
    maximum (bshd)."""
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be >= 1")
    return -(-int(length) // (2 * cp_size))


def zigzag_position_ranges(length: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global position ranges ``[(s0, e0), (s1, e1)]`` held by ``cp_rank`` for a zigzag split
    with chunk ``zigzag_chunk_size(length, cp_size)``. Ranges may extend past the real length
    (padding)."""
    _check_rank(cp_size, cp_rank)
    c = zigzag_chunk_size(length, cp_size)
    r = cp_rank
    return (r * c, (r + 1) * c), ((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c)


def allgather_local_length(total_lengths: Sequence[int], cp_size: int, pad_multiple: int = 1) -> int:
    """Local length of the contiguous allgather-CP split: the packed stream padded to a multiple
    of ``cp_size * pad_multiple``, divided by ``cp_size``."""
    total = int(sum(int(t) for t in total_lengths))
    unit = cp_size * pad_multiple
    padded = -(-total // unit) * unit
    return padded // cp_size


def validate_lengths(total_lengths: Sequence[int], response_lengths: Sequence[int]) -> None:
    """Raise ``ValueError`` naming the first bad sequence: responses must fit in their sequence
    and a non-empty response needs at least one prompt token (its first log-prob is computed at
    the last prompt position)."""
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"got {len(total_lengths)} total_lengths but {len(response_lengths)} response_lengths"
        )
    if (
        set(map(type, total_lengths)) <= {int} and set(map(type, response_lengths)) <= {int}
        and all(map(operator.gt, total_lengths, response_lengths)) and min(response_lengths, default=0) >= 0
    ):
        return  # the common case, checked by C-level maps: every response leaves a prompt token
    for i, (t, r) in enumerate(zip(total_lengths, response_lengths)):
        t, r = int(t), int(r)
        if r < 0 or t < 0:
            raise ValueError(
                f"sequence {i}: total_lengths[{i}]={t} and response_lengths[{i}]={r} must both be >= 0"
            )
        if r > 0 and t - r < 1:
            raise ValueError(
                f"sequence {i}: response_length={r} needs a prompt of at least 1 token, but "
                f"total_length={t}"
            )


@dataclass(frozen=True)
class LocalResponseLayout:
    """Where one rank's local response log-probs sit in the full responses.

    Attributes:
        ranges: ``[N, 2, 2]`` int64 (CPU) — per sequence, the two response-coordinate ranges
            ``[start, end)`` this rank holds, in local order (the second may be empty).
        local_lengths: ``[N]`` int64 — local response tokens per sequence.
        response_lengths: ``[N]`` int64.
    """

    ranges: torch.Tensor
    local_lengths: torch.Tensor
    response_lengths: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.response_lengths.numel())

    @property
    def num_local_tokens(self) -> int:
        return int(self.local_lengths.sum())

    def local_to_full_index(self) -> torch.Tensor:
        """``[T_local]`` int64: for each local token (sequences concatenated in order), its index in
        the concatenation of the FULL responses."""
        n = self.num_sequences
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        full_offsets = torch.cumsum(self.response_lengths, 0) - self.response_lengths  # [N]
        starts = self.ranges[:, :, 0]  # [N, 2]
        seg_len = (self.ranges[:, :, 1] - self.ranges[:, :, 0]).clamp_min(0)  # [N, 2]
        seg_len_flat = seg_len.reshape(-1)  # [2N]
        seg_base = (full_offsets[:, None] + starts).reshape(-1)  # [2N]
        total = int(seg_len_flat.sum())
        if total == 0:
            return torch.zeros(0, dtype=torch.long)
        seg_id = torch.repeat_interleave(torch.arange(2 * n), seg_len_flat, output_size=total)
        seg_start_in_local = torch.cumsum(seg_len_flat, 0) - seg_len_flat
        within = torch.arange(total) - seg_start_in_local[seg_id]
        return seg_base[seg_id] + within

    def local_sequence_ids(self) -> torch.Tensor:
        """``[T_local]`` int64: the sequence each local token belongs to."""
        total = self.num_local_tokens
        return torch.repeat_interleave(torch.arange(self.num_sequences), self.local_lengths, output_size=total)

    def local_cu_seqlens(self) -> torch.Tensor:
        """``[N+1]`` int64 offsets of each sequence's local piece in the local concatenation."""
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(self.local_lengths, 0)])


def local_response_layout(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    layout: CPLayout = "thd",
    max_seq_lens: Sequence[int] | int | None = None,
    local_length: int | None = None,
) -> LocalResponseLayout:
    """Compute which response tokens of every sequence ``cp_rank`` holds.

    Args:
        total_lengths: ``[N]`` prompt + response lengths.
        response_lengths: ``[N]`` response lengths.
        cp_size, cp_rank: the context-parallel size and this rank.
        layout: ``"thd"``, ``"bshd"`` or ``"allgather"`` (see module docstring).
        max_seq_lens: bshd only — the padded length per sequence (a list, as Miles passes it) or
            one int for the whole batch.
        local_length: allgather only — tokens per rank of the padded packed stream (default:
            :func:`allgather_local_length` without extra padding).

    Returns:
        :class:`LocalResponseLayout`. With ``cp_size == 1`` every rank holds everything.

    Raises:
        ValueError: bad lengths, unknown layout, missing ``max_seq_lens`` for bshd, a sequence
            longer than its ``max_seq_len``, or an allgather ``local_length`` too small.
    """
    tl = [int(x) for x in (total_lengths.tolist() if isinstance(total_lengths, torch.Tensor) else total_lengths)]
    rl = [int(x) for x in (response_lengths.tolist() if isinstance(response_lengths, torch.Tensor) else response_lengths)]
    validate_lengths(tl, rl)
    _check_rank(cp_size, cp_rank)
    n = len(tl)
    total = torch.tensor(tl, dtype=torch.long)
    resp = torch.tensor(rl, dtype=torch.long)
    prompt = total - resp
    # logit positions of the response tokens: [prompt-1, total-1)
    lo = prompt - 1
    hi = total - 1

    if layout == "bshd" and (max_seq_lens is not None or cp_size > 1):
        msl = check_max_seq_lens(max_seq_lens, tl)  # also at CP = 1: a padded length below a sample's is a host bug
    if cp_size == 1:
        ranges = torch.zeros(n, 2, 2, dtype=torch.long)
        ranges[:, 0, 1] = resp
        return LocalResponseLayout(ranges, resp.clone(), resp)

    if layout in ("thd", "bshd"):
        if layout == "thd":
            chunk = -(-total // (2 * cp_size))
        else:
            chunk = -(-torch.tensor(msl, dtype=torch.long) // (2 * cp_size))
        r = cp_rank
        c0s, c0e = r * chunk, (r + 1) * chunk
        c1s, c1e = (2 * cp_size - 1 - r) * chunk, (2 * cp_size - r) * chunk
        seg_starts = torch.stack([torch.maximum(c0s, lo), torch.maximum(c1s, lo)], 1)  # [N, 2]
        seg_ends = torch.stack([torch.minimum(c0e, hi), torch.minimum(c1e, hi)], 1)
    elif layout == "allgather":
        if local_length is None:
            local_length = allgather_local_length(tl, cp_size)
        if local_length * cp_size < sum(tl):
            raise ValueError(
                f"allgather local_length={local_length} x cp_size={cp_size} cannot hold the "
                f"{sum(tl)} packed tokens"
            )
        seq_start = torch.cumsum(total, 0) - total
        a, b = cp_rank * local_length, (cp_rank + 1) * local_length
        # in stream coordinates, then back to sequence coordinates
        s = torch.maximum(seq_start + lo, torch.tensor(a)) - seq_start
        e = torch.minimum(seq_start + hi, torch.tensor(b)) - seq_start
        seg_starts = torch.stack([s, s], 1)
        seg_ends = torch.stack([e, s], 1)  # second range empty
    else:
        raise ValueError(f"unknown CP layout {layout!r}; valid: thd, bshd, allgather")

    empty = seg_ends <= seg_starts
    seg_starts = torch.where(empty, torch.zeros_like(seg_starts), seg_starts - lo[:, None])
    seg_ends = torch.where(empty, torch.zeros_like(seg_ends), seg_ends - lo[:, None])
    ranges = torch.stack([seg_starts, seg_ends], 2)  # [N, 2, 2] response coordinates
    local_lengths = (ranges[:, :, 1] - ranges[:, :, 0]).sum(1)
    return LocalResponseLayout(ranges, local_lengths, resp)


def check_max_seq_lens(max_seq_lens: Sequence[int] | int | None, total_lengths: Sequence[int]) -> list[int]:
    """The bshd padded length of every sample (``[N]``), checked: given, one per sample (or one
    int for all), and never below the sample's total (prompt + response) length.

    Raises:
        ValueError: naming the sample, its total length and the ``max_seq_lens`` given.
    """
    n = len(total_lengths)
    if max_seq_lens is None:
        raise ValueError("layout='bshd' needs max_seq_lens (the padded length of the batch)")
    if isinstance(max_seq_lens, bool) or not isinstance(max_seq_lens, int) and not hasattr(max_seq_lens, "__iter__"):
        raise ValueError(f"max_seq_lens must be an int or one int per sample, got {type(max_seq_lens).__name__} ({max_seq_lens!r:.60})")
    msl = [int(max_seq_lens)] * n if isinstance(max_seq_lens, int) else [int(x) for x in max_seq_lens]
    if len(msl) != n:
        raise ValueError(f"got {len(msl)} max_seq_lens for {n} sequences")
    for i, (m, t) in enumerate(zip(msl, total_lengths)):
        if t > m:
            shown = max_seq_lens if isinstance(max_seq_lens, int) else msl
            raise ValueError(
                f"sample {i}: total_length={t} (prompt + response) exceeds max_seq_len={m} "
                f"(max_seq_lens={shown!r:.120}); bshd pads every sample to max_seq_lens, so it must be >= every "
                "sample's total length"
            )
    return msl


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} must lie in [0, {cp_size})")
