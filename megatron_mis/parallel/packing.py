"""Build per-context-parallel-rank model inputs from a list of token sequences (pure: no
process groups; only ``PackedSeqParams`` is imported from Megatron-Core, lazily).

Packed "thd" format under context parallelism (``cp``), the layout slime / Miles and Transformer
Engine use (DESIGN section 3):

- each sequence of ``L`` tokens is padded to ``L_pad = 2*cp*ceil(L / (2*cp))`` and cut into
  ``2*cp`` chunks of ``L_pad / (2*cp)``; rank ``r`` keeps chunks ``r`` and ``2*cp-1-r``;
- the local pieces are concatenated: ``tokens [1, T_local]`` with ``T_local = sum(L_pad) / cp``;
- ``PackedSeqParams.cu_seqlens_q_padded`` holds the GLOBAL padded offsets (what Megatron's rotary
  embedding and the core attention read), ``cu_seqlens_q`` the cumulative real lengths
  (Transformer Engine's convention), ``max_seqlen_q`` the longest padded sequence.

With ``cp == 1`` nothing is padded unless asked (``pad_to_multiple_of``) and the batch is the
plain packed stream. The padded "bshd" format splits the sequence dimension of a ``[B, S]``
batch the same zigzag way (:func:`zigzag_split`).

Every position carries its next-token label, so the log-prob of token ``t`` is read at position
``t-1`` on the rank holding that position; :meth:`PackedBatch.response_index` returns the local
positions of the response log-probs in exactly the order of
:func:`megatron_mis.parallel.layout.local_response_layout` (chunk 0 then chunk 1 per sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_mis.core.segments import to_device

__all__ = [
    "PackedBatch",
    "pack_sequences",
    "zigzag_thd_global_index",
    "zigzag_bshd_global_index",
    "zigzag_split",
    "pad_sequences",
]


def _as_long(seq: Any) -> torch.Tensor:
    t = seq if isinstance(seq, torch.Tensor) else torch.as_tensor(seq)
    if t.dim() != 1:
        raise ValueError(f"every sequence must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"token sequences must hold integer ids, got dtype {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.long)


def zigzag_thd_global_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Where each of ``cp_rank``'s local packed tokens sits in the global packed stream.

    Args:
        cu_seqlens_padded: ``[N+1]`` GLOBAL cumulative padded sequence lengths; every sequence
            length must be a multiple of ``2*cp_size`` (Megatron's ``cu_seqlens_q_padded``).
        cp_size, cp_rank: context-parallel size and rank.

    Returns:
        ``[cu_seqlens_padded[-1] // cp_size]`` int64 (CPU): the global stream index of every
        local token. Sequence ``n`` contributes its chunks ``cp_rank`` and
        ``2*cp_size-1-cp_rank`` of ``len_n / (2*cp_size)`` tokens, in that order.

    Raises:
        ValueError: a bad rank or a sequence length that is not a multiple of ``2*cp_size``.
    """
    _check_rank(cp_size, cp_rank)
    cu = cu_seqlens_padded.detach().to(device="cpu", dtype=torch.long)
    lengths = cu[1:] - cu[:-1]  # [N]
    unit = 2 * cp_size
    bad = torch.nonzero(lengths % unit).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"packed sequence {i} has padded length {int(lengths[i])}, not a multiple of "
            f"2*cp_size={unit}: pad every sequence (cu_seqlens_q_padded) to a multiple of 2*cp, "
            "e.g. with megatron_mis.parallel.packing.pack_sequences"
        )
    chunk = lengths // unit  # [N]
    local_len = 2 * chunk
    num_local = int(local_len.sum())
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), local_len, output_size=num_local)
    local_start = torch.cumsum(local_len, 0) - local_len
    j = torch.arange(num_local) - local_start[seq]  # index within this rank's piece of the sequence
    c = chunk[seq]
    pos = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return cu[:-1][seq] + pos


def zigzag_bshd_global_index(local_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[local_length]`` int64 global positions held by ``cp_rank`` when a sequence dimension of
    ``local_length * cp_size`` positions is split zigzag (``local_length`` must be even)."""
    from megatron_mis.parallel.layout import zigzag_position_ranges

    _check_rank(cp_size, cp_rank)
    if cp_size > 1 and local_length % 2:
        raise ValueError(f"the local sequence length under context parallelism must be even, got {local_length}")
    (s0, e0), (s1, e1) = zigzag_position_ranges(local_length * cp_size, cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(local_length)
    return torch.cat([torch.arange(s0, e0), torch.arange(s1, e1)])


def zigzag_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """``cp_rank``'s zigzag slice of ``x`` along ``dim`` (bshd: the sequence dimension, 1 for
    ``[B, S, ...]``). ``x.shape[dim]`` must be a multiple of ``2*cp_size``; the result has
    ``x.shape[dim] / cp_size`` positions: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``."""
    _check_rank(cp_size, cp_rank)
    if cp_size == 1:
        return x
    size = x.shape[dim]
    if size % (2 * cp_size):
        raise ValueError(
            f"zigzag_split: length {size} along dim {dim} is not a multiple of 2*cp_size={2 * cp_size}; "
            "pad it first (pad_sequences(..., pad_to_multiple_of=2*cp))"
        )
    index = zigzag_bshd_global_index(size // cp_size, cp_size, cp_rank).to(x.device)
    return x.index_select(dim, index)


def pad_sequences(
    sequences: Sequence[Any], *, pad_token_id: int = 0, pad_to_multiple_of: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad sequences into a ``[B, S]`` int64 batch; ``S`` is the longest length rounded up
    to ``pad_to_multiple_of`` (``2*cp`` for a zigzag bshd split). Returns ``(tokens [B, S],
    lengths [B])``."""
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be >= 1")
    seqs = [_as_long(s) for s in sequences]
    if not seqs:
        raise ValueError("pad_sequences needs at least one sequence")
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long)
    s_max = int(lengths.max())
    s_max = -(-s_max // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(seqs), s_max), int(pad_token_id), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
    return out, lengths


@dataclass(frozen=True)
class PackedBatch:
    """One CP rank's packed (thd) model input.

    Attributes:
        tokens: ``[1, T_local]`` int64 input ids (padding = ``pad_token_id``).
        position_ids: ``[1, T_local]`` int64 position of each token within its sequence.
        labels: ``[1, T_local]`` int64 next token of each position (``pad_token_id`` where the
            next position is padding or past the sequence).
        label_mask: ``[1, T_local]`` bool: the label is a real token of the same sequence.
        packed_seq_params: Megatron ``PackedSeqParams`` (``qkv_format="thd"``, GLOBAL
            ``cu_seqlens_q/kv`` real and ``cu_seqlens_q/kv_padded`` padded offsets, int32).
        global_index: ``[T_local]`` int64 index of each local token in the global padded stream.
        sequence_ids: ``[T_local]`` int64 sequence of each token (``num_sequences`` for the
            trailing stream padding).
        lengths: ``[N]`` int64 real sequence lengths.
        cu_seqlens_padded: ``[N+1]`` (``[N+2]`` with stream padding) int64 global padded offsets.
        cp_size, cp_rank: the split this batch was built for.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    packed_seq_params: Any
    global_index: torch.Tensor
    sequence_ids: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cp_size: int
    cp_rank: int

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_local_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def response_index(self, response_lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``[T_resp_local]`` int64 local positions whose labels are response tokens: the
        positions ``t-1`` of response tokens ``t``, per sequence in local order (chunk 0, then
        chunk 1), matching :func:`megatron_mis.parallel.layout.local_response_layout` with
        ``layout="thd"``. Gather per-position log-probs at these indices to get this rank's
        local response pieces, sequences concatenated."""
        resp = torch.as_tensor(response_lengths, dtype=torch.long).flatten()
        if resp.numel() != self.num_sequences:
            raise ValueError(f"got {resp.numel()} response lengths for {self.num_sequences} sequences")
        if bool((resp < 0).any()) or bool((resp > self.lengths - 1).any()):
            bad = int(torch.nonzero((resp < 0) | (resp > self.lengths - 1)).flatten()[0])
            raise ValueError(
                f"sequence {bad}: response_length={int(resp[bad])} must lie in "
                f"[0, total_length-1={int(self.lengths[bad]) - 1}]"
            )
        seq = self.sequence_ids
        real = seq < self.num_sequences
        seq_c = seq.clamp_max(self.num_sequences - 1)
        pos = self.position_ids[0]
        prompt = self.lengths - resp
        keep = real & (pos >= prompt[seq_c] - 1) & (pos <= self.lengths[seq_c] - 2)
        return torch.nonzero(keep).flatten()


def pack_sequences(
    sequences: Sequence[Any],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    slot_length: int | None = None,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack ``sequences`` (1-D integer tensors or lists, prompt + response) into ``cp_rank``'s
    thd input for a GPTModel under context parallelism ``cp_size``.

    Args:
        sequences: ``N`` token sequences, each ``[L_n]``.
        cp_size, cp_rank: context-parallel size and this rank (every rank calls this with the
            same sequences and its own rank).
        pad_token_id: id written into padding positions.
        pad_to_multiple_of: pad the LOCAL stream to a multiple of this (e.g. the TP size with
            sequence parallelism); the padding forms one extra trailing segment in
            ``cu_seqlens`` (as slime does). Under CP the multiple is rounded up to an even one.
        slot_length: pad EVERY sequence to this many tokens (rounded up to a multiple of
            ``2*cp``): a layout that does not depend on the generated lengths, the one the
            rollout engine's true-on-policy path reproduces at every decoding step.
        device: where the tensors the model reads go (tokens, position ids, labels, label mask,
            the ``cu_seqlens`` of ``packed_seq_params``; default CPU): copied from pinned memory
            without blocking, so packing never waits for the device. The sequences are host data
            (token ids from the rollout); the layout tensors (``global_index``, ``sequence_ids``,
            ``lengths``, ``cu_seqlens_padded``) stay on the host, where the layout code reads them.

    Returns:
        :class:`PackedBatch`.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    _check_rank(cp_size, cp_rank)
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be >= 1")
    seqs = [_as_long(s) for s in sequences]
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    for i, s in enumerate(seqs):
        if s.numel() == 0:
            raise ValueError(f"sequence {i} is empty")
    n = len(seqs)
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long)
    unit = 2 * cp_size if cp_size > 1 else 1
    padded = -(-lengths // unit) * unit  # [N]
    if slot_length is not None:
        too_long = torch.nonzero(lengths > slot_length).flatten()
        if too_long.numel():
            i = int(too_long[0])
            raise ValueError(f"sequence {i} has {int(lengths[i])} tokens, more than slot_length={slot_length}")
        padded = torch.full_like(lengths, -(-int(slot_length) // unit) * unit)
    seg_lengths = padded.tolist()
    local_total = int(padded.sum()) // cp_size
    local_multiple = pad_to_multiple_of if cp_size == 1 else math.lcm(pad_to_multiple_of, 2)
    stream_pad = (-local_total) % local_multiple  # local tokens of the trailing padding segment
    if stream_pad:
        seg_lengths.append(stream_pad * cp_size)
    cu_padded = torch.tensor([0] + seg_lengths, dtype=torch.long).cumsum(0)  # [N+1] or [N+2]

    # The global padded stream (tokens, positions, labels), then this rank's zigzag slice.
    total = int(cu_padded[-1])
    g_tokens = torch.full((total,), int(pad_token_id), dtype=torch.long)
    g_labels = torch.full((total,), int(pad_token_id), dtype=torch.long)
    g_label_mask = torch.zeros(total, dtype=torch.bool)
    g_pos = torch.zeros(total, dtype=torch.long)
    g_seq = torch.full((total,), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        a, length, width = int(cu_padded[i]), s.numel(), seg_lengths[i]
        g_tokens[a : a + length] = s
        g_labels[a : a + length - 1] = s[1:]
        g_label_mask[a : a + length - 1] = True
        g_pos[a : a + width] = torch.arange(width)
        g_seq[a : a + width] = i
    if stream_pad:
        a = int(cu_padded[n])
        g_pos[a:] = torch.arange(total - a)
    index = zigzag_thd_global_index(cu_padded, cp_size, cp_rank) if cp_size > 1 else torch.arange(total)

    cu_real = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    if stream_pad:
        cu_real = torch.cat([cu_real, cu_real[-1:] + stream_pad * cp_size])
    dev = torch.device(device) if device is not None else torch.device("cpu")
    # every tensor the model reads goes to the device pinned and non-blocking (no host wait);
    # the layout tensors the host reads (global_index, sequence_ids, lengths, cu_seqlens_padded)
    # stay host data
    cu_real32 = to_device(cu_real.to(torch.int32), dev)
    cu_pad32 = to_device(cu_padded.to(torch.int32), dev)
    max_seqlen = int((cu_padded[1:] - cu_padded[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real32,
        cu_seqlens_kv=cu_real32,
        cu_seqlens_q_padded=cu_pad32,
        cu_seqlens_kv_padded=cu_pad32,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    return PackedBatch(
        tokens=to_device(g_tokens[index].unsqueeze(0), dev),
        position_ids=to_device(g_pos[index].unsqueeze(0), dev),
        labels=to_device(g_labels[index].unsqueeze(0), dev),
        label_mask=to_device(g_label_mask[index].unsqueeze(0), dev),
        packed_seq_params=params,
        global_index=index,
        sequence_ids=g_seq[index],
        lengths=lengths,
        cu_seqlens_padded=cu_padded,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} must lie in [0, {cp_size})")
