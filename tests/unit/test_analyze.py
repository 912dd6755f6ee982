"""``megatron-mis analyze`` on host dumps: every reader's round trip, per-rollout rows against the
engine, the over-training table on a history with a known surge, the what-if table, strict JSON,
the PNG, and every malformed-file case (issues 12 and 15)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dump_writers import (
    make_samples,
    write_jsonl,
    write_miles,
    write_pt,
    write_slime_legacy,
    write_slime_v2,
    write_verl_generations,
)

from megatron_mis.analysis import DumpError, DumpReader, analyze_history, load_samples, to_json
from megatron_mis.analysis.history import RowAccumulator
from megatron_mis.cli import main
from megatron_mis.config import MISConfig
from megatron_mis.core.engine import compute_mis_from_lists
from megatron_mis.presets import preset_path


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _read_all(paths, fmt="auto"):
    reader = DumpReader(fmt)
    batches = []
    for p in paths:
        batches += reader.read(p)
    _, errors = reader.finish()
    assert not errors, errors
    return reader, batches


def _by_content(batches):
    """Samples keyed by their rollout log-probs (order-independent comparison)."""
    out = {}
    for b in batches:
        for t, r, m in zip(b.train_log_probs, b.rollout_log_probs, b.loss_masks):
            out[tuple(r.tolist())] = (t, m)
    return out


def _check_same(samples, batches):
    got = _by_content(batches)
    assert len(got) == len(samples)
    for s in samples:
        t, m = got[tuple(s["rollout"].tolist())]
        assert torch.equal(t, s["train"].to(torch.float32))
        assert torch.equal(m, s["mask"].to(torch.float32))


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("writer,fmt", [(write_jsonl, "jsonl"), (write_pt, "pt")])
def test_round_trip_own_formats(tmp_path, writer, fmt):
    samples = make_samples(5, [7, 1, 12, 4, 9], 0.1)
    path = writer(tmp_path / f"d.{'jsonl' if fmt == 'jsonl' else 'pt'}", samples, rollout_id=3)
    reader, batches = _read_all([path])
    assert reader.kind == fmt and [b.rollout_id for b in batches] == [3]
    _check_same(samples, batches)
    _, forced = _read_all([path], fmt)
    _check_same(samples, forced)


def test_round_trip_slime_v2(tmp_path):
    samples = make_samples(6, [5, 8, 3, 11, 6, 2], 0.05)
    path = write_slime_v2(tmp_path / "train_7.pt", samples, rollout_id=7, dp_size=2)
    reader, batches = _read_all([path])
    assert reader.kind == "slime (format_version 2)"
    assert [b.rollout_id for b in batches] == [7] and batches[0].response_lengths == [5, 8, 3, 11, 6, 2]
    # samples come back in rollout order
    assert [b.tolist() for b in batches[0].rollout_log_probs] == [s["rollout"].tolist() for s in samples]
    _check_same(samples, batches)


def test_round_trip_slime_legacy_dedupes_tp_and_skips_pp_stages(tmp_path):
    samples = make_samples(6, 6, 0.05)
    paths = write_slime_legacy(tmp_path, samples, rollout_id=2, dp_size=2, tp_size=2, pp_size=2)
    reader = DumpReader()
    batches, skipped = [], 0
    for p in paths:
        try:
            batches += reader.read(p)
        except DumpError as exc:
            assert "no 'log_probs'" in str(exc) and "pipeline stage" in str(exc)
            skipped += 1
    assert skipped == 4  # the first pipeline stage: 2 DP x 2 TP ranks
    assert reader.kind == "slime-legacy" and reader.num_duplicates == 6  # one TP copy of every sample
    _check_same(samples, batches)


@pytest.mark.parametrize("cp_size,tp_size,qkv", [(2, 1, "thd"), (2, 2, "thd"), (4, 1, "thd"), (2, 1, "bshd")])
def test_round_trip_miles_cp_pieces_joined(tmp_path, cp_size, tp_size, qkv):
    # response lengths chosen so some ranks hold no response token and chunks are uneven
    samples = make_samples(4, [1, 9, 16, 5], 0.05, prompt_length=7)
    paths = write_miles(tmp_path, samples, rollout_id=4, cp_size=cp_size, tp_size=tp_size, dp_size=2, qkv_format=qkv)
    reader, batches = _read_all(paths)
    assert reader.kind == "miles"
    _check_same(samples, batches)
    assert all(b.rollout_id == 4 for b in batches)


def test_miles_missing_cp_rank_reported(tmp_path):
    samples = make_samples(2, 6, 0.05)
    paths = write_miles(tmp_path, samples, rollout_id=0, cp_size=2)
    paths[1].unlink()  # cp_rank 1's file is lost
    reader = DumpReader()
    assert reader.read(paths[0]) == []
    _, errors = reader.finish()
    assert len(errors) == 2 and "cp_rank(s) [0] only, expected cp_size=2" in str(errors[0])
    with pytest.raises(DumpError, match="cp_rank"):
        analyze_history([str(paths[0])], MISConfig(), "default", progress=False)


def test_load_samples_reads_every_format(tmp_path):
    samples = make_samples(3, 4, 0.1)
    for path in (write_pt(tmp_path / "a.pt", samples), write_slime_v2(tmp_path / "b.pt", samples, 0)):
        loaded = load_samples(path)
        assert loaded.num_samples == 3 and loaded.num_tokens == 12


# ------------------------------------------------------------------------- rows vs the engine
def test_row_metrics_equal_the_engine_and_merge_across_files(tmp_path):
    cfg = MISConfig.from_yaml(preset_path("seed000_default"))
    samples = make_samples(10, [30, 7, 1, 45, 12, 30, 8, 22, 3, 40], 0.2, seed=3)
    one = write_pt(tmp_path / "one.pt", samples, rollout_id=0)
    rep = analyze_history([str(one)], cfg, "seed000", progress=False).report
    row = rep["rows"][0]
    res = compute_mis_from_lists([s["train"] for s in samples], [s["rollout"] for s in samples],
                                 [s["mask"] for s in samples], cfg)
    sc = res.scalars()
    for key, metric in (("k3_mean", "mis_k3_kl"), ("tv", "mis_tv"), ("log_ppl_abs_diff", "mis_log_ppl_abs_diff"),
                        ("chi2_token", "mis_chi2_token"), ("chi2_seq", "mis_chi2_seq"),
                        ("ess_token", "mis_ess_token"), ("ess_seq", "mis_ess_seq"),
                        ("rejected_token_fraction", "mis_rejected_token_fraction"),
                        ("rejected_seq_fraction", "mis_rejected_seq_fraction")):
        assert row[key] == pytest.approx(sc[metric], rel=1e-5, abs=1e-12), key
    assert row["config_effect"]["kept_tokens"] == sc["num_kept_tokens"]
    mask = torch.cat([s["mask"] for s in samples]).bool()
    k3 = res.token_metrics["mis_k3_kl"][mask].double()
    assert row["k3_max"] == pytest.approx(float(k3.max()), rel=1e-6)
    exact_p99 = float(k3.sort().values[math.ceil(0.99 * k3.numel()) - 1])
    assert row["k3_p99"] == pytest.approx(exact_p99, rel=0.012)  # histogram resolution, documented
    assert row["response_length"] == pytest.approx(sum(len(s["train"]) for s in samples) / 10)

    # the same rollout split over the per-rank files of a legacy dump merges to the same row
    # (self-normalisation is per file there, so compare a config without it)
    plain = MISConfig.from_yaml(preset_path("token_tis"))
    whole = analyze_history([str(one)], plain, "t", progress=False).report["rows"][0]
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    write_slime_legacy(legacy_dir, samples, rollout_id=0, dp_size=3, tp_size=1)
    split = analyze_history([str(legacy_dir)], plain, "t", progress=False).report
    assert split["num_files_analysed"] == 3 and len(split["rows"]) == 1
    for key in ("k3_mean", "k3_max", "tv", "log_ppl_abs_diff", "chi2_token", "chi2_seq", "ess_token", "ess_seq",
                "response_length", "num_loss_tokens"):
        assert split["rows"][0][key] == pytest.approx(whole[key], rel=1e-9), key


def test_fully_masked_rollout_gives_null_metrics(tmp_path, capsys):
    samples = make_samples(2, 4, 0.1)
    for s in samples:
        s["mask"].zero_()
    d = tmp_path / "m"
    d.mkdir()
    write_pt(d / "0.pt", samples, rollout_id=0)
    write_pt(d / "1.pt", make_samples(2, 4, 0.1), rollout_id=1)
    assert main(["analyze", str(d), "--json", "--no-progress"]) == 0
    rep = _strict_json(capsys.readouterr().out)
    row = rep["rows"][0]
    assert row["num_loss_tokens"] == 0 and row["k3_mean"] is None and row["k3_p99"] is None and row["tv"] is None
    assert rep["rows"][1]["k3_mean"] > 0 and "metrics" not in rep  # two batches: no single-batch metrics


def test_empty_batch_analyses_with_every_config(tmp_path):
    """A dump holding zero samples (found by the payload fuzz: ``{"train_log_probs": [],
    "rollout_log_probs": []}``) is a row with nothing in it, for the main configuration and every
    compared one, not a KeyError."""
    path = tmp_path / "empty.pt"
    torch.save({"train_log_probs": [], "rollout_log_probs": []}, path)
    rep = analyze_history([str(path)], MISConfig(), "d", progress=False,
                          compare={"token_tis": MISConfig.from_yaml(preset_path("token_tis"))}).report
    (row,) = rep["rows"]
    assert row["num_samples"] == 0 and row["config_effect"]["kept_tokens"] == 0
    assert row["config_effect"]["kept_token_share"] is None
    (tis,) = rep["compare"]
    assert tis["kept_tokens"] == 0 and tis["per_rollout"][0]["ess"] is None
    _strict_json(to_json(rep))


def test_accumulators_stay_bounded():
    samples = make_samples(40, 500, 0.3)
    from megatron_mis.analysis.history import process_batch

    row, _ = process_batch(0, "x", [s["train"] for s in samples], [s["rollout"] for s in samples],
                           [s["mask"] for s in samples], [500] * 40, {"config": MISConfig()}, "config")
    sizes = [getattr(row, f).numel() for f in RowAccumulator.__dataclass_fields__ if isinstance(getattr(row, f), torch.Tensor)]
    assert sizes and max(sizes) <= 200  # histograms and bucket sums, not the 20,000 tokens
    assert row.k3_hist.total == 40 * 499 and len(row.k3_hist.counts) < 1500


# ------------------------------------------------------------------------------ what-if
def test_compare_hand_derived(tmp_path):
    # r = 0.5, 1, 3 on three loss tokens of one sequence
    lr = [-1.0, -1.0, -1.0]
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"rollout_log_probs": lr, "train_log_probs": [-1 + math.log(0.5), -1.0, -1 + math.log(3.0)]}) + "\n")
    rep = analyze_history([str(path)], MISConfig(), "d", progress=False,
                          compare={"token_tis": MISConfig.from_yaml(preset_path("token_tis")),
                                   "token_mis": MISConfig.from_yaml(preset_path("token_mis"))}).report
    tis, mis = rep["compare"]
    assert tis["config"] == "token_tis" and tis["kept_tokens"] == 3 and tis["kept_sequences"] == 1
    assert tis["ess"] == pytest.approx(3.5**2 / (3 * (0.25 + 1 + 4)), rel=1e-5)  # w = 0.5, 1, min(3, 2)
    assert tis["weight_min"] == pytest.approx(0.5, rel=1e-6) and tis["weight_max"] == pytest.approx(2.0, rel=1e-6)
    assert mis["ess"] == pytest.approx(4.5**2 / (3 * (0.25 + 1 + 9)), rel=1e-5)  # all of [0.5, 5]: kept
    assert mis["effective_sample_share"] == pytest.approx(mis["ess"], rel=1e-9)
    assert len(tis["per_rollout"]) == 1


def test_cli_compare_and_rejection_share(tmp_path, capsys):
    samples = make_samples(8, 20, 0.8, seed=1)
    path = write_pt(tmp_path / "r.pt", samples, rollout_id=0)
    assert main(["analyze", str(path), "--compare", "token_tis", "geometric_rs", "--json", "--no-progress"]) == 0
    rep = _strict_json(capsys.readouterr().out)
    by = {c["config"]: c for c in rep["compare"]}
    assert by["token_tis"]["kept_tokens"] == rep["metrics"]["num_loss_tokens"]  # truncation rejects nothing
    assert by["geometric_rs"]["kept_sequences"] < 8  # [0.999, 1.001] rejects most of these sequences
    assert main(["analyze", str(path), "--compare", "token_tis", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "What-if" in out and "token_tis" in out and "mis_k3_kl" in out


# ---------------------------------------------------------------- over training, known surge
def _history(tmp_path, num=40, surge_at=25):
    d = tmp_path / "run"
    d.mkdir()
    for rid in range(num):
        length = 100 if rid < surge_at else 400
        sigma = 0.01 * 1.12**rid  # the mismatch grows steadily
        write_slime_v2(d / f"train_{rid}.pt", make_samples(8, length, sigma, seed=rid), rollout_id=rid)
    return d


def test_history_table_with_known_surge(tmp_path, capsys):
    d = _history(tmp_path)
    png = tmp_path / "report.png"
    assert main(["analyze", str(d), "--json", "--plot", str(png), "--no-progress"]) == 0
    rep = _strict_json(capsys.readouterr().out)
    assert [r["rollout_id"] for r in rep["rows"]] == list(range(40))
    assert rep["rows"][0]["response_length"] == 100 and rep["rows"][30]["response_length"] == 400
    # Hand-derived with the default window_ratio detector (smoothing 3, patience 2, ratio 2, window 10):
    # smoothed length at rollout 25 is (100+100+400)/3 = 200 = 2 x the reference 100 (1st hit), at 26
    # it is 300 (2nd hit): fires at rollout 26 = step 27. The run-up began at rollout 25 = step 26 (the
    # onset), so T = round(1.8 x 26) = 47; anchor 'start' halves first at step 47 = rollout 46.
    surge = rep["surge"]
    assert surge["fired"] and surge["rollout_id"] == 26 and surge["step"] == 27
    assert surge["onset_step"] == 26 and surge["onset_rollout_id"] == 25
    assert surge["decay_period"] == 47 and surge["first_decay_step"] == 47 and surge["first_decay_rollout_id"] == 46
    kinds = {(w["kind"], w["metric"]) for w in rep["monitor"]["warnings"]}
    assert ("length_surge", "response_length") in kinds
    assert ("trend", "mis_k3_kl") in kinds
    k3 = [r["k3_mean"] for r in rep["rows"]]
    assert k3[-1] > 100 * k3[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000

    assert main(["analyze", str(d / "train_*.pt"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Length surge (window_ratio): fired at rollout 26 (step 27; run-up from rollout 25)" in out
    assert "first halving at step 47" in out and "[trend]" in out
    assert out.count("\n") > 40


def test_schedule_config_changes_the_verdict(tmp_path, capsys):
    d = _history(tmp_path, num=30, surge_at=20)
    sched = tmp_path / "s.yaml"
    sched.write_text("length_surge_ratio: 5.0\n")
    assert main(["analyze", str(d), "--schedule-config", str(sched), "--json", "--no-progress"]) == 0
    assert not _strict_json(capsys.readouterr().out)["surge"]["fired"]  # a 4x jump is no 5x surge


def test_the_monitor_replay_flags_a_config_that_rejects_most_tokens(tmp_path):
    """Dumps of processed top-k log-probs with a kept mass of 0.2 on every token (pi_train =
    0.2 pi_rollout), analysed with token MIS's band [0.5, 5]: every loss token is rejected and the
    replayed monitor's default bound on the rejected-token fraction (0.5) flags the first rollout;
    with token TIS (truncation, nothing rejected) it stays silent on that metric."""
    samples = make_samples(8, 20, 0.0, seed=4)
    for s in samples:
        s["train"] = s["rollout"] + math.log(0.2)
    files = [str(write_pt(tmp_path / f"r{i}.pt", samples, rollout_id=i)) for i in range(3)]

    def rejected_warnings(preset):
        report = analyze_history(files, MISConfig.from_yaml(preset_path(preset)), preset, progress=False).report
        assert report["rows"][0]["rejected_token_fraction"] == (1.0 if preset == "token_mis" else 0.0)
        return [w for w in report["monitor"]["warnings"] if w["metric"] == "mis_rejected_token_fraction"]

    (w,) = rejected_warnings("token_mis")  # then the cool-down
    assert (w["kind"], w["rollout_id"], w["value"], w["threshold"]) == ("threshold", 0, 1.0, 0.5)
    assert "removes most of the loss tokens" in w["message"]
    assert rejected_warnings("token_tis") == []


# ------------------------------------------------------------------------------ strict JSON
def test_json_is_always_valid_with_extreme_log_probs(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    rows = [{"rollout_log_probs": [-3e38, -1.0], "train_log_probs": [-1.0, -3e38]},
            {"rollout_log_probs": [float("nan"), -1.0], "train_log_probs": [-1.0, float("inf")]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")  # Python writes NaN / Infinity
    assert main(["analyze", str(path), "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    rep = _strict_json(captured.out)
    assert rep["metrics"]["mis_nonfinite_token_fraction"] == pytest.approx(0.5)
    assert "NaN or inf" in captured.err


def test_json_safe_maps_non_finite_to_null():
    from megatron_mis.analysis import to_json

    text = to_json({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": 2})
    out = _strict_json(text)
    assert out["a"] == [1.0, None] and out["b"]["c"] is None
    assert out["non_finite_values_as_null"] == ["$.a[1]", "$.b.c"]


# ------------------------------------------------------------------------- malformed files
def _bad(tmp_path, name, content: bytes | str):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _valid_pt_bytes(tmp_path):
    p = write_slime_v2(tmp_path / "ok_src.pt", make_samples(3, 6, 0.1), rollout_id=0)
    data = p.read_bytes()
    p.unlink()
    return data


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("empty.pt", b"", "empty file (0 bytes)"),
        ("garbage.pt", b"\x00\x01garbage, not a torch file" * 10, "not a readable torch.save file"),
        ("list.jsonl", "[1, 2, 3]\n", "line 1: expected a JSON object per line, got list"),
        ("num.jsonl", '{"train_log_probs": [-1], "rollout_log_probs": [-1]}\n7\n', "line 2: expected a JSON object"),
        ("badjson.jsonl", '{"train_log_probs": [-1, \n', "line 1: not valid JSON"),
        ("emptylines.jsonl", "\n\n", "no JSON line in the file"),
        ("str.jsonl", '{"train_log_probs": ["a"], "rollout_log_probs": [-1]}\n',
         "line 1: field 'train_log_probs' must be a list of numbers, found 'a' (str) at position 0"),
        ("dict.jsonl", '{"train_log_probs": {"x": 1}, "rollout_log_probs": [-1]}\n',
         "line 1: field 'train_log_probs' must be a 1-D tensor or a list of numbers, got dict"),
        ("nested.jsonl", '{"train_log_probs": [[-1]], "rollout_log_probs": [-1]}\n', "found [-1] (list) at position 0"),
        ("rid.jsonl", '{"train_log_probs": [-1], "rollout_log_probs": [-1], "rollout_id": 1.5}\n',
         "line 1: field 'rollout_id' must be an integer, got 1.5"),
        ("mask.jsonl", '{"train_log_probs": [-1], "rollout_log_probs": [-1], "loss_mask": [2]}\n',
         "field 'loss_mask' (a loss mask) must hold 0 / 1 values, found 2"),
        ("latin1.jsonl", b'{"train_log_probs": [-1], "x": "\xe9"}\n', "not UTF-8 text"),
        # issue 27: a 400-digit integer gave an OverflowError traceback from float()
        ("bigint.jsonl", '{"train_log_probs": [-1], "rollout_log_probs": [-0.5, ' + "9" * 400 + ']}\n',
         "line 1: field 'rollout_log_probs' holds an integer of 400 digits at position 1, too large for a float"),
        ("bigmask.jsonl", '{"train_log_probs": [-1, -1], "rollout_log_probs": [-1, -1], "loss_mask": [1, -' + "1" * 400 + ']}\n',
         "line 1: field 'loss_mask' holds an integer of 400 digits at position 1"),
        ("f32.jsonl", '{"train_log_probs": [-1e39], "rollout_log_probs": [-1]}\n',
         "line 1: field 'train_log_probs' holds -1e+39 at position 0, outside the float32 range"),
        ("huge.jsonl", '{"train_log_probs": [' + "9" * 5000 + '], "rollout_log_probs": [-1]}\n',
         "line 1: not readable JSON (Exceeds the limit (4300 digits)"),
        ("verl.jsonl", None, "verl's trainer.rollout_data_dir dump"),
    ],
)
def test_malformed_files_name_file_and_field(tmp_path, capsys, name, content, expected):
    path = write_verl_generations(tmp_path / name) if content is None else _bad(tmp_path, name, content)
    with pytest.raises(DumpError) as info:
        load_samples(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)
    assert main(["analyze", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert name in err and expected in err and "Traceback" not in err


def test_truncated_pt(tmp_path):
    data = _valid_pt_bytes(tmp_path)
    path = _bad(tmp_path, "trunc.pt", data[: len(data) // 2])
    with pytest.raises(DumpError, match="trunc.pt: not a readable torch.save file"):
        load_samples(path)


@pytest.mark.parametrize(
    "payload,expected",
    [
        ([1, 2], "top level is a list"),
        ({"a": 1}, "matches no format"),
        ({"format_version": 3, "rollout_id": 0, "samples": []}, "field 'format_version' is 3; this reader knows slime's train-dump format_version 2"),
        ({"format_version": 2, "samples": []}, "missing top-level field 'rollout_id'"),
        ({"format_version": 2, "rollout_id": 0, "samples": []}, "field 'samples' is empty"),
        ({"format_version": 2, "rollout_id": 0, "samples": [[1]]}, "samples[0]: expected a dict, got list"),
        ({"format_version": 2, "rollout_id": 0, "samples": [{"rollout_log_probs": torch.zeros(2), "loss_masks": torch.ones(2), "response_lengths": 2}]},
         "samples[0]: missing field 'log_probs'"),
        ({"format_version": 2, "rollout_id": 0, "samples": [{"log_probs": torch.zeros(3), "rollout_log_probs": torch.zeros(2), "loss_masks": torch.ones(2), "response_lengths": 2}]},
         "samples[0]: field 'log_probs' has 3 values, expected response_length=2"),
        ({"format_version": 2, "rollout_id": 0, "samples": [{"log_probs": torch.zeros(2, dtype=torch.long), "rollout_log_probs": torch.zeros(2), "loss_masks": torch.ones(2), "response_lengths": 2}]},
         "must hold floating-point log-probs, got a torch.int64 tensor"),
        ({"format_version": 2, "rollout_id": "7", "samples": []}, "field 'rollout_id' must be an integer, got '7'"),
        ({"rollout_id": 0, "rank": 0, "rollout_data": {"log_probs": [torch.zeros(2)], "rollout_log_probs": [torch.zeros(4)], "loss_masks": [torch.ones(4)], "response_lengths": [4]}},
         "field 'log_probs' has 2 values, expected response_length=4 (a dump written under context parallelism"),
        ({"rollout_id": 0, "rank": 0, "rollout_data": {"log_probs": [torch.zeros(2)], "rollout_log_probs": [torch.zeros(2)], "loss_masks": [torch.ones(2), torch.ones(2)], "response_lengths": [2]}},
         "rollout_data['loss_masks'] has 2 entries, expected one per sample (1)"),
        ({"train_log_probs": torch.zeros(3), "rollout_log_probs": torch.zeros(3)}, "field 'train_log_probs' must be a list of 1-D tensors"),
    ],
)
def test_malformed_pt_payloads(tmp_path, payload, expected):
    path = tmp_path / "bad.pt"
    torch.save(payload, path)
    with pytest.raises(DumpError) as info:
        load_samples(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)


def test_pickled_objects_need_trust_pickle(tmp_path):
    from fractions import Fraction

    path = tmp_path / "obj.pt"
    torch.save({"train_log_probs": [torch.zeros(2)], "rollout_log_probs": [torch.zeros(2)], "extra": Fraction(1, 2)}, path)
    with pytest.raises(DumpError, match="pass --trust-pickle"):
        load_samples(path)
    assert load_samples(path, trust_pickle=True).num_tokens == 2


def test_directory_with_bad_and_mixed_files_analyses_the_rest(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    for rid in range(4):
        write_slime_v2(d / f"train_{rid}.pt", make_samples(4, 10, 0.05, seed=rid), rollout_id=rid)
    (d / "train_2.pt").write_bytes((d / "train_2.pt").read_bytes()[:300])  # truncated mid-write
    write_pt(d / "train_5.pt", make_samples(2, 5, 0.05), rollout_id=5)  # another format in the run
    torch.save({"format_version": 1, "rollout_id": 6, "samples": []}, d / "train_6.pt")  # another version
    assert main(["analyze", str(d), "--json", "--no-progress"]) == 1
    captured = capsys.readouterr()
    rep = _strict_json(captured.out)
    assert [r["rollout_id"] for r in rep["rows"]] == [0, 1, 3]
    bad = {e["file"].rsplit("/", 1)[-1]: e["error"] for e in rep["errors"]}
    assert set(bad) == {"train_2.pt", "train_5.pt", "train_6.pt"}
    assert "not a readable torch.save file" in bad["train_2.pt"]
    assert "mixed formats / versions: this file is pt" in bad["train_5.pt"]
    assert "'format_version' is 1" in bad["train_6.pt"]
    assert "train_2.pt" in captured.err and "(skipped)" in captured.err
    assert main(["analyze", str(d / "nothing*.pt"), "--no-progress"]) == 2
    assert "glob pattern matches no file" in capsys.readouterr().err


def test_forced_format_mismatch_is_clear(tmp_path, capsys):
    path = write_pt(tmp_path / "mine.pt", make_samples(2, 3, 0.1))
    assert main(["analyze", str(path), "--format", "slime", "--no-progress"]) == 2
    assert "mine.pt: missing top-level field 'format_version'" in capsys.readouterr().err


def test_builtin_sample_history_and_png(tmp_path, capsys):
    png = tmp_path / "b.png"
    assert main(["analyze", "--plot", str(png), "--json", "--no-progress"]) == 0
    rep = _strict_json(capsys.readouterr().out)
    assert rep["format"] == "built-in" and rep["metrics"]["mis_k3_kl"] > 0 and png.stat().st_size > 10000
