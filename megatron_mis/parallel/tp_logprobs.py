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

Sampling support (top-p / top-k replay): when the rollout engine sampled from a truncated
distribution (nucleus or top-k), the trainer's ``softmax(logits / T)`` spreads probability over ids
the rollout could never draw, a support mismatch no importance weight can repair. Given the
rollout's kept ids per token (:class:`TokenSupport`), the log-probs and entropy are those of the
distribution renormalised over that support, as the rollout engine's processed log-probs are:
the trainer replays the rollout's truncation (as slime's ``--rollout-top-p`` replay does for the
log-probs; slime takes the entropy of the unmasked logits, which a second call without the support
gives: ``MegatronRLLoss`` does so unless ``LossConfig.replay_entropy`` is ``kept``). The mask is
built chunk by chunk on the device from the sparse ids (no ``[T, V/tp]`` mask is kept).

Equal (up to rounding) to ``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` and to
``log_softmax`` of the gathered logits; ``tests/distributed/test_tp_logprobs.py`` checks both, on a real
Megatron-Core GPT with TP=2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_mis.core.checks import reads_values

__all__ = ["TokenSupport", "vocab_parallel_log_probs", "log_probs_from_shards", "log_softmax_from_shards"]


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


def _scaled(logits: torch.Tensor, compute_dtype: torch.dtype, temperature: float) -> torch.Tensor:
    z = logits.to(compute_dtype)
    return z / temperature if temperature != 1.0 else z


def _chunk_statistics(
    zs: Sequence[torch.Tensor],
    local_targets: Sequence[torch.Tensor],
    on_rank: Sequence[torch.Tensor],
    with_entropy: bool,
    reduce_max: Callable[[list[torch.Tensor]], torch.Tensor],
    reduce_sum: Callable[[list[torch.Tensor]], torch.Tensor],
    masked: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The forward arithmetic of one chunk, shared by the distributed function and the
    single-process shard path (:func:`log_probs_from_shards`).

    Args:
        zs: vocabulary shards ``[C, V/tp]`` held by this process (temperature applied, compute
            dtype): one shard under torch.distributed, all of them in :func:`log_probs_from_shards`.
        local_targets: per shard ``[C]`` target index inside the shard (0 where not on it).
        on_rank: per shard ``[C]`` bool, the target lies in the shard.
        reduce_max / reduce_sum: combine the per-shard ``[C]`` maxima / ``[C, k]`` statistics
            into the whole vocabulary's (an all-reduce, or an in-order max / sum of the list).
        masked: some logits are ``-inf`` (outside a :class:`TokenSupport`): their entropy term
            ``exp * z`` is taken as 0 instead of ``0 * -inf``.

    Returns:
        ``(zmax [C], shifted shards [C, V/tp], stacked [C, k])`` with ``stacked`` = (sum of
        ``exp(z - zmax)``, shifted target logit, and with entropy ``sum exp(z - zmax) (z - zmax)``)
        over the whole vocabulary.
    """
    zmax = reduce_max([z.max(dim=-1).values for z in zs])
    shifted = [z - zmax[:, None] for z in zs]
    stats = []
    for s, target, ok in zip(shifted, local_targets, on_rank):
        exp = s.exp()
        target_logit = s.gather(1, target[:, None]).squeeze(1)
        cols = [exp.sum(dim=-1), torch.where(ok, target_logit, torch.zeros_like(target_logit))]
        if with_entropy:
            term = exp * s
            cols.append((torch.where(exp > 0, term, torch.zeros_like(term)) if masked else term).sum(dim=-1))
        stats.append(torch.stack(cols, dim=1))
    return zmax, shifted, reduce_sum(stats)


def _shard_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - vocab_start
    ok = (local >= 0) & (local < local_vocab)
    return torch.where(ok, local, torch.zeros_like(local)), ok


@dataclass(frozen=True, slots=True)
class TokenSupport:
    """The ids the rollout could sample at each token (its top-p / top-k support), sparse.

    Token ``t``'s support is ``ids[offsets[t]:offsets[t + 1]]``; an empty range means the token
    was sampled from the whole vocabulary (no truncation there). The sampled token itself always
    counts as supported (so a support that lacks it cannot give a log-prob of ``-inf``).

    Attributes:
        ids: ``[K]`` int64 vocabulary ids in ``[0, V)``, token by token, on the logits' device.
        token_index: ``[K]`` int64, the token (``0 .. T-1``) each id belongs to, non-decreasing,
            on the logits' device.
        offsets: ``[T + 1]`` int64 on the host (CPU), ``offsets[0] == 0``, ``offsets[-1] == K``:
            host metadata, read without a device synchronisation to cut chunks.
    """

    ids: torch.Tensor
    token_index: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_lists(cls, per_token: Sequence[Sequence[int]], *, device: torch.device | str | None = None) -> "TokenSupport":
        """From one list of kept ids per token (``[]``: no truncation at that token). The two
        ``[K]`` tensors go to ``device`` in one pinned, non-blocking copy when it is an accelerator.

        Raises:
            ValueError: a non-integer id.
        """
        counts = [len(x) for x in per_token]
        flat: list[int] = []
        for t, ids in enumerate(per_token):
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) and not (torch.is_tensor(i) and not i.is_floating_point()):
                    raise ValueError(f"support ids must be integers, got {i!r} at token {t}")
                flat.append(int(i))
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        if counts:
            offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        token_index = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
        host = cls(ids=torch.tensor(flat, dtype=torch.int64), token_index=token_index, offsets=offsets)
        return host if device is None else host.to(device)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets.numel()) - 1

    def select(self, index: torch.Tensor) -> "TokenSupport":
        """The supports of tokens ``index [M]`` (int64, CPU), in that order: token ``j`` of the
        result is token ``index[j]`` of this one (a context-parallel rank's share of a
        micro-batch's responses). Host tensors only (``ids`` on the CPU): no synchronisation.

        Raises:
            ValueError: ``ids`` not on the CPU, or ``index`` out of range.
        """
        if self.ids.device.type != "cpu" or index.device.type != "cpu":
            raise ValueError("TokenSupport.select works on host supports (ids and index on the CPU); select before .to(device)")
        index = index.to(torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_tokens):
            raise ValueError(f"select: token index out of [0, {self.num_tokens}), got [{int(index.min())}, {int(index.max())}]")
        starts = self.offsets[index]
        counts = self.offsets[index + 1] - starts
        offsets = torch.zeros(index.numel() + 1, dtype=torch.int64)
        offsets[1:] = counts.cumsum(0)
        total = int(offsets[-1])
        gather = torch.repeat_interleave(starts - offsets[:-1], counts, output_size=total) + torch.arange(total)
        token_index = torch.repeat_interleave(torch.arange(index.numel()), counts, output_size=total)
        return TokenSupport(ids=self.ids.index_select(0, gather), token_index=token_index, offsets=offsets)

    def to(self, device: torch.device | str) -> "TokenSupport":
        """``ids`` and ``token_index`` on ``device`` (from host memory: one pinned, non-blocking
        copy of both); ``offsets`` stay on the host."""
        dev = torch.device(device)
        if self.ids.device == dev and self.token_index.device == dev:
            return self
        both = torch.stack([self.ids, self.token_index.to(self.ids.device)])
        if both.device.type == "cpu" and dev.type != "cpu":
            from megatron_mis.core.segments import to_device

            both = to_device(both, dev)
        else:
            both = both.to(dev)
        return TokenSupport(ids=both[0], token_index=both[1], offsets=self.offsets)

    def validate(self, num_tokens: int, vocab: int, device: torch.device, *, read_values: bool) -> None:
        """Shapes, dtypes and devices always; with ``read_values`` (a host read) also the id range
        and the offsets' consistency.

        Raises:
            ValueError: naming the field and what is allowed.
        """
        problems = []
        if self.offsets.device.type != "cpu" or self.offsets.dim() != 1 or self.offsets.dtype != torch.int64:
            problems.append(f"offsets must be a 1-D int64 CPU tensor, got {tuple(self.offsets.shape)} {self.offsets.dtype} on {self.offsets.device}")
        elif self.offsets.numel() != num_tokens + 1:
            problems.append(f"offsets has {self.offsets.numel()} entries, expected tokens + 1 = {num_tokens + 1}")
        for name in ("ids", "token_index"):
            t = getattr(self, name)
            if t.dim() != 1 or t.dtype != torch.int64:
                problems.append(f"{name} must be a 1-D int64 tensor, got {tuple(t.shape)} {t.dtype}")
            elif t.device != device:
                problems.append(f"{name} is on {t.device}, the logits on {device}")
        if not problems and self.ids.shape != self.token_index.shape:
            problems.append(f"ids {tuple(self.ids.shape)} and token_index {tuple(self.token_index.shape)} differ in shape")
        if not problems:
            off = self.offsets
            if int(off[0]) != 0 or int(off[-1]) != self.ids.numel() or bool((off[1:] < off[:-1]).any()):
                problems.append(f"offsets must rise from 0 to the number of ids {self.ids.numel()}, got {off.tolist()[:8]}...")
        if not problems and read_values and self.ids.numel():
            lo, hi = torch.stack([self.ids.min(), self.ids.max()]).tolist()
            if lo < 0 or hi >= vocab:
                problems.append(f"support ids must lie in [0, {vocab}) (vocabulary size), got min {lo}, max {hi}")
            counts = torch.bincount(self.token_index.cpu(), minlength=num_tokens)[:num_tokens]
            if counts.numel() != num_tokens or not torch.equal(counts, self.offsets[1:] - self.offsets[:-1]):
                problems.append("token_index does not match offsets (token t must own ids[offsets[t]:offsets[t+1]])")
        if problems:
            raise ValueError("TokenSupport: " + "; ".join(problems))


def _support_mask(support: TokenSupport, start: int, end: int, vocab_start: int, local_vocab: int,
                  local_target: torch.Tensor, on_rank: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[C, V/tp]`` bool: what tokens ``start .. end-1`` may take on this rank's shard. Built on
    the device from the sparse ids (no host read: the chunk's id range comes from host offsets)."""
    a, b = int(support.offsets[start]), int(support.offsets[end])
    num = end - start
    ids = support.ids[a:b] - vocab_start
    tok = support.token_index[a:b] - start
    here = (ids >= 0) & (ids < local_vocab)
    hits = torch.zeros(num, local_vocab, dtype=torch.int32, device=device)
    hits.index_put_((tok, ids.clamp(0, local_vocab - 1)), here.to(torch.int32), accumulate=True)
    truncated = torch.zeros(num, dtype=torch.int32, device=device).index_add_(0, tok, torch.ones_like(tok, dtype=torch.int32)) > 0
    keep = (hits > 0) | ~truncated[:, None]
    # the sampled token is always supported (where it lies on this shard)
    return keep.scatter(1, local_target[:, None], keep.gather(1, local_target[:, None]) | on_rank[:, None])


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy, chunk_size, rows=None, support=None):  # type: ignore[override]
        rank, world = _group_info(group)
        local_vocab = logits.shape[1]
        num_tokens = logits.shape[0] if rows is None else rows.shape[0]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        local_target, on_rank = _shard_targets(targets, rank * local_vocab, local_vocab)

        def reduce_max(parts: list[torch.Tensor]) -> torch.Tensor:
            _all_reduce(parts[0], "max", group, world)
            return parts[0]

        def reduce_sum(parts: list[torch.Tensor]) -> torch.Tensor:
            _all_reduce(parts[0], "sum", group, world)
            return parts[0]

        log_norm = torch.empty(num_tokens, dtype=compute_dtype, device=logits.device)  # log sum exp(z)
        log_probs = torch.empty(num_tokens, dtype=compute_dtype, device=logits.device)
        mean_logit = torch.empty(num_tokens if with_entropy else 0, dtype=compute_dtype, device=logits.device)
        entropy = torch.empty(num_tokens if with_entropy else 0, dtype=compute_dtype, device=logits.device)
        for s, e in _chunks(num_tokens, chunk_size):
            z = _scaled(_rows(logits, rows, s, e), compute_dtype, temperature)
            if support is not None:
                keep = _support_mask(support, s, e, rank * local_vocab, local_vocab, local_target[s:e], on_rank[s:e], z.device)
                z = z.masked_fill(~keep, float("-inf"))
            zmax, _, stacked = _chunk_statistics(
                [z], [local_target[s:e]], [on_rank[s:e]], with_entropy, reduce_max, reduce_sum, support is not None
            )
            log_sum = stacked[:, 0].log()
            log_norm[s:e] = zmax + log_sum
            log_probs[s:e] = stacked[:, 1] - log_sum
            if with_entropy:
                mean_shifted = stacked[:, 2] / stacked[:, 0]  # E_p[z - zmax]
                entropy[s:e] = log_sum - mean_shifted
                mean_logit[s:e] = mean_shifted + zmax
        ctx.save_for_backward(logits, local_target, on_rank, log_norm, mean_logit, rows)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_size = chunk_size
        ctx.support = support
        ctx.vocab_start = rank * local_vocab
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        logits, local_target, on_rank, log_norm, mean_logit, rows = ctx.saved_tensors
        temperature = ctx.temperature
        num_tokens = log_norm.shape[0]
        compute_dtype = log_norm.dtype
        # with rows, rows of logits outside them get no gradient: the gradient of logits is
        # written in place, one chunk at a time (no [R, V/tp] copy of the rows)
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s, e in _chunks(num_tokens, ctx.chunk_size):
            # at most four [C, V/tp] temporaries at a time (z, p, gz and the entropy term): the
            # products are formed in place where the operand is this chunk's own buffer
            z = _rows(logits, rows, s, e).to(compute_dtype)
            if temperature != 1.0:
                z = z / temperature
            keep = None
            if ctx.support is not None:
                keep = _support_mask(ctx.support, s, e, ctx.vocab_start, z.shape[1], local_target[s:e], on_rank[s:e], z.device)
                z = z.masked_fill(~keep, float("-inf"))  # p = 0 there: no gradient outside the support
            p = torch.sub(z, log_norm[s:e, None]).exp_()
            g_lp = grad_log_probs[s:e].to(compute_dtype) if grad_log_probs is not None else None
            if g_lp is not None:
                gz = p * g_lp.neg()[:, None]
                gz.scatter_add_(1, local_target[s:e, None], torch.where(on_rank[s:e], g_lp, torch.zeros_like(g_lp))[:, None])
            else:
                gz = torch.zeros_like(z)
            if use_entropy:
                # dH/dz_j = p_j (E_p[z] - z_j)
                term = torch.sub(mean_logit[s:e, None], z)
                if keep is not None:
                    term.masked_fill_(~keep, 0.0)  # inf * 0 outside the support
                del z
                gz.add_(term.mul_(p).mul_(grad_entropy[s:e, None].to(compute_dtype)))
                del term
            del p
            if temperature != 1.0:
                gz.div_(temperature)
            if rows is None:
                grad[s:e] = gz.to(logits.dtype)
            else:
                grad.index_add_(0, rows[s:e], gz.to(logits.dtype))
        return grad, None, None, None, None, None, None, None


def _rows(logits: torch.Tensor, rows: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    """Chunk ``[start, end)`` of the tokens: ``logits[start:end]``, or the logits rows
    ``rows[start:end]`` (a ``[C, V/tp]`` gather of one chunk, never of all rows)."""
    return logits[start:end] if rows is None else logits.index_select(0, rows[start:end])


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    check_targets: bool | None = None,
    rows: torch.Tensor | None = None,
    support: TokenSupport | None = None,
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
        check_targets: raise on a target id outside ``[0, V)``. ``None`` (default): only where
            reading the ids costs no device synchronisation (host tensors, or the debug flag
            ``MEGATRON_MIS_DEBUG_CHECKS=1``: :mod:`megatron_mis.core.checks`); ``True``: always
            (one host sync on an accelerator); ``False``: never (an out-of-range id then lies on
            no shard and its log-prob is computed from a target logit of 0: wrong, not an error).
        rows: ``[R]`` int64 (on the logits' device): compute only at these rows of ``logits``
            viewed as ``[S, V/tp]`` (``targets`` then has shape ``[R]``). Equal to
            ``vocab_parallel_log_probs(logits.reshape(-1, V/tp).index_select(0, rows), targets)``
            without materialising that ``[R, V/tp]`` copy and its gradient: one chunk of rows is
            gathered at a time, and the backward writes each chunk's gradient into the
            ``[S, V/tp]`` gradient of ``logits`` (zero outside ``rows``) with ``index_add_``.
        support: the rollout's sampling support per token (:class:`TokenSupport` over the
            ``T`` flattened targets, in their order): log-probs and entropy of
            ``softmax(logits / temperature)`` renormalised over each token's support (top-p /
            top-k replay); logits outside it get no gradient. ``None``: the whole vocabulary.
            Its id range is checked where ``check_targets`` is.

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32 (float64 for float64 logits),
        identical on every rank of ``group``. Collectives: ``2 * ceil(T / chunk_size)`` in
        forward (see module docstring), none in backward; each rank's ``logits`` receives the
        gradient of its own shard.

    Raises:
        ValueError: shape mismatches, a non-positive temperature or chunk size, or (with
            ``check_targets``) an out-of-range target.
    """
    if rows is not None:
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool or targets.shape != rows.shape:
            raise ValueError(
                f"rows must be a 1-D integer index [R] with targets of the same shape, got rows {tuple(rows.shape)} "
                f"{rows.dtype} and targets {tuple(targets.shape)}"
            )
        if logits.dim() < 1:
            raise ValueError(f"logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    elif logits.dim() < 1 or targets.shape != logits.shape[:-1]:
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
    if check_targets is None:
        check_targets = reads_values(flat_targets)
    if check_targets and flat_targets.numel():
        lo, hi = int(flat_targets.min()), int(flat_targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"target ids must lie in [0, {vocab}) (vocabulary size), got min {lo}, max {hi}")
    if support is not None:
        if not isinstance(support, TokenSupport):
            raise ValueError(f"support must be a TokenSupport, got {type(support).__name__}")
        support.validate(flat_targets.numel(), vocab, flat_logits.device, read_values=bool(check_targets))
    log_probs, entropy = _VocabParallelLogProbs.apply(
        flat_logits, flat_targets, group, float(temperature), bool(with_entropy), int(chunk_size),
        None if rows is None else rows.long(), support,
    )
    return log_probs.reshape(lead), (entropy.reshape(lead) if with_entropy else None)


# ------------------------------------------------------------------ shards held by one process
def _in_order_max(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for p in parts[1:]:
        out = torch.maximum(out, p)
    return out


def _in_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def _shard_inputs(shards: Sequence[torch.Tensor], temperature: float) -> tuple[list[torch.Tensor], torch.Size]:
    if not shards:
        raise ValueError("give at least one vocabulary shard")
    lead = shards[0].shape[:-1]
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"all shards must have the same shape, got {[tuple(s.shape) for s in shards]}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    compute_dtype = torch.promote_types(shards[0].dtype, torch.float32)
    return [_scaled(s.reshape(-1, s.shape[-1]), compute_dtype, float(temperature)) for s in shards], lead


@torch.no_grad()
def log_probs_from_shards(
    shards: Sequence[torch.Tensor], targets: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """:func:`vocab_parallel_log_probs` for vocabulary shards that one process holds together.

    The arithmetic is the same code (one chunk of :func:`_chunk_statistics`); the two
    all-reduces become the in-order maximum and sum over ``shards``. For one shard that is the
    TP = 1 computation; for two it is bit for bit what an all-reduce over two ranks returns (IEEE
    addition and maximum are commutative). With more shards the all-reduce's summation order
    belongs to the communication backend and the results may differ in the last bit. Per-token
    reductions do not depend on how many tokens are processed together, so the results equal
    the chunked distributed computation on the same rows bit for bit (tested).

    This is what the rollout engine's true-on-policy path records (:mod:`megatron_mis.testbed.demo.
    rollout`): the trainer's log-probs by construction.

    Args:
        shards: ``tp`` tensors ``[..., V/tp]``, shard ``k`` holding vocabulary ids
            ``[k V/tp, (k+1) V/tp)``.
        targets: ``[...]`` integer ids in ``[0, V)``.
        temperature: ``> 0``; the logits are divided by it.

    Returns:
        ``[...]`` log-probs in float32 (float64 for float64 shards). No gradient.

    Synchronisation: one read (the targets' minimum and maximum together, for the range check).
    """
    zs, lead = _shard_inputs(shards, temperature)
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} must have the shape of the shards without the vocabulary dimension {tuple(lead)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    flat = targets.reshape(-1).long()
    local_vocab = zs[0].shape[-1]
    if flat.numel():
        lo, hi = torch.stack([flat.min(), flat.max()]).tolist()  # the one read of this per-step function
        if lo < 0 or hi >= local_vocab * len(zs):
            raise ValueError(f"target ids must lie in [0, {local_vocab * len(zs)}), got [{lo}, {hi}]")
    parts = [_shard_targets(flat, k * local_vocab, local_vocab) for k in range(len(zs))]
    _, _, stacked = _chunk_statistics(
        zs, [p[0] for p in parts], [p[1] for p in parts], False, _in_order_max, _in_order_sum
    )
    return (stacked[:, 1] - stacked[:, 0].log()).reshape(lead)


@torch.no_grad()
def log_softmax_from_shards(shards: Sequence[torch.Tensor], *, temperature: float = 1.0) -> torch.Tensor:
    """The full ``[..., V]`` log-softmax of ``logits / temperature`` from vocabulary shards held by
    one process, computed with the statistics of :func:`log_probs_from_shards` (so
    ``log_softmax_from_shards(s)[..., y] == log_probs_from_shards(s, y)`` bit for bit): what the
    true-on-policy rollout samples from."""
    zs, lead = _shard_inputs(shards, temperature)
    zeros = torch.zeros(zs[0].shape[0], dtype=torch.long, device=zs[0].device)
    ok = torch.zeros_like(zeros, dtype=torch.bool)
    _, shifted, stacked = _chunk_statistics(
        zs, [zeros] * len(zs), [ok] * len(zs), False, _in_order_max, _in_order_sum
    )
    out = torch.cat(shifted, dim=-1) - stacked[:, 0].log()[:, None]
    return out.reshape(*lead, out.shape[-1])
