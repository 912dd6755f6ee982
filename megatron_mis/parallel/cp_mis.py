"""The MIS engine on context-parallel shards: exact, and cheap in communication.

Each CP rank holds pieces of every sequence (see :mod:`megatron_mis.parallel.layout`). Sequence
weights, vetoes, rejections, self-normalisation and sequence metrics need only per-sequence sums,
counts, minima and maxima, so :func:`compute_mis_cp` runs the engine on the local pieces and
exchanges the per-sequence statistics in **one all-gather** over the CP group (``N x 32``
float64 values per rank, whatever the sequence lengths: 26 sums, 3 minima, 3 maxima — the
``seq_max_*`` divergence criteria read the log-ratio extrema among them, so they need no second,
MAX-reducing collective). Every rank then reduces the gathered
statistics in the same rank order, so all CP ranks derive bitwise-identical sequence decisions.

Faults never hang a rank: before the statistics, every CP rank sends a fixed-size status
(``8`` int64: a fault code, its number of sequences, the sequence at fault and two details) in one
small all-gather, WHATEVER its data — malformed pieces, NaN log-probs or NaN / inf loss-mask
values under ``nonfinite_policy: error``, an empty micro-batch. A fixed size is what makes this possible: the
statistics' size depends on ``N``, and a collective whose sizes differ across ranks aborts the
process (gloo) or hangs. Every rank then raises the same error naming the rank(s) and the
sequence, or all go on to the statistics. Reading the status is one host synchronisation per call
under CP; without CP (the FSDP drop-in, CP = 1) nothing is exchanged or read.

The host needs the modified loss masks at FULL response length on every rank. Sequence-level
rejections are known everywhere after the statistics exchange; token-level rejections (token RS,
token-level IS masking, token criteria of ``rs_criteria``, rejected non-finite tokens; ``icepop``
rejects nothing) are known only where the token lives, so
when such rejection is configured and ``cp > 1`` one more collective — an all-reduce of a
``uint8`` bit per response token — completes the masks. Nothing else crosses ranks; nothing runs
per sequence.

Gradients: none. The weights and masks are detached; the caller multiplies its local per-token
loss by the local weights.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import (
    MISResult,
    NormalizationStatistics,
    SequenceStatistics,
    StatsReducer,
    compute_mis,
    normalization_statistics,
)
from megatron_mis.core.segments import concat_sequences, to_device
from megatron_mis.parallel.layout import CPLayout, LocalResponseLayout, check_max_seq_lens, local_response_layout, validate_lengths
from megatron_mis.parallel.state import GroupView

__all__ = ["CPFaultError", "CPInputs", "CPMISResult", "cp_stats_reducer", "compute_mis_cp", "cp_normalization_statistics"]


def _all_gather_into(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def cp_stats_reducer(cp: GroupView) -> StatsReducer | None:
    """A reducer that all-gathers per-sequence statistics over ``cp.group`` (one collective) and
    combines them identically on every rank. ``None`` when ``cp.size == 1``.

    All CP ranks of a micro-batch hold the same sequences, so ``N`` agrees across the group (the
    status exchange of :func:`compute_mis_cp` checks it first); a rank holding no token of a
    sequence contributes zeros / empty extrema and still takes part.
    """
    if cp.size == 1:
        return None

    def reduce(stats: SequenceStatistics) -> SequenceStatistics:
        if stats.num_sequences == 0:  # the same on every rank of the group (status checked): nobody communicates
            return stats
        k, e = stats.sums.shape[1], stats.mins.shape[1]
        local = torch.cat([stats.sums, stats.mins, stats.maxs], 1).contiguous()  # [N, k + 2e]
        gathered = local.new_empty((cp.size,) + tuple(local.shape))
        _all_gather_into(gathered.view(cp.size * local.shape[0], local.shape[1]), local, cp.group)
        return SequenceStatistics(
            sums=gathered[..., :k].sum(0),
            mins=gathered[..., k : k + e].amin(0),
            maxs=gathered[..., k + e :].amax(0),
        )

    return reduce


# ------------------------------------------------------------------------- fault status
_OK, _BAD_INPUT, _BAD_PIECE, _NONFINITE, _NONFINITE_MASK = 0, 1, 2, 3, 4
_STATUS_SIZE = 8


class CPFaultError(ValueError):
    """Raised identically on every rank of a CP group when any rank's input is at fault."""


def _collective_device(cp: GroupView, fallback: torch.device) -> torch.device:
    try:
        if dist.get_backend(cp.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except (RuntimeError, ValueError, AssertionError):
        pass
    return fallback


def _exchange_status(cp: GroupView, status: list[int], device: torch.device) -> list[list[int]]:
    """One fixed-size all-gather of every rank's status (``[cp, 8]`` int64), read on the host."""
    local = torch.tensor(status + [0] * (_STATUS_SIZE - len(status)), dtype=torch.long)
    local = _on(local, _collective_device(cp, device))  # pinned, non-blocking: the read below is the one wait
    gathered = local.new_empty(cp.size * _STATUS_SIZE)
    _all_gather_into(gathered, local, cp.group)
    rows = gathered.cpu().tolist()  # the one host read of a CP call: raising needs to know
    return [rows[i * _STATUS_SIZE : (i + 1) * _STATUS_SIZE] for i in range(cp.size)]


def _raise_on_fault(cp: GroupView, rows: list[list[int]], local_error: BaseException | None) -> None:
    counts = [row[1] for row in rows]
    problems = []
    for rank, (code, n, seq, a, b, *_) in enumerate(rows):
        if code == _BAD_INPUT:
            problems.append(f"CP rank {rank}: invalid input ({'see its own error' if rank != cp.rank else local_error})")
        elif code == _BAD_PIECE and rank == cp.rank and local_error is not None:
            problems.append(f"CP rank {rank}: {local_error}")
        elif code == _BAD_PIECE:
            problems.append(f"CP rank {rank}: sequence {seq} has a local piece of {a} values where the layout holds {b}")
        elif code == _NONFINITE_MASK:
            problems.append(f"CP rank {rank}: sequence {seq}: {_mask_message(seq, a)}")
        elif code == _NONFINITE:
            problems.append(
                f"CP rank {rank}: sequence {seq} has {a} loss-mask token(s) with NaN or inf log-probs "
                "(nonfinite_policy='error'; use 'neutralize' or 'reject' to continue)"
            )
    if len(set(counts)) > 1:
        problems.append(
            "the CP ranks disagree on the number of sequences in this micro-batch: "
            + ", ".join(f"rank {r} has {n}" for r, n in enumerate(counts))
            + " (every CP rank must pass the same sequences, its own pieces of them; an empty micro-batch on one rank?)"
        )
    if problems:
        err = CPFaultError(
            f"megatron-mis CP group of {cp.size} (this is rank {cp.rank}): " + "; ".join(problems)
        )
        if local_error is not None:
            raise err from local_error
        raise err


@dataclass
class CPInputs:
    """One micro-batch as a CP rank sees it.

    Attributes:
        train_log_probs: per sequence, this rank's local piece ``[t_i]`` of log pi_train, or
            ``None`` (no recomputed log-probs: pi_train := pi_rollout, every ratio is 1).
        rollout_log_probs: per sequence, this rank's local piece ``[t_i]`` of log pi_rollout.
        loss_masks: per sequence, the FULL response mask ``[R_i]`` (not CP-sliced).
        total_lengths: ``[N]`` prompt + response lengths.
        response_lengths: ``[N]`` response lengths.
        layout: ``"thd"``, ``"bshd"`` or ``"allgather"``.
        max_seq_lens: bshd only, per sequence (or one int).
        local_length: allgather only, tokens per rank of the padded packed stream.
    """

    train_log_probs: Sequence[torch.Tensor] | None
    rollout_log_probs: Sequence[torch.Tensor]
    loss_masks: Sequence[torch.Tensor]
    total_lengths: Sequence[int]
    response_lengths: Sequence[int]
    layout: CPLayout = "thd"
    max_seq_lens: Sequence[int] | int | None = None
    local_length: int | None = None

    def resolve(self, cp: GroupView) -> tuple[LocalResponseLayout | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], list[int]]:
        """Validate and flatten: ``(layout or None at CP = 1, train [T], rollout [T], local mask [T],
        full mask [R], local->full index [T] or None at CP = 1, local lengths [N], response
        lengths [N])`` — the lengths as Python ints.

        Raises:
            TypeError / ValueError: naming the argument, the sequence and what is allowed.
        """
        lay, train_list, rollout_list, masks, expected, resp = self.checked(cp)
        n = len(rollout_list)
        device = rollout_list[0].device if n else torch.device("cpu")
        rollout = concat_sequences(rollout_list, device)
        train = rollout if train_list is None else concat_sequences(train_list, device)
        full_mask = concat_sequences(masks, device)
        if full_mask.is_complex():
            raise TypeError(f"loss_masks must be bool, integer or real floating point tensors, got {full_mask.dtype}")
        if cp.size == 1:
            local_mask, index = full_mask, None
        else:
            index = _on(lay.local_to_full_index(), device)
            local_mask = full_mask.index_select(0, index) if full_mask.numel() else full_mask[:0]
        return lay, train, rollout, local_mask, full_mask, index, expected, resp

    def checked(self, cp: GroupView) -> tuple[LocalResponseLayout | None, Sequence[torch.Tensor] | None, Sequence[torch.Tensor], Sequence[torch.Tensor], list[int], list[int]]:
        """Validate without joining: ``(layout or None at CP = 1, train pieces or None, rollout
        pieces, full masks, local lengths [N], response lengths [N])``.

        Raises:
            TypeError / ValueError: naming the argument, the sequence and what is allowed.
        """
        rollout_list = _tensor_list("rollout_log_probs", self.rollout_log_probs)
        n = len(rollout_list)
        masks = _tensor_list("loss_masks", self.loss_masks)
        train_list = None if self.train_log_probs is None else _tensor_list("train_log_probs", self.train_log_probs)
        total = _int_list("total_lengths", self.total_lengths, n)
        resp = _int_list("response_lengths", self.response_lengths, n)
        if len(masks) != n:
            raise ValueError(f"got {n} rollout_log_probs but {len(masks)} loss_masks; one entry per sequence is needed")
        if train_list is not None and len(train_list) != n:
            raise ValueError(f"got {n} rollout_log_probs but {len(train_list)} train_log_probs")
        if self.layout not in ("thd", "bshd", "allgather"):
            raise ValueError(f"cp_layout / layout={self.layout!r} is not supported; valid: 'thd', 'bshd', 'allgather'")
        validate_lengths(total, resp)
        got = lengths_1d(rollout_list)
        if cp.size == 1:
            if self.layout == "bshd" and self.max_seq_lens is not None:
                check_max_seq_lens(self.max_seq_lens, total)  # rejected at every CP size alike
            lay, expected = None, resp
        else:
            lay = local_response_layout(
                total, resp, cp.size, cp.rank,
                layout=self.layout, max_seq_lens=self.max_seq_lens, local_length=self.local_length,
            )
            expected = lay.local_lengths.tolist()
        if got != expected:
            for i in range(n):
                if got[i] != expected[i]:
                    raise _PieceError(
                        i, got[i], expected[i],
                        f"sequence {i}: rollout_log_probs has {got[i] if got[i] >= 0 else tuple(rollout_list[i].shape)} values "
                        f"but CP rank {cp.rank}/{cp.size} ({self.layout}) holds {expected[i]} response tokens "
                        f"(total_length={total[i]}, response_length={resp[i]})",
                    )
        if train_list is not None:
            got_t = lengths_1d(train_list)
            if got_t != got:
                for i in range(n):
                    if got_t[i] != got[i]:
                        raise _PieceError(
                            i, int(train_list[i].numel()), got[i],
                            f"sequence {i}: train_log_probs has {train_list[i].numel()} values, rollout_log_probs {got[i]}",
                        )
        mask_lengths = lengths_1d(masks)
        if mask_lengths != resp:
            for i in range(n):
                if mask_lengths[i] != resp[i]:
                    raise ValueError(
                        f"sequence {i}: loss_mask has {masks[i].numel()} values but response_length is {resp[i]} "
                        f"(masks are full length, not CP-sliced; got shape {tuple(masks[i].shape)})"
                    )
        return lay, train_list, rollout_list, masks, expected, resp


class _PieceError(ValueError):
    """A local piece of the wrong length (carries the sequence and the lengths for the status)."""

    def __init__(self, seq: int, got: int, expected: int, message: str) -> None:
        super().__init__(message)
        self.seq, self.got, self.expected = seq, got, expected


def lengths_1d(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The length of each tensor, ``-1`` for one that is not 1-D (C-level ``map`` of C methods
    over the list: no per-sequence Python bytecode on the hot path; ``len`` would run
    ``Tensor.__len__`` in Python, ~1.5 us per tensor)."""
    if set(map(torch.Tensor.dim, tensors)) <= {1}:
        return list(map(torch.Tensor.numel, tensors))
    return [t.numel() if t.dim() == 1 else -1 for t in tensors]


def _tensor_list(name: str, value: Any) -> Sequence[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be a list with one 1-D tensor per sample, got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f" ({value!r:.60})")
        )
    # C-level type check first; anything else (a Parameter) takes the per-entry path
    if not set(map(type, value)) <= {torch.Tensor} and not all(isinstance(t, torch.Tensor) for t in value):
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__} ({t!r:.40})") from None
    return value


def _int_list(name: str, value: Any, n: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be {n} integers (a list or a 1-D integer tensor), got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.tolist()  # host data in the hosts' calls (lengths are Python lists there)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {n} integers, got {type(value).__name__} ({value!r:.60})")
    if len(value) != n:
        raise ValueError(f"got {n} rollout_log_probs but {len(value)} {name}; one entry per sequence is needed")
    if set(map(type, value)) <= {int}:  # C-level: the hosts pass lists of Python ints
        return list(value)
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or v is None or isinstance(v, (str, bytes)):
            raise TypeError(f"{name}[{i}]={v!r} must be an integer")
        if isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()):
            f = float(v)
            if not (math.isfinite(f) and f == int(f)):
                raise ValueError(f"{name}[{i}]={v!r} must be an integer (no fraction, NaN or inf)")
            out.append(int(f))
            continue
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{name}[{i}]={v!r:.40} must be an integer, got {type(v).__name__}") from None
    return out


@dataclass
class CPMISResult:
    """:class:`MISResult` of this rank's tokens plus what the hosts need.

    Attributes:
        result: the engine result over the local tokens (weights ``[T_local]`` aligned with the
            host's local ``pg_loss``; ``token_metrics`` likewise).
        modified_masks: per sequence, the FULL-length mask after rejection, identical on every
            CP rank, same dtype as the given mask.
        layout: the local layout used (``None`` at CP = 1, where every rank holds everything).
        num_collectives: collectives this call ran (for tests and benchmarks).
    """

    result: MISResult
    modified_masks: list[torch.Tensor]
    layout: LocalResponseLayout | None
    num_collectives: int


def compute_mis_cp(
    inputs: CPInputs,
    config: MISConfig,
    cp: GroupView,
    *,
    global_normalizer: torch.Tensor | float | None = None,
) -> CPMISResult:
    """Run the MIS engine on CP shards.

    Collectives over ``cp.group`` (none when ``cp.size == 1``): one fixed-size status all-gather
    (see the module docstring), one all-gather of the per-sequence statistics; plus, only if
    ``config.token_rejects``, one ``uint8`` all-reduce of the full-length rejection bits. Every
    rank of the CP group must call this with the same sequences (their own pieces); ranks holding
    no token of a sequence still take part, and a rank whose input is at fault still sends its
    status, so every rank raises the same :class:`CPFaultError`.
    """
    resolved = _resolve_with_status(inputs, config, cp)
    lay, train, rollout, local_mask, full_mask, index, local_lengths, resp = resolved
    num_seqs = len(resp)
    cu = _offsets(local_lengths)
    result = compute_mis(
        train, rollout, local_mask, cu, config,
        reduce_stats=cp_stats_reducer(cp), global_normalizer=global_normalizer,
    )
    collectives = 2 if cp.size > 1 and num_seqs else (1 if cp.size > 1 else 0)

    if cp.size == 1:
        full_keep = result.keep_mask  # local pieces are the full responses
    else:
        full_keep = _in_loss(full_mask)
        if num_seqs:
            full_seq_ids = torch.repeat_interleave(
                torch.arange(num_seqs, device=full_mask.device), _on(torch.tensor(resp), full_mask.device),
                output_size=int(full_mask.numel()),
            )
            full_keep = full_keep & ~result.seq_rejected.to(full_mask.device).index_select(0, full_seq_ids)
            if config.token_rejects and full_mask.numel():
                local_token_rejected = _in_loss(local_mask) & ~result.keep_mask
                bits = _scatter_bits(local_token_rejected, index, full_mask.numel()).to(torch.uint8)
                dist.all_reduce(bits, group=cp.group)  # each position is set by exactly one rank
                collectives += 1
                full_keep = full_keep & (bits == 0)
    # exactly 0 / 1 in the given dtype: no mask value passes through (a value > 0 is "in the loss")
    modified = full_keep if full_mask.dtype == torch.bool else full_keep.to(full_mask.dtype)
    masks = list(torch.split(modified, resp)) if resp else []
    return CPMISResult(result=result, modified_masks=masks, layout=lay, num_collectives=collectives)


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on ``device`` without blocking (pinned, non-blocking on CUDA)."""
    return to_device(host, device) if host.device.type == "cpu" else host.to(device)


def _in_loss(mask: torch.Tensor) -> torch.Tensor:
    """The documented exact conversion of a loss-mask value: in the loss iff > 0."""
    return mask if mask.dtype == torch.bool else mask > 0


def _nonfinite_mask_at(full_mask: torch.Tensor, response_lengths: list[int]) -> tuple[int, int] | None:
    """``(sample, token)`` of the first NaN / inf value of ``full_mask [R]`` (the samples' full
    masks concatenated), or ``None``. One host read: only ``nonfinite_policy: error`` calls it.
    Under the other policies a mask value is read exactly as ``value > 0`` (NaN is out, +inf in):
    the returned masks are 0 / 1, but a host that divides by the sums of its *original* masks
    still sees the NaN there."""
    if not full_mask.is_floating_point() or not full_mask.numel():
        return None
    bad = ~torch.isfinite(full_mask)
    if not bool(bad.any()):
        return None
    first = int(bad.nonzero()[0, 0])
    cu = _offsets(response_lengths)
    seq = bisect.bisect_right(cu, first) - 1
    return seq, first - cu[seq]


def _mask_message(seq: int, token: int) -> str:
    return (
        f"loss_masks[{seq}] holds a NaN or inf value at token {token}; loss masks are 0 / 1 "
        "(nonfinite_policy='error'; the other policies read a mask value as value > 0)"
    )


def _offsets(lengths: list[int]) -> list[int]:
    """``[N+1]`` offsets of ``[N]`` lengths (C-level ``itertools.accumulate``)."""
    return list(itertools.accumulate(lengths, initial=0))


def _resolve_with_status(inputs: CPInputs, config: MISConfig, cp: GroupView):
    """``inputs.resolve(cp)``; under CP, first every rank's status in one fixed-size all-gather,
    so a fault on any rank raises the same error on all of them instead of hanging the others."""
    if cp.size == 1 or not (dist.is_available() and dist.is_initialized()):
        resolved = inputs.resolve(cp)  # no peers to inform
        at = _nonfinite_mask_at(resolved[4], resolved[7]) if config.nonfinite_policy == "error" else None
        if at is not None:
            raise ValueError(_mask_message(*at))
        return resolved
    status, local_error, resolved = [_OK, 0], None, None
    try:
        resolved = inputs.resolve(cp)
        status = [_OK, len(resolved[7])]
        at = _nonfinite_mask_at(resolved[4], resolved[7]) if config.nonfinite_policy == "error" else None
        if at is not None:
            status = [_NONFINITE_MASK, len(resolved[7]), *at]
        elif config.nonfinite_policy == "error":
            _, train, rollout, local_mask, *_ = resolved
            bad = _in_loss(local_mask) & ~(torch.isfinite(train) & torch.isfinite(rollout))
            count = int(bad.sum())  # nonfinite_policy='error' must read it
            if count:
                first = int(bad.nonzero()[0, 0])
                seq = bisect.bisect_right(_offsets(resolved[6]), first) - 1
                status = [_NONFINITE, len(resolved[7]), seq, count]
    except _PieceError as exc:
        local_error = exc
        status = [_BAD_PIECE, _count(inputs), exc.seq, exc.got, exc.expected]
    except (TypeError, ValueError) as exc:
        local_error = exc
        status = [_BAD_INPUT, _count(inputs)]
    device = resolved[2].device if resolved is not None else _device_hint(inputs)
    rows = _exchange_status(cp, status, device)
    _raise_on_fault(cp, rows, local_error)
    return resolved


def _count(inputs: CPInputs) -> int:
    try:
        return len(inputs.rollout_log_probs)
    except TypeError:
        return -1


def _device_hint(inputs: CPInputs) -> torch.device:
    try:
        return inputs.rollout_log_probs[0].device
    except (TypeError, IndexError, AttributeError, KeyError):
        return torch.device("cpu")


def _scatter_bits(local_bits: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.bool, device=local_bits.device)
    if index.numel():
        out.index_copy_(0, index, local_bits)
    return out


def cp_normalization_statistics(inputs: CPInputs, config: MISConfig, cp: GroupView) -> NormalizationStatistics:
    """Self-normalisation sum and count of these sequences (the status and one statistics
    all-gather under CP). The result is identical on every CP rank; add it over micro-batches,
    then all-reduce over the data-parallel group WITHOUT context parallelism (see
    :mod:`megatron_mis.parallel.global_norm`)."""
    _, train, rollout, local_mask, _, _, local_lengths, _ = _resolve_with_status(inputs, config, cp)
    return normalization_statistics(train, rollout, local_mask, _offsets(local_lengths), config, reduce_stats=cp_stats_reducer(cp))
