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
  (token-level truncated ratio): the minimal eager chain, and with ``--compiled`` also one fused
  inductor kernel;
- ``drop-in floor``: the least any list-in, list-out drop-in does around that pass: join the
  three per-sample lists (``torch.cat``), the same one pass, multiply the host's loss by the
  weights (0 where not kept), and return the masks as per-sample pieces in the masks' dtype. The
  one-pass floor starts from tensors already joined and stops at the weights, so it omits work
  the host's contract requires; this row shows how much;

and the ratios per-sequence / engine and engine / floor. All functions are timed in interleaved
rounds (each round calls each once), and each ratio is the median of its per-round ratios, so
a slow spell of a shared machine does not land on one function only. Every function but the
per-sequence reference is also timed back to back (caches warm, memory reused).

Three ratios to the floor, from the most conservative to like for like:

- ``fastest floor``: the engine in the rounds (each call after the per-sequence reference has
  swept the caches) over the fastest floor median measured (usually back to back, warm);
- ``floor of the round``: the engine over the floor of the same round (both in the rounds);
- ``floor back to back`` (on the back-to-back rows): both back to back, over the median.

The engine rows in the rounds also print their ratio to the drop-in floor of the same round.

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
from megatron_mis.core.segments import concat_sequences  # noqa: E402
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


def _once(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def timed_rounds(fns: dict, repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per call of every function, measured in ``repeats`` interleaved rounds (each round
    calls every function once, after one warm-up call each), so that a slow spell of a shared
    machine hits all of them alike and per-round ratios stay meaningful."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_once(fn, device))
    return times


def floor_fn(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, upper: float):
    """``[T]`` log-probs and mask -> (truncated token weight, 0 off the mask; ``bool`` keep mask):
    the fewest eager passes found. The mask enters as a float32 factor through a ``uint8`` view
    (on a CPU that is 0.3-0.4 ms faster per call on 543k tokens than ``torch.where`` on the
    ``bool`` mask; every weight is finite and positive, so ``w * 0`` is the same ``+0.0``)."""
    keep = mask > 0
    w = torch.exp((train - rollout).clamp_(-20.0, 20.0)).clamp_(max=upper)
    return w.mul_(keep.view(torch.uint8).to(torch.float32)), keep


def dropin_floor_fn(train: list, rollout: list, masks: list, lengths: list[int], pg_loss: torch.Tensor, upper: float):
    """The least a list-in, list-out drop-in does: per-sample lists -> ``(pg_loss * weight``, 0
    where not kept; the keep masks as per-sample pieces in the masks' dtype``)``. The lists are
    joined the engine's way (:func:`concat_sequences`, the fastest join measured), then
    :func:`floor_fn`; the loss is a select, as it must be (a loss that is NaN at a rejected token
    must come out 0, and ``NaN * 0`` is NaN)."""
    device = rollout[0].device
    w, keep = floor_fn(concat_sequences(train, device), concat_sequences(rollout, device),
                       concat_sequences(masks, device), upper)
    loss = torch.where(keep, pg_loss * w, 0.0)
    return loss, list(torch.split(keep.to(masks[0].dtype), lengths))


def batch_shape(text: str) -> tuple[int, int, int]:
    """``SEQUENCES:MIN_LEN:MAX_LEN`` -> three ints (argparse type: a bad value is a usage error)."""
    try:
        n, lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not SEQUENCES:MIN_LEN:MAX_LEN (three integers, e.g. 256:256:4096)") from None
    if n < 1 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: need SEQUENCES >= 1 and 1 <= MIN_LEN <= MAX_LEN")
    return n, lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shapes", nargs="+", type=batch_shape, default=[(256, 256, 4096), (4096, 16, 256)],
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
    variants = {"engine": dict(SEED000), "weights only": dict(SEED000, mis_metrics="none")}
    if args.compiled:
        variants["engine compiled"] = dict(SEED000, compile_engine=True)
        variants["weights only compiled"] = dict(SEED000, mis_metrics="none", compile_engine=True)
    print(f"device={args.device} threads={torch.get_num_threads()} repeats={args.repeats} "
          f"torch={torch.__version__} allocator={args.allocator}; seed-000 default config")
    print("times: median [min-max] ms over interleaved rounds (rows marked back to back: consecutive calls); "
          "ratios: median [min-max] of the per-round (per-call) ratios")
    for n, lo, hi in args.shapes:
        lengths, train, rollout, masks = make_batch(n, lo, hi, args.device)
        pg = torch.randn(sum(lengths), device=args.device)
        flat = [torch.cat(x) for x in (train, rollout, masks)]
        cfg = MISConfig(**SEED000)
        print(f"\n{n} sequences of {lo}-{hi} tokens ({sum(lengths)} tokens)")
        fns = {"per-sequence (every statistic)": lambda: naive_mis(train, rollout, masks, cfg),
               "floor (one pass)": lambda: floor_fn(*flat, 1.5),
               "drop-in floor (lists in and out)": lambda: dropin_floor_fn(train, rollout, masks, lengths, pg, 1.5)}
        if args.compiled:
            # inductor's CPU code stores bool results slowly, so the eager chain may be the faster floor
            fused = torch.compile(floor_fn, fullgraph=True, dynamic=True)
            fns["floor (one fused kernel)"] = lambda: fused(*flat, 1.5)
        for name, keys in variants.items():
            host_args = Namespace(custom_config_path=None, **keys)
            fns[name] = lambda host_args=host_args: compute_mis_weights_fsdp(
                host_args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
        times = timed_rounds(fns, args.repeats, args.device)
        # every function but the reference also back to back (warm caches, memory reused)
        for name in [k for k in fns if not k.startswith("per-sequence")]:
            fns[name]()
            times[name + ", back to back"] = [_once(fns[name], args.device) for _ in range(args.repeats)]
        naive = times["per-sequence (every statistic)"]
        floors = {name: ts for name, ts in times.items() if name.startswith("floor")}
        floor_best = min(statistics.median(ts) for ts in floors.values())
        floor_round = [min(x) for x in zip(*(ts for name, ts in floors.items() if not name.endswith("back to back")))]
        floor_b2b = min(statistics.median(ts) for name, ts in floors.items() if name.endswith("back to back"))
        dropin = times["drop-in floor (lists in and out)"]
        for name, ts in times.items():
            extra = ""
            if name.startswith(("per-sequence", "floor", "drop-in floor")):
                pass  # the references: times only
            elif name.endswith("back to back"):
                over = [b / floor_b2b for b in ts]
                extra = f"  {statistics.median(over):5.1f}x [{min(over):.1f}-{max(over):.1f}] floor back to back"
            else:
                speedup = [a / b for a, b in zip(naive, ts)]
                over = [b / floor_best for b in ts]
                same = [b / f for b, f in zip(ts, floor_round)]
                contract = [b / f for b, f in zip(ts, dropin)]
                extra = (f"  {statistics.median(speedup):6.1f}x [{min(speedup):.1f}-{max(speedup):.1f}] per-sequence, "
                         f"{statistics.median(over):5.1f}x [{min(over):.1f}-{max(over):.1f}] fastest floor, "
                         f"{statistics.median(same):5.1f}x [{min(same):.1f}-{max(same):.1f}] floor of the round, "
                         f"{statistics.median(contract):5.1f}x [{min(contract):.1f}-{max(contract):.1f}] drop-in floor")
            print(f"  {name:<48} {statistics.median(ts) * 1e3:9.2f} [{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}]{extra}")

if __name__ == "__main__":
    main()
