"""Dose-response sweeps (issue 29): the sweeps' settings and arms, the seed rule, and
``megatron-mis study --sweep`` end to end on a tiny budget (runs, resume, report)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from megatron_mis.cli import main
from megatron_mis.config import ConfigError
from megatron_mis.testbed.study.config import SETTINGS, SWEEPS, StudyConfig, run_config
from megatron_mis.testbed.study.stats import minimal_detectable_effect, seeds_for_effect


def test_seed_rule_hand_derived():
    # (1.959964 + 0.841621) = 2.801585; SD 0.11, effect 0.05: (2.801585 * 2.2)^2 = 37.99 -> 38 seeds
    assert seeds_for_effect(0.11, 0.05) == 38
    assert seeds_for_effect(0.0, 0.05) == 2  # never fewer than a pair
    assert minimal_detectable_effect(0.11, 8) == pytest.approx(2.801585 * 0.11 / math.sqrt(8), rel=1e-6)
    with pytest.raises(ValueError, match="effect=0"):
        seeds_for_effect(0.1, 0)
    with pytest.raises(ValueError, match="n=0"):
        minimal_detectable_effect(0.1, 0)


def test_sweep_settings_carry_their_dose_and_the_reference_resets_it():
    assert set(SWEEPS) >= {"staleness", "temperature", "top-p-raw", "top-p-processed"}
    assert SWEEPS["staleness"].labels == ["k0", "k1", "k2", "k4", "k8", "k16"]
    study = StudyConfig(sweep="staleness")
    assert study.resolved_steps == 300 and study.dose_labels == SWEEPS["staleness"].labels
    assert {"decoupled_ppo", "bypass_ppo", "none", "ref_fp32"} <= set(study.arm_names)
    k8 = study.for_dose("k8")
    assert run_config(k8, "none", 0).staleness == 8 and run_config(k8, "decoupled_ppo", 0).correction == "decoupled_ppo"
    assert run_config(k8, "ref_fp32", 0).staleness == 0  # the reference is fresh
    t = StudyConfig(sweep="temperature").for_dose("t0.5")
    cfg = run_config(t, "none", 1)
    assert cfg.temperature == 0.5 and cfg.resolved_trainer_temperature == 1.0
    assert run_config(t, "ref_fp32", 1).resolved_trainer_temperature == 0.5  # the trainer uses the rollout's T
    p = run_config(StudyConfig(sweep="top-p-processed").for_dose("p0.9"), "none", 0)
    assert p.top_p == 0.9 and p.rollout_logprobs == "processed"
    # the staleness / sampling sweeps isolate their mechanism: fp32 rollouts
    assert all(SETTINGS[w.setting_name(lab)].overrides["rollout_precision"] == "fp32"
               for w in SWEEPS.values() if not w.name.startswith(("long-tail", "moe")) for lab in w.labels)
    lt = run_config(StudyConfig(sweep="long-tail").for_dose("s253"), "none", 0)
    assert (lt.vocab_size, lt.scratchpad, lt.precision, lt.distractors) == (512, 253, "int4", 4)
    assert (lt.entropy_coef, lt.scratchpad_position) == (0.03, "after")  # the tail stays high-entropy
    stale = StudyConfig(sweep="long-tail-stale").for_dose("k2")
    ls, lr = run_config(stale, "none", 0), run_config(stale, "ref_fp32", 0)
    assert (ls.staleness, ls.scratchpad, ls.precision, lr.staleness, lr.precision) == (2, 61, "int4", 0, "fp32")
    assert "zscore_rs_token_mis" in stale.arm_names and "sequence_tis" in stale.arm_names
    # the 128-token variant: twice the length, the same task otherwise; its k0 is long-tail-precision's int4
    stale128 = StudyConfig(sweep="long-tail-stale-128")
    l1 = run_config(stale128.for_dose("k1"), "none", 0)
    assert (l1.staleness, l1.scratchpad, l1.precision) == (1, 125, "int4")
    assert run_config(stale128.for_dose("k1"), "ref_fp32", 0).staleness == 0
    assert run_config(stale128.for_dose("k0"), "none", 0) == run_config(
        StudyConfig(sweep="long-tail-precision").for_dose("int4"), "none", 0)
    # the 256-token variant: its k0 is the long-tail sweep's s253 (the same resolved configuration)
    stale256 = StudyConfig(sweep="long-tail-stale-256")
    l256 = run_config(stale256.for_dose("k1"), "none", 0)
    assert (l256.staleness, l256.scratchpad, l256.precision, l256.vocab_size) == (1, 253, "int4", 512)
    assert run_config(stale256.for_dose("k1"), "ref_fp32", 0).staleness == 0
    assert stale256.arm_names[:4] == ["none", "ref_fp32", "token_tis", "sequence_mis"]
    assert run_config(stale256.for_dose("k0"), "none", 0) == run_config(StudyConfig(sweep="long-tail").for_dose("s253"), "none", 0)
    # top-p on the long-tail task: fp32 rollouts (truncation is the only mechanism), 64-token responses
    ltp = {kind: run_config(StudyConfig(sweep=f"long-tail-top-p-{kind}").for_dose("p0.8"), "none", 0)
           for kind in ("raw", "processed", "replay")}
    assert {(c.precision, c.vocab_size, c.scratchpad, c.top_p) for c in ltp.values()} == {("fp32", 512, 61, 0.8)}
    assert [(c.rollout_logprobs, c.trainer_truncation) for c in ltp.values()] == [
        ("raw", False), ("processed", False), ("processed", True)]
    p1 = run_config(StudyConfig(sweep="long-tail-top-p-replay").for_dose("p1"), "none", 0)
    assert (p1.top_p, p1.rollout_logprobs, p1.trainer_truncation) == (1.0, "raw", False)  # p1 has nothing to replay
    ltk = {kind: run_config(StudyConfig(sweep=f"long-tail-top-k-{kind}").for_dose("k64"), "none", 0)
           for kind in ("raw", "processed", "replay", "replay-full-entropy")}
    assert {(c.precision, c.scratchpad, c.top_k, c.top_p) for c in ltk.values()} == {("fp32", 61, 64, 1.0)}
    assert [(c.rollout_logprobs, c.trainer_truncation, c.replay_entropy) for c in ltk.values()] == [
        ("raw", False, "kept"), ("processed", False, "kept"), ("processed", True, "kept"), ("processed", True, "full")]
    # the replay as slime's differs from the archived replay in the entropy alone
    assert dataclasses.replace(ltk["replay-full-entropy"], replay_entropy="kept") == ltk["replay"]
    # the reference is one configuration at every dose of the eight (the archive copies it)
    refs = [run_config(StudyConfig(sweep=f"long-tail-{m}-{k}").for_dose(d), "ref_fp32", 0)
            for k in ("raw", "processed", "replay", "replay-full-entropy")
            for m, d in (("top-p", "p1"), ("top-p", "p0.9"), ("top-k", "k16"))]
    assert all(r == refs[0] for r in refs) and refs[0].top_p == 1.0 and refs[0].precision == "fp32"
    assert [run_config(StudyConfig(sweep="long-tail-precision").for_dose(p), "none", 0).precision
            for p in ("bf16", "int8", "int4")] == ["bf16", "int8", "int4"]
    moe = StudyConfig(sweep="moe-ties")
    assert "r3" in moe.arm_names and run_config(moe.for_dose("e64"), "r3", 0).routing_replay
    assert [run_config(moe.for_dose(e), "none", 0).num_moe_experts for e in ("e16", "e32", "e64")] == [16, 32, 64]
    noise = StudyConfig(sweep="moe-noise")
    n2 = run_config(noise.for_dose("n0.2"), "none", 0)
    assert (n2.rollout_router_noise, n2.precision, n2.num_moe_experts) == (0.2, "fp32", 16)
    assert run_config(noise.for_dose("n0.2"), "r3", 0).routing_replay
    assert run_config(noise.for_dose("n0.2"), "ref_fp32", 0).rollout_router_noise == 0.0  # the reference routes noiselessly
    mixed = StudyConfig(sweep="staleness-mixed").for_dose("f0.25")
    mn, mr = run_config(mixed, "none", 0), run_config(mixed, "ref_fp32", 0)
    assert (mn.staleness, mn.stale_fraction, mr.staleness, mr.stale_fraction) == (8, 0.25, 0, 1.0)
    assert {"geo_rs_token_tis", "zscore_rs_token_mis", "bypass_ppo"} <= set(mixed.arm_names)
    # demo --compare --preset staleness-mixed-f0.25: the sweep's best arm (bypass) against none
    assert SETTINGS["staleness-mixed-f0.25"].demo_values()["correction"] == "bypass_ppo"
    # megatron-mis demo --compare --preset staleness-k4 sets bypass PPO (the sweep's best) against none
    assert SETTINGS["staleness-k4"].demo_values()["correction"] == "bypass_ppo"
    assert SETTINGS["staleness-k4"].demo_values()["staleness"] == 4
    quick = StudyConfig(sweep="temperature", quick=True)
    assert quick.dose_labels == ["t1", "t1.5"] and quick.resolved_steps == 4
    with pytest.raises(ConfigError) as e:
        StudyConfig(sweep="temperature", doses=["t7"])
    assert "doses=['t7']" in str(e.value)
    with pytest.raises(ConfigError, match="doses needs a sweep"):
        StudyConfig(doses=["t1"])


def test_sweep_row_extras_hand_derived():
    """The sweep report's per-arm extras: the mean gradient norm and rejected-sequence share over
    every step of every seed, and the runs the monitor flagged on a mismatch metric / on any."""
    from megatron_mis.testbed.study.sweep_report import _run_extras

    runs = {
        0: {"records": [{"grad_norm": 1.0, "rejected_seq_fraction": 0.25, "monitor_warnings": []},
                        {"grad_norm": 3.0, "rejected_seq_fraction": 0.0, "monitor_warnings": ["mis_k3_kl is rising"]}]},
        1: {"records": [{"grad_norm": 2.0, "rejected_seq_fraction": 0.5, "monitor_warnings": ["grad_norm is rising"]}]},
    }
    extras = _run_extras(runs)
    assert extras["grad_norm_mean"] == pytest.approx(2.0)
    assert extras["rejected_seq_mean"] == pytest.approx(0.25)  # (0.25 + 0 + 0.5) / 3 steps
    assert extras["monitor_flagged"] == {"k": 1, "n": 2} and extras["monitor_any"] == {"k": 2, "n": 2}
    assert _run_extras({0: {"records": [{"grad_norm": 1.0}]}})["rejected_seq_mean"] is None


def test_the_sweep_report_gives_the_detectable_effect_of_every_seed_count_run():
    """``seeds_run`` is the fewest paired seeds of any dose; a dose run with more seeds gets its own
    minimal detectable effect, 2.8016 x SD / sqrt(n) (hand-derived: SD 0.1, n 16 -> 0.0700)."""
    from megatron_mis.testbed.study.sweep_report import _per_dose_mde

    def dose(label, n):
        return {"label": label, "none_vs_reference": {"n": n} if n else None}

    summary = {"paired_sd": 0.1, "seeds_run": 4,
               "doses": [dose("k0", 4), dose("k1", 16), dose("k2", None), dose("k4", 16), dose("k8", 9)]}
    assert _per_dose_mde(summary) == " (k8: 9 seeds, 0.093; k1, k4: 16 seeds, 0.070)"
    summary["doses"] = [dose("k0", 4), dose("k1", 4), dose("k2", None)]
    assert _per_dose_mde(summary) == ""


def test_list_names_the_sweeps(capsys):
    assert main(["study", "--list"]) == 0
    out = capsys.readouterr().out
    for name in SWEEPS:
        assert f"  {name} " in out
    assert "dose staleness: k0, k1, k2, k4, k8, k16" in out
    assert "temperature-t0.5 " not in out  # the dose settings are listed under their sweep


def test_sweep_smoke_runs_resumes_and_reports(tmp_path, capsys):
    argv = ["study", "--sweep", "temperature", "--doses", "t1,t1.5", "--arms", "none,ref_fp32", "--seeds", "2",
            "--steps", "2", "--jobs", "1", "--quick", "--out-dir", str(tmp_path), "--no-progress", "--bootstrap", "200"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "2 doses x 2 arms x 2 seeds = 8 runs" in captured.err
    for label in ("t1", "t1.5"):
        for arm in ("none", "ref_fp32"):
            for seed in (0, 1):
                assert (tmp_path / f"temperature-{label}" / arm / f"seed-{seed}.jsonl").is_file()
    header = json.loads((tmp_path / "temperature-t1.5" / "none" / "seed-0.jsonl").read_text().splitlines()[0])
    assert header["config"]["temperature"] == 1.5 and header["config"]["trainer_temperature"] == 1.0
    import platform

    import torch
    assert (header["machine"]["torch"], header["machine"]["python"]) == (torch.__version__, platform.python_version())
    # the ISA torch's CPU kernels use: the same seed on another ISA follows another trajectory
    isa = torch.backends.cpu.get_cpu_capability()
    assert header["machine"]["cpu_capability"] == isa
    summary = json.loads((tmp_path / "sweep-temperature" / "summary.json").read_text())
    assert [d["dose"] for d in summary["doses"]] == [1.0, 1.5]
    hot = summary["doses"][1]["arms"]
    # the temperature dose is a real mismatch: none's K3 at T=1.5 is far above the reference's
    assert hot["none"]["k3_mean"][0] > 100 * max(hot["ref_fp32"]["k3_mean"][0], 1e-12)
    assert summary["paired_sd"] is not None and summary["seeds_for_target"] >= 2
    assert "grad_norm_mean" in hot["none"] and hot["none"]["monitor_flagged"]["n"] == 2 == hot["none"]["monitor_any"]["n"]
    report = (tmp_path / "sweep-temperature" / "report.md").read_text()
    assert "| 1.5 | none | 2 |" in report and "Minimal detectable effect" in report
    assert "runs whose 2-step mean reward reached 0.5, and the mean of their first such step" in report
    family, _, model = header["machine"].get("cpu_family_model", "").partition("/")
    kind = f" (family {family} model {model})" if model else ""
    assert (f"Runs made on: {header['machine']['cpu']}{kind} [{isa}], Python {platform.python_version()}, "
            f"torch {torch.__version__} (8 runs)") in report
    assert (tmp_path / "sweep-temperature" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # run again: every run is reused, also one written before the demo had its output-only
    # dump_log_probs field (the committed archives' runs), whose header lacks the key
    run = tmp_path / "temperature-t1" / "none" / "seed-1.jsonl"
    lines = run.read_text().splitlines(keepends=True)
    old = json.loads(lines[0])
    assert old["config"].pop("dump_log_probs") is None
    run.write_text(json.dumps(old) + "\n" + "".join(lines[1:]))
    assert main(argv) == 0
    assert "ran 0 runs, reused 8" in capsys.readouterr().err


def test_sweep_plan_is_seed_major_and_runs_a_repeated_configuration_once(tmp_path):
    from megatron_mis.testbed.study.runner import _deduplicate, load_run, plan_sweep, run_jobs

    study = StudyConfig(sweep="staleness", doses=["k0", "k2"], arms=["none", "ref_fp32"], seeds=2, quick=True,
                        steps=2, out_dir=str(tmp_path), progress=False)
    jobs = plan_sweep(study)
    # seed 0 at every dose before seed 1: a sweep stopped part-way holds pairs at every dose
    assert [(j.setting, j.arm, j.seed) for j in jobs] == [
        (f"staleness-{d}", a, s) for s in (0, 1) for d in ("k0", "k2") for a in ("none", "ref_fp32")]
    todo, copies = _deduplicate(jobs)
    # fresh fp32 rollouts: none at k0 is the reference, and the reference resets the dose, so the
    # reference at k0 and k2 and none at k0 are one run per seed; none at k2 is the only other
    assert [(j.setting, j.arm) for j in todo] == [("staleness-k0", "none"), ("staleness-k2", "none")] * 2
    assert {(s.setting, s.arm, j.setting, j.arm) for s, j in copies} == {
        ("staleness-k0", "none", "staleness-k0", "ref_fp32"), ("staleness-k0", "none", "staleness-k2", "ref_fp32")}
    done = run_jobs(study, jobs, "test")
    assert (done["ran"], done["reused"], done["copied"]) == (4, 0, 4)
    for seed in (0, 1):
        src = load_run(tmp_path / "staleness-k0" / "none" / f"seed-{seed}.jsonl")
        for setting in ("staleness-k0", "staleness-k2"):
            path = tmp_path / setting / "ref_fp32" / f"seed-{seed}.jsonl"
            copy = load_run(path)
            assert copy["records"] == src["records"] and copy["end"] == src["end"]
            header = json.loads(path.read_text().splitlines()[0])
            assert header["setting"] == setting and header["arm"] == "ref_fp32" and header["copied_from"].endswith(
                f"staleness-k0/none/seed-{seed}.jsonl")
    # everything is on disk now: nothing to run or copy; a lost copy is copied again, not rerun
    (tmp_path / "staleness-k2" / "ref_fp32" / "seed-1.jsonl").unlink()
    todo, copies = _deduplicate(jobs)
    assert todo == [] and [(j.setting, j.arm, j.seed) for _, j in copies] == [("staleness-k2", "ref_fp32", 1)]
    assert run_jobs(study, jobs, "test")["copied"] == 1


def test_a_sweep_of_some_doses_copies_a_finished_run_of_another_dose(tmp_path):
    """`--doses k2` after `--doses k0`: the reference resets the dose, so k0's finished reference
    run is k2's too and is copied, not run again (a 300-step long-tail run costs 4 minutes)."""
    from megatron_mis.testbed.study.runner import load_run, run_sweep

    common = dict(sweep="staleness", seeds=1, quick=True, steps=2, out_dir=str(tmp_path), progress=False)
    first = run_sweep(StudyConfig(doses=["k0"], arms=["ref_fp32"], **common))
    assert (first["ran"], first["copied"]) == (1, 0)
    later = run_sweep(StudyConfig(doses=["k2"], arms=["none", "ref_fp32"], **common))
    assert (later["ran"], later["reused"], later["copied"]) == (1, 0, 1)  # none at k2 runs, its reference is copied
    copy = tmp_path / "staleness-k2" / "ref_fp32" / "seed-0.jsonl"
    assert json.loads(copy.read_text().splitlines()[0])["copied_from"].endswith("staleness-k0/ref_fp32/seed-0.jsonl")
    assert load_run(copy)["records"] == load_run(tmp_path / "staleness-k0" / "ref_fp32" / "seed-0.jsonl")["records"]
    # a dose's own runs are not copied from a dose whose configuration differs
    assert not (tmp_path / "staleness-k0" / "none").exists()


def test_a_sweep_copies_a_finished_run_of_another_sweep(tmp_path):
    """The fresh fp32 reference of `staleness` k0 is the same run as `temperature` t1's (T = 1 in
    both, no lag): in one out-dir the second sweep copies it; a run whose configuration no other
    sweep's finished run has (the reference at t1.5 samples and trains at T = 1.5) runs."""
    from megatron_mis.testbed.study.runner import load_run, run_sweep

    common = dict(seeds=1, quick=True, steps=2, out_dir=str(tmp_path), progress=False)
    first = run_sweep(StudyConfig(sweep="staleness", doses=["k0"], arms=["ref_fp32"], **common))
    assert (first["ran"], first["copied"]) == (1, 0)
    later = run_sweep(StudyConfig(sweep="temperature", doses=["t1", "t1.5"], arms=["ref_fp32"], **common))
    assert (later["ran"], later["reused"], later["copied"]) == (1, 0, 1)
    copy = tmp_path / "temperature-t1" / "ref_fp32" / "seed-0.jsonl"
    assert json.loads(copy.read_text().splitlines()[0])["copied_from"].endswith("staleness-k0/ref_fp32/seed-0.jsonl")
    assert load_run(copy)["records"] == load_run(tmp_path / "staleness-k0" / "ref_fp32" / "seed-0.jsonl")["records"]
    assert json.loads((tmp_path / "temperature-t1.5" / "ref_fp32" / "seed-0.jsonl").read_text().splitlines()[0]).get(
        "copied_from") is None


@pytest.mark.parametrize("delay", [0.3, 1.5, "running"])
def test_an_interrupted_sweep_exits_promptly(tmp_path, delay):
    """Ctrl-C (or `timeout -s INT`) during a sweep with more queued jobs than a pipe holds, early
    (while the workers start) or late (``running``: once a worker has written into its scratch
    folder): the process exits instead of hanging (as it did on the feeder thread of the task
    queue the runner used before its pipes: on a 16-core run, and in the full suite on a loaded
    machine when the interrupt came while the workers started), and the killed workers' scratch
    folders are gone."""
    import subprocess
    import sys

    script = f"""
import os, signal, threading
from megatron_mis.testbed.study.config import StudyConfig
from megatron_mis.testbed.study.runner import plan_sweep, run_jobs
study = StudyConfig(sweep="staleness", seeds=16, jobs=2, quick=True, out_dir={str(tmp_path)!r}, progress=False)
jobs = plan_sweep(study)
assert len(jobs) == 2 * 7 * 16  # quick: the first and the last dose
# a background job of a shell inherits SIGINT ignored (and Python then installs no handler):
# restore the interactive meaning, as Ctrl-C or timeout -s INT meet it in a foreground run
signal.signal(signal.SIGINT, signal.default_int_handler)
def interrupt(delay={delay!r}):
    import glob, time
    t0 = time.monotonic()
    if delay == "running":
        while not glob.glob(os.path.join(os.environ["TMPDIR"], "megatron_mis_study_*", "*")) and time.monotonic() - t0 < 40:
            time.sleep(0.05)
    else:
        time.sleep(delay)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
run_jobs(study, jobs, "interrupted")
"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    # the killed workers' scratch folders (half-written runs, file stores) are removed too
    assert not list(tmp.glob("megatron_mis_study_*")), sorted(p.name for p in tmp.iterdir())


def test_sigterm_stops_a_sweep_and_keeps_its_runs_in_the_archive(tmp_path):
    """SIGTERM (a scheduler's preemption or time limit; `kill` of a background launch, whose SIGINT
    is ignored) to `megatron-mis study` mid-sweep: the command exits with 128 + 15 and says how to
    resume, its workers are stopped (no run file appears after it exits, as an orphaned worker's
    would), their scratch folders are gone, and the archive holds every run finished before it.
    Without the handler the process dies at once, its workers run on and the archive stays unwritten."""
    import signal
    import subprocess
    import sys
    import time

    out, archive, tmp = tmp_path / "out", tmp_path / "archive", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "megatron_mis", "study", "--sweep", "temperature", "--doses", "t1.5", "--arms",
           "none,ref_fp32", "--quick", "--seeds", "16", "--jobs", "2", "--no-progress", "--no-plot",
           "--out-dir", str(out), "--archive", str(archive)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})

    def finished():
        return sorted(p.relative_to(out).as_posix() for p in out.rglob("seed-*.jsonl"))

    t0 = time.monotonic()
    while not finished() and proc.poll() is None and time.monotonic() - t0 < 300:
        time.sleep(0.1)
    assert proc.poll() is None and finished(), "no run finished within 300 s, or the sweep ended first"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert f"stopped by SIGTERM; the finished runs stay in {out}" in err, err[-2000:]
    # the killed workers registered no semaphore that outlives them (tqdm's default lock is one:
    # the resource tracker then warned of "leaked semaphore objects" at every stop)
    assert "leaked semaphore" not in err, err[-2000:]
    runs = finished()
    assert 1 <= len(runs) < 32, runs  # stopped part-way
    time.sleep(5)  # an orphaned worker would finish its 4-step run and write it within this
    assert finished() == runs
    assert not list(tmp.glob("megatron_mis_study_*")), sorted(p.name for p in tmp.iterdir())
    kept = sorted(p.relative_to(archive).as_posix().removesuffix(".gz") for p in archive.rglob("seed-*.jsonl.gz"))
    copies = sorted(p.relative_to(archive).as_posix().replace(".copy.json", ".jsonl")
                    for p in archive.rglob("seed-*.copy.json"))
    assert sorted(kept + copies) == runs, err[-2000:]


def test_a_sweep_registers_no_named_semaphore(tmp_path):
    """A parallel sweep's process registers no named semaphore with the resource tracker. With
    the ``multiprocessing`` queues the runner used before, it registered six (three per queue),
    and a stop by SIGTERM now and then left one unlinked but registered: the queue's feeder thread
    ran its cleanup at the interpreter's exit and was cut between the two, and the tracker warned
    of a "leaked semaphore" it could no longer unlink (one failure of the test above in a dozen
    suite runs). Nothing registered, nothing can leak."""
    import subprocess
    import sys

    script = f"""
import sys
import multiprocessing.resource_tracker as tracker
from megatron_mis.cli import main
registered = []
register = tracker.register
def counting(name, rtype):
    registered.append(rtype)
    register(name, rtype)
tracker.register = counting  # what a SemLock calls on creation (a spawn-context lock, queue, pipe)
code = main(["study", "--sweep", "temperature", "--doses", "t1.5", "--arms", "none,ref_fp32", "--quick",
             "--seeds", "2", "--jobs", "2", "--no-progress", "--no-plot", "--out-dir", {str(tmp_path / "out")!r}])
print("REGISTERED", registered, file=sys.stderr)
sys.exit(code)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REGISTERED []" in proc.stderr, proc.stderr[-2000:]
    assert len(list((tmp_path / "out").rglob("seed-*.jsonl"))) == 4  # the sweep did run in parallel
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]


def test_a_run_that_raises_in_a_worker_stops_the_sweep_with_its_traceback(tmp_path, monkeypatch):
    """A parallel sweep whose third run raises in its worker: `run_jobs` raises StudyError naming
    that run's arm and seed with the worker's traceback, the failed run leaves no file, the run
    finished before it stays, and the workers' scratch folders are gone."""
    import dataclasses
    import tempfile

    from megatron_mis.testbed.study.runner import StudyError, plan_sweep, run_jobs

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    study = StudyConfig(sweep="temperature", doses=["t1.5"], arms=["none", "ref_fp32"], seeds=3, jobs=2, quick=True,
                        out_dir=str(tmp_path / "out"), progress=False)
    jobs = plan_sweep(study)
    assert [(j.arm, j.seed) for j in jobs][:3] == [("none", 0), ("ref_fp32", 0), ("none", 1)]
    bad = jobs[2] = dataclasses.replace(jobs[2], config={**jobs[2].config, "steps": -3})
    with pytest.raises(StudyError, match=r"run none seed 1 failed:\n(?s:.*)ConfigError(?s:.*)steps=-3 must be >= 1"):
        run_jobs(study, jobs, "failing")
    assert not os.path.exists(bad.path)
    # the bad run was sent to the first worker to finish seed 0's none or reference: that run stays
    # (the other may have been stopped half-way, and leaves nothing)
    assert os.path.exists(jobs[0].path) or os.path.exists(jobs[1].path)
    assert not list(scratch.glob("megatron_mis_study_*")), sorted(p.name for p in scratch.iterdir())


def test_a_killed_worker_stops_the_sweep(tmp_path):
    """A study worker killed by SIGKILL (the kernel's OOM killer, an operator) once the workers
    have started (a scratch folder holds a file store): the sweep stops part-way with StudyError
    naming the exit code (-9) instead of waiting on the dead worker's run or failing on its reset
    pipe (ConnectionResetError, seen in 1 of 4 runs before the runner caught it), the other
    worker is stopped and every scratch folder is gone."""
    import subprocess
    import sys

    script = f"""
import glob, os, signal, threading, time
import multiprocessing as mp
from megatron_mis.testbed.study.config import StudyConfig
from megatron_mis.testbed.study.runner import StudyError, plan_sweep, run_jobs
study = StudyConfig(sweep="temperature", doses=["t1.5"], arms=["none", "ref_fp32"], seeds=16, jobs=2, quick=True,
                    out_dir={str(tmp_path / "out")!r}, progress=False)
def kill_one():
    t0 = time.monotonic()  # a worker is running once its scratch folder holds a file
    while not glob.glob(os.path.join(os.environ["TMPDIR"], "megatron_mis_study_*", "*")) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    os.kill(mp.active_children()[0].pid, signal.SIGKILL)
threading.Thread(target=kill_one, daemon=True).start()
t0 = time.monotonic()
try:
    run_jobs(study, plan_sweep(study), "killed")
except StudyError as exc:
    print("STOPPED", time.monotonic() - t0, exc, flush=True)
    assert not mp.active_children(), mp.active_children()
"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0 and "STOPPED" in proc.stdout, proc.stderr[-2000:]
    assert "a study worker died (exit code -9)" in proc.stdout, proc.stdout
    assert len(list((tmp_path / "out").rglob("seed-*.jsonl"))) < 32  # stopped part-way, not after the sweep
    assert not list(tmp.glob("megatron_mis_study_*")), sorted(p.name for p in tmp.iterdir())


def test_a_sweep_extends_from_its_archive_on_another_machine(tmp_path, capsys):
    """`--archive`: the runs of a first study are written into the archive; a second study in an
    empty out-dir (another machine) restores them, runs only the new seed, and its report over
    the first seeds equals the first study's (the archive is lossless)."""
    archive = tmp_path / "keep" / "runs"
    common = ["study", "--sweep", "temperature", "--doses", "t1.5", "--arms", "none,ref_fp32", "--steps", "2",
              "--jobs", "1", "--quick", "--no-progress", "--no-plot", "--bootstrap", "200", "--archive", str(archive)]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*common, "--seeds", "1", "--out-dir", str(first)]) == 0
    err = capsys.readouterr().err
    assert f"archive {archive}: not there yet, it will be made" in err and "ran 2 runs, reused 0" in err
    assert f"archive {archive}: 2 runs (2 added from {first}, 2 files written)" in err
    assert main([*common, "--seeds", "2", "--out-dir", str(second)]) == 0
    err = capsys.readouterr().err
    assert f"archive {archive}: restored 2 runs into {second}, 0 already there" in err
    assert "ran 2 runs, reused 2" in err  # seed 1's two arms run, seed 0's are the archive's
    assert f"archive {archive}: 4 runs (2 added from {second}, 2 files written)" in err  # seed 0's unchanged
    for rel in ("temperature-t1.5/none/seed-0.jsonl", "temperature-t1.5/ref_fp32/seed-0.jsonl"):
        assert (second / rel).read_bytes() == (first / rel).read_bytes()
    # the report over seed 0 from the restored runs is the first study's
    assert main([*common, "--seeds", "1", "--out-dir", str(second), "--report-only"]) == 0
    capsys.readouterr()

    def doses(root):
        return json.loads((root / "sweep-temperature" / "summary.json").read_text())["doses"]

    assert doses(second) == doses(first)
    # a variant under the same names (here: 3 steps, not 2) runs in the out-dir but does not
    # replace the archive's runs: the archive only grows, and the command names what it kept out
    stamps = {p: p.read_bytes() for p in archive.rglob("*") if p.is_file()}
    steps = common.index("--steps") + 1
    assert main([*common[:steps], "3", *common[steps + 1:], "--seeds", "1", "--out-dir", str(second)]) == 0
    err = capsys.readouterr().err
    assert "ran 2 runs, reused 0" in err and f"archive {archive}: 4 runs (0 added from {second}, 0 files written)" in err
    assert "2 runs in " in err and "differ from the archive's runs of the same name and were not written" in err
    assert {p: p.read_bytes() for p in archive.rglob("*") if p.is_file()} == stamps
    # an archive that is not one is refused before anything runs, and left as it is
    bad = tmp_path / "bad"
    (bad / "temperature-t1.5" / "none").mkdir(parents=True)
    (bad / "temperature-t1.5" / "none" / "seed-0.jsonl.gz").write_text("not gzip")
    assert main([*common[:-1], str(bad), "--seeds", "1", "--out-dir", str(tmp_path / "third")]) == 2
    assert f"{bad}: no format.json, so not a run archive" in capsys.readouterr().err
    assert sorted(p.name for p in bad.rglob("*")) == ["none", "seed-0.jsonl.gz", "temperature-t1.5"]
    assert not (tmp_path / "third").exists()


def test_an_archive_takes_only_the_doses_the_command_ran(tmp_path, capsys):
    """`--archive` with `--doses`: the archive takes the out-dir's finished runs of the doses the
    command ran, not those of the sweep's other doses the out-dir holds (a T = 0.5 archive updated
    from an out-dir that also held T = 1.5 runs took all 2600 of them, 2026-12-03)."""
    out, hot, cold = tmp_path / "out", tmp_path / "hot", tmp_path / "cold"
    common = ["study", "--sweep", "temperature", "--arms", "none", "--steps", "2", "--jobs", "1", "--quick",
              "--seeds", "1", "--no-progress", "--no-plot", "--bootstrap", "200", "--out-dir", str(out)]
    assert main([*common, "--doses", "t1.5", "--archive", str(hot)]) == 0
    assert main([*common, "--doses", "t0.5", "--archive", str(cold)]) == 0
    assert f"archive {cold}: 1 runs (1 added from {out}, 1 files written)" in capsys.readouterr().err

    def runs(archive):
        return sorted(p.relative_to(archive).as_posix() for p in archive.rglob("seed-*"))

    assert runs(cold) == ["temperature-t0.5/none/seed-0.jsonl.gz"]
    assert runs(hot) == ["temperature-t1.5/none/seed-0.jsonl.gz"]
    # the out-dir keeps both doses' runs
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("seed-*")) == [
        "temperature-t0.5/none/seed-0.jsonl", "temperature-t1.5/none/seed-0.jsonl"]


def test_ctrl_c_stops_the_command_with_130_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C takes the SIGTERM path's exit: 128 + 2 and the resume hint, not a traceback (the
    runner's own clean-up on KeyboardInterrupt is test_an_interrupted_sweep_exits_promptly's)."""
    import megatron_mis.cli.study as cli_study

    def interrupted(args, study):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_study, "_run_archived", interrupted)
    assert main(["study", "--sweep", "temperature", "--quick", "--out-dir", str(tmp_path)]) == 130
    assert f"stopped by an interrupt (Ctrl-C); the finished runs stay in {tmp_path}" in capsys.readouterr().err
