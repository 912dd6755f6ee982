"""Writers of the dump formats ``megatron-mis analyze`` reads, for tests.

Each follows the host's documented structure (slime ``docs/en/developer_guide/debug.md`` and
``slime/observability/train_data_utils.py``; Miles ``miles/utils/train_dump_utils.py``); no host
code is copied. The context-parallel slicing below is written from the zigzag description
(DESIGN section 3), independently of ``megatron_mis.parallel.layout`` which the reader uses, so
a round trip checks one against the other.

A sample is a dict ``{"train": [R] tensor, "rollout": [R] tensor, "mask": [R] tensor,
"prompt_length": int}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def make_samples(
    num: int, response_length: int | list[int], sigma: float, *, seed: int = 0, prompt_length: int = 5, mask_holes: bool = True
) -> list[dict]:
    """``num`` samples whose trainer log-probs differ from the rollout's by N(0, sigma^2)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [response_length] * num if isinstance(response_length, int) else list(response_length)
    out = []
    for i, length in enumerate(lengths):
        p = torch.rand(length, generator=g, dtype=torch.float64) * 0.95 + 0.01
        rollout = torch.log(p).to(torch.float32)
        train = (rollout.double() + sigma * torch.randn(length, generator=g, dtype=torch.float64)).clamp(max=0).to(torch.float32)
        mask = torch.ones(length, dtype=torch.int32)
        if mask_holes and length > 3:
            mask[1] = 0  # a multi-turn hole
        out.append({"train": train, "rollout": rollout, "mask": mask, "prompt_length": prompt_length + i % 3})
    return out


# ------------------------------------------------------------------------- megatron-mis formats
def write_jsonl(path: Path, samples: list[dict], rollout_id: int | None = None) -> Path:
    with open(path, "w") as fh:
        for s in samples:
            row = {
                "train_log_probs": s["train"].tolist(),
                "rollout_log_probs": s["rollout"].tolist(),
                "loss_mask": s["mask"].tolist(),
            }
            if rollout_id is not None:
                row["rollout_id"] = rollout_id
            fh.write(json.dumps(row) + "\n")
    return path


def write_pt(path: Path, samples: list[dict], rollout_id: int | None = None) -> Path:
    data = {
        "train_log_probs": [s["train"] for s in samples],
        "rollout_log_probs": [s["rollout"] for s in samples],
        "loss_masks": [s["mask"] for s in samples],
    }
    if rollout_id is not None:
        data["rollout_id"] = rollout_id
    torch.save(data, path)
    return path


# ------------------------------------------------------------------------------------- slime
def _columns(samples: list[dict], indices: list[int]) -> dict:
    """The per-sample columns slime's trainer keeps in ``rollout_data`` (full responses)."""
    cols: dict = {
        "tokens": [], "response_lengths": [], "total_lengths": [], "loss_masks": [], "log_probs": [],
        "rollout_log_probs": [], "advantages": [], "rewards": [], "sample_indices": [],
    }
    for i in indices:
        s = samples[i]
        r = int(s["train"].numel())
        total = s["prompt_length"] + r
        cols["tokens"].append(torch.arange(total) % 97)
        cols["response_lengths"].append(r)
        cols["total_lengths"].append(total)
        cols["loss_masks"].append(s["mask"].to(torch.int32))
        cols["log_probs"].append(s["train"])
        cols["rollout_log_probs"].append(s["rollout"])
        cols["advantages"].append(torch.full((r,), 0.5))
        cols["rewards"].append(1.0)
        cols["sample_indices"].append(1000 + i)
    return cols


def write_slime_v2(path: Path, samples: list[dict], rollout_id: int, *, dp_size: int = 2) -> Path:
    """slime's ``--save-debug-train-data`` payload, format_version 2: one file per rollout (the DP
    source rank gathers every DP shard), ``samples`` sorted by rollout position."""
    n = len(samples)
    shards = [list(range(d, n, dp_size)) for d in range(dp_size)]
    flat, layout = [], []
    for d, idx in enumerate(shards):
        cols = _columns(samples, idx)
        indices = cols.pop("sample_indices")
        layout.append({"rank": d * 4, "data_parallel_rank": d, "sample_indices": indices, "partition": idx,
                       "micro_batch_indices": [[list(range(len(idx)))]], "num_microbatches": [1], "global_batch_sizes": [n]})
        for j, pos in enumerate(idx):
            sample = {"data_parallel_rank": d, "sample_index": indices[j], "rollout_position": pos}
            sample.update({k: v[j] for k, v in cols.items()})
            flat.append(sample)
    flat.sort(key=lambda s: s["rollout_position"])
    torch.save({"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": flat, "dp_shards": layout,
                "raw_reward": [1.0] * n}, path)
    return path


def write_slime_legacy(directory: Path, samples: list[dict], rollout_id: int, *, dp_size: int = 2, tp_size: int = 2,
                       pp_size: int = 1) -> list[Path]:
    """Older slime: every rank writes ``{rollout_id}_{rank}.pt`` = ``{rollout_id, rank,
    rollout_data}`` with its DP shard; TP ranks write copies; pipeline stages other than the last
    have no ``log_probs``. Rank order: tp fastest, then dp, then pp."""
    n = len(samples)
    paths = []
    for pp in range(pp_size):
        for d in range(dp_size):
            cols = _columns(samples, list(range(d, n, dp_size)))
            if pp != pp_size - 1:
                del cols["log_probs"]
            for t in range(tp_size):
                rank = t + tp_size * (d + dp_size * pp)
                path = directory / f"{rollout_id}_{rank}.pt"
                torch.save({"rollout_id": rollout_id, "rank": rank, "rollout_data": cols}, path)
                paths.append(path)
    return paths


# ------------------------------------------------------------------------------------- Miles
def zigzag_piece(values: torch.Tensor, total_length: int, cp_size: int, cp_rank: int, chunk_base: int | None = None) -> torch.Tensor:
    """The response values rank ``cp_rank`` holds: response token j sits at logit position
    ``prompt - 1 + j``; chunks of ``ceil(base / (2 cp))`` positions, rank r holds chunks r and
    2cp-1-r (``base`` = total length for thd, the padded max length for bshd)."""
    r = int(values.numel())
    prompt = total_length - r
    base = total_length if chunk_base is None else chunk_base
    chunk = math.ceil(base / (2 * cp_size))
    picked = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo, hi = c * chunk, (c + 1) * chunk
        picked += [j for j in range(r) if lo <= prompt - 1 + j < hi]
    return values[torch.tensor(picked, dtype=torch.long)] if picked else values[:0]


def write_miles(directory: Path, samples: list[dict], rollout_id: int, *, cp_size: int = 2, tp_size: int = 1,
                dp_size: int = 1, qkv_format: str = "thd") -> list[Path]:
    """Miles' ``--save-debug-train-data``: ``{rollout_id, rank, rollout_data, cp_rank, cp_size,
    qkv_format}`` per rank; per-token train fields are this CP rank's piece, masks full length.
    Rank order: tp fastest, then cp, then dp."""
    n = len(samples)
    paths = []
    for d in range(dp_size):
        full = _columns(samples, list(range(d, n, dp_size)))
        max_len = max(full["total_lengths"]) if full["total_lengths"] else 0
        if qkv_format == "bshd":
            full["max_seq_lens"] = [max_len] * len(full["total_lengths"])
        for c in range(cp_size):
            cols = dict(full)
            for key in ("log_probs", "rollout_log_probs", "advantages"):
                cols[key] = [
                    zigzag_piece(v, tl, cp_size, c, max_len if qkv_format == "bshd" else None)
                    for v, tl in zip(full[key], full["total_lengths"])
                ]
            for t in range(tp_size):
                rank = t + tp_size * (c + cp_size * d)
                path = directory / f"{rollout_id}_{rank}.pt"
                torch.save({"rollout_id": rollout_id, "rank": rank, "rollout_data": cols, "cp_rank": c,
                            "cp_size": cp_size, "qkv_format": qkv_format}, path)
                paths.append(path)
    return paths


# -------------------------------------------------------------------------------------- verl
def write_verl_generations(path: Path, num: int = 3, step: int = 1) -> Path:
    """verl's ``trainer.rollout_data_dir`` JSONL (``{global_steps}.jsonl``): text and scores only."""
    with open(path, "w") as fh:
        for i in range(num):
            fh.write(json.dumps({"input": f"q{i}", "output": f"a{i}", "gts": "x", "score": 1.0, "step": step}) + "\n")
    return path
