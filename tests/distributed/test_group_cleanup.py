"""Megatron's ``destroy_model_parallel`` drops its process groups without destroying them; a
long-lived worker (the test pool's, the study's) that initialises Megatron's parallel state once per
case or run therefore grew by ~17 gloo groups and ~50 threads each time, and the machine's load
climbed with them. :func:`megatron_mis.testing.distributed.owned_process_groups` (used by
:func:`megatron_parallel` and the demo's ``megatron_state``) destroys them: the number of groups
and of threads returns to where it was, over two ranks."""

from __future__ import annotations

import gc
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


def _training_runs(release: bool, out_dir: str, runs: int) -> list[tuple[int, int]]:
    """``runs`` 2-step runs of the testbed's training (the staleness sweep's first none run, the
    study worker's path: ``megatron_state`` on a world of one) in this worker, with the group
    counts and threads after each; ``release=False`` turns off the release of Megatron's own
    references (what the worker did before)."""
    import megatron_mis.testing.distributed as harness
    from megatron_mis.testbed.demo.config import DemoConfig
    from megatron_mis.testbed.demo.train import run_rank
    from megatron_mis.testbed.study.config import StudyConfig
    from megatron_mis.testbed.study.runner import plan_sweep

    job = next(j for j in plan_sweep(StudyConfig(sweep="staleness", seeds=1, quick=True, out_dir=out_dir))
               if j.arm == "none")
    cfg = DemoConfig.from_dict({**job.config, "out_dir": out_dir, "steps": 2, "progress": False})
    kept = harness.release_megatron_group_references
    if not release:
        harness.release_megatron_group_references = lambda: None
    try:
        seen = []
        for _ in range(runs):
            run_rank(cfg)
            gc.collect()
            seen.append(_groups_and_threads())
        return seen
    finally:
        harness.release_megatron_group_references = kept


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_training_runs_leave_no_gloo_threads_behind(tmp_path):
    """A destroyed gloo group keeps its threads while anything references it, and Megatron-Core
    keeps two kinds of reference after ``destroy_model_parallel`` (an intra-partial data-parallel
    group it does not reset, ``RotaryEmbedding.forward``'s lru_cache of instances): a study worker
    gained three threads a run, ~160 after 36 runs. With
    :func:`~megatron_mis.testing.distributed.release_megatron_group_references` the groups and
    threads stay flat from the first run on; without it they grow by a group's threads each run."""
    with ProcessGroupPool(1) as pool:
        (clean,) = pool.run(_training_runs, True, str(tmp_path / "clean"), 3)
        (leaky,) = pool.run(_training_runs, False, str(tmp_path / "leaky"), 2)
    assert [g for g, _ in clean] == [clean[0][0]] * 3 and clean[2][1] == clean[1][1] == clean[0][1], clean
    assert leaky[1][1] >= leaky[0][1] + 3, leaky  # the check catches the leak it guards against
