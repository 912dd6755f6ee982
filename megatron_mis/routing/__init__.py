"""Rollout routing replay (R3) for MoE experts: rollout-side decoding, slicing, replay in Megatron."""
