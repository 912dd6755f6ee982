"""Multi-process gloo harness for tests and benchmarks.

:class:`ProcessGroupPool` starts ``world_size`` worker processes once, initialises a gloo process
group in each (through a file store: no ports to pick, nothing to race for), and then runs many
functions on every rank: ``pool.run(fn, *args)`` returns the list of per-rank results. Starting
processes and importing Megatron-Core costs seconds per process, so a test module starts one
pool and runs all its cases in it, and the workers are forked from a fork server that imported
torch and Megatron-Core once (:mod:`megatron_mis.testing._preload`), not spawned.

Nothing hangs: a case that fails on one rank while others wait in a collective is bounded by the
pool's timeout, after which the pool is torn down (and restarted on the next ``run``) and the
failing rank's traceback is raised.

Functions given to ``run`` must be importable by qualified name (module-level functions).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "ProcessGroupPool", "RemoteError", "collective_calls", "megatron_parallel", "owned_process_groups",
    "release_megatron_group_references",
]

#: The torch.distributed entry points :func:`collective_calls` records.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "send", "recv", "isend", "irecv", "barrier", "all_gather_object", "broadcast_object_list",
)

#: What the fork server imports before it forks a worker (``multiprocessing``'s "forkserver" start
#: method: a worker is a fork of that clean server, never of the caller, so the caller's threads
#: and state do not reach it; the server starts once per calling process).
PRELOAD = ["megatron_mis.testing._preload"]


class RemoteError(RuntimeError):
    """A function raised on a worker rank; the message holds that rank's traceback."""


def _worker(
    rank: int, world_size: int, store: str, conn: Any, threads: int, timeout_s: float, cpu_compat: bool, backend: str = "gloo"
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    stack = contextlib.ExitStack()
    if cpu_compat:
        from megatron_mis.testing.cpu import cpu_compat as _cpu_compat

        stack.enter_context(_cpu_compat())
    conn.send(("ready", rank))
    with stack:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            fn, args, kwargs = msg
            try:
                conn.send(("ok", fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                conn.send(("err", f"rank {rank}:\n{traceback.format_exc()}"))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class ProcessGroupPool:
    """``world_size`` gloo ranks kept alive between calls.

    Args:
        world_size: number of ranks (2 cores here: keep it <= 8 and ``threads=1``).
        timeout: seconds a single ``run`` may take before the pool is torn down.
        threads: intra-op threads per rank.
        cpu_compat: install :func:`megatron_mis.testing.cpu.cpu_compat` in every worker.
        backend: ``"gloo"`` (default) or ``"nccl"`` (rank ``r`` on GPU ``r``; needs a GPU per rank).
    """

    def __init__(
        self, world_size: int, *, timeout: float = 180.0, threads: int = 1, cpu_compat: bool = True, backend: str = "gloo"
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be >= 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: allowed 'gloo' or 'nccl'")
        if backend == "nccl":
            import torch

            if world_size > torch.cuda.device_count():
                raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                                 f"{torch.cuda.device_count()} visible")
        self.backend = backend
        self.world_size = world_size
        self.timeout = timeout
        self.threads = threads
        self.cpu_compat = cpu_compat
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._tmp: str | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> "ProcessGroupPool":
        if self._procs:
            return self
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs (it keeps its imports)
        self._tmp = tempfile.mkdtemp(prefix="mis_pg_")
        store = os.path.join(self._tmp, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, store, child, self.threads, self.timeout, self.cpu_compat, self.backend),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(lambda msg: msg[0] == "ready", what="start-up")
        return self

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._procs, self._conns = [], []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "ProcessGroupPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises:
            RemoteError: with the traceback of the first rank that raised.
            TimeoutError: if not every rank answered within the pool's timeout (the pool is
                restarted on the next call).
        """
        self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(lambda msg: msg[0] in ("ok", "err"), what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, accept: Callable[[tuple], bool], what: str) -> list[Any]:
        results: list[Any] = [None] * len(self._conns)
        pending = set(range(len(self._conns)))
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout
        while pending:
            if time.monotonic() > deadline:
                self._kill()
                detail = ("\n" + errors[0]) if errors else ""
                raise TimeoutError(
                    f"{what}: ranks {sorted(pending)} did not answer within {self.timeout:.0f}s{detail}"
                )
            progressed = False
            for rank in list(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.01):
                    try:
                        msg = conn.recv()
                    except EOFError:
                        msg = ("err", f"rank {rank}: worker exited (code {proc.exitcode})")
                    pending.discard(rank)
                    progressed = True
                    if msg[0] == "err":
                        errors.append(msg[1])
                    elif accept(msg):
                        results[rank] = msg[1]
                elif not proc.is_alive():
                    pending.discard(rank)
                    errors.append(f"rank {rank}: worker died (exit code {proc.exitcode})")
            if errors and pending and not progressed:
                # Other ranks are probably blocked in a collective the failed rank never joined:
                # give them a short grace period, then tear the pool down.
                grace = time.monotonic() + 5.0
                while pending and time.monotonic() < grace:
                    for rank in list(pending):
                        if self._conns[rank].poll(0.05):
                            msg = self._conns[rank].recv()
                            pending.discard(rank)
                            if msg[0] == "err":
                                errors.append(msg[1])
                if pending:
                    self._kill()
                    raise RemoteError(errors[0] + f"\n(ranks {sorted(pending)} were still waiting; pool restarted)")
        if errors:
            raise RemoteError(errors[0])
        return results


@contextlib.contextmanager
def collective_calls() -> Iterator[list[str]]:
    """Record, in order, the name of every torch.distributed collective (:data:`COLLECTIVES`)
    called inside the block; the yielded list fills as they run. The originals are restored on
    exit."""
    import torch.distributed as dist

    calls: list[str] = []
    saved = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        setattr(dist, name, wrapper)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def owned_process_groups() -> Iterator[None]:
    """Destroy, on exit, every process group created inside the block.

    ``megatron.core.parallel_state.destroy_model_parallel`` drops Megatron's references to its
    groups but never destroys them, so every ``initialize_model_parallel`` on a long-lived world
    (a test pool's workers, the study's workers) left ~17 gloo groups and ~50 of their threads
    behind: after some runs a worker held a thousand threads, and the machine's load average
    reached 30 on two cores. Reads torch's registry of groups (``distributed_c10d._world.pg_map``,
    present since torch 1.13); where it is missing, nothing is destroyed."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    registry = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    before = set(registry) if registry is not None and dist.is_initialized() else None
    try:
        yield
    finally:
        if before is not None and dist.is_initialized():
            default = distributed_c10d._get_default_group()
            for group in [g for g in list(registry) if g not in before and g is not default]:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
            gc.collect()  # the models and losses of the block hold the groups in reference cycles


def release_megatron_group_references() -> None:
    """Drop the references to process groups that Megatron-Core keeps after
    ``destroy_model_parallel``: a destroyed gloo group keeps its three threads until its last
    reference goes, so a long-lived worker (the study's) gained three per run, ~160 threads after
    36 runs. Two holders, both in Megatron-Core 0.16.1's ``megatron.core``: ``parallel_state``'s
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its ``_GLOO`` twin, which
    ``destroy_model_parallel`` does not reset (it resets the expert ones), and the class-level
    ``functools.lru_cache`` on ``RotaryEmbedding.forward`` (and the YaRN variant's), which keeps up to
    32 instances, each with its context-parallel group (Megatron clears it itself when YaRN
    rebuilds its cache, for the same leak). Only modules already imported are touched; a name
    missing in another Megatron-Core version is skipped."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and not ps.model_parallel_is_initialized():
        for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
            if getattr(ps, name, None) is not None:
                setattr(ps, name, None)
    for module, cls in (("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
                        ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding")):
        forward = getattr(getattr(sys.modules.get(module), cls, None), "forward", None)
        clear = getattr(forward, "cache_clear", None)
        if clear is not None:
            clear()


@contextlib.contextmanager
def megatron_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    vpp: int | None = None,
    seed: int = 1234,
) -> Iterator[None]:
    """Initialise Megatron-Core's parallel state on the existing (gloo) default group, seed the
    global RNG identically on every rank, and destroy the state and its process groups again on
    exit (:func:`owned_process_groups`)."""
    import torch
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kwargs: dict[str, Any] = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    if vpp is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = vpp
    with owned_process_groups():
        ps.initialize_model_parallel(**kwargs)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            release_megatron_group_references()
