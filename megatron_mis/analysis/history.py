"""The mismatch over training: one row per rollout id, accumulated file by file.

Each file's samples go through the MIS engine (:func:`megatron_mis.core.engine.compute_mis_from_lists`)
once per configuration; from its outputs only per-row sums, counts, extrema and bounded
histograms are kept (:class:`RowAccumulator`), so a directory larger than memory is analysed one
file at a time and rows spread over several files (per-rank dumps) merge exactly:

- means (K3, TV, log-ppl gap, chi-square) from sums and counts, with the engine's denominators
  (token metrics over loss-mask tokens, sequence metrics over sequences with loss-mask tokens);
- ESS from ``sum r`` and ``sum r^2`` (token) and from the sequence ratios (sequence);
- the K3 p99 from a sparse log-spaced histogram with :data:`K3_BINS_PER_DECADE` bins per decade
  (the reported value is the geometric centre of its bin: within 1.2% of the exact quantile);
- the mismatch by rollout-probability bucket from per-bucket counts and sums.

:func:`replay_monitor` replays the mismatch monitor's warnings and Beyond Precision (arXiv:2602.01826)'s length-surge
detector over the finished rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import DEFAULT_PROB_BUCKET_EDGES, MISResult, compute_mis_from_lists

__all__ = [
    "ConfigAccumulator",
    "K3_BINS_PER_DECADE",
    "LogHistogram",
    "RATIO_EDGES",
    "RowAccumulator",
    "analysis_config",
    "process_batch",
    "replay_monitor",
]

#: K3 histogram resolution (bins per decade of log10 K3).
K3_BINS_PER_DECADE = 100
#: log10 edges of the IS-weight histograms: 10^-4 .. 10^4 in 0.05 steps, plus under / overflow.
RATIO_EDGES = torch.linspace(-4.0, 4.0, 161, dtype=torch.float64)


class LogHistogram:
    """A sparse histogram of non-negative values on a log10 grid (``bins_per_decade`` bins per
    decade) plus a count of exact zeros. Memory grows with the number of occupied bins only."""

    __slots__ = ("bins_per_decade", "counts", "zeros", "total")

    def __init__(self, bins_per_decade: int = K3_BINS_PER_DECADE) -> None:
        self.bins_per_decade = bins_per_decade
        self.counts: dict[int, int] = {}
        self.zeros = 0
        self.total = 0

    def add(self, values: torch.Tensor) -> None:
        """Add ``[n]`` values >= 0 (non-finite ones are ignored: they carry no quantile)."""
        values = values.to(torch.float64).reshape(-1)
        values = values[torch.isfinite(values)]
        if values.numel() == 0:
            return
        positive = values[values > 0]
        self.zeros += int(values.numel() - positive.numel())
        self.total += int(values.numel())
        if positive.numel():
            idx = torch.floor(torch.log10(positive) * self.bins_per_decade).to(torch.int64)
            uniq, cnt = torch.unique(idx, return_counts=True)
            for i, c in zip(uniq.tolist(), cnt.tolist()):
                self.counts[i] = self.counts.get(i, 0) + c

    def merge(self, other: "LogHistogram") -> None:
        self.zeros += other.zeros
        self.total += other.total
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank); ``None`` when empty, 0 when it falls on the zeros."""
        if self.total == 0:
            return None
        rank = max(1, math.ceil(q * self.total))
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return 10.0 ** ((i + 0.5) / self.bins_per_decade)
        return 10.0 ** ((max(self.counts) + 0.5) / self.bins_per_decade)  # pragma: no cover


def analysis_config(config: MISConfig) -> MISConfig:
    """``config`` for offline analysis: a global self-normalisation scope becomes the per-call
    scope, since a file (one rollout) is analysed as one batch — the step the global mean is over."""
    if config.normalizes and config.tis_batch_normalize_scope == "global":
        return dataclasses.replace(config, tis_batch_normalize_scope="micro_batch")
    return config


@dataclass
class ConfigAccumulator:
    """What one configuration does to a row: kept / rejected / vetoed counts and the final weights
    of the kept tokens (sum, sum of squares, extrema)."""

    num_loss_tokens: int = 0
    num_kept_tokens: int = 0
    num_sequences: int = 0  # sequences with loss-mask tokens
    num_kept_sequences: int = 0
    num_vetoed_sequences: int = 0
    sum_w: float = 0.0
    sum_w2: float = 0.0
    w_min: float = math.inf
    w_max: float = -math.inf

    def merge(self, other: "ConfigAccumulator") -> None:
        for f in ("num_loss_tokens", "num_kept_tokens", "num_sequences", "num_kept_sequences", "num_vetoed_sequences", "sum_w", "sum_w2"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.w_min = min(self.w_min, other.w_min)
        self.w_max = max(self.w_max, other.w_max)

    def summary(self) -> dict[str, float | int | None]:
        """``kept_*``, ``rejected_*``, ``vetoed_seq_fraction``, ``ess`` (of the kept tokens' final
        weights), ``weight_min`` / ``weight_max`` and ``effective_sample_share`` = (sum w)^2 /
        (num_loss_tokens x sum w^2): the effective number of samples as a share of all loss tokens
        (ESS x kept share)."""
        n, k = self.num_loss_tokens, self.num_kept_tokens
        ess = self.sum_w**2 / (k * self.sum_w2) if k and self.sum_w2 > 0 else None
        share = self.sum_w**2 / (n * self.sum_w2) if n and self.sum_w2 > 0 else (None if n == 0 else 0.0)
        return {
            "kept_tokens": k,
            "kept_token_share": k / n if n else None,
            "kept_sequences": self.num_kept_sequences,
            "kept_sequence_share": self.num_kept_sequences / self.num_sequences if self.num_sequences else None,
            "rejected_token_fraction": (n - k) / n if n else None,
            "rejected_seq_fraction": (self.num_sequences - self.num_kept_sequences) / self.num_sequences if self.num_sequences else None,
            "vetoed_seq_fraction": self.num_vetoed_sequences / self.num_sequences if self.num_sequences else None,
            "ess": ess,
            "weight_min": self.w_min if k else None,
            "weight_max": self.w_max if k else None,
            "effective_sample_share": share,
        }


@dataclass
class RowAccumulator:
    """Per-row sums for one rollout id (see the module docstring)."""

    rollout_id: int
    sources: list[str] = field(default_factory=list)
    num_samples: int = 0
    sum_response_length: int = 0
    num_loss_tokens: int = 0
    num_valid_tokens: int = 0
    num_nonfinite: int = 0
    sum_k3: float = 0.0
    max_k3: float = 0.0
    k3_hist: LogHistogram = field(default_factory=LogHistogram)
    sum_tv: float = 0.0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    num_seq_mask: int = 0
    sum_log_ppl_abs_diff: float = 0.0
    sum_log_ppl_diff: float = 0.0
    sum_chi2_token: float = 0.0
    sum_chi2_seq: float = 0.0
    num_seq_valid: int = 0
    sum_seq_w: float = 0.0
    sum_seq_w2: float = 0.0
    bucket_count: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DEFAULT_PROB_BUCKET_EDGES) - 1, dtype=torch.float64))
    bucket_abs_log_r: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DEFAULT_PROB_BUCKET_EDGES) - 1, dtype=torch.float64))
    bucket_k3: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DEFAULT_PROB_BUCKET_EDGES) - 1, dtype=torch.float64))
    ratio_hist: torch.Tensor = field(default_factory=lambda: torch.zeros(len(RATIO_EDGES) + 1, dtype=torch.float64))
    weight_hist: torch.Tensor = field(default_factory=lambda: torch.zeros(len(RATIO_EDGES) + 1, dtype=torch.float64))
    configs: dict[str, ConfigAccumulator] = field(default_factory=dict)

    def merge(self, other: "RowAccumulator") -> None:
        """Add ``other`` (the same rollout id from another file)."""
        self.sources.extend(other.sources)
        for f in dataclasses.fields(self):
            name = f.name
            if name in ("rollout_id", "sources", "k3_hist", "configs", "max_k3"):
                continue
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_k3 = max(self.max_k3, other.max_k3)
        self.k3_hist.merge(other.k3_hist)
        for name, acc in other.configs.items():
            self.configs.setdefault(name, ConfigAccumulator()).merge(acc)

    def summary(self, main: str) -> dict[str, Any]:
        """The row: mismatch metrics, response length and what configuration ``main`` does."""
        n, ns = self.num_loss_tokens, self.num_seq_mask
        nv = self.num_valid_tokens
        row: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "num_samples": self.num_samples,
            "num_loss_tokens": n,
            "response_length": self.sum_response_length / self.num_samples if self.num_samples else None,
            "k3_mean": self.sum_k3 / n if n else None,
            "k3_p99": self.k3_hist.quantile(0.99),
            "k3_max": self.max_k3 if nv else None,
            "log_ppl_abs_diff": self.sum_log_ppl_abs_diff / ns if ns else None,
            "log_ppl_diff": self.sum_log_ppl_diff / ns if ns else None,
            "chi2_token": self.sum_chi2_token / ns if ns else None,
            "chi2_seq": self.sum_chi2_seq / ns if ns else None,
            "tv": self.sum_tv / n if n else None,
            "ess_token": self.sum_r**2 / (nv * self.sum_r2) if nv and self.sum_r2 > 0 else (1.0 if nv == 0 else None),
            "ess_seq": (
                self.sum_seq_w**2 / (self.num_seq_valid * self.sum_seq_w2)
                if self.num_seq_valid and self.sum_seq_w2 > 0
                else (1.0 if self.num_seq_valid == 0 else None)
            ),
            "nonfinite_fraction": self.num_nonfinite / n if n else None,
        }
        if main in self.configs:
            c = self.configs[main].summary()
            row.update({k: c[k] for k in ("rejected_token_fraction", "rejected_seq_fraction", "vetoed_seq_fraction")})
        row["sources"] = list(dict.fromkeys(self.sources))
        return row

    def bucket_means(self) -> dict[str, list[float | None]]:
        count = self.bucket_count
        return {
            "edges": list(DEFAULT_PROB_BUCKET_EDGES),
            "num_tokens": count.tolist(),
            "mean_abs_log_ratio": [float(s / c) if c > 0 else None for s, c in zip(self.bucket_abs_log_r.tolist(), count.tolist())],
            "mean_k3": [float(s / c) if c > 0 else None for s, c in zip(self.bucket_k3.tolist(), count.tolist())],
        }


def _first_token_index(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts [N], seq_ids [T])`` for sequences of ``lengths``."""
    lens = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    return starts, seq_ids


def _hist(values: torch.Tensor) -> torch.Tensor:
    """Counts of ``log10(values)`` in :data:`RATIO_EDGES` (index 0: below, last: above)."""
    out = torch.zeros(len(RATIO_EDGES) + 1, dtype=torch.float64)
    positive = values[values > 0].to(torch.float64)
    if positive.numel():
        idx = torch.bucketize(torch.log10(positive), RATIO_EDGES, right=True)
        out.index_add_(0, idx, torch.ones_like(positive))
    out[0] += float((values <= 0).sum())
    return out


def _config_stats(result: MISResult, mask: torch.Tensor, starts: torch.Tensor, has_mask: torch.Tensor) -> ConfigAccumulator:
    keep = result.keep_mask
    w = result.weights.to(torch.float64)[keep]
    acc = ConfigAccumulator(
        num_loss_tokens=int(mask.sum()),
        num_kept_tokens=int(keep.sum()),
        num_sequences=int(has_mask.sum()),
        num_kept_sequences=int((~result.seq_rejected & has_mask).sum()),
    )
    vetoed = torch.zeros_like(has_mask)
    for name in ("mis_rs_catastrophic_seq_fraction", "mis_prob_veto_seq_fraction"):
        metric = result.token_metrics.get(name)
        if metric is not None and metric.numel():
            vetoed |= metric[starts.clamp(max=metric.numel() - 1)] > 0.5
    acc.num_vetoed_sequences = int((vetoed & has_mask).sum())
    if w.numel():
        acc.sum_w = float(w.sum())
        acc.sum_w2 = float((w * w).sum())
        acc.w_min = float(w.min())
        acc.w_max = float(w.max())
    return acc


def process_batch(
    rollout_id: int,
    source: str,
    train: list[torch.Tensor],
    rollout: list[torch.Tensor],
    masks: list[torch.Tensor],
    response_lengths: list[int],
    configs: Mapping[str, MISConfig],
    main: str,
) -> tuple[RowAccumulator, MISResult]:
    """Run the engine once per configuration over one batch and reduce the outputs to a
    :class:`RowAccumulator`. Returns it and the main configuration's :class:`MISResult`."""
    row = RowAccumulator(rollout_id=rollout_id, sources=[source])
    lengths = [int(t.numel()) for t in train]
    row.num_samples = len(train)
    row.sum_response_length = int(sum(response_lengths))
    main_result = None
    if not train:  # an empty batch: every configuration saw nothing (the row still reports it)
        row.configs = {name: ConfigAccumulator() for name in configs}
        return row, compute_mis_from_lists([], [], [], configs[main])
    mask = torch.cat(masks) != 0
    starts, seq_ids = _first_token_index(lengths)
    per_seq_mask = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq_ids, mask.to(torch.float64))
    has_mask = per_seq_mask > 0
    for name, cfg in configs.items():
        result = compute_mis_from_lists(train, rollout, masks, cfg)
        row.configs[name] = _config_stats(result, mask, starts, has_mask)
        if name == main:
            main_result = result
    assert main_result is not None
    res, cfg = main_result, configs[main]
    tm = res.token_metrics
    nonfinite = tm["mis_nonfinite_token_fraction"] > 0.5
    valid = mask & ~nonfinite
    k3 = tm["mis_k3_kl"].to(torch.float64)[valid]
    row.num_loss_tokens = int(mask.sum())
    row.num_valid_tokens = int(valid.sum())
    row.num_nonfinite = int((mask & nonfinite).sum())
    row.sum_k3 = float(k3.sum())
    row.max_k3 = float(k3.max()) if k3.numel() else 0.0
    row.k3_hist.add(k3.clamp_min(0))
    row.sum_tv = float(tm["mis_tv"].to(torch.float64)[valid].sum())
    log_r = (-tm["mis_kl"].to(torch.float64)).clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound)
    r = torch.exp(log_r[valid])
    row.sum_r = float(r.sum())
    row.sum_r2 = float((r * r).sum())
    row.ratio_hist = _hist(r)
    row.weight_hist = _hist(res.weights.to(torch.float64)[res.keep_mask])
    # sequence metrics: the value at each sequence's first token (they are repeated over it)
    first = starts[has_mask]
    row.num_seq_mask = int(has_mask.sum())
    for attr, name in (
        ("sum_log_ppl_abs_diff", "mis_log_ppl_abs_diff"),
        ("sum_log_ppl_diff", "mis_log_ppl_diff"),
        ("sum_chi2_token", "mis_chi2_token"),
        ("sum_chi2_seq", "mis_chi2_seq"),
    ):
        setattr(row, attr, float(tm[name].to(torch.float64)[first].sum()))
    seq_log_r = torch.zeros(len(lengths), dtype=torch.float64).index_add_(
        0, seq_ids, torch.where(valid, -tm["mis_kl"].to(torch.float64), torch.zeros_like(log_r))
    )
    per_seq_valid = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq_ids, valid.to(torch.float64)) > 0
    seq_w = torch.exp(seq_log_r[per_seq_valid].clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound))
    row.num_seq_valid = int(per_seq_valid.sum())
    row.sum_seq_w = float(seq_w.sum())
    row.sum_seq_w2 = float((seq_w * seq_w).sum())
    table = res.bucket_table
    row.bucket_count = table["num_tokens"].to(torch.float64).clone()
    row.bucket_abs_log_r = (table["mean_abs_log_ratio"] * table["num_tokens"]).to(torch.float64)
    row.bucket_k3 = (table["mean_k3"] * table["num_tokens"]).to(torch.float64)
    return row, main_result


def replay_monitor(rows: list[dict[str, Any]], monitor_config, surge_config, decay_config) -> tuple[list[dict], dict[str, Any]]:
    """Replay the mismatch monitor and Beyond Precision (arXiv:2602.01826)'s length-surge detector over finished rows.

    Steps: RL step = rollout id + 1 (rollout ids count from 0 in slime and Miles; the schedule's
    steps from 1).

    Returns:
        ``(warnings, surge)``: the monitor's warnings as dicts (with ``rollout_id``), and the
        detector's verdict: ``fired``, ``rollout_id`` / ``step`` of the firing, the smoothed and
        reference lengths, the decay period ``T`` and the first step at which the length-decay
        schedule would halve the learning rate.
    """
    from megatron_mis.monitor import MismatchMonitor, build_surge_detector
    from megatron_mis.lr_schedule import LengthDecaySchedule

    monitor = MismatchMonitor(monitor_config, surge_config, sinks=[])
    schedule = LengthDecaySchedule(decay_config, detector=build_surge_detector(surge_config))
    warnings_out: list[dict] = []
    feed = {
        "mis_k3_kl": "k3_mean",
        "mis_k3_kl_p99": "k3_p99",
        "mis_k3_kl_max": "k3_max",
        "mis_log_ppl_abs_diff": "log_ppl_abs_diff",
        "mis_chi2_token": "chi2_token",
        "mis_chi2_seq": "chi2_seq",
        "mis_tv": "tv",
        "mis_ess_token": "ess_token",
        "mis_ess_seq": "ess_seq",
        "mis_rejected_token_fraction": "rejected_token_fraction",
        "response_length": "response_length",
    }
    for row in rows:
        step = int(row["rollout_id"]) + 1
        metrics = {name: row[key] for name, key in feed.items() if row.get(key) is not None}
        for w in monitor.update(step, metrics):
            d = w.to_dict()
            d["rollout_id"] = row["rollout_id"]
            warnings_out.append(d)
        length = row.get("response_length")
        schedule.observe(step, float(length) if length is not None and math.isfinite(length) else None)
    monitor.close()
    event = schedule.surge_event
    surge: dict[str, Any] = {
        "detector": surge_config.length_surge_detector,
        "fired": event is not None,
        "config": surge_config.to_dict(),
    }
    if event is not None:
        surge.update(
            {
                "step": event.step,
                "rollout_id": event.step - 1,
                "onset_step": event.onset_step,
                "onset_rollout_id": None if event.onset_step is None else event.onset_step - 1,
                "smoothed_length": event.smoothed_length,
                "reference_length": event.reference_length,
                "ratio": event.ratio,
            }
        )
        if schedule.trigger_step is not None:
            surge["trigger_step"] = schedule.trigger_step
            surge["decay_period"] = schedule.decay_period
            first = schedule.next_decay_step(schedule.trigger_step)
            surge["first_decay_step"] = first
            surge["first_decay_rollout_id"] = None if first is None else first - 1
    return warnings_out, surge
