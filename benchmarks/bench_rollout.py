"""Benchmark: the demo's rollout engine and trainer passes on the demo-sized GPT (1 process).

Times, in one run on the same machine (median of several repeats):

- a rollout of ``--batch`` prompts x ``--new-tokens`` tokens through every fast numeric path
  (fp32 / bf16 / fp16 / int8, KV cache) and through the true-on-policy path (the trainer's
  kernels and shapes, one full-batch forward per token), with the cost ratio of the aligned
  path against the fast fp32 one;
- one fp32 Megatron-Core forward (no grad: the pi_old recompute) and one forward + backward of
  that batch, packed thd in one micro-batch and padded bshd.

    python benchmarks/bench_rollout.py [--batch 32] [--prompt-len 6] [--new-tokens 24]
                                       [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per thd micro-batch (second timing)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    store = tempfile.mktemp(prefix="bench_rollout_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine, weights_from_megatron
    from megatron_mis.testbed.demo.scoring import trainer_log_probs
    from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs
    from megatron_mis.testing.cpu import cpu_compat
    from megatron_mis.testbed.models.gpt import GPTSpec, build_gpt
    from megatron_mis.parallel.packing import pack_sequences, pad_sequences
    from megatron_mis.testing.distributed import megatron_parallel

    spec = GPTSpec(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
        max_sequence_length=max(64, args.prompt_len + args.new_tokens),
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, args.vocab, (args.prompt_len,), generator=g) for _ in range(args.batch)]
    print(
        f"GPT vocab {args.vocab} hidden {args.hidden} layers {args.layers}; {args.batch} prompts x "
        f"({args.prompt_len} + {args.new_tokens}) tokens; {args.threads} thread(s); median of {args.repeats}"
    )
    with cpu_compat(), megatron_parallel(tp=1, seed=1):
        model = build_gpt(spec)
        weights = weights_from_megatron(model)
        print(f"  weight sync (GPTModel -> engine)        {1e3 * timed(lambda: weights_from_megatron(model), args.repeats):8.2f} ms")
        fast_ms = {}
        for precision in ("fp32", "bf16", "fp16", "int8"):
            eng = RolloutEngine(weights, RolloutConfig(precision=precision, max_new_tokens=args.new_tokens))
            fast_ms[precision] = 1e3 * timed(lambda: eng.generate(prompts, generator=torch.Generator().manual_seed(1)), args.repeats)
            print(f"  rollout fast {precision:5s} (KV cache)            {fast_ms[precision]:8.2f} ms")
        aligned = RolloutEngine(weights, RolloutConfig(precision="fp32", true_on_policy=True, max_new_tokens=args.new_tokens))
        aligned_ms = 1e3 * timed(lambda: aligned.generate(prompts, generator=torch.Generator().manual_seed(1)), args.repeats)
        print(f"  rollout true-on-policy (aligned)         {aligned_ms:8.2f} ms   = {aligned_ms / fast_ms['fp32']:.1f} x fast fp32")
        mb = args.micro_batch
        aligned_mb = RolloutEngine(
            weights, RolloutConfig(precision="fp32", true_on_policy=True, max_new_tokens=args.new_tokens, micro_batch_size=mb)
        )
        mb_ms = 1e3 * timed(lambda: aligned_mb.generate(prompts, generator=torch.Generator().manual_seed(1)), args.repeats)
        print(f"  rollout true-on-policy, micro-batch {mb:3d}  {mb_ms:8.2f} ms   = {mb_ms / fast_ms['fp32']:.1f} x fast fp32")

        batch = RolloutEngine(weights, RolloutConfig(precision="fp32", max_new_tokens=args.new_tokens)).generate(prompts)
        packed = pack_sequences(batch.sequences)
        resp = batch.response_lengths

        def thd_fwd():
            with torch.no_grad():
                trainer_log_probs(model, packed, resp)

        def thd_fwd_bwd():
            lp = trainer_log_probs(model, packed, resp)
            torch.cat(lp).sum().backward()

        parts = [
            (pack_sequences([batch.sequences[i] for i in r]), resp[list(r)])
            for r in [range(i, min(i + mb, args.batch)) for i in range(0, args.batch, mb)]
        ]

        def thd_mb(grad: bool):
            for pk, rl in parts:
                with torch.set_grad_enabled(grad):
                    lp = trainer_log_probs(model, pk, rl)
                    if grad:
                        torch.cat(lp).sum().backward()

        tokens, _ = pad_sequences(batch.sequences)
        labels = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)

        def bshd(grad: bool):
            with torch.set_grad_enabled(grad):
                logits = model(tokens, positions, None)
                lp, _ = vocab_parallel_log_probs(logits, labels)
                if grad:
                    lp.sum().backward()

        t = {
            "thd fwd (pi_old recompute, no grad)": timed(thd_fwd, args.repeats),
            "thd fwd + bwd": timed(thd_fwd_bwd, args.repeats),
            f"thd fwd, micro-batches of {mb}": timed(lambda: thd_mb(False), args.repeats),
            f"thd fwd + bwd, micro-batches of {mb}": timed(lambda: thd_mb(True), args.repeats),
            "bshd fwd (no grad)": timed(lambda: bshd(False), args.repeats),
            "bshd fwd + bwd": timed(lambda: bshd(True), args.repeats),
        }
        for name, sec in t.items():
            print(f"  trainer {name:33s} {1e3 * sec:8.2f} ms")
    dist.destroy_process_group()
    os.path.exists(store) and os.remove(store)


if __name__ == "__main__":
    main()
