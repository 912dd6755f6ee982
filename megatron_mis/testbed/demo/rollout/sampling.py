"""Sampling helpers of the rollout engine: top-k / top-p filtering, multinomial draws, prompt
checks."""

from __future__ import annotations

from typing import Any

import torch

from megatron_mis.testbed.demo.rollout.config import RolloutConfig

__all__ = ["_draw", "_filter", "_sample", "_as_prompt", "processed_log_probs"]


def _filter(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude from ``logp [B, V]``."""
    if top_k and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_lp.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp


def processed_log_probs(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logp [B, V]`` -> the log-probs of the distribution top-k / top-p sampling draws from:
    the kept tokens renormalised (``log_softmax`` of the filtered row), ``-inf`` elsewhere."""
    return torch.log_softmax(_filter(logp, top_k, top_p), dim=-1)


def _draw(filtered: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, V]`` log-probs already filtered by :func:`_filter` -> ``[B]`` int64 sampled ids."""
    return torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)


def _sample(logp: torch.Tensor, config: RolloutConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``logp [B, V]`` float32 -> ``[B]`` int64 sampled ids."""
    return _draw(_filter(logp, config.top_k, config.top_p), generator)


def _as_prompt(p: Any, vocab: int) -> torch.Tensor:
    t = (p if isinstance(p, torch.Tensor) else torch.as_tensor(p)).detach().to("cpu", torch.long).flatten()
    if t.numel() == 0:
        raise ValueError("prompts must hold at least one token")
    if int(t.min()) < 0 or int(t.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got [{int(t.min())}, {int(t.max())}]")
    return t


