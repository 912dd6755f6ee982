#!/bin/bash
# slime + megatron-mis: GRPO on Qwen3-30B-A3B (MoE) with mismatch correction, rollout routing
# replay, global self-normalisation and the length-decay learning rate.
#
# Prerequisites, inside slime's container on every node:
#   pip install torch==<your CUDA build> && pip install "megatron-mis[gpu]"   (or `pip install -e .` here)
# and slime's usual checkpoints / data (the paths below follow slime's own examples).
# Everything megatron-mis adds is in MIS_ARGS; the rest is a standard slime launch.

set -ex
export PYTHONUNBUFFERED=1

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
SLIME_DIR="${SLIME_DIR:-/root/slime}"
source "${SLIME_DIR}/scripts/models/qwen3-30B-A3B.sh"   # defines MODEL_ARGS

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-30B-A3B
   --ref-load /root/Qwen3-30B-A3B_torch_dist
   --save /root/Qwen3-30B-A3B_slime_mis/
   --save-interval 50
)

ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 2
   --expert-model-parallel-size 8
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 20480
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --eps-clip 0.2
   --eps-clip-high 0.28
   --entropy-coef 0.00
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 8
   --sglang-mem-fraction-static 0.7
)

MIS_ARGS=(
   # Decoupled 3-policy PPO: the trainer recomputes pi_old; the IS weight pi_old / pi_rollout
   # corrects the rollout engine's numerics. (Add --use-rollout-logprobs instead for bypass mode:
   # then pi_old := pi_rollout and only rejection / vetoes act.)
   --use-tis
   # 32 prompts x 8 samples = one global batch of 256: one optimizer step per rollout, so slime would
   # reuse the training forward's log-probs as pi_old (can_reuse_log_probs_in_loss, actor.py:461-475)
   # and rollout_data would hold no pi_old when the global normalisation mean is taken before
   # training. This flag keeps the pi_old recompute (one more forward pass per rollout) and adds the
   # mismatch metrics; without it, use tis_batch_normalize_scope: micro_batch in mis.yaml.
   --get-mismatch-metrics
   # The IS / RS / veto / normalisation settings, and the LR-schedule and monitor keys.
   --custom-config-path "${SCRIPT_DIR}/mis.yaml"
   # The megatron-mis TIS function: exact under tensor and context parallelism (one all-gather of
   # per-sample statistics per micro-batch), full-length masks on every CP rank, mis_* metrics.
   --custom-tis-function-path megatron_mis.compute_mis_weights_with_cp
   # Once per rollout, after pi_old is recomputed: the global self-normalisation mean
   # (tis_batch_normalize_scope: global) and the rollout's mean response length for the
   # length-decay schedule and the monitor.
   --rollout-data-postprocess-path megatron_mis.integrations.slime.rollout_data_postprocess
   # Before every optimizer step: apply the length-decay learning rate to slime's scheduler.
   # (For exact resume and decayed LR in slime's own logs, apply
   # patches/slime-624b824a-length-decay.patch instead of this hook.)
   --custom-megatron-before-train-step-hook-path megatron_mis.integrations.slime.before_train_step
   # Rollout routing replay (R3): SGLang returns the experts it chose and the trainer's routers
   # replay them (slime turns on --enable-return-routed-experts in SGLang for this). megatron-mis'
   # own RoutingReplay (compact uint8 routes, per-rank shards, schedule-safe backward replay) needs
   # a small change in slime's actor, described in docs/routing_replay.md.
   --use-rollout-routing-replay
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

# Check the YAML, and what it does on slime with these flags (exit 2 on any error):
megatron-mis validate --host slime --host-flags="$(printf '%q ' "${MIS_ARGS[@]}")" "${SCRIPT_DIR}/mis.yaml"

export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus 8 --disable-usage-stats

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' \
   -- python3 "${SLIME_DIR}/train.py" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 8 \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MIS_ARGS[@]}" \
   "${MISC_ARGS[@]}"
