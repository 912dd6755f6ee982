"""Routing replay (R3) benchmark: route bytes per rank per step, and the cost of replay in a
forward pass, against shipping full int32 routes to every rank.

Part 1 (bytes): for model shapes of real MoE models and a parallel layout, every rank's shard
is cut with :func:`shard_routes` from synthetic routes of a step's samples; the baseline is what
a rank receives when the full int32 routes of its data-parallel rank's samples are shipped to
every rank (and sliced there). Ratios are baseline / ours.

Part 2 (time): a small Megatron-Core MoE GPT on CPU (one gloo rank): forward with natural
routing, forward under R3 with this rank's compact shard, and forward under R3 where the rank
first slices its shard out of the full int32 routes (the baseline's on-rank work). Medians over
repeated runs, ratios against natural routing.

Run: ``python benchmarks/bench_r3.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_mis.routing.slicing import RouteShardSpec, moe_layer_pattern, shard_routes  # noqa: E402

MODELS = {
    # name: (num_layers, moe_layer_freq, num_experts, topk)
    "DeepSeek-V3 (61 layers, first 3 dense, 256 experts, top-8)": (61, [0] * 3 + [1] * 58, 256, 8),
    "Qwen3-30B-A3B (48 layers, 128 experts, top-8)": (48, 1, 128, 8),
}
LAYOUT = dict(tp=2, sp=True, cp=2, pp=4)


def _sample_routes(lengths, num_layers, num_experts, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, num_experts, (t - 1, num_layers, topk), generator=g, dtype=torch.int32) for t in lengths]


def _stage_layers(num_layers, freq, pp, stage):
    pattern = moe_layer_pattern(num_layers, freq)
    per = -(-num_layers // pp)
    return tuple(i for i in range(stage * per, min((stage + 1) * per, num_layers)) if pattern[i])


def bytes_table(num_samples: int, mean_len: int) -> None:
    print(f"\n== route bytes per rank per step ({num_samples} samples of ~{mean_len} tokens per data-parallel rank; "
          f"tp={LAYOUT['tp']} with sequence parallel, cp={LAYOUT['cp']}, pp={LAYOUT['pp']}, packed thd) ==")
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(mean_len // 2, mean_len * 3 // 2, (num_samples,), generator=g)]
    tp, cp, pp = LAYOUT["tp"], LAYOUT["cp"], LAYOUT["pp"]
    print(f"{'model':58s} {'full int32 / rank':>18s} {'ours max / rank':>16s} {'ours mean':>12s} {'ratio':>7s}")
    for name, (num_layers, freq, num_experts, topk) in MODELS.items():
        routes = _sample_routes(lengths, num_layers, num_experts, topk)
        baseline = sum(r.numel() * 4 for r in routes)
        sizes = []
        for stage in range(pp):
            layer_ids = _stage_layers(num_layers, freq, pp, stage)
            for c in range(cp):
                for t in range(tp):
                    spec = RouteShardSpec(layer_ids=layer_ids, num_experts=num_experts, cp_size=cp, cp_rank=c,
                                          tp_size=tp, tp_rank=t, sequence_parallel=True, pad_multiple=tp)
                    sizes.append(shard_routes(routes, lengths, spec).nbytes)
        print(f"{name:58s} {baseline / 2**20:15.1f} MiB {max(sizes) / 2**20:13.2f} MiB "
              f"{statistics.mean(sizes) / 2**20:9.2f} MiB {baseline / max(sizes):6.1f}x")


def _median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_table(repeats: int) -> None:
    import torch.distributed as dist

    from megatron_mis.testing.cpu import cpu_compat
    from megatron_mis.testbed.models.gpt import GPTSpec
    from megatron_mis.testbed.cpu_moe import build_cpu_moe_gpt
    from megatron_mis.routing.replay import RoutingReplay
    from megatron_mis.routing.slicing import RouteShardSpec
    from megatron_mis.testing.distributed import megatron_parallel

    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="bench_r3_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    spec = GPTSpec(vocab_size=256, hidden_size=128, num_layers=4, num_attention_heads=4, max_sequence_length=1024,
                   num_moe_experts=32, moe_router_topk=4)
    lengths = [300, 500, 224]
    n = sum(lengths)
    with cpu_compat(), megatron_parallel(seed=0):
        model = build_cpu_moe_gpt(spec)
        tokens = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(t) for t in lengths]).unsqueeze(0)
        full = _sample_routes(lengths, spec.num_layers, spec.num_moe_experts, spec.moe_router_topk)
        sspec = RouteShardSpec(layer_ids=tuple(range(spec.num_layers)), num_experts=spec.num_moe_experts)
        shard = shard_routes(full, lengths, sspec)

        def natural():
            with torch.no_grad():
                model(tokens, pos, None)

        replay = RoutingReplay(model, routing_replay_mode="r3")

        def replayed():
            replay.set_routes(0, shard)
            replay.begin_pass()
            with torch.no_grad():
                model(tokens, pos, None)

        def slice_on_rank():
            replay.set_routes(0, shard_routes(full, lengths, sspec))
            replay.begin_pass()
            with torch.no_grad():
                model(tokens, pos, None)

        t_nat = _median_time(natural, repeats)
        with replay:
            t_rep = _median_time(replayed, repeats)
            replay.config = replay.config.replace(routing_replay_agreement=False)
            t_rep_noagree = _median_time(replayed, repeats)
            replay.config = replay.config.replace(routing_replay_agreement=True)
            t_slice = _median_time(slice_on_rank, repeats)
    dist.destroy_process_group()
    print(f"\n== forward time, {spec.num_layers}-layer MoE GPT (hidden {spec.hidden_size}, {spec.num_moe_experts} experts, "
          f"top-{spec.moe_router_topk}), {n} packed tokens, CPU 1 thread, median of {repeats} ==")
    print(f"{'natural routing':52s} {t_nat * 1e3:8.2f} ms  1.00x")
    print(f"{'R3, compact shard (agreement metric on)':52s} {t_rep * 1e3:8.2f} ms  {t_rep / t_nat:.2f}x")
    print(f"{'R3, compact shard (agreement metric off)':52s} {t_rep_noagree * 1e3:8.2f} ms  {t_rep_noagree / t_nat:.2f}x")
    print(f"{'R3, sliced on-rank from full int32 routes':52s} {t_slice * 1e3:8.2f} ms  {t_slice / t_nat:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per variant (median reported)")
    parser.add_argument("--samples", type=int, default=16, help="samples per data-parallel rank per step")
    parser.add_argument("--mean-len", type=int, default=2048, help="mean sample length in tokens")
    args = parser.parse_args()
    bytes_table(args.samples, args.mean_len)
    time_table(args.repeats)


if __name__ == "__main__":
    main()
