"""MISConfig: the hosts' keys and defaults, every problem reported at once, the three sources
(YAML, dict, host args namespace), and every shipped YAML."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_mis.config import HOST_KEYS, ConfigError, MISConfig
from megatron_mis.presets import configs_dir, preset_names, preset_path

REPO = Path(__file__).resolve().parent.parent


def test_defaults_and_host_keys():
    cfg = MISConfig()
    assert set(HOST_KEYS) <= set(MISConfig.field_names())
    assert (cfg.use_tis, cfg.use_rs, cfg.tis_level, cfg.tis_mode) == (False, False, "token", "truncate")
    assert cfg.tis_lower == pytest.approx(0.5)  # 1 / tis_upper_bound
    assert (cfg.rs_lower, cfg.rs_upper) == (cfg.tis_lower, cfg.tis_upper_bound)
    assert all(doc for _, _, doc in MISConfig.field_docs().values())


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        MISConfig.from_dict(
            {
                "tis_levle": "token",  # unknown, with suggestion
                "tis_mode": "trunc",  # not a choice
                "tis_upper_bound": -1,  # non-positive
                "rs_veto_threshold": 1.5,  # outside (0, 1)
                "tis_batch_normalize": True,  # nothing to normalise
                "log_ratio_bound": 200,
            },
            source="x.yaml",
        )
    problems = info.value.problems
    assert len(problems) == 6, problems
    text = str(info.value)
    assert "x.yaml" in text
    assert "unknown key 'tis_levle' (did you mean 'tis_level'?); valid keys:" in text
    assert "tis_mode='trunc' is not one of 'truncate', 'clip', 'mask' (did you mean 'truncate'?)" in text
    assert "tis_upper_bound=-1.0 must be > 0" in text
    assert "rs_veto_threshold=1.5 must lie in the open interval (0, 1)" in text
    assert "nothing to normalise" in text
    assert "log_ratio_bound=200.0 must lie in (0, 80]" in text


@pytest.mark.parametrize(
    "cfg, message",
    [
        (dict(use_tis=True, tis_mode="clip", tis_lower_bound=2.0, tis_upper_bound=1.5), "tis_lower_bound=2.0 must be < tis_upper_bound=1.5"),
        (dict(use_rs=True, rs_lower_bound=1.1, rs_upper_bound=1.0), "rs_lower_bound=1.1 must be < rs_upper_bound=1.0"),
        (dict(tis_level="tokens"), "tis_level='tokens' is not one of"),
        (dict(use_tis="yes"), "use_tis='yes' is not true or false"),
        (dict(prob_veto_threshold=0.0), "prob_veto_threshold=0.0 must lie in the open interval"),
        (dict(tis_upper_bound=float("inf")), "must be a finite number"),
        (dict(use_tis=True, tis_batch_normalize_scope="global"), "needs tis_batch_normalize: true"),
        (dict(nonfinite_policy="ignore"), "nonfinite_policy='ignore' is not one of"),
    ],
)
def test_impossible_values(cfg, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MISConfig(**cfg)


def test_numbers_as_yaml_writes_them(tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\nrs_veto_threshold: 1e-4\ntis_upper_bound: 2\n")  # PyYAML: '1e-4' is a str
    cfg = MISConfig.from_yaml(path)
    assert cfg.rs_veto_threshold == pytest.approx(1e-4) and isinstance(cfg.tis_upper_bound, float)


def test_ineffective_settings_warn():
    with pytest.warns(UserWarning, match="tis_lower_bound=0.4 has no effect in tis_mode='truncate'"):
        MISConfig(use_tis=True, tis_lower_bound=0.4)
    with pytest.warns(UserWarning, match="rs_upper_bound=1.2 has no effect because use_rs is false"):
        MISConfig(rs_upper_bound=1.2)
    with pytest.warns(UserWarning, match="tis_level set but use_tis is false"):
        MISConfig(tis_level="sequence")


def test_from_namespace_and_host_args(tmp_path):
    ns = argparse.Namespace(use_tis=True, tis_level="geometric", tis_upper_bound=1.5, tis_lower_bound=None,
                            lr=1e-6, custom_config_path=None)
    cfg = MISConfig.from_host_args(ns)
    assert (cfg.use_tis, cfg.tis_level, cfg.tis_upper_bound) == (True, "geometric", 1.5)
    # a YAML the host loaded without checking: typos in MIS-like keys are reported, with every
    # other problem; keys that belong to the host are left alone
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_uper_bound: 3.0\nrs_veto: 0.1\nmy_reward_scale: 2\n")
    ns = argparse.Namespace(use_tis=True, tis_mode="crop", custom_config_path=str(path), my_reward_scale=2)
    with pytest.raises(ConfigError) as info:
        MISConfig.from_host_args(ns)
    text = str(info.value)
    assert "tis_uper_bound" in text and "did you mean 'tis_upper_bound'" in text
    assert "'rs_veto'" in text
    assert "tis_mode='crop'" in text
    assert "my_reward_scale" not in text


SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))


def test_shipped_yaml_count():
    # configs/mis.yaml + 7 presets; update this number deliberately when adding one.
    mis_files = [p for p in SHIPPED if p.name == "mis.yaml" or p.parent.name == "presets"]
    assert len(mis_files) == 8, [str(p) for p in mis_files]
    assert preset_names() == sorted(
        ["token_tis", "token_mis", "sequence_tis", "sequence_mis", "geometric_rs", "geometric_rs_token_tis", "seed000_default"]
    )


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name == "mis.yaml" or p.parent.name == "presets"], ids=lambda p: p.name)
def test_shipped_yaml_validates_without_warnings(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = MISConfig.from_yaml(path)
    assert cfg.use_tis or cfg.use_rs
    data = yaml.safe_load(path.read_text())
    assert set(data) <= set(MISConfig.field_names())


def test_documented_mis_yaml_comments_every_key():
    lines = (configs_dir() / "mis.yaml").read_text().splitlines()
    keys = [ln.split(":")[0] for ln in lines if ln and not ln.startswith("#") and ":" in ln]
    assert keys == MISConfig.field_names()
    for key in keys:
        i = next(i for i, ln in enumerate(lines) if ln.startswith(f"{key}:"))
        assert lines[i - 1].startswith("#"), f"{key} has no comment above it"


def test_preset_lookup_errors():
    assert preset_path("token_tis").is_file()
    with pytest.raises(FileNotFoundError, match="unknown preset 'token_tsi' \\(did you mean 'token_tis'\\?\\)"):
        preset_path("token_tsi")
