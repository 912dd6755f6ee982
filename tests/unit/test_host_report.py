"""megatron_mis.integrations.host_report: what a --custom-config-path YAML does on slime / Miles.

Each case is a flag combination read in the hosts' code (slime 624b824a, Miles 31f1ca96); the
expected note names the host file:line that decides it (HOST_FACTS), so a note without its source
fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_mis.integrations.host_report import HOST_FACTS, HOSTS, HostNote, host_report, parse_host_flags

CUSTOM = "--custom-tis-function-path megatron_mis.compute_mis_weights_with_cp"
GEOMETRIC_RS = {"use_tis": False, "use_rs": True, "rs_level": "geometric", "rs_lower_bound": 0.999, "rs_upper_bound": 1.001}


def notes_by(notes: list[HostNote], kind: str, key: str) -> list[HostNote]:
    return [n for n in notes if n.kind == kind and n.key == key]


def one(notes: list[HostNote], kind: str, key: str) -> HostNote:
    found = notes_by(notes, kind, key)
    assert len(found) == 1, (kind, key, [n.format() for n in notes])
    return found[0]


@pytest.mark.parametrize("host", HOSTS)
def test_use_tis_false_overrides_the_flag_and_makes_the_config_inert(host):
    """Issue 27 item 7: configs/presets/geometric_rs.yaml sets use_tis: false; the host sets it on
    args over --use-tis and then never calls the function (slime loss.py:1050, Miles losses.py:230)."""
    notes = host_report(GEOMETRIC_RS, host)
    assert not [n for n in notes if n.is_error]  # without the launch flags: notes only
    override = one(notes, "overrides_flag", "use_tis")
    assert "overrides --use-tis" in override.message and HOST_FACTS["yaml_on_args"][host] in override.source
    inert = one(notes, "inert", "use_tis")
    assert HOST_FACTS["call_condition"][host] in inert.source
    assert "rs_level, rs_lower_bound, rs_upper_bound, use_rs" in inert.message and "apply_is_weights: false" in inert.message
    # the launch flags decide: --use-tis alone -> never called: an error
    flags = parse_host_flags(f"--use-tis {CUSTOM}", host)
    error = one(host_report(GEOMETRIC_RS, host, flags=flags), "error", "use_tis")
    assert "never called" in error.message
    # with --get-mismatch-metrics the function runs, metrics only: RS is inert, no error
    flags = parse_host_flags(f"--use-tis --get-mismatch-metrics {CUSTOM}", host)
    notes = host_report(GEOMETRIC_RS, host, flags=flags)
    assert not [n for n in notes if n.is_error]
    assert "metrics only" in one(notes, "inert", "use_rs").message
    # rs_without_tis makes RS act: not inert
    notes = host_report({**GEOMETRIC_RS, "rs_without_tis": True}, host, flags=flags)
    assert not notes_by(notes, "inert", "use_rs")


@pytest.mark.parametrize("host", HOSTS)
def test_no_use_tis_anywhere_is_an_error_when_the_flags_are_known(host):
    notes = host_report({"use_rs": True}, host, flags=parse_host_flags(CUSTOM, host))
    assert "Fix: --use-tis" in one(notes, "error", "use_tis").message
    assert not [n for n in host_report({"use_rs": True}, host, flags=parse_host_flags(f"--use-tis {CUSTOM}", host)) if n.is_error]


@pytest.mark.parametrize("host", HOSTS)
def test_host_bound_flags(host):
    """Issue 27 item 4: the hosts' --tis-clip / --tis-clip-low (slime arguments.py:1067-1077,
    Miles arguments.py:1545-1555) are the bounds of their built-in clamp."""
    flags = parse_host_flags(f"--use-tis --tis-clip 2.5 {CUSTOM}", host)
    notes = host_report({"use_tis": True, "tis_clip": 1.5}, host, flags=flags)
    assert "(the command line gives 2.5)" in one(notes, "overrides_flag", "tis_clip").message
    meaning = one(notes, "host_meaning", "tis_clip")
    assert "read by megatron-mis as tis_upper_bound" in meaning.message
    assert HOST_FACTS["builtin_tis_reads_tis_clip"][host] in meaning.source
    # flag and MIS key disagree: an error naming both
    notes = host_report({"tis_clip": 1.5, "tis_upper_bound": 2.0}, host)
    assert "tis_clip=1.5 (the host's --tis-clip) and tis_upper_bound=2.0" in one(notes, "error", "tis_clip").message
    assert not notes_by(host_report({"tis_clip": 2, "tis_upper_bound": 2.0}, host), "error", "tis_clip")
    # a lower bound with truncate (which has none) is an error; 0 is the hosts' "no lower bound"
    assert one(host_report({"tis_clip_low": 0.5, "tis_mode": "truncate"}, host), "error", "tis_clip_low")
    assert "tis_mode: clip, as no tis_mode is set" in one(host_report({"tis_clip_low": 0.5}, host), "host_meaning", "tis_clip_low").message
    assert not notes_by(host_report({"tis_clip_low": 0}, host), "host_meaning", "tis_clip_low")
    assert one(host_report({"tis_clip": "high"}, host), "error", "tis_clip")
    # our bound in the YAML: the host's flag is not read (the custom function replaces the built-in)
    ignored = one(host_report({"tis_upper_bound": 1.5}, host), "ignored_bound", "tis_clip")
    assert HOST_FACTS["custom_function_replaces_builtin"][host] in ignored.source


@pytest.mark.parametrize("host", HOSTS)
def test_without_the_custom_function_no_mis_key_is_read(host):
    notes = host_report({"use_rs": True, "tis_upper_bound": 1.5}, host, flags=parse_host_flags("--use-tis", host))
    assert "megatron_mis.compute_mis_weights_with_cp" in one(notes, "error", "custom_tis_function_path").message


@pytest.mark.parametrize("host", HOSTS)
def test_bypass(host):
    """Issue 27 item 3: --use-rollout-logprobs makes the PPO ratio pi_theta / pi_rollout; a YAML
    use_tis: true passes the host's own refusal of the two together (it runs before the YAML)."""
    flags = parse_host_flags(f"--use-rollout-logprobs {CUSTOM}", host)
    data = {"use_tis": True, "tis_upper_bound": 1.5, "use_rs": True}
    notes = host_report(data, host, flags=flags)
    passed = one(notes, "host_meaning", "use_tis")
    assert HOST_FACTS["bypass_excludes_use_tis_check"][host] in passed.source and "bypass mode" in passed.message
    assert "never applied twice" in one(notes, "inert", "tis_upper_bound").message
    errors = [n for n in notes if n.is_error]
    if host == "miles":  # Miles passes train_log_probs=None then (losses.py:127-132)
        assert [n.key for n in errors] == ["use_rs"] and "--get-mismatch-metrics" in errors[0].message
        assert HOST_FACTS["bypass_train_log_probs"]["miles"] in errors[0].source
    else:  # slime passes pi_theta.detach() (loss.py:985-989)
        assert errors == []
    flags = parse_host_flags(f"--use-rollout-logprobs --get-mismatch-metrics {CUSTOM}", host)
    assert not [n for n in host_report(data, host, flags=flags) if n.is_error]


@pytest.mark.parametrize("host", HOSTS)
def test_host_meanings(host):
    """Issue 27 items 5 and 8 (docs/hosts.md host_meanings)."""
    notes = host_report({"tis_batch_normalize": True, "tis_level": "sequence"}, host)
    assert "rejected ones included" in one(notes, "host_meaning", "tis_batch_normalize").message
    assert "weight then becomes exactly 1" in one(notes, "host_meaning", "tis_batch_normalize_scope").message
    notes = host_report({"tis_batch_normalize": True, "tis_batch_normalize_over": "kept", "tis_level": "sequence",
                         "tis_batch_normalize_scope": "global"}, host)
    assert not notes_by(notes, "host_meaning", "tis_batch_normalize")
    assert not notes_by(notes, "host_meaning", "tis_batch_normalize_scope")
    assert one(host_report({"rs_veto_threshold": 1e-4}, host), "inert", "rs_veto_threshold")
    assert not host_report({"rs_veto_threshold": 1e-4, "use_rs": True}, host)
    assert not host_report({"rs_veto_threshold": 1e-4, "rs_veto_without_rs": True}, host)
    icepop = one(host_report({"tis_mode": "mask"}, host), "host_meaning", "tis_mode")
    assert "weight 0: that is tis_mode: icepop (token level" in icepop.message
    assert HOST_FACTS["icepop_keeps_mask"][host] in icepop.source


def test_hooks_and_patches():
    data = {"tis_batch_normalize": True, "tis_batch_normalize_scope": "global"}
    slime = one(host_report(data, "slime"), "needs_hook", "tis_batch_normalize_scope")
    assert "megatron_mis.integrations.slime.rollout_data_postprocess" in slime.message
    assert "--get-mismatch-metrics" in slime.message  # the log-prob reuse trap, issue 27 item 2
    assert HOST_FACTS["log_prob_reuse"]["slime"] in slime.source
    hook = "--rollout-data-postprocess-path megatron_mis.integrations.slime.rollout_data_postprocess"
    given = host_report(data, "slime", flags=parse_host_flags(f"--use-tis {CUSTOM} {hook}", "slime"))
    assert "(given)" in one(given, "needs_hook", "tis_batch_normalize_scope").message
    missing = host_report(data, "slime", flags=parse_host_flags(f"--use-tis {CUSTOM}", "slime"))
    assert "(the command line gives None)" in one(missing, "error", "tis_batch_normalize_scope").message
    miles = one(host_report(data, "miles"), "needs_hook", "tis_batch_normalize_scope")
    assert "patches/miles-31f1ca96-global-mis-normalizer.patch" in miles.message
    skip = host_report(data, "miles", flags=parse_host_flags(f"--use-tis {CUSTOM} --skip-actor-forward-only", "miles"))
    assert "Fix: drop --skip-actor-forward-only" in one(skip, "error", "tis_batch_normalize_scope").message
    assert "length-decay.patch (apply it before" in one(host_report({"length_decay_enabled": True}, "miles"), "needs_hook", "length_decay_enabled").message
    assert "slime-624b824a-length-decay.patch" in one(host_report({"monitor_enabled": True}, "slime"), "needs_hook", "monitor_enabled").message


@pytest.mark.parametrize("host", HOSTS)
def test_token_level_settings_under_gspo(host):
    """Issue 32 item 3: --advantage-estimator gspo makes the PPO ratio one per sequence (slime
    loss.py:992-1027 + ppo_utils.py:95-121, Miles losses.py:141-179 + math_utils.py:224-250).
    Token-level IS weights and token-level rejection are applied as written (with a warning at
    the first call, tests/host/test_gspo_pattern.py) and reported here, naming the sequence-level
    presets; sequence / geometric levels and GRPO get no note."""
    gspo = parse_host_flags(f"--use-tis --advantage-estimator gspo {CUSTOM}", host)
    assert gspo["advantage_estimator"] == "gspo"
    notes = host_report({"use_tis": True, "tis_upper_bound": 2.0}, host, flags=gspo)  # token_tis: tis_level by default
    assert not [n for n in notes if n.is_error]
    level = one(notes, "host_meaning", "tis_level")
    assert "one per sequence" in level.message and "tis_level: token, the default" in level.message
    assert "mean of its token weights" in level.message and "tis_level: geometric" in level.message
    assert "geometric_tis, geometric_rs, sequence_tis, sequence_mis" in level.message
    assert HOST_FACTS["sequence_level_ratio"][host] in level.source and "docs/hosts.md sequence_level_ratio" in level.source
    rejection = {"use_tis": True, "tis_level": "geometric", "use_rs": True, "rs_lower_bound": 0.5, "rs_upper_bound": 2.0,
                 "tis_mode": "mask"}
    notes = host_report(rejection, host, flags=gspo)
    assert "still enters the sequence ratio" in one(notes, "host_meaning", "rs_level").message  # rs_level token by default
    assert not notes_by(notes, "host_meaning", "tis_level")
    assert [n.message for n in notes_by(notes, "host_meaning", "tis_mode") if "one per sequence" in n.message] == []
    token_mask = host_report({"use_tis": True, "tis_mode": "mask", "tis_lower_bound": 0.5, "tis_upper_bound": 5.0}, host, flags=gspo)
    assert [n for n in notes_by(token_mask, "host_meaning", "tis_mode") if "still enters the sequence ratio" in n.message]
    # sequence-level presets: no note; the same YAML under GRPO (the default): no note
    for data in ({"use_tis": True, "tis_level": "geometric", "use_rs": True, "rs_level": "geometric"},
                 {"use_tis": True, "apply_is_weights": False, "use_rs": True, "rs_level": "geometric"}):
        assert not [n for n in host_report(data, host, flags=gspo) if "one per sequence" in n.message]
    grpo = parse_host_flags(f"--use-tis --advantage-estimator grpo {CUSTOM}", host)
    assert not [n for n in host_report({"use_tis": True}, host, flags=grpo) if "one per sequence" in n.message]
    assert not [n for n in host_report({"use_tis": True}, host) if "one per sequence" in n.message]
    # bypass: IS weights are 1, only token rejection is left to report
    bypass = parse_host_flags(f"--use-rollout-logprobs --get-mismatch-metrics --advantage-estimator gspo {CUSTOM}", host)
    notes = host_report({"use_tis": True, "use_rs": True}, host, flags=bypass)
    assert not notes_by(notes, "host_meaning", "tis_level") and one(notes, "host_meaning", "rs_level")
    # the estimator set in the YAML counts too (it overrides the flag)
    assert one(host_report({"use_tis": True, "advantage_estimator": "gspo"}, host), "host_meaning", "tis_level")


def test_validate_cli_reports_gspo_with_token_weights(capsys):
    """``megatron-mis validate --host slime --host-flags="--advantage-estimator gspo ..."`` on the
    shipped token_tis preset: a note (exit 0), naming the presets to use."""
    from megatron_mis.cli import main
    from megatron_mis.integrations.host_report import SEQUENCE_LEVEL_PRESETS
    from megatron_mis.presets import preset_names, preset_path

    assert set(SEQUENCE_LEVEL_PRESETS) <= set(preset_names())
    flags = f"--use-tis --advantage-estimator gspo {CUSTOM}"
    assert main(["validate", "--host", "slime", "--host-flags", flags, str(preset_path("token_tis"))]) == 0
    out = capsys.readouterr().out
    assert "host_meaning: tis_level: --advantage-estimator gspo makes slime's PPO ratio one per sequence" in out
    assert "slime/backends/megatron_utils/loss.py:992-1027" in out
    assert main(["validate", "--host", "slime", "--host-flags", flags, str(preset_path("sequence_tis"))]) == 0
    assert "one per sequence" not in capsys.readouterr().out


def test_miles_skip_actor_forward_refuses_the_hooks():
    flags = f"--use-tis {CUSTOM} --skip-actor-forward-only --custom-megatron-before-train-step-hook-path x.y"
    error = one(host_report({}, "miles", flags=parse_host_flags(flags, "miles")), "error", "skip_actor_forward_only")
    assert "--custom-megatron-before-train-step-hook-path" in error.message
    assert HOST_FACTS["skip_forward_refuses_hooks"]["miles"] in error.source
    # not a slime flag: ignored there
    assert not host_report({}, "slime", flags=parse_host_flags(flags, "slime"))


def test_errors_come_first_and_every_note_names_its_source():
    notes = host_report({**GEOMETRIC_RS, "tis_clip": 1.5, "tis_upper_bound": 2.0}, "slime")
    assert notes[0].is_error and not any(n.is_error for n in notes[1:])
    for note in notes:
        assert note.source.startswith(("slime slime/", "docs/hosts.md")), note
        assert note.format().startswith(f"{note.kind}: {note.key}: ")


def test_parse_host_flags():
    flags = parse_host_flags("--use-tis --lr 1e-6 --tis-clip=1.5 --tis-clip-low 0.5 --custom-tis-function-path a.b "
                             "--advantage-estimator=gspo", "slime")
    assert flags == {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5, "custom_tis_function_path": "a.b",
                     "advantage_estimator": "gspo"}
    assert parse_host_flags(["--skip-actor-forward-only"], "miles") == {"skip_actor_forward_only": True}
    assert parse_host_flags(["--skip-actor-forward-only"], "slime") == {}
    with pytest.raises(ValueError, match="host flag --tis-clip needs a value"):
        parse_host_flags("--tis-clip --use-tis", "slime")
    with pytest.raises(ValueError, match=r"host flag --tis-clip='x' must be a number"):
        parse_host_flags("--tis-clip x", "miles")


def test_unknown_host():
    with pytest.raises(ValueError, match="host='verl' is not supported; valid: slime, miles"):
        host_report({}, "verl")


def test_importable_without_torch_or_yaml():
    code = "import sys, megatron_mis.integrations.host_report; print('torch' in sys.modules, 'yaml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_tables_agree_with_docs_hosts_md():
    """host_report's tables are the ones of docs/hosts.md's machine-readable summary (written with
    the drop-in's semantics, issue 27a); a change on one side must be made on the other."""
    import re
    from pathlib import Path

    import yaml

    from megatron_mis.integrations import host_report as hr

    doc = Path(__file__).resolve().parents[2] / "docs" / "hosts.md"
    if not doc.is_file():
        pytest.skip("docs/hosts.md comes with the drop-in semantics branch (issue 27a)")
    block = re.search(r"```yaml\n(hosts_summary_version:.*?)```", doc.read_text(), re.S)
    assert block, "docs/hosts.md lost its machine-readable summary"
    summary = yaml.safe_load(block[1])
    assert summary["hosts_summary_version"] == 1
    assert set(summary["yaml_overrides_flags"]) <= set(hr._HOST_ARGS)
    assert {flag: row["maps_to"] for flag, row in summary["host_bound_flags"].items()} == hr._BOUND_FLAG_KEYS
    assert {flag: row["default"] for flag, row in summary["host_bound_flags"].items()} == {
        flag: hr._HOST_ARGS[flag][1] for flag in hr._BOUND_FLAG_KEYS
    }
    assert tuple(summary["modes"]["bypass"]["inert_keys"]) == hr._BYPASS_INERT
    assert set(hr._RATIO_REJECTION) <= set(summary["modes"]["bypass"]["acting_keys"])
    assert tuple(summary["modes"]["metrics_only"]["inert_keys"]) == hr._METRICS_ONLY_INERT
    assert summary["host_meanings"]["tis_batch_normalize"]["variant_key"] == {"tis_batch_normalize_over": "kept"}
    assert summary["host_meanings"]["rs_veto_threshold"]["variant_key"] == {"rs_veto_without_rs": True}
    assert "icepop" in summary["host_meanings"]["tis_mode"]
    ratio = summary["sequence_level_ratio"]
    assert tuple(ratio["estimators"]) == hr.SEQUENCE_RATIO_ESTIMATORS
    assert tuple(ratio["presets"]) == hr.SEQUENCE_LEVEL_PRESETS
    assert ratio["token_level"] == "warned"
