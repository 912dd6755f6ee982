"""The RL loss for a plain Megatron-Core training loop: a forward-step function and ``loss_func``
for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

One optimizer step::

    rl = MegatronRLLoss(loss_config, mis_config)              # once
    batches = [RLMicroBatch(...), ...]                         # this rank's micro-batches
    den = rl.count_denominators(batches)                       # 1 all-reduce over the DP group
    store = get_forward_backward_func()(
        forward_step_func=rl.forward_step(den, num_microbatches=len(batches)),
        data_iterator=iter(batches), model=[ddp_model], num_microbatches=len(batches),
        seq_length=..., micro_batch_size=1, forward_only=False)
    metrics = rl.reduce_metrics(store, den)                    # 1 all-reduce over the DP group
    optimizer.step()

What the loss function does per micro-batch (last pipeline stage only; the schedule never calls
it elsewhere):

1. log pi_theta of the response tokens from the model's vocab-parallel output with
   :func:`megatron_mis.parallel.tp_logprobs.vocab_parallel_log_probs` (over the TP group,
   rollout temperature applied, chunked), plus the entropy;
2. the MIS engine (:func:`megatron_mis.core.engine.compute_mis`) on pi_old (given, or pi_theta
   detached) against pi_rollout: IS weights and the keep mask;
3. :func:`megatron_mis.core.losses.compute_rl_loss` with the step's global denominators: this
   micro-batch's share ``c`` of the step loss ``L`` (shares add up to ``L`` over micro-batches
   and data-parallel ranks).

Scaling for the schedule. Megatron-Core 0.13 - 0.16 accept a 3-tuple ``(loss, num_tokens,
metrics)`` or the legacy 2-tuple ``(loss, metrics)`` from ``loss_func`` (same code in
``forward_step_calc_loss`` of all four versions):

- 3-tuple, ``calculate_per_token_loss=False``: the schedule divides the loss by ``num_tokens``
  and by the number of micro-batches ``M``; DDP averages gradients over the data-parallel(-CP)
  group of size ``W``;
- 3-tuple, ``calculate_per_token_loss=True``: no division; DDP sums the gradients and
  ``finalize_model_grads`` divides them by the sum of ``num_tokens`` over micro-batches and
  ranks;
- 2-tuple: the schedule multiplies by the CP size and divides by ``M``; DDP averages over ``W``.

This loss returns ``c * M * W`` and ``num_tokens = 1``: in every case the gradient that reaches
the optimizer is exactly ``d L / d theta`` (for per-token mode the summed ``num_tokens`` is
``M * W``, so Megatron's reported "total_num_tokens" counts micro-batches, not tokens; the token
normalisation already happened through the global denominators). Without Megatron's DDP,
average the gradients over the data-parallel group yourself (what DDP does with
``calculate_per_token_loss=False``).

Context parallelism is not handled here (CP size must be 1): the CP drop-in for slime / Miles is
:mod:`megatron_mis.integrations.hosts`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_mis.config.loss import LossConfig
from megatron_mis.core.aggregation import Denominators, denominator_mask, local_denominators
from megatron_mis.core.losses import POLICY_LOSSES, compute_rl_loss, finalize_metrics
from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs

__all__ = ["MegatronRLLoss", "RLMicroBatch", "response_positions"]


def response_positions(cu_seqlens: torch.Tensor, response_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the response tokens of packed sequences are, and which logit predicts each.

    Args:
        cu_seqlens: ``[N+1]`` boundaries of the packed (prompt + response) sequences.
        response_lengths: ``[N]`` response tokens at the end of each sequence (each sequence
            needs at least one prompt token before its response).

    Returns:
        ``(logit_rows [R], target_positions [R])`` long, ``R = sum(response_lengths)``: token
        ``t`` is predicted by the logits at position ``t - 1``.
    """
    cu = cu_seqlens.to(torch.long).cpu()
    resp = torch.as_tensor(response_lengths, dtype=torch.long).cpu()
    totals = cu[1:] - cu[:-1]
    if resp.shape != totals.shape:
        raise ValueError(f"response_lengths has {resp.numel()} entries, expected {totals.numel()} (one per sequence)")
    if bool((resp < 0).any()) or bool((resp > totals - 1).any()):
        bad = torch.nonzero((resp < 0) | (resp > totals - 1)).flatten().tolist()[:8]
        raise ValueError(
            f"response_lengths must lie in [0, total_length - 1] (at least one prompt token), violated by sequence(s) {bad}"
        )
    starts = cu[1:] - resp  # first response token of each sequence
    offsets = torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
    targets = torch.repeat_interleave(starts, resp) + offsets
    return targets - 1, targets


@dataclass(slots=True)
class RLMicroBatch:
    """One micro-batch of packed sequences (``thd`` format, micro-batch size 1).

    Attributes:
        tokens: ``[S]`` the packed prompt + response tokens of ``N`` sequences.
        cu_seqlens: ``[N+1]`` sequence boundaries in ``tokens``.
        response_lengths: ``[N]`` response tokens at the end of each sequence.
        loss_mask: ``[R]`` over the concatenated responses, ``R = sum(response_lengths)``.
        advantages: ``[R]``.
        rollout_log_probs: ``[R]`` pi_rollout from the rollout engine, or ``None``.
        old_log_probs: ``[R]`` pi_old recomputed by the trainer, or ``None`` (pi_theta detached).
        ref_log_probs: ``[R]`` reference policy, or ``None``.
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.response_lengths = torch.as_tensor(self.response_lengths, dtype=torch.long)
        if self.tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D [S] (packed sequences), got shape {tuple(self.tokens.shape)}")
        if self.cu_seqlens.dim() != 1 or int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != self.tokens.numel():
            raise ValueError(f"cu_seqlens must be [N+1] from 0 to len(tokens)={self.tokens.numel()}")
        num_resp = int(self.response_lengths.sum())
        for name in ("loss_mask", "advantages", "rollout_log_probs", "old_log_probs", "ref_log_probs"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 1 or t.numel() != num_resp):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected [{num_resp}] (one per response token, "
                    f"sum of response_lengths)"
                )
        response_positions(self.cu_seqlens, self.response_lengths)  # validates the lengths

    @property
    def response_cu_seqlens(self) -> torch.Tensor:
        """``[N+1]`` boundaries of the sequences in the ``[R]`` response tensors."""
        return torch.nn.functional.pad(torch.cumsum(self.response_lengths, 0), (1, 0))


def _metric_store_key(name: str) -> bool:
    return name.partition("/")[0] in ("share", "sum", "lsum", "count")


class MegatronRLLoss:
    """The RL loss for ``get_forward_backward_func()`` (see the module docstring).

    Args:
        loss_config: loss settings.
        mis_config: IS / RS engine settings (:class:`megatron_mis.config.mis.MISConfig`); needed
            by losses that use IS weights (``decoupled_ppo``, ``reinforce``); optional otherwise
            (then only its keep mask and metrics are used).
        tp_group: tensor-parallel group for the log-probs; default Megatron's.
        dp_group: data-parallel group (with context parallelism) of the last pipeline stage for
            the denominators, the metrics and the loss scaling; default Megatron's.
        return_num_tokens: return the 3-tuple ``(loss, num_tokens, metrics)`` (default) or the
            legacy 2-tuple ``(loss, metrics)``.
    """

    def __init__(
        self,
        loss_config: LossConfig,
        mis_config: Any = None,
        *,
        tp_group: Any = None,
        dp_group: Any = None,
        return_num_tokens: bool = True,
    ) -> None:
        from megatron.core import parallel_state as ps

        from megatron_mis.config.base import ConfigError

        self.config = loss_config
        self.mis_config = mis_config
        self.policy = POLICY_LOSSES.get(loss_config.policy_loss)
        problems = []
        if self.policy.uses_is_weights and mis_config is None:
            problems.append(
                f"policy_loss={self.policy.name!r} multiplies by IS weights: give a MISConfig "
                "(MISConfig() with use_tis false means weights 1)"
            )
        if self.policy.old_policy == "rollout" and mis_config is not None and mis_config.use_tis:
            problems.append(
                "policy_loss='bypass_ppo' with use_tis: the bypass ratio pi_theta/pi_rollout already is the "
                "IS ratio; IS weights on top would count it twice (RS, mask-mode rejection and the veto still "
                "apply without use_tis)"
            )
        if problems:
            raise ConfigError("MegatronRLLoss", problems)
        if ps.get_context_parallel_world_size() > 1:
            raise ValueError(
                f"context parallel size {ps.get_context_parallel_world_size()} is not supported by "
                "MegatronRLLoss (CP size must be 1); use the CP drop-in megatron_mis.integrations.hosts"
            )
        self.tp_group = tp_group if tp_group is not None else ps.get_tensor_model_parallel_group()
        self.dp_group = dp_group if dp_group is not None else ps.get_data_parallel_group(with_context_parallel=True)
        self.return_num_tokens = return_num_tokens

    # --------------------------------------------------------------------------- denominators
    def _engine(self, train_log_probs, mb: RLMicroBatch):
        from megatron_mis.core.engine import compute_mis

        return compute_mis(
            train_log_probs.detach().float(),
            mb.rollout_log_probs.float(),
            mb.loss_mask,
            mb.response_cu_seqlens,
            self.mis_config,
        )

    def _runs_engine(self, mb: RLMicroBatch) -> bool:
        if self.mis_config is None:
            return False
        if mb.rollout_log_probs is None:
            if self.policy.uses_is_weights:
                raise ValueError(f"policy_loss={self.policy.name!r} needs rollout_log_probs in every micro-batch")
            return False
        return True

    def _finite_inputs(self, mb: RLMicroBatch) -> torch.Tensor:
        """``[R]`` bool: the inputs known before the step are finite (as compute_rl_loss checks)."""
        ok = torch.isfinite(mb.advantages)
        old = mb.rollout_log_probs if self.policy.old_policy == "rollout" else mb.old_log_probs
        if old is not None:
            ok &= torch.isfinite(old)
        if self.config.kl_active and mb.ref_log_probs is not None:
            ok &= torch.isfinite(mb.ref_log_probs)
        return ok

    def local_denominator_mask(self, mb: RLMicroBatch) -> torch.Tensor:
        """``[R]`` bool: the tokens of ``mb`` the denominators count."""
        lmask = mb.loss_mask.bool()
        if self.config.rejected_in_denominator:
            return lmask
        keep = lmask & self._finite_inputs(mb)
        if self._runs_engine(mb) and self.mis_config.rejects:
            if mb.old_log_probs is None:
                raise ValueError(
                    "rejected_in_denominator=False needs old_log_probs: the engine's rejections must be known "
                    "before the step (they would otherwise depend on pi_theta); pass the recomputed pi_old"
                )
            keep &= self._engine(mb.old_log_probs, mb).keep_mask.bool().to(keep.device)
        return denominator_mask(lmask, keep, False)

    def count_denominators(self, micro_batches: Iterable[RLMicroBatch]) -> Denominators:
        """The step's global :class:`Denominators` from this rank's micro-batches: one SUM
        all-reduce over the data-parallel group (call on every rank of it, last stage)."""
        local = Denominators(0.0, 0.0)
        for mb in micro_batches:
            local = local + local_denominators(self.local_denominator_mask(mb), mb.response_cu_seqlens)
        buf = torch.tensor([local.num_tokens, local.num_sequences], dtype=torch.float64)
        buf = self._all_reduce(buf)
        return Denominators(float(buf[0]), float(buf[1]))

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group=self.dp_group) > 1:
            device = "cuda" if dist.get_backend(self.dp_group) == "nccl" else "cpu"
            out = buf.to(device)
            dist.all_reduce(out, group=self.dp_group)
            return out.cpu()
        return buf

    # ------------------------------------------------------------------------------ forward
    def forward_step(self, denominators: Denominators, *, num_microbatches: int):
        """``forward_step_func(data_iterator, model)`` for this step: runs the model on the next
        :class:`RLMicroBatch` (packed ``thd``) and returns ``(output, loss_func)``."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches!r} must be >= 1")

        def forward_step(data_iterator, model):
            from megatron.core.packed_seq_params import PackedSeqParams

            mb = next(data_iterator)
            if not isinstance(mb, RLMicroBatch):
                raise TypeError(f"the data iterator must yield RLMicroBatch, got {type(mb).__name__}")
            cu = mb.cu_seqlens.to(torch.int32)
            lengths = (cu[1:] - cu[:-1]).long()
            max_len = int(lengths.max()) if lengths.numel() else 0
            starts = torch.repeat_interleave(cu[:-1].long(), lengths)
            position_ids = (torch.arange(int(cu[-1])) - starts).unsqueeze(0)  # restarts at every sequence
            device = _module_device(model)
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu.to(device),
                cu_seqlens_kv=cu.to(device),
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            output = model(
                mb.tokens.unsqueeze(0).to(device), position_ids.to(device), None, packed_seq_params=params
            )
            return output, functools.partial(self.loss_func, mb, denominators, num_microbatches)

        return forward_step

    def loss_func(self, mb: RLMicroBatch, denominators: Denominators, num_microbatches: int, output_tensor: torch.Tensor):
        """Megatron ``loss_func`` body (bound by :meth:`forward_step`): see the module docstring.

        Args:
            output_tensor: ``[1, S, V/tp]`` vocab-parallel logits of the packed micro-batch.

        Returns:
            ``(c * M * W, num_tokens=1, metrics)`` or ``(c * M * W, metrics)``; ``metrics`` maps
            ``share/ | sum/ | lsum/ | count/`` names to detached 0-dim tensors (reduce them with
            :meth:`reduce_metrics`).
        """
        cfg = self.config
        logits = output_tensor.reshape(-1, output_tensor.shape[-1])
        rows, targets = response_positions(mb.cu_seqlens, mb.response_lengths)
        rows = rows.to(logits.device)
        log_probs, entropy = vocab_parallel_log_probs(
            logits.index_select(0, rows),
            mb.tokens.to(logits.device)[targets.to(logits.device)],
            group=self.tp_group,
            temperature=cfg.rollout_temperature,
            with_entropy=True,
            chunk_size=cfg.log_probs_chunk_size,
        )
        dev = log_probs.device
        cu = mb.response_cu_seqlens.to(dev)
        is_weights = keep_mask = None
        engine_metrics: dict[str, torch.Tensor] = {}
        if self._runs_engine(mb):
            train = mb.old_log_probs.to(dev) if mb.old_log_probs is not None else log_probs.detach()
            res = self._engine(train, mb)
            res.check_nonfinite()  # warns once about NaN / inf train or rollout log-probs
            keep_mask = res.keep_mask.to(dev)
            if self.policy.uses_is_weights:
                is_weights = res.weights.to(dev)
            lmask = mb.loss_mask.bool().to(dev)
            for name, values in getattr(res, "token_metrics", {}).items():
                v = values.detach().float().to(dev)
                ok = lmask & torch.isfinite(v)
                engine_metrics[f"lsum/{name}"] = torch.where(ok, v, torch.zeros_like(v)).sum()

        def opt(t):
            return None if t is None else t.to(dev)

        out = compute_rl_loss(
            log_probs,
            mb.advantages.to(dev),
            mb.loss_mask.to(dev),
            cu,
            cfg,
            denominators,
            old_log_probs=opt(mb.old_log_probs),
            rollout_log_probs=opt(mb.rollout_log_probs),
            ref_log_probs=opt(mb.ref_log_probs) if cfg.kl_active else None,
            entropy=entropy,
            is_weights=is_weights,
            keep_mask=keep_mask,
        )
        world = _group_size(self.dp_group)
        loss = out.loss * float(num_microbatches * world)
        metrics = out.flat_metrics()
        metrics.update(engine_metrics)
        if self.return_num_tokens:
            return loss, torch.tensor(1, dtype=torch.int), metrics
        return loss, metrics

    # ------------------------------------------------------------------------------ metrics
    def reduce_metrics(self, forward_data_store: Sequence[Mapping[str, torch.Tensor]], denominators: Denominators) -> dict[str, float]:
        """The step's metrics from the schedule's output: sum over micro-batches, one SUM
        all-reduce over the data-parallel group, then
        :func:`megatron_mis.core.losses.finalize_metrics` (``lsum/`` entries are divided by the
        global number of loss tokens). Returns ``{}`` on pipeline stages other than the last.

        Raises:
            ValueError: if the counted denominator tokens / sequences differ from
                ``denominators`` (they were not computed from this step's data).
        """
        from megatron.core import parallel_state as ps

        if not ps.is_pipeline_last_stage():
            return {}
        keys = sorted({k for d in forward_data_store for k in d if _metric_store_key(k)})
        local = torch.zeros(len(keys), dtype=torch.float64)
        for d in forward_data_store:
            for i, k in enumerate(keys):
                if k in d:
                    local[i] += float(d[k])
        total = self._all_reduce(local)
        summed = dict(zip(keys, total.tolist()))
        got = (summed.get("count/num_denominator_tokens", 0.0), summed.get("count/num_denominator_sequences", 0.0))
        if got != (denominators.num_tokens, denominators.num_sequences):
            raise ValueError(
                f"the step counted {got[0]:g} denominator tokens and {got[1]:g} sequences but the loss was "
                f"normalised by {denominators.num_tokens:g} and {denominators.num_sequences:g}: the denominators "
                "were not computed from this step's micro-batches (use count_denominators on the same data)"
            )
        num_loss = summed.get("count/num_loss_tokens", 0.0)
        lsums = {k: summed.pop(k) for k in list(summed) if k.startswith("lsum/")}
        out = finalize_metrics(summed)
        for k, v in lsums.items():
            out[k.partition("/")[2]] = v / num_loss if num_loss > 0 else 0.0
        return out


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def _module_device(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
