"""The GRPO loop of ``megatron-mis demo`` and ``examples/megatron/train_grpo.py`` (one engine).

Every rank runs :func:`run_rank` with an initialised ``torch.distributed`` process group; the
Megatron-Core parallel state (TP x CP x PP x DP) is set up here and every collective runs on one
of its explicit groups. One RL step:

1. **weight sync**: :func:`megatron_mis.testbed.demo.rollout.weights_from_megatron` all-gathers the TP
   shards (and the pipeline stages) into the rollout engine, a separate pure-torch inference path;
2. **rollout**: ``P`` prompts of the digit task, ``G`` samples each, sampled with a KV cache in
   the chosen precision (or through the trainer's kernels with ``true_on_policy``), log-probs
   recorded as SGLang returns them. Every rank generates the same global batch (same weights,
   same seed) and trains on its data-parallel share: the data movement of a real rollout service
   is not the subject here;
3. **reward and advantages**: the task's programmatic reward, GRPO / RLOO advantages per group
   (:func:`megatron_mis.core.advantages.compute_advantages`);
4. **pi_old**: the trainer recomputes the log-probs in fp32 with Megatron's schedule, forward
   only (:meth:`MegatronRLLoss.recompute_log_probs`); their difference to the rollout's is the
   real mismatch, compared with the public :func:`megatron_mis.core.bitwise.compare_log_probs`;
5. **updates**: ``updates_per_step`` optimizer steps, each on a mini-batch of micro-batches,
   with :class:`MegatronRLLoss` in ``get_forward_backward_func()`` and Megatron's DDP: decoupled
   PPO with the correction's IS weights / rejections, or plain PPO for ``correction: none``;
6. **schedule and monitor**: the length-decay LR schedule (wrapping Megatron's
   ``OptimizerParamScheduler``) observes the global mean response length; the mismatch monitor
   watches K3 KL, the log-ppl gap and the gradient norm.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from megatron_mis.testbed.demo.config import (
    BUILTIN_CORRECTIONS,
    DIAGNOSTIC_TIS,
    REWRITE_EXPONENT,
    REWRITTEN_TIS,
    DemoConfig,
)

__all__ = ["BUILTIN_CORRECTIONS", "ArmSpec", "GRPOTrainer", "RunResult", "arm_spec", "balanced_first_token_weights",
           "group_mean_weights", "megatron_state", "permuted_group_mean_weights", "powered_weights",
           "random_derangement", "rollout_log_probs_for_weights", "run_rank", "shuffle_log_ratios", "summarize"]


# ----------------------------------------------------------------------------------- arms
@dataclass
class ArmSpec:
    """One run of the demo: its correction and the loss / engine configs it implies.

    ``correction == "none"``: ``LossConfig(policy_loss="ppo")`` against the recomputed pi_old,
    no IS weight, nothing rejected; the MIS engine runs with ``use_tis = use_rs = false`` only to
    measure the mismatch. Otherwise decoupled PPO with the preset's ``MISConfig``.
    """

    label: str
    correction: str
    loss: Any
    mis: Any
    #: how the trainer rewrites the rollout log-probs before the engine weighs them, so that the
    #: engine computes other weights (the diagnostics of ``REWRITTEN_TIS``): ``shuffle`` permutes the
    #: log-ratios log(pi_old / pi_rollout) among each micro-batch's loss tokens
    #: (:func:`shuffle_log_ratios`), ``group_mean``, ``group_mean_permuted`` and
    #: ``balance_first_token`` give the engine token TIS's weights rewritten per GRPO group
    #: (:func:`group_mean_weights`, :func:`permuted_group_mean_weights`,
    #: :func:`balanced_first_token_weights`), ``unit`` gives it weights of exactly 1 (the null
    #: arm: rollout log-probs set to pi_old); ``None``: no rewrite. The step's log-prob comparison
    #: and dump see the true pairs; the engine's mismatch metrics see the rewritten ones
    rewrite: str | None = None
    #: the power the rewritten weights are raised to (``REWRITE_EXPONENT``; 1: as rewritten)
    rewrite_exponent: float = 1.0


#: The "no bound" of ``decoupled_ppo``: larger than any weight exp(clamped log-ratio) reaches here.
UNBOUNDED_WEIGHT = 1.0e6


def arm_spec(correction: str, cfg: DemoConfig) -> ArmSpec:
    """The loss and MIS configs of ``correction``: ``none`` (PPO against the recomputed pi_old, no
    weight), ``bypass_ppo`` (PPO with pi_rollout as pi_old, no weight), ``decoupled_ppo`` (3-policy
    PPO, unbounded token weight pi_old / pi_rollout), a token TIS diagnostic of
    :data:`DIAGNOSTIC_TIS` (decoupled PPO), or a preset / mis.yaml (decoupled PPO with the preset's
    weights and rejections)."""
    from megatron_mis.config.loss import LossConfig
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.presets import preset_path

    common = dict(
        eps_clip=cfg.eps_clip,
        advantage_estimator=cfg.advantage_estimator,
        loss_aggregation="seq_mean_token_mean",
        entropy_coef=cfg.entropy_coef,
        replay_entropy=cfg.replay_entropy,
        rollout_temperature=cfg.resolved_trainer_temperature,  # the trainer's (the rollout's unless set apart)
    )
    off = MISConfig(use_tis=False, use_rs=False)  # the engine only measures the mismatch
    if correction == "none":
        return ArmSpec("none", "none", LossConfig(policy_loss="ppo", **common), off)
    if correction == "bypass_ppo":  # pi_rollout is the old policy: PPO's clip bounds pi_theta / pi_rollout
        return ArmSpec("bypass_ppo", correction, LossConfig(policy_loss="bypass_ppo", **common), off)
    if correction == "decoupled_ppo":  # 3-policy PPO with the raw weight pi_old / pi_rollout (no bound)
        mis = MISConfig(use_tis=True, use_rs=False, tis_level="token", tis_mode="truncate", tis_upper_bound=UNBOUNDED_WEIGHT)
        return ArmSpec("decoupled_ppo", correction, LossConfig(policy_loss="decoupled_ppo", **common), mis)
    if correction in DIAGNOSTIC_TIS:
        mis = MISConfig(use_tis=True, use_rs=False, tis_level="token", **DIAGNOSTIC_TIS[correction])
        return ArmSpec(correction, correction, LossConfig(policy_loss="decoupled_ppo", **common), mis,
                       rewrite=REWRITTEN_TIS.get(correction), rewrite_exponent=REWRITE_EXPONENT.get(correction, 1.0))
    path = preset_path(correction)
    label = path.stem
    return ArmSpec(label, correction, LossConfig(policy_loss="decoupled_ppo", **common), MISConfig.from_yaml(path))


@dataclass
class RunResult:
    """What the reporting rank returns for one arm."""

    label: str
    correction: str
    records: list[dict[str, Any]]
    samples: list[str] = field(default_factory=list)
    schedule: str = ""
    evaluation: dict[str, float] = field(default_factory=dict)


# -------------------------------------------------------------------------- parallel state
@contextlib.contextmanager
def megatron_state(cfg: DemoConfig) -> Iterator[None]:
    """Initialise Megatron-Core's parallel state for ``cfg`` on the existing process group
    (whose size must be ``tp x cp x pp x dp``) and destroy it and its process groups on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world != cfg.world_size:
        raise ValueError(
            f"{world} processes but tp x cp x pp x dp = {cfg.tp} x {cfg.cp} x {cfg.pp} x {cfg.dp} = {cfg.world_size}"
        )
    from megatron_mis.testing.distributed import owned_process_groups, release_megatron_group_references

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    with owned_process_groups():  # the study's workers run many of these on one world
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            context_parallel_size=cfg.cp,
        )
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            release_megatron_group_references()


def _per_sequence(micro_batches: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each sequence's ``(pi_old, rollout log-probs, loss mask)``, ``[T_i]`` each, in the order of
    ``micro_batches`` (packed micro-batches with ``old_log_probs`` recomputed)."""
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for mb in micro_batches:
        sizes = mb.response_lengths.tolist()
        out += zip(*(torch.split(t, sizes) for t in (mb.old_log_probs, mb.rollout_log_probs, mb.loss_mask)))
    return out


def shuffle_log_ratios(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                       generator: torch.Generator) -> torch.Tensor:
    """Rollout log-probs whose log-ratios to ``old_log_probs`` are the loss tokens' log-ratios in a
    random order (``generator``'s permutation): ``old - result`` is ``old - rollout`` permuted among
    the tokens with ``loss_mask > 0``, the others unchanged. The engine then computes the same
    weights, each on another token.

    Args:
        old_log_probs, rollout_log_probs, loss_mask: ``[T]`` one micro-batch's response tokens.

    Returns:
        ``[T]`` float32 rollout log-probs.
    """
    old, rollout = old_log_probs.float(), rollout_log_probs.float()
    d = old - rollout
    pos = (loss_mask > 0).nonzero().squeeze(1)
    shuffled = d.clone()
    shuffled[pos] = d[pos[torch.randperm(pos.numel(), generator=generator)]]
    return old - shuffled


def _group_offsets(response_lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[S+1]`` int64 offsets of the packed responses (``response_lengths [S]``), checked to form
    whole GRPO groups (sequences ``g * group_size`` to ``(g + 1) * group_size - 1`` are group ``g``)."""
    num_seqs = response_lengths.numel()
    if group_size < 1 or num_seqs % group_size:
        raise ValueError(f"{num_seqs} sequences do not split into whole GRPO groups of group_size={group_size}")
    return torch.nn.functional.pad(torch.cumsum(response_lengths.long(), 0), (1, 0))


def group_mean_weights(weights: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """Every loss token's weight replaced by the mean weight of its GRPO group's loss tokens: the
    weights' variation within a group removed, their variation between groups kept. Per group the
    weighted policy gradient is then the unweighted one times the group's mean weight.

    Args:
        weights: ``[T]`` token weights of one micro-batch's packed responses.
        loss_mask: ``[T]``; a value > 0 marks a loss token.
        response_lengths: ``[S]`` the responses' lengths, whole groups in order (``S`` a multiple of
            ``group_size``).
        group_size: samples per prompt.

    Returns:
        ``[T]`` float32; tokens outside the loss mask keep their weight.

    Raises:
        ValueError: if the sequences do not split into whole groups.
    """
    mean, count, gid = _group_means(weights, loss_mask, response_lengths, group_size)
    return torch.where(loss_mask > 0, mean[gid], weights.float())


def _group_means(weights: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each GRPO group's mean loss-token weight ``[G]`` (0 where it has no loss token), its loss-token
    count ``[G]`` and every token's group index ``[T]`` int64 (arguments as in :func:`group_mean_weights`)."""
    from megatron_mis.core.segments import sequence_ids

    cu = _group_offsets(response_lengths, group_size)
    w = weights.float()
    m = (loss_mask > 0).float()
    gid = sequence_ids(cu, w.numel()) // group_size
    groups = response_lengths.numel() // group_size
    # summed token by token into each group (one index_add): the order the archived runs were made with
    total = torch.zeros(groups).index_add_(0, gid, w * m)
    count = torch.zeros(groups).index_add_(0, gid, m)
    return total / count.clamp(min=1.0), count, gid


def random_derangement(n: int, generator: torch.Generator) -> list[int]:
    """A uniformly random permutation of ``range(n)`` that moves every element (``n >= 2``): random
    permutations drawn from ``generator`` until one has no fixed point (about e = 2.7 draws)."""
    if n < 2:
        raise ValueError(f"n={n}: a derangement needs at least 2 elements")
    while True:
        perm = torch.randperm(n, generator=generator).tolist()
        if all(p != i for i, p in enumerate(perm)):
            return perm


def permuted_group_mean_weights(weights: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor,
                                group_size: int, generator: torch.Generator) -> torch.Tensor:
    """A placebo of :func:`group_mean_weights`: every loss token of a GRPO group weighted by the mean
    weight of *another* group of the micro-batch. The group means are deranged (a random permutation
    without fixed points, :func:`random_derangement`) among the groups that have loss tokens, so the
    micro-batch holds the same group weights as under the group mean, none on the group it was
    measured on: a weight with the group mean's spread that is independent of the group's samples.

    Args:
        weights, loss_mask, response_lengths, group_size: as in :func:`group_mean_weights`.
        generator: draws the derangement.

    Returns:
        ``[T]`` float32; tokens outside the loss mask keep their weight.

    Raises:
        ValueError: if the sequences do not split into whole groups, or fewer than 2 groups have loss
            tokens (there is no other group to take a mean from).
    """
    mean, count, gid = _group_means(weights, loss_mask, response_lengths, group_size)
    live = (count > 0).nonzero().squeeze(1)
    if live.numel() < 2:
        raise ValueError(f"{live.numel()} of {count.numel()} GRPO groups have loss tokens: the permuted group "
                         f"mean needs at least 2")
    permuted = mean.clone()
    permuted[live] = mean[live[torch.tensor(random_derangement(live.numel(), generator))]]
    return torch.where(loss_mask > 0, permuted[gid], weights.float())


def balanced_first_token_weights(weights: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor,
                                 advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """Token weights whose sum_i w_i A_i over each GRPO group's first response tokens is 0.

    A group's first tokens share one context (the prompt), and there the unweighted gradient's
    softmax terms cancel because the advantages sum to 0 (with the loss's per-sequence token mean,
    where the group's sequences have equal loss-token counts). Each first token's share of the loss is
    q_i = w_i A_i / n_i (``n_i`` its sequence's loss tokens). The heavier side of the group (the
    samples with q_i > 0 or those with q_i < 0, whichever sums to more in magnitude) has its first-token
    weights scaled down by one factor until both sides weigh the same; no weight rises, every other
    token keeps its weight. A group with a side that weighs nothing is left as it is.

    Args:
        weights: ``[T]`` token weights of one micro-batch's packed responses.
        loss_mask: ``[T]``; a value > 0 marks a loss token.
        response_lengths: ``[S]`` the responses' lengths, whole groups in order.
        advantages: ``[T]`` each token's (its sequence's) advantage.
        group_size: samples per prompt.

    Returns:
        ``[T]`` float32.

    Raises:
        ValueError: if the sequences do not split into whole groups.
    """
    from megatron_mis.core.segments import segment_sum

    cu = _group_offsets(response_lengths, group_size)
    w = weights.float().clone()
    m = (loss_mask > 0).float()
    n = segment_sum(m, cu)
    first = cu[:-1]  # each response's first token (empty ones are skipped)
    has = (response_lengths > 0) & (n > 0)
    at = first.clamp(max=max(w.numel() - 1, 0))
    q = torch.where(has, w[at] * m[at] * advantages.float()[at] / n.clamp(min=1.0), torch.zeros(()))
    q = q.view(-1, group_size)
    pos, neg = q.clamp(min=0).sum(1), (-q).clamp(min=0).sum(1)
    ok = (pos > 0) & (neg > 0)
    scale_pos = torch.where(ok & (pos > neg), neg / pos.clamp(min=1e-30), torch.ones(()))
    scale_neg = torch.where(ok & (neg > pos), pos / neg.clamp(min=1e-30), torch.ones(()))
    scale = torch.where(q > 0, scale_pos[:, None], torch.where(q < 0, scale_neg[:, None], torch.ones(()))).reshape(-1)
    w[at[has]] = w[at[has]] * scale[has]
    return w


def powered_weights(weights: torch.Tensor, loss_mask: torch.Tensor, exponent: float) -> torch.Tensor:
    """Every loss token's weight w raised to ``exponent``: log w scaled by it, so a weight's distance
    from 1 in log space is multiplied by ``exponent`` (0: every weight 1; 2: 0.9 becomes 0.81, 1.1
    1.21); tokens outside the loss mask keep their weight.

    Args:
        weights, loss_mask: ``[T]``; the loss tokens' weights > 0.
        exponent: a finite power.

    Returns:
        ``[T]`` float32.

    Raises:
        ValueError: if ``exponent`` is not finite or a loss token's weight is not > 0.
    """
    if not math.isfinite(exponent):
        raise ValueError(f"exponent={exponent!r}: expected a finite power")
    m, w = _positive_loss_weights(weights, loss_mask, "raised to a power")
    return torch.where(m, w.clamp(min=1e-30) ** exponent, w)


def _positive_loss_weights(weights: torch.Tensor, loss_mask: torch.Tensor,
                           use: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_mask > 0, weights as float32)``, checked: every loss token's weight > 0 (``use`` names
    what it is for in the error)."""
    m = loss_mask > 0
    w = weights.float()
    if not bool(torch.all((w > 0) | ~m)):
        raise ValueError(f"every loss token's weight must be > 0 to be {use} (smallest {float(w[m].min())})")
    return m, w


def rollout_log_probs_for_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                                  loss_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rollout log-probs from which the engine's token weight exp(old - rollout) is ``weights``:
    ``old - log(weights)`` on the loss tokens, the recorded rollout log-prob elsewhere.

    Args:
        old_log_probs, rollout_log_probs, loss_mask, weights: ``[T]``; the loss tokens' weights > 0.

    Returns:
        ``[T]`` float32 rollout log-probs.

    Raises:
        ValueError: if a loss token's weight is not > 0 (its log would not be finite).
    """
    m, w = _positive_loss_weights(weights, loss_mask, "written as a log-ratio")
    return torch.where(m, old_log_probs.float() - torch.log(w.clamp(min=1e-30)), rollout_log_probs.float())


def _trainer_device() -> torch.device:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) > 1:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        out = t.to(device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return out.to(t.device)
    return t


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, *, model_parallel_group: Any, tp_rank: int) -> float:
    """The global gradient norm of a (TP / PP sharded) model, and clipping to ``max_norm`` (0: no
    clipping). Tensor-parallel shards count on every TP rank, replicated parameters (norms,
    biases of row-parallel layers) on TP rank 0 only; one SUM all-reduce of the squared norm over
    the model-parallel (TP x PP) group. Data- and context-parallel replicas already hold the
    reduced gradients."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sq += p.grad.detach().double().pow(2).sum().cpu()
    norm = float(_all_reduce(sq, model_parallel_group).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


# ------------------------------------------------------------------------------- trainer
class GRPOTrainer:
    """One arm of the demo on this rank (every rank of the job builds one; see the module
    docstring for a step). Megatron's parallel state must be initialised."""

    def __init__(self, cfg: DemoConfig, arm: ArmSpec) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine
        from megatron_mis.testbed.demo.task import PAD, DigitTask, TaskConfig
        from megatron_mis.integrations.megatron_loss import MegatronRLLoss
        from megatron_mis.testbed.models.gpt import GPTSpec, build_gpt
        from megatron_mis.lr_schedule import LengthDecayParamScheduler, build_lr_schedule
        from megatron_mis.monitor import LengthDecayConfig, MismatchMonitor, MonitorConfig, SurgeConfig

        self.cfg, self.arm = cfg, arm
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group() if cfg.pp > 1 else None
        self.dp_group = ps.get_data_parallel_group()  # without CP: different samples
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.mp_group = ps.get_model_parallel_group()
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.reporter = self.last_stage and self.tp_rank == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        # the log-prob dump: one writer per data-parallel rank (its sequences), on the stage that has pi_old
        self.dump_dir = (
            Path(cfg.dump_log_probs) / arm.label
            if cfg.dump_log_probs and self.last_stage and self.tp_rank == 0 and ps.get_context_parallel_rank() == 0
            else None
        )

        self.task = DigitTask(
            TaskConfig(kind=cfg.task, min_length=cfg.min_digits, max_length=cfg.max_digits, stop_with_eos=cfg.eos,
                       vocab_size=cfg.vocab_size, scratchpad=cfg.scratchpad, distractors=cfg.distractors,
                       scratchpad_position=cfg.scratchpad_position, digit_credit=cfg.digit_credit)
        )
        spec = GPTSpec(
            vocab_size=self.task.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            max_sequence_length=max(64, 2 * (cfg.max_digits + 3) + cfg.scratchpad + cfg.distractors),
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
        )
        torch.manual_seed(cfg.seed)  # Megatron's CPU init: the same full weights under any layout
        # packed micro-batches differ in length: the pipeline p2p must send shapes (Megatron checks the
        # MoE dispatcher setting even for dense models)
        overrides: dict[str, Any] = {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"} if cfg.pp > 1 else {}
        if cfg.num_moe_experts is not None:
            # no biases (the rollout engine mirrors bias-free experts and routers)
            # (the experts' width given explicitly: Megatron warns when it falls back to ffn_hidden_size)
            overrides.update(add_bias_linear=False, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or 4 * cfg.hidden_size)
        self.model = build_gpt(spec, **overrides)
        # gloo: everything on the CPU; nccl (torchrun on GPUs): the trainer on this rank's GPU, the
        # rollout engine still on the CPU (weights_from_megatron copies the weights there)
        self.device = _trainer_device()
        self.model.to(self.device)
        self.ddp = DistributedDataParallel(
            self.model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            self.model,
        )
        self.model.config.finalize_model_grads_func = finalize_model_grads
        self.params = [p for p in self.ddp.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)
        inner = OptimizerParamScheduler(
            self.optimizer, init_lr=cfg.lr, max_lr=cfg.lr, min_lr=cfg.lr, lr_warmup_steps=0,
            lr_decay_steps=max(cfg.steps * cfg.updates_per_step, 1), lr_decay_style="constant",
            start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        )
        # short-run surge settings (docs/monitor.md: smoothing 2, window 5, min steps 5)
        surge = SurgeConfig(length_surge_smoothing=2, length_surge_window=5, length_surge_min_steps=5)
        decay = LengthDecayConfig(
            length_decay_enabled=cfg.lr_schedule == "length-decay", length_decay_surge_step=cfg.lr_surge_step
        )
        self.scheduler = LengthDecayParamScheduler(inner, build_lr_schedule(decay, surge))
        self.monitor = (
            MismatchMonitor(MonitorConfig(monitor_window=max(4, min(30, cfg.steps // 2)), monitor_emit="none"), surge, sinks=[])
            if self.reporter
            else None
        )
        self.rl = MegatronRLLoss(arm.loss, arm.mis)
        self.rollout_config = RolloutConfig(
            precision=cfg.precision,
            max_new_tokens=self.task.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            logprobs=cfg.rollout_logprobs,
            eos_token_id=self.task.eos_token_id,
            pad_token_id=PAD,
            true_on_policy=cfg.true_on_policy,
            micro_batch_size=cfg.micro_batch_size if cfg.true_on_policy else None,
            record_support=cfg.trainer_truncation,
            router_noise=cfg.rollout_router_noise,
        )
        self.engine = RolloutEngine(self._weights(), self.rollout_config)
        # staleness: a ring buffer of (optimizer step, weights); the oldest entry is the rollout's policy
        self.optimizer_steps = 0
        self.snapshots: collections.deque = collections.deque(maxlen=cfg.staleness + 1)
        if cfg.staleness:
            self.snapshots.append((0, self.engine.weights))
        self.fast_fp32 = (
            RolloutEngine(self.engine.weights, RolloutConfig(**{**self.rollout_config.to_dict(), "true_on_policy": False, "micro_batch_size": None}))
            if cfg.true_on_policy
            else None
        )
        self.g_task = torch.Generator().manual_seed(cfg.seed)
        self.g_rollout = torch.Generator().manual_seed(cfg.seed + 1)
        self.pad = PAD
        self.routes = _MoERoutes(self.model, replay=cfg.routing_replay) if cfg.num_moe_experts is not None else None

    def close(self) -> None:
        """Remove what this trainer installed on the model (routing replay, router hooks)."""
        if self.routes is not None:
            self.routes.close()

    def _weights(self):
        from megatron_mis.testbed.demo.rollout import weights_from_megatron

        return weights_from_megatron(self.model, tp_group=self.tp_group, pp_group=self.pp_group)

    # ------------------------------------------------------------------------------ a step
    def _micro_batches(self, batch, advantages: torch.Tensor) -> list[Any]:
        from megatron_mis.integrations.megatron_loss import RLMicroBatch
        from megatron_mis.parallel.tp_logprobs import TokenSupport

        cfg = self.cfg
        per_rank = cfg.num_sequences // self.dp_size
        start = self.dp_rank * per_rank
        seqs = batch.sequences
        out = []
        for lo in range(start, start + per_rank, cfg.micro_batch_size):
            idx = list(range(lo, lo + cfg.micro_batch_size))
            resp = batch.response_lengths[idx]
            lengths = torch.tensor([seqs[i].numel() for i in idx])
            out.append(
                RLMicroBatch(
                    tokens=torch.cat([seqs[i] for i in idx]),
                    cu_seqlens=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).int(),
                    response_lengths=resp,
                    loss_mask=torch.ones(int(resp.sum())),
                    advantages=torch.repeat_interleave(advantages[idx], resp),
                    rollout_log_probs=torch.cat([batch.rollout_log_probs[i] for i in idx]),
                    rollout_support=(
                        None if batch.support is None else TokenSupport.from_lists([ids for i in idx for ids in batch.support[i]])
                    ),
                    slot_length=batch.slot_length if cfg.true_on_policy else None,
                    pad_token_id=self.pad,
                )
            )
        return out

    def _micro_batch_indices(self) -> list[list[int]]:
        """The global sequence indices of this rank's micro-batches (as :meth:`_micro_batches`)."""
        cfg = self.cfg
        per_rank = cfg.num_sequences // self.dp_size
        start = self.dp_rank * per_rank
        return [list(range(lo, lo + cfg.micro_batch_size)) for lo in range(start, start + per_rank, cfg.micro_batch_size)]

    def _compare_log_probs(self, sequences: list[tuple[torch.Tensor, ...]]) -> dict[str, float]:
        """The recomputed pi_old against the rollout's log-probs (``sequences``: this rank's, as
        :func:`_per_sequence` gives them) with the public bitwise check, over the whole global batch
        (one SUM and one MAX all-reduce over the DP group)."""
        from megatron_mis.core.bitwise import compare_log_probs

        rep = compare_log_probs([seq[0] for seq in sequences], [seq[1] for seq in sequences])
        counts = _all_reduce(torch.tensor([rep.num_tokens, rep.num_different], dtype=torch.float64), self.dp_group)
        worst = _all_reduce(torch.tensor([rep.max_abs_diff], dtype=torch.float64), self.dp_group, "max")
        return {
            "logprob_abs_diff_max": float(worst[0]),
            "logprob_fraction_different": float(counts[1] / counts[0]) if counts[0] > 0 else 0.0,
            "logprob_bitwise_equal": bool(counts[1] == 0),
        }

    def _dump_log_probs(self, step: int, sequences: list[tuple[torch.Tensor, ...]]) -> None:
        """Write this rank's sequences of step ``step`` (as :func:`_per_sequence` gives them):
        rollout log-probs, the recomputed pi_old and the loss mask, one JSON line each, as
        ``megatron-mis analyze`` reads them (``rollout_id`` = ``step - 1``); written to a temporary
        name and renamed when complete."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"step-{step:05d}.dp-{self.dp_rank}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for train, rollout, mask in sequences:
                fh.write(json.dumps({"train_log_probs": train.tolist(), "rollout_log_probs": rollout.tolist(),
                                     "loss_mask": mask.tolist(), "rollout_id": step - 1}) + "\n")
        os.replace(tmp, path)

    def _rewrite_log_ratios(self, mb: Any, idx: list[int], step: int) -> Any:
        """``mb`` (pi_old recomputed) with rollout log-probs from which the engine computes the
        weights of the arm's diagnostic (:attr:`ArmSpec.rewrite`); ``idx``: its global sequence
        indices. Deterministic, so every TP / CP rank of the micro-batch writes the same."""
        # one stream per (seed, step, micro-batch); the shuffle's expression made the archived shuffled runs
        g = torch.Generator().manual_seed(((self.cfg.seed * 1_000_003 + step) * 100_003 + idx[0]) % 2**63)
        if self.arm.rewrite == "shuffle":
            mb = replace(mb, rollout_log_probs=shuffle_log_ratios(mb.old_log_probs, mb.rollout_log_probs,
                                                                  mb.loss_mask, g))
            if self.arm.rewrite_exponent == 1.0:  # the engine weighs the shuffled log-ratios as they are
                return mb
        from megatron_mis.core.engine import compute_mis

        group = self.cfg.samples_per_prompt
        if self.arm.rewrite == "unit":  # the null arm: weights of 1, nothing for the engine to compute first
            w = torch.ones(mb.old_log_probs.shape)
        else:  # a shuffle permutes within the micro-batch: its sequences need not form whole groups
            cu = mb.response_cu_seqlens if self.arm.rewrite == "shuffle" else _group_offsets(mb.response_lengths, group)
            w = compute_mis(mb.old_log_probs, mb.rollout_log_probs, mb.loss_mask, cu, self.arm.mis).weights
        if self.arm.rewrite == "group_mean":
            w = group_mean_weights(w, mb.loss_mask, mb.response_lengths, group)
        elif self.arm.rewrite == "group_mean_permuted":
            w = permuted_group_mean_weights(w, mb.loss_mask, mb.response_lengths, group, g)
        elif self.arm.rewrite == "balance_first_token":
            w = balanced_first_token_weights(w, mb.loss_mask, mb.response_lengths, mb.advantages, group)
        elif self.arm.rewrite not in ("unit", "shuffle"):
            raise ValueError(f"rewrite={self.arm.rewrite!r}: expected one of shuffle, group_mean, group_mean_permuted, "
                             f"balance_first_token, unit")
        if self.arm.rewrite_exponent != 1.0:
            w = powered_weights(w, mb.loss_mask, self.arm.rewrite_exponent)
        return replace(mb, rollout_log_probs=rollout_log_probs_for_weights(mb.old_log_probs, mb.rollout_log_probs,
                                                                            mb.loss_mask, w))

    def step(self, step: int) -> dict[str, Any]:
        """Run RL step ``step`` (numbered from 1) on this rank; returns the step's record (complete
        on the reporting rank)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_mis.core.advantages import compute_advantages
        from megatron_mis.testbed.demo.rollout import RolloutBatch

        cfg = self.cfg
        t0 = time.perf_counter()
        # staleness: the first `stale` prompt groups use the weights of `staleness` optimizer steps
        # earlier (or the initial ones), the others the current weights (all groups unless stale_fraction < 1)
        stale = round(cfg.stale_fraction * cfg.prompts_per_step) if cfg.staleness else 0
        version = self.snapshots[0][0] if cfg.staleness else self.optimizer_steps
        if stale == cfg.prompts_per_step:
            self.engine.load_weights(self.snapshots[0][1])
        elif not stale:
            self.engine.load_weights(self._weights())
        problems = self.task.sample(cfg.prompts_per_step, generator=self.g_task)
        expanded = [p for p in problems for _ in range(cfg.samples_per_prompt)]
        prompts = [p.prompt for p in expanded]
        record: dict[str, Any] = {"step": step, "run": self.arm.label, "policy_lag": self.optimizer_steps - version}
        if self.fast_fp32 is not None and self.reporter:
            # the cost of true on-policy: the fast fp32 engine on the same prompts, same draws
            self.fast_fp32.load_weights(self.engine.weights)
            g = torch.Generator()
            g.set_state(self.g_rollout.get_state())
            tf = time.perf_counter()
            self.fast_fp32.generate(prompts, generator=g)
            record["time_rollout_fast_s"] = time.perf_counter() - tf
        t_roll = time.perf_counter()
        if 0 < stale < cfg.prompts_per_step:  # a mixed batch: the stale groups first, then the fresh ones
            cut = stale * cfg.samples_per_prompt
            self.engine.load_weights(self.snapshots[0][1])
            old_part = self.engine.generate(prompts[:cut], generator=self.g_rollout)
            self.engine.load_weights(self._weights())
            batch = RolloutBatch.concat([old_part, self.engine.generate(prompts[cut:], generator=self.g_rollout)])
            record["stale_fraction"] = stale / cfg.prompts_per_step
        else:
            batch = self.engine.generate(prompts, generator=self.g_rollout)
        record["time_rollout_s"] = time.perf_counter() - t_roll
        rewards = self.task.rewards(expanded, batch.responses)
        correct = [self.task.is_correct(p, r) for p, r in zip(expanded, batch.responses)]
        adv = compute_advantages(
            rewards, group_size=cfg.samples_per_prompt, estimator=cfg.advantage_estimator
        ).advantages
        lengths = batch.response_lengths.float()
        record.update(
            reward_mean=float(rewards.mean()),
            reward_max=float(rewards.max()),
            reward_min=float(rewards.min()),
            accuracy=sum(correct) / len(correct),
            response_length_mean=float(lengths.mean()),
        )

        # ---- pi_old, recomputed by the trainer in fp32
        t_re = time.perf_counter()
        micro_batches = self._micro_batches(batch, adv)
        shards = self.routes.shards(batch, self._micro_batch_indices()) if self.routes is not None else None
        if shards is not None:
            self.routes.before_recompute(shards)
        old = self.rl.recompute_log_probs([self.ddp], micro_batches)
        if shards is not None:
            record.update(self.routes.after_recompute(shards, self.dp_group))
        if old is not None:
            micro_batches = [mb.with_old_log_probs(o.cpu()) for mb, o in zip(micro_batches, old)]
            sequences = _per_sequence(micro_batches)
            record.update(self._compare_log_probs(sequences))
            if self.dump_dir is not None:
                self._dump_log_probs(step, sequences)
            if self.arm.rewrite is not None:  # a diagnostic: other weights through the same engine (after the records)
                micro_batches = [self._rewrite_log_ratios(mb, idx, step)
                                 for mb, idx in zip(micro_batches, self._micro_batch_indices())]
            if cfg.true_on_policy and not record["logprob_bitwise_equal"]:
                raise RuntimeError(
                    f"step {step}: true on-policy rollout log-probs differ from the trainer's recompute "
                    f"(max |diff| {record['logprob_abs_diff_max']:.3g}, fraction {record['logprob_fraction_different']:.3g}); "
                    "the aligned path no longer mirrors the trainer"
                )
        record["time_recompute_s"] = time.perf_counter() - t_re

        # ---- learning-rate schedule: the global mean response length (every rank has the batch)
        self.scheduler.observe(step, float(lengths.mean()))
        record["lr"] = float(self.optimizer.param_groups[0]["lr"])
        record["lr_factor"] = float(self.scheduler.factor)

        # ---- updates
        t_tr = time.perf_counter()
        fb = get_forward_backward_func()
        per_update = len(micro_batches) // cfg.updates_per_step
        agg = _UpdateAggregator()
        for k in range(cfg.updates_per_step):
            group = micro_batches[k * per_update : (k + 1) * per_update]
            den = self.rl.count_denominators(group)
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad(set_to_none=True)
            if shards is not None:
                self.routes.before_update(shards[k * per_update : (k + 1) * per_update])
            store = fb(
                forward_step_func=self.rl.forward_step(den, num_microbatches=len(group)),
                data_iterator=iter(group),
                model=[self.ddp],
                num_microbatches=len(group),
                seq_length=max(int(mb.tokens.numel()) for mb in group),
                micro_batch_size=1,
                forward_only=False,
            )
            metrics = self.rl.reduce_metrics(store, den)
            for p in self.params:
                p.grad = p.main_grad.to(p.dtype)
            norm = clip_grad_norm(self.params, cfg.clip_grad, model_parallel_group=self.mp_group, tp_rank=self.tp_rank)
            self.optimizer.step()
            self.scheduler.step(1)
            self.optimizer_steps += 1
            if cfg.staleness:  # every rank: the weight sync is collective
                self.snapshots.append((self.optimizer_steps, self._weights()))
            agg.add(metrics, norm)
        record["time_train_s"] = time.perf_counter() - t_tr
        record.update(agg.result(uses_weights=self.rl.policy.uses_is_weights))
        record["time_step_s"] = time.perf_counter() - t0
        if self.monitor is not None:
            found = self.monitor.update(
                step,
                {k: record.get(k) for k in ("mis_k3_kl", "mis_log_ppl_abs_diff", "grad_norm", "lr")}
                | {"response_length": record["response_length_mean"], "entropy": record.get("entropy"),
                   "mis_rejected_token_fraction": record["rejected_token_fraction"]},
            )
            record["monitor_warnings"] = [w.message for w in found]
        return record

    def evaluate(self, num_prompts: int = 64, num_samples: int = 4) -> tuple[dict[str, float], list[str]]:
        """Greedy decoding (fp32 engine, top-1) of ``num_prompts`` fresh problems, the same for
        every run of a seed: ``({"greedy_reward", "greedy_exact"}, a few decoded samples)``. Call on
        every rank: the weight sync gathers TP shards / pipeline stages; every rank then computes
        the same numbers."""
        from megatron_mis.testbed.demo.rollout import RolloutConfig, RolloutEngine

        cfg = {**self.rollout_config.to_dict(), "precision": "fp32", "top_k": 1, "true_on_policy": False, "micro_batch_size": None,
               "router_noise": 0.0}
        engine = RolloutEngine(self._weights(), RolloutConfig(**cfg))
        problems = self.task.sample(num_prompts, generator=torch.Generator().manual_seed(self.cfg.seed + 7919))
        batch = engine.generate([p.prompt for p in problems], generator=torch.Generator().manual_seed(0))
        rewards = self.task.rewards(problems, batch.responses)
        exact = [self.task.is_correct(p, r) for p, r in zip(problems, batch.responses)]
        lines = []
        for p, r, ok, rew in list(zip(problems, batch.responses, exact, rewards.tolist()))[:num_samples]:
            mark = "right" if ok else f"reward {rew:.2f}"
            lines.append(f"{self.task.decode(p.prompt)} -> {self.task.decode(r)}  ({mark})")
        return {"greedy_reward": float(rewards.mean()), "greedy_exact": sum(exact) / len(exact)}, lines


class _MoERoutes:
    """The MoE side of a trainer: the rollout's routes cut into per-micro-batch
    :class:`~megatron_mis.routing.RouteShard` s, routing replay (R3) when asked, and the routing
    agreement between rollout and trainer measured in the pi_old recompute.

    Metrics of a step (over tokens with a rollout route, all MoE layers):

    - ``route_agreement``: fraction of the rollout's experts that the trainer's own float32 router
      chooses for the same token (1 - ``route_flip_fraction``). Without replay it is read from the
      routers' outputs; with replay from :meth:`RoutingReplay.agreement` (the router's natural
      top-k beside the replayed one; from the second MoE layer on, on hidden states that the
      replayed experts of the earlier layers produced, so the two figures are not the same
      measurement beyond the first MoE layer).
    - ``route_tokens_flipped``: fraction of (token, layer) pairs where the trainer's natural choice
      differs from the rollout's in at least one expert (without replay only).
    - ``route_replay_match`` (replay only): fraction of (token, layer) pairs whose experts, as the
      trainer's routers used them, equal the rollout's (1.0 when replay works).
    """

    def __init__(self, model: Any, *, replay: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_mis.routing import RoutingReplay, shard_spec_from_megatron

        self.spec = shard_spec_from_megatron(model.config)
        self.routers = {int(m.layer_number) - 1: m for m in model.modules() if isinstance(m, TopKRouter)}
        self.topk = int(model.config.moe_router_topk)
        self._dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
        self._maps: list[dict[int, torch.Tensor]] = []
        self._capture = False
        self._hooks = [r.register_forward_hook(self._hook(layer)) for layer, r in self.routers.items()]
        self.replay = RoutingReplay(model, routing_replay_mode="r3").install() if replay else None

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self._capture:
                return
            if layer == min(self.routers):
                self._maps.append({})
            self._maps[-1][layer] = output[1].detach().to("cpu")  # routing_map [n, E] bool

        return hook

    def close(self) -> None:
        """Remove the hooks and the replay, and drop the autograd graphs the token dispatchers keep.

        Megatron-Core's MoE token dispatcher keeps tensors of its last forward (the all-gather
        dispatcher's ``local_probs``, 0.16.1) with their ``grad_fn``. That graph reaches the
        parameters' ``AccumulateGrad`` nodes, whose hooks (the DDP's backward post-hooks, held in
        C++ where the garbage collector cannot see them) close over the DDP and so the model: a
        cycle that is never collected. Every MoE run made in a long-lived process (the study's
        workers) kept its model and, through it, its destroyed process groups' ~48 gloo threads."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.replay is not None:
            self.replay.remove()
            self.replay = None
        for dispatcher in self._dispatchers:
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(dispatcher, name, None)
        self._dispatchers = []

    def shards(self, batch: Any, micro_batches: list[list[int]]) -> list[Any]:
        from megatron_mis.routing import shard_routes

        if batch.routed_experts is None:
            raise RuntimeError("the rollout engine returned no routes for an MoE model")
        out = []
        for idx in micro_batches:
            lengths = [int(batch.prompts[i].numel() + batch.responses[i].numel()) for i in idx]
            out.append(shard_routes([batch.routed_experts[i] for i in idx], lengths, self.spec))
        return out

    def _load(self, shards: list[Any]) -> None:
        if self.replay is not None:
            self.replay.clear()
            self.replay.load_routes(shards)
            self.replay.begin_pass()

    def before_recompute(self, shards: list[Any]) -> None:
        self._load(shards)
        if self.replay is not None:
            self.replay.reset_agreement()
        self._maps = []
        self._capture = True

    def before_update(self, shards: list[Any]) -> None:
        self._load(shards)

    def after_recompute(self, shards: list[Any], dp_group: Any) -> dict[str, float]:
        """The step's routing metrics (sums over the data-parallel group: one all-reduce)."""
        from megatron_mis.routing import agreement_counts

        self._capture = False
        if len(self._maps) != len(shards):
            raise RuntimeError(f"captured {len(self._maps)} router passes for {len(shards)} micro-batches")
        # [agreement sum, agreement count, flipped pairs, pairs, replay-equal pairs]
        acc = torch.zeros(5, dtype=torch.float64)
        for maps, shard in zip(self._maps, shards):
            for layer, routing_map in maps.items():
                col = shard.column(layer)
                rollout = shard.routes[:, col].long()  # [n, k]
                keep = shard.valid if shard.replayed is None else shard.valid & shard.replayed[:, col]
                used = routing_map.nonzero()[:, 1].view(routing_map.shape[0], self.topk)  # sorted ids
                same = (torch.sort(rollout, dim=1).values == used).all(1)
                if self.replay is None:
                    acc[:2] += agreement_counts(rollout, used, keep)
                    acc[2] += float((~same & keep).sum())
                acc[3] += float(keep.sum())
                acc[4] += float((same & keep).sum())
        if self.replay is not None:
            ids, stats = self.replay.agreement_stats()
            if len(ids):
                acc[:2] += stats.sum(0)
        acc = _all_reduce(acc, dp_group)
        out = {}
        if acc[1] > 0:
            out["route_agreement"] = float(acc[0] / acc[1])
            out["route_flip_fraction"] = 1.0 - out["route_agreement"]
        if acc[3] > 0:
            if self.replay is None:
                out["route_tokens_flipped"] = float(acc[2] / acc[3])
            else:
                out["route_replay_match"] = float(acc[4] / acc[3])
        return out


class _UpdateAggregator:
    """Combines the metrics of a step's updates (disjoint mini-batches covering the batch):
    loss-token means weighted by loss tokens, kept-token means by valid tokens, extremes over
    updates."""

    def __init__(self) -> None:
        self.updates: list[tuple[dict[str, float], float]] = []

    def add(self, metrics: dict[str, float], grad_norm: float) -> None:
        self.updates.append((metrics, grad_norm))

    def result(self, *, uses_weights: bool) -> dict[str, float]:
        ms = [m for m, _ in self.updates if m]
        out: dict[str, float] = {"grad_norm": sum(g for _, g in self.updates) / max(len(self.updates), 1)}
        if not ms:
            return out
        n_loss = [m.get("num_loss_tokens", 0.0) for m in ms]
        n_valid = [m.get("num_valid_tokens", 0.0) for m in ms]

        def weighted(key: str, weights: list[float]) -> float | None:
            pairs = [(m[key], w) for m, w in zip(ms, weights) if key in m]
            total = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None

        def extreme(key: str, fn: Callable) -> float | None:
            vals = [m[key] for m in ms if key in m]
            return fn(vals) if vals else None

        for key in ("mis_k3_kl", "mis_log_ppl_abs_diff", "mis_training_log_ppl", "mis_rollout_log_ppl",
                    "mis_rejected_seq_fraction"):
            v = weighted(key, n_loss)
            if v is not None:
                out[key] = v
        out["mis_ratio_mean"] = weighted("mis_ratio", n_loss)
        out["mis_ratio_min"] = extreme("mis_ratio_min", min)
        out["mis_ratio_max"] = extreme("mis_ratio_max", max)
        out["mis_k3_kl_max"] = extreme("mis_k3_kl_max", max)
        for key in ("pg_clipfrac", "entropy", "ratio"):
            v = weighted(key, n_valid)
            if v is not None:
                out[key] = v
        out["loss"] = sum(m.get("loss", 0.0) for m in ms) / len(ms)
        out["pg_loss"] = sum(m.get("pg_loss", 0.0) for m in ms) / len(ms)
        if uses_weights:
            out["is_weight_mean"] = weighted("is_weight", n_valid)
            out["is_weight_min"] = extreme("is_weight_min", min)
            out["is_weight_max"] = extreme("is_weight_max", max)
        else:  # the loss multiplies by no weight: 1 for every token
            out["is_weight_mean"] = out["is_weight_min"] = out["is_weight_max"] = 1.0
        total_loss = sum(n_loss)
        out["rejected_token_fraction"] = sum(m.get("num_rejected_tokens", 0.0) for m in ms) / total_loss if total_loss else 0.0
        out["rejected_seq_fraction"] = out.pop("mis_rejected_seq_fraction", 0.0)
        return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------------- a rank
def run_rank(cfg: DemoConfig) -> list[RunResult] | None:
    """Run every arm of ``cfg`` on this rank (all ranks call it; ``torch.distributed`` must be
    initialised with ``cfg.world_size`` ranks). The reporting rank (last pipeline stage, TP / DP
    / CP rank 0) shows the progress bar, writes ``OUT_DIR/NAME/metrics.jsonl`` and returns the
    results; other ranks return ``None``."""
    import warnings

    results: list[RunResult] = []
    reporter = False
    # the caller's warning filters and torch RNG are left as they were (Megatron's CPU init draws
    # from the global generator, seeded here)
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), megatron_state(cfg):
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
        warnings.filterwarnings("ignore", message=".*(cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*")
        run_dir = Path(cfg.out_dir) / cfg.name
        for index, correction in enumerate(cfg.arms):
            arm = arm_spec(correction, cfg)
            trainer = GRPOTrainer(cfg, arm)
            reporter = trainer.reporter
            sink = None
            if reporter:
                run_dir.mkdir(parents=True, exist_ok=True)
                sink = (run_dir / "metrics.jsonl").open("w" if index == 0 else "a", encoding="utf-8")
            bar = _progress(cfg, arm, index) if reporter else None
            records = []
            wall0 = time.perf_counter()
            try:
                for step in range(1, cfg.steps + 1):
                    record = trainer.step(step)
                    record["wall_s"] = time.perf_counter() - wall0
                    if reporter:
                        records.append(record)
                        sink.write(json.dumps(_jsonable(record)) + "\n")
                        sink.flush()
                        _update_bar(bar, record)
                evaluation, samples = trainer.evaluate()  # every rank: the weight sync is collective
            finally:
                trainer.close()  # routing replay and router hooks leave the model, also on an error
                if bar is not None:
                    bar.close()
                if sink is not None:
                    sink.close()
            if reporter:
                results.append(
                    RunResult(
                        label=arm.label,
                        correction=arm.correction,
                        records=records,
                        samples=samples,
                        schedule=trainer.scheduler.schedule.describe(),
                        evaluation=evaluation,
                    )
                )
            del trainer
    return results if reporter else None


def _progress(cfg: DemoConfig, arm: ArmSpec, index: int):
    from tqdm.auto import tqdm

    desc = f"{arm.label:>12s}" if cfg.compare else arm.label
    return tqdm(total=cfg.steps, desc=desc, unit="step", disable=not cfg.progress, dynamic_ncols=True, leave=True)


def _update_bar(bar, record: dict[str, Any]) -> None:
    bar.set_postfix(
        reward=f"{record['reward_mean']:.3f}",
        k3_kl=f"{record.get('mis_k3_kl', float('nan')):.2e}",
        refresh=False,
    )
    bar.update(1)
    for message in record.get("monitor_warnings", []):
        bar.write(f"monitor: {message}")


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


# ------------------------------------------------------------------------------- summary
def summarize(result: RunResult) -> dict[str, float]:
    """The comparison row of one run: final reward (mean of the last 10% of steps, at least 3),
    peak reward, mean and max K3 KL, mean log-ppl abs diff, mean rejected token fraction, wall
    time, and the greedy evaluation after training."""
    recs = result.records
    if not recs:
        return {}
    tail = max(3, len(recs) // 10)
    last = recs[-tail:]

    def mean(key: str, rs=recs) -> float:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    return {
        "reward_start": mean("reward_mean", recs[:tail]),
        "reward_final": mean("reward_mean", last),
        "reward_peak": max(r["reward_mean"] for r in recs),
        "accuracy_final": mean("accuracy", last),
        "k3_kl_mean": mean("mis_k3_kl"),
        "k3_kl_max": max((r.get("mis_k3_kl_max", 0.0) or 0.0) for r in recs),
        "log_ppl_abs_diff_mean": mean("mis_log_ppl_abs_diff"),
        "rejected_fraction_mean": mean("rejected_token_fraction"),
        "logprob_abs_diff_max": max((r.get("logprob_abs_diff_max", 0.0) or 0.0) for r in recs),
        "wall_s": recs[-1]["wall_s"],
        "steps": float(len(recs)),
        **result.evaluation,
    }
