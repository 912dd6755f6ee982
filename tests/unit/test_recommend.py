"""megatron_mis.analysis.recommend: the correction rule on hand-derived cases."""

from __future__ import annotations

import math

import pytest
import torch
from dump_writers import make_samples, write_jsonl

from megatron_mis.analysis.recommend import geometric_band, recommend, sequence_log_weight_sd


def test_sequence_sd_and_band_hand_derived():
    assert sequence_log_weight_sd(1e-3, 200) == pytest.approx(math.sqrt(0.4))
    lo, hi = geometric_band(1e-3, 2000)  # h = 3 sqrt(2e-3 / 2000) = 3e-3 around -K3 = -1e-3
    assert lo == pytest.approx(math.exp(-4e-3)) and hi == pytest.approx(math.exp(2e-3))
    assert geometric_band(0.0, 10) == (1.0, 1.0)


@pytest.mark.parametrize(
    "k3,length,correction,regime",
    [
        (1e-3, 5, "token_tis", "measured-harmless"),  # s = sqrt(0.01) = 0.1
        (1e-3, 200, "token_tis", "sequence-level"),  # s = 0.632: sequence weights usable, the option
        (5e-3, 100, "token_tis", "sequence-level"),  # s = 1.0 exactly: still sequence-level
        (1e-3, 2000, "token_tis", "token-level"),  # s = 2
        (2e-2, 5, "token_tis", "config-bug"),  # K3 above numerics
        (0.0, 4096, "token_tis", "measured-harmless"),
    ],
)
def test_regimes(k3, length, correction, regime):
    r = recommend(k3, length)
    assert (r.correction, r.regime) == (correction, regime)
    assert r.effective_sequence_share == pytest.approx(math.exp(-2 * length * k3))
    assert r.basis and r.reason


def test_a_mismatch_beyond_numerics_names_bypass_for_stale_rollouts_and_the_config_checks():
    r = recommend(0.14, 3)  # the staleness sweep's k = 2
    assert r.regime == "config-bug" and r.geometric_band is None
    assert "--use-rollout-logprobs" in r.reason and "bypass_ppo" in r.reason and "temperature" in r.reason
    assert "staleness sweep" in r.basis


def test_token_level_carries_the_length_scaled_band():
    r = recommend(1e-3, 2000)
    assert r.sequence_log_weight_sd == pytest.approx(2.0)
    assert r.geometric_band == pytest.approx((math.exp(-4e-3), math.exp(2e-3)))
    assert r.rs_criteria == {"seq_zscore_k1": {"k3": 1e-3, "z": 3.0}}
    # measured: token TIS the correction that failed least at s 1.2-3.6 (2 collapses in 54); the band an option
    assert r.correction == "token_tis" and r.regime == "token-level"
    assert "long-tail-stale" in r.basis and "long-tail-stale-128" in r.basis and "Optional" in r.reason
    assert "2/54 collapses" in r.basis and "none in 3/54" in r.basis
    # stale rollouts at 256 tokens (11 seeds): bypass ahead of none and token TIS, above the reference only
    # through its misses (test_study_archive recomputes these figures from three machines' runs)
    assert "bypass_ppo" in r.reason and "long-tail-stale-256" in r.basis and "+0.070 [+0.017, +0.140]" in r.basis
    assert "11 seeds" in r.basis and "+0.012 [-0.092, +0.116]" in r.basis
    # and at 128 tokens (12 seeds): ahead of none by less
    assert "long-tail-stale-128 k1" in r.basis and "+0.023 [+0.005, +0.048]" in r.basis and "12 seeds" in r.basis
    # where token TIS, on the same 12 seeds, collapsed once and was not ahead of none
    assert "+0.043 [+0.005, +0.088] against token TIS" in r.basis and "-0.019 [-0.074, +0.030]" in r.basis
    mid = recommend(1e-3, 200)  # s 0.63: the advice token TIS, sequence MIS named as the option
    assert "measured twice" in mid.basis and "s 0.6" in mid.basis and "s 0.4" in mid.basis
    assert "the preset sequence_mis is the option" in mid.reason
    assert recommend(1e-3, 200).geometric_band is None and recommend(1e-3, 200).rs_criteria is None
    # the advice is a valid config: the preset with the pinned K3, and at the mean length it keeps
    # exactly the band reported
    from megatron_mis import MISConfig
    from megatron_mis.presets import preset_path

    assert "zscore_rs_token_mis" in r.reason  # the option names the preset the criteria belong to
    cfg = MISConfig.from_yaml(preset_path("zscore_rs_token_mis")).replace(rs_criteria=r.rs_criteria)
    assert tuple(cfg.rs_bounds()[0]) == ("seq_zscore_k1", 1e-3, 3.0)


@pytest.mark.parametrize("k3,length,msg", [(-1e-3, 10, "k3_mean=-0.001"), (float("nan"), 10, "k3_mean=nan"),
                                           (1e-3, 0, "response_length=0"), (1e-3, float("inf"), "response_length=inf")])
def test_bad_input_named(k3, length, msg):
    with pytest.raises(ValueError, match=msg):
        recommend(k3, length)


def test_analyze_report_hook():
    import json

    from megatron_mis.analysis.report import recommendation, to_json

    assert recommendation({"overall": {"k3_mean": 1e-3, "response_length": 200.0}})["regime"] == "sequence-level"
    assert recommendation({"overall": {"k3_mean": None, "response_length": 200.0}}) is None
    assert recommendation({"overall": {"k3_mean": float("nan"), "response_length": 5.0}}) is None
    out = json.loads(to_json({"overall": {"k3_mean": 1e-3, "response_length": 2000.0}}))
    assert out["recommendation"]["regime"] == "token-level"


def test_share_ratio_above_reads_the_histogram_hand_derived():
    from megatron_mis.analysis.recommend import share_ratio_above

    edges = [-0.1, -0.05, 0.0, 0.05, 0.1]
    # bins: < -0.1 | [-0.1, -0.05) | [-0.05, 0) | [0, 0.05) | [0.05, 0.1) | >= 0.1
    assert share_ratio_above(edges, [1, 2, 3, 4, 5, 6]) == pytest.approx(11 / 21)
    assert share_ratio_above(edges, [1, 2, 3, 4, 5, 6], log10_bound=0.1) == pytest.approx(6 / 21)
    assert share_ratio_above(edges, [0] * 6) is None
    with pytest.raises(ValueError, match="counts has 5 bins; 5 edges need 6"):
        share_ratio_above(edges, [1] * 5)
    with pytest.raises(ValueError, match="log10_bound=0.07 is not an edge"):
        share_ratio_above(edges, [1] * 6, log10_bound=0.07)


@pytest.mark.parametrize(
    "k3,above,correction,regime",
    [
        (0.5, 0.0, "none", "sampling-mismatch"),  # processed top-k log-probs: every ratio <= 1
        (0.5, 0.0099, "none", "sampling-mismatch"),
        (0.5, 0.01, "token_tis", "config-bug"),  # 1% above: two-sided enough (stale weights, a temperature)
        (0.5, None, "token_tis", "config-bug"),  # not measured: the K3 rule alone
        (5e-3, 0.0, "token_tis", "sequence-level"),  # one-sided at a numeric K3 is not flagged
    ],
)
def test_one_sided_log_ratios_above_numerics_advise_no_weight_and_the_sampling_fix(k3, above, correction, regime):
    r = recommend(k3, 64, share_ratio_above=above)
    assert (r.correction, r.regime) == (correction, regime)
    if regime == "sampling-mismatch":
        assert "replay the rollout's support" in r.reason and "raw log-probs" in r.reason
        # a rollout-only temperature is a full-support mismatch: two-sided, not this regime's cause
        assert "apply the rollout's temperature" not in r.reason and "not one-sided" in r.reason
        assert "long-tail-top-k-processed k64" in r.basis
        assert "self-normalise it (preset token_tis_normalized)" in r.reason


@pytest.mark.parametrize("above", [-0.1, 1.5, float("nan")])
def test_a_share_outside_0_1_is_refused(above):
    with pytest.raises(ValueError, match="share_ratio_above=.* must lie in \\[0, 1\\]"):
        recommend(0.5, 64, share_ratio_above=above)


def test_analyze_tells_processed_truncation_from_a_two_sided_mismatch(tmp_path):
    """End to end through ``analyze_history``: rollout log-probs that are the trainer's renormalised
    over a kept mass Z in [0.3, 0.9] per token (log pi_rollout = log pi_train - log Z: what top-k /
    top-p sampling's processed log-probs are) give ratios Z <= 1 on every token, so the advice is
    the sampling fix and no weight; the same K3 order with two-sided noise stays config-bug."""
    from megatron_mis.analysis import analyze_history
    from megatron_mis.analysis.report import format_history, recommendation
    from megatron_mis.config import MISConfig

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        train = torch.log(torch.rand(64, generator=g, dtype=torch.float64) * 0.25 + 0.01)  # rollout <= log 0.87
        kept = torch.rand(64, generator=g, dtype=torch.float64) * 0.6 + 0.3
        samples.append({"train": train.float(), "rollout": (train - torch.log(kept)).float(),
                        "mask": torch.ones(64, dtype=torch.int32)})
    one_sided = analyze_history([str(write_jsonl(tmp_path / "truncated.jsonl", samples))], MISConfig(), "default",
                                progress=False).report
    rec = recommendation(one_sided)
    assert one_sided["overall"]["k3_mean"] > 1e-2
    assert (rec["correction"], rec["regime"]) == ("none", "sampling-mismatch")
    assert "Recommended correction: none (sampling-mismatch)" in format_history(one_sided)
    two_sided = analyze_history([str(write_jsonl(tmp_path / "noisy.jsonl", make_samples(16, 64, 0.3)))], MISConfig(),
                                "default", progress=False).report
    assert two_sided["overall"]["k3_mean"] > 1e-2
    assert recommendation(two_sided)["regime"] == "config-bug"
