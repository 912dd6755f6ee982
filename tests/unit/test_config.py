"""MISConfig: the hosts' keys and defaults, every problem reported at once, the three sources
(YAML, dict, host args namespace), and every shipped YAML."""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_mis.config import HOST_KEYS, ConfigError, MISConfig, load_yaml_mapping
from megatron_mis.presets import configs_dir, preset_names, preset_path

REPO = Path(__file__).resolve().parents[2]


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
    assert "tis_mode='trunc' is not one of 'truncate', 'clip', 'mask', 'icepop' (did you mean 'truncate'?)" in text
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
    # configs/mis.yaml + 12 presets; update this number deliberately when adding one.
    mis_files = [p for p in SHIPPED if p.name == "mis.yaml" or p.parent.name == "presets"]
    assert len(mis_files) == 13, [str(p) for p in mis_files]
    assert preset_names() == sorted(
        ["token_tis", "token_tis_normalized", "token_mis", "sequence_tis", "sequence_mis", "geometric_tis",
         "geometric_rs", "geometric_rs_token_tis", "seed000_default", "seq_mean_k3", "k3_rs_token_tis",
         "zscore_rs_token_mis"]
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


def test_token_tis_normalized_keeps_the_weights_mean_at_1_over_the_loss_tokens():
    """Processed top-k log-probs: every ratio pi_train / pi_rollout is its context's kept mass. Hand
    values: loss-token ratios 0.2, 0.4 (sequence 1; its third token is out of the loss) and 0.6
    (sequence 2); token_tis keeps them (all below 2), token_tis_normalized divides them by their
    mean 0.4, so the policy gradient keeps its overall scale and only the tokens' shares move."""
    import math

    import torch

    from megatron_mis.core.engine import compute_mis

    train = torch.log(torch.tensor([0.2, 0.4, 0.9, 0.6])) - 1.0
    rollout = torch.full((4,), -1.0)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    plain, normalized = (compute_mis(train, rollout, mask, [0, 3, 4], MISConfig.from_yaml(preset_path(name)))
                         for name in ("token_tis", "token_tis_normalized"))
    kept = mask.bool()
    assert plain.weights[kept].tolist() == pytest.approx([0.2, 0.4, 0.6], rel=1e-6)
    assert normalized.weights[kept].tolist() == pytest.approx([0.5, 1.0, 1.5], rel=1e-6)
    assert float(normalized.normalizer) == pytest.approx(0.4, rel=1e-6) and float(plain.normalizer) == 1.0
    assert math.isclose(float(normalized.weights[kept].mean()), 1.0, rel_tol=1e-6)


def test_preset_lookup_errors():
    assert preset_path("token_tis").is_file()
    with pytest.raises(FileNotFoundError, match="unknown preset 'token_tsi' \\(did you mean 'token_tis'\\?\\)"):
        preset_path("token_tsi")


# ------------------------------------------------------------------ bad files and bad values (issue 12)
BAD_FILES = {
    "duplicate": (b"use_tis: true\ntis_upper_bound: 2.0\nuse_tis: false\n", "duplicate key 'use_tis' at line 3 (first at line 1)"),
    "not_utf8": (b"use_tis: \xff\xfe\n", "is not UTF-8 text: byte 0xff at offset 9 (line 1)"),
    "deep": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 64 levels deep (line 1)"),
    "deep_block": (b"".join(b"  " * i + b"k:\n" for i in range(200)), "nested more than 64 levels deep (line 65)"),
    "huge_number": (b"tis_upper_bound: " + b"9" * 400 + b"\n", "tis_upper_bound=999"),
    "too_many_digits": (b"tis_upper_bound: " + b"9" * 5000 + b"\n", "not a readable YAML value"),
    "list": (b"- use_tis\n- true\n", "top level must be a mapping of keys, got list"),
    "scalar": (b"42\n", "top level must be a mapping of keys, got int"),
    "empty": (b"", "holds no keys"),
    "comments_only": (b"# use_tis: true\n", "holds no keys"),
    "bad_yaml": (b"use_tis: [true\n", "not valid YAML"),
    "python_tag": (b"use_tis: !!python/object:os.system {}\n", "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_give_one_clear_error_naming_the_file(tmp_path, case):
    content, message = BAD_FILES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        MISConfig.from_yaml(path)
    assert str(path) in str(info.value) and message in str(info.value), str(info.value)


def test_duplicates_all_reported_and_merge_keys_allowed(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("use_tis: true\nuse_rs: true\nuse_tis: true\nuse_rs: false\n")
    with pytest.raises(ConfigError) as info:
        MISConfig.from_yaml(path)
    assert len(info.value.problems) == 2
    assert "'use_tis' at line 3 (first at line 1)" in str(info.value)
    assert "'use_rs' at line 4 (first at line 2)" in str(info.value)
    # a nested duplicate (in a mapping value) is reported too
    path.write_text("monitor_thresholds: {mis_k3_kl: 1.0, mis_k3_kl: 2.0}\n")
    with pytest.raises(ConfigError, match="duplicate key 'mis_k3_kl' at line 1"):
        load_yaml_mapping(path)
    # a YAML merge key overriding an anchored value is not a duplicate
    path.write_text("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n")
    assert load_yaml_mapping(path)["other"] == {"x": 2}


def test_empty_file_allowed_only_on_request(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    assert MISConfig.from_yaml(path) == MISConfig()
    path.write_text("")
    assert load_yaml_mapping(path, allow_empty=True) == {}


def test_directory_missing_and_non_path(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        MISConfig.from_yaml(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        MISConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(TypeError, match="path must be a file path"):
        MISConfig.from_yaml(3)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        MISConfig.from_yaml("a\0b.yaml")


def test_rs_bounds_checked_only_where_rs_is_on():
    # truncating at 1 is a valid TIS setting; its default RS bounds [1, 1] are unused with RS off
    cfg = MISConfig(use_tis=True, tis_upper_bound=1.0)
    assert cfg.tis_upper_bound == 1.0
    with pytest.raises(ConfigError, match=r"rs_lower_bound=1.0 \(unset: 1/tis_upper_bound, as tis_lower_bound is unset\) must be "
                       r"< rs_upper_bound=1.0 \(unset: tis_upper_bound=1.0\) \(unset RS bounds default"):
        MISConfig(use_tis=True, use_rs=True, tis_upper_bound=1.0)
    # an unset RS bound names the IS key its value comes from (found by the public-API fuzz: the
    # message named only rs_lower_bound, which the user never set)
    with pytest.raises(ConfigError, match=r"rs_lower_bound=330.0 \(unset: tis_lower_bound=330.0\) must be < rs_upper_bound=2.0 "
                       r"\(unset: tis_upper_bound=2.0\)"):
        MISConfig(use_rs=True, tis_lower_bound=330.0)
    with pytest.raises(ConfigError, match=r"rs_lower_bound=3.0 must be < rs_upper_bound=2.0 \(unset: tis_upper_bound=2.0\)"):
        MISConfig(use_rs=True, rs_lower_bound=3.0)
    # the IS pair is compared only where IS reads both
    with pytest.raises(ConfigError, match=r"tis_lower_bound=1.0 must be < tis_upper_bound=1.0 \(unset, it is 1/tis_upper_bound\)"):
        MISConfig(use_tis=True, tis_mode="mask", tis_upper_bound=1.0)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("log_ratio_bound", True, "log_ratio_bound=True is not a number (allowed: a number that must lie in (0, 80])"),
        ("tis_upper_bound", False, "tis_upper_bound=False is not a number (allowed: a number that must be > 0)"),
        ("log_ratio_bound", "nan", "log_ratio_bound='nan' is not a number"),
        ("log_ratio_bound", "inf", "log_ratio_bound='inf' is not a number"),
        ("log_ratio_bound", " 5", "log_ratio_bound=' 5' is not a number"),
        ("log_ratio_bound", "1_0", "log_ratio_bound='1_0' is not a number"),
        ("log_ratio_bound", float("nan"), "log_ratio_bound=nan must be a finite number (allowed: it must lie in (0, 80])"),
        ("tis_lower_bound", float("-inf"), "tis_lower_bound=-inf must be a finite number (allowed: it must be > 0)"),
        ("tis_upper_bound", 10**400, "must be a finite number (allowed: it must be > 0)"),
        ("rs_veto_threshold", "abc", "rs_veto_threshold='abc' is not a number or null (allowed: a number or null that must lie in the open interval (0, 1))"),
        ("rs_veto_threshold", 1, "rs_veto_threshold=1.0 must lie in the open interval (0, 1), or be null"),
        ("log_ratio_bound", 80.5, "log_ratio_bound=80.5 must lie in (0, 80] (exp overflows float32 near 88)"),
        ("tis_lower_bound", 0, "tis_lower_bound=0.0 must be > 0, or be null (a ratio bound)"),
    ],
)
def test_numeric_keys_name_the_key_and_range(key, value, message):
    with pytest.raises(ConfigError) as info:
        MISConfig(**{key: value})
    assert message in str(info.value), str(info.value)


def test_numbers_in_decimal_strings_still_accepted():
    assert MISConfig(log_ratio_bound="1e1").log_ratio_bound == 10.0
    assert MISConfig(rs_veto_threshold=".5").rs_veto_threshold == 0.5


def test_int_keys_of_other_configs():
    from megatron_mis.monitor import MonitorConfig

    with pytest.raises(ConfigError, match=r"monitor_window=True is not an integer \(monitor_window: .*>= 4"):
        MonitorConfig(monitor_window=True)
    with pytest.raises(ConfigError, match="monitor_window=.* must fit in a 64-bit integer"):
        MonitorConfig(monitor_window=2**70, monitor_history_size=2**70)
    with pytest.raises(ConfigError, match="monitor_window='30' is not an integer"):
        MonitorConfig(monitor_window="30")


@pytest.mark.parametrize("args", [{"use_tis": True}, None, "use_tis", 3])
def test_host_args_must_be_a_namespace(args):
    # a dict's keys are not attributes: every key would be ignored and the defaults run silently
    with pytest.raises(TypeError, match=f"args must carry the config keys as attributes.*got (a )?{type(args).__name__}"):
        MISConfig.from_host_args(args)
    with pytest.raises(TypeError, match="args must carry the config keys as attributes"):
        MISConfig.from_namespace(args)


def test_host_args_yaml_with_duplicate_key(tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\nuse_tis: false\n")
    ns = argparse.Namespace(use_tis=False, custom_config_path=str(path))
    with pytest.raises(ConfigError, match="duplicate key 'use_tis' at line 2"):
        MISConfig.from_host_args(ns)


@pytest.mark.parametrize("key", ["tis_upper_bound", "tis_lower_bound", "rs_lower_bound", "rs_upper_bound"])
@pytest.mark.parametrize("value", [1e39, 1e-39])
def test_ratio_bounds_fit_float32(key, value):
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r} must lie in [2.939e-39, 3.403e+38] (float32")):
        MISConfig(**{key: value})


def test_duplicate_key_reported_with_every_other_problem(tmp_path):
    # issue 30: a duplicate key used to stop the check, hiding the file's other problems
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_upper_bound: -2.0\ntis_levle: token\nuse_tis: false\ntis_mode: trunc\n")
    with pytest.raises(ConfigError) as info:
        MISConfig.from_yaml(path)
    text = str(info.value)
    assert str(path) in text
    assert len(info.value.problems) == 4, info.value.problems
    assert "duplicate key 'use_tis' at line 4 (first at line 1)" in info.value.problems[0]
    assert "unknown key 'tis_levle' (did you mean 'tis_level'?)" in text
    assert "tis_upper_bound=-2.0 must be > 0" in text
    assert "tis_mode='trunc' is not one of" in text
    # a duplicate alone is still an error, and a duplicate in an otherwise valid file too
    path.write_text("use_tis: true\ntis_upper_bound: 2.0\ntis_upper_bound: 2.0\n")
    with pytest.raises(ConfigError) as info:
        MISConfig.from_yaml(path)
    assert info.value.problems == [
        "duplicate key 'tis_upper_bound' at line 3 (first at line 2); YAML would silently keep only the last value, "
        "so write each key once"
    ]
    # the file-level reader used by the other loaders keeps refusing duplicates outright
    with pytest.raises(ConfigError, match="duplicate key 'tis_upper_bound' at line 3"):
        load_yaml_mapping(path)
