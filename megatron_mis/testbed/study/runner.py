"""Run a study's arms x seeds: worker processes (one intra-op thread each by default) are sent
runs one at a time, each run's records go to ``OUT_DIR/SETTING/ARM/seed-S.jsonl`` (written to a
temporary name and renamed when complete), and a run whose file already exists with the same
resolved configuration is reused, so an interrupted study resumes where it stopped.

A run's JSONL file: a ``{"type": "run", ...}`` header (setting, arm, seed, the resolved
``DemoConfig``), one ``{"type": "step", ...}`` line per RL step (the demo's metrics record), and an
``{"type": "end", ...}`` line (greedy evaluation, decoded samples, LR schedule, wall time).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mis.testbed.demo.launch import stop_processes, thread_lock_for_tqdm
from megatron_mis.testbed.study.config import SWEEPS, StudyConfig, run_config

__all__ = ["RUNS_PER_WORKER", "RunJob", "StudyError", "load_run", "plan_sweep", "run_jobs", "run_path", "run_study",
           "run_sweep"]

#: Runs a study worker process makes before a fresh one takes its place. A long-lived process
#: leaks with MoE runs: each left its GPT model and ~48 gloo threads behind (measured 2026-12-06:
#: 54, 102, 150, 198 threads after 1-4 quick MoE runs; dense runs stay at 6), and a sweep process
#: held 2,468 threads after ~37 runs of 150 steps, by when a run took 300 s instead of 44 s on the
#: same machine. The holder, found later: Megatron-Core's MoE token dispatcher keeps its last
#: forward's autograd graph, whose AccumulateGrad hooks (the DDP's, in C++) close over the model;
#: the demo trainer now drops that graph on close (``_MoERoutes.close``), and an MoE run frees its
#: model (tests/e2e/test_study.py). Recycling stays as the bound on a holder not yet known (another
#: Megatron-Core version's): a new worker costs seconds (importing Megatron-Core).
RUNS_PER_WORKER = 8


class StudyError(RuntimeError):
    """A run of the study failed; the message holds its traceback."""


@dataclass(frozen=True)
class RunJob:
    setting: str
    arm: str
    seed: int
    config: dict[str, Any]
    path: str


def study_dir(study: StudyConfig) -> Path:
    return Path(study.out_dir) / study.setting


def run_path(study: StudyConfig, arm: str, seed: int) -> Path:
    return study_dir(study) / arm / f"seed-{seed}.jsonl"


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration keys that decide a run's numbers (not where it writes or what it shows)."""
    return {k: v for k, v in config.items() if k not in ("name", "out_dir", "progress", "plot", "dump_log_probs")}


def load_run(path: str | Path) -> dict[str, Any] | None:
    """A finished run's ``{"header", "records", "end"}``, or ``None`` when the file is missing or
    incomplete."""
    path = Path(path)
    if not path.is_file():
        return None
    header, records, end = None, [], None
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.pop("type", None)
            if kind == "run":
                header = rec
            elif kind == "step":
                records.append(rec)
            elif kind == "end":
                end = rec
    if header is None or end is None:
        return None
    return {"header": header, "records": records, "end": end}


def _finished(job: RunJob) -> bool:
    """A finished run with the same configuration (keys a run file lacks, written before a
    DemoConfig field existed, count as that field's default)."""
    from megatron_mis.testbed.demo.config import DemoConfig

    run = load_run(job.path)
    if run is None:
        return False
    defaults = DemoConfig().to_dict()
    return _comparable({**defaults, **run["header"]["config"]}) == _comparable({**defaults, **job.config})


def _execute(job: RunJob, scratch: str) -> None:
    """Run one job in this process (torch.distributed world of 1, initialised or not) and write
    its JSONL file atomically."""
    from megatron_mis.testbed.demo.config import DemoConfig
    from megatron_mis.testbed.demo.launch import _run_in_group

    cfg = DemoConfig.from_dict({**job.config, "out_dir": scratch})
    t0 = time.perf_counter()
    # a fresh file store per run (used only when this process has no process group yet)
    # the demo prints the mismatch monitor's messages; here they are in the JSONL (monitor_warnings)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        results = _run_in_group(cfg, 0, 1, os.path.join(scratch, f"store-{job.arm}-{job.seed}-{time.monotonic_ns()}"))
    wall = time.perf_counter() - t0
    (result,) = results
    out = Path(job.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        header = {"type": "run", "setting": job.setting, "arm": job.arm, "seed": job.seed, "config": job.config,
                  "machine": run_machine()}
        f.write(json.dumps(header) + "\n")
        for rec in result.records:
            f.write(json.dumps(_jsonable({"type": "step", **rec})) + "\n")
        end = {"type": "end", "evaluation": result.evaluation, "samples": result.samples,
               "schedule": result.schedule, "wall_s": wall, "label": result.label}
        f.write(json.dumps(_jsonable(end)) + "\n")
    os.replace(tmp, out)
    shutil.rmtree(os.path.join(scratch, cfg.name), ignore_errors=True)


def run_machine() -> dict[str, Any]:
    """Where a run was made: the CPU model (with its family / model numbers from /proc/cpuinfo
    where there is one), the vector instruction set torch's CPU kernels use (``AVX2``,
    ``AVX512``, ...), the cores this process may use, Python and torch versions. The same seed
    follows the same trajectory only with the same software *and* the same instruction set: a
    different ISA rounds reductions differently and a 300-step run diverges (docs/study.md)."""
    import platform

    from megatron_mis.testbed.demo.config import available_cpus

    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break  # the first processor's block is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    cpu = fields.get("model name", cpu)
    import torch

    out = {"cpu": cpu, "cores": available_cpus(), "python": platform.python_version(), "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if "cpu family" in fields and "model" in fields:
        out["cpu_family_model"] = f"{fields['cpu family']}/{fields['model']}"
    return out


def machine_label(run: dict[str, Any]) -> str:
    """``"CPU (family F model M) [ISA], Python x, torch y"`` of a loaded run (``"not recorded"``
    for runs made before the header held it; the family and model, and ``[ISA]``, only where the
    header records them: two CPUs of one model name, e.g. two AMD EPYC generations, can follow
    different trajectories from the same seed)."""
    m = run["header"].get("machine")
    if not m:
        return "not recorded"
    family, _, model = str(m.get("cpu_family_model", "")).partition("/")
    kind = f" (family {family} model {model})" if family and model else ""
    isa = f" [{m['cpu_capability']}]" if m.get("cpu_capability") else ""
    return f"{m.get('cpu', '?')}{kind}{isa}, Python {m.get('python', '?')}, torch {m.get('torch', '?')}"


def _jsonable(value: Any) -> Any:
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _worker(conn: Any, threads: int, scratch: str) -> None:
    """A worker process: one gloo world of size 1 for its whole life (Megatron imported once),
    runs the jobs the parent sends over ``conn`` (its end of a duplex pipe), answering each with
    ``("ok", "")`` or ``("err", traceback)``, until ``None``, the pipe's end or the parent's death.
    ``scratch``: its folder (made and removed by the parent, so that a worker killed on Ctrl-C
    leaves nothing behind)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    thread_lock_for_tqdm()
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(scratch, 'store')}", rank=0, world_size=1)
        parent = mp.parent_process()
        while True:
            if not conn.poll(1.0):
                if parent is not None and not parent.is_alive():
                    break  # the study was killed: do not run on as an orphan
                continue
            try:
                job = conn.recv()
            except (EOFError, OSError):  # the parent closed its end, or died
                break
            if job is None:
                break
            try:
                _execute(job, scratch)
                answer = ("ok", "")
            except BaseException:  # noqa: BLE001 - reported to the parent, which stops the study
                answer = ("err", traceback.format_exc())
            try:
                conn.send(answer)
            except OSError:  # the parent is gone
                break
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        conn.close()


def plan(study: StudyConfig) -> list[RunJob]:
    """Every run of the study, seed-major (all arms of the first seed first), so that a partial
    study holds complete pairs."""
    jobs = []
    for seed in study.seed_list:
        for arm in study.arm_names:
            cfg = run_config(study, arm, seed)
            jobs.append(RunJob(study.setting, arm, seed, cfg.to_dict(), str(run_path(study, arm, seed))))
    return jobs


def run_study(study: StudyConfig) -> dict[str, Any]:
    """Run (or reuse) every run of ``study``; returns ``{"ran": n, "reused": m, "wall_s": t}``.

    Raises:
        StudyError: a run raised (its traceback) or a worker died; finished runs stay on disk.
    """
    return run_jobs(study, plan(study), f"study {study.setting}")


def plan_sweep(study: StudyConfig) -> list[RunJob]:
    """Every run of a sweep, seed-major across the doses: every dose's arms for seed 0, then for
    seed 1, ... (doses in order within a seed, arms in order within a dose), so that a sweep
    stopped part-way holds complete pairs at every dose rather than every seed of the first doses."""
    jobs = [job for label in study.dose_labels for job in plan(study.for_dose(label))]
    return sorted(jobs, key=lambda job: job.seed)  # stable: keeps the dose and arm order per seed


def run_sweep(study: StudyConfig) -> dict[str, Any]:
    """Run (or reuse: finished run files on disk are skipped) every run of a dose-response sweep
    in up to ``study.num_jobs`` worker processes; returns ``{"ran", "reused", "wall_s"}``."""
    if study.sweep is None:
        raise ValueError("run_sweep needs a StudyConfig with a sweep")
    chosen = set(study.dose_labels)
    # the doses not chosen (``--doses``) can still hold a finished run of the same configuration
    # (the reference, which resets the dose): copy it rather than run it again
    others = [job for label in SWEEPS[study.sweep].labels if label not in chosen
              for job in _on_disk(study.for_dose(label))]
    return run_jobs(study, plan_sweep(study), f"sweep {study.sweep}", sources=others + _other_sweeps_on_disk(study))


def _on_disk(study: StudyConfig) -> list[RunJob]:
    """:func:`plan`'s jobs whose run files exist, resolving only those (a copy's source must be
    on disk; resolving every configuration of every dose costs seconds)."""
    return [RunJob(study.setting, arm, seed, run_config(study, arm, seed).to_dict(), str(path))
            for seed in study.seed_list for arm in study.arm_names
            if (path := run_path(study, arm, seed)).is_file()]


def _other_sweeps_on_disk(study: StudyConfig) -> list[RunJob]:
    """The runs of the other sweeps (their own arms, this study's seeds and flags) whose files
    exist in ``study.out_dir``: a dose of one sweep can be another's, e.g. ``long-tail-stale-128``
    k0 is ``long-tail-precision`` int4 and ``staleness`` k0's fresh fp32 reference is
    ``temperature`` t1's, so such a run is copied rather than run again. A sweep or dose whose
    study this study's flags do not fit (its validation rejects one of its arms' configurations)
    is skipped."""
    from megatron_mis.config import ConfigError

    found = []
    for name, sweep in SWEEPS.items():
        if name == study.sweep:
            continue
        try:
            other = StudyConfig(**{**study.to_dict(), "sweep": name, "doses": None, "arms": None})
        except ConfigError:
            continue
        for label in sweep.labels:
            try:
                sub = other.for_dose(label)
            except ConfigError:  # e.g. --quick's micro-batches do not split into staleness-multi's 4 updates
                continue
            found += _on_disk(sub)
    return found


def run_jobs(study: StudyConfig, jobs: list[RunJob], desc: str, sources: Sequence[RunJob] = ()) -> dict[str, Any]:
    """Run the jobs not yet finished on disk (``study.num_jobs`` workers of ``study.threads``
    threads); returns ``{"ran", "reused", "copied", "wall_s"}`` (``copied``: runs whose resolved
    configuration equals another run's, written as a copy of its file). ``sources``: more runs
    whose files a job may copy when they are finished on disk (never run here).

    Raises:
        StudyError: a run raised (its traceback) or a worker died; finished runs stay on disk.
    """
    from tqdm.auto import tqdm

    todo, copies = _deduplicate(jobs, sources)
    reused = len(jobs) - len(todo) - len(copies)
    t0 = time.perf_counter()
    bar = tqdm(total=len(jobs), initial=reused, desc=desc, unit="run",
               disable=not study.progress, dynamic_ncols=True)
    try:
        if todo and study.num_jobs == 1 and len(todo) <= RUNS_PER_WORKER:  # a few runs: in this process
            scratch = tempfile.mkdtemp(prefix="megatron_mis_study_")
            try:
                for job in todo:
                    try:
                        _execute(job, scratch)
                    except Exception as exc:
                        raise StudyError(f"run {job.arm} seed {job.seed} failed: {exc}") from exc
                    bar.set_postfix_str(f"{job.arm} seed {job.seed}", refresh=False)
                    bar.update(1)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        elif todo:
            _run_pool(study, todo, bar)
        for source, job in copies:
            _copy_run(source, job)
            bar.update(1)
    finally:
        bar.close()
    return {"ran": len(todo), "reused": reused, "copied": len(copies), "wall_s": time.perf_counter() - t0}


def _config_key(config: dict[str, Any]) -> str:
    return json.dumps(_comparable(config), sort_keys=True, default=str)


def _deduplicate(jobs: list[RunJob], sources: Sequence[RunJob] = ()) -> tuple[list[RunJob], list[tuple[RunJob, RunJob]]]:
    """The jobs to run, and ``(source, job)`` pairs of jobs whose resolved configuration equals an
    earlier job's (a sweep's reference arm resets the dose, so it is the same run at every dose):
    those are run once and their file copied, ``source`` being finished on disk (one of ``jobs``
    or of ``sources``) or in the list to run. Jobs finished on disk are in neither list."""
    keys = [_config_key(job.config) for job in jobs]
    done = [_finished(job) for job in jobs]
    source = {}  # configuration -> the job whose file the others copy: a finished one if any
    for job, key, finished in zip(jobs, keys, done):
        if finished:
            source.setdefault(key, job)
    # read a source's file only when an unfinished job has its configuration (a sweep's other doses
    # hold hundreds of run files, and only the reference's match)
    wanted = {key for key, finished in zip(keys, done) if not finished and key not in source}
    for job in sources:
        key = _config_key(job.config)
        if key in wanted and _finished(job):
            source.setdefault(key, job)
    todo, copies = [], []
    for job, key, finished in zip(jobs, keys, done):
        if finished:
            continue
        if key in source:
            copies.append((source[key], job))
        else:
            source[key] = job
            todo.append(job)
    return todo, copies


def _copy_run(source: RunJob, job: RunJob) -> None:
    """Write ``source``'s finished run file as ``job``'s (same numbers; the header names ``job``'s
    setting, arm, seed and configuration and where the run was copied from), atomically."""
    lines = Path(source.path).read_text(encoding="utf-8").splitlines(keepends=True)
    header = json.loads(lines[0])
    header.update(setting=job.setting, arm=job.arm, seed=job.seed, config=job.config, copied_from=str(source.path))
    out = Path(job.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(header) + "\n" + "".join(lines[1:]), encoding="utf-8")
    os.replace(tmp, out)


def _run_pool(study: StudyConfig, todo: list[RunJob], bar: Any) -> None:
    """Run ``todo`` on ``min(study.num_jobs, len(todo))`` spawned workers, one job at a time each,
    sent over a duplex pipe per worker; a worker that has made :data:`RUNS_PER_WORKER` runs is
    retired (it gets ``None`` and exits) and a fresh one takes its slot while jobs wait. Pipes,
    not ``multiprocessing`` queues: a queue holds named semaphores whose cleanup, run by its
    feeder thread at the interpreter's exit after a stop, could be cut between the unlink and the
    resource tracker's unregister (the tracker then warned of a "leaked semaphore" it could not
    unlink), and a queue filled with every job up front needed that thread not to block on a full
    pipe. Here nothing outlives the call: on a stop the
    workers are killed and the pipes closed."""
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    waiting = list(reversed(todo))  # popped from the end: the plan's order
    n = min(study.num_jobs, len(todo))
    procs: list[Any] = []
    conns: list[Any] = []
    scratches: list[str] = []
    running: dict[int, RunJob] = {}  # worker index -> the job it runs
    made: list[int] = []  # worker index -> runs it has finished
    retired: list[tuple[Any, Any, str]] = []  # (process, pipe, scratch) of workers sent None, exiting
    pending = len(todo)

    def died(i: int) -> StudyError:
        procs[i].join(timeout=1.0)
        return StudyError(f"a study worker died (exit code {procs[i].exitcode})")

    def send_next(i: int) -> None:
        job = waiting.pop() if waiting else None
        try:
            conns[i].send(job)
        except OSError:  # BrokenPipeError: the worker is gone
            raise died(i) from None
        if job is not None:
            running[i] = job

    def start(i: int) -> None:
        """A fresh worker in slot ``i`` (appended when ``i`` is a new slot)."""
        scratch = tempfile.mkdtemp(prefix="megatron_mis_study_")
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker, args=(theirs, study.threads, scratch), daemon=True)
        if i == len(procs):
            procs.append(proc)
            conns.append(ours)
            scratches.append(scratch)
            made.append(0)
        else:
            procs[i], conns[i], scratches[i], made[i] = proc, ours, scratch, 0
        proc.start()
        theirs.close()

    def retire(i: int) -> None:
        """Send worker ``i`` its ``None`` (it exits when it reads it) and start a fresh one in its slot;
        the old one's scratch folder goes once it has exited (below, or in ``finally``)."""
        with contextlib.suppress(OSError):
            conns[i].send(None)
        retired.append((procs[i], conns[i], scratches[i]))
        start(i)

    try:  # from the first start on: a Ctrl-C while the workers start (seconds on a loaded machine) is handled too
        for i in range(n):
            start(i)
            send_next(i)
        while pending:
            wait([conns[i] for i in running] + [procs[i].sentinel for i in running], timeout=1.0)
            for i in list(running):
                if conns[i].poll(0):
                    try:
                        kind, payload = conns[i].recv()
                    except (EOFError, OSError):  # a killed worker: EOF, or ECONNRESET (a duplex pipe is a socket pair)
                        raise died(i) from None
                    job = running.pop(i)
                    if kind == "err":
                        raise StudyError(f"run {job.arm} seed {job.seed} failed:\n{payload}")
                    pending -= 1
                    bar.set_postfix_str(f"{job.arm} seed {job.seed}", refresh=False)
                    bar.update(1)
                    made[i] += 1
                    if made[i] >= RUNS_PER_WORKER and waiting:
                        retire(i)
                    send_next(i)
                elif not procs[i].is_alive():
                    raise died(i)
            for old in [r for r in retired if not r[0].is_alive()]:  # retired workers that have exited
                old[0].join(timeout=0)
                old[1].close()
                shutil.rmtree(old[2], ignore_errors=True)
                retired.remove(old)
    finally:
        # stopped early (an error, Ctrl-C, SIGTERM): kill the workers at once; else each has its
        # None and exits
        old_procs, old_conns, old_scratches = (list(x) for x in zip(*retired)) if retired else ([], [], [])
        stop_processes([p for p in procs + old_procs if p.pid is not None], graceful=not pending)
        for conn in conns + old_conns:
            conn.close()
        for scratch in scratches + old_scratches:  # also a killed worker's (its half-written run, its file store)
            shutil.rmtree(scratch, ignore_errors=True)
