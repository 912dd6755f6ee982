"""The command line: validate and analyze (the demo has its own tests)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_mis.cli import main


def test_validate_prints_resolved(capsys):
    assert main(["validate", "configs/presets/token_tis.yaml"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "tis_batch_normalize_scope: micro_batch" in out and "tis_lower_bound: 0.5" in out


def test_validate_reports_every_error_with_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tis_levle: token\ntis_mode: nope\nrs_veto_threshold: 3\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "tis_levle" in err and "nope" in err and "rs_veto_threshold" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2


def test_analyze_builtin_sample(capsys):
    assert main(["analyze"]) == 0
    captured = capsys.readouterr()
    assert "built-in sample" in captured.err
    assert "mis_k3_kl" in captured.out and "p_rollout bucket" in captured.out


def test_analyze_jsonl_and_pt(tmp_path, capsys):
    rows = [
        {"rollout_log_probs": [-1.0, -0.5, -2.0], "train_log_probs": [-1.1, -0.5, -1.9], "loss_mask": [1, 0, 1]},
        {"rollout_log_probs": [-0.1], "train_log_probs": [-0.2]},
    ]
    path = tmp_path / "lp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["analyze", str(path), "--config", "configs/presets/token_tis.yaml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["num_loss_tokens"] == 3.0
    # k3 over the three loss-mask tokens, by hand
    import math

    k3 = [math.exp(x) - 1 - x for x in (-0.1, 0.1, -0.1)]
    assert report["metrics"]["mis_k3_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)

    pt = tmp_path / "lp.pt"
    torch.save({"rollout_log_probs": [torch.tensor(r["rollout_log_probs"]) for r in rows],
                "train_log_probs": [torch.tensor(r["train_log_probs"]) for r in rows]}, pt)
    assert main(["analyze", str(pt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["num_loss_tokens"] == 4.0


def test_analyze_bad_files(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"rollout_log_probs": [-1.0]}\n')
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl: line 1: missing field(s) ['train_log_probs']" in err
    path.write_text('{"rollout_log_probs": [-1.0, -2.0], "train_log_probs": [-1.0]}\n')
    assert main(["analyze", str(path)]) == 2
    assert "line 1: field 'rollout_log_probs' has 2 values, expected len(train_log_probs)=1" in capsys.readouterr().err


def test_validate_combined_host_yaml(tmp_path, capsys):
    """A slime / Miles --custom-config-path file holds MIS and LR-schedule keys together."""
    both = tmp_path / "host.yaml"
    both.write_text(open("configs/mis.yaml").read() + "\n" + open("configs/lr_schedule.yaml").read())
    assert main(["validate", str(both)]) == 0
    out = capsys.readouterr().out
    assert out.index("# ---- mis") < out.index("# ---- lr_schedule")
    both.write_text("use_tis: true\nlength_decay_enabld: true\ntis_mode: x\nlength_decay_factor: 2.0\n")
    assert main(["validate", str(both)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err
    assert "'length_decay_enabld' (did you mean 'length_decay_enabled'?)" in err
    assert "[mis] tis_mode='x'" in err and "[lr_schedule] length_decay_factor" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (b"use_tis: true\nuse_tis: false\n", "duplicate key 'use_tis' at line 2 (first at line 1)"),
        (b"use_tis: \xff\n", "is not UTF-8 text"),
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 64 levels deep"),
        (b"tis_upper_bound: " + b"9" * 400 + b"\n", "[mis] tis_upper_bound=999"),
        (b"tis_upper_bound: " + b"9" * 5000 + b"\n", "not a readable YAML value"),
        (b"- 1\n", "top level must be a mapping of keys, got list"),
        (b"", "holds no keys"),
        (b"log_ratio_bound: true\n", "log_ratio_bound=True is not a number (allowed: a number that must lie in (0, 80])"),
    ],
    ids=["duplicate", "not_utf8", "deep", "huge_number", "too_many_digits", "list", "empty", "bool_for_number"],
)
def test_validate_bad_files_exit_2_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and str(path) in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_validate_directory_and_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "is a directory, not a YAML file" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


# ---- validate --host (issue 27) ---------------------------------------------------------------------
@pytest.mark.parametrize("host, source", [("slime", "slime/backends/megatron_utils/loss.py:1050"),
                                          ("miles", "miles/backends/training_utils/loss_hub/losses.py:230")])
def test_validate_host_reports_an_inert_preset_with_status_0(capsys, host, source, tmp_path):
    """The geometric_rs preset as it was (use_tis: false): valid, but on the host it overrides
    --use-tis and the function is never called without --get-mismatch-metrics."""
    old = tmp_path / "geometric_rs_old.yaml"
    old.write_text(OLD_GEOMETRIC_RS)
    assert main(["validate", "--host", host, str(old)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "0 error(s)" in out
    assert "overrides_flag: use_tis:" in out and "inert: use_tis:" in out and source in out


OLD_GEOMETRIC_RS = "use_tis: false\nuse_rs: true\nrs_level: geometric\nrs_lower_bound: 0.999\nrs_upper_bound: 1.001\n"


def test_validate_host_with_flags_exits_2_on_errors(capsys, tmp_path):
    flags = "--use-tis --custom-tis-function-path megatron_mis.compute_mis_weights_with_cp"
    old = tmp_path / "geometric_rs_old.yaml"
    old.write_text(OLD_GEOMETRIC_RS)
    assert main(["validate", "--host", "slime", "--host-flags", flags, "configs/presets/geometric_rs.yaml"]) == 0
    capsys.readouterr()  # the shipped preset acts on the host (use_tis: true, apply_is_weights: false)
    assert main(["validate", "--host", "slime", "--host-flags", flags, str(old)]) == 2
    captured = capsys.readouterr()
    assert "1 error(s)" in captured.out
    assert "error: use_tis: use_tis: false in the YAML overrides --use-tis" in captured.err and "never called" in captured.err
    assert main(["validate", "--host", "slime", "--host-flags", flags + " --get-mismatch-metrics", str(old)]) == 0
    assert "metrics only" in capsys.readouterr().out


def test_validate_host_bad_arguments(capsys, tmp_path):
    assert main(["validate", "--host-flags=--use-tis", "configs/presets/token_tis.yaml"]) == 2
    assert "--host-flags needs --host slime|miles" in capsys.readouterr().err
    assert main(["validate", "--host", "miles", "--host-flags=--tis-clip", "configs/presets/token_tis.yaml"]) == 2
    assert "error: --host-flags: host flag --tis-clip needs a value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--host", "verl", "configs/presets/token_tis.yaml"])
    assert "invalid choice: 'verl'" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tis_levle: token\n")
    assert main(["validate", "--host", "slime", str(bad)]) == 2  # the config's own errors still count
    assert "tis_levle" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["slime", "miles"])
def test_validate_host_on_the_shipped_examples_has_no_error(capsys, host):
    """The examples' YAML with the flags their launch scripts pass (MIS_ARGS)."""
    import shlex
    import subprocess
    from pathlib import Path

    script = next(Path("examples", host).glob("run-*.sh"))
    text = script.read_text()
    block = text[text.index("MIS_ARGS=(") : text.index("\n)\n", text.index("MIS_ARGS=(")) + 3]
    printed = subprocess.run(["bash", "-c", f'SCRIPT_DIR={shlex.quote(str(script.parent))}\n{block}\nprintf "%q " "${{MIS_ARGS[@]}}"'],
                             capture_output=True, text=True, check=True).stdout
    assert "--custom-tis-function-path" in printed
    assert main(["validate", "--host", host, "--host-flags", printed, str(script.parent / "mis.yaml")]) == 0
    out = capsys.readouterr().out
    assert "0 error(s)" in out and "needs_hook: tis_batch_normalize_scope:" in out
    assert f'megatron-mis validate --host {host} --host-flags="' in text  # the script runs the same check


def test_validate_reports_a_duplicate_key_together_with_every_other_fault(tmp_path, capsys):
    """A YAML with a duplicate key and a second fault reported only the duplicate (issue 27's
    backlog): every problem of the file comes in one report."""
    path = tmp_path / "mis.yaml"
    path.write_text("use_tis: true\ntis_upper_bound: 2.0\ntis_upper_bound: -1.0\nno_such_key: 1\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tis_upper_bound" in err and "duplicate" in err.lower()
    assert "unknown key 'no_such_key'" in err
    assert "-1.0" in err  # the out-of-range value (the last of the duplicates, as YAML keeps it)
