"""Segment (per-sequence) reductions over packed token tensors, without Python loops over
sequences and without host-device synchronisation.

A packed batch is a flat ``[T]`` tensor whose sequences are contiguous, described by
``cu_seqlens`` ``[N+1]`` (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``) or equivalently by
``lengths`` ``[N]``. A context-parallel rank's local pieces are contiguous per sequence too, so
the same description (local lengths) covers them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from megatron_mis.core.compiling import is_compiling, opaque_op

__all__ = [
    "as_cu_seqlens",
    "concat_sequences",
    "cu_seqlens_from_lengths",
    "SegmentLayout",
    "chunk_size",
    "segment_layout",
    "segment_sum",
    "sequence_ids",
    "to_device",
]


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``[N+1]`` int64 offsets from ``[N]`` lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _host_offsets(cu_seqlens: Sequence[int]) -> list[int]:
    if isinstance(cu_seqlens, (str, bytes)) or not hasattr(cu_seqlens, "__iter__"):
        raise TypeError(
            f"cu_seqlens must be a list of N+1 integer offsets or a 1-D integer tensor, got "
            f"{type(cu_seqlens).__name__} ({cu_seqlens!r:.60})"
        )
    if isinstance(cu_seqlens, list) and set(map(type, cu_seqlens)) <= {int}:  # C-level type check
        return cu_seqlens  # the hosts' case: Python ints already
    values = []
    for i, v in enumerate(cu_seqlens):
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__index__"):
            raise TypeError(f"cu_seqlens[{i}]={v!r:.40} must be an integer offset, got {type(v).__name__}")
        if isinstance(v, float):
            if not (math.isfinite(v) and v == int(v)):
                raise ValueError(f"cu_seqlens[{i}]={v!r} must be an integer offset (no fraction, NaN or inf)")
            v = int(v)
        values.append(int(v))
    return values


def as_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Validate and move ``cu_seqlens`` to ``device`` as int64.

    Validation (integer entries, first entry 0, non-decreasing, last entry ``num_tokens``) runs
    when the offsets are host data (a list or a CPU tensor); offsets already on an accelerator are
    trusted, so the check never forces a device synchronisation. Host offsets reach an
    accelerator by a non-blocking copy from pinned memory.

    Raises:
        TypeError / ValueError: naming ``cu_seqlens``, the offending entry and what is allowed.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
            raise TypeError(f"cu_seqlens must hold integer offsets, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.device.type != "cpu":
            if cu_seqlens.is_floating_point():
                raise TypeError(f"cu_seqlens on {cu_seqlens.device} must be an integer tensor, got {cu_seqlens.dtype}")
            return cu_seqlens.to(device=device, dtype=torch.long)
        values = _host_offsets(cu_seqlens.tolist())  # host memory: reading it is no device sync
    else:
        values = _host_offsets(cu_seqlens)
    if not values:
        raise ValueError("cu_seqlens must have N+1 >= 1 entries, got an empty sequence")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    if not all(map(operator.le, values, values[1:])):  # C-level check; the loop names the culprit
        i = next(i for i in range(1, len(values)) if values[i] < values[i - 1])
        raise ValueError(
            f"cu_seqlens must be non-decreasing: cu_seqlens[{i}]={values[i]} < cu_seqlens[{i - 1}]={values[i - 1]}"
        )
    if values[-1] != num_tokens:
        raise ValueError(f"cu_seqlens[-1]={values[-1]} must equal the number of tokens {num_tokens}")
    return to_device(torch.tensor(values, dtype=torch.long), device)


def concat_sequences(parts: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """``N x [L_n] -> [sum L_n]`` on ``device``: one ``torch.cat`` (C-level over the list; pieces on
    other devices are moved first; an empty list gives an empty float32 tensor).

    On a CPU the cat runs with one intra-op thread: torch's CPU cat parallelises each input copy
    separately, and on many short pieces the thread hand-offs cost more than the copies
    (measured on 2 cores, torch 2.13: 4096 pieces of 16-256 floats 4.7 ms with 2 threads against
    0.64 ms with 1; 256 pieces of 256-4096 floats 0.36 against 0.15 ms; no case was slower). The
    thread count is process-wide: torch ops another Python thread runs during the cat (under a
    millisecond here) get one thread too. It is restored before returning, also on error;
    accelerator tensors are untouched.
    """
    if not parts:
        return torch.zeros(0, device=device)
    threads = torch.get_num_threads() if parts[0].device.type == "cpu" else 1
    if threads > 1:
        torch.set_num_threads(1)
    try:
        try:
            out = torch.cat(list(parts))
        except RuntimeError:  # pieces on other devices (or not 1-D: reshaped)
            out = torch.cat([p.reshape(-1).to(device) for p in parts])
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    return out if out.device == torch.device(device) else out.to(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host (pinned, non-blocking on CUDA)."""
    if torch.device(device).type == "cpu":
        return host
    if torch.device(device).type == "cuda" and not is_compiling():
        # (under compile_engine dynamo cannot trace pin_memory (torch 2.11, seen on an H100): the
        # index is a constant of the graph there, placed by the compiler)
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` int64 sequence index of every token (one index_add and one cumsum; handles
    zero-length sequences; no synchronisation)."""
    marks = torch.zeros(num_tokens + 1, dtype=torch.long, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:-1], torch.ones_like(cu_seqlens[1:-1]))
    return torch.cumsum(marks[:num_tokens], 0)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, ...] -> [N, ...]``: differentiable sums over the sequences of ``cu_seqlens [N+1]``
    (one ``index_add``; empty sequences give 0). For the losses' autograd path; the MIS engine's
    float64 statistics use :class:`SegmentLayout`."""
    cu = cu_seqlens.to(torch.long)
    cu = to_device(cu, values.device) if cu.device.type == "cpu" else cu.to(values.device)
    out = values.new_zeros((cu.numel() - 1,) + tuple(values.shape[1:]))
    return out.index_add(0, sequence_ids(cu, int(values.shape[0])), values)


def chunk_size(num_tokens: int, num_segments: int) -> int:
    """The chunk length :class:`SegmentLayout` uses: a power of two near a sixteenth of the mean
    segment length, within ``[16, 1024]`` (shorter rows reduce slowly) (host integers only: shapes, never data)."""
    target = num_tokens // max(1, 16 * num_segments)
    return 1 << min(10, max(4, target.bit_length() - 1 if target > 0 else 0))


class SegmentLayout(NamedTuple):
    """How ``N`` contiguous segments of a ``[T]`` token tensor fall on chunks of ``C`` tokens, for
    per-segment reductions and expansions with no atomics, no Python loop over segments, no
    ``[T]`` index tensor and no host synchronisation.

    Every token of segment ``n = [a, b)`` lies in exactly one of three parts: a *full chunk*
    (``C`` consecutive tokens starting at a multiple of ``C``, all inside ``[a, b)``), the *head*
    ``[a, min(fa, b))`` before the first full chunk (``fa`` = ``a`` rounded up to a multiple of
    ``C``), or the *tail* ``[max(fb, head end), b)`` after the last one (``fb`` = ``b`` rounded
    down). A reduction is then one contiguous ``[M, C]`` row reduction over the chunks (fast,
    vectorised), a scatter of the ``M = T // C`` chunk results to their segments, and one gather
    of the ``[2N, C]`` head and tail windows; an expansion is the mirror image (a broadcast write
    of every full chunk, one scatter into the windows). Sums accumulate only within their
    segment, so a segment's float64 sum does not depend on its neighbours' magnitudes. The chunk
    length is a host constant (:func:`chunk_size`), so the op count never depends on ``N`` and
    everything traces with ``torch.compile(fullgraph=True, dynamic=True)``.

    Attributes:
        num_tokens: ``T``.
        chunk: ``C``.
        num_chunks: ``M``.
        chunk_segment: ``[M]`` int64 segment of each full chunk, ``N`` (a discard slot) for a chunk
            that straddles a boundary.
        window: ``[2N, C]`` int64 token index of the head (rows ``0..N-1``) and tail (rows
            ``N..2N-1``) windows (past the end of the part it may leave ``[0, T)``: read only
            where not ``window_invalid``, or through ``window_target``).
        window_target: ``[2N * C]`` int64 — ``window`` where valid, ``T - 1`` elsewhere (the last
            token doubles as the discard slot of an expansion, which rewrites it afterwards).
        last_segment: ``[1]`` int64 — the segment holding token ``T - 1`` (0 when ``T = 0``).
        reduce_target: ``[M + 2N]`` int64 — ``chunk_segment``, then ``0..N-1`` twice: the segment
            (or the discard slot ``N``) of every chunk, head window and tail window result, so
            that a reduction combines all three in one scatter (chunks first, then heads, then
            tails: the order of the separate additions it replaces).
        window_invalid: ``[2N, C]`` bool — the window position is not a token of the part (what
            the reductions mask out).
    """

    num_tokens: int
    chunk: int
    num_chunks: int
    chunk_segment: torch.Tensor
    window: torch.Tensor
    window_target: torch.Tensor
    last_segment: torch.Tensor
    reduce_target: torch.Tensor
    window_invalid: torch.Tensor

    @property
    def num_segments(self) -> int:
        return int(self.window.shape[0]) // 2

    def sums(self, columns: Sequence[torch.Tensor], float64: bool = True, exact: int = 0) -> torch.Tensor:
        """``K x [T] -> [N, K]`` float64 per-segment sums of FINITE columns (a transposed view of
        a ``[K, N]`` block: each column ``[:, k]`` is contiguous).

        With ``float64`` (the default) the columns are summed in float64 (torch converts the
        ``[K, M, C]`` chunk block for the reduction): where the batch places a segment (its chunk
        alignment) changes its sum only by float64 rounding. The first ``exact`` columns are 0/1
        float32 counts: their chunks are summed in float32, which is exact and spares their
        float64 copy (the largest memory cost of the call on a CPU). ``float64=False`` sums each
        chunk in the column's own dtype (torch's cascade summation). Windows are summed in
        float64 (or the own dtype). Booleans count."""
        n = self.num_segments
        device = self.window.device
        f64 = torch.float64
        if not columns:
            return torch.zeros(n, 0, dtype=f64, device=device)
        m, c = self.num_chunks, self.chunk
        # columns of one dtype are reduced together as a [K, T] block: a handful of ops per
        # dtype instead of ~8 per column (every op is a kernel launch on an accelerator)
        groups: dict[torch.dtype, list[int]] = {}
        for k, col in enumerate(columns):
            groups.setdefault(torch.float32 if col.dtype == torch.bool else col.dtype, []).append(k)
        pieces, order = [], []
        for dtype, ks in groups.items():
            cols = [columns[k].view(torch.uint8).to(torch.float32) if columns[k].dtype == torch.bool else columns[k] for k in ks]
            block = torch.stack(cols, 0) if len(cols) > 1 else cols[0].unsqueeze(0)  # [K, T]
            acc = f64 if float64 else dtype
            chunked = block[:, : m * c].view(len(ks), m, c)
            counts = sum(1 for k in ks if k < exact) if float64 and dtype == torch.float32 else 0
            if 0 < counts < len(ks):  # counts in their own float32 (no float64 copy), then values
                chunks = torch.cat([chunked[:counts].sum(2), chunked[counts:].sum(2, dtype=f64)])  # [K, M]
            else:
                chunks = chunked.sum(2, dtype=dtype if counts else acc).to(f64)  # [K, M]
            if self.num_tokens:  # the head and tail windows, 0 at positions outside their part
                win = block.index_select(1, self.window_target).view(len(ks), 2 * n, c)
                windows = win.masked_fill(self.window_invalid, 0.0).sum(2, dtype=acc).to(f64)  # [K, 2N]
            else:
                windows = torch.zeros(len(ks), 2 * n, dtype=f64, device=device)
            out = torch.zeros(len(ks), n + 1, dtype=f64, device=device)
            out.index_add_(1, self.reduce_target, torch.cat([chunks, windows], 1))  # [K, N+1]
            pieces.append(out[:, :n])
            order.extend(ks)
        result = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]  # [K, N] in group order
        if order != sorted(order):
            inverse = [0] * len(order)
            for pos, k in enumerate(order):
                inverse[k] = pos
            result = result.index_select(0, to_device(torch.tensor(inverse, dtype=torch.long), device))
        return result.t()

    def mins(self, columns: Sequence[torch.Tensor], fill: float) -> torch.Tensor:
        """``K x [T] -> [N, K]`` per-segment minima in the columns' dtype (``fill`` for empty
        segments; give excluded tokens the value ``fill`` beforehand)."""
        return self._extremes(columns, fill, "amin")

    def maxs(self, columns: Sequence[torch.Tensor], fill: float) -> torch.Tensor:
        """``K x [T] -> [N, K]`` per-segment maxima (as :meth:`mins`)."""
        return self._extremes(columns, fill, "amax")

    def _extremes(self, columns: Sequence[torch.Tensor], fill: float, how: str) -> torch.Tensor:
        n = self.num_segments
        device = self.window.device
        dtype = columns[0].dtype if columns else torch.float32
        if not columns:
            return torch.zeros(n, 0, dtype=dtype, device=device)
        if any(col.dtype != dtype for col in columns):
            raise TypeError(f"columns of one extremes call must share a dtype, got {[col.dtype for col in columns]}")
        m, c = self.num_chunks, self.chunk
        k = len(columns)
        block = torch.stack(list(columns), 0) if k > 1 else columns[0].unsqueeze(0)  # [K, T], one op for all
        reduce = torch.amin if how == "amin" else torch.amax
        chunks = reduce(block[:, : m * c].view(k, m, c), 2)  # [K, M]
        if self.num_tokens:
            win = block.index_select(1, self.window_target).view(k, 2 * n, c)
            windows = reduce(win.masked_fill(self.window_invalid, fill), 2)  # [K, 2N]
        else:
            windows = torch.full((k, 2 * n), fill, dtype=dtype, device=device)
        out = torch.full((k, n + 1), fill, dtype=dtype, device=device)
        target = self.reduce_target.unsqueeze(0).expand(k, -1)
        out.scatter_reduce_(1, target, torch.cat([chunks, windows], 1), how)  # [K, N+1]
        return out[:, :n].t()

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """``[N] -> [T]`` (or ``[S, N] -> [S, T]``, contiguous): each segment's value repeated
        over its tokens — a broadcast write of the full chunks, one scatter into the head and
        tail windows (every token is written by one of the two; invalid window positions land
        on the last token, which is written again at the end).

        Under ``torch.compile`` this runs as one opaque op (:func:`_expand_op`): inductor's CPU
        code for the broadcast write is a scalar loop with an integer division per element
        (32 ms for 16 rows of 543k tokens, against about 3 ms eager)."""
        rows = per_segment.dim() == 2
        values = per_segment if rows else per_segment.unsqueeze(0)
        expand = _expand_op if is_compiling() else _expand_eager
        out = expand(values, self.chunk_segment, self.window_target, self.last_segment, self.num_tokens, self.chunk)
        return out if rows else out[0]


def _expand_eager(
    values: torch.Tensor, chunk_segment: torch.Tensor, window_target: torch.Tensor, last_segment: torch.Tensor, t: int, c: int
) -> torch.Tensor:
    """``[S, N] -> [S, T]`` contiguous: :meth:`SegmentLayout.expand`."""
    s, n = values.shape
    m = t // c
    out = values.new_empty(s, t)
    if not t:
        return out
    if m:
        # value of the discard slot N: anything (straddling chunks are overwritten by windows)
        source = values.index_select(1, chunk_segment.clamp(max=n - 1))  # [S, M]
        out[:, : m * c].view(s, m, c).copy_(source.unsqueeze(2).expand(s, m, c))
    if n:
        row_values = torch.cat([values, values], 1)  # [S, 2N]: head rows, then tail rows
        # a scatter along dim 1 (every row the same targets): ~3x faster than an index_put on a
        # CPU. Invalid window positions all land on the last token, which is then rewritten.
        target = window_target.unsqueeze(0).expand(s, -1)
        out.scatter_(1, target, row_values.unsqueeze(2).expand(s, 2 * n, c).reshape(s, 2 * n * c))
        out[:, t - 1 :].copy_(values.index_select(1, last_segment))
    return out


def _expand_shape(
    values: torch.Tensor, chunk_segment: torch.Tensor, window_target: torch.Tensor, last_segment: torch.Tensor, t: int, c: int
) -> torch.Tensor:
    return values.new_empty(values.shape[0], t)


@opaque_op("segment_expand", _expand_shape)
def _expand_op(
    values: torch.Tensor, chunk_segment: torch.Tensor, window_target: torch.Tensor, last_segment: torch.Tensor, t: int, c: int
) -> torch.Tensor:
    return _expand_eager(values, chunk_segment, window_target, last_segment, t, c)


def segment_layout(cu_seqlens: torch.Tensor, num_tokens: int, chunk: int | None = None) -> SegmentLayout:
    """The :class:`SegmentLayout` of ``cu_seqlens [N+1]`` (int64, on the tokens' device) over
    ``num_tokens`` tokens; ``chunk`` defaults to :func:`chunk_size`. ``O(M log N + N C)`` work,
    no ``[T]`` tensor, no host synchronisation."""
    n = int(cu_seqlens.shape[0]) - 1
    c = chunk_size(num_tokens, n) if chunk is None else int(chunk)
    m = num_tokens // c
    device = cu_seqlens.device
    if m:
        # the segment holding a token: the last n with cu[n] <= t (skips empty segments), here
        # one more than that for the first and the last token of every chunk
        first = torch.searchsorted(cu_seqlens, torch.arange(0, m * c, c, device=device), right=True)
        last = torch.searchsorted(cu_seqlens, torch.arange(c - 1, m * c, c, device=device), right=True)
        chunk_segment = (first - 1).masked_fill_(first != last, n)
    else:
        chunk_segment = torch.zeros(0, dtype=torch.long, device=device)
    a, b = cu_seqlens[:-1], cu_seqlens[1:]
    if c & (c - 1) == 0:  # rounded up / down to a multiple of a power of two: a bit mask (offsets >= 0)
        fa = (a + (c - 1)).bitwise_and_(-c)
        fb = b.bitwise_and(-c)
    else:
        fa = torch.div(a + (c - 1), c, rounding_mode="floor") * c
        fb = torch.div(b, c, rounding_mode="floor") * c
    head_end = torch.minimum(fa, b)
    tail_start = torch.maximum(fb, head_end)
    part_starts = torch.cat([a, tail_start])  # [2N]
    part_ends = torch.cat([head_end, b])
    window = part_starts.unsqueeze(1) + torch.arange(c, device=device)  # [2N, C]
    window_invalid = window >= part_ends.unsqueeze(1)
    window_target = window.masked_fill(window_invalid, max(num_tokens - 1, 0)).reshape(-1)
    # the segment holding token T - 1: the number of segments that end before it (trailing empty
    # segments end at T); 0 for an empty batch
    last_segment = (b < num_tokens).sum(0, keepdim=True)
    segments = torch.arange(n, device=device)
    reduce_target = torch.cat([chunk_segment, segments, segments])
    return SegmentLayout(
        num_tokens, c, m, chunk_segment, window, window_target, last_segment, reduce_target, window_invalid
    )
