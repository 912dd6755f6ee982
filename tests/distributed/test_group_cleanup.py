"""Megatron's ``destroy_model_parallel`` drops its process groups without destroying them; a
long-lived worker (the test pool's, the study's) that initialises Megatron's parallel state once per
case or run therefore grew by ~17 gloo groups and ~50 threads each time, and the machine's load
climbed with them. :func:`megatron_mis.testing.distributed.owned_process_groups` (used by
:func:`megatron_parallel` and the demo's ``megatron_state``) destroys them: the number of groups
and of threads returns to where it was, over two ranks."""

from __future__ import annotations

import os

import pytest

from megatron_mis.testing.distributed import ProcessGroupPool


@pytest.fixture(scope="module")
def pool2():
    with ProcessGroupPool(2) as pool:
        yield pool


def _groups_and_threads() -> tuple[int, int]:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))


def _cycles(leak: bool) -> list[tuple[int, int]]:
    from megatron.core import parallel_state as ps

    from megatron_mis.testing.distributed import megatron_parallel

    seen = [_groups_and_threads()]
    for _ in range(3):
        if leak:  # what megatron_parallel did before: Megatron's own init / destroy
            ps.initialize_model_parallel(tensor_model_parallel_size=2)
            ps.destroy_model_parallel()
        else:
            with megatron_parallel(tp=2):
                assert ps.get_tensor_model_parallel_world_size() == 2
        seen.append(_groups_and_threads())
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_megatron_parallel_leaves_no_groups_or_threads(pool2):
    clean = pool2.run(_cycles, False)
    for seen in clean:
        groups = [g for g, _ in seen]
        threads = [t for _, t in seen]
        assert groups[1:] == [groups[0]] * 3, seen
        assert max(threads[1:]) <= threads[1], seen  # the first cycle may start lazy threads; then flat
    leaky = pool2.run(_cycles, True)  # the rule catches the leak it guards against
    for seen in leaky:
        groups = [g for g, _ in seen]
        assert groups[3] - groups[0] >= 3 * 10, seen
        assert seen[3][1] > seen[1][1] + 20, seen


def test_pool_arguments_are_validated():
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        ProcessGroupPool(0)
    with pytest.raises(ValueError, match=r"backend='mpi': allowed 'gloo' or 'nccl'"):
        ProcessGroupPool(1, backend="mpi")
    import torch

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"backend='nccl' needs one GPU per rank: world_size={n + 1}, {n} visible"):
        ProcessGroupPool(n + 1, backend="nccl")


def _start_state() -> tuple[int, bool, bool]:
    import sys

    return os.getppid(), "megatron.core.parallel_state" in sys.modules, "megatron_mis.testing._preload" in sys.modules


def test_workers_are_forks_of_a_server_that_preloaded_torch_and_megatron():
    """Spawned workers imported torch and Megatron-Core each (8 ranks: ~30 s on 2 cores); the pool
    forks them from ``multiprocessing``'s fork server, which imported them once
    (``megatron_mis.testing._preload``). A worker's parent is that server, not this process, and
    a pool without ``cpu_compat`` (which imports Megatron itself) finds Megatron loaded."""
    with ProcessGroupPool(2, cpu_compat=False) as pool:
        states = pool.run(_start_state)
    parents = {parent for parent, _, _ in states}
    assert len(parents) == 1 and os.getpid() not in parents, (os.getpid(), states)
    assert all(megatron and preload for _, megatron, preload in states), states
