"""Benchmark: chunked vocab-parallel log-probs + entropy against a plain full log-softmax.

Single rank (no TP group), forward + backward of ``sum(log_probs) + sum(entropy)`` for ``T``
tokens over a vocabulary of ``V``. The reference materialises ``log_softmax`` (and
``softmax * log_softmax`` for the entropy) in float32 and keeps them for backward; the chunked
function keeps per-token statistics only and recomputes one chunk at a time. Prints the median
time of each and the ratio, plus (on CUDA) the peak memory of each, in one run on one machine.

    python benchmarks/bench_logprobs.py [--tokens 2048] [--vocab 16000] [--chunk 512] [--device cpu]

``--loss-func`` measures instead the peak extra memory of ``MegatronRLLoss.loss_func`` (forward
and backward) as a multiple of the size of the logits it is given, for the current code (the
response rows gathered one chunk at a time, ``rows=``) and for the former path (an
``index_select`` copy of all ``[R_local, V/tp]`` response rows, kept for backward, plus its
gradient). Peak memory is counted on any device as the bytes of live tensor storages, polled
after every dispatched op (:class:`LiveBytes`): what a caching allocator would have to hold,
without its rounding.

    python benchmarks/bench_logprobs.py --loss-func [--tokens 2048] [--vocab 16000] [--chunk 512]
"""

from __future__ import annotations

import argparse
import contextlib
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


class LiveBytes:
    """Peak bytes of live tensor storages created while active (a ``TorchDispatchMode`` polling
    weak references to every storage an op returns). Storages of ``existing`` tensors (the
    inputs; views of them are returned by ops too) are not counted."""

    def __init__(self, *existing: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        key = st.data_ptr()
                        if key and key not in tracker.storages and key not in tracker.excluded:
                            tracker.storages[key] = (StorageWeakRef(st), st.nbytes())
                tracker.poll()
                return out

        self.storages: dict[int, tuple[object, int]] = {}
        self.excluded = {t.untyped_storage().data_ptr() for t in existing}
        self.peak = 0
        self.mode = _Mode()

    def poll(self) -> None:
        live = 0
        for key, (ref, nbytes) in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
            else:
                live += nbytes
        self.peak = max(self.peak, live)

    def __enter__(self) -> "LiveBytes":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


@contextlib.contextmanager
def one_rank_group(backend: str = "gloo"):
    """A one-process default group (file store in a temporary folder) for the block; yields a
    subgroup of rank 0 for the loss's TP / CP / DP groups, and destroys the default group on exit."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.new_group([0])
        finally:
            dist.destroy_process_group()


def memory_micro_batch(tokens: int, vocab: int):
    """The micro-batch of the loss_func memory measurements (here and in bench_gpu.py): 8 packed
    sequences of ``tokens / 8`` tokens, 1/8 of each a prompt; returns it and the generator that
    made it (the logits are drawn from it next)."""
    from megatron_mis.integrations.rl_batch import RLMicroBatch

    g = torch.Generator().manual_seed(0)
    num_seq = 8
    prompt = max(1, tokens // (num_seq * 8))
    resp = tokens // num_seq - prompt
    totals = torch.full((num_seq,), prompt + resp)
    responses = torch.full((num_seq,), resp)
    num = int(responses.sum())
    old = torch.randn(num, generator=g) * 0.3 - 2.0
    mb = RLMicroBatch(
        tokens=torch.randint(0, vocab, (int(totals.sum()),), generator=g),
        cu_seqlens=torch.nn.functional.pad(torch.cumsum(totals, 0), (1, 0)).int(), response_lengths=responses,
        loss_mask=torch.ones(num), advantages=torch.randn(num, generator=g), old_log_probs=old,
        rollout_log_probs=old + 0.1 * torch.randn(num, generator=g),
    )
    return mb, g


def loss_func_memory(tokens: int, vocab: int, chunk: int) -> None:
    """Peak extra memory of MegatronRLLoss.loss_func + backward, as a multiple of the logits."""
    import types

    from megatron_mis import MISConfig
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.integrations.megatron_loss import MegatronRLLoss, _on

    mb, g = memory_micro_batch(tokens, vocab)
    totals, num = mb.total_lengths, int(mb.response_lengths.sum())
    with one_rank_group("gloo") as group:
        cfg = LossConfig(policy_loss="decoupled_ppo", log_probs_chunk_size=chunk)
        for name in ("index_select copy (before)", "rows= (after)"):
            rl = MegatronRLLoss(cfg, MISConfig(use_tis=True), tp_group=group, cp_group=group, dp_group=group)
            if name.startswith("index_select"):
                def copy_path(self, output_tensor, view, with_entropy):
                    logits = output_tensor.reshape(-1, output_tensor.shape[-1])
                    return vocab_parallel_log_probs(
                        logits.index_select(0, _on(view.rows, logits.device)), _on(view.targets, logits.device),
                        group=self.tp_group, temperature=self.config.rollout_temperature,
                        with_entropy=with_entropy, chunk_size=self.config.log_probs_chunk_size,
                    )
                rl._log_probs = types.MethodType(copy_path, rl)
            view = rl.local_view(mb)
            den = rl.count_denominators([mb])
            output = (torch.randn(1, int(totals.sum()), vocab, generator=g)).requires_grad_()
            size = output.numel() * output.element_size()
            with LiveBytes(output) as live:
                loss, _, _ = rl.loss_func(mb, view, den, 1, output)
                loss.backward()
            print(f"  {name:>28}: peak extra {live.peak / 2**20:8.1f} MiB = {live.peak / size:.2f} x logits "
                  f"({size / 2**20:.1f} MiB; the logits' own gradient is 1.00 x of it)")
    print(f"T={int(totals.sum())} (R={num} response rows) V={vocab} chunk={chunk} float32")


if __name__ == "__main__":
    if "--loss-func" in sys.argv:
        ap = argparse.ArgumentParser(description="peak extra memory of MegatronRLLoss.loss_func")
        ap.add_argument("--loss-func", action="store_true")
        ap.add_argument("--tokens", type=int, default=2048)
        ap.add_argument("--vocab", type=int, default=16000)
        ap.add_argument("--chunk", type=int, default=512)
        a = ap.parse_args()
        torch.set_num_threads(1)
        loss_func_memory(a.tokens, a.vocab, a.chunk)
    else:
        main()
