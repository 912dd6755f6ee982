"""GPU figures in one run on one CUDA device (the GPU issue): the MIS engine against the
per-sequence reference on about a million tokens, timed with CUDA events; kernel launches per
engine call; the engine's share of one forward + backward of a Megatron-Core GPT on the same
tokens; the peak extra memory of ``MegatronRLLoss.loss_func`` against the logits' size.

    python benchmarks/bench_gpu.py [--sequences 512] [--repeats 20] [--skip-model]

Times are medians of ``--repeats`` calls after a warm-up (each call between two CUDA events,
the stream otherwise idle); the per-sequence reference runs 3 times (it is 100x slower).
Nothing here is asserted: the figures are recorded in benchmarks/README.md with the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package
from bench_logprobs import memory_micro_batch, one_rank_group  # noqa: E402
from bench_mis import SEED000, make_batch  # noqa: E402
from naive_mis import naive_mis  # noqa: E402

from megatron_mis import MISConfig  # noqa: E402
from megatron_mis.core.engine import compute_mis  # noqa: E402


def cuda_ms(fn, repeats: int) -> list[float]:
    """Milliseconds per call of ``fn`` between CUDA events (one warm-up call first)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def kernels_per_call(fn) -> tuple[int, int]:
    """(GPU kernels, memory copies and sets) one call of ``fn`` launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = mem = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            mem += 1
        else:
            kernels += 1
    return kernels, mem


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f} ms [{min(xs):.2f}-{max(xs):.2f}]"


def engine_figures(num_seqs: int, repeats: int) -> int:
    lengths, train, rollout, masks = make_batch(num_seqs, 256, 4096, "cuda")
    t, r, m = (torch.cat(x) for x in (train, rollout, masks))
    cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0))
    print(f"engine: {num_seqs} sequences of 256-4096 tokens ({t.numel()} tokens), seed-000 default config, fp32")
    variants = {"every statistic": MISConfig(**SEED000), "weights only": MISConfig(**SEED000, mis_metrics="none")}
    med = {}
    for name, cfg in variants.items():
        xs = cuda_ms(lambda cfg=cfg: compute_mis(t, r, m, cu, cfg), repeats)
        med[name] = statistics.median(xs)
        k, mem = kernels_per_call(lambda cfg=cfg: compute_mis(t, r, m, cu, cfg))
        print(f"  compute_mis, {name:<16} {fmt(xs)}  {k} kernels + {mem} copies / sets per call")
    ref = cuda_ms(lambda: naive_mis(train, rollout, masks, variants["every statistic"]), 3)
    print(f"  per-sequence reference        {fmt(ref)}  ({statistics.median(ref) / med['every statistic']:.0f}x the engine)")
    floor = cuda_ms(lambda: torch.where(m.bool(), (t - r).exp().clamp(max=1.5), 0.0), repeats)
    print(f"  one-pass floor (exp, clamp, select) {fmt(floor)}")
    return t.numel()


def model_share(tokens_per_seq: int, num_seqs: int, repeats: int) -> None:
    """One forward + backward of a bf16 GPTModel (Megatron-Core local spec, no Transformer Engine)
    on ``num_seqs x tokens_per_seq`` tokens, against the engine on the same number of tokens."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_mis.testbed.models.gpt import GPTSpec, build_gpt

    with one_rank_group("nccl"):
        ps.initialize_model_parallel()
        try:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
            spec = GPTSpec(vocab_size=32000, hidden_size=2048, num_layers=8, num_attention_heads=16,
                           max_sequence_length=tokens_per_seq)
            gpt = build_gpt(spec, params_dtype=torch.bfloat16).cuda()
            model = Float16Module(gpt.config, gpt)
            params = sum(p.numel() for p in model.parameters())
            tokens = torch.randint(0, spec.vocab_size, (num_seqs, tokens_per_seq), device="cuda")
            pos = torch.arange(tokens_per_seq, device="cuda").expand(num_seqs, -1)

            def step():
                logits = model(tokens, pos, None)
                logits.float().log_softmax(-1).gather(-1, tokens[..., None]).sum().backward()
                model.zero_grad(set_to_none=True)

            xs = cuda_ms(step, max(3, repeats // 4))
            n = num_seqs * tokens_per_seq
            lengths, train, rollout, masks = make_batch(num_seqs, tokens_per_seq, tokens_per_seq, "cuda")
            t, r, m = (torch.cat(x) for x in (train, rollout, masks))
            cu = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0))
            eng = cuda_ms(lambda: compute_mis(t, r, m, cu, MISConfig(**SEED000)), repeats)
            print(f"model: GPT {params / 1e6:.0f}M parameters (hidden 2048, 8 layers, vocabulary 32000), bf16, "
                  f"{num_seqs} x {tokens_per_seq} = {n} tokens")
            print(f"  forward + backward            {fmt(xs)}")
            print(f"  engine on the same tokens     {fmt(eng)}  = {100 * statistics.median(eng) / statistics.median(xs):.2f}% of it")
            del model, gpt
        finally:
            ps.destroy_model_parallel()


def loss_func_memory(tokens: int, vocab: int, chunk: int) -> None:
    """Peak extra GPU memory of ``MegatronRLLoss.loss_func`` forward + backward on float32 logits
    ``[1, T, V]`` (Megatron's Float16Module hands fp32 logits to the loss), as a multiple of the
    logits' size."""
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss

    mb, _ = memory_micro_batch(tokens, vocab)
    totals, num = mb.total_lengths, int(mb.response_lengths.sum())
    with one_rank_group("nccl") as group:
        rl = MegatronRLLoss(LossConfig(policy_loss="decoupled_ppo", log_probs_chunk_size=chunk), MISConfig(use_tis=True),
                            tp_group=group, cp_group=group, dp_group=group)
        view = rl.local_view(mb)
        den = rl.count_denominators([mb])
        output = torch.randn(1, int(totals.sum()), vocab, device="cuda").requires_grad_()
        size = output.numel() * output.element_size()
        for attempt in ("warm-up", "measured"):
            output.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss, _, _ = rl.loss_func(mb, view, den, 1, output)
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        print(f"loss_func: T={int(totals.sum())} (R={num} response rows) V={vocab} chunk={chunk} float32 logits "
              f"{size / 2**30:.2f} GiB: peak extra {peak / 2**30:.2f} GiB = {peak / size:.2f} x logits "
              "(the logits' own gradient is 1.00 x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} cuda={torch.version.cuda}")
    parts = [lambda: engine_figures(args.sequences, args.repeats), lambda: loss_func_memory(16384, 152064, 4096)]
    if not args.skip_model:
        parts.append(lambda: model_share(4096, 8, args.repeats))
    failed = 0
    for part in parts:  # one part failing does not hide the others' figures
        try:
            part()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed += 1
        sys.stdout.flush()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
