"""The RL loss for a plain Megatron-Core training loop: a forward-step function and ``loss_func``
for ``megatron.core.pipeline_parallel.get_forward_backward_func()``, with tensor, context,
data and pipeline parallelism.

One optimizer step::

    rl = MegatronRLLoss(loss_config, mis_config)              # once
    batches = [RLMicroBatch(...), ...]                         # this DP rank's micro-batches
    old = rl.recompute_log_probs(model, batches)               # pi_old in fp32 (optional)
    batches = [b.with_old_log_probs(o) for b, o in zip(batches, old)]
    den = rl.count_denominators(batches)                       # 1 all-reduce over the DP(-CP) group
    store = get_forward_backward_func()(
        forward_step_func=rl.forward_step(den, num_microbatches=len(batches)),
        data_iterator=iter(batches), model=[ddp_model], num_microbatches=len(batches),
        seq_length=..., micro_batch_size=1, forward_only=False)
    metrics = rl.reduce_metrics(store, den)                    # 1-2 all-reduces over the DP(-CP) group
    optimizer.step()

A micro-batch holds WHOLE sequences and full-length per-token tensors; under context
parallelism every CP rank gets the same micro-batch and the forward step packs this rank's
zigzag share (:func:`megatron_mis.parallel.packing.pack_sequences`: chunks ``r`` and
``2cp-1-r`` of every sequence padded to a multiple of ``2cp``).

What the loss function does per micro-batch (last pipeline stage only; the schedule never calls
it elsewhere):

1. log pi_theta of this CP rank's response tokens from the model's vocab-parallel output with
   :func:`megatron_mis.parallel.tp_logprobs.vocab_parallel_log_probs` (over the TP group,
   rollout temperature applied, chunked), plus the entropy;
2. the MIS engine on CP shards (:func:`megatron_mis.parallel.cp_mis.compute_mis_cp`, one
   all-gather of per-sequence statistics over the CP group) on pi_old (given, or pi_theta
   detached) against pi_rollout: IS weights and the keep mask of the local tokens;
3. :func:`megatron_mis.core.losses.compute_rl_loss` on the local tokens with the step's global
   denominators and, under CP, the full per-sequence denominator counts (known on every rank
   from the full masks) and OPSM's and GSPO's per-sequence sums summed over the CP group (one
   all-reduce for both, so a GSPO sequence ratio is exact however the sequence is split):
   this rank's share ``c`` of the step loss ``L`` (shares add up to ``L`` over micro-batches,
   CP ranks and data-parallel ranks).

Scaling for the schedule. Megatron-Core 0.13 - 0.16 accept a 3-tuple ``(loss, num_tokens,
metrics)`` or the legacy 2-tuple ``(loss, metrics)`` from ``loss_func`` (same code in
``forward_step_calc_loss`` of all four versions). Let ``M`` be the number of micro-batches,
``cp`` the CP size and ``W = dp * cp`` the size of the data-parallel group WITH context
parallelism, over which Megatron's DDP reduces gradients:

- 3-tuple, ``calculate_per_token_loss=False``: the schedule divides the loss by ``num_tokens``
  and by ``M``; DDP averages gradients over the ``W`` ranks;
- 3-tuple, ``calculate_per_token_loss=True``: no division; DDP sums the gradients over ``W`` and
  ``finalize_model_grads`` divides them by the sum of ``num_tokens`` over micro-batches and the
  ``W`` ranks;
- 2-tuple: the schedule multiplies by ``cp`` and divides by ``M``; DDP averages over ``W``.

The gradient the optimizer needs is ``d L / d theta = sum over micro-batches and all W ranks of
d c / d theta``: a CP rank's ``c`` is the loss of its own tokens, which depends on the other CP
ranks' tokens only through attention, whose backward (the CP all-gather of keys and values in
the attention module) returns each rank the gradient of its own keys / values. So every rank
must contribute ``d c / d theta`` to a SUM over ``W``. This loss therefore returns ``c * M * W``
with ``num_tokens = 1`` for the 3-tuple (``/ M``, then ``/ W`` by DDP: ``c``; per-token mode:
summed ``num_tokens`` is ``M * W``) and ``c * M * W / cp`` for the 2-tuple (``* cp / M`` by the
schedule, ``/ W`` by DDP: ``c``). In every case the gradient that reaches the optimizer is exactly
``d L / d theta``; the token normalisation already happened through the global denominators
(Megatron's reported "total_num_tokens" counts micro-batches x ranks, not tokens). Without
Megatron's DDP, SUM the gradients over the data-parallel-with-CP group and divide by ``W``
yourself (what DDP does with ``calculate_per_token_loss=False``). ``tests/distributed/test_megatron_loss.py``
checks all three paths, and CP = 2 and TP = 2 x CP = 2 against the single-process run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from megatron_mis.config.loss import LossConfig
from megatron_mis.core.aggregation import Denominators, segment_sum
from megatron_mis.core.losses import POLICY_LOSSES, compute_rl_loss
from megatron_mis.integrations.rl_batch import RLMicroBatch, _LocalView, response_positions
from megatron_mis.integrations.rl_metrics import engine_metrics, masked_extreme, reduce_metric_store
from megatron_mis.core.engine import DeferredCount, nonfinite_message
from megatron_mis.core.segments import to_device
from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs

__all__ = ["MegatronRLLoss", "RLMicroBatch", "response_positions"]


class MegatronRLLoss:
    """The RL loss for ``get_forward_backward_func()`` (see the module docstring).

    Args:
        loss_config: loss settings.
        mis_config: IS / RS engine settings (:class:`megatron_mis.config.mis.MISConfig`); needed
            by losses that use IS weights (``decoupled_ppo``, ``reinforce``, ``gspo``,
            ``cispo``); optional otherwise
            (then only its keep mask and metrics are used: ``MISConfig(use_tis=False)`` with the
            ``ppo`` loss measures the mismatch without correcting it).
        tp_group: tensor-parallel group for the log-probs; default Megatron's.
        cp_group: context-parallel group (sequences are split over it); default Megatron's.
        dp_group: data-parallel group WITH context parallelism of the last pipeline stage, over
            which Megatron's DDP reduces gradients: for the denominators, the metrics and the
            loss scaling; default Megatron's.
        return_num_tokens: return the 3-tuple ``(loss, num_tokens, metrics)`` (default) or the
            legacy 2-tuple ``(loss, metrics)``.
    """

    def __init__(
        self,
        loss_config: LossConfig,
        mis_config: Any = None,
        *,
        tp_group: Any = None,
        cp_group: Any = None,
        dp_group: Any = None,
        return_num_tokens: bool = True,
    ) -> None:
        from megatron.core import parallel_state as ps

        from megatron_mis.config.base import ConfigError
        from megatron_mis.parallel.state import group_view

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
        if mis_config is not None and mis_config.normalizes and mis_config.tis_batch_normalize_scope == "global":
            problems.append(
                "tis_batch_normalize_scope='global' is not supported by MegatronRLLoss (it normalises per "
                "micro-batch); use 'micro_batch'"
            )
        if problems:
            raise ConfigError("MegatronRLLoss", problems)
        if self.policy.sequence_ratio and mis_config is not None and mis_config.use_tis and mis_config.tis_level == "token":
            import warnings

            warnings.warn(
                f"policy_loss={self.policy.name!r} with tis_level='token': each token's GSPO term (the sequence "
                "ratio) is multiplied by that token's own IS weight, mixing a sequence-level ratio with token-level "
                "weights (slime does the same); tis_level 'sequence' or 'geometric' gives one weight per sequence",
                UserWarning,
                stacklevel=2,
            )
        self.tp_group = tp_group if tp_group is not None else ps.get_tensor_model_parallel_group()
        self.cp = group_view(cp_group if cp_group is not None else ps.get_context_parallel_group())
        self.dp_group = dp_group if dp_group is not None else ps.get_data_parallel_group(with_context_parallel=True)
        self.return_num_tokens = return_num_tokens
        self._nonfinite: list[DeferredCount] = []  # the engine's non-finite counts, read per step

    # ------------------------------------------------------------------------------ layout
    def local_view(self, mb: RLMicroBatch) -> _LocalView:
        """This CP rank's packed input and response layout of ``mb`` (CPU tensors; no
        communication).

        Raises:
            ValueError: ``slot_length`` with context parallelism (the fixed-slot layout is the
                true-on-policy one, which needs CP = 1).
        """
        from megatron_mis.parallel.packing import pack_sequences
        from megatron_mis.parallel.layout import local_response_layout

        if mb.slot_length is not None and self.cp.size > 1:
            raise ValueError(
                f"RLMicroBatch.slot_length={mb.slot_length} with context parallel size {self.cp.size}: the "
                "fixed-slot layout (true on-policy) needs CP size 1"
            )
        pack = pack_sequences(
            mb.sequences(), cp_size=self.cp.size, cp_rank=self.cp.rank, pad_token_id=mb.pad_token_id,
            slot_length=mb.slot_length,
        )
        rows = pack.response_index(mb.response_lengths)
        lay = local_response_layout(mb.total_lengths, mb.response_lengths, self.cp.size, self.cp.rank, layout="thd")
        full_index = lay.local_to_full_index()
        assert rows.numel() == full_index.numel(), "packing and response layout disagree"
        targets = pack.labels[0].index_select(0, rows)
        support = None if mb.rollout_support is None else mb.rollout_support.select(full_index)
        return _LocalView(pack=pack, rows=rows, targets=targets, full_index=full_index, cu=lay.local_cu_seqlens(), support=support)

    def _full_index(self, mb: RLMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron_mis.parallel.layout import local_response_layout

        if self.cp.size == 1:
            num = int(mb.response_lengths.sum())
            return torch.arange(num), mb.response_cu_seqlens
        lay = local_response_layout(mb.total_lengths, mb.response_lengths, self.cp.size, self.cp.rank, layout="thd")
        return lay.local_to_full_index(), lay.local_cu_seqlens()

    # ----------------------------------------------------------------------------- engine
    def _engine(self, train_local: torch.Tensor, mb: RLMicroBatch, full_index: torch.Tensor, cu_local: torch.Tensor):
        """The MIS engine on this rank's tokens: ``(MISResult over the local tokens, full-length
        keep mask [R])``. One all-gather over the CP group when ``cp > 1`` (plus one all-reduce
        when single tokens can be rejected)."""
        from megatron_mis.parallel.cp_mis import CPInputs, compute_mis_cp

        dev = train_local.device
        rollout_local = _on(mb.rollout_log_probs, dev).index_select(0, _on(full_index, dev)).float()
        counts_local = (cu_local[1:] - cu_local[:-1]).tolist()
        resp = mb.response_lengths.tolist()
        inputs = CPInputs(
            train_log_probs=list(torch.split(train_local.detach().float(), counts_local)),
            rollout_log_probs=list(torch.split(rollout_local, counts_local)),
            loss_masks=list(torch.split(_on(mb.loss_mask, dev), resp)),
            total_lengths=mb.total_lengths.tolist(),
            response_lengths=resp,
            layout="thd",
        )
        out = compute_mis_cp(inputs, self.mis_config, self.cp)
        full_keep = torch.cat(out.modified_masks) != 0 if out.modified_masks else torch.zeros(0, dtype=torch.bool, device=dev)
        return out.result, full_keep

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

    def _full_denominator_mask(self, mb: RLMicroBatch, full_keep: torch.Tensor | None) -> torch.Tensor:
        lmask = mb.loss_mask.bool()
        if self.config.rejected_in_denominator:
            return lmask
        keep = lmask & self._finite_inputs(mb)
        if full_keep is not None:
            keep &= full_keep.to(keep.device)
        return keep

    def denominator_mask(self, mb: RLMicroBatch) -> torch.Tensor:
        """``[R]`` bool over the FULL responses of ``mb``: the tokens the denominators count
        (identical on every CP rank; runs the engine, a CP collective, when rejected tokens
        leave the denominators and the engine can reject)."""
        full_keep = None
        if not self.config.rejected_in_denominator and self._runs_engine(mb) and self.mis_config.rejects:
            if mb.old_log_probs is None:
                raise ValueError(
                    "rejected_in_denominator=False needs old_log_probs: the engine's rejections must be known "
                    "before the step (they would otherwise depend on pi_theta); pass the recomputed pi_old"
                )
            full_index, cu_local = self._full_index(mb)
            old_local = mb.old_log_probs.index_select(0, full_index.to(mb.old_log_probs.device))
            if self.cp.size > 1 and _is_nccl(self.cp.group):
                old_local = old_local.cuda()  # the engine's CP all-gather runs where its inputs are
            _, full_keep = self._engine(old_local, mb, full_index, cu_local)
        return self._full_denominator_mask(mb, full_keep)

    def local_denominator_mask(self, mb: RLMicroBatch) -> torch.Tensor:
        """``[R_local]`` bool: :meth:`denominator_mask` at this CP rank's response tokens."""
        full_index, _ = self._full_index(mb)
        return self.denominator_mask(mb).index_select(0, full_index.to(mb.loss_mask.device))

    def count_denominators(self, micro_batches: Iterable[RLMicroBatch]) -> Denominators:
        """The step's global :class:`Denominators` from this rank's micro-batches: one SUM
        all-reduce over the data-parallel(-with-CP) group (call on every rank of it), plus the
        engine's CP collectives per micro-batch when rejected tokens leave the denominators. Under
        CP each rank counts its own tokens and CP rank 0 counts the sequences. On pipeline stages
        other than the last (which never compute the loss) nothing is counted or communicated
        and ``Denominators(0, 0)`` is returned."""
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and not ps.is_pipeline_last_stage(ignore_virtual=True):
            return Denominators(0.0, 0.0)
        # counted where the masks are, read once at the end (one synchronisation per step)
        counts_per_mb = []
        for mb in micro_batches:
            full = self.denominator_mask(mb)
            full_index, _ = self._full_index(mb)
            tokens = full.index_select(0, _on(full_index, full.device)).sum().to(torch.float64)
            sequences = torch.zeros((), dtype=torch.float64, device=full.device)
            if self.cp.rank == 0:
                counts = segment_sum(full.float(), _on(mb.response_cu_seqlens, full.device))
                sequences = (counts > 0).sum().to(torch.float64)
            counts_per_mb.append(torch.stack([tokens, sequences]))
        # the one read (host masks: none)
        local = torch.stack(counts_per_mb).sum(0).cpu() if counts_per_mb else torch.zeros(2, dtype=torch.float64)
        tokens, sequences = self._all_reduce(local).tolist()
        return Denominators(tokens, sequences)

    def _all_reduce(self, buf: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group=self.dp_group) > 1:
            device = "cuda" if dist.get_backend(self.dp_group) == "nccl" else "cpu"
            out = buf.to(device)
            dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
            return out.to(buf.device)  # where the caller keeps it (device buffers are read once, later)
        return buf

    def _cp_all_reduce(self, buf: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        if self.cp.size == 1:
            return buf
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.cp.group)
        return buf

    # ------------------------------------------------------------------------------ forward
    def _forward(self, model, mb: RLMicroBatch) -> tuple[torch.Tensor, _LocalView]:
        if not isinstance(mb, RLMicroBatch):
            raise TypeError(f"the data iterator must yield RLMicroBatch, got {type(mb).__name__}")
        view = self.local_view(mb)
        p = view.pack
        device = _module_device(model)
        params = dataclasses.replace(
            p.packed_seq_params,
            **{
                f.name: _on(getattr(p.packed_seq_params, f.name), device)
                for f in dataclasses.fields(p.packed_seq_params)
                if isinstance(getattr(p.packed_seq_params, f.name), torch.Tensor)
            },
        )
        output = model(_on(p.tokens, device), _on(p.position_ids, device), None, packed_seq_params=params)
        return output, view

    def _log_probs(self, output_tensor: torch.Tensor, view: _LocalView, with_entropy: bool):
        """Log pi and entropy of this rank's response tokens: ``[R_local]`` each (the package's
        one log-prob function; the true-on-policy rollout path records the same numbers). With a
        rollout support the log-probs are the renormalised distribution's and the entropy that of
        ``config.replay_entropy``: the full softmax's (a second pass without the support) or the
        renormalised one's."""
        logits = output_tensor.reshape(-1, output_tensor.shape[-1])
        # rows= computes at the response rows without an [R_local, V/tp] copy of the logits
        # (and of its gradient): one chunk of rows is gathered at a time
        pass_ = functools.partial(
            vocab_parallel_log_probs,
            logits,
            _on(view.targets, logits.device),
            rows=_on(view.rows, logits.device),
            group=self.tp_group,
            temperature=self.config.rollout_temperature,
            chunk_size=self.config.log_probs_chunk_size,
        )
        support = None if view.support is None else view.support.to(logits.device)
        if support is None or not with_entropy or self.config.replay_entropy == "kept":
            return pass_(with_entropy=with_entropy, support=support)
        log_probs, _ = pass_(with_entropy=False, support=support)
        _, entropy = pass_(with_entropy=True, support=None)
        return log_probs, entropy

    def forward_step(self, denominators: Denominators, *, num_microbatches: int):
        """``forward_step_func(data_iterator, model)`` for this step: runs the model on this CP
        rank's share of the next :class:`RLMicroBatch` (packed ``thd``) and returns
        ``(output, loss_func)``."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches!r} must be >= 1")

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output, view = self._forward(model, mb)
            return output, functools.partial(self.loss_func, mb, view, denominators, num_microbatches)

        return forward_step

    # ----------------------------------------------------------------------- pi_old recompute
    def recompute_log_probs(
        self,
        model: Any,
        micro_batches: Sequence[RLMicroBatch],
        *,
        seq_length: int | None = None,
        forward_backward_func: Any = None,
    ) -> list[torch.Tensor] | None:
        """The trainer's log-probs (pi_old) of every micro-batch's responses: one forward-only
        pass of Megatron's schedule under ``torch.no_grad()``, the same packing and log-prob
        function as the loss.

        Args:
            model: the (DDP-wrapped) model chunk(s), as given to the schedule.
            micro_batches: this DP rank's micro-batches.
            seq_length: the schedule's ``seq_length`` (pipeline p2p shapes); default the longest
                local packed stream.
            forward_backward_func: default ``get_forward_backward_func()``.

        Returns:
            On the last pipeline stage, one float32 ``[R]`` full-length tensor per micro-batch
            (the CP ranks' pieces assembled by one SUM all-reduce over the CP group, each
            position written by exactly one rank); ``None`` on other stages.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = list(micro_batches)
        if not batches:
            return []
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output, view = self._forward(model, mb)

            def loss_func(output_tensor):
                lp, _ = self._log_probs(output_tensor, view, with_entropy=False)
                pieces.append((lp.detach().float(), view.full_index))
                zero = output_tensor.sum() * 0.0
                return (zero, torch.tensor(1, dtype=torch.int), {}) if self.return_num_tokens else (zero, {})

            return output, loss_func

        if seq_length is None:
            seq_length = max(int(mb.tokens.numel()) for mb in batches)
        fb = forward_backward_func or get_forward_backward_func()
        with torch.no_grad():
            fb(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=model if isinstance(model, list) else [model],
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=1,
                forward_only=True,
            )
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        assert len(pieces) == len(batches), "the schedule ran the loss function once per micro-batch"
        sizes = [int(mb.response_lengths.sum()) for mb in batches]
        dev = pieces[0][0].device
        full = torch.zeros(sum(sizes), dtype=torch.float32, device=dev)
        offset = 0
        for (lp, index), size in zip(pieces, sizes):
            full[offset + _on(index, dev)] = lp
            offset += size
        if self.cp.size > 1:
            full = self._cp_all_reduce(full.to("cuda" if _is_nccl(self.cp.group) else "cpu")).to(dev)
        return list(torch.split(full, sizes))

    # --------------------------------------------------------------------------------- loss
    def loss_func(
        self,
        mb: RLMicroBatch,
        view: _LocalView,
        denominators: Denominators,
        num_microbatches: int,
        output_tensor: torch.Tensor,
    ):
        """Megatron ``loss_func`` body (bound by :meth:`forward_step`): see the module docstring.

        Args:
            output_tensor: ``[1, S_local, V/tp]`` vocab-parallel logits of this CP rank's share.

        Returns:
            ``(c * M * W, num_tokens=1, metrics)`` or ``(c * M * W / cp, metrics)``; ``metrics``
            maps ``share/ | sum/ | lsum/ | count/ | max/ | min/`` names to detached 0-dim tensors
            (reduce them with :meth:`reduce_metrics`). Collectives over the CP group (cp > 1):
            the engine's statistics all-gather; with OPSM and / or a sequence-ratio loss
            (``gspo``) ONE SUM all-reduce of the ``[N, k]`` float64 per-sequence sums before
            the loss (k = 2 for OPSM + 4 for GSPO: log-ratio sum, token count, tokens with
            ``A > 0`` / ``A < 0``), and with OPSM one MAX all-reduce of ``[N]`` flags after it.
            None of them runs in the backward: the statistics are detached, and each CP rank's
            tokens get the gradient of their own terms (for ``gspo`` the full GSPO gradient of
            the token, ``s_i * d log pi_theta`` times its aggregation weight).
        """
        cfg = self.config
        log_probs, entropy = self._log_probs(output_tensor, view, with_entropy=True)
        dev = log_probs.device
        idx = _on(view.full_index, dev)
        cu = _on(view.cu, dev)

        def local(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _on(t, dev).index_select(0, idx)

        old = local(mb.old_log_probs)
        rollout = local(mb.rollout_log_probs)
        ref = local(mb.ref_log_probs) if cfg.kl_active else None
        advantages = local(mb.advantages)
        loss_mask = local(mb.loss_mask)
        lmask = loss_mask.bool()

        is_weights = keep_mask = full_keep = None
        extra: dict[str, torch.Tensor] = {}
        if self._runs_engine(mb):
            train = old if old is not None else log_probs.detach()
            res, full_keep = self._engine(train, mb, view.full_index, view.cu)
            # NaN / inf train or rollout log-probs: counted without a read, warned about once the
            # device has written the count (polled by reduce_metrics, once per step)
            self._nonfinite.append(DeferredCount(res.num_nonfinite))
            keep_mask = res.keep_mask.to(dev)
            if self.policy.uses_is_weights:
                is_weights = res.weights.to(dev)
            extra = engine_metrics(res, train.detach().float(), rollout.float(), lmask, keep_mask, self.mis_config)

        seq_token_counts = cp_sum = None
        if self.cp.size > 1:
            den_full = self._full_denominator_mask(mb, full_keep if self.mis_config is not None and self.mis_config.rejects else None)
            seq_token_counts = segment_sum(_on(den_full.float(), dev), _on(mb.response_cu_seqlens, dev))
            # OPSM's and GSPO's per-sequence sums: compute_rl_loss forms them from its own masks
            # and sums them over the CP group in ONE all-reduce (only when one of them is on)
            cp_sum = self._cp_all_reduce

        out = compute_rl_loss(
            log_probs,
            advantages,
            loss_mask,
            cu,
            cfg,
            denominators,
            old_log_probs=old,
            rollout_log_probs=rollout,
            ref_log_probs=ref,
            entropy=entropy,
            is_weights=is_weights,
            keep_mask=keep_mask,
            seq_token_counts=seq_token_counts,
            cp_sum=cp_sum,
        )
        metrics = out.flat_metrics()
        if self.cp.size > 1:
            # sequence counts: every CP rank sees every sequence; count each once (on CP rank 0)
            if self.cp.rank != 0:
                for key in ("num_denominator_sequences", "num_seq_ratio_sequences", "num_seq_clipped_low", "num_seq_clipped_high"):
                    if f"count/{key}" in metrics:
                        metrics[f"count/{key}"] = torch.zeros_like(metrics[f"count/{key}"])
            if cfg.use_opsm:
                dropped_tok = (out.valid_mask & ~out.pg_mask).float()
                dropped = self._cp_all_reduce(segment_sum(dropped_tok, cu).clamp_max(1.0), op="max")
                n = dropped.sum() if self.cp.rank == 0 else torch.zeros((), device=dev)
                metrics["count/num_opsm_sequences"] = n.float()
        if is_weights is not None:
            extra["max/is_weight"] = masked_extreme(is_weights.float(), out.valid_mask, "max")
            extra["min/is_weight"] = masked_extreme(is_weights.float(), out.valid_mask, "min")
        metrics.update(extra)
        world = _group_size(self.dp_group)
        if self.return_num_tokens:
            return out.loss * float(num_microbatches * world), torch.tensor(1, dtype=torch.int), metrics
        return out.loss * (float(num_microbatches * world) / self.cp.size), metrics

    # ------------------------------------------------------------------------------ metrics
    def reduce_metrics(self, forward_data_store: Sequence[Mapping[str, torch.Tensor]], denominators: Denominators) -> dict[str, float]:
        """The step's metrics from the schedule's output: sum over micro-batches, one SUM
        all-reduce over the data-parallel(-with-CP) group (plus one MAX all-reduce when there are
        ``max/`` / ``min/`` metrics), then :func:`megatron_mis.core.losses.finalize_metrics`
        (``lsum/`` entries are divided by the global number of loss tokens; ``max/`` and
        ``min/`` become ``NAME_max`` / ``NAME_min``, left out when no token had a value).
        Returns ``{}`` on pipeline stages other than the last.

        Raises:
            ValueError: if the counted denominator tokens / sequences differ from
                ``denominators`` (they were not computed from this step's data).
        """
        from megatron.core import parallel_state as ps

        if not ps.is_pipeline_last_stage():
            return {}
        self.warn_nonfinite()
        return reduce_metric_store(forward_data_store, denominators, self._all_reduce)

    def warn_nonfinite(self) -> int:
        """Warn (once per call) about the NaN / inf train or rollout log-probs the engine met in
        the micro-batches run since the last call, and return their number. Reads only counts the
        device has finished writing (:class:`~megatron_mis.core.engine.DeferredCount`): no
        synchronisation; counts not ready yet stay for the next call."""
        ready = [(d, d.poll()) for d in self._nonfinite]
        self._nonfinite = [d for d, v in ready if v is None]
        count = sum(v for _, v in ready if v is not None)
        if count:
            import warnings

            warnings.warn(nonfinite_message(count, self.mis_config), RuntimeWarning, stacklevel=2)
        return count


def _on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; host tensors reach an accelerator through pinned memory and a
    non-blocking copy (a plain ``.to(device)`` of host memory blocks the host)."""
    if t.device.type == "cpu" and torch.device(device).type != "cpu":
        return to_device(t, device)
    return t.to(device)


def _is_nccl(group: Any) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl"


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def _module_device(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
