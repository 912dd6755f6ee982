"""Benchmark: chunked vocab-parallel log-probs + entropy against a plain full log-softmax.

Single rank (no TP group), forward + backward of ``sum(log_probs) + sum(entropy)`` for ``T``
tokens over a vocabulary of ``V``. The reference materialises ``log_softmax`` (and
``softmax * log_softmax`` for the entropy) in float32 and keeps them for backward; the chunked
function keeps per-token statistics only and recomputes one chunk at a time. Prints the median
time of each and the ratio, plus (on CUDA) the peak memory of each, in one run on one machine.

    python benchmarks/bench_logprobs.py [--tokens 2048] [--vocab 16000] [--chunk 512] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout's package
from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs  # noqa: E402


def reference(logits: torch.Tensor, targets: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def chunked(logits: torch.Tensor, targets: torch.Tensor, chunk: int):
    return vocab_parallel_log_probs(logits, targets, with_entropy=True, chunk_size=chunk)


def run(fn, logits, targets, device) -> tuple[float, float | None]:
    x = logits.detach().clone().requires_grad_()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    lp, ent = fn(x, targets)
    (lp.sum() + ent.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = None
    return time.perf_counter() - t0, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(args.tokens, args.vocab, generator=g)).to(getattr(torch, args.dtype)).to(args.device)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(args.device)

    lp_a, ent_a = reference(logits, targets)
    lp_b, ent_b = chunked(logits, targets, args.chunk)
    err = max(float((lp_a - lp_b).abs().max()), float((ent_a - ent_b).abs().max()))

    results = {}
    for name, fn in (("full log_softmax", reference), (f"chunked ({args.chunk})", lambda x, t: chunked(x, t, args.chunk))):
        run(fn, logits, targets, args.device)  # warm-up
        samples = [run(fn, logits, targets, args.device) for _ in range(args.repeats)]
        results[name] = (statistics.median(s[0] for s in samples), samples[-1][1])
    print(f"T={args.tokens} V={args.vocab} dtype={args.dtype} device={args.device} max |diff|={err:.2e}")
    (ref_name, (ref_t, ref_m)), (name, (t, m)) = results.items()
    for n, (tt, mm) in results.items():
        mem = f", peak {mm:.0f} MiB" if mm is not None else ""
        print(f"  {n:>20}: median {tt * 1e3:8.1f} ms{mem}")
    print(f"  time ratio chunked / full: {t / ref_t:.2f}" + (f", memory ratio {m / ref_m:.2f}" if m is not None else ""))


if __name__ == "__main__":
    main()
