"""``megatron-mis study`` end to end on a tiny budget: 2 arms x 2 seeds x 2 small steps in 2
worker processes, the JSONL files, resuming (finished runs reused), the report, flag validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mis.cli import main
from megatron_mis.config import ConfigError
from megatron_mis.testbed.study.config import ARMS, SETTINGS, StudyConfig, arm_overrides_of_extra, run_config


def test_study_config_validation():
    with pytest.raises(ConfigError) as e:
        StudyConfig(setting="int3", arms=["none", "nope", "none"], seeds=0, last_k=0, collapse_fraction=1.5,
                    confidence=0.3, extra={"not_a_field": 1})
    text = str(e.value)
    for part in ("setting='int3'", "['nope']", "seeds=0", "last_k=0", "collapse_fraction=1.5", "confidence=0.3",
                 "not_a_field"):
        assert part in text, part
    # a run's DemoConfig is validated up front (a batch that does not split into micro-batches)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        StudyConfig(arms=["none"], extra={"micro_batch_size": 7})


def test_run_config_layers_setting_arm_quick_extra():
    study = StudyConfig(setting="bf16", arms=["ref_true_on_policy", "length_decay"], quick=True, extra={"lr": 0.004})
    cfg = run_config(study, "ref_true_on_policy", 3)
    assert cfg.true_on_policy and cfg.precision == "fp32" and cfg.correction == "none"
    assert cfg.seed == 3 and cfg.steps == 4 and cfg.prompts_per_step == 4 and cfg.lr == 0.004 and cfg.threads == 1
    cfg = run_config(study, "length_decay", 0)
    assert cfg.precision == "bf16" and cfg.lr_schedule == "length-decay" and cfg.lr_surge_step == 1  # pinned within 4 steps
    assert all(a.overrides.get("rollout_precision") in (None, "fp32") for a in ARMS.values())


def test_set_changes_the_mechanism_and_a_reference_stays_a_reference(capsys, tmp_path):
    """--set applies on top of the setting, and the arm on top of it: --set staleness=2 makes
    every mismatch arm stale while ref_fp32 keeps fresh weights (it was stale before this order),
    and the CLI says where an arm's value wins."""
    study = StudyConfig(sweep="long-tail", doses=["s61"], arms=["none", "ref_fp32", "token_tis"], extra={"staleness": 2, "lr": 0.002})
    probe = study.for_dose("s61")
    cfgs = {arm: run_config(probe, arm, 0) for arm in study.arm_names}
    assert cfgs["none"].staleness == 2 and cfgs["token_tis"].staleness == 2 and cfgs["ref_fp32"].staleness == 0
    assert cfgs["none"].precision == "int4" and cfgs["ref_fp32"].precision == "fp32"
    assert all(c.lr == 0.002 for c in cfgs.values())  # a key no arm sets applies to every arm
    assert arm_overrides_of_extra(study) == [("ref_fp32", "staleness", 0, 2)]
    assert main(["study", "--sweep", "long-tail", "--doses", "s61", "--arms", "none,ref_fp32", "--set", "staleness=2",
                 "--report-only", "--no-plot", "--out-dir", str(tmp_path)]) == 1  # nothing run yet
    assert "arm ref_fp32 runs with staleness=0, not --set staleness=2" in capsys.readouterr().err
    assert {s.overrides["rollout_precision"] for s in SETTINGS.values()} >= {"bf16", "fp16", "int8", "int4", "fp32"}


def test_study_smoke_runs_resumes_and_reports(tmp_path, capsys):
    argv = ["study", "--arms", "none,token_tis", "--seeds", "2", "--steps", "2", "--jobs", "2", "--quick",
            "--out-dir", str(tmp_path), "--bootstrap", "200", "--last-k", "1", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "ran 4 runs, reused 0" in out.err
    root = tmp_path / "int4"
    for arm in ("none", "token_tis"):
        for seed in (0, 1):
            lines = [json.loads(x) for x in (root / arm / f"seed-{seed}.jsonl").read_text().splitlines()]
            assert [x["type"] for x in lines] == ["run", "step", "step", "end"]
            assert lines[0]["config"]["seed"] == seed and lines[0]["config"]["rollout_precision"] == "int4"
            assert lines[1]["mis_k3_kl"] > 0  # int4 rollouts: a real mismatch
            assert "greedy_reward" in lines[-1]["evaluation"]
    summary = json.loads((root / "summary.json").read_text())
    assert set(summary["arms"]) == {"none", "token_tis"} and summary["arms"]["none"]["n"] == 2
    diff = summary["arms"]["token_tis"]["vs_none"]["final_reward"]
    assert diff["n"] == 2 and diff["low"] <= diff["mean"] <= diff["high"]
    assert "| token_tis | 2 |" in out.out and (root / "report.png").stat().st_size > 10_000
    # run again: every run is reused; a changed setting (more steps) is not
    assert main(argv) == 0
    assert "ran 0 runs, reused 4" in capsys.readouterr().err
    argv_more = [*argv[:argv.index("--steps") + 1], "3", *argv[argv.index("--steps") + 2:], "--arms", "none", "--seeds", "1",
                 "--jobs", "1", "--no-plot"]
    assert main(argv_more) == 0
    assert "ran 1 runs, reused 0" in capsys.readouterr().err


def test_a_study_worker_is_replaced_after_runs_per_worker_runs(tmp_path, capsys, monkeypatch):
    """A long-lived worker leaked with MoE runs (runner.RUNS_PER_WORKER; that holder is fixed, the next test), so a
    worker is retired after that many runs and a fresh one takes its slot: with a limit of 2, five runs on one slot
    take three workers (also with --jobs 1, which runs in the study's own process only up to the limit), every run
    is written, every worker has exited and no scratch folder is left."""
    import tempfile

    from megatron_mis.testbed.study import runner

    started = []
    real = runner.mp.get_context

    class Counting:
        def __init__(self, ctx):
            self._ctx = ctx

        def Pipe(self, *args, **kwargs):
            return self._ctx.Pipe(*args, **kwargs)

        def Process(self, *args, **kwargs):
            started.append(self._ctx.Process(*args, **kwargs))
            return started[-1]

    monkeypatch.setattr(runner.mp, "get_context", lambda method=None: Counting(real(method)))
    monkeypatch.setattr(runner, "RUNS_PER_WORKER", 2)
    scratch_before = {p.name for p in Path(tempfile.gettempdir()).glob("megatron_mis_study_*")}
    argv = ["study", "--arms", "none", "--seeds", "5", "--steps", "2", "--jobs", "1", "--quick", "--out-dir",
            str(tmp_path), "--bootstrap", "200", "--last-k", "1", "--no-progress", "--no-plot"]
    assert main(argv) == 0
    assert "ran 5 runs, reused 0" in capsys.readouterr().err
    assert len(started) == 3 and not any(p.is_alive() for p in started)
    for seed in range(5):
        lines = (tmp_path / "int4" / "none" / f"seed-{seed}.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["seed"] == seed and json.loads(lines[-1])["type"] == "end"
    assert {p.name for p in Path(tempfile.gettempdir()).glob("megatron_mis_study_*")} == scratch_before


def test_an_moe_run_leaves_no_model_behind(tmp_path):
    """A study worker makes many runs in one process, so a run must free its model (and through it its destroyed
    process groups' gloo threads). Megatron-Core's MoE token dispatcher keeps its last forward's autograd graph,
    whose AccumulateGrad hooks (the DDP's, held in C++) close over the model: a cycle the garbage collector cannot
    see, which kept every MoE run's model until the trainer's routes dropped that graph on close."""
    import gc

    from megatron.core.models.gpt import GPTModel

    from megatron_mis.testbed.study import runner

    def models() -> int:
        gc.collect()
        return sum(isinstance(o, GPTModel) for o in gc.get_objects())

    before = models()
    study = StudyConfig(sweep="moe-noise", doses=["n0.4"], arms=["none"], seeds=1, steps=2, quick=True,
                        out_dir=str(tmp_path)).for_dose("n0.4")
    (job,) = runner.plan(study)
    runner._execute(job, str(tmp_path))
    assert json.loads(Path(job.path).read_text().splitlines()[-1])["type"] == "end"
    assert models() == before


def test_study_cli_errors_and_list(capsys):
    assert main(["study", "--arms", "none,bogus", "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "seeds=0" in err
    assert main(["study", "--list"]) == 0
    out = capsys.readouterr().out
    assert "int4" in out and "ref_true_on_policy" in out
