"""Run the demo on one machine: one process in place, or ``tp x cp x pp x dp`` processes on gloo.

Several processes are spawned (``multiprocessing`` "spawn"), meet through a file store in a
temporary folder (no port to pick), run :func:`megatron_mis.testbed.demo.train.run_rank` under
:func:`megatron_mis.testing.cpu.cpu_compat`, and the reporting rank's results come back through a
pipe. A rank that fails takes the others down (they would wait in a collective otherwise) and
its traceback is raised here.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from typing import Any

from megatron_mis.testbed.demo.config import DemoConfig

__all__ = ["launch", "DemoError"]

#: How long a collective may wait before gloo gives up (a failing rank is noticed sooner: the
#: parent tears the job down as soon as one process reports an error or dies).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class DemoError(RuntimeError):
    """A rank of the demo failed; the message holds its traceback."""


def _run_in_group(cfg: DemoConfig, rank: int, world: int, store: str):
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    import torch
    import torch.distributed as dist

    from megatron_mis.testbed.demo.train import run_rank
    from megatron_mis.testing.cpu import cpu_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    elif dist.get_world_size() != world:
        raise ValueError(f"torch.distributed already runs {dist.get_world_size()} ranks; this demo needs {world}")
    try:
        with cpu_compat():
            return run_rank(cfg)
    finally:
        torch.set_num_threads(threads)
        if owned:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def thread_lock_for_tqdm() -> None:
    """In a worker process this package spawned (a demo rank, a study worker), before any bar:
    give tqdm a thread lock instead of the multiprocessing RLock its first bar creates. That RLock
    is a named semaphore registered with the parent's resource tracker; a worker killed on a stop
    (Ctrl-C, SIGTERM, a failed rank) never unregisters it, so the tracker warned of "leaked
    semaphore objects" at the command's exit. A spawned worker shares its bars with no other
    process, so a thread lock is all tqdm needs there. Not for the user's own process."""
    try:
        from tqdm import tqdm
    except ImportError:  # no bar without tqdm either
        return
    import threading

    tqdm.set_lock(threading.RLock())


def _worker(cfg: DemoConfig, rank: int, world: int, store: str, conn: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)
    thread_lock_for_tqdm()
    try:
        conn.send(("ok", rank, _run_in_group(cfg, rank, world, store)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("err", rank, traceback.format_exc()))
    finally:
        conn.close()


def launch(cfg: DemoConfig):
    """Run ``cfg`` and return the reporting rank's list of
    :class:`~megatron_mis.testbed.demo.train.RunResult` (one per arm).

    Raises:
        DemoError: a rank raised (its traceback) or died.
    """
    tmp = tempfile.mkdtemp(prefix="megatron_mis_demo_")
    store = os.path.join(tmp, "store")
    try:
        if cfg.world_size == 1:
            try:
                return _run_in_group(cfg, 0, 1, store)
            except Exception as exc:
                raise DemoError(f"the demo failed: {exc}") from exc
        return _spawn(cfg, store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stop_processes(procs: list[Any], *, graceful: bool) -> None:
    """Join worker processes (up to 5 s each when ``graceful``, else not at all) and kill the
    ones still alive."""
    for proc in procs:
        proc.join(timeout=5 if graceful else 0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _spawn(cfg: DemoConfig, store: str):
    ctx = mp.get_context("spawn")
    world = cfg.world_size
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(cfg, rank, world, store, child), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: list[Any] = [None] * world
    pending = set(range(world))
    try:
        while pending:
            progressed = False
            for rank in list(pending):
                if conns[rank].poll(0.05):
                    progressed = True
                    try:
                        kind, _, payload = conns[rank].recv()
                    except EOFError:
                        kind, payload = "err", f"rank {rank} exited without a result (exit code {procs[rank].exitcode})"
                    pending.discard(rank)
                    if kind == "err":
                        raise DemoError(f"rank {rank} of {world} failed:\n{payload}")
                    results[rank] = payload
                elif not procs[rank].is_alive() and not conns[rank].poll(0):
                    raise DemoError(f"rank {rank} of {world} died (exit code {procs[rank].exitcode})")
            if not progressed:
                time.sleep(0.05)
    finally:
        stop_processes(procs, graceful=not pending)
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
    reported = [r for r in results if r is not None]
    if len(reported) != 1:
        raise DemoError(f"expected results from exactly one reporting rank, got {len(reported)}")
    return reported[0]
