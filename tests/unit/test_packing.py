"""Per-CP-rank packed inputs: hand-derived layouts, consistency with the response-layout
arithmetic of megatron_mis.parallel.layout, and the zigzag bshd split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mis.parallel.packing import (
    pack_sequences,
    pad_sequences,
    zigzag_bshd_global_index,
    zigzag_split,
    zigzag_thd_global_index,
)
from megatron_mis.parallel.layout import local_response_layout


def test_cp1_is_the_plain_packed_stream():
    b = pack_sequences([[3, 4, 5], [6, 7]])
    assert b.tokens.tolist() == [[3, 4, 5, 6, 7]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert b.labels.tolist() == [[4, 5, 0, 7, 0]]
    assert b.label_mask.tolist() == [[True, True, False, True, False]]
    p = b.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_q_padded.tolist() == [0, 3, 5]
    assert p.max_seqlen_q == 3
    assert b.sequence_ids.tolist() == [0, 0, 0, 1, 1]


def test_cp2_hand_derived_layout():
    # lengths 5 and 2 -> padded to 8 and 4 (multiples of 2*cp=4), chunks of 2 and 1.
    seqs = [[10, 11, 12, 13, 14], [20, 21]]
    r0 = pack_sequences(seqs, cp_size=2, cp_rank=0, pad_token_id=1)
    r1 = pack_sequences(seqs, cp_size=2, cp_rank=1, pad_token_id=1)
    # rank 0: seq0 chunks 0 and 3 -> positions 0,1 and 6,7; seq1 chunks 0 and 3 -> 0 and 3
    assert r0.global_index.tolist() == [0, 1, 6, 7, 8, 11]
    assert r1.global_index.tolist() == [2, 3, 4, 5, 9, 10]
    assert r0.tokens.tolist() == [[10, 11, 1, 1, 20, 1]]
    assert r1.tokens.tolist() == [[12, 13, 14, 1, 21, 1]]
    assert r0.position_ids.tolist() == [[0, 1, 6, 7, 0, 3]]
    assert r1.labels.tolist() == [[13, 14, 1, 1, 1, 1]]
    assert r1.label_mask.tolist() == [[True, True, False, False, False, False]]
    for r in (r0, r1):
        p = r.packed_seq_params
        assert p.cu_seqlens_q_padded.tolist() == [0, 8, 12]  # GLOBAL padded offsets
        assert p.cu_seqlens_q.tolist() == [0, 5, 7]  # real lengths (TE convention)
        assert p.max_seqlen_q == 8


def test_stream_padding_forms_a_trailing_segment():
    seqs = [[1, 2, 3], [4]]
    b = pack_sequences(seqs, pad_to_multiple_of=8)
    assert b.num_local_tokens == 8
    assert b.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 3, 4, 8]
    assert b.sequence_ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    # under CP the local multiple is made even so the padding segment splits zigzag too
    for rank in range(2):
        c = pack_sequences(seqs, cp_size=2, cp_rank=rank, pad_to_multiple_of=3)
        assert c.num_local_tokens % 6 == 0
        lengths = c.cu_seqlens_padded[1:] - c.cu_seqlens_padded[:-1]
        assert bool((lengths % 4 == 0).all())


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_partition_the_stream(cp):
    seqs = [list(range(n)) for n in (1, 7, 8, 13)]
    indices = [pack_sequences(seqs, cp_size=cp, cp_rank=r).global_index for r in range(cp)]
    total = int(pack_sequences(seqs, cp_size=cp, cp_rank=0).cu_seqlens_padded[-1])
    assert sorted(torch.cat(indices).tolist()) == list(range(total))
    assert len({int(i.numel()) for i in indices}) == 1


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 11)), min_size=1, max_size=5),
    cp=st.integers(1, 4),
)
def test_response_index_matches_local_response_layout(data, cp):
    """The labels at response_index are exactly the response tokens local_response_layout assigns
    to this rank, in the same order."""
    totals = [t + 1 for t, _ in data]  # at least 2 tokens
    responses = [min(r, t - 1) for (t, r), t in zip(data, totals)]
    g = torch.Generator().manual_seed(sum(totals) + cp)
    seqs = [torch.randint(0, 50, (t,), generator=g) for t in totals]
    full_responses = torch.cat([s[t - r :] for s, t, r in zip(seqs, totals, responses)])
    for rank in range(cp):
        b = pack_sequences(seqs, cp_size=cp, cp_rank=rank)
        idx = b.response_index(responses)
        assert bool(b.label_mask[0, idx].all())
        layout = local_response_layout(totals, responses, cp, rank, layout="thd")
        expected = full_responses[layout.local_to_full_index()]
        assert torch.equal(b.labels[0, idx], expected)


def test_zigzag_thd_index_rejects_unpadded_lengths():
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp_size=4"):
        zigzag_thd_global_index(torch.tensor([0, 4, 10]), 2, 0)


def test_zigzag_bshd_split():
    x = torch.arange(2 * 8).reshape(2, 8)
    assert zigzag_bshd_global_index(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_bshd_global_index(4, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_split(x, 2, 1, dim=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert zigzag_split(x, 1, 0) is x
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=6"):
        zigzag_split(x, 3, 0, dim=1)


def test_pad_sequences():
    tokens, lengths = pad_sequences([[1, 2, 3], [4]], pad_token_id=9, pad_to_multiple_of=4)
    assert tokens.tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert lengths.tolist() == [3, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sequences=[[1], []]), "sequence 1 is empty"),
        (dict(sequences=[[1.0, 2.0]]), "integer ids"),
        (dict(sequences=[[1, 2]], cp_size=2, cp_rank=2), "cp_rank=2"),
        (dict(sequences=[[1, 2]], pad_to_multiple_of=0), "pad_to_multiple_of=0"),
        (dict(sequences=[]), "at least one sequence"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(**kwargs)


def test_response_index_rejects_bad_lengths():
    b = pack_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="response_length=3"):
        b.response_index([3])
    with pytest.raises(ValueError, match="1 response lengths for 2"):
        pack_sequences([[1, 2], [3, 4]]).response_index([1])


def test_slot_length_gives_fixed_slots():
    b = pack_sequences([[1, 2, 3], [4, 5]], slot_length=5, pad_token_id=9)
    assert b.tokens.tolist() == [[1, 2, 3, 9, 9, 4, 5, 9, 9, 9]]
    assert b.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 5, 10]
    assert b.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5]
    assert b.response_index([2, 1]).tolist() == [0, 1, 5]
    # under CP the slot is rounded up to a multiple of 2*cp
    assert pack_sequences([[1, 2, 3]], slot_length=5, cp_size=2, cp_rank=0).cu_seqlens_padded.tolist() == [0, 8]
    with pytest.raises(ValueError, match="more than slot_length=2"):
        pack_sequences([[1, 2, 3]], slot_length=2)
