"""Statistics of a study: per-run metrics, percentile-bootstrap confidence intervals of a mean,
paired differences against the baseline arm per seed (numpy only).

Per run (:func:`run_metrics`), with ``k = last_k`` and the reward curve ``r_1 .. r_S`` (mean reward
of each step's rollout batch):

- ``final_reward``: mean of the last ``k`` steps; ``start_reward``: mean of the first ``k``;
- ``peak_reward``: the largest ``k``-step moving mean;
- ``greedy_reward`` / ``greedy_exact``: the demo's greedy evaluation after training (64 fresh
  prompts, fp32 engine, top-1);
- ``collapsed``: the run gained at least ``MIN_GAIN`` (``peak - start``) and then lost more than
  ``collapse_fraction`` of it by the end: ``final - start < (1 - collapse_fraction) (peak - start)``;
- ``steps_to_threshold``: the first step whose ``k``-step moving mean reaches ``threshold``
  (``None`` if never);
- ``k3_mean`` / ``k3_max``: mean and largest per-step K3 KL (each step's mean over its loss
  tokens); ``k3_token_max``: the largest single-token K3; ``k3_late_early``: mean K3 of the last
  third of the steps over that of the first third (Let Speed Be With Stability's "late K3 growth");
- ``route_flip_mean`` (MoE runs): mean over steps of ``route_flip_fraction``, the fraction of the
  rollout's experts that the trainer's float32 router would not choose (``None`` for dense runs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["MIN_GAIN", "bootstrap_ci", "paired_differences", "run_metrics", "moving_mean", "curve_band", "wilson_interval"]

#: Smallest gain (peak - start reward) for a run to count as having learned, hence able to collapse.
MIN_GAIN = 0.1


def moving_mean(values: Sequence[float], k: int) -> np.ndarray:
    """``[S - k + 1]`` means of ``k`` consecutive values (the whole mean if ``S < k``)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return x
    k = min(k, x.size)
    c = np.concatenate([[0.0], np.cumsum(x)])
    return (c[k:] - c[:-k]) / k


def run_metrics(records: Sequence[Mapping[str, Any]], end: Mapping[str, Any], *, last_k: int, threshold: float,
                collapse_fraction: float) -> dict[str, Any]:
    """The per-run metrics above from a run's step records and its end line."""
    reward = [float(r["reward_mean"]) for r in records]
    if not reward:
        raise ValueError("a run without step records has no metrics")
    k = min(last_k, len(reward))
    mm = moving_mean(reward, k)
    start, final, peak = float(np.mean(reward[:k])), float(np.mean(reward[-k:])), float(mm.max())
    gain = peak - start
    collapsed = bool(gain >= MIN_GAIN and final - start < (1.0 - collapse_fraction) * gain)
    reached = np.nonzero(mm >= threshold)[0]
    k3 = np.array([r.get("mis_k3_kl") if r.get("mis_k3_kl") is not None else np.nan for r in records], dtype=np.float64)
    k3_tok = [r.get("mis_k3_kl_max") for r in records if r.get("mis_k3_kl_max") is not None]
    third = max(1, len(k3) // 3)
    early, late = np.nanmean(k3[:third]), np.nanmean(k3[-third:])
    evaluation = end.get("evaluation", {})
    flips = [r["route_flip_fraction"] for r in records if r.get("route_flip_fraction") is not None]
    return {
        "start_reward": start,
        "final_reward": final,
        "peak_reward": peak,
        "greedy_reward": evaluation.get("greedy_reward"),
        "greedy_exact": evaluation.get("greedy_exact"),
        "collapsed": collapsed,
        "steps_to_threshold": int(reached[0]) + k if reached.size else None,
        "k3_mean": float(np.nanmean(k3)) if np.isfinite(k3).any() else None,
        "k3_max": float(np.nanmax(k3)) if np.isfinite(k3).any() else None,
        "k3_token_max": float(max(k3_tok)) if k3_tok else None,
        "k3_late_early": float(late / early) if early > 0 and math.isfinite(late) else None,
        "rejected_fraction": float(np.mean([r.get("rejected_token_fraction", 0.0) or 0.0 for r in records])),
        "wall_s": float(end.get("wall_s", float("nan"))),
        # MoE runs: mean over steps of the fraction of rollout experts the trainer's router does not choose
        "route_flip_mean": float(np.mean(flips)) if flips else None,
    }


def bootstrap_ci(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10000,
                 seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` and its percentile-bootstrap interval
    (``resamples`` resamples with replacement, a fixed generator). One value: ``(v, v, v)``.

    Raises:
        ValueError: no values, or a non-finite one.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if not np.isfinite(x).all():
        raise ValueError(f"bootstrap_ci got non-finite values: {x[~np.isfinite(x)].tolist()}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(low), float(high)


def curve_band(curves: Sequence[Sequence[float]], *, confidence: float = 0.95, resamples: int = 2000,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step mean and percentile-bootstrap band over runs: ``curves [N runs, S steps]`` ->
    ``(mean [S], low [S], high [S])`` (runs resampled as whole curves)."""
    x = np.asarray(curves, dtype=np.float64)
    mean = np.nanmean(x, axis=0)
    if x.shape[0] < 2:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(resamples, x.shape[0]))
    means = np.nanmean(x[idx], axis=1)  # [resamples, S]
    alpha = (1.0 - confidence) / 2.0
    low, high = np.nanquantile(means, [alpha, 1.0 - alpha], axis=0)
    return mean, low, high


def paired_differences(arm: Mapping[int, float], baseline: Mapping[int, float], *, confidence: float = 0.95,
                       resamples: int = 10000, seed: int = 0) -> dict[str, Any] | None:
    """Per-seed differences ``arm[s] - baseline[s]`` over the seeds both have a (non-None) value
    for, their mean and bootstrap interval: ``{"n", "mean", "low", "high", "excludes_zero",
    "diffs"}``; ``None`` without a common seed."""
    seeds = sorted(s for s in arm if s in baseline and arm[s] is not None and baseline[s] is not None)
    if not seeds:
        return None
    diffs = [float(arm[s]) - float(baseline[s]) for s in seeds]
    mean, low, high = bootstrap_ci(diffs, confidence=confidence, resamples=resamples, seed=seed)
    return {"n": len(seeds), "mean": mean, "low": low, "high": high,
            "excludes_zero": bool(len(seeds) > 1 and (low > 0 or high < 0)), "diffs": dict(zip(seeds, diffs))}


def wilson_interval(successes: int, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (for collapse rates)."""
    if n == 0:
        return float("nan"), float("nan")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    p = successes / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


#: z quantiles of the seed-count rule (two-sided alpha 0.05, power 0.8)
Z_ALPHA_2 = 1.959963984540054
Z_POWER_80 = 0.8416212335729143


def seeds_for_effect(paired_sd: float, effect: float, *, z_alpha: float = Z_ALPHA_2, z_power: float = Z_POWER_80) -> int:
    """Seeds (pairs) for a paired difference of ``effect`` to be detected with a two-sided test at
    the ``z_alpha`` level and ``z_power`` power (normal approximation):
    ``ceil(((z_alpha + z_power) * paired_sd / effect) ** 2)``, at least 2."""
    if not paired_sd >= 0 or not effect > 0:
        raise ValueError(f"need paired_sd >= 0 and effect > 0, got paired_sd={paired_sd!r}, effect={effect!r}")
    return max(2, math.ceil(((z_alpha + z_power) * paired_sd / effect) ** 2))


def minimal_detectable_effect(paired_sd: float, n: int, *, z_alpha: float = Z_ALPHA_2, z_power: float = Z_POWER_80) -> float:
    """The smallest paired difference ``n`` seeds detect (two-sided, same rule as
    :func:`seeds_for_effect`): ``(z_alpha + z_power) * paired_sd / sqrt(n)``."""
    if n < 1:
        raise ValueError(f"n={n!r} must be >= 1")
    return (z_alpha + z_power) * paired_sd / math.sqrt(n)
