"""Per-token log-probs (and entropy) from vocab-parallel logits over an explicit TP group.

Megatron-Core's output layer leaves the logits split over the vocabulary: TP rank ``k`` of
``tp`` holds columns ``[k V/tp, (k+1) V/tp)`` of ``[..., V]``. :func:`vocab_parallel_log_probs`
turns that shard and the target tokens into ``log softmax(logits / T)[target]`` (and optionally
the entropy of ``softmax(logits / T)``), identical on every TP rank, with correct gradients for
this rank's shard. ``T`` is the rollout temperature, applied as SGLang applies it: the logits are
divided by ``T`` before the softmax.

Communication, per chunk of tokens (all over ``group``; none at all when ``group`` is ``None``
or has one rank):

1. one ``MAX`` all-reduce of the per-token logit maxima ``[C]``;
2. one ``SUM`` all-reduce of the stacked per-token ``[C, 2]`` (sum of ``exp``, target logit) or
   ``[C, 3]`` with entropy (plus ``sum exp * logit``).

That is the three reductions of a vocab-parallel log-softmax (max, sum-exp, target logit) plus
entropy's one, fused into two collectives per chunk. Backward runs no collective: every TP rank
receives the same upstream gradient (the loss after the log-probs is replicated), and each rank
computes the gradient of its own vocabulary shard from the saved per-token statistics.

Memory: tokens are processed in chunks of ``chunk_size``; forward keeps only per-token
statistics (max-shifted log-normaliser, target logit, mean logit) and backward recomputes the
softmax chunk by chunk, so no ``[T, V/tp]`` float32 buffer beyond one chunk's is held between
forward and backward (the returned gradient itself is ``[T, V/tp]``, as for any loss).

Equal (up to rounding) to ``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` and to
``log_softmax`` of the gathered logits; ``tests/test_tp_logprobs.py`` checks both, on a real
Megatron-Core GPT with TP=2.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["vocab_parallel_log_probs"]


def _group_info(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _all_reduce(t: torch.Tensor, op: str, group: Any, world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)


def _chunks(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    step = num_tokens if chunk_size <= 0 else chunk_size
    return [(s, min(s + step, num_tokens)) for s in range(0, num_tokens, max(step, 1))]


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy, chunk_size):  # type: ignore[override]
        rank, world = _group_info(group)
        num_tokens, local_vocab = logits.shape
        vocab_start = rank * local_vocab
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        local_target = targets - vocab_start
        on_rank = (local_target >= 0) & (local_target < local_vocab)
        local_target = torch.where(on_rank, local_target, torch.zeros_like(local_target))

        log_norm = torch.empty(num_tokens, dtype=compute_dtype, device=logits.device)  # log sum exp(z)
        log_probs = torch.empty(num_tokens, dtype=compute_dtype, device=logits.device)
        mean_logit = torch.empty(num_tokens if with_entropy else 0, dtype=compute_dtype, device=logits.device)
        entropy = torch.empty(num_tokens if with_entropy else 0, dtype=compute_dtype, device=logits.device)
        for s, e in _chunks(num_tokens, chunk_size):
            z = logits[s:e].to(compute_dtype)
            if temperature != 1.0:
                z = z / temperature
            zmax = z.max(dim=-1).values
            _all_reduce(zmax, "max", group, world)
            shifted = z - zmax[:, None]
            exp = shifted.exp()
            target_logit = shifted.gather(1, local_target[s:e, None]).squeeze(1)
            stats = [exp.sum(dim=-1), torch.where(on_rank[s:e], target_logit, torch.zeros_like(target_logit))]
            if with_entropy:
                stats.append((exp * shifted).sum(dim=-1))
            stacked = torch.stack(stats, dim=1)
            _all_reduce(stacked, "sum", group, world)
            log_sum = stacked[:, 0].log()
            log_norm[s:e] = zmax + log_sum
            log_probs[s:e] = stacked[:, 1] - log_sum
            if with_entropy:
                mean_shifted = stacked[:, 2] / stacked[:, 0]  # E_p[z - zmax]
                entropy[s:e] = log_sum - mean_shifted
                mean_logit[s:e] = mean_shifted + zmax
        ctx.save_for_backward(logits, local_target, on_rank, log_norm, mean_logit)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_size = chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        logits, local_target, on_rank, log_norm, mean_logit = ctx.saved_tensors
        temperature = ctx.temperature
        num_tokens = logits.shape[0]
        compute_dtype = log_norm.dtype
        grad = torch.empty_like(logits)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s, e in _chunks(num_tokens, ctx.chunk_size):
            z = logits[s:e].to(compute_dtype)
            if temperature != 1.0:
                z = z / temperature
            p = (z - log_norm[s:e, None]).exp()
            g_lp = grad_log_probs[s:e].to(compute_dtype) if grad_log_probs is not None else None
            gz = torch.zeros_like(z)
            if g_lp is not None:
                gz = -p * g_lp[:, None]
                gz.scatter_add_(1, local_target[s:e, None], torch.where(on_rank[s:e], g_lp, torch.zeros_like(g_lp))[:, None])
            if use_entropy:
                # dH/dz_j = p_j (E_p[z] - z_j)
                gz = gz + p * (mean_logit[s:e, None] - z) * grad_entropy[s:e, None].to(compute_dtype)
            if temperature != 1.0:
                gz = gz / temperature
            grad[s:e] = gz.to(logits.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (and the entropy) under ``softmax(logits / temperature)`` from this
    rank's vocabulary shard.

    Args:
        logits: ``[..., V/tp]`` this TP rank's shard (rank ``k`` holds vocabulary ids
            ``[k V/tp, (k+1) V/tp)``, Megatron-Core's layout); any float dtype (computed in at
            least float32).
        targets: ``[...]`` integer token ids in ``[0, V)``, the same on every TP rank.
        group: the tensor-parallel process group (``parallel_state.
            get_tensor_model_parallel_group()``); ``None``: ``logits`` hold the full vocabulary and
            nothing is communicated. Never defaults to the WORLD group.
        temperature: rollout sampling temperature (``> 0``).
        with_entropy: also return the per-token entropy (differentiable).
        chunk_size: tokens per chunk (``-1``: all at once).
        check_targets: raise on a target id outside ``[0, V)`` (one host sync).

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32 (float64 for float64 logits),
        identical on every rank of ``group``. Collectives: ``2 * ceil(T / chunk_size)`` in
        forward (see module docstring), none in backward; each rank's ``logits`` receives the
        gradient of its own shard.

    Raises:
        ValueError: shape mismatches, a non-positive temperature or chunk size, or (with
            ``check_targets``) an out-of-range target.
    """
    if logits.dim() < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must have the shape of logits {tuple(logits.shape)} without its last "
            "(vocabulary) dimension"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    if chunk_size != -1 and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be >= 1, or -1 (one chunk)")
    _, world = _group_info(group)
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    vocab = logits.shape[-1] * world
    if check_targets and flat_targets.numel():
        lo, hi = int(flat_targets.min()), int(flat_targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"target ids must lie in [0, {vocab}) (vocabulary size), got min {lo}, max {hi}")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        flat_logits, flat_targets, group, float(temperature), bool(with_entropy), int(chunk_size)
    )
    return log_probs.reshape(lead), (entropy.reshape(lead) if with_entropy else None)
