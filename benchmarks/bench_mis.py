"""Benchmark: the vectorised MIS engine against the naive per-sequence loop.

256 sequences of 256-4096 tokens (about 560k tokens), full metrics on, two configurations
(seed 000's default: token TIS + geometric RS + veto + normalisation; sequence-level MIS). Prints
the median of several runs of each and the speed-up ratio, in one run on the same machine.

    python benchmarks/bench_mis.py [--repeats 5] [--device cpu|cuda] [--sequences 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from naive_mis import naive_mis  # noqa: E402

from megatron_mis import MISConfig  # noqa: E402
from megatron_mis.core.engine import compute_mis  # noqa: E402
from megatron_mis.core.segments import cu_seqlens_from_lengths  # noqa: E402


def make_batch(num_seqs: int, min_len: int, max_len: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g)
    total = int(lengths.sum())
    rollout = -torch.rand(total, generator=g) * 4
    train = rollout + torch.randn(total, generator=g) * 0.05
    mask = (torch.rand(total, generator=g) > 0.05).to(torch.int64)
    return lengths.tolist(), train.to(device), rollout.to(device), mask.to(device)


def timed(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    lengths, train, rollout, mask = make_batch(args.sequences, args.min_len, args.max_len, args.device)
    cu = cu_seqlens_from_lengths(lengths, device=args.device)
    train_l, rollout_l, mask_l = (list(torch.split(t, lengths)) for t in (train, rollout, mask))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        configs = {
            "seed000 default (token TIS + geo RS + veto + BN)": MISConfig(
                use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5, rs_lower_bound=0.99,
                rs_upper_bound=1.001, rs_veto_threshold=1e-4, tis_batch_normalize=True),
            "sequence MIS + BN": MISConfig(use_tis=True, tis_level="sequence", tis_mode="mask",
                                           tis_lower_bound=1e-8, tis_upper_bound=2.0, tis_batch_normalize=True),
        }
    print(f"device={args.device} threads={torch.get_num_threads()} sequences={len(lengths)} "
          f"tokens={sum(lengths)} repeats={args.repeats} (median seconds)")
    print(f"{'configuration':<50} {'naive loop':>11} {'vectorised':>11} {'speed-up':>9}")
    for name, cfg in configs.items():
        def engine():
            res = compute_mis(train, rollout, mask, cu, cfg)
            return res

        def naive():
            return naive_mis(train_l, rollout_l, mask_l, cfg)

        engine()  # warm-up
        naive()
        t_engine = timed(engine, args.repeats, args.device)
        t_naive = timed(naive, max(1, args.repeats), args.device)
        print(f"{name:<50} {t_naive:>11.4f} {t_engine:>11.4f} {t_naive / t_engine:>8.1f}x")


if __name__ == "__main__":
    main()
