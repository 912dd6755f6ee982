"""Benchmark: the MIS engine through the host drop-in against a per-sequence implementation and
against a single-pass floor, in one run on one machine.

For each batch shape (default: 256 sequences of 256-4096 tokens, and 4096 of 16-256) and the
seed-000 default (token TIS + geometric RS + veto + batch normalisation), prints the median time
of:

- ``per-sequence``: ``naive_mis.py`` — the same semantics and every statistic, written the way
  per-sequence implementations are (a Python loop over sequences; ``tests/e2e/test_bench_reference.py``
  checks it computes the engine's weights, masks and metrics);
- ``engine``: ``compute_mis_weights_fsdp`` (lists in, lists out; ``mis_metrics: standard``, every
  statistic);
- ``weights only``: the same with ``mis_metrics: none``;
- the same two with ``compile_engine: true`` (``--compiled``; torch.compile, inductor);
- ``floor``: one pass reading the log-probs and the mask and writing weights and a mask
  (token-level truncated ratio), compiled into one fused kernel with ``--compiled``, else the
  minimal eager chain;

and the ratios per-sequence / engine and engine / floor.

``--allocator keep`` runs the same in a process whose glibc malloc keeps freed memory
(``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set to 4 GB, so large buffers come from
the heap and are not returned to the kernel). By default glibc returns every large buffer, and
the next call pays a page fault for each 4 KiB page it writes: on the VM this was measured on,
writing 37 MB into fresh memory took 12-15 ms against 1.2-1.9 ms into reused memory. The CUDA
caching allocator, and jemalloc / tcmalloc on a CPU, reuse memory the same way; the default
column is what an untuned CPU process sees.

    python benchmarks/bench_mis.py [--repeats 7] [--compiled] [--threads 2] [--allocator default|keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package, not an installed one
from naive_mis import naive_mis  # noqa: E402

from megatron_mis import MISConfig  # noqa: E402
from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp  # noqa: E402

SEED000 = dict(use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5, rs_lower_bound=0.99,
               rs_upper_bound=1.001, rs_veto_threshold=1e-4, tis_batch_normalize=True)


#: glibc malloc thresholds of ``--allocator keep`` (bytes): large buffers from the heap, never trimmed.
KEEP_BYTES = "4000000000"


def make_batch(num_seqs: int, min_len: int, max_len: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g).tolist()
    total = sum(lengths)
    rollout = -torch.rand(total, generator=g) * 4
    train = rollout + torch.randn(total, generator=g) * 0.05
    mask = (torch.rand(total, generator=g) > 0.05).to(torch.int64)
    split = lambda t: list(torch.split(t.to(device), lengths))  # noqa: E731
    return lengths, split(train), split(rollout), split(mask)


def timed(fn, repeats: int, device: str) -> tuple[float, float, float]:
    """(median, min, max) seconds over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def floor_fn(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, upper: float):
    keep = mask > 0
    w = torch.exp((train - rollout).clamp(-20.0, 20.0)).clamp(max=upper)
    return torch.where(keep, w, torch.zeros_like(w)), keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shapes", nargs="+", default=["256:256:4096", "4096:16:256"],
                   help="batch shapes as SEQUENCES:MIN_LEN:MAX_LEN")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compiled", action="store_true", help="also time compile_engine: true and a fused floor")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--allocator", choices=("default", "keep"), default="default",
                   help="keep: re-run in a process whose glibc malloc keeps freed memory (see above)")
    args = p.parse_args()
    if args.allocator == "keep" and os.environ.get("MALLOC_TRIM_THRESHOLD_") != KEEP_BYTES:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=KEEP_BYTES, MALLOC_TRIM_THRESHOLD_=KEEP_BYTES)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)  # glibc reads these at start-up only
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    floor = torch.compile(floor_fn, fullgraph=True, dynamic=True) if args.compiled else floor_fn
    variants = {"engine": dict(SEED000), "weights only": dict(SEED000, mis_metrics="none")}
    if args.compiled:
        variants["engine compiled"] = dict(SEED000, compile_engine=True)
        variants["weights only compiled"] = dict(SEED000, mis_metrics="none", compile_engine=True)
    print(f"device={args.device} threads={torch.get_num_threads()} repeats={args.repeats} "
          f"torch={torch.__version__} allocator={args.allocator}; median [min-max] ms; seed-000 default config")
    for shape in args.shapes:
        n, lo, hi = (int(x) for x in shape.split(":"))
        lengths, train, rollout, masks = make_batch(n, lo, hi, args.device)
        pg = torch.randn(sum(lengths), device=args.device)
        flat = [torch.cat(x) for x in (train, rollout, masks)]
        cfg = MISConfig(**SEED000)
        print(f"\n{n} sequences of {lo}-{hi} tokens ({sum(lengths)} tokens)")
        t_naive = timed(lambda: naive_mis(train, rollout, masks, cfg), max(3, args.repeats // 2), args.device)
        t_floor = timed(lambda: floor(*flat, 1.5), args.repeats, args.device)
        rows = [("per-sequence (every statistic)", t_naive), ("floor (one pass)", t_floor)]
        for name, keys in variants.items():
            host_args = Namespace(custom_config_path=None, **keys)

            def call(host_args=host_args):
                return compute_mis_weights_fsdp(host_args, pg_loss=pg, train_log_probs=train,
                                                rollout_log_probs=rollout, loss_masks=masks)

            rows.append((name, timed(call, args.repeats, args.device)))
        for name, (med, mn, mx) in rows:
            extra = ""
            if name not in ("per-sequence (every statistic)", "floor (one pass)"):
                extra = f"  {t_naive[0] / med:6.1f}x per-sequence, {med / t_floor[0]:5.1f}x floor"
            print(f"  {name:<32} {med * 1e3:9.2f} [{mn * 1e3:.2f}-{mx * 1e3:.2f}]{extra}")


if __name__ == "__main__":
    main()
