"""The study's verdicts and answers (``testbed/study/report.py``) on synthetic paired results whose
right answers are known by construction: each arm's per-seed final reward and K3 curve are chosen
so that every paired difference against its baseline is a fixed offset plus a small alternating
term (its bootstrap CI excludes 0 on a known side) or a pure alternating term (the CI holds 0).

Written for issue 33: a report with "supported" and "contradicted" swapped, or with "measurably
worse" tested on the wrong side of 0, passed every other test."""

from __future__ import annotations

import re

import pytest

from megatron_mis.testbed.study.config import StudyConfig
from megatron_mis.testbed.study.report import _verdict, format_markdown, summarize_study

SEEDS = range(6)
STEPS = 6
#: None's K3 per step: early (first third) 1e-6, late (last third) 4e-6: late/early ratio 4.
K3_NONE = [1e-6, 1e-6, 2e-6, 2e-6, 4e-6, 4e-6]


def _alt(seed: int, size: float) -> float:
    """The paired noise: +size on even seeds, -size on odd ones (mean 0 over the 6 seeds)."""
    return size if seed % 2 == 0 else -size


def _run(reward: float, k3: list[float], greedy: float | None = None, rejected: float = 0.0) -> dict:
    """A finished run whose reward is flat (final = start = peak = reward: no collapse)."""
    records = [
        {"step": t + 1, "reward_mean": reward, "mis_k3_kl": k3[t], "mis_k3_kl_max": 10 * k3[t],
         "rejected_token_fraction": rejected}
        for t in range(STEPS)
    ]
    end = {"evaluation": {"greedy_reward": reward if greedy is None else greedy, "greedy_exact": 0.0}, "wall_s": 1.0}
    return {"records": records, "end": end}


def _study(arms: list[str]) -> StudyConfig:
    return StudyConfig(arms=arms, seeds=len(SEEDS), bootstrap=400, last_k=2, plot=False)


def synthetic_runs() -> dict[str, dict[int, dict]]:
    """Per seed s (base reward b_s = 0.4 + 0.02 s):

    - none: reward b_s, K3 = K3_NONE;
    - ref_fp32: b_s + 0.2 +- 0.01 (none - ref = -0.2: none measurably worse than the reference);
    - token_mis: b_s + 0.1 +- 0.01, flat K3 (late/early 1 +- 0.05 against none's 4: suppressed);
    - sequence_mis: b_s + 0.3 +- 0.01 (beats token_mis by 0.2), K3 growing 8x (late/early 8:
      more late growth than none, the seed-000 claim contradicted);
    - length_decay: b_s - 0.15 +- 0.01 (measurably worse than none), mean K3 10^(+-0.1) x none's
      (log10 difference +-0.1, mean 0: not resolved).
    """
    runs: dict[str, dict[int, dict]] = {a: {} for a in ("none", "ref_fp32", "token_mis", "sequence_mis", "length_decay")}
    for s in SEEDS:
        b = 0.4 + 0.02 * s
        runs["none"][s] = _run(b, K3_NONE, rejected=0.0)
        runs["ref_fp32"][s] = _run(b + 0.2 + _alt(s, 0.01), [1e-9] * STEPS)
        late = 1.0 + _alt(s, 0.05)
        runs["token_mis"][s] = _run(b + 0.1 + _alt(s, 0.01), [1e-6, 1e-6, 1e-6, 1e-6, late * 1e-6, late * 1e-6], rejected=0.25)
        runs["sequence_mis"][s] = _run(b + 0.3 + _alt(s, 0.01), [1e-6, 1e-6, 3e-6, 3e-6, 8e-6, 8e-6])
        scale = 10 ** _alt(s, 0.1)
        runs["length_decay"][s] = _run(b - 0.15 + _alt(s, 0.01), [k * scale for k in K3_NONE], rejected=0.5)
    return runs


def _curve(run: dict, rewards: list[float]) -> dict:
    """``run`` with its per-step rewards set to ``rewards`` (a reward curve with a shape)."""
    for rec, r in zip(run["records"], rewards):
        rec["reward_mean"] = r
    return run


def _listed(part: str) -> list[str]:
    """The arm names of one half of the ``arms_vs_none`` answer ("ARM +0.123 [low, high] *, ...")."""
    return re.findall(r"(?:^|: |, )([a-z_0-9]+) [+-]\d", part)


@pytest.fixture(scope="module")
def summary():
    runs = synthetic_runs()
    return summarize_study(_study(list(runs)), runs)


def test_verdict_sides():
    above = {"excludes_zero": True, "low": 0.1, "high": 0.3, "n": 6}
    below = {"excludes_zero": True, "low": -0.3, "high": -0.1, "n": 6}
    holds_zero = {"excludes_zero": False, "low": -0.1, "high": 0.2, "n": 6}
    assert _verdict(above, supported_if="above") == "supported"
    assert _verdict(below, supported_if="above") == "contradicted"
    assert _verdict(below, supported_if="below") == "supported"
    assert _verdict(above, supported_if="below") == "contradicted"
    for side in ("above", "below"):
        assert _verdict(holds_zero, supported_if=side) == "not resolved (CI includes 0, n=6)"


def test_paired_differences_of_the_synthetic_study(summary):
    arms = summary["arms"]
    d = arms["sequence_mis"]["vs_none"]["final_reward"]
    assert d["n"] == 6 and d["mean"] == pytest.approx(0.3) and d["low"] > 0.28 and d["excludes_zero"]
    d = arms["length_decay"]["vs_none"]["final_reward"]
    assert d["mean"] == pytest.approx(-0.15) and d["high"] < -0.13 and d["excludes_zero"]
    d = arms["length_decay"]["vs_none"]["log10_k3_mean"]
    assert d["mean"] == pytest.approx(0.0, abs=1e-12) and d["low"] < 0 < d["high"] and not d["excludes_zero"]
    d = arms["token_mis"]["vs_none"]["k3_late_early"]
    assert d["mean"] == pytest.approx(1.0 - 4.0) and d["excludes_zero"]
    assert arms["none"]["vs_none"]["final_reward"] is None  # no difference of the baseline with itself


def test_answers_of_the_synthetic_study(summary):
    ans = summary["answers"]
    # none is 0.2 below the reference on every seed: the mismatch hurts
    assert ans["a_mismatch_hurts"].startswith("YES: ")
    assert "none - ref_fp32 final reward -0.200 [" in ans["a_mismatch_hurts"]
    assert "CI below 0: measurably worse" in ans["a_mismatch_hurts"]
    assert "none collapsed in 0/6 seeds" in ans["a_mismatch_hurts"]
    # ref_fp32's mean final reward 0.65 (CI about +-0.03) holds neither token_mis's 0.55 nor sequence_mis's 0.75
    assert ans["b_correction_recovers"].endswith("]: none")
    worse, better = ans["arms_vs_none"].split("; measurably better: ")
    assert _listed(worse) == ["length_decay"] and worse.endswith(" *, rejected 50%")
    assert worse.startswith("measurably worse than none (final reward): length_decay -0.150 [")
    assert _listed(better) == ["ref_fp32", "token_mis", "sequence_mis"]
    assert ans["seed001_sequence_beats_token"].startswith("sequence_mis - token_mis final reward +0.200 [")
    assert ans["seed001_sequence_beats_token"].endswith(": supported")
    assert ans["seed000_token_mis_suppresses_late_k3"].endswith(": supported")
    assert ans["seed000_sequence_mis_suppresses_late_k3"].endswith(": contradicted")
    assert ans["seed002_length_decay_keeps_k3_low"].endswith(": not resolved (CI includes 0, n=6)")
    text = format_markdown(summary)
    for key in ans:
        assert f"- **{key}**: {ans[key]}" in text


def test_a_reference_below_none_is_not_harm_and_recovery_is_listed():
    """The mirror case: none is 0.2 ABOVE the reference (CI above 0): not measurably worse, and a
    correction whose mean lies inside the reference's CI is listed as recovering."""
    runs = synthetic_runs()
    for s in SEEDS:
        b = 0.4 + 0.02 * s
        runs["ref_fp32"][s] = _run(b - 0.2 + _alt(s, 0.01), [1e-9] * STEPS)
        runs["token_mis"][s] = _run(b - 0.2 + _alt(s, 0.011), [1e-6] * STEPS)
    summary = summarize_study(_study(list(runs)), runs)
    ans = summary["answers"]
    assert ans["a_mismatch_hurts"].startswith("NO: ")
    assert "CI includes 0 or is above it: not measurably worse" in ans["a_mismatch_hurts"]
    # ref_fp32's mean 0.25 (CI about +-0.03) holds token_mis's mean 0.25, not sequence_mis's 0.75
    assert ans["b_correction_recovers"].startswith("arms whose mean final reward lies within ref_fp32's CI 0.250 [")
    assert ans["b_correction_recovers"].endswith("]: token_mis (0.250)")
    worse, better = ans["arms_vs_none"].split("; measurably better: ")
    assert _listed(worse) == ["ref_fp32", "token_mis", "length_decay"]
    assert _listed(better) == ["sequence_mis"]


def test_collapse_majority_of_none_is_harm():
    """4 of 6 runs of none gain 0.3 and fall back: a clear majority of collapses means YES even
    though none's final reward is not below the reference's."""
    runs = synthetic_runs()
    for s in SEEDS:
        b = 0.4 + 0.02 * s
        rewards = [b, b, b + 0.3, b + 0.3, b, b] if s < 4 else [b] * STEPS
        runs["none"][s] = _curve(_run(b, K3_NONE), rewards)
        runs["ref_fp32"][s] = _run(b + _alt(s, 0.01), [1e-9] * STEPS)
    summary = summarize_study(_study(list(runs)), runs)
    assert summary["arms"]["none"]["collapse"]["k"] == 4
    ans = summary["answers"]["a_mismatch_hurts"]
    assert ans.startswith("YES: ") and "none collapsed in 4/6 seeds (a clear majority)" in ans
    assert "not measurably worse" in ans


def test_ended_low_counts_runs_that_never_reach_the_plateau():
    """The reference gains 0.3 on every seed (start 0.1, the last steps 0.4), so the bar is
    (1 - 0.5) x 0.3 = 0.15 of final - start. With last_k = 2 over 6 steps:

    - none rises to +0.2 and stays: kept 0.2 >= 0.15, not low, and no collapse;
    - sequence_mis learns nothing (flat 0.1): kept 0, low, but no collapse (it never gained 0.1);
    - token_mis rises to +0.14 and stays: kept 0.14 < 0.15, low, no collapse (gain 0.14, kept all);
    - length_decay rises to +0.3, falls back to +0.1: a collapse and low.
    """
    runs: dict[str, dict[int, dict]] = {a: {} for a in ("none", "ref_fp32", "token_mis", "sequence_mis", "length_decay")}
    shapes = {
        "ref_fp32": [0.1, 0.1, 0.3, 0.4, 0.4, 0.4],
        "none": [0.1, 0.1, 0.2, 0.3, 0.3, 0.3],
        "sequence_mis": [0.1] * STEPS,
        "token_mis": [0.1, 0.1, 0.2, 0.24, 0.24, 0.24],
        "length_decay": [0.1, 0.1, 0.4, 0.4, 0.2, 0.2],
    }
    for s in SEEDS:
        for arm, shape in shapes.items():
            runs[arm][s] = _curve(_run(0.0, [1e-6] * STEPS), shape)
    summary = summarize_study(_study(list(runs)), runs)
    arms = summary["arms"]
    n = len(SEEDS)
    low = {a: (arms[a]["ended_low"]["k"], arms[a]["collapse"]["k"]) for a in arms}
    assert low == {"ref_fp32": (0, 0), "none": (0, 0), "sequence_mis": (n, 0), "token_mis": (n, 0), "length_decay": (n, n)}
    assert arms["none"]["ended_low"]["bar"] == pytest.approx(0.15)
    assert arms["none"]["ended_low"]["reference"] == "ref_fp32"
    assert f"| sequence_mis | {n} |" in format_markdown(summary)
    row = next(line for line in format_markdown(summary).splitlines() if line.startswith("| sequence_mis |"))
    assert row.split(" | ")[4:6] == ["0/6", "6/6"]  # collapse, ended low
    # a reference that gained less than MIN_GAIN leaves nothing to lose: no count
    for s in SEEDS:
        runs["ref_fp32"][s] = _curve(_run(0.0, [1e-9] * STEPS), [0.1, 0.1, 0.15, 0.15, 0.15, 0.15])
    assert summarize_study(_study(list(runs)), runs)["arms"]["none"]["ended_low"] is None
    # without a reference arm: no count either
    del runs["ref_fp32"]
    assert summarize_study(_study(list(runs)), runs)["arms"]["none"]["ended_low"] is None


def test_steps_to_threshold_is_the_settings_own_unless_given():
    """The long-tail task plateaus at 0.34-0.39, so its settings time the take-off at 0.2; the
    others keep 0.5; an explicit threshold wins. With last_k = 2 the curve below has its 2-step
    means 0.1, 0.1, 0.225, 0.375, 0.35 (steps 2..6): 0.2 is first reached at step 4, 0.3 at step 5
    and 0.5 never."""
    from megatron_mis.testbed.study.config import SWEEPS

    long_tail = [name for name in SWEEPS if name.startswith("long-tail")]
    assert long_tail and all(SWEEPS[n].threshold == 0.2 for n in long_tail)
    assert all(w.threshold == 0.5 for n, w in SWEEPS.items() if n not in long_tail)
    assert StudyConfig(sweep="long-tail-stale-256").resolved_threshold == 0.2
    assert StudyConfig(sweep="long-tail-stale-256").for_dose("k1").resolved_threshold == 0.2
    assert StudyConfig(sweep="staleness").for_dose("k2").resolved_threshold == 0.5
    assert StudyConfig().resolved_threshold == 0.5
    assert StudyConfig(sweep="long-tail", threshold=0.3).for_dose("s61").resolved_threshold == 0.3

    curve = [0.1, 0.1, 0.1, 0.35, 0.4, 0.3]
    runs = {"none": {s: _curve(_run(0.0, [1e-6] * STEPS), curve) for s in SEEDS}}

    def reached(**kw) -> dict:
        study = StudyConfig(arms=["none"], seeds=len(SEEDS), bootstrap=400, last_k=2, plot=False, **kw)
        summary = summarize_study(study, runs)
        return summary["threshold"], summary["arms"]["none"]["steps_to_threshold"]

    threshold, t = reached(setting="long-tail-stale-256-k1")
    assert threshold == 0.2 and t["reached"] == len(SEEDS) and t["mean"][0] == 4
    threshold, t = reached(setting="int4")
    assert threshold == 0.5 and t["reached"] == 0 and t["mean"] is None
    threshold, t = reached(setting="int4", threshold=0.3)
    assert threshold == 0.3 and t["reached"] == len(SEEDS) and t["mean"][0] == 5


    # paired against the reference and none, over the seeds on which both reached it: the reference
    # reaches 0.2 at step 3 (2-step means 0.1, 0.225, ...) on every seed, sequence_mis (flat 0.1)
    # never, token_mis at step 4 on even seeds and 5 on odd ones
    runs["ref_fp32"] = {s: _curve(_run(0.0, [1e-6] * STEPS), [0.1, 0.1, 0.35, 0.4, 0.4, 0.4]) for s in SEEDS}
    runs["sequence_mis"] = {s: _curve(_run(0.0, [1e-6] * STEPS), [0.1] * STEPS) for s in SEEDS}
    runs["token_mis"] = {s: _curve(_run(0.0, [1e-6] * STEPS), curve if s % 2 == 0 else [0.1, 0.1, 0.1, 0.1, 0.35, 0.4])
                         for s in SEEDS}
    study = StudyConfig(setting="long-tail-stale-256-k1", arms=list(runs), seeds=len(SEEDS), bootstrap=400, last_k=2, plot=False)
    arms = summarize_study(study, runs)["arms"]
    d = arms["none"]["vs_reference"]["steps_to_threshold"]
    assert d["n"] == len(SEEDS) and d["mean"] == d["low"] == d["high"] == 1 and d["excludes_zero"]
    d = arms["token_mis"]["vs_none"]["steps_to_threshold"]
    assert d["diffs"] == {s: s % 2 for s in SEEDS} and d["mean"] == pytest.approx(0.5)
    assert arms["sequence_mis"]["vs_reference"]["steps_to_threshold"] is None  # no seed on which both reached it


def test_sweep_report_shows_the_mean_first_step_of_the_runs_that_reached_the_threshold():
    from megatron_mis.testbed.study.sweep_report import _fmt_paired_steps, _fmt_reached

    assert _fmt_reached({"reached": 3, "n": 4, "mean": [151.4, 114.0, 224.0]}) == "3/4 (151 [114, 224])"
    assert _fmt_reached({"reached": 0, "n": 4, "mean": None}) == "0/4"
    d = {"n": 5, "mean": -27.4, "low": -48.2, "high": -4.0, "excludes_zero": True}
    assert _fmt_paired_steps(d) == "-27 [-48, -4] * (n 5)"
    assert _fmt_paired_steps(None) == "-"


def test_machine_label_names_the_isa_where_the_run_recorded_it():
    from megatron_mis.testbed.study.runner import machine_label

    old = {"cpu": "AMD EPYC", "python": "3.11.7", "torch": "2.13.0+cpu"}  # a run made before the ISA was recorded
    assert machine_label({"header": {"machine": old}}) == "AMD EPYC, Python 3.11.7, torch 2.13.0+cpu"
    isa = {**old, "cpu_capability": "AVX512"}  # a run made before the family and model were recorded
    assert machine_label({"header": {"machine": isa}}) == "AMD EPYC [AVX512], Python 3.11.7, torch 2.13.0+cpu"
    new = {**isa, "cpu_family_model": "25/17"}
    assert machine_label({"header": {"machine": new}}) == ("AMD EPYC (family 25 model 17) [AVX512], Python 3.11.7, "
                                                            "torch 2.13.0+cpu")
    assert machine_label({"header": {}}) == "not recorded"


def test_top_p_settings_compare_the_greedy_reward_where_the_training_reward_misleads():
    """Top-p sampling raises the reward of the samples themselves, so a truncated run's training
    reward beats the untruncated reference's while its policy may be worse. The synthetic runs
    below have exactly that: none's training reward is the reference's + 0.1, its greedy reward
    the reference's - 0.1 (+- 0.01 alternating). A top-p setting's answers must read the greedy
    reward (none measurably worse); the same runs under a setting that compares the training
    reward read it as not worse."""
    from megatron_mis.testbed.study.config import SETTINGS, SWEEPS

    greedy = {n for n, w in SWEEPS.items() if w.outcome == "greedy_reward"}
    assert greedy == {f"{task}-{kind}" for task in ("top-p", "long-tail-top-p", "long-tail-top-k")
                      for kind in ("raw", "processed", "replay")} | {
        f"long-tail-{mech}-replay-full-entropy" for mech in ("top-p", "top-k")}
    assert SETTINGS["top-p-raw-p0.8"].outcome == "greedy_reward"
    assert SETTINGS["temperature-t0.5"].outcome == "final_reward"
    runs = {"none": {}, "ref_fp32": {}, "token_tis": {}}
    for s in SEEDS:
        b = 0.4 + 0.02 * s
        runs["ref_fp32"][s] = _run(b, [1e-9] * STEPS, greedy=b)
        runs["none"][s] = _run(b + 0.1 + _alt(s, 0.01), K3_NONE, greedy=b - 0.1 + _alt(s, 0.01))
        runs["token_tis"][s] = _run(b + 0.1, K3_NONE, greedy=b - 0.1 + _alt(s, 0.01) + 0.05)  # greedy: none + 0.05

    def summary(setting: str) -> dict:
        study = StudyConfig(setting=setting, arms=list(runs), seeds=len(SEEDS), bootstrap=400, last_k=2, plot=False)
        return summarize_study(study, runs)

    top_p = summary("top-p-raw-p0.8")
    assert top_p["outcome"] == "greedy_reward"
    d = top_p["arms"]["none"]["vs_reference"]["greedy_reward"]
    assert d["mean"] == pytest.approx(-0.1) and d["excludes_zero"] and d["high"] < 0
    answers = top_p["answers"]
    assert answers["a_mismatch_hurts"].startswith("YES: none - ref_fp32 greedy reward -0.100")
    worse, better = answers["arms_vs_none"].split("; ")
    assert worse == "measurably worse than none (greedy reward): none of them"
    assert _listed(better) == ["ref_fp32", "token_tis"] and "token_tis +0.050" in better
    assert "compare the arms on the greedy reward" in format_markdown(top_p)

    final = summary("temperature-t0.5")
    assert final["outcome"] == "final_reward"
    assert final["answers"]["a_mismatch_hurts"].startswith("NO: none - ref_fp32 final reward +0.100")
    assert "measurably better: none of them" in final["answers"]["arms_vs_none"]  # training rewards equal
    assert "compare the arms on the" not in format_markdown(final)


def test_a_setting_with_an_unknown_outcome_is_refused():
    from megatron_mis.testbed.study.config import Setting

    with pytest.raises(ValueError, match=r"outcome='reward'.*'final_reward', 'greedy_reward'"):
        Setting("x", "a setting", {}, outcome="reward")
