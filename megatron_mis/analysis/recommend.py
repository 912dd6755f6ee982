"""Which correction fits a measured mismatch: a pure rule from the mean per-token K3 KL and the
mean response length (``megatron-mis analyze`` prints it; ``docs/study.md`` states the rule and
its basis).

The rule's one derived quantity: for a small per-token log-ratio ``d = log(pi_train / pi_rollout)``,
``K3 = E[e^d - 1 - d] ~ E[d^2] / 2``, so a sequence of ``L`` tokens whose log-ratios are
independent has a log sequence weight with standard deviation about

    s = sqrt(2 * L * K3)

and (log-normal weights of mean 1) an effective sample share of sequence-level weights of about
``exp(-s^2)``. The per-token mean log-ratio has mean ``-KL(rollout || train) = -K3`` and standard
deviation ``sqrt(2 * K3 / L)``; a band of three of them around ``-K3`` is the length-scaled
geometric band (``rs_criteria: {seq_zscore_k1: {k3: K3, z: 3}}``, which scales it per sequence).

Regimes (first match wins):

1. ``K3 > 1e-2``: more than numerics. The study's precision settings (bf16, fp16, int8, int4,
   dense and MoE) measured K3 up to about 2.6e-3; a temperature, top-p / top-k or stale-weight
   mismatch (the dose-response sweeps' mechanisms) reaches far higher. With stale rollouts,
   bypass PPO (the staleness sweep's one correction that closed the gap); otherwise check the
   rollout's sampling parameters and weight sync; meanwhile a truncated token weight
   (``token_tis``: at one step of lag it recovered the most of the IS weights, and token masking
   was never measurably better and at a rollout temperature of 1.5 measurably worse). A
   rollout-only temperature is fixed in the configuration, not by a weight: uncorrected it was
   level with the reference at T 0.5 and 1.5, and at 1.5 both token weights cost reward.
   Unless the log-ratios are one-sided: when fewer than 1% of the loss tokens have
   ``pi_train / pi_rollout >= 10^0.05`` (about 1.12; ``share_ratio_above``), the rollout's
   distribution is a truncated copy of the trainer's (processed log-probs of top-p / top-k
   sampling renormalise the kept mass, so every sampled token has ``pi_rollout >= pi_train`` and
   the ratios average the kept mass, below 1). A full-support mismatch is not one-sided: its
   ratios average 1 over the rollout's samples, so where most lie below 1 a few lie far above,
   and a rollout-only temperature (measured at T 0.5: 10% of the tokens at 1.12 or more) falls in
   the case above. For a truncation the fix is in the configuration (replay the support, or
   record raw log-probs) and no IS weight (``none``): each token's weight is about the kept
   mass, so a weight only shrinks the policy gradient against the terms it does not weight (the
   entropy bonus, a KL loss) and a mask band removes every token whose kept mass is below its lower bound (token MIS
   over processed top-k 64 log-probs trained nothing); where a weight stays on, self-normalised
   token TIS (``token_tis_normalized``, mean weight 1) stalled no run there; measured in the
   long-tail top-k sweep (below, ``TRUNCATION_BASIS``).
2. ``s <= 0.15``: the regime the study measured as harmless (no correction not measurably worse
   than the no-mismatch reference at K3 up to 2e-3 with 3-6-token responses, i.e. s up to about
   0.155); ``token_tis`` (bounded, rejects nothing) as cheap insurance.
3. ``0.15 < s <= 1``: sequence weights stay informative (share >= exp(-1) = 0.37) and are the
   unbiased correction (When Speed Kills Stability), so ``sequence_mis`` is printed as the
   option; the advice is ``token_tis``: in the long-response runs (64 and 128 tokens) it did not
   collapse in 27 runs on a first machine (one collapse in 12 more, one step stale at 128 tokens,
   on a second) and, fresh, ended at most 0.011 below none.
   Measured twice with fresh int4 rollouts: ``long-tail-stale`` k0 (64 tokens, s 0.6, 3 seeds),
   every arm on the plateau; ``long-tail-stale-128`` k0 (128 tokens, s 0.4, 4 seeds), no
   correction helps (every CI includes 0), sequence MIS one collapse in four. A cautious choice,
   not a measured difference.
4. ``s > 1``: sequence weights degenerate (share < 0.37): token-level truncation (``token_tis``),
   measured: in the study's ``long-tail-stale`` sweeps (64-token responses, s 1.9-3.6 at 1, 2 and
   4 steps of lag, K3 0.03-0.1; 128-token responses, s 1.2 and 2.4 at 1 and 2 steps, K3 5.7e-3
   and 2.3e-2; 3-25 seeds per dose; carried over to numeric K3 <= 1e-2 by s alone) token TIS was
   the correction that failed least (2/54 collapses, 4/54 ended low: half at 128 tokens one step
   stale, in 12 seeds on a second machine, where it was not measurably behind none, half at two
   steps stale, in 17 seeds on a Zen 3 VM, where over 25 seeds of two machines it ended below the
   fresh reference, -0.036 [-0.067, -0.006], and level with none, -0.015 [-0.052, +0.022]), while
   sequence MIS collapsed in 11/27 runs (15/27 ended low: below half of the reference's gain),
   sequence TIS in 7/27 (12/27 ended low), token MIS with the length-scaled band in 2/9 (64
   tokens) and none in 3/54. The band (``zscore_rs_token_mis`` with ``rs_criteria:
   {seq_zscore_k1: {k3: K3, z: 3}}``, K3 pinned; ``rs_criteria`` of the recommendation) is printed
   as an option for batches with outlier sequences, not as the advice. With stale rollouts, bypass
   instead: at 256 tokens with one step of lag (K3 3.3e-3, s 1.3, 11 seeds on three machines)
   bypass ended ahead of none (+0.070 [+0.017, +0.140], on 10 of 11 seeds) and of token TIS
   (+0.058 [+0.017, +0.117]), above the fresh reference only where the reference had not taken
   off, and took off on every seed, 55 [8, 98] steps before none; neither none (-0.001 [-0.116,
   +0.114]) nor token TIS (+0.012 [-0.092, +0.116]) is measurably behind the reference at 11 seeds
   (the reference missed the take-off in 300 steps on 3 of them), while sequence MIS is below it
   (-0.139 [-0.248, -0.040], 7 seeds; it never took off on 5) and sequence TIS below none (-0.179
   [-0.276, -0.082], 5 seeds, one collapse). At 128 tokens with one step of lag (K3 7.5e-3, s 1.2,
   12 seeds on one machine) bypass was ahead of none too, by less (+0.023 [+0.005, +0.048], on 10
   of 12 seeds), and of token TIS (+0.043 [+0.005, +0.088]), and took off 50 [15, 84] steps before
   none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Recommendation", "recommend", "sequence_log_weight_sd", "share_ratio_above", "geometric_band"]

#: Above this mean per-token K3 the mismatch is more than numerics (see the module docstring).
K3_CONFIG_BUG = 1e-2
#: Up to this sequence log-weight SD the study measured no harm from an uncorrected run.
S_MEASURED_HARMLESS = 0.15
#: Above this sequence log-weight SD the sequence weights' effective share drops below exp(-1).
S_SEQUENCE_DEGENERATE = 1.0
#: A loss token counts as "trainer above rollout" at log10(pi_train / pi_rollout) >= this (ratio
#: about 1.12: a bin edge of the analysis' ratio histogram, far above fp32 / bf16 rounding).
ONE_SIDED_LOG10 = 0.05
#: Above K3_CONFIG_BUG, a share of such tokens below this marks one-sided log-ratios (truncation).
ONE_SIDED_SHARE = 0.01
#: What the sampling-mismatch advice rests on (docs/study.md, "Top-p and top-k on the long-tail task", "Top-k 64 over
#: processed log-probs on more seeds", "Top-k 16 over processed log-probs on more seeds" and "None and the reference at
#: top-k 16 on more seeds").
TRUNCATION_BASIS = (
    "study: long-tail-top-k-processed k64 (512 ids, 64-token responses, top-k 64 with the processed log-probs "
    "recorded; mean K3 KL 4.8e-1 uncorrected, 16 seeds): token TIS -0.031 [-0.068, -0.004] against the reference "
    "on the greedy reward, 3/16 ended low and 2/16 never took off in 300 steps (none 0/16), with a gradient norm "
    "0.37x none's (each token's weight is its kept mass, and the entropy bonus is not weighted: at top-k 16 token "
    "TIS with that bonus lowered by its mean weight took off with none, -12 [-33, +5] steps, 8 seeds); token MIS "
    "(band [0.5, 5], this regime's advice before) rejected every loss token on every step of 12/12 runs and "
    "never learned: -0.365 [-0.372, -0.356]; token TIS self-normalised (token_tis_normalized) -0.009 [-0.019, "
    "-0.000], 0/16 ended low, 16/16 took off; none -0.004 [-0.012, +0.005] against the reference (no weight: the "
    "same run as with raw log-probs); replaying the support (long-tail-top-k-replay) +0.010 [-0.014, +0.034] "
    "against the run without it (4 seeds); at 26 seeds (10 more, long-tail-top-k-processed-k64-more) token TIS "
    "-0.030 [-0.058, -0.006] against the reference and -0.027 [-0.056, -0.002] against none (not excluding 0 with "
    "the 5% split over the two looks), 4/26 below the plateau (greedy reward under 0.3; no run of none, the "
    "reference or token_tis_normalized), token_tis_normalized -0.005 [-0.015, +0.005], none -0.003 [-0.014, +0.008]; "
    "at top-k 16 over 30 seeds (14 more, long-tail-top-k-processed-k16-more) token TIS -0.046 [-0.082, -0.016] "
    "against the reference and -0.035 [-0.071, -0.003] against none (not excluding 0 with the 5% split), "
    "token_tis_normalized -0.008 [-0.024, +0.006], none -0.011 [-0.025, +0.000]; at top-k 16 over 50 seeds (20 "
    "more of none and the reference, long-tail-top-k-processed-k16-none) none -0.013 [-0.024, -0.003] against "
    "the reference (-0.013 [-0.027, -0.001] with the 5% split over the three looks; MDE 0.015); replaying the "
    "support there (42 seeds, long-tail-top-k-replay-k16, the entropy bonus over the kept ids) removed the mismatch "
    "(mean K3 8.9e-13) but not the cost: -0.027 [-0.052, -0.007] against the reference, -0.013 [-0.041, +0.010] "
    "against none (the cost is the small sampling support's, not the mismatch's)"
)


@dataclass(frozen=True)
class Recommendation:
    """A correction for a measured mismatch.

    ``correction``: a preset name of ``configs/presets/``, or ``none`` (no IS weight);
    ``geometric_band``: the length-scaled band for the per-token geometric mean of the ratio at
    the mean length (``None`` where none is advised); ``rs_criteria``: the ``rs_criteria`` to
    set over the preset's (the band per sequence length, K3 pinned to the measured one), or
    ``None``;
    ``sequence_log_weight_sd``: ``s``; ``effective_sequence_share``: ``exp(-s^2)``; ``regime``:
    ``config-bug`` / ``sampling-mismatch`` / ``measured-harmless`` / ``sequence-level`` /
    ``token-level``; ``reason`` and ``basis``: why, and whether the study measured it or the
    literature argues it."""

    correction: str
    geometric_band: tuple[float, float] | None
    rs_criteria: dict | None
    sequence_log_weight_sd: float
    effective_sequence_share: float
    regime: str
    reason: str
    basis: str


def _check(name: str, value: float, low: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < low:
        raise ValueError(f"{name}={value!r} must be a finite number >= {low}")
    return v


def sequence_log_weight_sd(k3_mean: float, response_length: float) -> float:
    """``sqrt(2 * L * K3)``: the standard deviation of a sequence's log IS weight (see the module
    docstring)."""
    k3 = _check("k3_mean", k3_mean, 0.0)
    length = _check("response_length", response_length, 1.0)
    return math.sqrt(2.0 * length * k3)


def geometric_band(k3_mean: float, response_length: float, *, width: float = 3.0) -> tuple[float, float]:
    """``[exp(-K3 - h), exp(-K3 + h)]`` with ``h = width * sqrt(2 * K3 / L)``: ``width`` standard
    deviations of the per-token geometric mean of the ratio around its mean ``-K3``, narrowing as
    responses grow (what ``seq_zscore_k1`` keeps at length ``L``)."""
    k3 = _check("k3_mean", k3_mean, 0.0)
    length = _check("response_length", response_length, 1.0)
    _check("width", width, 0.0)
    h = width * math.sqrt(2.0 * k3 / length)
    return (math.exp(-k3 - h), math.exp(-k3 + h))


def share_ratio_above(
    log10_edges: list[float], counts: list[float], log10_bound: float = ONE_SIDED_LOG10
) -> float | None:
    """The share of the counted tokens whose ``log10(pi_train / pi_rollout)`` is at least
    ``log10_bound``, from a histogram over ``log10_edges`` (``counts[0]``: below the first edge,
    ``counts[i]``: ``[edges[i-1], edges[i])``, ``counts[-1]``: at or above the last edge; the
    ``weights.ratio_counts`` of ``megatron-mis analyze``'s report). ``log10_bound`` must be one of
    the edges; ``None`` when nothing was counted."""
    if len(counts) != len(log10_edges) + 1:
        raise ValueError(f"counts has {len(counts)} bins; {len(log10_edges)} edges need {len(log10_edges) + 1}")
    start = [i for i, e in enumerate(log10_edges) if abs(e - log10_bound) < 1e-9]
    if not start:
        raise ValueError(
            f"log10_bound={log10_bound!r} is not an edge of the histogram ({log10_edges[0]} .. {log10_edges[-1]})"
        )
    total = float(sum(counts))
    return float(sum(counts[start[0] + 1:])) / total if total > 0 else None


def recommend(k3_mean: float, response_length: float, *, share_ratio_above: float | None = None) -> Recommendation:
    """The correction for a mean per-token K3 KL ``k3_mean`` (>= 0) and a mean response length
    ``response_length`` (tokens, >= 1); ``share_ratio_above``: the share of loss tokens with
    ``pi_train / pi_rollout >= 10^ONE_SIDED_LOG10`` (``None``: not measured); see the module
    docstring for the rule."""
    s = sequence_log_weight_sd(k3_mean, response_length)
    share = math.exp(-s * s)
    k3, length = float(k3_mean), float(response_length)
    if share_ratio_above is not None and not 0.0 <= float(share_ratio_above) <= 1.0:
        raise ValueError(f"share_ratio_above={share_ratio_above!r} must lie in [0, 1] (a share of tokens) or be None")
    if k3 > K3_CONFIG_BUG and share_ratio_above is not None and share_ratio_above < ONE_SIDED_SHARE:
        return Recommendation(
            "none", None, None, s, share, "sampling-mismatch",
            f"mean K3 {k3:.2e} exceeds {K3_CONFIG_BUG:g} and the log-ratios are one-sided: only "
            f"{share_ratio_above:.2%} of the loss tokens have pi_train / pi_rollout >= {10 ** ONE_SIDED_LOG10:.2f}, "
            "so the rollout's distribution is a truncated copy of the trainer's: processed (renormalised) "
            "log-probs of top-p / top-k sampling (a full-support mismatch, stale weights or a rollout-only "
            "temperature, has ratios averaging 1, so not one-sided). Fix the configuration: replay the rollout's "
            "support in the trainer (TokenSupport, as slime's top-p replay) or record the raw log-probs. Use no IS "
            "weight meanwhile: each token's weight is about the kept mass, so a weight only shrinks the policy "
            "gradient against what it does not weight (the entropy bonus, a KL loss), and a mask band (token "
            "MIS's [0.5, 5]) removes every token whose kept mass is below its lower bound. Where a weight stays on "
            "(a host that always applies one), self-normalise it (preset token_tis_normalized): its mean is then 1, "
            "so it moves the tokens' shares and leaves the policy gradient's scale as it is",
            TRUNCATION_BASIS,
        )
    if k3 > K3_CONFIG_BUG:
        return Recommendation(
            "token_tis", None, None, s, share, "config-bug",
            f"mean K3 {k3:.2e} exceeds {K3_CONFIG_BUG:g}, more than bf16 / fp16 / int8 / int4 numerics gave in the "
            "study (<= 2.6e-3): a configuration or staleness mismatch. If the rollouts are stale (asynchronous RL), "
            "use bypass (the rollout's log-probs as PPO's old policy: --use-rollout-logprobs, policy_loss: "
            "bypass_ppo): in the study's staleness sweep it alone closed the gap at 1-8 steps of lag (+0.36 to +0.66 "
            "reward over none; IS-weight corrections +0.03 to +0.18); at one step of lag, where none fell -0.152 "
            "[-0.187, -0.117] behind fresh rollouts (120 seeds), token TIS recovered +0.095 [+0.063, +0.126], "
            "decoupled PPO +0.080 [+0.049, +0.111] and token MIS +0.073 [+0.042, +0.103] (masking 1.6% of the "
            "tokens), bypass +0.366 [+0.324, +0.408] (60 seeds). Otherwise check the "
            "rollout's temperature, top-p / top-k (replay the rollout's support in the trainer: TokenSupport) and "
            "weight sync; meanwhile weight tokens truncated at 2 (token TIS; token MIS - token TIS was -0.022 "
            "[-0.053, +0.010] at one step of lag and -0.055 [-0.087, -0.022] at a rollout temperature of 1.5). A "
            "rollout-only temperature (the trainer's log-probs at another one) is fixed in the configuration, not "
            "by a weight: uncorrected it was level with the reference in the study, at T 0.5 (K3 0.19, 60 seeds) "
            "none - reference +0.020 [-0.019, +0.058], token MIS -0.016 [-0.067, +0.035] against none, and at T 1.5 "
            "(K3 0.086, 60 seeds) none - reference +0.010 [-0.044, +0.065], where token TIS cost -0.064 [-0.115, "
            "-0.014] and token MIS -0.119 [-0.167, -0.071] against none (masking 17% of the tokens: the rollout's "
            "low-probability samples, which a weight discounts)",
            "study: K3 of the precision settings; the staleness sweep (6 doses x 7 arms x 8 seeds), its one step of "
            "lag at 120 seeds (docs/study/sweep-staleness-k1), temperatures 0.5 and 1.5 at 60 seeds "
            "(docs/study/sweep-temperature-t0.5, docs/study/sweep-temperature-t1.5) and the top-p runs "
            "(docs/study.md)",
        )
    if s <= S_MEASURED_HARMLESS:
        return Recommendation(
            "token_tis", None, None, s, share, "measured-harmless",
            f"sequence log-weight SD s = sqrt(2 x {length:g} x {k3:.2e}) = {s:.3f} <= {S_MEASURED_HARMLESS}: in the "
            "range where the study found no correction not measurably worse than the no-mismatch reference; a "
            "token weight truncated at 2 is cheap insurance",
            "study (docs/study.md): K3 <= 2e-3 with 3-6-token responses (s <= 0.155); with 128-token responses "
            "(long-tail-precision) none - fp32 reference -0.006 [-0.024, +0.008] at bf16 (s 0.05, 14 seeds, MDE "
            "0.023) and +0.003 [-0.006, +0.010] at int8 (s 0.04, 19 seeds, MDE 0.012)",
        )
    if s <= S_SEQUENCE_DEGENERATE:
        return Recommendation(
            "token_tis", None, None, s, share, "sequence-level",
            f"s = {s:.3f}: sequence weights keep an effective share exp(-s^2) = {share:.2f}, so the unbiased "
            "sequence-level correction is usable: the preset sequence_mis is the option. The advice is a token "
            "weight truncated at 2: in the study's long-response runs (64 and 128 tokens) it did not collapse in 27 "
            "runs on a first machine (one collapse in 12 more, one step stale at 128 tokens, on a second) and, with "
            "fresh rollouts, ended at most 0.011 below none",
            "study (docs/study.md), measured twice with fresh int4 rollouts: long-tail-stale k0 (64 tokens, s 0.6, 3 "
            "seeds), every arm on the plateau, none not hurt; long-tail-stale-128 k0 (128 tokens, s 0.4, 4 seeds), no "
            "correction helps (every CI includes 0), sequence MIS -0.054 [-0.154, +0.002] against none with one "
            "collapse in four, token TIS -0.011 [-0.033, +0.009], no collapse: a cautious choice, not a measured "
            "difference; none itself at 128 tokens on 16 seeds of two machines (long-tail-precision int4, s 0.5): "
            "+0.001 [-0.006, +0.008] against the fp32 reference, MDE 0.011. Literature (When Speed Kills Stability) "
            "for sequence-level weights in this range",
        )
    band = geometric_band(k3, length)
    criteria = {"seq_zscore_k1": {"k3": float(f"{k3:.3g}"), "z": 3.0}}
    return Recommendation(
        "token_tis", band, criteria, s, share, "token-level",
        f"s = {s:.3f}: sequence weights degenerate (effective share {share:.2g}); truncate the token weight at 2. "
        "Optional, against outlier sequences: the preset zscore_rs_token_mis (token MIS) rejects those whose "
        f"mean log-ratio lies more than 3 SD from -K3 at their own length (at the mean length {length:g}: geometric-mean ratio outside [{band[0]:.4f}, "
        f"{band[1]:.4f}]): rs_criteria: {{seq_zscore_k1: {{k3: {k3:.3g}, z: 3}}}}. If the rollouts are stale "
        "(asynchronous RL), use bypass instead (--use-rollout-logprobs, policy_loss: bypass_ppo): at 256 tokens with one "
        "step of lag (K3 3.3e-3, 11 seeds) bypass ended ahead of none on 10 of 11 seeds and of token TIS, above "
        "the fresh reference only where that missed its take-off, and took off about 55 steps before none; at 128 "
        "tokens (12 seeds) ahead of none by a smaller margin, on 10 of 12, taking off about 50 steps earlier, and "
        "ahead of token TIS, which collapsed on one of those seeds and never reached the plateau on another; at two "
        "steps of lag there token TIS ended below the fresh reference and no better than none (25 seeds), while "
        "bypass ended level with the reference and above none (29 seeds) and none about 0.03 behind the reference (42 seeds)",
        "study (docs/study.md, long-tail-stale: 64-token responses, s 1.9-3.6 at 1-4 steps of lag; long-tail-stale-128: "
        "128 tokens, s 1.2 and 2.4 at 1 and 2 steps; 3-25 seeds per dose): token TIS the correction that failed least "
        "(2/54 collapses, 4/54 ended low, at 128 tokens k1 on a second machine and k2 on a Zen 3 VM; +0.105 [+0.018, "
        "+0.267] over none "
        "at 4 steps, 64 tokens), sequence MIS collapsed in 11/27 runs "
        "(15/27 ended below half of the reference's gain), sequence TIS in 7/27 (12/27 ended low), token MIS with the "
        "length-scaled band in 2/9 at 64 tokens (it rejected ~1% of the sequences), none in 3/54. Measured with stale "
        "rollouts (K3 5.7e-3 to 0.1), carried over to a numeric "
        "K3 <= 1e-2 at long lengths by s alone; literature (When Speed Kills Stability) for why sequence weights fail. "
        "Stale at 256 tokens (long-tail-stale-256 k1, s 1.3, 11 seeds): bypass +0.070 [+0.017, +0.140] against none "
        "(take-off 55 [8, 98] steps earlier), +0.058 [+0.017, +0.117] against token TIS and +0.069 [+0.002, +0.149] "
        "against the reference (through its misses); token TIS +0.013 [-0.037, +0.074] against none and +0.012 "
        "[-0.092, +0.116] against the reference (-0.091 [-0.197, -0.013] at 6 seeds); none itself -0.001 [-0.116, "
        "+0.114] against the reference (none missed the take-off in 300 steps on two seeds, token TIS on one, the "
        "reference on three, bypass on none); sequence MIS -0.139 [-0.248, -0.040] against the reference (7 seeds, "
        "5 never took off) and sequence TIS -0.179 [-0.276, -0.082] against none (5 seeds, one collapse). Stale at "
        "128 tokens (long-tail-stale-128 k1, s 1.2, 12 seeds, one machine): bypass +0.023 [+0.005, +0.048] against "
        "none (take-off 50 [15, 84] steps earlier, 0/12 ended low), +0.017 [-0.002, +0.047] against the reference "
        "and +0.043 [+0.005, +0.088] against token TIS (12 seeds, same machine), which was -0.019 [-0.074, +0.030] "
        "against none with 1/12 collapsed and 2/12 ended low. Stale two steps at 128 tokens (long-tail-stale-128 k2, "
        "s 2.4, 25 seeds of two machines): token TIS -0.036 [-0.067, -0.006] against the reference (-0.043 [-0.086, "
        "-0.002] on the 17 seeds that tested it) and -0.015 [-0.052, +0.022] against none; none itself -0.032 "
        "[-0.054, -0.012] against the reference (42 seeds of three machines, 3 collapses); bypass +0.001 [-0.014, "
        "+0.017] against the reference and +0.031 [+0.008, +0.058] against none (29 seeds of three machines, no "
        "collapse)",
    )
