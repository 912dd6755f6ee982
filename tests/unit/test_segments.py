"""SegmentLayout: per-segment sums, extrema and expansions through chunks and head/tail windows.

Tier 1: hand-derived layouts and values. Tier 2: random segmentations (empty segments, segments
shorter and longer than a chunk, a trailing partial chunk) against a per-segment loop.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mis.core.segments import chunk_size, segment_layout


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()), dtype=torch.long)


def test_hand_derived_layout_parts():
    # lengths 5, 0, 11 with C = 4: tokens 0-4 | (empty) | 5-15; chunks [0,4) [4,8) [8,12) [12,16)
    lay = segment_layout(_cu([5, 0, 11]), 16, chunk=4)
    assert (lay.chunk, lay.num_chunks) == (4, 4)
    # chunk 0 inside segment 0; chunk 1 straddles 0|2; chunks 2, 3 inside segment 2
    assert lay.chunk_segment.tolist() == [0, 3, 2, 2]
    rows = [lay.window[i][~lay.window_invalid[i]].tolist() for i in range(6)]
    # heads: seg 0 starts aligned ([0, 0)), seg 1 empty, seg 2 head [5, 8); tails: seg 0 [4, 5), seg 2 [16, 16)
    assert rows == [[], [], [5, 6, 7], [4], [], []]
    values = torch.arange(16, dtype=torch.float64)
    assert lay.sums([values])[:, 0].tolist() == [10.0, 0.0, sum(range(5, 16))]
    assert lay.mins([values], 99.0)[:, 0].tolist() == [0.0, 99.0, 5.0]
    assert lay.maxs([values], -1.0)[:, 0].tolist() == [4.0, -1.0, 15.0]
    assert lay.expand(torch.tensor([1.0, 2.0, 3.0])).tolist() == [1.0] * 5 + [3.0] * 11


def test_chunk_size_is_a_power_of_two_in_range():
    assert chunk_size(543_125, 256) == 128
    assert chunk_size(552_976, 4096) == 16
    assert chunk_size(0, 0) == 16 and chunk_size(10**9, 1) == 1024


def test_a_segment_sum_does_not_depend_on_its_neighbours_magnitude():
    """Sums accumulate only within their segment: a tiny segment beside huge ones keeps full
    float64 relative accuracy (a global prefix-sum difference would lose it)."""
    tiny = torch.full((300,), 1e-14, dtype=torch.float64)
    huge = torch.full((300,), 1e6, dtype=torch.float64)
    values = torch.cat([huge, tiny, huge])
    lay = segment_layout(_cu([300, 300, 300]), 900, chunk=16)
    got = lay.sums([values])[1, 0].item()
    assert got == pytest.approx(300 * 1e-14, rel=1e-12)


def test_empty_batch_and_no_segments():
    lay = segment_layout(_cu([]), 0)
    assert lay.sums([torch.zeros(0)]).shape == (0, 1)
    assert lay.expand(torch.zeros(0)).shape == (0,)
    lay = segment_layout(_cu([0, 0]), 0)
    assert lay.sums([torch.zeros(0)])[:, 0].tolist() == [0.0, 0.0]
    assert lay.mins([torch.zeros(0)], 7.0)[:, 0].tolist() == [7.0, 7.0]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=0, max_size=24),
    chunk=st.sampled_from([None, 16, 32, 64]),
    seed=st.integers(0, 2**16),
)
def test_matches_a_per_segment_loop(lengths, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    lay = segment_layout(_cu(lengths), total, chunk=chunk)
    cols = [torch.randn(total, generator=g, dtype=torch.float64), torch.rand(total, generator=g) > 0.5]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    sums = lay.sums(cols)
    mins = lay.mins([cols[0]], 1e30)
    maxs = lay.maxs([cols[0]], -1e30)
    for i, (a, n) in enumerate(zip(starts, lengths)):
        piece = cols[0][a : a + n]
        assert sums[i, 0].item() == pytest.approx(float(piece.sum()), abs=1e-12)
        assert sums[i, 1].item() == float(cols[1][a : a + n].sum())
        assert mins[i, 0].item() == (float(piece.min()) if n else 1e30)
        assert maxs[i, 0].item() == (float(piece.max()) if n else -1e30)
    # each full chunk's segment (the one holding all its tokens), or N where it straddles a
    # boundary: by definition, token by token
    owner = [i for i, n in enumerate(lengths) for _ in range(n)]
    c = lay.chunk
    want = [owner[k * c] if len(set(owner[k * c : (k + 1) * c])) == 1 else len(lengths) for k in range(total // c)]
    assert lay.chunk_segment.tolist() == want
    per_seq = torch.randn(len(lengths), generator=g)
    lens = torch.tensor(lengths, dtype=torch.long)
    assert torch.equal(lay.expand(per_seq), torch.repeat_interleave(per_seq, lens))
    block = torch.randn(3, len(lengths), generator=g)
    assert torch.equal(lay.expand(block), torch.repeat_interleave(block, lens, dim=1))
    flags = torch.rand(len(lengths), generator=g) > 0.5
    assert torch.equal(lay.expand(flags), torch.repeat_interleave(flags, lens))
