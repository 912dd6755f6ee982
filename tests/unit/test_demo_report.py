"""The demo's six-panel report (``megatron_mis.testbed.demo.report.draw_report``): which panels get a
log axis. A stale rollout's raw ratios run into the thousands while the applied weights stay near 1; on a
linear axis the weights panel then shows nothing (docs/demo_report.png before 2026-12-06)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")


def _records(ratio_lo: float, ratio_hi: float, k3: float, steps: int = 5) -> list[dict]:
    return [{"step": s, "reward_mean": 0.1 * s, "mis_k3_kl": k3 * (s + 1), "mis_k3_kl_max": 10 * k3 * (s + 1),
             "mis_log_ppl_abs_diff": 0.01, "mis_ratio_min": ratio_lo, "mis_ratio_max": ratio_hi,
             "is_weight_mean": 1.0, "is_weight_min": 1.0, "is_weight_max": 1.0, "rejected_token_fraction": 0.0,
             "lr": 3e-3} for s in range(steps)]


def _scales(runs: dict) -> dict:
    from megatron_mis.testbed.demo.report import draw_report

    ax_r, ax_k, ax_p, ax_w, ax_rej, ax_lr = draw_report(runs).axes
    return {"reward": ax_r.get_yscale(), "k3": ax_k.get_yscale(), "log-ppl": ax_p.get_yscale(),
            "weights": ax_w.get_yscale(), "rejected": ax_rej.get_yscale(), "lr": ax_lr.get_yscale()}


def test_stale_raw_ratios_put_the_weights_panel_on_a_log_axis():
    scales = _scales({"none": _records(1e-3, 1750.0, 1e-2), "bypass_ppo": _records(0.5, 30.0, 1e-3)})
    assert scales["weights"] == "log" and scales["k3"] == "log"
    assert scales["reward"] == scales["rejected"] == scales["lr"] == "linear"


def test_ratios_near_one_keep_a_linear_weights_panel():
    scales = _scales({"token_tis": _records(0.9, 1.1, 1e-4)})
    assert scales["weights"] == "linear"
    assert scales["k3"] == "log"  # 1e-4 (mean, step 0) to 5e-3 (max, step 4): a factor of 50
