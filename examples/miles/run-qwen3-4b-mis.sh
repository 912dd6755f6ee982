#!/bin/bash
# Miles + megatron-mis: GRPO on Qwen3-4B with mismatch correction, global self-normalisation and
# the length-decay learning rate.
#
# Prerequisites, inside Miles' container on every node:
#   pip install "megatron-mis[gpu]"        (or `pip install -e .` from a megatron-mis checkout)
#   cd "${MILES_DIR}" && git checkout 31f1ca961a94cb860cec3b2dea34ec332bfa8f76   # the commit the patches name
#   git apply /path/to/megatron-mis/patches/miles-31f1ca96-length-decay.patch           # first:
#   git apply /path/to/megatron-mis/patches/miles-31f1ca96-global-mis-normalizer.patch  # its line numbers count the first's
# Miles calls its rollout-data hook without the data, so the two once-per-rollout tasks (the
# global normalisation mean, the response length for the LR schedule) need these small patches;
# the TIS function itself needs no patch. Everything megatron-mis adds is in MIS_ARGS.

set -ex
export PYTHONUNBUFFERED=1

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
MILES_DIR="${MILES_DIR:-/root/miles}"
MODEL_ARGS_LINE="$(python3 "${MILES_DIR}/miles/utils/external_utils/model_args_utils.py" "qwen3-4B")" || exit 1
read -ra MODEL_ARGS <<< "${MODEL_ARGS_LINE}"

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-4B
   --ref-load /root/Qwen3-4B_torch_dist
   --save /root/Qwen3-4B_miles_mis/
   --save-interval 200
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
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 2
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
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
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.7
)

MIS_ARGS=(
   # Decoupled 3-policy PPO: Miles recomputes pi_old and the IS weight pi_old / pi_rollout
   # corrects the rollout engine's numerics (--use-rollout-logprobs would be bypass mode).
   --use-tis
   # IS / RS / veto / normalisation keys plus the LR-schedule and monitor keys, validated on first use.
   --custom-config-path "${SCRIPT_DIR}/mis.yaml"
   # Miles passes its ParallelState and max_seq_lens (bshd); the function reads the CP group from
   # it and never reduces over the WORLD group.
   --custom-tis-function-path megatron_mis.compute_mis_weights_with_cp
   # For a MoE model add rollout routing replay (R3): SGLang returns its experts, the trainer
   # replays them. megatron-mis' RoutingReplay is described in docs/routing_replay.md.
   # --use-rollout-routing-replay
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

# Check the YAML, and what it does on Miles with these flags (exit 2 on any error):
megatron-mis validate --host miles --host-flags="$(printf '%q ' "${MIS_ARGS[@]}")" "${SCRIPT_DIR}/mis.yaml"

export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus 8 --disable-usage-stats

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' \
   -- python3 "${MILES_DIR}/train.py" \
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
