"""GRPO on plain Megatron-Core with megatron-mis: a Megatron-Core ``GPTModel`` learns to copy digits,
rollouts are sampled in a lower precision than the trainer computes (the training-inference
mismatch), and the loss corrects it with a mis.yaml preset. Launched by torchrun, multi-node ready.

Two nodes with 8 GPUs each (TP=2, CP=2, PP=1, so DP = 16 / 4 = 4); run on every node, with
NODE_RANK 0 and 1 and MASTER_ADDR the address of node 0::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --master-addr $MASTER_ADDR --master-port 29500 \\
        examples/megatron/train_grpo.py --tp 2 --cp 2 --steps 200 --mis-config token_tis

One machine, CPU only (gloo), two processes::

    torchrun --standalone --nproc-per-node 2 examples/megatron/train_grpo.py --tp 2 --steps 20

This file uses Megatron-Core and megatron-mis's public API only; copy it into your job and
replace the three parts that are the example's own (the task, the model size, the rollout
sampler) by yours. A step:

1. rollout: the model samples answers in ``--rollout-dtype`` (autocast: bf16 matmuls, as a
   bf16 inference engine computes them) through Megatron's forward-only schedule, one token at a
   time, and records the sampled tokens' log-probs, as SGLang or vLLM return them. In a real job
   these come from the inference engine;
2. reward (fraction of digits copied) and GRPO advantages (:func:`compute_advantages_from_config`);
3. pi_old recomputed in fp32 by the trainer (:meth:`MegatronRLLoss.recompute_log_probs`): its
   difference to the rollout log-probs is the mismatch;
4. one update with Megatron's schedule, DDP and optimizer, the loss being
   :class:`MegatronRLLoss` (decoupled PPO, IS weights and rejections from the mis.yaml);
5. Megatron's LR scheduler wrapped by :class:`LengthDecayParamScheduler`, and the
   :class:`MismatchMonitor` watching K3 and the gradient norm.

On GPUs with Transformer Engine the model uses its layer spec. Otherwise (a CPU-only machine, or
a GPU without Transformer Engine) it uses Megatron's local spec with the package's torch-SDPA core
attention, which accepts packed sequences and context parallelism
(:func:`megatron_mis.testing.cpu.cpu_gpt_layer_spec`), and on a CPU the shims Megatron-Core needs
without CUDA (:func:`megatron_mis.testing.cpu.cpu_compat`).

The reporting rank (last pipeline stage, first TP / CP / DP rank) appends one JSON line per step
to ``--metrics``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# ------------------------------------------------------------------------------- the task
PAD, SEP, FIRST_DIGIT = 0, 1, 2  # token ids: padding, the separator ending a prompt, digits 0-9 from 2
VOCAB_SIZE = 16  # 12 used, rounded up so that any TP size up to 16 that divides it works


def sample_prompts(num: int, digits: int, generator: torch.Generator) -> torch.Tensor:
    """``[num, digits + 1]`` prompts: ``digits`` random digits, then ``SEP``."""
    body = torch.randint(FIRST_DIGIT, FIRST_DIGIT + 10, (num, digits), generator=generator)
    return torch.cat([body, torch.full((num, 1), SEP)], dim=1)


def copy_rewards(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """``[N]`` fraction of the prompt's digits the response reproduces in place."""
    return (responses == prompts[:, :-1]).float().mean(dim=1)


# ------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (divides --num-layers)")
    p.add_argument("--steps", type=int, default=20, help="RL steps (one optimizer step each)")
    p.add_argument("--mis-config", default="token_tis", help="a mis.yaml path or a shipped preset name")
    p.add_argument("--rollout-dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="rollout precision")
    p.add_argument("--digits", type=int, default=3, help="digits to copy (prompt and response length)")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step, over all DP ranks")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO group size")
    p.add_argument("--micro-batch-size", type=int, default=32, help="sequences per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA (nccl) where available, else the CPU (gloo); cpu forces the CPU on a GPU machine")
    p.add_argument("--metrics", type=Path, default=Path("train_grpo_metrics.jsonl"), help="JSONL written by the reporting rank")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world: int) -> list[str]:
    """Every problem with the flags at once, before any process group exists."""
    sizes = ("tp", "cp", "pp", "steps", "digits", "prompts_per_step", "samples_per_prompt", "micro_batch_size",
             "hidden_size", "num_layers", "num_attention_heads")
    problems = [f"--{n.replace('_', '-')}={getattr(args, n)} must be >= 1" for n in sizes if getattr(args, n) < 1]
    if not (args.lr > 0):
        problems.append(f"--lr={args.lr} must be > 0")
    if not (args.clip_grad >= 0):
        problems.append(f"--clip-grad={args.clip_grad} must be >= 0 (0: no clipping)")
    if any(getattr(args, n) < 1 for n in sizes):
        return problems  # the layout checks below divide by these
    model_parallel = args.tp * args.cp * args.pp
    if world % model_parallel:
        problems.append(f"WORLD_SIZE={world} is not a multiple of tp x cp x pp = {model_parallel}")
    if VOCAB_SIZE % args.tp:
        problems.append(f"--tp={args.tp} must divide the vocabulary size {VOCAB_SIZE}")
    if args.num_attention_heads % args.tp or args.hidden_size % args.num_attention_heads:
        problems.append(f"--num-attention-heads={args.num_attention_heads} must divide --hidden-size={args.hidden_size} "
                        f"and be divisible by --tp={args.tp}")
    if args.num_layers % args.pp:
        problems.append(f"--num-layers={args.num_layers} must be divisible by --pp={args.pp}")
    dp = max(world // model_parallel, 1)
    if args.prompts_per_step % dp:
        problems.append(f"--prompts-per-step={args.prompts_per_step} must be divisible by the data-parallel size {dp}")
    elif (args.prompts_per_step // dp * args.samples_per_prompt) % args.micro_batch_size:
        problems.append(f"each DP rank's {args.prompts_per_step // dp * args.samples_per_prompt} sequences must split "
                        f"into micro-batches of --micro-batch-size={args.micro_batch_size}")
    return problems


def load_configs(spec: str):
    """The validated sections of a mis.yaml (MIS engine, loss, LR schedule / monitor)."""
    from megatron_mis.config.sections import load_sections
    from megatron_mis.presets import preset_path

    path = Path(spec) if Path(spec).suffix in (".yaml", ".yml") else preset_path(spec)
    return load_sections(path)


# ---------------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace, device: torch.device):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,  # every TP layout draws the same full weights from the seed
        pipeline_dtype=torch.float32,
        variable_seq_lengths=True,  # packed micro-batches differ in length: the pipeline sends shapes
        moe_token_dispatcher_type="alltoall",  # (Megatron checks it with variable_seq_lengths, even when dense)
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )
    try:  # Transformer Engine: packed sequences and context parallelism on GPUs
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer_spec = get_gpt_layer_with_transformer_engine_spec() if device.type == "cuda" else None
    except ImportError:
        layer_spec = None
    if layer_spec is None:  # Megatron's local spec with a torch-SDPA core attention that takes packed sequences
        from megatron_mis.testing.cpu import cpu_gpt_layer_spec

        if device.type == "cuda" and dist.get_rank() == 0:
            print("note: Transformer Engine is not installed; using the torch-SDPA core attention "
                  "(pip install 'megatron-mis[gpu]' for Transformer Engine)", flush=True)
        layer_spec = cpu_gpt_layer_spec()
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=2 * args.digits + 2,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model.to(device)


# -------------------------------------------------------------------------------- rollout
def last_token_logits(model, sequences: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``[N, V]`` float32 logits at the last token of every sequence of ``sequences`` ``[N, L]``,
    from one forward-only pass of Megatron's schedule. Every TP / CP / PP rank calls it; the last
    pipeline stage returns the logits (identical on its TP and CP ranks), other stages ``None``.
    Under CP each rank runs its zigzag share; the rank holding a sequence's last token contributes
    its row to one SUM all-reduce over the CP group. The TP shards of the vocabulary are joined by
    one all-gather over the TP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.parallel.packing import pack_sequences

    n = sequences.shape[0]
    cp_group = ps.get_context_parallel_group()
    pack = pack_sequences(list(sequences), cp_size=cp_group.size(), cp_rank=cp_group.rank(), pad_token_id=PAD, device=device)
    seq_of_row = pack.sequence_ids.to(device)
    is_last = (seq_of_row < n) & (pack.position_ids[0] == pack.lengths.to(device)[seq_of_row.clamp_max(n - 1)] - 1)
    rows = torch.nonzero(is_last).flatten()
    captured: list[torch.Tensor] = []

    def forward_step(data_iterator, model_chunk):
        next(data_iterator)
        output = model_chunk(pack.tokens, pack.position_ids, None, packed_seq_params=pack.packed_seq_params)

        def loss_func(output_tensor):
            captured.append(output_tensor.reshape(-1, output_tensor.shape[-1])[rows].float())
            return output_tensor.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=pack.num_local_tokens, micro_batch_size=1, forward_only=True,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = torch.zeros(n, captured[0].shape[-1], device=device)
    local[seq_of_row[rows]] = captured[0]
    if cp_group.size() > 1:
        dist.all_reduce(local, group=cp_group)
    tp_group = ps.get_tensor_model_parallel_group()
    if tp_group.size() > 1:
        shards = [torch.empty_like(local) for _ in range(tp_group.size())]
        dist.all_gather(shards, local, group=tp_group)
        local = torch.cat(shards, dim=-1)
    return local


@torch.no_grad()
def generate(model, prompts: torch.Tensor, *, new_tokens: int, dtype: str, generator: torch.Generator,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` tokens after every prompt (temperature 1) in rollout precision.

    Returns ``(responses [N, new_tokens], log_probs [N, new_tokens])`` on every rank: the last
    pipeline stage samples and records log pi_rollout from its low-precision logits, then
    broadcasts both over the pipeline group."""
    from megatron.core import parallel_state as ps

    autocast = (torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
                if dtype != "fp32" else contextlib.nullcontext())
    sequences = prompts.to(device)
    n = prompts.shape[0]
    responses = torch.zeros(n, new_tokens, dtype=torch.long, device=device)
    log_probs = torch.zeros(n, new_tokens, device=device)
    for t in range(new_tokens):
        with autocast:
            logits = last_token_logits(model, sequences, device)
        if logits is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)
            token = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(device)
            responses[:, t] = token[:, 0]
            log_probs[:, t] = logp.gather(1, token)[:, 0]
        if ps.get_pipeline_model_parallel_world_size() > 1:  # the earlier stages need the sampled token
            column = torch.stack([responses[:, t].double(), log_probs[:, t].double()])
            dist.broadcast(column, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
            responses[:, t] = column[0].long()
            log_probs[:, t] = column[1].float()
        sequences = torch.cat([sequences, responses[:, t : t + 1]], dim=1)
    return responses, log_probs


# ----------------------------------------------------------------------------------- main
def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(f"error: {name} is not set; launch with torchrun, e.g. "
                         "torchrun --standalone --nproc-per-node 2 examples/megatron/train_grpo.py --tp 2")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    problems = check_args(args, world)
    try:
        configs = load_configs(args.mis_config)
    except (ValueError, FileNotFoundError, KeyError) as exc:  # ConfigError is a ValueError
        problems.append(str(exc))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if use_cuda and not torch.cuda.is_available():
        problems.append("--device=cuda but CUDA is not available here (torch.cuda.is_available() is False); use --device cpu")
    elif use_cuda and torch.cuda.device_count() < local_world:
        problems.append(f"{local_world} processes on this node but {torch.cuda.device_count()} visible GPU(s) with "
                        f"--device={args.device}: nccl needs one GPU per rank; start at most "
                        f"{torch.cuda.device_count()} per node, or use --device cpu")
    if problems:
        # every rank says it: torchrun stops the others as soon as one rank exits, so a message
        # printed by rank 0 alone was lost whenever another rank exited first
        print(f"error (rank {rank}): " + "\n       ".join(problems), file=sys.stderr, flush=True)
        return 2

    if use_cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    if use_cuda:
        shims = contextlib.nullcontext()
    else:
        from megatron_mis.testing.cpu import cpu_compat

        shims = cpu_compat()
    try:
        with shims:
            train(args, configs, device)
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, configs: dict, device: torch.device) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_mis.core.advantages import compute_advantages_from_config
    from megatron_mis.integrations.megatron import (
        LengthDecayParamScheduler, MegatronRLLoss, MismatchMonitor, RLMicroBatch, build_lr_schedule,
        global_mean_response_length,
    )

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 context_parallel_size=args.cp)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    reporter = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
    if dist.get_rank() == 0:
        print(f"TP={args.tp} CP={args.cp} PP={args.pp} DP={dp_size}: {dist.get_world_size()} process(es) on "
              f"{dist.get_backend()}; rollouts in {args.rollout_dtype}, mis-config {args.mis_config}", flush=True)

    model = build_model(args, device)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False), model
    )
    model.config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce, PP embedding grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=0.0, clip_grad=args.clip_grad,
                        bf16=False, fp16=False, use_distributed_optimizer=False),
        [ddp],
    )
    schedule_cfg = configs["lr_schedule"]
    scheduler = LengthDecayParamScheduler(
        OptimizerParamScheduler(optimizer, init_lr=args.lr, max_lr=args.lr, min_lr=args.lr, lr_warmup_steps=0,
                                lr_decay_steps=args.steps, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                wd_incr_steps=1, wd_incr_style="constant"),
        build_lr_schedule(schedule_cfg.decay, schedule_cfg.surge),
    )
    monitor = MismatchMonitor(schedule_cfg.monitor, schedule_cfg.surge, sinks=[]) if reporter else None
    rl = MegatronRLLoss(configs["loss"], configs["mis"])
    forward_backward = get_forward_backward_func()

    # the same prompts and draws on every TP / CP / PP rank of one data-parallel replica
    g_prompts = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank)
    g_sample = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank + 500_009)
    local_prompts = args.prompts_per_step // dp_size
    if reporter:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text("")

    for step in range(1, args.steps + 1):
        # ---- 1. rollout (this DP rank's share of the global batch)
        prompts = sample_prompts(local_prompts, args.digits, g_prompts).repeat_interleave(args.samples_per_prompt, dim=0)
        ddp.eval()
        responses, rollout_lp = generate(ddp, prompts, new_tokens=args.digits, dtype=args.rollout_dtype,
                                         generator=g_sample, device=device)
        ddp.train()
        responses, rollout_lp = responses.cpu(), rollout_lp.cpu()

        # ---- 2. reward and GRPO advantages (groups never straddle DP ranks)
        rewards = copy_rewards(prompts, responses)
        advantages = compute_advantages_from_config(rewards, configs["loss"], group_size=args.samples_per_prompt).advantages

        # ---- 3. micro-batches of whole packed sequences; pi_old recomputed in fp32
        sequences = torch.cat([prompts, responses], dim=1)
        n, length = sequences.shape
        batches = []
        for lo in range(0, n, args.micro_batch_size):
            idx = slice(lo, lo + args.micro_batch_size)
            m = sequences[idx].shape[0]
            batches.append(RLMicroBatch(
                tokens=sequences[idx].reshape(-1),
                cu_seqlens=torch.arange(0, (m + 1) * length, length, dtype=torch.int32),
                response_lengths=torch.full((m,), args.digits),
                loss_mask=torch.ones(m * args.digits),
                advantages=advantages[idx].repeat_interleave(args.digits),
                rollout_log_probs=rollout_lp[idx].reshape(-1),
                pad_token_id=PAD,
            ))
        old = rl.recompute_log_probs([ddp], batches)
        if old is not None:  # last pipeline stage: the loss runs here
            batches = [b.with_old_log_probs(o.cpu()) for b, o in zip(batches, old)]
            gap = torch.cat([(b.old_log_probs - b.rollout_log_probs).abs() for b in batches]).max().reshape(1)
        else:
            gap = torch.zeros(1)
        gap = gap.to(device)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)  # the worst |log pi_old - log pi_rollout| in the job

        # ---- 4. learning rate from the global mean response length (length-decay schedule)
        mean_length = global_mean_response_length([args.digits] * n, group=ps.get_data_parallel_group(), device=device)
        scheduler.observe(step, mean_length)

        # ---- 5. one update: Megatron's schedule, DDP and optimizer with the MIS-corrected loss
        den = rl.count_denominators(batches)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(
            forward_step_func=rl.forward_step(den, num_microbatches=len(batches)), data_iterator=iter(batches),
            model=[ddp], num_microbatches=len(batches), seq_length=max(int(b.tokens.numel()) for b in batches),
            micro_batch_size=1, forward_only=False,
        )
        metrics = rl.reduce_metrics(store, den) if old is not None else {}
        _, grad_norm, _ = optimizer.step()
        scheduler.step(1)

        # ---- 6. report: reward over the whole job, the mismatch, the monitor
        reward = torch.stack([rewards.mean(), (rewards == 1).float().mean()]).to(device)
        dist.all_reduce(reward)
        reward = (reward / dist.get_world_size()).tolist()  # every rank holds its replica's batch: a plain mean
        if reporter:
            record = {"step": step, "reward_mean": reward[0], "accuracy": reward[1], "logprob_abs_diff_max": float(gap),
                      "grad_norm": float(grad_norm), "lr": optimizer.param_groups[0]["lr"], **metrics}
            watched = ("mis_k3_kl", "mis_log_ppl_abs_diff", "grad_norm", "lr", "entropy")
            warnings = monitor.update(step, {k: record.get(k) for k in watched} | {"response_length": mean_length})
            record["monitor_warnings"] = [w.message for w in warnings]
            with args.metrics.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step:4d}  reward {reward[0]:.3f}  k3 {record.get('mis_k3_kl', float('nan')):.2e}  "
                  f"|dlogp| max {float(gap):.2e}  grad norm {float(grad_norm):.3f}", flush=True)
            for w in warnings:
                print(f"  monitor: {w.message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
