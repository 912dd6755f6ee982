"""Megatron-Core models that run on CPU: shims, SDPA core attention, layer specs, builders."""
