"""GRPO with plain Megatron-Core and megatron-mis: the ``megatron-mis demo`` engine, launched by
torchrun (one process per GPU, or per CPU slot on gloo), multi-node ready.

Two nodes with 8 GPUs each (TP=2, CP=2, so PP=1 and DP = 16 / 4 = 4); run on every node, with
NODE_RANK 0 and 1 and MASTER_ADDR the address of node 0::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --master-addr $MASTER_ADDR --master-port 29500 \\
        examples/megatron/train_grpo.py --tp 2 --cp 2 --steps 150 --correction token_tis \\
        --prompts-per-step 32 --micro-batch-size 8 --name grpo_2x8

One machine, CPU only (gloo), two processes::

    torchrun --standalone --nproc-per-node 2 examples/megatron/train_grpo.py --tp 2 --steps 20

What it does: reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the
environment torchrun sets, initialises ``torch.distributed`` (nccl when CUDA is available, else
gloo), sets up Megatron-Core's parallel state with the given TP / CP / PP sizes (the rest of the
world is data parallel), and runs :func:`megatron_mis.testbed.demo.train.run_rank`: rollouts from a
separate engine (``--rollout-precision``; ``--true-on-policy`` for bitwise-equal log-probs),
rewards, GRPO advantages, the fp32 pi_old recompute through Megatron's schedule, and
:class:`megatron_mis.integrations.megatron_loss.MegatronRLLoss` updates with Megatron's DDP
(decoupled PPO with the chosen mis.yaml preset). The reporting rank (last pipeline stage, first
TP / DP / CP rank) writes ``OUT_DIR/NAME/metrics.jsonl``, ``report.png`` and ``summary.json``.

Every flag of ``megatron-mis demo`` is accepted (``--help``) except ``--dp``, which follows from
the world size. On GPUs the trainer runs on ``cuda:LOCAL_RANK`` and the (tiny) rollout engine on
the CPU. The flags are validated before any process group is created.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_mis.cli.demo import add_arguments

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (and docs/demo.md) for the multi-node command.",
    )
    add_arguments(parser, exclude=("dp",))
    return parser.parse_args(argv)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(
            f"error: {name} is not set; launch with torchrun, e.g. "
            "torchrun --standalone --nproc-per-node 2 examples/megatron/train_grpo.py --tp 2"
        )
    return int(value)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex|cuda_graph_scope|CUDA_DEVICE_MAX).*")
    args = parse_args(argv)
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    from megatron_mis.config import ConfigError
    from megatron_mis.testbed.demo.config import available_cpus

    model_parallel = getattr(args, "tp", 1) * getattr(args, "cp", 1) * getattr(args, "pp", 1)
    if world % model_parallel:
        print(f"error: WORLD_SIZE={world} is not a multiple of tp x cp x pp = {model_parallel}", file=sys.stderr)
        return 2
    threads = getattr(args, "threads", None) or max(1, available_cpus() // local_world)
    from megatron_mis.cli.demo import build_config

    try:
        cfg = build_config(args, dp=world // model_parallel, threads=threads)
    except ConfigError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(cfg.num_threads)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    try:
        from megatron_mis.cli.demo import describe, report
        from megatron_mis.testbed.demo.train import run_rank
        from megatron_mis.testbed.models.cpu import cpu_compat

        if rank == 0:
            print(describe(cfg).replace("on gloo", "on nccl" if use_cuda else "on gloo"), flush=True)
        with (contextlib.nullcontext() if use_cuda else cpu_compat()):
            results = run_rank(cfg)
        if results is not None:  # the reporting rank
            report(cfg, results)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
