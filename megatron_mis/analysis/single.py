"""One batch of samples, analysed as a whole: the report ``megatron-mis analyze`` prints for a
single file or the built-in sample (:func:`load_samples`, :func:`analyze`, :func:`format_report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import MISResult, compute_mis_from_lists
from megatron_mis.core.metrics import METRIC_DOCS

__all__ = ["LogProbSamples", "analyze", "format_report", "load_samples"]


@dataclass
class LogProbSamples:
    """Per-sample log-probs (each list has one 1-D float tensor per sample)."""

    train_log_probs: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    source: str

    @property
    def num_samples(self) -> int:
        return len(self.train_log_probs)

    @property
    def num_tokens(self) -> int:
        return int(sum(int(t.numel()) for t in self.train_log_probs))


def load_samples(path: str | Path, format: str = "auto", *, trust_pickle: bool = False) -> LogProbSamples:
    """Every sample of one file (any format of :data:`megatron_mis.analysis.readers.FORMATS`),
    as one batch.

    Raises:
        DumpError (a ValueError): naming the file, the sample / line and the field.
    """
    from megatron_mis.analysis.readers import DumpError, DumpReader

    reader = DumpReader(format, trust_pickle=trust_pickle)
    batches = reader.read(path)
    _, errors = reader.finish()
    if errors:
        raise errors[0]
    if not batches:
        raise DumpError(path, "no sample left to analyse")
    return LogProbSamples(
        [t for b in batches for t in b.train_log_probs],
        [t for b in batches for t in b.rollout_log_probs],
        [t for b in batches for t in b.loss_masks],
        source=str(path),
    )


def analyze(samples: LogProbSamples, config: MISConfig | None = None) -> MISResult:
    """Run the engine over all samples as one batch."""
    from megatron_mis.analysis.history import analysis_config

    return compute_mis_from_lists(
        samples.train_log_probs, samples.rollout_log_probs, samples.loss_masks, analysis_config(config or MISConfig())
    )


_MISMATCH_KEYS = (
    "mis_k3_kl", "mis_kl", "mis_log_ppl_abs_diff", "mis_log_ppl_diff", "mis_training_log_ppl", "mis_rollout_log_ppl",
    "mis_ppl_ratio", "mis_chi2_token", "mis_chi2_seq", "mis_tv", "mis_ess_token", "mis_ess_seq",
    "mis_nonfinite_token_fraction",
)


def format_report(samples: LogProbSamples, result: MISResult, config: MISConfig, config_source: str) -> str:
    """The human-readable report of one batch."""
    s = result.scalars()
    lines = [
        "megatron-mis mismatch report",
        f"  data:   {samples.source}",
        f"  batch:  {samples.num_samples} samples, {samples.num_tokens} tokens, {int(s['num_loss_tokens'])} in the loss mask",
        f"  config: {config_source}",
        "",
        "Mismatch (rollout vs training log-probs)",
    ]
    for key in _MISMATCH_KEYS:
        if key in s:
            lines.append(f"  {key:<30} {fmt(s[key]):>12}   {METRIC_DOCS.get(key, '')}")
    lines += ["", "What this configuration does"]
    action_keys = [k for k in s if k.startswith(("mis_tis_", "mis_rs_", "mis_prob_veto", "mis_rejected", "mis_weight_", "mis_batch_norm"))]
    action_keys += ["num_kept_tokens", "num_kept_sequences"]
    for key in action_keys:
        if key in s:
            lines.append(f"  {key:<34} {fmt(s[key]):>12}   {METRIC_DOCS.get(key, '')}")
    lines += ["", "Mismatch by rollout-probability bucket (When Speed Kills Stability (docs/references.md): it grows as probabilities approach 0)",
              f"  {'p_rollout bucket':<22} {'tokens':>8} {'mean |log r|':>14} {'mean k3':>12}"]
    table = result.bucket_table
    edges = table["edges"].tolist()
    for i in range(len(edges) - 1):
        label = f"[{edges[i]:g}, {edges[i + 1]:g}{']' if i == len(edges) - 2 else ')'}"
        lines.append(
            f"  {label:<22} {int(table['num_tokens'][i]):>8} {fmt(float(table['mean_abs_log_ratio'][i])):>14} "
            f"{fmt(float(table['mean_k3'][i])):>12}"
        )
    return "\n".join(lines)


def fmt(value: float | int | None) -> str:
    """A number for a terminal table: 4 decimals in [1e-3, 1e5), else scientific; ``-`` for None."""
    if value is None:
        return "-"
    value = float(value)
    if value == 0 or (1e-3 <= abs(value) < 1e5):
        return f"{value:.4f}"
    if math.isfinite(value):
        return f"{value:.3e}"
    return str(value)
