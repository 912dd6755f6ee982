"""``megatron-mis demo`` end to end in its short mode (``--quick``: 3 steps of 4 prompts x 4
samples): metrics.jsonl, a readable PNG, the comparison table; the mismatch is fp32 rounding with
fp32 rollouts, real with bf16 ones, exactly zero on the true-on-policy path; TP=2 and CP=2 runs
(spawned gloo processes) reproduce the single-process step; bad flags are reported at once.

Single-process runs happen in this process (the launcher initialises and tears down a gloo group
of one); multi-process runs are spawned by the launcher."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from megatron_mis.cli import main

TIME_KEYS = ("time_rollout_s", "time_rollout_fast_s", "time_recompute_s", "time_train_s", "time_step_s", "wall_s")


def run_demo(tmp_path, *flags: str, name: str = "t"):
    """Run the CLI in this process; returns (exit code, stdout, stderr, records)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["demo", "--quick", "--no-progress", "--out-dir", str(tmp_path), "--name", name, *flags])
    path = tmp_path / name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rc, out.getvalue(), err.getvalue(), records


def _check_png(path):
    """The report exists, decodes, has the six-panel size and is not blank."""
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    assert img.shape[0] >= 400 and img.shape[1] >= 800, img.shape
    rgb = img[..., :3]
    assert float(rgb.std()) > 0.05  # lines and text, not a blank canvas
    assert float((rgb.min(axis=-1) < 0.5).mean()) > 0.005  # dark pixels: axes, text, curves
    assert path.stat().st_size < 300_000


def test_default_quick_run_bf16_mismatch_is_real(tmp_path):
    rc, out, err, recs = run_demo(tmp_path)
    assert rc == 0, err
    assert [r["step"] for r in recs] == [1, 2, 3] and {r["run"] for r in recs} == {"token_tis"}
    for key in ("reward_mean", "reward_max", "accuracy", "response_length_mean", "mis_k3_kl", "mis_k3_kl_max",
                "mis_log_ppl_abs_diff", "mis_ratio_min", "mis_ratio_max", "is_weight_mean", "is_weight_min",
                "is_weight_max", "rejected_token_fraction", "lr", "grad_norm", "loss", "logprob_abs_diff_max",
                *TIME_KEYS[:1], "time_train_s", "wall_s"):
        assert all(key in r and r[key] is not None for r in recs), key
    for r in recs:
        # bf16 rollouts against the fp32 recompute (measured on these steps: K3 ~4e-7, max |diff| ~3e-3)
        assert r["mis_k3_kl"] > 1e-9 and r["mis_k3_kl_max"] > r["mis_k3_kl"]
        assert r["logprob_abs_diff_max"] > 1e-4 and not r["logprob_bitwise_equal"]
        assert r["mis_ratio_max"] - r["mis_ratio_min"] > 1e-4
        # token TIS truncates at 2: the applied weights are the raw ratios here
        assert r["is_weight_min"] == pytest.approx(r["mis_ratio_min"], rel=1e-6)
        assert r["lr"] == 3e-3 and math.isfinite(r["loss"])
    _check_png(tmp_path / "t" / "report.png")
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["config"]["rollout_precision"] is None and "token_tis" in summary["summaries"]
    assert "[token_tis] reward" in out and "greedy: <bos>" in out and "greedy decoding of 64" in out


def test_fp32_rollouts_mismatch_is_rounding_and_runs_are_deterministic(tmp_path):
    rc, _, err, recs = run_demo(tmp_path, "--rollout-precision", "fp32", name="a")
    assert rc == 0, err
    for r in recs:
        # Same weights, different kernels and shapes (KV-cache decode vs the packed trainer
        # forward): float32 rounding only (measured max |diff| ~5e-7, K3 ~1e-13).
        assert 0 < r["logprob_abs_diff_max"] < 5e-6
        assert r["mis_k3_kl"] < 1e-12 and r["mis_k3_kl_max"] < 1e-11
        assert r["mis_log_ppl_abs_diff"] < 1e-6
        for key in ("mis_ratio_min", "mis_ratio_max", "is_weight_min", "is_weight_max", "is_weight_mean"):
            assert abs(r[key] - 1.0) < 1e-5, key
        assert r["rejected_token_fraction"] == 0.0
    rc, _, err, again = run_demo(tmp_path, "--rollout-precision", "fp32", name="b")
    assert rc == 0, err
    strip = [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs]
    assert strip == [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in again]


def test_true_on_policy_compare_is_exactly_zero_and_prints_the_table(tmp_path):
    from megatron_mis.testbed.study.config import DEMO_COMPARE_SETTING, SETTINGS

    rc, out, err, recs = run_demo(tmp_path, "--true-on-policy", "--compare")
    assert rc == 0, err
    # the default compare setting's correction, its staleness dropped (true on-policy has no mismatch)
    correction = SETTINGS[DEMO_COMPARE_SETTING].demo_correction
    assert [r["run"] for r in recs] == ["none"] * 3 + [correction] * 3
    assert all(r["policy_lag"] == 0 for r in recs)
    for r in recs:
        assert r["logprob_bitwise_equal"] is True and r["logprob_abs_diff_max"] == 0.0
        assert r["mis_k3_kl"] == 0.0 and r["mis_k3_kl_max"] == 0.0 and r["mis_log_ppl_abs_diff"] == 0.0
        assert r["mis_ratio_min"] == r["mis_ratio_max"] == 1.0
        assert r["is_weight_min"] == r["is_weight_max"] == 1.0
        assert r["time_rollout_fast_s"] > 0
    # both runs start from the same weights and seed: the same first batch
    assert recs[0]["reward_mean"] == recs[3]["reward_mean"]
    table = out[out.index("reward (first 10%)") - 200 :]
    assert "none" in table and correction in table
    for title in ("peak reward", "K3 KL mean", "K3 KL max", "log-ppl abs diff", "rejected tokens", "wall time"):
        assert title in table
    assert "bitwise equal at every step" in out
    _check_png(tmp_path / "t" / "report.png")


def test_length_decay_schedule_and_eos(tmp_path):
    """--lr-surge-step 1 pins the trigger: period round(1.8 x 1) = 2, so step 2 halves the rate."""
    rc, out, err, recs = run_demo(tmp_path, "--eos", "--lr-schedule", "length-decay", "--lr-surge-step", "1", "--no-plot")
    assert rc == 0, err
    assert [r["lr"] for r in recs] == pytest.approx([3e-3, 1.5e-3, 1.5e-3])
    assert "triggered at step 1, period 2" in out
    assert not (tmp_path / "t" / "report.png").exists()


def test_tp2_and_cp2_reproduce_the_single_process_step(tmp_path):
    """Spawned gloo processes: the first step (same initial weights, so the same rollout) has the
    same rewards and, to fp32 rounding of the split matmuls / attention, the same loss and
    gradient norm as the single-process run."""
    rc, _, err, ref = run_demo(tmp_path, "--rollout-precision", "fp32", "--no-plot", name="ref")
    assert rc == 0, err
    for flags in (("--tp", "2"), ("--cp", "2")):
        rc, out, err, recs = run_demo(tmp_path, "--rollout-precision", "fp32", *flags, name=flags[0][2:])
        assert rc == 0, err
        assert "2 process(es)" in out
        assert len(recs) == 3
        a, b = recs[0], ref[0]
        assert a["reward_mean"] == b["reward_mean"] and a["response_length_mean"] == b["response_length_mean"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["logprob_abs_diff_max"] < 5e-6
        _check_png(tmp_path / flags[0][2:] / "report.png")
    # true on-policy through Megatron's schedule under TP=2: bitwise at every step
    rc, out, err, recs = run_demo(tmp_path, "--tp", "2", "--true-on-policy", "--no-plot", name="top2")
    assert rc == 0, err
    assert all(r["logprob_bitwise_equal"] and r["logprob_abs_diff_max"] == 0.0 for r in recs)


def test_the_log_prob_dump_is_what_the_step_measured_and_analyze_reads_it(tmp_path, capsys):
    """--dump-log-probs DIR: one file per step and data-parallel rank (here dp = 2, spawned), one line
    per sequence; the K3 recomputed from the dumped log-probs by hand is the step's ``mis_k3_kl``;
    ``megatron-mis analyze`` reads the folder as a host's dumps (one row per step, the same K3); the
    run's records equal those of the same run without the dump."""
    flags = ("--correction", "none", "--temperature", "0.5", "--trainer-temperature", "1", "--dp", "2", "--no-plot")
    dump = tmp_path / "dump"
    rc, _, err, recs = run_demo(tmp_path, *flags, "--dump-log-probs", str(dump), name="dumped")
    assert rc == 0, err
    files = sorted(p.name for p in (dump / "none").iterdir())
    assert files == [f"step-{s:05d}.dp-{r}.jsonl" for s in (1, 2, 3) for r in (0, 1)]
    for rec in recs:
        rows = [json.loads(line) for r in (0, 1)
                for line in (dump / "none" / f"step-{rec['step']:05d}.dp-{r}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and {row["rollout_id"] for row in rows} == {rec["step"] - 1}  # 4 prompts x 4 samples
        k3 = []
        for row in rows:
            assert len(row["train_log_probs"]) == len(row["rollout_log_probs"]) == len(row["loss_mask"]) >= 1
            k3 += [math.exp(t - r) - 1 - (t - r) for t, r in zip(row["train_log_probs"], row["rollout_log_probs"])]
        # a temperature the trainer does not apply: a real mismatch, the one the step measured
        assert rec["mis_k3_kl"] > 1e-3 and sum(k3) / len(k3) == pytest.approx(rec["mis_k3_kl"], rel=1e-4)
    assert main(["analyze", str(dump / "none"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["rollout_id"] for row in report["rows"]] == [0, 1, 2]
    assert [row["k3_mean"] for row in report["rows"]] == pytest.approx([r["mis_k3_kl"] for r in recs], rel=1e-4)
    # K3 far above numerics, and two-sided (a full-support mismatch: the ratios average 1), so not
    # the one-sided truncation regime
    assert report["overall"]["k3_mean"] > 1e-2 and report["recommendation"]["regime"] == "config-bug"
    rc, _, err, plain = run_demo(tmp_path, *flags, name="plain")
    assert rc == 0, err
    assert [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs] == [
        {k: v for k, v in r.items() if k not in TIME_KEYS} for r in plain]
    assert not list(dump.rglob("*.tmp"))


def test_bad_flags_are_reported_together(tmp_path, capsys):
    rc = main([
        "demo", "--true-on-policy", "--rollout-precision", "bf16", "--cp", "2", "--correction", "tokn_tis",
        "--prompts-per-step", "3", "--out-dir", str(tmp_path), "--dump-log-probs", "",
    ])
    err = capsys.readouterr().err
    assert rc == 2
    for part in ("needs rollout_precision fp32", "cp=2", "unknown preset 'tokn_tis'", "did you mean", "token_tis",
                 "must split into dp=1", "dump_log_probs='' must be a folder path"):
        assert part in err, part
    assert main(["demo", "--compare", "--correction", "none"]) == 2
    assert "runs the baseline (none) against CORRECTION" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("use_tis: true\ntis_levle: token\n")
    assert main(["demo", "--correction", str(bad)]) == 2
    assert "unknown key 'tis_levle'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--rollout-precision", "fp8"])
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]  # nothing ran


def test_preset_and_compare_start_from_the_study_setting():
    from megatron_mis.cli.demo import build_config
    from megatron_mis.cli import build_parser
    from megatron_mis.testbed.study.config import DEFAULT_SETTING, DEMO_COMPARE_SETTING, SETTINGS

    parse = build_parser().parse_args
    # --compare without --preset runs the setting where the study found a correction closing a gap
    # (stale rollouts), not the study's default setting (int4, where no correction changed anything)
    assert parse(["demo", "--preset", DEMO_COMPARE_SETTING]).preset == DEMO_COMPARE_SETTING  # a valid --preset
    found = SETTINGS[DEMO_COMPARE_SETTING]
    assert DEMO_COMPARE_SETTING != DEFAULT_SETTING and found.demo_correction != "none"
    assert found.overrides["staleness"] > 0
    cfg = build_config(parse(["demo", "--compare"]))
    assert cfg.compare and cfg.correction == found.demo_correction
    assert all(getattr(cfg, k) == v for k, v in found.overrides.items())
    assert cfg.arms == ["none", found.demo_correction]
    cfg = build_config(parse(["demo", "--compare", "--preset", DEFAULT_SETTING]))  # the int4 comparison
    assert cfg.precision == "int4" and cfg.staleness == 0 and cfg.correction == SETTINGS[DEFAULT_SETTING].demo_correction
    cfg = build_config(parse(["demo", "--preset", "bf16", "--rollout-precision", "fp16", "--steps", "7", "--quick"]))
    assert cfg.precision == "fp16" and cfg.steps == 7 and cfg.prompts_per_step == 4 and not cfg.compare
    cfg = build_config(parse(["demo", "--compare", "--true-on-policy"]))  # the preset's precision yields
    assert cfg.true_on_policy and cfg.precision == "fp32"
    assert build_config(parse(["demo"])).precision == "bf16"  # no preset without --compare


def test_help_documents_every_flag(capsys):
    from megatron_mis.testbed.demo.config import DemoConfig

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    for name in DemoConfig.field_names():
        flag = {"progress": "--no-progress", "plot": "--no-plot"}.get(name, "--" + name.replace("_", "-"))
        assert flag in text, flag
    assert "--quick" in text and "--preset" in text


def test_sigterm_stops_a_multi_process_demo_and_its_ranks(tmp_path):
    """SIGTERM to `megatron-mis demo --tp 2` (a scheduler's time limit, `kill`) while its ranks
    train: the command exits with 128 + 15 and says so, both ranks are gone within 10 s (no process
    with the run's marker in its environment is left, as orphaned ranks would be: they would train
    on to the end) and the launcher's scratch folder is removed. Without the handler the parent dies at
    once and its ranks run on."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    marker = f"MEGATRON_MIS_TEST_RUN={uuid.uuid4().hex}".encode()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "MEGATRON_MIS_TEST_RUN": marker.split(b"=")[1].decode()}

    def marked() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if marker in f.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:  # gone, or not ours
                    pass
        return pids

    proc = subprocess.Popen([sys.executable, "-m", "megatron_mis", "demo", "--tp", "2", "--steps", "2000", "--no-progress",
                             "--no-plot", "--out-dir", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "out" / "demo" / "metrics.jsonl"
    try:
        t0 = time.monotonic()  # a step written: the ranks have met and the reporting rank's bar exists
        while not (metrics.exists() and metrics.read_text()) and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.1)
        # the parent, its two ranks and multiprocessing's resource tracker
        assert proc.poll() is None and len(marked()) >= 3, "the two ranks did not write a step within 300 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert f"megatron-mis demo: stopped by SIGTERM; its ranks were stopped (the steps it finished, if any, are in {metrics}" in err, err[-2000:]
        # the killed ranks registered no semaphore that outlives them (tqdm's default lock is one)
        assert "leaked semaphore" not in err, err[-2000:]
        t1 = time.monotonic()  # the resource tracker leaves when its pipe closes
        while marked() and time.monotonic() - t1 < 10:
            time.sleep(0.2)
        assert marked() == []
        assert not list(tmp.glob("megatron_mis_demo_*")), sorted(p.name for p in tmp.iterdir())
    finally:
        for pid in marked():
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
