"""Benchmark: MIS under context parallelism — megatron-mis against gather-everything.

Baseline (what reference implementations do today): for every sequence, rebuild the full
response log-probs of pi_old and pi_rollout from the CP pieces with one all-reduce each (two
collectives per sequence), then compute on full sequences.
megatron-mis: run the engine on the local pieces and exchange per-sequence statistics in one
all-gather (plus one uint8 all-reduce of rejection bits when token-level rejection is on).

Prints, per (CP size, N sequences): collectives per call, payload bytes each rank contributes per
call, and the median wall time per call, with the ratios baseline / megatron-mis. Runs over gloo
on this machine's CPU (one intra-op thread per rank).

    python benchmarks/bench_cp.py [--repeats 5] [--cp 2 4] [--sequences 64 256 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis_from_lists
from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp
from megatron_mis.parallel.layout import local_response_layout
from megatron_mis.parallel.state import group_view
from megatron_mis.testing.distributed import ProcessGroupPool

CONFIG = dict(use_tis=True, tis_upper_bound=1.5, use_rs=True, rs_level="geometric", rs_lower_bound=0.99,
              rs_upper_bound=1.001, rs_veto_threshold=1e-4, tis_batch_normalize=True)


def _batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    resps = [int(x) for x in torch.randint(128, 1024, (n,), generator=g)]
    totals = [r + int(torch.randint(16, 512, (1,), generator=g)) for r in resps]
    rollout = [-torch.rand(r, generator=g) * 3 for r in resps]
    train = [x + torch.randn(x.shape, generator=g) * 0.02 for x in rollout]
    masks = [torch.ones(r, dtype=torch.int64) for r in resps]
    return totals, resps, train, rollout, masks


def _pieces(full, lay):
    return [torch.cat([full[i][s:e] for s, e in lay.ranges[i].tolist()]) for i in range(len(full))]


def worker(n: int, repeats: int, token_rejection: bool):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cp = group_view(dist.group.WORLD)
    cfg = MISConfig(**CONFIG, **({"tis_mode": "mask", "tis_lower_bound": 0.5} if token_rejection else {}))
    totals, resps, train, rollout, masks = _batch(n)
    lay = local_response_layout(totals, resps, cp.size, cp.rank)
    ltrain, lrollout = _pieces(train, lay), _pieces(rollout, lay)
    inputs = CPInputs(ltrain, lrollout, masks, totals, resps)

    def ours():
        return compute_mis_cp(inputs, cfg, cp)

    def baseline():
        full = []
        for pieces in (ltrain, lrollout):
            gathered = []
            for i in range(n):
                buf = torch.zeros(resps[i])
                for (s, e), chunk in zip(lay.ranges[i].tolist(), torch.split(pieces[i], [b - a for a, b in lay.ranges[i].tolist()])):
                    buf[s:e] = chunk
                dist.all_reduce(buf, group=cp.group)
                gathered.append(buf)
            full.append(gathered)
        return compute_mis_from_lists(full[0], full[1], masks, cfg)

    out = {}
    for name, fn in (("megatron-mis", ours), ("gather-everything", baseline)):
        fn()
        dist.barrier()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    res = ours()
    num_stat_cols = res.result.stats.sums.shape[1] + 2 * res.result.stats.mins.shape[1]
    ours_bytes = n * num_stat_cols * 8 + (sum(resps) if cfg.token_rejects else 0)
    base_bytes = 2 * 4 * sum(resps)
    return dict(times=out, ours_collectives=res.num_collectives, base_collectives=2 * n,
                ours_bytes=ours_bytes, base_bytes=base_bytes, tokens=sum(resps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sequences", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--token-rejection", action="store_true", help="token-level IS masking (adds the bit all-reduce)")
    args = p.parse_args()
    print("gloo on CPU, 1 thread per rank; payload = bytes each rank contributes per call; times are medians")
    print(f"{'cp':>3} {'N':>6} {'tokens':>8} | {'collectives':>17} | {'payload bytes/rank':>27} | {'seconds/call':>21} | {'ratios (base/ours)':>26}")
    print(f"{'':>3} {'':>6} {'':>8} | {'base':>8} {'ours':>8} | {'base':>13} {'ours':>13} | {'base':>10} {'ours':>10} | {'coll':>7} {'bytes':>8} {'time':>8}")
    for cp in args.cp:
        with ProcessGroupPool(cp, cpu_compat=False, timeout=900) as pool:
            for n in args.sequences:
                r = pool.run(worker, n, args.repeats, args.token_rejection)
                t_base = max(x["times"]["gather-everything"] for x in r)
                t_ours = max(x["times"]["megatron-mis"] for x in r)
                x = r[0]
                print(
                    f"{cp:>3} {n:>6} {x['tokens']:>8} | {x['base_collectives']:>8} {x['ours_collectives']:>8} | "
                    f"{x['base_bytes']:>13,} {x['ours_bytes']:>13,} | {t_base:>10.4f} {t_ours:>10.4f} | "
                    f"{x['base_collectives'] / max(x['ours_collectives'], 1):>7.0f} {x['base_bytes'] / x['ours_bytes']:>8.1f} "
                    f"{t_base / t_ours:>8.1f}"
                )


if __name__ == "__main__":
    main()
