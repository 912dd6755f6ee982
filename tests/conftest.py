"""Shared pytest fixtures: one gloo process pool per world size, started lazily per module."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")


@pytest.fixture(scope="module")
def pool2():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(4) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool8():
    from megatron_mis.testing.distributed import ProcessGroupPool

    with ProcessGroupPool(8, timeout=300.0) as pool:
        yield pool
