"""megatron_mis.analysis.recommend: the correction rule on hand-derived cases."""

from __future__ import annotations

import math

import pytest

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
        (2e-2, 5, "token_mis", "config-bug"),  # K3 above numerics
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
    # measured: token TIS the correction that failed least at s 1.2-3.6 (1 collapse in 37); the band an option
    assert r.correction == "token_tis" and r.regime == "token-level"
    assert "long-tail-stale" in r.basis and "long-tail-stale-128" in r.basis and "Optional" in r.reason
    assert "1/37 collapses" in r.basis and "none in 2/37" in r.basis
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
