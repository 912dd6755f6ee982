"""Hypothesis strategies shared by the unit tests (test-only; the library never imports this)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

#: a float32 log-prob
finite_log_probs = st.floats(min_value=-8.0, max_value=0.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def sample_lists(draw, max_samples: int, max_len: int, min_samples: int = 0, mask_range: tuple[int, int] = (0, 1)):
    """``(train, rollout, masks)``: per-sample lists of ``[L]`` float32 log-probs and int64 mask
    values drawn from ``mask_range`` (inclusive), ``min_samples..max_samples`` samples of
    ``0..max_len`` tokens."""
    n = draw(st.integers(min_samples, max_samples))
    train, rollout, masks = [], [], []
    for _ in range(n):
        length = draw(st.integers(0, max_len))
        train.append(torch.tensor(draw(st.lists(finite_log_probs, min_size=length, max_size=length)), dtype=torch.float32))
        rollout.append(torch.tensor(draw(st.lists(finite_log_probs, min_size=length, max_size=length)), dtype=torch.float32))
        masks.append(torch.tensor(draw(st.lists(st.integers(*mask_range), min_size=length, max_size=length)), dtype=torch.int64))
    return train, rollout, masks
