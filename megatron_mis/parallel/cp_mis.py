"""The MIS engine on context-parallel shards: exact, and cheap in communication.

Each CP rank holds pieces of every sequence (see :mod:`megatron_mis.parallel.layout`). Sequence
weights, vetoes, rejections, self-normalisation and sequence metrics need only per-sequence sums,
counts, minima and maxima, so :func:`compute_mis_cp` runs the engine on the local pieces and
exchanges the per-sequence statistics in **one all-gather** over the CP group (``N x 32``
float64 values per rank, whatever the sequence lengths: 26 sums, 3 minima, 3 maxima — the
``seq_max_*`` divergence criteria read the log-ratio extrema among them, so they need no second,
MAX-reducing collective), with this rank's **status** (11 float64: a fault code, its number of
pieces, the sequence at fault and details, a fingerprint of the lengths, the non-finite counts)
appended to the same buffer. Every rank then reduces the gathered statistics in the same rank
order, so all CP ranks derive bitwise-identical sequence decisions.

Faults never hang a rank. The buffer's size, ``N x 32 + 11``, comes from metadata every CP rank
holds identically — ``N = len(response_lengths)``, which slime and Miles pass unchanged to every
CP rank (the micro-batch's lengths, not the rank's pieces) — so every rank sends it WHATEVER its
data: a rank whose pieces are malformed, whose log-probs or loss masks hold NaN / inf under
``nonfinite_policy: error``, or that got no pieces at all sends its fault code and zeros. After
the all-gather every rank reads the gathered status column once — **the one host read of a CP
call** — and either all raise the same :class:`CPFaultError`, naming the rank(s) and the
sequence, or all go on with the statistics. The non-finite counts are computed on the device and
ride in the status, so ``nonfinite_policy: error`` adds no read of its own (the engine runs with
its local check off: a local raise would leave the peers waiting). The fingerprint (a hash of
``total_lengths`` and ``response_lengths``) turns ranks that were given the same number of
sequences but different lengths into the same error on every rank instead of silently wrong
weights.

What one collective cannot guard against: ranks given different NUMBERS of sequences (a host
that breaks the contract above) send buffers of different sizes, which aborts the process
(gloo: "Received data size doesn't match expected size") or hangs (NCCL). With
``MEGATRON_MIS_DEBUG_CHECKS=1`` (:mod:`megatron_mis.core.checks`) every call first all-gathers
the number of sequences in a fixed-size buffer (one more collective and one more read), so even
that case raises the same error on every rank. Without CP (the FSDP drop-in, CP = 1) nothing is
exchanged or read, except under ``nonfinite_policy: error``, which must read to raise.

The host needs the modified loss masks at FULL response length on every rank. Sequence-level
rejections are known everywhere after the statistics exchange; token-level rejections (token RS,
token-level IS masking, token criteria of ``rs_criteria``, rejected non-finite tokens; ``icepop``
rejects nothing) are known only where the token lives, so
when such rejection is configured and ``cp > 1`` one more collective — an all-reduce of a
``uint8`` bit per response token — completes the masks. So: **1** collective per call, **2**
with token-level rejection, whatever ``N``; nothing else crosses ranks; nothing runs per
sequence.

Gradients: none. The weights and masks are detached; the caller multiplies its local per-token
loss by the local weights.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.checks import debug_checks
from megatron_mis.core.engine import (
    MISResult,
    NormalizationStatistics,
    SequenceStatistics,
    StatsReducer,
    check_normalizer,
    compute_mis,
    normalization_statistics,
)
from megatron_mis.core.statistics import BIG, SequenceExtremum, SequenceSum
from megatron_mis.core.segments import concat_sequences, to_device
from megatron_mis.parallel.layout import CPLayout, LocalResponseLayout, check_max_seq_lens, local_response_layout, validate_lengths
from megatron_mis.parallel.state import GroupView

__all__ = ["CPFaultError", "CPInputs", "CPMISResult", "cp_stats_reducer", "compute_mis_cp", "cp_normalization_statistics"]


def _all_gather_into(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


#: columns of one sequence's statistics: ``len(SequenceSum)`` sums, then the minima and maxima
_STATS_WIDTH = len(SequenceSum) + 2 * len(SequenceExtremum)


def _pack(stats: SequenceStatistics, *extra: torch.Tensor) -> torch.Tensor:
    """``[N * 32 + len(extra)]``: the statistics row by row (sums, minima, maxima), then ``extra``."""
    body = torch.cat([stats.sums, stats.mins, stats.maxs], 1)
    return torch.cat([body.reshape(-1), *extra]) if extra else body.reshape(-1)


def _reduce_gathered(gathered: torch.Tensor, num_seqs: int, k: int, e: int) -> SequenceStatistics:
    """The reduction every rank runs on the same ``[cp, >= N * (k + 2e)]`` gathered buffer."""
    rows = gathered[:, : num_seqs * (k + 2 * e)].reshape(gathered.shape[0], num_seqs, k + 2 * e)
    return SequenceStatistics(
        sums=rows[..., :k].sum(0),
        mins=rows[..., k : k + e].amin(0),
        maxs=rows[..., k + e :].amax(0),
    )


def cp_stats_reducer(cp: GroupView) -> StatsReducer | None:
    """A reducer that all-gathers per-sequence statistics over ``cp.group`` (one collective) and
    combines them identically on every rank. ``None`` when ``cp.size == 1``.

    The bare reducer for callers of :func:`~megatron_mis.core.engine.compute_mis` that guarantee
    the same ``N`` on every rank themselves: it carries no status (:func:`compute_mis_cp` appends
    one to the same collective) and, with ``N = 0``, does not communicate. A rank holding no token
    of a sequence contributes zeros / empty extrema and still takes part.
    """
    if cp.size == 1:
        return None

    def reduce(stats: SequenceStatistics) -> SequenceStatistics:
        if stats.num_sequences == 0:  # the caller guarantees the same N on every rank: nobody communicates
            return stats
        k, e = stats.sums.shape[1], stats.mins.shape[1]
        local = _pack(stats)
        gathered = local.new_empty(cp.size * local.numel())
        _all_gather_into(gathered, local, cp.group)
        return _reduce_gathered(gathered.view(cp.size, -1), stats.num_sequences, k, e)

    return reduce


# ------------------------------------------------------------------------- fault status
_OK, _BAD_INPUT, _BAD_PIECE, _NONFINITE, _NONFINITE_MASK = 0, 1, 2, 3, 4
# The status row appended to the statistics (float64; every value an integer below 2**53, exact).
# The first six fields are host values; the last five are computed on the device (non-finite
# log-probs and mask values under nonfinite_policy='error', zeros otherwise).
(_CODE, _NUM_PIECES, _SEQ, _GOT, _EXPECTED, _FINGERPRINT,
 _NF_COUNT, _NF_SEQ, _MASK_NF_COUNT, _MASK_NF_SEQ, _MASK_NF_TOKEN) = range(11)
_HOST_FIELDS = 6
_STATUS_SIZE = 11
_FINGERPRINT_BITS = (1 << 52) - 1


class CPFaultError(ValueError):
    """Raised identically on every rank of a CP group when any rank's input is at fault."""


def _collective_device(cp: GroupView, fallback: torch.device) -> torch.device:
    if fallback.type != "cpu":
        return fallback
    try:
        if dist.get_backend(cp.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except (RuntimeError, ValueError, AssertionError):
        pass
    return fallback


def _agreed_count(inputs: "CPInputs") -> int:
    """``N`` as every CP rank of a micro-batch knows it: the number of ``response_lengths`` (the
    host's per-micro-batch metadata, the same on every CP rank), else of ``total_lengths``, else
    of the pieces. Only a rank whose input is at fault can reach the fallbacks."""
    for value in (inputs.response_lengths, inputs.total_lengths, inputs.rollout_log_probs):
        try:
            return len(value)
        except TypeError:
            continue
    return 0


class _StatusExchange:
    """The one collective of a CP call: this rank's statistics with its status appended
    (``N x 32 + 11`` float64, the size known to every rank from the host metadata), all-gathered
    over ``cp.group``, and the one host read of the gathered status column.

    Use: :meth:`resolve` (never raises for bad input: it records the fault), then either run the
    engine with :meth:`reduce` as its ``reduce_stats`` or, on a recorded fault, :meth:`fail`.
    Either way every rank of the group takes part in the same all-gather and raises the same
    :class:`CPFaultError` if any rank reported a fault.
    """

    def __init__(self, cp: GroupView, inputs: "CPInputs") -> None:
        self.cp = cp
        self.inputs = inputs
        self.num_seqs = _agreed_count(inputs)
        self.host = [float(_OK), float(_count(inputs)), 0.0, 0.0, 0.0, -1.0]
        self.on_device: torch.Tensor | None = None  # [5] float64: non-finite counts (policy 'error')
        self.local_error: BaseException | None = None
        self.sent = False
        self.num_collectives = 0

    def resolve(self, config: MISConfig, global_normalizer: Any = None):
        """``inputs.resolve(cp)``, or ``None`` with the fault recorded."""
        try:
            resolved = self.inputs.resolve(self.cp)
            _, train, rollout, local_mask, full_mask, _, local_lengths, resp = resolved
            if not train.is_floating_point() or not rollout.is_floating_point():
                raise TypeError(f"log-probs must be floating point, got {train.dtype} and {rollout.dtype}")
            if global_normalizer is not None and config.normalizes and config.tis_batch_normalize_scope == "global":
                check_normalizer(global_normalizer, rollout.device)  # host values only: no read
            total = _int_list("total_lengths", self.inputs.total_lengths, len(resp))
            self.host[_FINGERPRINT] = float(hash((tuple(resp), tuple(total))) & _FINGERPRINT_BITS)
            if config.nonfinite_policy == "error":
                self.on_device = _nonfinite_status(train, rollout, local_mask, full_mask, local_lengths, resp)
            return resolved
        except _PieceError as exc:
            self.record(_BAD_PIECE, exc, exc.seq, exc.got, exc.expected)
        except Exception as exc:  # whatever it is, the peers must hear of it (never hang them)
            self.record(_BAD_INPUT, exc)
        return None

    def record(self, code: int, exc: BaseException, seq: int = 0, got: int = 0, expected: int = 0) -> None:
        self.local_error = exc
        self.host[:_FINGERPRINT] = [float(code), float(_count(self.inputs)), float(seq), float(got), float(expected)]
        self.on_device = None

    def reduce(self, stats: SequenceStatistics) -> SequenceStatistics:
        """The engine's ``reduce_stats``: one all-gather of statistics and status, one read."""
        assert not self.sent, "one exchange per call"
        assert stats.num_sequences == self.num_seqs and stats.sums.shape[1] + 2 * stats.mins.shape[1] == _STATS_WIDTH
        self.sent = True
        home = stats.sums.device
        device = _collective_device(self.cp, home)
        if self.on_device is None:  # the whole status is host data: one pinned, non-blocking copy
            extra = [_on(torch.tensor(self.host + [0.0] * (_STATUS_SIZE - _HOST_FIELDS), dtype=torch.float64), device)]
        else:
            extra = [_on(torch.tensor(self.host, dtype=torch.float64), device), self.on_device.to(device)]
        if home != device:  # NCCL with statistics on the CPU
            stats = SequenceStatistics(stats.sums.to(device), stats.mins.to(device), stats.maxs.to(device))
        local = _pack(stats, *extra)
        gathered = local.new_empty(self.cp.size * local.numel()).view(self.cp.size, -1)
        _all_gather_into(gathered.view(-1), local, self.cp.group)
        self.num_collectives += 1
        k, e = stats.sums.shape[1], stats.mins.shape[1]
        reduced = _reduce_gathered(gathered, self.num_seqs, k, e)  # queued before the read: it overlaps
        _raise_on_fault(self.cp, _read_status(gathered), self.local_error)
        if home != device:
            reduced = SequenceStatistics(reduced.sums.to(home), reduced.mins.to(home), reduced.maxs.to(home))
        return reduced

    def fail(self) -> None:
        """After a recorded fault: send zeros of the agreed size with the fault, read, raise."""
        assert self.local_error is not None and not self.sent
        device = _collective_device(self.cp, _device_hint(self.inputs))
        n, s, e = self.num_seqs, len(SequenceSum), len(SequenceExtremum)
        zeros = torch.zeros(n, s, dtype=torch.float64, device=device)
        self.reduce(SequenceStatistics(zeros, torch.full((n, e), BIG, dtype=torch.float64, device=device),
                                       torch.full((n, e), -BIG, dtype=torch.float64, device=device)))
        raise AssertionError("unreachable: the status exchange raises on a recorded fault") from self.local_error

    def check_counts(self, device: torch.device) -> None:
        """``MEGATRON_MIS_DEBUG_CHECKS=1`` only: a fixed-size all-gather of ``N`` (one more
        collective and read), so that ranks given different numbers of sequences raise the same
        error instead of sending statistics of different sizes."""
        local = _on(torch.tensor([self.num_seqs, _count(self.inputs)], dtype=torch.long), _collective_device(self.cp, device))
        gathered = local.new_empty(self.cp.size * 2)
        _all_gather_into(gathered, local, self.cp.group)
        self.num_collectives += 1
        rows = gathered.view(self.cp.size, 2).cpu().tolist()  # the debug read
        if len({r[0] for r in rows}) > 1:
            raise CPFaultError(
                f"megatron-mis CP group of {self.cp.size} (this is rank {self.cp.rank}): the CP ranks disagree on the "
                "number of sequences in this micro-batch (response_lengths): "
                + ", ".join(f"rank {r} has {n}" for r, (n, _) in enumerate(rows))
                + " (every CP rank must pass the host's same lengths, its own pieces of the sequences)"
            )


def _read_status(gathered: torch.Tensor) -> list[list[int]]:
    """The one host read of a CP call: every rank's status row, as Python ints."""
    rows = gathered[:, -_STATUS_SIZE:].cpu().tolist()  # the documented read: raising needs to know
    return [[int(v) for v in row] for row in rows]


def _nonfinite_status(
    train: torch.Tensor, rollout: torch.Tensor, local_mask: torch.Tensor, full_mask: torch.Tensor,
    local_lengths: list[int], resp: list[int],
) -> torch.Tensor:
    """``[5]`` float64 on the data's device, without a read: the count of loss-mask tokens with
    NaN / inf log-probs among this rank's tokens and the sequence of the first; the count of NaN /
    inf values in the full loss masks, the sequence and the token of the first."""
    device = rollout.device
    zero = torch.zeros((), dtype=torch.long, device=device)
    count = seq = mask_count = mask_seq = mask_token = zero
    if train.numel():
        bad = _in_loss(local_mask) & ~(torch.isfinite(train) & torch.isfinite(rollout))
        count = bad.sum()
        first = torch.argmax(bad.to(torch.uint8)).reshape(1)  # the first True (0 when none)
        ends = _on(torch.tensor(_offsets(local_lengths)[1:], dtype=torch.long), device)
        seq = torch.searchsorted(ends, first, right=True).reshape(())
    if full_mask.is_floating_point() and full_mask.numel():
        bad = ~torch.isfinite(full_mask)
        mask_count = bad.sum()
        first = torch.argmax(bad.to(torch.uint8)).reshape(1)
        cu = _on(torch.tensor(_offsets(resp), dtype=torch.long), device)
        mask_seq = torch.searchsorted(cu[1:], first, right=True)
        mask_token = (first - cu.index_select(0, mask_seq)).reshape(())
        mask_seq = mask_seq.reshape(())
    return torch.stack([count, seq, mask_count, mask_seq, mask_token]).to(torch.float64)


def _raise_on_fault(cp: GroupView, rows: list[list[int]], local_error: BaseException | None) -> None:
    problems = []
    for rank, row in enumerate(rows):
        code, seq, got, expected = row[_CODE], row[_SEQ], row[_GOT], row[_EXPECTED]
        if code == _BAD_INPUT:
            problems.append(f"CP rank {rank}: invalid input ({'see its own error' if rank != cp.rank else local_error})")
        elif code == _BAD_PIECE and rank == cp.rank and local_error is not None:
            problems.append(f"CP rank {rank}: {local_error}")
        elif code == _BAD_PIECE:
            problems.append(f"CP rank {rank}: sequence {seq} has a local piece of {got} values where the layout holds {expected}")
        elif row[_MASK_NF_COUNT]:
            problems.append(f"CP rank {rank}: sequence {row[_MASK_NF_SEQ]}: {_mask_message(row[_MASK_NF_SEQ], row[_MASK_NF_TOKEN])}")
        elif row[_NF_COUNT]:
            problems.append(
                f"CP rank {rank}: {row[_NF_COUNT]} loss-mask token(s) with NaN or inf log-probs, the first in sequence "
                f"{row[_NF_SEQ]} (nonfinite_policy='error'; use 'neutralize' or 'reject' to continue)"
            )
    counts = [row[_NUM_PIECES] for row in rows]
    if len(set(counts)) > 1:
        problems.append(
            "the CP ranks disagree on the number of sequences in this micro-batch: "
            + ", ".join(f"rank {r} has {n}" for r, n in enumerate(counts))
            + " (every CP rank must pass the same sequences, its own pieces of them; an empty micro-batch on one rank?)"
        )
    prints = [row[_FINGERPRINT] for row in rows]
    if not problems and len(set(prints)) > 1:
        groups: dict[int, list[int]] = {}
        for r, f in enumerate(prints):
            groups.setdefault(f, []).append(r)
        problems.append(
            "the CP ranks were given different total_lengths / response_lengths (the same number of sequences): "
            + " vs ".join("ranks " + ", ".join(map(str, g)) for g in groups.values())
            + " (every CP rank must pass the host's same lengths)"
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

    Collectives over ``cp.group`` (none when ``cp.size == 1``): one all-gather of the
    per-sequence statistics with every rank's status appended (see the module docstring), read
    once on the host; plus, only if ``config.token_rejects``, one ``uint8`` all-reduce of the
    full-length rejection bits. One more fixed-size all-gather and read runs first under
    ``MEGATRON_MIS_DEBUG_CHECKS=1``. Every rank of the CP group must call this with the same
    sequences (their own pieces; the same ``response_lengths`` / ``total_lengths``); ranks holding
    no token of a sequence still take part, and a rank whose input is at fault still sends its
    status, so every rank raises the same :class:`CPFaultError`.
    """
    if not _exchanges(cp):
        resolved = _resolve_local(inputs, config, cp)
        exchange, engine_config, reducer = None, config, cp_stats_reducer(cp)
    else:
        exchange, resolved = _start_exchange(inputs, config, cp, global_normalizer)
        engine_config, reducer = _without_local_check(config), exchange.reduce
    lay, train, rollout, local_mask, full_mask, index, local_lengths, resp = resolved
    num_seqs = len(resp)
    cu = _offsets(local_lengths)
    try:
        result = compute_mis(
            train, rollout, local_mask, cu, engine_config,
            reduce_stats=reducer, global_normalizer=global_normalizer,
        )
    except Exception as exc:
        if exchange is None or exchange.sent:
            raise
        exchange.record(_BAD_INPUT, exc)  # failed before the exchange: the peers must still hear of it
        exchange.fail()
    result.config = config
    if exchange is not None:
        assert exchange.sent, "the engine called reduce_stats"
    collectives = 0 if exchange is None else exchange.num_collectives
    if cp.size > 1 and exchange is None:
        collectives = 1 if num_seqs else 0  # the bare reducer (no process group initialised)

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


def _exchanges(cp: GroupView) -> bool:
    """Whether this call talks to CP peers (``cp > 1`` with a process group initialised)."""
    return cp.size > 1 and dist.is_available() and dist.is_initialized()


def _start_exchange(inputs: CPInputs, config: MISConfig, cp: GroupView, global_normalizer: Any = None):
    """``(exchange, resolved inputs)``; on a fault of this rank, the exchange is sent and every
    rank raises (so this returns only with valid inputs)."""
    exchange = _StatusExchange(cp, inputs)
    if debug_checks():
        exchange.check_counts(_device_hint(inputs))
    resolved = exchange.resolve(config, global_normalizer)
    if resolved is None:
        exchange.fail()
    return exchange, resolved


def _without_local_check(config: MISConfig) -> MISConfig:
    """The engine's configuration under CP: with ``nonfinite_policy: error`` the engine would
    read and raise on this rank alone, leaving its peers in the collective; the count rides in
    the status instead, and with no non-finite token ``neutralize`` computes exactly what
    ``error`` does. A shallow copy with that one field changed (valid whenever ``error`` is; no
    re-validation, which costs ~0.4 ms per call)."""
    if config.nonfinite_policy != "error":
        return config
    engine_config = copy.copy(config)
    engine_config.nonfinite_policy = "neutralize"
    return engine_config


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


def _resolve_local(inputs: CPInputs, config: MISConfig, cp: GroupView):
    """``inputs.resolve(cp)`` with no peers to inform (CP = 1, or no process group): errors are
    raised here, on this rank."""
    resolved = inputs.resolve(cp)
    at = _nonfinite_mask_at(resolved[4], resolved[7]) if config.nonfinite_policy == "error" else None
    if at is not None:
        raise ValueError(_mask_message(*at))
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
    """Self-normalisation sum and count of these sequences (under CP one all-gather of the
    statistics with the status, read once, as in :func:`compute_mis_cp`). The result is
    identical on every CP rank; add it over micro-batches, then all-reduce over the data-parallel
    group WITHOUT context parallelism (see :mod:`megatron_mis.parallel.global_norm`)."""
    if not _exchanges(cp):
        _, train, rollout, local_mask, _, _, local_lengths, _ = _resolve_local(inputs, config, cp)
        return normalization_statistics(train, rollout, local_mask, _offsets(local_lengths), config, reduce_stats=cp_stats_reducer(cp))
    exchange, resolved = _start_exchange(inputs, config, cp)
    _, train, rollout, local_mask, _, _, local_lengths, _ = resolved
    try:
        stats = normalization_statistics(
            train, rollout, local_mask, _offsets(local_lengths), _without_local_check(config), reduce_stats=exchange.reduce
        )
    except Exception as exc:
        if exchange.sent:
            raise
        exchange.record(_BAD_INPUT, exc)
        exchange.fail()
    return stats
