"""The end-to-end demo: a GRPO run on Megatron-Core with a separate, mismatched rollout engine."""
