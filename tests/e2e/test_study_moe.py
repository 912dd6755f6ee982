"""``megatron-mis study`` on the MoE setting: 2 arms (none, r3) x 2 seeds x 2 small steps in one
process; the route metrics reach the run files, the summary and the report; the setting's
default arms; routing-replay arms are refused on a dense setting."""

from __future__ import annotations

import json

import pytest

from megatron_mis.cli import main
from megatron_mis.config import ConfigError
from megatron_mis.testbed.study.config import DEFAULT_ARMS, MOE_ARMS, SETTINGS, StudyConfig, run_config


def test_moe_setting_arms_and_run_config():
    study = StudyConfig(setting="moe-int4")
    assert study.arm_names == list(MOE_ARMS) and StudyConfig().arm_names == list(DEFAULT_ARMS)
    assert not any(a.startswith("r3") for a in DEFAULT_ARMS)
    cfg = run_config(study, "r3_token_tis", 1)
    assert cfg.routing_replay and cfg.correction == "token_tis" and cfg.num_moe_experts == 16 and cfg.precision == "int4"
    assert run_config(study, "ref_fp32", 1).precision == "fp32" and not run_config(study, "none", 1).routing_replay
    with pytest.raises(ConfigError, match="routing_replay=True needs an MoE model"):
        StudyConfig(setting="int4", arms=["none", "r3"])
    with pytest.raises(ConfigError, match="true_on_policy with num_moe_experts"):
        StudyConfig(setting="moe-bf16", arms=["ref_true_on_policy"])
    assert SETTINGS["moe-bf16"].overrides["rollout_precision"] == "bf16"


def test_moe_study_smoke(tmp_path, capsys):
    argv = ["study", "--setting", "moe-int4", "--arms", "none,r3", "--seeds", "2", "--steps", "2", "--jobs", "1",
            "--quick", "--out-dir", str(tmp_path), "--bootstrap", "200", "--last-k", "1", "--no-progress", "--no-plot"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "ran 4 runs, reused 0" in out.err
    root = tmp_path / "moe-int4"
    for arm in ("none", "r3"):
        for seed in (0, 1):
            lines = [json.loads(x) for x in (root / arm / f"seed-{seed}.jsonl").read_text().splitlines()]
            assert [x["type"] for x in lines] == ["run", "step", "step", "end"]
            assert lines[0]["config"]["num_moe_experts"] == 16 and lines[0]["config"]["routing_replay"] == (arm == "r3")
            steps = lines[1:3]
            assert all(0.0 <= s["route_flip_fraction"] <= 1.0 for s in steps)
            if arm == "r3":
                assert all(s["route_replay_match"] == 1.0 for s in steps)
            else:
                assert all("route_replay_match" not in s for s in steps)
    summary = json.loads((root / "summary.json").read_text())
    assert set(summary["arms"]) == {"none", "r3"}
    assert summary["arms"]["none"]["route_flip_mean"][0] > 0  # int4 rollouts flip expert choices
    assert "r3_recovers" in summary["answers"]
    assert "route flips" in out.out and "| r3 | 2 |" in out.out


def test_demo_preset_moe_setting():
    from megatron_mis.cli import build_parser
    from megatron_mis.cli.demo import build_config

    parse = build_parser().parse_args
    cfg = build_config(parse(["demo", "--preset", "moe-int4", "--routing-replay", "--quick"]))
    assert cfg.num_moe_experts == 16 and cfg.moe_router_topk == 2 and cfg.precision == "int4"
    assert cfg.routing_replay and cfg.correction == SETTINGS["moe-int4"].demo_correction
    with pytest.raises(ConfigError, match="routing_replay=True needs an MoE model"):
        build_config(parse(["demo", "--preset", "int4", "--routing-replay"]))
