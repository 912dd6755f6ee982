"""The study's run archive (a folder: ``format.json``, ``SETTING/ARM/seed-S.jsonl.gz``, copies as
``.copy.json``): lossless round trip, a copied run's body stored once, unfinished files skipped,
files on disk never overwritten, unchanged runs never rewritten, and every malformed archive
refused with a message naming what is wrong."""

from __future__ import annotations

import functools
import gzip
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_mis.testbed.study.archive import ARCHIVE_FORMAT, ArchiveError, read_archive, restore_runs, update_archive


def _run_text(setting: str, arm: str, seed: int, rewards: list[float], *, end: bool = True, copied_from: str | None = None) -> str:
    header = {"type": "run", "setting": setting, "arm": arm, "seed": seed, "config": {"seed": seed}}
    if copied_from:
        header["copied_from"] = copied_from
    lines = [json.dumps(header)] + [json.dumps({"type": "step", "step": i, "reward_mean": r}) for i, r in enumerate(rewards)]
    if end:
        lines.append(json.dumps({"type": "end", "evaluation": {"greedy_reward": rewards[-1]}, "wall_s": 1.5}))
    return "\n".join(lines) + "\n"


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.fixture
def out(tmp_path):
    root = tmp_path / "runs"
    _write(root, "sw-k0/none/seed-0.jsonl", _run_text("sw-k0", "none", 0, [0.1, 0.2]))
    _write(root, "sw-k0/none/seed-1.jsonl", _run_text("sw-k0", "none", 1, [0.3, 0.25]))
    _write(root, "sw-k0/ref_fp32/seed-0.jsonl", _run_text("sw-k0", "ref_fp32", 0, [0.5, 0.6]))
    # the reference copied to another dose: another header, the same body
    _write(root, "sw-k1/ref_fp32/seed-0.jsonl",
           _run_text("sw-k1", "ref_fp32", 0, [0.5, 0.6], copied_from="/x/sw-k0/ref_fp32/seed-0.jsonl"))
    _write(root, "sw-k1/none/seed-0.jsonl", _run_text("sw-k1", "none", 0, [0.1, 0.0], end=False))  # still running
    _write(root, "other-k0/none/seed-0.jsonl", _run_text("other-k0", "none", 0, [0.9]))  # another sweep's
    return root


def test_round_trip_is_lossless_and_a_copied_body_is_stored_once(tmp_path, out):
    archive = tmp_path / "keep" / "runs"
    got = update_archive(archive, out, ["sw-k0", "sw-k1"])
    # the unfinished run is not archived; the copied reference is stored as its header only
    assert got == {"runs": 4, "from_disk": 4, "added": 4, "stored_once": 1, "written": 4, "conflicts": []}
    assert json.loads((archive / "format.json").read_text()) == {"format": ARCHIVE_FORMAT}
    assert sorted(p.relative_to(archive).as_posix() for p in archive.rglob("seed-*")) == [
        "sw-k0/none/seed-0.jsonl.gz", "sw-k0/none/seed-1.jsonl.gz", "sw-k0/ref_fp32/seed-0.jsonl.gz",
        "sw-k1/ref_fp32/seed-0.copy.json"]
    copy = json.loads((archive / "sw-k1/ref_fp32/seed-0.copy.json").read_text())
    assert copy["body_of"] == "sw-k0/ref_fp32/seed-0.jsonl" and json.loads(copy["header"])["setting"] == "sw-k1"
    runs = read_archive(archive)
    assert sorted(runs) == ["sw-k0/none/seed-0.jsonl", "sw-k0/none/seed-1.jsonl", "sw-k0/ref_fp32/seed-0.jsonl",
                            "sw-k1/ref_fp32/seed-0.jsonl"]
    for rel, text in runs.items():
        assert text == (out / rel).read_text(encoding="utf-8"), rel
    # into an empty folder: byte for byte the files that were packed
    fresh = tmp_path / "fresh"
    assert restore_runs(archive, fresh) == {"restored": 4, "present": 0, "differ": 0}
    for rel in runs:
        assert (fresh / rel).read_bytes() == (out / rel).read_bytes(), rel
    assert not (fresh / "sw-k1" / "none").exists() and not (fresh / "other-k0").exists()
    # the same runs again: nothing is written, so an archive kept in git does not change
    stamps = {p: p.stat().st_mtime_ns for p in archive.rglob("*")}
    os.utime(archive / "sw-k0/none/seed-0.jsonl.gz", ns=(1, 1))
    stamps[archive / "sw-k0/none/seed-0.jsonl.gz"] = 1
    assert update_archive(archive, fresh, ["sw-k0", "sw-k1"])["written"] == 0
    assert {p: p.stat().st_mtime_ns for p in archive.rglob("*")} == stamps
    # and a second archive of the same runs has the same bytes (gzip's time stamp is fixed)
    again = tmp_path / "again"
    update_archive(again, fresh, ["sw-k0", "sw-k1"])
    for p in archive.rglob("*"):
        if p.is_file():
            assert (again / p.relative_to(archive)).read_bytes() == p.read_bytes(), p


def test_restore_keeps_files_on_disk_and_update_merges(tmp_path, out):
    archive = tmp_path / "archive"
    update_archive(archive, out, ["sw-k0"])
    target = tmp_path / "target"
    _write(target, "sw-k0/none/seed-0.jsonl", _run_text("sw-k0", "none", 0, [0.7, 0.7]))  # a different run there
    _write(target, "sw-k0/none/seed-1.jsonl", (out / "sw-k0/none/seed-1.jsonl").read_text())  # the same one
    assert restore_runs(archive, target) == {"restored": 1, "present": 2, "differ": 1}
    assert json.loads((target / "sw-k0/none/seed-0.jsonl").read_text().splitlines()[1])["reward_mean"] == 0.7
    # a new seed on disk joins the archive; a run of a setting not named is kept; the archive only
    # grows: a different run on disk under a name the archive holds is not written, but named
    _write(target, "sw-k0/none/seed-2.jsonl", _run_text("sw-k0", "none", 2, [0.4]))
    update_archive(archive, out, ["other-k0"])
    got = update_archive(archive, target, ["sw-k0"])
    assert (got["runs"], got["from_disk"], got["added"], got["written"]) == (5, 4, 1, 1)
    assert got["conflicts"] == ["sw-k0/none/seed-0.jsonl"]
    runs = read_archive(archive)
    assert "other-k0/none/seed-0.jsonl" in runs and "sw-k0/none/seed-2.jsonl" in runs
    assert runs["sw-k0/none/seed-0.jsonl"] == (out / "sw-k0/none/seed-0.jsonl").read_text()


def test_a_run_becomes_a_copy_when_an_earlier_name_with_its_body_joins(tmp_path):
    """Bodies are stored in full under the first name in path order: a reference added at k0
    after k1 and k2 were archived takes the body, k1 becomes a copy of it and k2's copy points to it."""
    out, archive = tmp_path / "out", tmp_path / "archive"
    for dose in ("k1", "k2"):
        _write(out, f"a-{dose}/ref/seed-0.jsonl", _run_text(f"a-{dose}", "ref", 0, [0.5]))
    update_archive(archive, out, ["a-k1", "a-k2"])
    assert (archive / "a-k1/ref/seed-0.jsonl.gz").is_file() and (archive / "a-k2/ref/seed-0.copy.json").is_file()
    _write(out, "a-k0/ref/seed-0.jsonl", _run_text("a-k0", "ref", 0, [0.5]))
    got = update_archive(archive, out, ["a-k0", "a-k1", "a-k2"])
    assert (got["added"], got["stored_once"], got["written"]) == (1, 2, 3)
    assert sorted(p.relative_to(archive).as_posix() for p in archive.rglob("seed-*")) == [
        "a-k0/ref/seed-0.jsonl.gz", "a-k1/ref/seed-0.copy.json", "a-k2/ref/seed-0.copy.json"]
    assert json.loads((archive / "a-k2/ref/seed-0.copy.json").read_text())["body_of"] == "a-k0/ref/seed-0.jsonl"
    runs = read_archive(archive)
    for dose in ("k0", "k1", "k2"):
        assert runs[f"a-{dose}/ref/seed-0.jsonl"] == (out / f"a-{dose}/ref/seed-0.jsonl").read_text()


def _archive(tmp_path, files: dict) -> object:
    root = tmp_path / "bad"
    root.mkdir()
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


_FMT = json.dumps({"format": ARCHIVE_FORMAT})
_RUN = gzip.compress(_run_text("s", "none", 0, [0.1]).encode())


@pytest.mark.parametrize(("files", "message"), [
    ({"s/none/seed-0.jsonl.gz": _RUN}, "no format.json, so not a run archive"),
    ({"format.json": json.dumps({"format": "megatron-mis-study-runs/0"})},
     "format 'megatron-mis-study-runs/0', expected 'megatron-mis-study-runs/1'"),
    ({"format.json": "{not json"}, "format.json: not a JSON object"),
    ({"format.json": "[1]"}, "format.json: not a JSON object"),
    ({"format.json": _FMT, "s/none/seed-0.jsonl.gz": "plain text"}, "seed-0.jsonl.gz: not a gzip run file"),
    ({"format.json": _FMT, "s/none/seed-0.copy.json": json.dumps({"header": "{}", "body_of": "s/none/seed-9.jsonl"})},
     "body_of 's/none/seed-9.jsonl' is not a run stored in full"),
    ({"format.json": _FMT, "s/none/seed-0.copy.json": "{"}, "seed-0.copy.json: not JSON"),
    ({"format.json": _FMT, "s/none/seed-0.copy.json": json.dumps({"header": "{}"})},
     "a copy needs a 'header' and a 'body_of' string"),
    ({"format.json": _FMT, "s/none/seed-0.jsonl.gz": _RUN,
      "s/none/seed-0.copy.json": json.dumps({"header": "{}", "body_of": "s/none/seed-0.jsonl"})},
     "s/none/seed-0.jsonl is also stored in full"),
])
def test_malformed_archives_are_refused_naming_the_problem(tmp_path, files, message):
    root = _archive(tmp_path, files)
    with pytest.raises(ArchiveError) as e:
        read_archive(root)
    assert message in str(e.value) and str(root) in str(e.value)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(ArchiveError):  # and an update writes nothing into what it cannot read
        update_archive(root, tmp_path, ["s"])
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_not_a_folder_and_missing(tmp_path):
    path = tmp_path / "runs.jsonl.gz"
    path.write_bytes(gzip.compress(b"{}"))
    with pytest.raises(ArchiveError, match="a run archive is a folder"):
        read_archive(path)
    with pytest.raises(FileNotFoundError, match="no such run archive"):
        read_archive(tmp_path / "missing")
    (tmp_path / "empty").mkdir()  # a folder made for the archive: an empty one
    assert read_archive(tmp_path / "empty") == {}
    # files outside the layout are not read (a report beside the runs, a half-written temporary)
    root = _archive(tmp_path, {"format.json": _FMT, "s/none/seed-0.jsonl.gz": _RUN, "report.md": "# r",
                               "s/none/seed-1.jsonl.gz.tmp99": b"partial", "s/none/notes.txt": "x"})
    assert list(read_archive(root)) == ["s/none/seed-0.jsonl"]


#: docs/study: the committed sweeps' folders (SWEEP/runs the archive, SWEEP/REPORT/summary.json its reports)
_STUDY_DOCS = Path(__file__).resolve().parents[2] / "docs" / "study"
#: two steps of lag at 128 tokens past the first machine's seeds 0-7 (whose runs were not kept): the added seeds, in
#: their own archive and report (none and the reference, the Zen 3 VM, 2026-12-06/07)
_LAG2_128_SEEDS = range(8, 25)
#: its looks, each pre-registered with its own seeds and cut: 8-14 (cut at 21:35 UTC), 8-18 (23:25), 8-24 (00:20)
_LAG2_128_LOOKS = (range(8, 15), range(8, 19), _LAG2_128_SEEDS)
#: token TIS and then bypass on those seeds, a session later on a VM of the same kind, each beside the none and
#: reference runs of its seeds: {arm: (its report in the k2 archive, the seeds it finished by the pre-registered cut)}
_LAG2_128_CORRECTIONS = {"token_tis": ("token-tis", _LAG2_128_SEEDS), "bypass_ppo": ("bypass", range(8, 12))}
#: bypass, none and the reference at two steps of lag at 128 tokens on a third machine's seeds past 24 (a Zen 4 VM,
#: AVX-512 kernels, other trajectories than the Zen 3 VM's, 2026-12-07): (its report in the k2 archive, the seeds
#: finished in all three arms by the pre-registered cut)
_LAG2_128_ZEN4 = ("bypass-zen4", range(25, 33))
#: more seeds of the three arms on a VM of the same kind a session later (2026-12-07): (its report in the k2 archive,
#: the seeds finished in all three arms by its pre-registered cut)
_LAG2_128_ZEN4_MORE = ("more-zen4", range(33, 42))
#: the comparisons pooled over the three machines: (arm, base, its name in the section's table)
_LAG2_128_POOLED = (("bypass_ppo", "ref_fp32", "bypass - reference"), ("bypass_ppo", "none", "bypass - none"),
                    ("none", "ref_fp32", "none - reference"))
#: docs/study/sweep-long-tail-precision/int4-zen4 and bf16-zen4: none at int4 and at bf16 rollouts of the 128-token
#: long-tail task on a Zen 4 VM's seeds from 25 (2026-12-07; the question fixed before any of them ran), each beside the
#: fresh fp32 reference the k2 archive holds for those seeds (copied: the reference resets the precision and the
#: lag); the seeds finished at both doses by the pre-registered cut. The archive holds both doses (one report each)
_PRECISION_128_DOSES = ("int4", "bf16")
_PRECISION_128_SEEDS = range(25, 37)
#: docs/study/sweep-long-tail-precision/int8-zen4: none at int8 rollouts on the same VM kind a session later
#: (2026-12-07; the question fixed before any of them ran), beside the k2 archive's reference, on the seeds finished
#: by the pre-registered cut
_PRECISION_INT8_SEEDS = range(25, 42)
#: the committed archives' reports: (sweep folder, report subfolder, {arm: seeds it quotes})
_REPORTS = [
    ("sweep-long-tail-stale-128", "replication-avx2", {"none": range(12)}),
    ("sweep-long-tail-stale-128", "sequence-mis-seeds-4-5", {"none": (4, 5), "sequence_mis": (4, 5)}),
    ("sweep-long-tail-stale-128", "sequence-seeds-4-5", {"none": (4, 5), "sequence_mis": (4, 5), "sequence_tis": (4, 5)}),
    ("sweep-long-tail-stale-128", "sequence-seeds-4-9", {"none": range(4, 10), "sequence_mis": range(4, 10),
                                                          "sequence_tis": range(4, 10)}),
    ("sweep-long-tail-stale-128", "bypass-k1", {"none": range(12), "bypass_ppo": range(12)}),
    ("sweep-long-tail-stale-128", "token-tis-k1", {"none": range(12), "token_tis": range(12), "bypass_ppo": range(12)}),
    # two steps of lag past the first machine's 8 seeds: none and the reference, their own archive (the Zen 3 VM)
    ("sweep-long-tail-stale-128-k2", ".", {"none": _LAG2_128_SEEDS}),
    *(("sweep-long-tail-stale-128-k2", report, {"none": seeds, arm: seeds})
      for arm, (report, seeds) in _LAG2_128_CORRECTIONS.items()),
    # and bypass, none and the reference on a third machine's seeds past 24, a session later on a Zen 4 VM
    ("sweep-long-tail-stale-128-k2", _LAG2_128_ZEN4[0], {"none": _LAG2_128_ZEN4[1], "bypass_ppo": _LAG2_128_ZEN4[1]}),
    ("sweep-long-tail-stale-128-k2", _LAG2_128_ZEN4_MORE[0], {"none": _LAG2_128_ZEN4_MORE[1],
                                                              "bypass_ppo": _LAG2_128_ZEN4_MORE[1]}),
    # none at int4 and bf16 rollouts of the 128-token task on the Zen 4 VM's seeds, beside the k2 archive's reference
    *(("sweep-long-tail-precision", f"{dose}-zen4", {"none": _PRECISION_128_SEEDS}) for dose in _PRECISION_128_DOSES),
    ("sweep-long-tail-precision", "int8-zen4", {"none": _PRECISION_INT8_SEEDS}),
    ("sweep-long-tail-stale-256", "seeds-6-7", {"none": (6, 7), "token_tis": (6, 7), "bypass_ppo": (6, 7)}),
    ("sweep-long-tail-stale-256", "seeds-6-8", {"none": (6, 7, 8), "token_tis": (6, 7, 8), "bypass_ppo": (6, 7, 8)}),
    ("sweep-long-tail-stale-256", "sequence-seeds-6-7", {"none": (6, 7), "token_tis": (6, 7), "bypass_ppo": (6, 7),
                                                          "sequence_mis": (6, 7), "sequence_tis": (6, 7)}),
    ("sweep-long-tail-stale-256", "sequence-seeds-6-8", {"none": (6, 7, 8), "token_tis": (6, 7, 8), "bypass_ppo": (6, 7, 8),
                                                          "sequence_mis": (6, 7, 8), "sequence_tis": (6, 7, 8)}),
    # seeds 9-10 on a third VM (AVX-512 kernels); the sequence-level arms of seed 10 ran last
    ("sweep-long-tail-stale-256", "sequence-seeds-6-9", {"none": range(6, 10), "token_tis": range(6, 10),
                                                          "bypass_ppo": range(6, 10), "sequence_mis": range(6, 10),
                                                          "sequence_tis": range(6, 10)}),
    ("sweep-long-tail-stale-256", "seeds-6-10", {"none": range(6, 11), "token_tis": range(6, 11),
                                                  "bypass_ppo": range(6, 11)}),
    ("sweep-long-tail-stale-256", "sequence-seeds-6-10", {"none": range(6, 11), "token_tis": range(6, 11),
                                                           "bypass_ppo": range(6, 11), "sequence_mis": range(6, 11),
                                                           "sequence_tis": range(6, 11)}),
    # one step of lag at 120 seeds (150 steps): none, the reference and token TIS (third VM), decoupled PPO, token
    # MIS and the first 60 seeds of bypass and sequence MIS (fourth VM), their own archive
    ("sweep-staleness-k1", ".", {"none": range(120), "token_tis": range(120), "decoupled_ppo": range(120),
                                 "token_mis": range(120), "bypass_ppo": range(60), "sequence_mis": range(60)}),
    # a rollout-only temperature of 0.5 at 60 seeds (150 steps, the fourth VM): its own archive
    ("sweep-temperature-t0.5", ".", {"none": range(60), "token_tis": range(60), "token_mis": range(60)}),
    # and seeds 100-199 of none and the shuffled weights, a session later on an Intel VM (the dose-curves report's)
    ("sweep-temperature-t0.5", "shuffled-intel", {a: range(100, 200) for a in ("none", "token_tis_shuffled",
                                                                               "token_tis")}),
    # and seeds 200-299 of the same three arms, a day later on a Zen 4 VM (AVX-512 kernels, other trajectories)
    ("sweep-temperature-t0.5", "shuffled-zen4", {a: range(200, 300) for a in ("none", "token_tis_shuffled",
                                                                              "token_tis")}),
    # and the reference on those seeds, right after them on the same VM, beside them
    ("sweep-temperature-t0.5", "reference-zen4", {a: range(200, 300) for a in ("none", "ref_fp32",
                                                                               "token_tis_shuffled", "token_tis")}),
    # and token TIS's raise alone and its discount alone on those seeds, a session later on a VM of the same kind
    ("sweep-temperature-t0.5", "floor-cap-zen4", {a: range(200, 300) for a in ("none", "ref_fp32", "token_tis",
                                                                               "token_tis_floor1", "token_tis_cap1")}),
    # and of 1.5, in a later session on the same VM
    ("sweep-temperature-t1.5", ".", {"none": range(60), "token_tis": range(60), "token_mis": range(60),
                                     # and the three token TIS diagnostics, a day later on a Zen 1 VM
                                     "token_tis_floor1": range(60), "token_tis_cap1": range(60),
                                     "token_tis_shuffled": range(60),
                                     # and the two of the zero-sum account, a session later on the same VM
                                     "token_tis_group_mean": range(60), "token_tis_balanced": range(60),
                                     # and the group mean's placebo, a session later on the same VM
                                     "token_tis_group_permuted": range(60)}),
    # and 40 more seeds of none and token TIS, the same session and VM, then of the group mean, its placebo and
    # the shuffled weights, a session later: a 100-seed report without a reference
    ("sweep-temperature-t1.5", "seeds-100", {"none": range(100), "token_tis": range(100),
                                             "token_tis_group_mean": range(100), "token_tis_group_permuted": range(100),
                                             "token_tis_shuffled": range(100)}),
    # and seeds 100-199 of none, token TIS, the placebo and its noise halved and doubled on an Intel VM (AVX-512
    # kernels: other trajectories than the AVX2 VMs'), the same session
    ("sweep-temperature-t1.5", "noise-dose", {"none": range(100, 200), "token_tis": range(100, 200),
                                              "token_tis_group_permuted": range(100, 200),
                                              "token_tis_group_permuted_half": range(100, 200),
                                              "token_tis_group_permuted_double": range(100, 200)}),
    # and seeds 100-199 of the group mean, the shuffled weights and the shuffled weights at half and twice the dose,
    # a session later on an Intel VM of the same kind, beside none, token TIS and the placebo of the noise-dose report
    ("sweep-temperature-t1.5", "token-weights", {a: range(100, 200) for a in (
        "none", "token_tis", "token_tis_group_permuted", "token_tis_group_mean", "token_tis_shuffled",
        "token_tis_shuffled_half", "token_tis_shuffled_double")}),
    # and seeds 200-299 of none and the shuffled weights at a tenth and a quarter of the dose, a session later on a
    # Zen 4 VM (AVX-512 kernels, other trajectories than the Intel VM's): none's own runs there
    ("sweep-temperature-t1.5", "shuffled-low-doses", {a: range(200, 300) for a in (
        "none", "token_tis_shuffled_tenth", "token_tis_shuffled_quarter")}),
    # and the placebo at the powers 3.5 and 6 on the same seeds, a day later on a Zen 5 VM that repeats the Zen 4
    # VM's runs bit for bit, then the shuffled weights' half dose there, beside the Zen 4 VM's none
    ("sweep-temperature-t1.5", "group-wide-doses", {a: range(200, 300) for a in (
        "none", "token_tis_group_permuted_wide", "token_tis_group_permuted_wider", "token_tis_shuffled_half")}),
    # and both wide doses and the shuffled weights' quarter dose on the Intel seeds 100-199, a session later on a
    # third Intel VM of the kind that repeats the first one's runs bit for bit: every rewritten arm there
    ("sweep-temperature-t1.5", "dose-curves", {a: range(100, 200) for a in (
        "none", "token_tis_group_permuted_half", "token_tis_group_permuted", "token_tis_group_mean",
        "token_tis_group_permuted_double", "token_tis_group_permuted_wide", "token_tis_group_permuted_wider",
        "token_tis_shuffled_quarter", "token_tis_shuffled_half", "token_tis_shuffled", "token_tis_shuffled_double")}),
    # and of 1.25, a session after that on the same VM
    ("sweep-temperature-t1.25", ".", {"none": range(60), "token_tis": range(60), "token_mis": range(60)}),
    # and seeds 100-199 of the T = 0.5 shuffled-intel report's arms, a session after that one on an Intel VM of its kind
    ("sweep-temperature-t1.25", "shuffled-intel", {a: range(100, 200) for a in ("none", "token_tis_shuffled",
                                                                                "token_tis")}),
    # and none and the reference on seeds 200-299, a day later on a Zen 4 VM
    ("sweep-temperature-t1.25", "reference-zen4", {a: range(200, 300) for a in ("none", "ref_fp32")}),
    # and token TIS on those seeds, on a VM of the same kind by the session after, beside them
    ("sweep-temperature-t1.25", "token-tis-zen4", {a: range(200, 300) for a in ("none", "ref_fp32", "token_tis")}),
    # the shuffled-intel arms at 0.75, right after those at 1.25 on the same Intel VM: their own archive
    ("sweep-temperature-t0.75", "shuffled-intel", {a: range(100, 200) for a in ("none", "token_tis_shuffled",
                                                                                "token_tis")}),
    # and none, the reference and token TIS on seeds 200-299 of a Zen 4 VM, by the session after its T = 1.25 reference
    ("sweep-temperature-t0.75", "reference-zen4", {a: range(200, 300) for a in ("none", "ref_fp32", "token_tis")}),
    # none and the reference for 600 steps (third VM): their own archive, a --steps variant
    ("sweep-long-tail-stale-256-600-steps", "seeds-9-10", {"none": (9, 10)}),
    ("sweep-long-tail-stale-256-600-steps", "seeds-9-11", {"none": (9, 10, 11)}),
    # token TIS and bypass for 600 steps on the same seeds and VM
    ("sweep-long-tail-stale-256-600-steps", "all-arms-seeds-9-11", {"none": (9, 10, 11), "token_tis": (9, 10, 11),
                                                                     "bypass_ppo": (9, 10, 11)}),
]


def _committed_finals(sweep: str, summary: dict) -> dict:
    """``{(arm, seed): final reward}`` of every run in docs/study/SWEEP/runs, each checked complete
    and of the report's dose and step count."""
    return {key: m["final_reward"] for key, m in _committed_metrics(sweep, summary).items()}


def _committed_metrics(sweep: str, summary: dict) -> dict:
    """``{(arm, seed): run_metrics(...)}`` (every per-run metric) of every run in docs/study/SWEEP/runs, with the
    report's parameters, each run checked complete and of the report's dose and step count."""
    (dose,) = summary["doses"]
    study = summary["study"]
    return _archive_metrics(sweep, dose["setting"], summary["steps"], study["last_k"], summary["threshold"],
                            study["collapse_fraction"])


@functools.cache
def _archive_metrics(sweep: str, setting: str, steps: int, last_k: int, threshold: float,
                     collapse_fraction: float) -> dict:
    """:func:`_committed_metrics` by value: an archive is read and its metrics computed once per
    sweep and report parameters, not once per report that quotes it. An archive holds one setting
    (the report's), except those of :data:`_MULTI_DOSE_ARCHIVES`, whose other doses' runs are left out."""
    from megatron_mis.testbed.study.stats import run_metrics

    metrics = {}
    for (run_setting, arm, seed), (records, end) in _archive_runs(sweep).items():
        if run_setting != setting and sweep in _MULTI_DOSE_ARCHIVES:
            continue
        assert run_setting == setting and len(records) == steps, (run_setting, arm, seed)
        metrics[arm, seed] = run_metrics(records, end, last_k=last_k, threshold=threshold,
                                         collapse_fraction=collapse_fraction)
    return metrics


#: The archives that hold several doses of a sweep (one report per dose): their runs are filed under their own
#: setting, and a report's figures read only its dose's
_MULTI_DOSE_ARCHIVES = frozenset({"sweep-long-tail-precision", "sweep-long-tail-truncation", "sweep-moe-noise",
                                  "sweep-top-p"})


@functools.cache
def _archive_records(sweep: str) -> dict:
    """``{(setting, arm, seed): every record of the run}`` in docs/study/SWEEP/runs, each run checked
    complete (a header first, an end record last) and filed under its own setting and arm; read and
    parsed once per sweep."""
    records = {}
    for rel, text in read_archive(_STUDY_DOCS / sweep / "runs").items():
        lines = [json.loads(x) for x in text.splitlines()]
        assert lines[0]["type"] == "run" and lines[-1]["type"] == "end", rel
        run_setting, arm, _ = rel.split("/")
        assert run_setting == lines[0]["setting"] and arm == lines[0]["arm"], rel
        records[run_setting, arm, lines[0]["seed"]] = lines
    return records


@functools.cache
def _archive_runs(sweep: str) -> dict:
    """``{(setting, arm, seed): (step records, end record)}`` of every run in docs/study/SWEEP/runs."""
    return {key: ([x for x in lines if x["type"] == "step"], lines[-1])
            for key, lines in _archive_records(sweep).items()}


def _archive_headers(sweep: str) -> dict:
    """``{(setting, arm, seed): the run's header record}`` of docs/study/SWEEP/runs (its
    configuration and the machine it was made on)."""
    return {key: lines[0] for key, lines in _archive_records(sweep).items()}


def _summary(sweep: str, report: str) -> dict:
    return json.loads((_STUDY_DOCS / sweep / report / "summary.json").read_text())


def _prose(path: Path) -> str:
    """A document's text with every run of whitespace one space: quoted figures may wrap."""
    return " ".join(path.read_text().split())


@functools.cache
def _sections(path: Path) -> tuple[tuple[str, str], ...]:
    """``(heading, prose)`` of every Markdown section of a document: from its heading to the next
    heading of its level or above (so a section holds its subsections), as :func:`_prose` writes
    it; a line starting with ``#`` inside a fenced code block is code, not a heading."""
    lines = path.read_text().splitlines()
    headings, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            headings.append((i, len(line) - len(line.lstrip("#"))))
    out = []
    for j, (i, level) in enumerate(headings):
        end = next((k for k, lv in headings[j + 1:] if lv <= level), len(lines))
        out.append((lines[i], " ".join(" ".join(lines[i:end]).split())))
    return tuple(out)


def _section(part: str, path: Path = _STUDY_DOCS.parent / "study.md") -> str:
    """The prose of the one section of ``path`` (docs/study.md) whose heading contains ``part``, so
    a figure quoted for one run is looked for where that run is reported, not anywhere."""
    found = [prose for heading, prose in _sections(path) if part in heading]
    assert len(found) == 1, (part, [h for h, _ in _sections(path) if part in h])
    return found[0]


def _assert_quoted(quoted: list[str], text: str, context: object = None) -> None:
    """Every string of ``quoted`` is in ``text``; a failure lists those that are not (with
    ``context`` when given)."""
    missing = [q for q in quoted if q not in text]
    assert not missing, missing if context is None else (missing, context)


def _e(x: float, digits: int) -> str:
    """``x`` as docs/study.md writes it: 2.5e-2, not 2.5e-02."""
    return re.sub(r"e([-+])0(\d)", r"e\1\2", f"{x:.{digits}e}")


def _quoted(d: dict, fmt: str = "{:+.3f}") -> str:
    """A :func:`~megatron_mis.testbed.study.stats.paired_differences` result as the docs quote it."""
    return f"{fmt.format(d['mean'])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"


@pytest.mark.parametrize("sweep, report, arms", _REPORTS)
def test_the_committed_archive_reads_and_gives_its_report_s_numbers(sweep, report, arms):
    """docs/study/SWEEP/runs (the committed run archives): every run is complete, and the
    per-seed arm - reference differences of every arm a report (REPORT/summary.json) quotes,
    recomputed from the archive, are the ones it quotes (arm - none in a report that ran no
    reference), so a format change that broke committed archives, or an archive that drifted from
    its report, fails here."""
    summary = _summary(sweep, report)
    final = _committed_finals(sweep, summary)
    (dose,) = summary["doses"]
    reference = "ref_fp32" if "ref_fp32" in dose["arms"] else "none"
    assert sorted(dose["arms"]) == sorted({*arms, reference})
    for name, seeds in arms.items():
        if name == reference:
            continue
        diffs = {str(seed): final[name, seed] - final[reference, seed] for seed in seeds}
        quoted = dose["arms"][name]["vs_reference" if reference == "ref_fp32" else "vs_none"]["final_reward"]["diffs"]
        assert diffs == pytest.approx(quoted, abs=1e-12) and len(quoted) == len(seeds), name
    if reference == "ref_fp32":
        assert dose["none_vs_reference"]["diffs"] == dose["arms"]["none"]["vs_reference"]["final_reward"]["diffs"]
    else:  # no reference: no none - reference
        assert dose["none_vs_reference"] is None and list(dose["arms"]["none"]["seeds"]) == list(arms["none"])


#: the committed sweep summaries the current report writer reads (those with an ``outcome``; older
#: reports were written before it, and their summaries lack fields it needs)
_CURRENT_SWEEP_SUMMARIES = sorted(
    p.parent.relative_to(_STUDY_DOCS).as_posix()
    for p in _STUDY_DOCS.rglob("summary.json") if "outcome" in json.loads(p.read_text())
)


def test_the_current_sweep_reports_are_their_summaries_markdown():
    """Each such report.md is what the report writer makes of its summary.json, so a report
    edited by hand, or left behind when the writer changed (its detectable-effect line), fails."""
    from megatron_mis.testbed.study.sweep_report import format_sweep_markdown

    assert len(_CURRENT_SWEEP_SUMMARIES) >= 10, _CURRENT_SWEEP_SUMMARIES
    for folder in _CURRENT_SWEEP_SUMMARIES:
        summary = json.loads((_STUDY_DOCS / folder / "summary.json").read_text())
        assert (_STUDY_DOCS / folder / "report.md").read_text() == format_sweep_markdown(summary), folder


@pytest.mark.parametrize("sweep", sorted({sweep for sweep, _, _ in _REPORTS}))
def test_every_committed_run_is_in_a_report(sweep):
    """A run added to a committed archive without a report that quotes it fails here (a report
    quotes its reference's runs on its seeds where it ran one; in an archive of several doses, each
    report its own dose's runs)."""
    quoted = set()
    for report, arms in [(report, arms) for s, report, arms in _REPORTS if s == sweep]:
        (dose,) = _summary(sweep, report)["doses"]  # its runs' completeness and step count: the test above
        runs = {(dose["setting"], arm, seed) for arm, seeds in arms.items() for seed in seeds}
        if "ref_fp32" in dose["arms"]:
            runs |= {(setting, "ref_fp32", seed) for setting, _, seed in runs}
        quoted |= runs
    assert set(_archive_runs(sweep)) == quoted


def test_the_quoted_bypass_over_token_tis_at_128_tokens_k1_comes_from_the_archive():
    """docs/study.md and ``analyze`` quote bypass - token TIS at long-tail-stale-128 k1
    (12 seeds on the second VM), a pair that no report prints: recomputed from the committed
    archive with the reports' paired bootstrap, it is the figure they quote."""
    from megatron_mis.analysis.recommend import recommend
    from megatron_mis.testbed.study.stats import paired_differences

    summary = _summary("sweep-long-tail-stale-128", "token-tis-k1")
    final = _committed_finals("sweep-long-tail-stale-128", summary)
    bypass = {s: final["bypass_ppo", s] for s in range(12)}
    token_tis = {s: final["token_tis", s] for s in range(12)}
    d = paired_differences(bypass, token_tis, confidence=summary["study"]["confidence"],
                           resamples=summary["study"]["bootstrap"])
    quoted = _quoted(d)
    assert d["n"] == 12 and quoted == "+0.043 [+0.005, +0.088]"
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    assert quoted in study_md and quoted in " ".join(recommend(1e-3, 2000).basis.split())


def test_the_quoted_k3_guard_figures_at_128_tokens_k1_come_from_the_archive():
    """docs/study.md asks whether a K3 threshold would have singled out the runs that failed at
    long-tail-stale-128 k1 (second VM): each run's peak 20-step mean K3, the failures (collapsed by
    the reports' rule, or ended low in the reports' summary.json), and the counts of runs that
    learned and a threshold would still flag, recomputed from the committed archive, are the ones
    it quotes."""
    from megatron_mis.testbed.study.stats import moving_mean, run_metrics

    sequence = _summary("sweep-long-tail-stale-128", "sequence-seeds-4-9")
    summaries = {"sequence_mis": sequence, "sequence_tis": sequence}
    main = _summary("sweep-long-tail-stale-128", "token-tis-k1")
    study = main["study"]
    peak, failed, at, at_threshold = {}, set(), {}, {}
    for (setting, arm, seed), (records, end) in _archive_runs("sweep-long-tail-stale-128").items():
        if setting != "long-tail-stale-128-k1":
            continue
        curve = moving_mean([r["mis_k3_kl"] for r in records], 20)
        peak[arm, seed], at[arm, seed] = float(curve.max()), int(curve.argmax()) + 20  # the window's last step
        low = summaries.get(arm, main)["doses"][0]["arms"][arm]["ended_low"]["seeds"]
        m = run_metrics(records, end, last_k=study["last_k"], threshold=main["threshold"],
                        collapse_fraction=study["collapse_fraction"])
        at_threshold[arm, seed] = m["steps_to_threshold"]
        if m["collapsed"] or seed in low:
            failed.add((arm, seed))
    assert failed == {("token_tis", 1), ("token_tis", 2), ("sequence_mis", 4), ("sequence_mis", 7), ("sequence_mis", 9),
                      ("sequence_tis", 4), ("ref_fp32", 8)}
    mismatched = [k for k in peak if k[0] != "ref_fp32"]
    learned = [k for k in mismatched if k not in failed]
    tis_learned = sorted(peak[k] for k in learned if k[0] == "token_tis")
    mis_learned = sorted(peak[k] for k in learned if k[0] == "sequence_mis")

    def flagged(tau: float) -> tuple[int, int, int]:
        """(failures caught, runs that learned flagged, of them none's) at a threshold ``tau``."""
        return (sum(peak[k] >= tau for k in failed if k in mismatched), sum(peak[k] >= tau for k in learned),
                sum(peak[k] >= tau for k in learned if k[0] == "none"))

    lowest_failure = min(peak[k] for k in failed if k in mismatched)
    quoted = [
        f"peaked at {_e(peak['token_tis', 1], 1)} (step {at['token_tis', 1]}",
        f"and {_e(peak['token_tis', 2], 1)} (step {at['token_tis', 2]}",
        f"within the {_e(tis_learned[0], 1)} to {_e(tis_learned[-1], 1)} of its {len(tis_learned)} runs that learned "
        f"({sum(p >= peak['token_tis', 1] for p in tis_learned)} of them at or above {_e(peak['token_tis', 1], 1)})",
        f"peaked at {_e(peak['sequence_mis', 4], 2)} at step {at['sequence_mis', 4]}",
        "fires on {1} of the {n} mismatched runs that learned ({2} of none's".format(*flagged(lowest_failure), n=len(learned)),
        "at 2.5e-2 it catches {0} of the {n} and fires on {1} ({2} of none's)".format(
            *flagged(0.025), n=sum(k in mismatched for k in failed)),
        f"sequence TIS's seed 4, which took off only at step {at_threshold['sequence_tis', 4]} and ended low",
        f"peaked at {_e(peak['sequence_tis', 4], 1)} at step {at['sequence_tis', 4]}, below the "
        f"{_e(peak['sequence_tis', 5], 1)} (step {at['sequence_tis', 5]}) of its seed 5, which learned",
        f"peaked at {_e(peak['sequence_mis', 7], 1)} (step {at['sequence_mis', 7]}) and {_e(peak['sequence_mis', 9], 1)} "
        f"(step {at['sequence_mis', 9]}), just above the {_e(mis_learned[0], 1)} to {_e(mis_learned[-1], 1)} of its "
        f"{len(mis_learned)} runs that learned",
        f"Bypass's 20-step K3 peaked at most at {_e(max(v for k, v in peak.items() if k[0] == 'bypass_ppo'), 1)}",
        f"a 20-step K3 of {_e(peak['ref_fp32', 8], 0)}",
    ]
    text = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted(quoted, text)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert f"would have fired on {flagged(lowest_failure)[1]} of the {len(learned)} that learned" in readme


def test_the_pooled_sequence_level_figures_at_128_tokens_k1_come_from_both_machines():
    """docs/study.md quotes sequence MIS and sequence TIS at long-tail-stale-128 k1 pooled
    over the first machine's seeds 0-3 (the sweep's summary.json, its runs not kept) and the second
    VM's archived seeds, each against its own machine's reference and none of the same seed, with
    the reports' paired bootstrap: recomputed here, they are the figures quoted."""
    from megatron_mis.testbed.study.stats import paired_differences

    first = json.loads((_STUDY_DOCS / "sweep-long-tail-stale-128" / "summary.json").read_text())
    (dose,) = [d for d in first["doses"] if d["setting"] == "long-tail-stale-128-k1"]
    study = first["study"]
    second = _committed_finals("sweep-long-tail-stale-128", _summary("sweep-long-tail-stale-128", "token-tis-k1"))
    figures = {}
    for arm in ("sequence_mis", "sequence_tis"):
        mine = {int(s): v for s, v in dose["arms"][arm]["vs_reference"]["final_reward"]["diffs"].items()}
        none = {int(s): v for s, v in dose["arms"]["none"]["vs_reference"]["final_reward"]["diffs"].items()
                if int(s) in mine}
        assert sorted(mine) == [0, 1, 2, 3], arm
        for (a, seed), value in second.items():
            if a == arm:
                mine[seed] = value - second["ref_fp32", seed]
                none[seed] = second["none", seed] - second["ref_fp32", seed]
        assert sorted(mine) == list(range(10)), arm
        for name, baseline in (("reference", dict.fromkeys(mine, 0.0)), ("none", none)):
            figures[arm, name] = _quoted(paired_differences(mine, baseline, confidence=study["confidence"],
                                                            resamples=study["bootstrap"]))
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    missing = [k for k, v in figures.items() if v not in study_md]
    assert not missing, (missing, figures)


def test_two_steps_of_lag_at_128_tokens_pools_the_first_machine_s_seeds_with_the_added_ones():
    """docs/study.md's section on long-tail-stale-128 k2 past 8 seeds: none - reference on the final reward pooled
    over the first machine's seeds 0-7 (the sweep's summary.json, each seed's difference on its own machine) and the
    added seeds' archive, with the reports' paired bootstrap; the added seeds alone and the first 8 beside it; the
    paired SD, MDE and seeds a 0.05 difference needs, at each pre-registered look (a table row each); the added runs'
    outcomes, machine and times; none's collapses over both machines; and the outcomes of the questions fixed before
    they ran (harm only where the pooled CI excludes 0 below it; the 0.05 target)."""
    import numpy as np

    from megatron_mis.testbed.study.stats import paired_differences, seeds_for_effect

    archive, added = "sweep-long-tail-stale-128-k2", _LAG2_128_SEEDS
    first, old = _summary("sweep-long-tail-stale-128", "."), _dose("sweep-long-tail-stale-128", ".", "k2")
    old_diffs = {int(s): v for s, v in old["none_vs_reference"]["diffs"].items()}
    assert sorted(old_diffs) == list(range(added.start))
    summary = _summary(archive, ".")
    (dose,) = summary["doses"]
    study = summary["study"]
    assert dose["setting"] == old["setting"] and summary["steps"] == first["steps"]
    assert all(study[k] == first["study"][k] for k in ("bootstrap", "confidence", "last_k", "collapse_fraction"))
    assert sorted(dose["arms"]) == ["none", "ref_fp32"]
    # the archive also holds the corrections run on these seeds later and a third machine's seeds past them (the
    # next two sections'): none's and the reference's runs of these seeds
    mine = {(arm, seed) for arm in ("none", "ref_fp32") for seed in added}
    metrics = {key: m for key, m in _committed_metrics(archive, summary).items() if key in mine}
    runs = {key: run for key, run in _archive_runs(archive).items() if key[1:] in mine}
    headers = {key: h for key, h in _archive_headers(archive).items() if key[1:] in mine}
    final = {key: m["final_reward"] for key, m in metrics.items()}
    assert set(final) == mine == {key[1:] for key in runs} == {key[1:] for key in headers}
    assert _kinds(headers.values()) == {_ZEN3}
    assert {h["config"]["threads"] for h in headers.values()} == {1}
    assert not any(h.get("copied_from") for h in headers.values())  # every run made here, none copied

    def alone(seeds: range) -> dict:
        """none - reference over these added seeds alone, with the reports' paired bootstrap."""
        return paired_differences({s: final["none", s] for s in seeds}, {s: final["ref_fp32", s] for s in seeds},
                                  confidence=study["confidence"], resamples=study["bootstrap"])

    def look(seeds: range) -> tuple[dict, dict, float, float, int]:
        """The added seeds' none - reference alone and pooled with the first machine's, the pooled SD, MDE and the
        seeds a 0.05 difference needs, at one look."""
        new_diffs = {s: final["none", s] - final["ref_fp32", s] for s in seeds}
        pooled = paired_differences({**old_diffs, **new_diffs}, dict.fromkeys([*old_diffs, *new_diffs], 0.0),
                                    confidence=study["confidence"], resamples=study["bootstrap"])
        sd = float(np.std(list(pooled["diffs"].values()), ddof=1))
        return alone(seeds), pooled, sd, _paired_mde(pooled), seeds_for_effect(sd, 0.05)

    assert _LAG2_128_LOOKS[-1] == added and all(seeds.start == added.start for seeds in _LAG2_128_LOOKS)
    alone_added, pooled, sd, mde, needed = look(added)
    assert _quoted(alone_added) == _quoted(dose["none_vs_reference"])  # the report's own figure, recomputed
    arms = dose["arms"]
    walls = [end["wall_s"] for _, end in runs.values()]
    n = len(pooled["diffs"])
    rows = []  # one table row per look, in order
    for seeds in _LAG2_128_LOOKS:
        alone_, pooled_, sd_, mde_, needed_ = look(seeds)
        rows.append(f"| {len(pooled_['diffs'])} | {_quoted(pooled_)} | {_quoted(alone_)} | "
                    f"{_quoted(old['none_vs_reference'])} | {sd_:.3f} | {mde_:.3f} | {needed_} |")
    section = _section("Two steps of lag at 128 tokens on more seeds")
    _assert_quoted(rows, section)  # one row per look, in order, and no other row of figures in the table
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert len(re.findall(r"\| \d+ \| [-+]\d", section)) == len(rows)
    quotes = [
        f"seeds {added.start}-{added.stop - 1} alone {_quoted(dose['none_vs_reference'])}",
        f"none {np.mean([final['none', s] for s in added]):.3f} and the reference "
        f"{np.mean([final['ref_fp32', s] for s in added]):.3f}",
        f"collapsed: none {arms['none']['collapse']['k']} of {len(added)}, the reference "
        f"{arms['ref_fp32']['collapse']['k']}; ended low: none {arms['none']['ended_low']['k']}, the reference "
        f"{arms['ref_fp32']['ended_low']['k']}",
        f"{len(walls)} runs, {sum(walls) / 3600:.1f} CPU-hours, {np.median(walls) / 60:.1f} min per run (median)",
        f"the paired SD over the {n} seeds is {sd:.3f}, so a 0.05 difference needs {needed} seeds",
        ("**Harm at two steps of lag**" if pooled["high"] < 0 else "**No harm shown at two steps of lag**"),
        (f"MDE {mde:.3f}: the 0.05 target is met" if mde <= 0.05 else f"MDE {mde:.3f}: the 0.05 target is not met"),
        *([f"needs {needed} seeds, {needed - n} more pairs"] if needed > n else []),
    ]
    # collapses over both machines' seeds: the first machine's from its report, the added ones' from their runs
    k = {a: arms[a]["collapse"]["k"] + old["arms"][a]["collapse"]["k"] for a in ("none", "ref_fp32")}
    collapsed = sorted(seed for (arm, seed), m in metrics.items() if arm == "none" and m["collapsed"])
    assert len(collapsed) == arms["none"]["collapse"]["k"]
    first_worst = f"seed {min(old_diffs, key=old_diffs.get)}"
    if not collapsed:
        quotes.append(f"collapse of none ({first_worst}, {min(old_diffs.values()):+.3f}) did not recur")
    else:  # it recurred: each collapsed seed as quoted, the collapse counts of both machines and their Fisher test
        fisher = _fisher_one_sided(k["none"], k["none"] + k["ref_fp32"], n)  # none's count or more of the collapses
        quotes += [*(f"seed {s} here (none {final['none', s]:.3f}, the reference {final['ref_fp32', s]:.3f}, "
                     f"{final['none', s] - final['ref_fp32', s]:+.3f})" for s in collapsed),
                   f"beside {first_worst} there ({min(old_diffs.values()):+.3f})",
                   f"None collapsed in {k['none']} of {n} seeds and the reference in {k['ref_fp32'] or 'none'}",
                   f"one-sided Fisher exact p = {fisher:.2f}"]
        others = [d for s, d in pooled["diffs"].items() if s not in collapsed]  # without the added collapsed seeds
        quotes += [f"({np.mean(others):+.3f} over the other {len(others)} seeds)",
                   f"(the other {len(others)} seeds' SD is {np.std(others, ddof=1):.3f})"]
    batch = range(_LAG2_128_LOOKS[-2].stop, added.stop)  # the last look's own seeds, as that look's runner reported
    alone_batch = alone(batch)
    below = sum(final["none", s] < final["ref_fp32", s] for s in batch)
    quotes.append(f"The third look's six seeds alone gave {_quoted(alone_batch)} (seeds {batch.start}-{batch.stop - 1}; "
                  f"{below} of the {len(batch)} below 0)")
    assert len(_LAG2_128_LOOKS) == 3 and len(batch) == 6  # the sentence's "third look" and "six seeds"
    _assert_quoted(quotes, section)
    # the answers table, the README and analyze carry the pooled figure of the next look (a third machine's)


def test_token_tis_and_bypass_at_two_steps_of_lag_at_128_tokens_pool_the_first_machine_s_seeds():
    """docs/study.md's section on token TIS and bypass at long-tail-stale-128 k2 past 8 seeds: each correction -
    reference and - none on the final reward over the added seeds alone (the k2 archive; each report's own figure,
    recomputed) and pooled with the first machine's seeds 0-7 (its summary.json's per-seed differences, each seed's
    difference on its own machine), the pooled paired SD and MDE (one table row per correction); the added runs'
    means, collapses, machine and times; and the outcomes of the questions fixed before they ran: token TIS's cost
    confirmed only where the added seeds' CI excludes 0 below it, token TIS against none and bypass against either a
    difference only where the pooled CI excludes 0."""
    import numpy as np

    from megatron_mis.testbed.study.stats import paired_differences, seeds_for_effect

    archive = "sweep-long-tail-stale-128-k2"
    old = _dose("sweep-long-tail-stale-128", ".", "k2")
    headers, runs = _archive_headers(archive), _archive_runs(archive)
    section = _section("Token TIS and bypass at two steps of lag at 128 tokens")
    rows, quotes, pooled, alones = [], [], {}, {}
    for arm, (report, added) in _LAG2_128_CORRECTIONS.items():
        summary = _summary(archive, report)
        (dose,) = summary["doses"]
        study = summary["study"]
        assert dose["setting"] == old["setting"] and sorted(dose["arms"]) == sorted({"none", "ref_fp32", arm})
        assert list(dose["arms"][arm]["seeds"]) == list(added)
        # the archive also holds a third machine's seeds past 24 (the next section's): this report's seeds
        metrics = {(a, s): m for (a, s), m in _committed_metrics(archive, summary).items() if s < _LAG2_128_SEEDS.stop}
        final = {key: m["final_reward"] for key, m in metrics.items()}
        assert {s for a, s in final if a == arm} == set(added)  # every run of the correction is its report's
        made = {key: h for key, h in headers.items() if key[1] == arm and key[2] in added}
        assert _kinds(made.values()) == {_ZEN3}
        assert {h["config"]["threads"] for h in made.values()} == {1} and not any(h.get("copied_from") for h in made.values())
        boot = {"confidence": study["confidence"], "resamples": study["bootstrap"]}
        alone = alones[arm] = {}
        for base, key in (("ref_fp32", "vs_reference"), ("none", "vs_none")):
            first = {int(s): v for s, v in old["arms"][arm][key]["final_reward"]["diffs"].items()}
            assert sorted(first) == list(range(added.start))
            new = {s: final[arm, s] - final[base, s] for s in added}
            alone[base] = paired_differences(new, dict.fromkeys(new, 0.0), **boot)
            assert _quoted(alone[base]) == _quoted(dose["arms"][arm][key]["final_reward"])  # the report's own figure
            pooled[arm, base] = paired_differences({**first, **new}, dict.fromkeys([*first, *new], 0.0), **boot)
        to_ref = pooled[arm, "ref_fp32"]
        sd = float(np.std(list(to_ref["diffs"].values()), ddof=1))
        rows.append(f"| `{arm}` | {added.start}-{added.stop - 1} | {_quoted(alone['ref_fp32'])} | "
                    f"{_quoted(old['arms'][arm]['vs_reference']['final_reward'])} | {_quoted(to_ref)} | "
                    f"{_quoted(alone['none'])} | {_quoted(pooled[arm, 'none'])} | {sd:.3f} | {_paired_mde(to_ref):.3f} |")
        arms, n = dose["arms"], len(to_ref["diffs"])
        walls = [end["wall_s"] for (_, a, seed), (_, end) in runs.items() if a == arm and seed in added]
        name = {"token_tis": "token TIS", "bypass_ppo": "bypass"}[arm]
        quotes += [
            f"{name}: {len(walls)} runs, {sum(walls) / 3600:.1f} CPU-hours, {np.median(walls) / 60:.1f} min per run",
            f"On seeds {added.start}-{added.stop - 1} the final rewards were none "
            f"{np.mean([final['none', s] for s in added]):.3f}, the reference "
            f"{np.mean([final['ref_fp32', s] for s in added]):.3f} and {name} "
            f"{np.mean([final[arm, s] for s in added]):.3f} (means); collapsed: none {arms['none']['collapse']['k']}, "
            f"the reference {arms['ref_fp32']['collapse']['k']}, {name} {arms[arm]['collapse']['k']} of {len(added)}; "
            f"ended low: none {arms['none']['ended_low']['k']}, the reference {arms['ref_fp32']['ended_low']['k']}, "
            f"{name} {arms[arm]['ended_low']['k']}",
            f"Over both machines {name} collapsed in {arms[arm]['collapse']['k'] + old['arms'][arm]['collapse']['k']} of "
            f"{n} seeds",
            f"a 0.05 difference from the reference needs {seeds_for_effect(sd, 0.05)} seeds",
        ]
        if arm == "token_tis":  # question 1 on the added seeds alone, question 2 pooled
            tis_arms, tis_added, tis_study = arms, added, study  # for the study-wide record below
            diffs = alone["ref_fp32"]["diffs"]
            collapsed = [s for (a, s), m in metrics.items() if a == arm and m["collapsed"]]
            # the one collapse, the other run that ended low, and the reference's run that ended low, as quoted
            (seed,) = collapsed
            (other,) = [s for s in arms[arm]["ended_low"]["seeds"] if s != seed]
            (ref_low,) = arms["ref_fp32"]["ended_low"]["seeds"]
            quotes += [f"{sum(d < 0 for d in diffs.values())} of the {len(added)} below 0",
                       f"token TIS's collapse is seed {seed}, {diffs[seed]:+.3f} against the reference; it ended low "
                       f"there and on seed {other}, {diffs[other]:+.3f}",
                       f"the reference ended low on seed {ref_low}, where token TIS ended {diffs[ref_low]:+.3f} above it",
                       f"token TIS collapsed in {len(collapsed) + old['arms'][arm]['collapse']['k']} of {n} seeds "
                       f"(seed {seed} here)"]
            quotes.append("**Token TIS's cost is confirmed on the new seeds**" if alone["ref_fp32"]["high"] < 0
                          else "**Token TIS's cost is not confirmed on the new seeds**")
            differs = pooled[arm, "none"]["high"] < 0 or pooled[arm, "none"]["low"] > 0
            quotes.append("**Token TIS differs from none**" if differs else "**Token TIS does not differ measurably from none**")
        else:  # question 3: a difference only where the pooled CI excludes 0
            quotes += [_bypass_verdict(pooled[arm, base], word) for base, word in (("ref_fp32", "the reference"),
                                                                                   ("none", "none"))]
    _assert_quoted(rows, section)  # one row per correction, in order, and no other row of figures in the table
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert len(re.findall(r"\| `\w+` \| \d+-\d+ \| [-+]\d", section)) == len(rows)
    _assert_quoted(quotes, section)
    # the study-wide record of token TIS's stale long-response runs: the 37 counted before these runs (64 tokens k1,
    # k2, k4 x 3 seeds; 128 tokens k1 8 + 12 and k2 8 seeds: 1 collapsed, 2 ended low, none collapsed in 2 of the
    # same settings and seeds) and the added k2 seeds
    n = 37 + len(tis_added)
    tis, low, none = (1 + tis_arms["token_tis"]["collapse"]["k"], 2 + tis_arms["token_tis"]["ended_low"]["k"],
                      2 + tis_arms["none"]["collapse"]["k"])
    _assert_quoted([f"token TIS now collapsed in {tis} of {n}", f"ended low in {low} of {n}; none collapsed in {none} of "
                    f"the same {n} settings and seeds"], section)
    # none - reference on the same 25 seeds, as the difference of token TIS's two pooled per-seed differences
    to_ref, to_none = (pooled["token_tis", base]["diffs"] for base in ("ref_fp32", "none"))
    none_ref = paired_differences({s: to_ref[s] - to_none[s] for s in to_ref}, dict.fromkeys(to_ref, 0.0),
                                  confidence=tis_study["confidence"], resamples=tis_study["bootstrap"])
    tis_ref, tis_none = _quoted(pooled["token_tis", "ref_fp32"]), _quoted(pooled["token_tis", "none"])
    quotes = [f"none's own shortfall over these {len(to_ref)} seeds, {_quoted(none_ref)}, is not resolved"
              if none_ref["high"] >= 0 else f"none's own shortfall over these {len(to_ref)} seeds, {_quoted(none_ref)}"]
    _assert_quoted(quotes, section)
    # where the docs and analyze carry it: the answers table, the s > 1 row, the README's rows and the basis
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted([f"token TIS collapsed in {tis} of {n} stale runs at 64-128 tokens",
                    f"at k2, {len(to_ref)} seeds of two machines, it ended below the reference, {tis_ref}, confirmed on "
                    f"the {len(tis_added)} seeds added to test it, and level with none, {tis_none}",
                    f"token TIS the weight that failed least, {tis}/{n} collapses ({low}/{n} ended low",
                    f"none {none}/{n}; at 128 tokens two steps stale",
                    f"token TIS ended below the fresh reference ({tis_ref}) and level with none ({tis_none})",
                    f"collapsed in {tis} of {n} stale long-response runs)"], study_md)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    _assert_quoted([f"token TIS collapsed in {tis} of {n} stale long-response runs and at 128 tokens two steps stale "
                    f"ended below the reference, {tis_ref} ({len(to_ref)} seeds), no better than none",
                    f"({tis} collapses in {n} stale long-response runs)"], readme)
    from megatron_mis.analysis.recommend import recommend

    basis = " ".join(recommend(1e-3, 2000).basis.split())
    _assert_quoted([f"({tis}/{n} collapses, {low}/{n} ended low", f"none in {none}/{n}.",
                    f"token TIS {tis_ref} against the reference ({_quoted(alones['token_tis']['ref_fp32'])} on the "
                    f"{len(tis_added)} seeds that tested it) and {tis_none} against none;"],
                   basis)  # none's and bypass's pooled figures there are the next look's (three machines)


def _lag2_128_three_machines(added: range = _LAG2_128_ZEN4[1]) -> SimpleNamespace:
    """long-tail-stale-128 k2 over three machines: for each of :data:`_LAG2_128_POOLED`, the per-seed differences on
    the final reward of the first machine's seeds 0-7 (the sweep's summary.json; its runs were not kept), the Zen 3
    VM's (the k2 archive: none and the reference on seeds 8-24, bypass on 8-11) and the Zen 4 VM's (the k2 archive,
    seeds 25 up to ``added``'s end), each seed's difference taken on its own machine; with the reports' paired
    bootstrap over the earlier seeds (every seed before ``added``), the ``added`` seeds alone (a Zen 4 look's own:
    those of :data:`_LAG2_128_ZEN4` or of :data:`_LAG2_128_ZEN4_MORE`) and all of them, the pooled paired SD, MDE
    and the seeds a 0.05 difference needs (:func:`_pooled_look`)."""
    archive, report = "sweep-long-tail-stale-128-k2", _LAG2_128_ZEN4[0]
    zen4 = range(_LAG2_128_ZEN4[1].start, added.start)  # the Zen 4 seeds of earlier looks
    assert added.start in (_LAG2_128_ZEN4[1].start, _LAG2_128_ZEN4[1].stop)
    first, old = _summary("sweep-long-tail-stale-128", "."), _dose("sweep-long-tail-stale-128", ".", "k2")
    summary = _summary(archive, report)
    (dose,) = summary["doses"]
    study = summary["study"]
    assert dose["setting"] == old["setting"] and summary["steps"] == first["steps"]
    assert all(study[k] == first["study"][k] for k in ("bootstrap", "confidence", "last_k", "collapse_fraction"))
    metrics = _committed_metrics(archive, summary)
    final = {key: m["final_reward"] for key, m in metrics.items()}
    zen3 = {"bypass_ppo": _LAG2_128_CORRECTIONS["bypass_ppo"][1], "none": _LAG2_128_SEEDS, "ref_fp32": _LAG2_128_SEEDS}
    out = {}
    for arm, base, name in _LAG2_128_POOLED:
        if arm == "none":
            firsts = old["none_vs_reference"]["diffs"]
        else:
            firsts = old["arms"][arm]["vs_reference" if base == "ref_fp32" else "vs_none"]["final_reward"]["diffs"]
        earlier = {int(s): v for s, v in firsts.items()}
        assert sorted(earlier) == list(range(_LAG2_128_SEEDS.start))
        earlier |= {s: final[arm, s] - final[base, s] for s in (*zen3[arm], *zen4)}
        new = {s: final[arm, s] - final[base, s] for s in added}
        out[arm, base] = SimpleNamespace(name=name, **vars(_pooled_look(earlier, new, study)))
    return SimpleNamespace(comparisons=out, summary=summary, dose=dose, metrics=metrics, final=final, old=old,
                           added=added, zen3=zen3, zen4=zen4)


def _bypass_verdict(d: dict, word: str) -> str:
    """The bold phrase with which a section reads a pooled bypass difference against ``word`` (``d``: a
    :func:`~megatron_mis.testbed.study.stats.paired_differences` result): above or below it only where its CI
    excludes 0."""
    if d["low"] > 0 or d["high"] < 0:
        return f"**Bypass is {'above' if d['low'] > 0 else 'below'} {word}**"
    return f"**Bypass is not measurably different from {word}**"


def _mean_ci(diffs: dict, study: dict, looks: int = 1) -> dict:
    """The reports' paired bootstrap of per-seed differences (``{seed: difference}``, against 0; ``study``: a
    report's study parameters), with its 5% split evenly over ``looks`` looks (confidence 1 - 0.05 / looks)."""
    from megatron_mis.testbed.study.stats import paired_differences

    return paired_differences(diffs, dict.fromkeys(diffs, 0.0), confidence=1 - (1 - study["confidence"]) / looks,
                              resamples=study["bootstrap"])


def _pooled_look(earlier: dict, added: dict, study: dict) -> SimpleNamespace:
    """A look that adds seeds to earlier ones (``{seed: per-seed difference}`` each, no seed in both, each taken on
    its own machine): :func:`_mean_ci` over the ``earlier`` seeds, the ``added`` seeds ``alone`` and both
    ``pooled``, with the pooled paired SD, MDE and the seeds a 0.05 difference needs."""
    import numpy as np

    from megatron_mis.testbed.study.stats import seeds_for_effect

    assert not set(earlier) & set(added)
    both = {**earlier, **added}
    pooled, sd = _mean_ci(both, study), float(np.std(list(both.values()), ddof=1))
    return SimpleNamespace(earlier=_mean_ci(earlier, study), alone=_mean_ci(added, study), pooled=pooled, sd=sd,
                           mde=_paired_mde(pooled), needed=seeds_for_effect(sd, 0.05))


def _lag2_128_zen4_look(r: SimpleNamespace, dose: dict, part: str) -> SimpleNamespace:
    """What both Zen 4 looks at long-tail-stale-128 k2 check alike (``r``: :func:`_lag2_128_three_machines` of the
    look's seeds; ``dose``: its report's dose; ``part``: its docs/study.md section's title): its report quotes the
    look's seeds in all three arms, whose runs were made on the Zen 4 VM at one thread and not copied, and the
    archive holds no other run from the look's first seed up to the next look's; the report's own figures are
    those recomputed from the archive; the section's table has one row per comparison, in order, and no other.
    Returns the runs' wall times, the section, the report's collapses (``k``) and runs ended low per arm, each
    arm's collapses and seeds over the three machines (``total``, ``seeds``), none's collapsed seeds there
    (``every``), none - reference pooled without them (``without``) and the quotes both sections make of these."""
    import numpy as np

    archive, added, arms, c = "sweep-long-tail-stale-128-k2", r.added, dose["arms"], r.comparisons
    assert sorted(arms) == ["bypass_ppo", "none", "ref_fp32"]
    assert all(list(arms[a]["seeds"]) == list(added) for a in arms)
    mine = {(a, s) for a in arms for s in added}
    headers = {key[1:]: h for key, h in _archive_headers(archive).items() if key[1:] in mine}
    walls = [end["wall_s"] for key, (_, end) in _archive_runs(archive).items() if key[1:] in mine]
    assert set(headers) == mine and len(walls) == len(mine)
    assert _kinds(headers.values()) == {_ZEN4}
    assert {h["config"]["threads"] for h in headers.values()} == {1} and not any(h.get("copied_from") for h in headers.values())
    # the archive's runs from the look's first seed up to the next look's are its seeds' three arms, no more
    stop = min((seeds.start for _, seeds in (_LAG2_128_ZEN4, _LAG2_128_ZEN4_MORE) if seeds.start > added.start),
               default=math.inf)
    assert {key[1:] for key in _archive_runs(archive) if added.start <= key[2] < stop} == mine
    for key, report_key in ((("bypass_ppo", "ref_fp32"), arms["bypass_ppo"]["vs_reference"]["final_reward"]),
                            (("bypass_ppo", "none"), arms["bypass_ppo"]["vs_none"]["final_reward"]),
                            (("none", "ref_fp32"), dose["none_vs_reference"])):
        assert _quoted(c[key].alone) == _quoted(report_key)  # the report's own figure, recomputed
    section = _section(part)
    rows = [f"| {x.name} | {added.start}-{added.stop - 1} | {_quoted(x.alone)} | {_seed_ranges(x.earlier['diffs'])} | "
            f"{_quoted(x.earlier)} | {_quoted(x.pooled)} | {x.pooled['n']} | {x.sd:.3f} | {x.mde:.3f} | {x.needed} |"
            for x in c.values()]
    _assert_quoted(rows, section)  # one row per comparison, in order, and no other row of figures in the table
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert len(re.findall(r"\| [a-z]+ - [a-z]+ \| \d+-\d+ \| [-+]\d", section)) == len(rows)
    mean = {a: np.mean([r.final[a, s] for s in added]) for a in arms}
    k = {a: arms[a]["collapse"]["k"] for a in arms}
    low = {a: arms[a]["ended_low"]["k"] for a in arms}
    # collapses over the three machines: the first machine's from its report, the later ones from the runs
    total = {a: r.old["arms"][a]["collapse"]["k"] + sum(r.metrics[a, s]["collapsed"] for s in (*r.zen3[a], *r.zen4))
             + k[a] for a in arms}
    seeds = {a: _LAG2_128_SEEDS.start + len(r.zen3[a]) + len(r.zen4) + len(added) for a in arms}
    to_ref, to_none, none_ref = c["bypass_ppo", "ref_fp32"], c["bypass_ppo", "none"], c["none", "ref_fp32"]
    assert seeds["none"] == none_ref.pooled["n"] and seeds["bypass_ppo"] == to_ref.pooled["n"] == to_none.pooled["n"]
    # none's collapsed seeds over the three machines: the first machine's one is its worst seed against the reference
    assert r.old["arms"]["none"]["collapse"]["k"] == 1
    every = sorted([int(min(r.old["none_vs_reference"]["diffs"].items(), key=lambda kv: kv[1])[0]),
                    *(s for s in (*r.zen3["none"], *r.zen4, *added) if r.metrics["none", s]["collapsed"])])
    assert len(every) == total["none"]
    n = none_ref.pooled["n"]
    fisher = _fisher_one_sided(total["none"], total["none"] + total["ref_fp32"], n)
    others = {s: v for s, v in none_ref.pooled["diffs"].items() if s not in every}
    without = _mean_ci(others, r.summary["study"])
    quotes = [
        f"{len(walls)} runs, {sum(walls) / 3600:.1f} CPU-hours, {np.median(walls) / 60:.1f} min per run (median)",
        f"On seeds {added.start}-{added.stop - 1} the final rewards were none {mean['none']:.3f}, the reference "
        f"{mean['ref_fp32']:.3f} and bypass {mean['bypass_ppo']:.3f} (means); collapsed: none {k['none']}, the "
        f"reference {k['ref_fp32']}, bypass {k['bypass_ppo']} of {len(added)}; ended low: none {low['none']}, the "
        f"reference {low['ref_fp32']}, bypass {low['bypass_ppo']}",
        f"Over the three machines bypass collapsed in {total['bypass_ppo']} of {seeds['bypass_ppo']} seeds, none in "
        f"{total['none']} of {seeds['none']} and the reference in {total['ref_fp32']} of {seeds['ref_fp32']}",
        _bypass_verdict(to_ref.pooled, "the reference"), _bypass_verdict(to_none.pooled, "none"),
        f"none collapsed in {total['none']} of {n} seeds ({', '.join(map(str, every))}) and the reference in "
        f"{total['ref_fp32'] or 'none'} (one-sided Fisher exact p = {fisher:.2f})",
        f"without those {len(every)} seeds the pooled difference is {_quoted(without)} over {len(others)}",
    ]
    return SimpleNamespace(walls=walls, section=section, k=k, low=low, total=total, seeds=seeds, every=every,
                           without=without, quotes=quotes)


def test_bypass_at_two_steps_of_lag_at_128_tokens_pools_three_machines():
    """docs/study.md's section on bypass, none and the reference at long-tail-stale-128 k2 on a Zen 4 VM's seeds past
    24: per comparison (bypass - reference, bypass - none, none - reference) the Zen 4 seeds alone (the report's own
    figure, recomputed from the archive), the earlier seeds of two machines and all three pooled, each seed's
    difference taken on its own machine, with the pooled paired SD, MDE and the seeds a 0.05 difference needs (one
    table row each); the added runs' means, collapses, machine and times; the collapses over the three machines;
    and the outcomes of the questions fixed before they ran (a difference only where the pooled CI excludes 0, harm
    only where it excludes 0 below, the 0.05 target by the MDE); and the plan's row for these runs (the answers
    table, the README and ``analyze``'s basis carry the next look's figures: the next test)."""
    import numpy as np

    r = _lag2_128_three_machines()
    added, arms = r.added, r.dose["arms"]
    look = _lag2_128_zen4_look(r, r.dose, "Bypass at two steps of lag at 128 tokens on a third machine")
    walls, total, quotes = look.walls, look.total, look.quotes
    c = r.comparisons
    to_ref, to_none, none_ref = c["bypass_ppo", "ref_fp32"], c["bypass_ppo", "none"], c["none", "ref_fp32"]
    quotes += [f"{_quoted(to_ref.pooled)} over {to_ref.pooled['n']} seeds of three machines, **MDE {to_ref.mde:.3f}: "
               f"the 0.05 target is {'met' if to_ref.mde <= 0.05 else 'not met'}**; on the added seeds alone "
               f"{_quoted(to_ref.alone)}",
               f"{_quoted(to_none.pooled)} pooled (MDE {to_none.mde:.3f})",
               f"on the added seeds alone it is above none, {_quoted(to_none.alone)}, on "
               f"{sum(d > 0 for d in to_none.alone['diffs'].values())} of {len(added)}",
               "**Harm at two steps of lag**" if none_ref.pooled["high"] < 0 else "**No harm shown at two steps of lag**"]
    assert to_none.alone["low"] > 0 and to_none.pooled["low"] <= 0  # the sentence's "though ... it is above none"
    # question 3: the pooled figure, the earlier one, the added seeds alone; the look-adjusted interval and each of
    # none's failures here (its collapses over the three machines and the figure without them: the shared quotes)
    adjusted = _mean_ci(none_ref.pooled["diffs"], r.summary["study"], looks=4)
    diffs = none_ref.alone["diffs"]
    (collapsed,) = [s for s in added if r.metrics["none", s]["collapsed"]]
    low_here = [s for s in added if s != collapsed and diffs[s] < -0.1]
    assert collapsed in look.every
    n = none_ref.pooled["n"]
    quotes += [f"none - reference {_quoted(none_ref.pooled)} over {n} seeds of three machines (MDE {none_ref.mde:.3f}), "
               f"after {_quoted(none_ref.earlier)} over the {none_ref.earlier['n']} earlier seeds; the added seeds "
               f"alone, which no earlier look saw, gave {_quoted(none_ref.alone)} "
               f"({sum(d < 0 for d in diffs.values())} of the {len(added)} below 0)",
               f"the pooled interval is [{adjusted['low']:.3f}, {adjusted['high']:+.4f}], just reaching 0",
               f"none collapsed on seed {collapsed} here ({diffs[collapsed]:+.3f} against the reference), and ended near "
               f"{min(r.final['none', s] for s in low_here):.2f}-{max(r.final['none', s] for s in low_here):.2f} on "
               f"seeds {' and '.join(map(str, low_here))} ({', '.join(f'{diffs[s]:+.3f}' for s in low_here)})",
               f"(K3 of none {_e(arms['none']['k3_mean'][0], 1)} here)",
               f"ends level with the reference there (MDE {to_ref.mde:.3f}) and collapsed in none of its "
               f"{to_ref.pooled['n']} seeds"]
    assert none_ref.alone["high"] < 0 and 0 < adjusted["high"] and total["bypass_ppo"] == 0  # the sentences' reading
    assert len(low_here) == 2 and total["ref_fp32"] == 0
    _assert_quoted(quotes, look.section)
    # the plan's row for these runs (the answers table, the summary, the README and analyze quote the next look)
    _assert_quoted([f"then none, the reference and bypass x {len(added)} more on a Zen 4 VM ({sum(walls) / 3600:.1f} "
                    f"CPU-hours for {len(walls)} runs at {np.median(walls) / 60:.1f} min; none {n} seeds, MDE "
                    f"{none_ref.mde:.3f}: **{'harm' if none_ref.pooled['high'] < 0 else 'no harm shown'}**, a fourth look; "
                    f"bypass {to_ref.pooled['n']} seeds, MDE {to_ref.mde:.3f}: level with the reference"],
                   _prose(_STUDY_DOCS.parent / "study.md"))
    # the outcomes these sentences state: harm by about 0.03 (rounds to 0.03), bypass level with the reference
    assert none_ref.pooled["high"] < 0 and round(none_ref.pooled["mean"], 2) == -0.03
    assert to_ref.pooled["low"] <= 0 <= to_ref.pooled["high"] and to_ref.mde <= 0.05


def test_more_seeds_at_two_steps_of_lag_at_128_tokens_on_the_zen4_vm():
    """docs/study.md's section on more seeds of bypass, none and the reference at long-tail-stale-128 k2 (the Zen 4
    VM's seeds of :data:`_LAG2_128_ZEN4_MORE`, a session after those of :data:`_LAG2_128_ZEN4`): per comparison the
    added seeds alone (the report's own figure, recomputed from the archive), every earlier seed of the three
    machines and all of them pooled, with the pooled paired SD, MDE and the seeds a 0.05 difference needs (one table
    row each); the added runs' means, collapses, machine and times; the outcomes of the questions fixed before they
    ran (a difference only where the pooled CI excludes 0, harm only where it excludes 0 below, the 0.05 target by
    the MDE; the interval with the 5% split over the looks); and where the answers table, the summary, the plan, the
    guidance table, the README and ``analyze``'s basis carry the pooled figures."""
    import numpy as np

    report, added = _LAG2_128_ZEN4_MORE
    r = _lag2_128_three_machines(added)
    summary = _summary("sweep-long-tail-stale-128-k2", report)
    (dose,) = summary["doses"]
    arms = dose["arms"]
    assert dose["setting"] == r.dose["setting"] and summary["steps"] == r.summary["steps"]
    assert all(summary["study"][k] == r.summary["study"][k] for k in ("bootstrap", "confidence", "last_k",
                                                                      "collapse_fraction", "threads", "jobs"))
    look = _lag2_128_zen4_look(r, dose, "More seeds of bypass, none and the reference at two steps of lag at 128 tokens")
    walls, total, every, without, quotes = look.walls, look.total, look.every, look.without, look.quotes
    c = r.comparisons
    # the earlier seeds are those the section above pooled, bypass's 20 and none's 33
    assert [c[k].earlier["n"] for k in c] == [20, 20, 33]
    to_ref, to_none, none_ref = c["bypass_ppo", "ref_fp32"], c["bypass_ppo", "none"], c["none", "ref_fp32"]
    study = summary["study"]
    # question 1 (a third look), question 2, question 3 (a fifth look): each pooled figure with its MDE, the added
    # seeds alone, the look-adjusted interval (none's collapses over the three machines and the figure without them:
    # the shared quotes)
    adj_none, adj_ref = (_mean_ci(to_none.pooled["diffs"], study, looks=3),
                         _mean_ci(none_ref.pooled["diffs"], study, looks=5))
    diffs = none_ref.alone["diffs"]
    n = none_ref.pooled["n"]
    quotes += [
        f"{_quoted(to_none.pooled)} over {to_none.pooled['n']} seeds of three machines, **MDE {to_none.mde:.3f}: the "
        f"0.05 target is {'met' if to_none.mde <= 0.05 else 'not met'}**; on the added seeds alone {_quoted(to_none.alone)}, "
        f"above none on {sum(v > 0 for v in to_none.alone['diffs'].values())} of {len(added)}",
        f"(a 98.33% interval) it is {_quoted(adj_none)[7:]}, still above 0",
        f"{_quoted(to_ref.pooled)} over {to_ref.pooled['n']} seeds (MDE {to_ref.mde:.3f}); on the added seeds alone "
        f"{_quoted(to_ref.alone)}",
        "**Harm at two steps of lag**" if none_ref.pooled["high"] < 0 else "**No harm shown at two steps of lag**",
        f"none - reference {_quoted(none_ref.pooled)} over {n} seeds of three machines (MDE {none_ref.mde:.3f}), "
        f"after {_quoted(none_ref.earlier)} over the {none_ref.earlier['n']} earlier seeds; the added seeds alone "
        f"gave {_quoted(none_ref.alone)} ({sum(v < 0 for v in diffs.values())} of the {len(added)} below 0)",
        f"(a 99% interval) the pooled interval is [{adj_ref['low']:.3f}, {adj_ref['high']:.3f}], which now excludes 0 too",
        f"ended between {min(r.final['none', s] for s in added):.2f} and {max(r.final['none', s] for s in added):.2f} on them",
        f"(K3 of none {_e(arms['none']['k3_mean'][0], 1)} here)",
        f"resolved to the 0.05 target (MDE {none_ref.mde:.3f})",
        f"ends level with the reference (MDE {to_ref.mde:.3f}) and measurably above none, collapsing in none of its "
        f"{to_ref.pooled['n']} seeds",
    ]
    # the sentences' readings: bypass above none even after the adjustment, level with the reference; harm also
    # after it; no collapse on the added seeds; without the collapses about half of the shortfall is left
    assert adj_none["low"] > 0 and to_ref.pooled["low"] <= 0 <= to_ref.pooled["high"] and total["bypass_ppo"] == 0
    assert adj_ref["high"] < 0 and look.k["none"] == 0 and without["high"] < 0
    assert 0.4 < without["mean"] / none_ref.pooled["mean"] < 0.6 and round(none_ref.pooled["mean"], 2) == -0.03
    _assert_quoted(quotes, look.section)
    # token TIS - reference at k2 over the first machine's seeds and the Zen 3 VM's (the sections above)
    tis = {int(s): v for s, v in r.old["arms"]["token_tis"]["vs_reference"]["final_reward"]["diffs"].items()}
    tis |= {s: r.final["token_tis", s] - r.final["ref_fp32", s] for s in _LAG2_128_CORRECTIONS["token_tis"][1]}
    tis_ref = _mean_ci(tis, study)
    # the answers table, the summary, the plan, the open part, the guidance table; the README's long-response row
    # and gap; analyze
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted([
        f"only at 128 tokens two steps stale, by about 0.03: {_quoted(none_ref.pooled)} over {n} seeds of three machines "
        f"(MDE {none_ref.mde:.3f}; a fifth look, unadjusted; [{adj_ref['low']:.3f}, {adj_ref['high']:.3f}] with the 5% "
        f"split over the five looks); none collapsed in {total['none']} of them, the reference in none, and without "
        f"those {len(every)} it is {_quoted(without)}",
        f"ends level with it ({_quoted(to_ref.pooled)}, {to_ref.pooled['n']} seeds of three machines, MDE "
        f"{to_ref.mde:.3f}) and above none ({_quoted(to_none.pooled)}, MDE {to_none.mde:.3f}), collapsing in none of them",
        f"cost none about 0.03 against the fresh reference ({_quoted(none_ref.pooled)}, {n} seeds of three machines, a "
        f"fifth look, unadjusted, and excluding 0 with the 5% split over the looks; none's {total['none']} collapses "
        f"in {n} carry about half of it) and bypass ended level with the reference there ({_quoted(to_ref.pooled)}, "
        f"{to_ref.pooled['n']} seeds) and above none",
        f"and x {len(added)} more there a session later ({sum(walls) / 3600:.1f} CPU-hours for {len(walls)} runs at "
        f"{np.median(walls) / 60:.1f} min; none {n} seeds, MDE {none_ref.mde:.3f}: **harm**, a fifth look, excluding 0 "
        f"after adjustment for the looks; bypass {to_none.pooled['n']} seeds, MDE {to_none.mde:.3f} against none: "
        f"above none, level with the reference",
        f"`long-tail-stale-128` k2's none and reference ({n} seeds), token TIS ({_LAG2_128_SEEDS.stop}) and bypass "
        f"({to_ref.pooled['n']}), and `long-tail-precision`'s",
        f"int4; 3-{n}) | only at 128 tokens",
        # the guidance table's stale row and the sentence under it
        f"with long responses (`long-tail-stale-128` k2, K3 {_e(arms['none']['k3_mean'][0], 1)}) none fell behind the "
        f"fresh reference by about 0.03 ({_quoted(none_ref.pooled)}, {n} seeds of three machines, {total['none']} "
        f"collapses) and bypass ended level with the reference ({_quoted(to_ref.pooled)}, {to_ref.pooled['n']} seeds) "
        f"and above none ({_quoted(to_none.pooled)}), collapsing in none of its seeds, while token TIS ended below the "
        f"reference ({_quoted(tis_ref)}, {tis_ref['n']} seeds)",
        f"(8 at 128 tokens k2, {n} of none and the reference there, {to_ref.pooled['n']} of bypass and "
        f"{_LAG2_128_SEEDS.stop} of token TIS, 12 of none"], study_md)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    _assert_quoted([f"only at 128 tokens two steps stale, by about 0.03: {_quoted(none_ref.pooled)} ({n} seeds of three "
                    f"machines; MDE {none_ref.mde:.3f}; a fifth look, excluding 0 also with the 5% split over the looks), "
                    f"about half of it none's collapses ({total['none']} of {n}, the reference none)",
                    f"at 128 tokens two steps stale bypass ended level with the reference, {_quoted(to_ref.pooled)} "
                    f"({to_ref.pooled['n']} seeds; MDE {to_ref.mde:.3f}), and above none, {_quoted(to_none.pooled)}",
                    f"at 128 tokens one and two steps of lag are resolved, 12 and {n} seeds, MDE 0.048 and "
                    f"{none_ref.mde:.3f}"], readme)
    from megatron_mis.analysis.recommend import recommend

    advice = recommend(1e-3, 2000)
    basis, reason = (" ".join(x.split()) for x in (advice.basis, advice.reason))
    _assert_quoted([f"none itself {_quoted(none_ref.pooled)} against the reference ({n} seeds of three machines, "
                    f"{total['none']} collapses); bypass {_quoted(to_ref.pooled)} against the reference and "
                    f"{_quoted(to_none.pooled)} against none ({to_ref.pooled['n']} seeds of three machines, no collapse)"],
                   basis)
    _assert_quoted([f"bypass ended level with the reference and above none ({to_ref.pooled['n']} seeds) and none about "
                    f"0.03 behind the reference ({n} seeds)"], reason)


def _seed_ranges(seeds) -> str:
    """Seeds as runs of consecutive ones, e.g. ``"0-11, 25-32"``."""
    out, seeds = [], sorted(seeds)
    for s in seeds:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def _pooled_256_k1() -> dict:
    """long-tail-stale-256 k1 pooled over three machines: ``{"final": {arm: {seed: final reward -
    the reference's}}, "steps": {arm: {seed: step that reached the threshold - none's}}, ...}``,
    seeds 0-5 (sequence MIS: 0-1; sequence TIS: none) from the first machine's report
    (docs/study/sweep-long-tail-stale-256/summary.json, its runs not kept) and the later ones from
    the committed archive (seeds 6-8 on a second VM, 9-10 on a third; every seed's arms on one
    machine) as the same differences, so that arm - arm pairs come out of the per-seed differences
    alike."""
    from megatron_mis.testbed.study.stats import run_metrics

    first = json.loads((_STUDY_DOCS / "sweep-long-tail-stale-256" / "summary.json").read_text())
    (dose,) = [d for d in first["doses"] if d["setting"] == "long-tail-stale-256-k1"]
    arms = ("none", "token_tis", "bypass_ppo", "sequence_mis", "sequence_tis")  # sequence TIS: the later machines only
    final = {a: {int(s): v for s, v in dose["arms"][a]["vs_reference"]["final_reward"]["diffs"].items()}
             if a in dose["arms"] else {} for a in arms}
    # steps to threshold: the first machine's are given against none (its seeds where both reached it)
    steps = {a: {int(s): v for s, v in dose["arms"][a]["vs_none"]["steps_to_threshold"]["diffs"].items()}
             for a in ("token_tis", "bypass_ppo")}
    study = first["study"]
    kept = {}
    for (setting, arm, seed), (records, end) in _archive_runs("sweep-long-tail-stale-256").items():
        assert setting == "long-tail-stale-256-k1" and seed not in final["none"], (setting, arm, seed)
        kept[arm, seed] = run_metrics(records, end, last_k=study["last_k"], threshold=first["threshold"],
                                      collapse_fraction=study["collapse_fraction"])
    for arm, seed in kept:
        if arm in arms and ("ref_fp32", seed) in kept:
            final[arm][seed] = kept[arm, seed]["final_reward"] - kept["ref_fp32", seed]["final_reward"]
        if arm in steps and ("none", seed) in kept:
            mine, none = kept[arm, seed]["steps_to_threshold"], kept["none", seed]["steps_to_threshold"]
            if mine is not None and none is not None:
                steps[arm][seed] = mine - none
    return {"final": final, "steps": steps, "bootstrap": study["bootstrap"], "confidence": study["confidence"]}


def test_the_pooled_figures_at_256_tokens_k1_come_from_three_machines():
    """README, docs/study.md and ``analyze`` quote long-tail-stale-256 k1 pooled over the first
    machine's seeds 0-5 (their report's per-seed differences) and the archive's later seeds (a
    second and a third machine), with the reports' paired bootstrap (sequence TIS ran on the later
    machines only): recomputed here, they are the figures quoted."""
    from megatron_mis.analysis.recommend import recommend
    from megatron_mis.testbed.study.stats import paired_differences

    pooled = _pooled_256_k1()
    final = pooled["final"]
    n = len(final["none"])
    assert n == len(final["token_tis"]) == len(final["bypass_ppo"])
    reference = dict.fromkeys(final["none"], 0.0)  # ``final`` holds differences against the reference

    def ci(arm: dict, baseline: dict, fmt: str = "{:+.3f}") -> str:
        """The reports' paired bootstrap (stats.paired_differences, seeds in order) as quoted."""
        return _quoted(paired_differences(arm, baseline, confidence=pooled["confidence"],
                                          resamples=pooled["bootstrap"]), fmt)

    figures = {
        "none - reference": ci(final["none"], reference),
        "token TIS - reference": ci(final["token_tis"], reference),
        "bypass - reference": ci(final["bypass_ppo"], reference),
        "bypass - none": ci(final["bypass_ppo"], final["none"]),
        "bypass - token TIS": ci(final["bypass_ppo"], final["token_tis"]),
        "token TIS - none": ci(final["token_tis"], final["none"]),
        "bypass take-off - none's": ci(dict.fromkeys(pooled["steps"]["bypass_ppo"], 0.0),
                                       pooled["steps"]["bypass_ppo"], "{:.0f}"),
        # sequence MIS: 7 seeds (0-1 first machine, 6-8 second, 9-10 third), paired on the seeds both arms ran
        "sequence MIS - reference": ci(final["sequence_mis"], reference),
        "sequence MIS - none": ci(final["sequence_mis"], final["none"]),
        "sequence MIS - token TIS": ci(final["sequence_mis"], final["token_tis"]),
        "bypass - sequence MIS": ci(final["bypass_ppo"], final["sequence_mis"]),
    }
    assert sorted(final["sequence_mis"]) == [0, 1, 6, 7, 8, 9, 10] and sorted(final["sequence_tis"]) == [6, 7, 8, 9, 10]
    assert sorted(final["none"]) == list(range(11))
    # sequence TIS ran on the later machines only, each seed paired with its machine's none and reference runs
    figures["sequence TIS - reference"] = ci(final["sequence_tis"], reference)
    figures["sequence TIS - none"] = ci(final["sequence_tis"], final["none"])
    figures["sequence TIS - token TIS"] = ci(final["sequence_tis"], final["token_tis"])
    figures["bypass - sequence TIS"] = ci(final["bypass_ppo"], final["sequence_tis"])
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    basis = " ".join(recommend(1e-3, 2000).basis.split())
    where = {"README": readme, "docs/study.md": study_md, "analyze": basis}
    quoted_in = {  # which of the three quote each figure
        "none - reference": ("README", "docs/study.md", "analyze"),
        "token TIS - reference": ("docs/study.md", "analyze"),
        "bypass - reference": ("docs/study.md", "analyze"),
        "bypass - none": ("README", "docs/study.md", "analyze"),
        "bypass - token TIS": ("docs/study.md", "analyze"),
        "token TIS - none": ("docs/study.md", "analyze"),
        "bypass take-off - none's": ("docs/study.md", "analyze"),
        "sequence MIS - reference": ("README", "docs/study.md", "analyze"),
        "sequence MIS - none": ("docs/study.md",),
        "sequence MIS - token TIS": ("docs/study.md",),
        "bypass - sequence MIS": ("docs/study.md",),
        "sequence TIS - reference": ("docs/study.md",),
        "sequence TIS - none": ("docs/study.md", "analyze"),
        "sequence TIS - token TIS": ("docs/study.md",),
        "bypass - sequence TIS": ("docs/study.md",),
    }
    missing = [(name, figures[name], doc) for name, docs in quoted_in.items() for doc in docs
               if figures[name] not in where[doc]]
    assert not missing, missing
    assert f"k1, s 1.3, {n} seeds" in basis


#: the 600-step runs at long-tail-stale-256 k1 (third VM): their own archive, beside the 300-step one
_LONG_256 = "sweep-long-tail-stale-256-600-steps"
#: its arms, each run on seeds 9-11
_ARMS_600 = ("none", "ref_fp32", "token_tis", "bypass_ppo")


def test_the_600_step_runs_repeat_the_committed_300_step_runs_for_their_first_300_steps():
    """The 600-step runs at long-tail-stale-256 k1 of an arm and seed that the 300-step archive also
    holds were made on the same VM, and their first 300 steps are those runs step for step (every
    recorded figure but the timings): the longer runs continue the very trajectories the 300-step
    figures score, so a change of the run's configuration, data or seeding that the 300-step
    archive did not see fails here."""
    long, short = _archive_runs(_LONG_256), _archive_runs("sweep-long-tail-stale-256")
    assert long and all(len(records) == 600 for records, _ in long.values())

    def figures(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith("time_") and k != "wall_s"}

    shared = sorted(set(long) & set(short))
    assert {(arm, seed) for _, arm, seed in shared} == {(a, s) for a in _ARMS_600 for s in (9, 10)}
    for key in shared:
        (records, _), (old, _) = long[key], short[key]
        assert len(old) == 300 and [figures(r) for r in records[:300]] == [figures(r) for r in old], key


def test_the_quoted_600_step_figures_at_256_tokens_k1_come_from_the_archive():
    """docs/study.md's tables of the 600-step runs (per seed: final reward at step 300 and at step
    600, the step each run took off, the differences; none and the reference in one, token TIS and
    bypass in the other; the K3 of the three mismatched arms) and the docs' counts
    are the archive's, recomputed with the reports' rules (final reward: the last 10 steps;
    take-off: the first step whose 10-step mean reaches the long-tail threshold, 0.2)."""
    import numpy as np

    from megatron_mis.testbed.study.stats import moving_mean, run_metrics

    summary = _summary(_LONG_256, "seeds-9-11")
    study = summary["study"]

    def metrics(records: list, end: dict) -> dict:
        return run_metrics(records, end, last_k=study["last_k"], threshold=summary["threshold"],
                           collapse_fraction=study["collapse_fraction"])

    runs = _archive_runs(_LONG_256)
    at = {(arm, seed): (metrics(records[:300], end), metrics(records, end))
          for (_, arm, seed), (records, end) in runs.items()}
    seeds = sorted({seed for _, seed in at})
    assert seeds == [9, 10, 11] and set(at) == {(a, s) for a in _ARMS_600 for s in seeds}
    # every mismatched run's K3 per step and its 20-step moving mean (window i ends at step i + 20)
    k3 = {(arm, seed): [r["mis_k3_kl"] for r in records] for (_, arm, seed), (records, _) in runs.items()
          if arm != "ref_fp32"}
    curve = {key: moving_mean(values, 20) for key, values in k3.items()}

    def up(m: dict) -> str:
        return "never" if m["steps_to_threshold"] is None else str(m["steps_to_threshold"])

    rows = []
    for s in seeds:
        (n3, n6), (r3, r6) = at["none", s], at["ref_fp32", s]
        rows.append(f"| {s} | {n3['final_reward']:.3f} | {n6['final_reward']:.3f} | {up(n6)} | {r3['final_reward']:.3f} "
                    f"| {r6['final_reward']:.3f} | {up(r6)} | {n3['final_reward'] - r3['final_reward']:+.3f} "
                    f"| {n6['final_reward'] - r6['final_reward']:+.3f} |")
    for s in seeds:  # the corrections' table: token TIS and bypass, and their differences at step 600
        (t3, t6), (b3, b6) = at["token_tis", s], at["bypass_ppo", s]
        n6, r6 = at["none", s][1]["final_reward"], at["ref_fp32", s][1]["final_reward"]
        rows.append(f"| {s} | {t3['final_reward']:.3f} | {t6['final_reward']:.3f} | {up(t6)} | {b3['final_reward']:.3f} "
                    f"| {b6['final_reward']:.3f} | {up(b6)} | {t6['final_reward'] - r6:+.3f} | {b6['final_reward'] - r6:+.3f} "
                    f"| {b6['final_reward'] - n6:+.3f} | {b6['final_reward'] - t6['final_reward']:+.3f} |")
    text = _prose(_STUDY_DOCS.parent / "study.md")
    missing = [row for row in rows if " ".join(row.split()) not in text]
    assert not missing, missing
    never = {when: sum(m[i]["steps_to_threshold"] is None for m in at.values()) for i, when in enumerate((300, 600))}
    collapsed = sum(m[1]["collapsed"] for m in at.values())
    quoted = f"{never[300]} of the {len(at)} runs had not taken off by step 300 and {never[600]} by step 600"
    assert quoted in text, (quoted, never)
    assert f"{collapsed} of the {len(at)} collapsed" in text
    # the paired SD of none - reference over these seeds, at step 300 and at step 600
    sd = [float(np.std([at["none", s][i]["final_reward"] - at["ref_fp32", s][i]["final_reward"] for s in seeds], ddof=1))
          for i in (0, 1)]
    assert f"reference on these 3 seeds is {sd[0]:.3f} at step 300 and {sd[1]:.3f} at step 600" in text, sd
    assert sd[1] == pytest.approx(summary["paired_sd"], abs=1e-12)  # the step-600 one is the report's own
    # none's K3: the peak 20-step mean (the window's last step), how long after the take-off and how
    # many times the run mean it came, and the mean over steps 501-600, per seed
    peaks, lates, after, times = [], [], [], []
    for s in seeds:
        c = curve["none", s]
        peaks.append(f"{_e(float(c.max()), 1)} (step {int(c.argmax()) + 20}, seed {s})")
        lates.append(_e(float(np.mean(k3["none", s][500:])), 1))
        after.append(int(c.argmax()) + 20 - at["none", s][1]["steps_to_threshold"])
        times.append(float(c.max()) / float(np.mean(k3["none", s])))
    assert f"peaked at {peaks[0]}, {peaks[1]} and {peaks[2]}" in text, peaks
    assert f"steps 501-600 was {lates[0]}, {lates[1]} and {lates[2]}" in text, lates
    assert f"{min(after)}-{max(after)} steps after that run's take-off and {min(times):.0f}-{max(times):.0f} times its run mean" in text, (after, times)
    # every mismatched arm's K3 by seed: the run mean, the 20-step peak (and its step) and the mean
    # over steps 501-600, as the docs' K3 table gives them
    for arm, name in (("none", "none"), ("token_tis", "token TIS"), ("bypass_ppo", "bypass")):
        cells = []
        for s in seeds:
            values, c = k3[arm, s], curve[arm, s]
            cells.append(f"{_e(float(np.mean(values)), 1)} / {_e(float(c.max()), 1)} ({int(c.argmax()) + 20}) / "
                         f"{_e(float(np.mean(values[500:])), 1)}")
        row = f"| {name} | {' | '.join(cells)} |"
        assert row in text, row


#: The truncation archives: docs/study/ARCHIVE/runs holds the top-p (and top-k) sweeps' runs of one
#: task (they share the reference), with a report per sweep, each comparing the arms on the greedy
#: reward; {archive: {report: the arms it quotes (each at the doses that ran it)}}. sweep-top-p: the
#: 3-digit copy task (vocabulary 16); sweep-long-tail-truncation: the long-tail task (vocabulary 512,
#: 64-token responses).
_TOP_P_ARCHIVES = {
    "sweep-top-p": {
        "top-p-raw": ("none",),
        "top-p-replay": ("none",),
        "top-p-processed": ("none", "token_tis", "token_mis", "sequence_mis"),
    },
    "sweep-long-tail-truncation": {
        "long-tail-top-p-raw": ("none",),
        "long-tail-top-p-replay": ("none",),
        "long-tail-top-p-processed": ("none", "token_tis", "token_tis_normalized", "sequence_mis"),
        "long-tail-top-k-raw": ("none",),
        "long-tail-top-k-replay": ("none",),
        "long-tail-top-k-processed": ("none", "token_tis", "token_tis_normalized", "token_mis"),
    },
}
_TOP_P_REPORTS = [(archive, report) for archive, reports in _TOP_P_ARCHIVES.items() for report in reports]


def _greedy(end: dict) -> float:
    return end["evaluation"]["greedy_reward"]


#: docs/study/sweep-top-p: the reports over more seeds of none and the reference at one top-p dose with raw log-probs
#: than the raw sweep's 16 (the Zen 4 VM, 2026-11-29), each one a session's added seeds on a Zen 3 VM (2026-12-06, its
#: question fixed before any of them ran) cut where that session's time ended, in order: {report: (its docs/study.md
#: section, its dose label, its seeds, the report whose seeds it extends, the seeds over which its pre-registered rule
#: for going on at the same dose was read (None: it had none))}
_TOP_P_MORE_CHAIN = {
    "top-p-raw-p0.8-more": ("Top-p 0.8 on more seeds", "p0.8", range(0, 49), "top-p-raw", None),
    "top-p-raw-p0.8-to-0.05": ("Top-p 0.8 to a 0.05 resolution", "p0.8", range(0, 145), "top-p-raw-p0.8-more",
                               range(0, 123)),
    "top-p-raw-p0.9-more": ("Top-p 0.9 on more seeds", "p0.9", range(0, 156), "top-p-raw", None),
    "top-p-raw-p0.95-more": ("Top-p 0.95 on more seeds", "p0.95", range(0, 92), "top-p-raw", None),
    "top-p-raw-p0.95-to-0.05": ("Top-p 0.95 to the 0.05 target", "p0.95", range(0, 156), "top-p-raw-p0.95-more",
                                None),
}
#: {report: the sign its added seeds alone were to confirm, a question fixed before they ran (the pooled CI holds the
#: seeds that raised the candidate, so only the added ones answer it)}
_TOP_P_CONFIRMS = {"top-p-raw-p0.95-to-0.05": "above"}
#: {dose label: the newest of them at that dose, which the answers and the README quote}
_TOP_P_MORE = {label: report for report, (_, label, *_) in _TOP_P_MORE_CHAIN.items()}
#: the raw sweep's seeds, run on the Zen 4 VM
_TOP_P_FIRST_SEEDS = range(16)
#: docs/study/sweep-long-tail-truncation/long-tail-top-k-processed-k{64,16}-more: none, the reference, token TIS and
#: self-normalised token TIS over processed top-k log-probs on seeds past the processed sweep's 16, on Zen 4 VMs of the
#: kind that made those (2026-12-07, one session per dose; the questions fixed before any of them ran): {dose label:
#: (the report, the seeds whose four runs finished by the pre-registered cut)}
_TOP_K_MORE = {"k64": ("long-tail-top-k-processed-k64-more", range(16, 26)),
               "k16": ("long-tail-top-k-processed-k16-more", range(16, 30))}
#: docs/study/sweep-long-tail-truncation/long-tail-top-k-processed-k16-none: none and the reference alone at processed
#: top-k 16 on seeds past _TOP_K_MORE["k16"]'s, on a Zen 4 VM of that kind (2026-12-07; the questions fixed before any
#: of them ran): (the report, the seeds whose two runs finished by the pre-registered cut)
_TOP_K_NONE = ("long-tail-top-k-processed-k16-none", range(30, 50))
#: docs/study/sweep-long-tail-truncation/long-tail-top-k-replay-k16: the replay's none at top-k 16 (the rollout's
#: support replayed in the trainer) from seed 0, its reference copied from the archived untruncated reference, on a Zen
#: 4 VM of that kind (2026-12-07; the questions fixed before any of them ran): (the report, the seeds whose replay run
#: finished by the pre-registered cut)
_TOP_K_REPLAY = ("long-tail-top-k-replay-k16", range(0, 42))
#: docs/study/sweep-long-tail-truncation/long-tail-top-k-replay-full-entropy-k16-check: slime's replay (the entropy
#: bonus over the whole softmax) at top-k 16 on the seeds of _TOP_K_REPLAY whose run ended at the kept ids' entropy ln 16
#: (a check fixed before it ran, after the cut): (the report, its seeds)
_TOP_K_REPLAY_CHECK = ("long-tail-top-k-replay-full-entropy-k16-check", range(4, 5))
#: the comparisons each section pools with the processed sweep's seeds 0-15: (arm, base, its name in the section)
_TOP_K_PAIRS = (("none", "ref_fp32", "none - reference"), ("token_tis", "none", "token TIS - none"),
                ("token_tis", "ref_fp32", "token TIS - reference"),
                ("token_tis_normalized", "ref_fp32", "self-normalised - reference"),
                ("token_tis_normalized", "none", "self-normalised - none"))
#: the processed sweep's own seeds at top-k 64 and 16 (its report, the Zen 4 VM of 2026-11-29)
_TOP_K_FIRST = range(16)
#: {archive: the reports over more seeds than a sweep's own report (at one dose)}
_TOP_P_MORE_REPORTS = {"sweep-top-p": tuple(_TOP_P_MORE_CHAIN),
                       "sweep-long-tail-truncation": (*(report for report, _ in _TOP_K_MORE.values()),
                                                      _TOP_K_NONE[0], _TOP_K_REPLAY[0], _TOP_K_REPLAY_CHECK[0])}


def _top_p(label: str) -> str:
    """``p0.8`` -> ``0.8``: a top-p dose label as docs/study.md and the README write the dose."""
    assert label.startswith("p0."), label
    return label.removeprefix("p")


@functools.cache
def _top_p_more_quotes(report: str) -> tuple[list[str], dict]:
    """The figures of docs/study.md's section on one report of :data:`_TOP_P_MORE_CHAIN`, recomputed from the
    archive: none - reference on the greedy reward (what the truncation sweeps compare) over every seed, the seeds it
    added alone and the seeds of the report it extends (whose quote that report's summary.json must give), on the
    final training reward beside it, the paired SD of the greedy differences, the MDE and the seeds a 0.05
    difference needs (each checked against the report's summary.json), the runs that ended low, and the added runs'
    machine and times (the runs made here; the reference's copies, followed to the run they copy, counted apart);
    with the paired differences."""
    import numpy as np

    archive = "sweep-top-p"
    _, label, seeds, extends, rule_seeds = _TOP_P_MORE_CHAIN[report]
    first = range(0, len(_dose(archive, extends, label)["none_vs_reference"]["diffs"]))
    added = range(first.stop, seeds.stop)
    summary = _summary(archive, report)
    (dose,) = summary["doses"]
    arms, study, setting = dose["arms"], summary["study"], dose["setting"]
    assert summary["sweep"] == "top-p-raw" and dose["label"] == label and summary["outcome"] == "greedy_reward"
    assert sorted(arms) == ["none", "ref_fp32"] and all(list(arms[a]["seeds"]) == list(seeds) for a in arms)
    runs, headers, ref = _archive_runs(archive), _archive_headers(archive), "ref_fp32"
    machines = {(s >= _TOP_P_FIRST_SEEDS.stop, headers[setting, a, s]["machine"]["cpu_family_model"],
                 headers[setting, a, s]["machine"]["cpu_capability"]) for a in arms for s in seeds}
    assert machines == {(False, "25/17", "AVX512"), (True, *_ZEN3)}, machines  # Zen 4, then Zen 3 VMs
    paired = _paired_over(_committed_finals(archive, summary), runs, setting, study, seeds)
    greedy = "greedy_reward"
    f = {"greedy": paired("none", ref, key=greedy), "added": paired("none", ref, added, key=greedy),
         "first": paired("none", ref, first, key=greedy), "final": paired("none", ref)}
    assert _quoted(f["greedy"]) == _quoted(dose["none_vs_reference"])
    assert {str(k): v for k, v in f["greedy"]["diffs"].items()} == dose["none_vs_reference"]["diffs"]
    assert _quoted(f["first"]) == _quoted(_dose(archive, extends, label)["none_vs_reference"])
    sd, mde, needed = _paired_noise(f["greedy"], summary)
    q = {k: _quoted(v) for k, v in f.items()}
    # the reference samples untruncated, so it is the same run at every dose: its added seeds already made at another
    # dose are copies of those runs (step for step; a copy may copy a copy), and every other added run was made here
    def made_at(a: str, s: int) -> str:
        """The dose setting where run (a, s) of this report's setting was made, following its copies."""
        at, seen = setting, set()
        while headers[at, a, s].get("copied_from"):
            assert at not in seen, (a, s, at)
            seen.add(at)
            at = Path(headers[at, a, s]["copied_from"]).parts[-3]
        return at

    copied = {(a, s): made_at(a, s) for a in arms for s in added if headers[setting, a, s].get("copied_from")}
    for (a, s), source in copied.items():
        assert a == ref and source != setting, (a, s, source)
        assert runs[source, a, s] == runs[setting, a, s], (a, s, source)
    walls = [runs[setting, a, s][1]["wall_s"] for a in arms for s in added if (a, s) not in copied]
    # one thread per run, as the first 16 (guards a rerun at another thread count, which the archive keeps apart)
    assert {headers[setting, a, s]["config"]["threads"] for a in arms for s in seeds} == {1}
    mean = {a: np.mean([_greedy(runs[setting, a, s][1]) for s in seeds]) for a in arms}
    quotes = [
        f"| {len(seeds)} | {mean['none']:.3f} | {mean[ref]:.3f} | {q['greedy']} | {q['final']} | {sd:.3f} | "
        f"{mde:.3f} | {needed} |",
        f"on the {len(added)} added seeds alone {q['added']}; on the first {len(first)} {q['first']}",
        f"Ended low (training reward): none {arms['none']['ended_low']['k']} of {len(seeds)}, the reference "
        f"{arms[ref]['ended_low']['k']}; collapsed: none {arms['none']['collapse']['k']}, the reference "
        f"{arms[ref]['collapse']['k']}",
        f"{len(walls)} runs, {sum(walls) / 3600:.1f} CPU-hours, {np.median(walls):.0f} s per run (median)"
        + (f"; {len(copied)} runs of the reference copied" if copied else ""),
        f"the paired SD of the greedy reward is {sd:.3f}, so a 0.05 difference needs {needed} seeds",
    ]
    if needed > len(seeds):  # unresolved: what the target still costs
        quotes.append(f"needs {needed} seeds, about {needed - len(seeds)} more pairs")
    if rule_seeds is not None:  # the rule: more seeds of the dose where the MDE over rule_seeds was above 0.05
        at_rule = _paired_mde(paired("none", ref, rule_seeds, key=greedy))
        assert at_rule > 0.05 and seeds.stop > rule_seeds.stop, at_rule
        quotes.append(f"the MDE over seeds 0-{rule_seeds.stop - 1} was {at_rule:.3f}, above 0.05")
    return quotes, f


@pytest.mark.parametrize("report", list(_TOP_P_MORE_CHAIN))
def test_top_p_on_more_seeds_comes_from_the_archive(report):
    """docs/study.md's sections on a top-p dose past 16 seeds: every figure recomputed from the archive, and the
    outcome of each one's question, fixed before its added seeds ran (harm only where none - reference on the greedy
    reward excludes 0 below it, with the MDE reported); the answers quote the newest at each dose."""
    quotes, f = _top_p_more_quotes(report)
    section_name, label = _TOP_P_MORE_CHAIN[report][:2]
    section, p = _section(section_name), _top_p(label)
    _assert_quoted(quotes, section)
    harm = f["greedy"]["high"] < 0
    assert (f"**Harm at p = {p}**" if harm else f"**No harm shown at p = {p}**") in section
    if report in _TOP_P_CONFIRMS:  # the candidate confirmed only if the added seeds' CI excludes 0 on its side
        added = f["added"]
        confirmed = added["low"] > 0 if _TOP_P_CONFIRMS[report] == "above" else added["high"] < 0
        assert ("**Confirmed**" if confirmed else "**Not confirmed**") in section
        assert ("**Not confirmed**" if confirmed else "**Confirmed**") not in section
    if report == _TOP_P_MORE[label]:
        mde = _paired_mde(f["greedy"])
        quoted = f"{_quoted(f['greedy'])} at p = {p} ({len(f['greedy']['diffs'])} seeds; MDE {mde:.3f}"
        assert quoted in _section("The answers so far, per mechanism"), quoted


def _dose(archive: str, report: str, label: str) -> dict:
    """The dose ``label`` of docs/study/ARCHIVE/REPORT/summary.json."""
    (d,) = [d for d in _summary(archive, report)["doses"] if d["label"] == label]
    return d


@pytest.mark.parametrize("archive", sorted(_TOP_P_ARCHIVES))
def test_the_top_p_archive_gives_its_reports_greedy_figures(archive):
    """docs/study/ARCHIVE/runs: every run complete and of its report's step count; the per-seed
    greedy-reward differences against the reference that each report (REPORT/summary.json) quotes,
    per dose and arm, recomputed from the archive; every archived run quoted by a report."""
    runs = _archive_runs(archive)
    quoted = set()
    for report, arms in _TOP_P_ARCHIVES[archive].items():
        summary = _summary(archive, report)
        assert summary["sweep"] == report and summary["outcome"] == "greedy_reward"
        assert "compared on the greedy reward" in (_STUDY_DOCS / archive / report / "report.md").read_text()
        for dose in summary["doses"]:
            setting = dose["setting"]
            assert {"none", "ref_fp32"} <= set(dose["arms"]) <= {*arms, "ref_fp32"}, setting
            for arm in [a for a in arms if a in dose["arms"]]:
                d = dose["arms"][arm]["vs_reference"]["greedy_reward"]
                seeds = [int(s) for s in d["diffs"]]
                assert d["diffs"] == pytest.approx({str(s): _greedy(runs[setting, arm, s][1])
                                                    - _greedy(runs[setting, "ref_fp32", s][1]) for s in seeds},
                                                   abs=1e-12), (setting, arm)
                assert all(len(runs[setting, arm, s][0]) == summary["steps"] for s in seeds)
                quoted |= {(setting, a, s) for a in (arm, "ref_fp32") for s in seeds}
            assert dose["none_vs_reference"] == dose["arms"]["none"]["vs_reference"]["greedy_reward"]
    for report in _TOP_P_MORE_REPORTS.get(archive, ()):  # their figures are checked in their own test
        (dose,) = _summary(archive, report)["doses"]
        quoted |= {(dose["setting"], a, s) for a, arm in dose["arms"].items() for s in arm["seeds"]}
    assert set(runs) == quoted


@pytest.mark.parametrize("archive, pairs", [("sweep-top-p", 32), ("sweep-long-tail-truncation", 12)])
def test_recording_the_processed_log_probs_leaves_the_uncorrected_run_as_it_was(archive, pairs):
    """Without an IS weight the rollout's recorded log-probs enter no loss, so the processed sweep's
    none follows the raw sweep's none step for step (reward, gradient norm, greedy evaluation) at
    every dose and seed archived (sweep-top-p: p 0.95 and 0.9 seeds 0-7, p 0.8 seeds 0-15;
    sweep-long-tail-truncation: top-p 0.8 seeds 0-7, top-k 64 seeds 0-3), while only its mismatch
    metrics see the truncation:
    K3 at fp32 rounding with the raw log-probs, the kept mass's log-ratio with the processed ones."""
    runs = _archive_runs(archive)
    raw = ("top-p-raw-", "long-tail-top-p-raw-", "long-tail-top-k-raw-")
    found = [(s, seed) for (s, arm, seed) in runs if arm == "none" and s.startswith(raw)
             and (s.replace("raw", "processed"), "none", seed) in runs]
    assert len(found) == pairs
    for setting, seed in found:
        raw = runs[setting, "none", seed]
        processed = runs[setting.replace("raw", "processed"), "none", seed]
        for key in ("reward_mean", "grad_norm"):
            assert [r[key] for r in raw[0]] == [r[key] for r in processed[0]], (setting, seed, key)
        assert raw[1]["evaluation"] == processed[1]["evaluation"], (setting, seed)
        assert max(r["mis_k3_kl"] for r in raw[0]) < 1e-10, (setting, seed)  # fp32 rounding: 1e-14 to 3e-12
        assert min(r["mis_k3_kl"] for r in processed[0]) > 1e-5, (setting, seed)  # the kept mass: >= 3e-5 at p 0.95


def _top_p_rows(archive: str) -> list[str]:
    """The rows of one of docs/study.md's truncation tables, from the archive's reports'
    summary.json: the reference (from each raw sweep's report) and every quoted arm per sweep and
    dose. The first cell is the sweep's kind (raw / processed / replay), after its mechanism
    (top-p / top-k) where the archive holds both."""
    from megatron_mis.testbed.study.report import _fmt_ci, _fmt_diff

    rows = []
    for report, arms in _TOP_P_ARCHIVES[archive].items():
        summary = _summary(archive, report)
        mechanism, kind = report.removeprefix("long-tail-").rsplit("-", 1)
        first = kind if archive == "sweep-top-p" else f"{mechanism} {kind}"
        for dose in summary["doses"]:
            for arm in [a for a in (("ref_fp32",) if kind == "raw" else ()) + arms if a in dose["arms"]]:
                a = dose["arms"][arm]
                mon = a["monitor_flagged"]
                rows.append(
                    f"| {first} | {dose['dose']} | {arm} | {a['n']} | "
                    f"{_e(a['k3_mean'][0], 1)} | "
                    f"{_fmt_ci(a['greedy_reward'])} | {_fmt_diff(a['vs_reference']['greedy_reward'])} | "
                    f"{_fmt_diff(a['vs_none']['greedy_reward'])} | {mon['k']}/{mon['n']} |")
    return rows


def _top_p_replay_vs_none(archive: str) -> dict:
    """``{dose label: replay's none - raw's none}`` over every replay sweep of the archive (top-p
    labels p0.8, top-k labels k64), greedy reward paired per seed (the reports' bootstrap), over
    the seeds both ran: what replaying the support changes in the same run."""
    from megatron_mis.testbed.study.stats import paired_differences

    runs = _archive_runs(archive)
    out = {}
    for replay_report in [r for r in _TOP_P_ARCHIVES[archive] if r.endswith("-replay")]:
        raw_report = replay_report.replace("-replay", "-raw")
        study = _summary(archive, raw_report)["study"]
        for label in [d["label"] for d in _summary(archive, replay_report)["doses"]]:
            replay = {seed: _greedy(end) for (s, arm, seed), (_, end) in runs.items()
                      if s == f"{replay_report}-{label}" and arm == "none"}
            raw = {seed: _greedy(runs[f"{raw_report}-{label}", "none", seed][1]) for seed in replay}
            assert label not in out
            out[label] = paired_differences(replay, raw, confidence=study["confidence"], resamples=study["bootstrap"])
    return out


@pytest.mark.parametrize("archive, labels", [("sweep-top-p", {"p0.95", "p0.9", "p0.8"}),
                                             ("sweep-long-tail-truncation", {"p0.9", "p0.8", "k64"})])
def test_the_quoted_top_p_table_and_replay_figures_come_from_the_archive(archive, labels):
    """docs/study.md's truncation tables are the reports' rows, and the replay-against-no-replay
    figures it quotes are recomputed from the archive with the reports' paired bootstrap."""
    text = (_STUDY_DOCS.parent / "study.md").read_text()
    missing = [row for row in _top_p_rows(archive) if row not in text]
    assert not missing, missing
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    replay = _top_p_replay_vs_none(archive)
    assert set(replay) == labels
    for label, d in replay.items():
        quoted = f"{label.removeprefix('p')}: {_quoted(d)} ({d['n']} seeds)"
        assert quoted in prose, quoted


def test_the_readme_s_top_p_figures_come_from_the_archives():
    """The README's truncation row quotes the archives' reports: none - reference at each top-p dose run past the raw
    sweep's 16 seeds on the 3-token task (its newest report; the unresolved ones also in "Not yet measured to a 0.05
    resolution"), and over processed top-k log-probs on the long tail token MIS at top-k 64 (greedy reward, as
    those sweeps compare; token TIS at top-k 16 and 64: the tests of their sections over more seeds)."""
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert set(_TOP_P_MORE) <= {"p0.95", "p0.9", "p0.8"}
    for label, report in _TOP_P_MORE.items():  # the doses run past the raw sweep's 16 seeds, at their newest report
        none_vs_reference = _dose("sweep-top-p", report, label)["none_vs_reference"]
        n, p = len(none_vs_reference["diffs"]), _top_p(label)
        assert n == len(_TOP_P_MORE_CHAIN[report][2])
        mde = _paired_mde(none_vs_reference)
        row = re.escape(f"{_quoted(none_vs_reference)} at p = {p} ({n} seeds") + r"[^)]*\), an MDE of " + f"{mde:.3f}"
        assert re.search(row, readme), row
        needed = _summary("sweep-top-p", report)["seeds_for_target"]
        # "Not yet measured to a 0.05 resolution" names a dose with its seeds and MDE until the MDE reaches 0.05
        unresolved = f"p = {p} ({n} seeds resolve {mde:.3f}, {needed} needed"
        resolved = f"p = {p}, {n} seeds, MDE {mde:.3f}"
        assert (unresolved in readme, resolved in readme) == ((False, True) if mde <= 0.05 else (True, False)), label
    for label in {"p0.95", "p0.9", "p0.8"} - set(_TOP_P_MORE):  # still at the raw sweep's 16 seeds: unresolved
        assert f"p = {_top_p(label)} (16 seeds resolve about 0.16" in readme, label
    archive = "sweep-long-tail-truncation"
    mis = _dose(archive, "long-tail-top-k-processed", "k64")["arms"]["token_mis"]
    assert f"token MIS trains nothing ({_quoted(mis['vs_reference']['greedy_reward'])}, {mis['n']} seeds)" in readme
    assert mis["ended_low"]["k"] == mis["n"]  # "trains nothing": every run ended low

@pytest.mark.parametrize("archive, report", _TOP_P_REPORTS)
def test_the_top_p_sweep_reports_rebuilt_from_the_archive_compare_the_greedy_reward(archive, report, tmp_path):
    """The sweep report rebuilt from the restored archive with the committed summary's study
    settings: its none - reference differences, paired SD and first-hurt dose are the committed
    ones, all on the greedy reward (a sweep report reading the training reward here differs:
    the truncated samples' training reward is not the policy's), and its markdown says so."""
    from megatron_mis.testbed.study.archive import restore_runs
    from megatron_mis.testbed.study.config import StudyConfig
    from megatron_mis.testbed.study.sweep_report import format_sweep_markdown, summarize_sweep

    committed = _summary(archive, report)
    restore_runs(_STUDY_DOCS / archive / "runs", tmp_path)
    keep = ("sweep", "doses", "arms", "seeds", "first_seed", "last_k", "collapse_fraction", "confidence", "bootstrap")
    study = StudyConfig(**{k: committed["study"][k] for k in keep}, out_dir=str(tmp_path), plot=False)
    rebuilt = summarize_sweep(study, write_dose_reports=False)
    assert rebuilt["outcome"] == "greedy_reward"
    for mine, theirs in zip(rebuilt["doses"], committed["doses"], strict=True):
        diffs = {str(k): v for k, v in mine["none_vs_reference"]["diffs"].items()}
        assert diffs == theirs["none_vs_reference"]["diffs"], mine["label"]
        assert mine["none_vs_reference"]["diffs"] == mine["arms"]["none"]["vs_reference"]["greedy_reward"]["diffs"]
        assert mine["none_vs_reference"]["diffs"] != mine["arms"]["none"]["vs_reference"]["final_reward"]["diffs"]
    assert rebuilt["paired_sd"] == pytest.approx(committed["paired_sd"], abs=1e-12)
    assert rebuilt["first_dose_none_behind_reference"] == committed["first_dose_none_behind_reference"]
    text = format_sweep_markdown(rebuilt)
    assert "| dose | arm | n | K3 KL mean | greedy reward | vs reference |" in text
    assert "Paired SD of the greedy reward" in text


def _first_truncation_runs() -> dict:
    """:func:`_archive_runs` of the long-tail truncation archive without the seeds that :data:`_TOP_K_MORE`,
    :data:`_TOP_K_NONE`, :data:`_TOP_K_REPLAY` and :data:`_TOP_K_REPLAY_CHECK` added at their doses: the runs of the
    section "Top-p and top-k on the long-tail task"."""
    added = {(f"long-tail-top-k-processed-{label}", s) for label, (_, seeds) in _TOP_K_MORE.items() for s in seeds}
    added |= {("long-tail-top-k-processed-k16", s) for s in _TOP_K_NONE[1]}
    added |= {("long-tail-top-k-replay-k16", s) for s in _TOP_K_REPLAY[1]}
    added |= {("long-tail-top-k-replay-full-entropy-k16", s) for s in _TOP_K_REPLAY_CHECK[1]}
    return {key: run for key, run in _archive_runs("sweep-long-tail-truncation").items()
            if (key[0], key[2]) not in added}


def _token_tis_mean_weight(setting: str, seeds: range | None = None) -> float:
    """Token TIS's mean IS weight (``is_weight_mean``) over every step of the archived runs at
    ``setting`` of the long-tail truncation archive's first section (:func:`_first_truncation_runs`): every seed, or
    those in ``seeds``."""
    import numpy as np

    return float(np.mean([r["is_weight_mean"] for (s, arm, seed), (records, _) in
                          _first_truncation_runs().items()
                          if s == setting and arm == "token_tis" and (seeds is None or seed in seeds)
                          for r in records]))


#: The entropy checks (docs/study/sweep-long-tail-truncation-entropy/runs): the archived arm each re-runs
#: with another ``entropy_coef``, and the name the tests give the check.
_ENTROPY_CHECKS = {"none": "raised", "token_tis": "lowered"}


@functools.cache
def _entropy_check(setting: str) -> SimpleNamespace:
    """The entropy checks at ``setting`` beside the archived runs they re-run, seeds 0-7:
    ``records`` and ``metrics`` (the reports' run metrics), ``{arm: {seed: ...}}`` for ref_fp32,
    none, token_tis and each check run there ("raised", "lowered"); ``coefficients``
    ``{check: entropy_coef}``; ``study`` (the processed top-k report's settings); ``paired(arm,
    baseline, key)`` (the reports' paired bootstrap). Each check run's configuration is asserted
    to differ from its archived twin's in ``entropy_coef`` alone."""
    from megatron_mis.testbed.study.config import LONG_TAIL_THRESHOLD
    from megatron_mis.testbed.study.stats import paired_differences, run_metrics

    archive = "sweep-long-tail-truncation"
    main_texts = read_archive(_STUDY_DOCS / archive / "runs")
    coefficients = {}
    for rel, text in read_archive(_STUDY_DOCS / f"{archive}-entropy" / "runs").items():
        if rel.startswith(f"{setting}/"):
            mine, theirs = (json.loads(t.split("\n", 1)[0])["config"] for t in (text, main_texts[rel]))
            assert {k for k in mine if mine[k] != theirs[k]} == {"entropy_coef"}, rel
            check = _ENTROPY_CHECKS[rel.split("/")[1]]
            assert coefficients.setdefault(check, mine["entropy_coef"]) == mine["entropy_coef"], rel
    main, checks = _archive_runs(archive), _archive_runs(f"{archive}-entropy")
    seeds = range(8)
    records = {arm: {s: main[setting, arm, s] for s in seeds} for arm in ("ref_fp32", "none", "token_tis")}
    for arm, check in _ENTROPY_CHECKS.items():
        if check in coefficients:
            assert {s for (st, a, s) in checks if (st, a) == (setting, arm)} == set(seeds), (setting, arm)
            records[check] = {s: checks[setting, arm, s] for s in seeds}
    study = _summary(archive, "long-tail-top-k-processed")["study"]
    kw = dict(last_k=study["last_k"], threshold=LONG_TAIL_THRESHOLD, collapse_fraction=study["collapse_fraction"])
    metrics = {arm: {s: run_metrics(*run, **kw) for s, run in by_seed.items()} for arm, by_seed in records.items()}

    def paired(arm: str, baseline: str, key: str) -> dict:
        return paired_differences({s: metrics[arm][s][key] for s in seeds},
                                  {s: metrics[baseline][s][key] for s in seeds},
                                  confidence=study["confidence"], resamples=study["bootstrap"])

    return SimpleNamespace(records=records, metrics=metrics, coefficients=coefficients, study=study, paired=paired)


def _entropy_lowered_vs_none() -> str:
    """Token TIS with the entropy bonus lowered by its mean weight against the archived none at top-k
    16: the take-off, paired per seed, as ``analyze``'s basis quotes it."""
    d = _entropy_check("long-tail-top-k-processed-k16").paired("lowered", "none", "steps_to_threshold")
    return f"{_quoted(d, '{:+.0f}')} steps, {d['n']} seeds"


def test_the_sampling_mismatch_advice_quotes_the_long_tail_top_k_archive():
    """``analyze``'s advice for one-sided log-ratios above numerics (no IS weight, fix the sampling
    configuration) quotes the long-tail top-k sweeps: the figures in its basis are the processed
    report's (token TIS and none against the reference on the greedy reward, the runs that ended
    low or never took off, the gradient norms) and the replay's effect recomputed from the archive."""
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS

    dose = _dose("sweep-long-tail-truncation", "long-tail-top-k-processed", "k64")
    none, tis, mis = dose["arms"]["none"], dose["arms"]["token_tis"], dose["arms"]["token_mis"]
    replay = _top_p_replay_vs_none("sweep-long-tail-truncation")["k64"]
    never = tis["steps_to_threshold"]["n"] - tis["steps_to_threshold"]["reached"]
    assert mis["steps_to_threshold"]["reached"] == 0 and mis["ended_low"]["k"] == mis["n"]
    quoted = [
        f"mean K3 KL {_e(none['k3_mean'][0], 1)} uncorrected, {none['n']} seeds",
        f"token TIS {_quoted(tis['vs_reference']['greedy_reward'])} against the reference",
        f"{tis['ended_low']['k']}/{tis['n']} ended low and {never}/{tis['n']} never took off in 300 steps "
        f"(none {none['ended_low']['k']}/{none['n']})",
        f"gradient norm {tis['grad_norm_mean'] / none['grad_norm_mean']:.2f}x none's",
        f"every step of {mis['n']}/{mis['n']} runs and never learned: {_quoted(mis['vs_reference']['greedy_reward'])}",
        f"none {_quoted(none['vs_reference']['greedy_reward'])}",
        f"{_quoted(replay)} against the run without it ({replay['n']} seeds)",
        # the entropy check (recomputed in test_the_entropy_bonus_checks_at_top_k_16_come_from_their_archive)
        f"token TIS with that bonus lowered by its mean weight took off with none, {_entropy_lowered_vs_none()}",
    ]
    basis = " ".join(TRUNCATION_BASIS.split())
    _assert_quoted(quoted, basis, context=basis)


def test_the_answers_and_correction_tables_quote_the_processed_top_k_report():
    """docs/study.md's answers-table row for the 512-id tail and the correction table's
    sampling-mismatch row quote the processed top-k and top-p reports: K3 per dose, token TIS and
    token MIS against the reference at top-k 64, token TIS's take-off delay at top-k 16, token TIS
    at top-p 0.8."""
    archive = "sweep-long-tail-truncation"
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    top_k = {label: _dose(archive, "long-tail-top-k-processed", label)["arms"] for label in ("k256", "k64", "k16")}
    k3 = [top_k[k]["none"]["k3_mean"][0] for k in ("k256", "k64", "k16")]
    tis, mis, none = (top_k["k64"][a] for a in ("token_tis", "token_mis", "none"))
    delay16 = _quoted(top_k["k16"]["token_tis"]["vs_reference"]["steps_to_threshold"], "{:+.0f}")
    top_p = {label: _dose(archive, "long-tail-top-p-processed", label)["arms"] for label in ("p0.95", "p0.8")}
    tis08 = top_p["p0.8"]["token_tis"]
    assert not tis08["vs_reference"]["greedy_reward"]["excludes_zero"]
    quoted = [
        f"processed top-p 0.95 / 0.8: {top_p['p0.95']['none']['k3_mean'][0]:.4f} / "
        f"{top_p['p0.8']['none']['k3_mean'][0]:.3f}; processed top-k 256 / 64 / 16",
        f"at processed top-p 0.8 (every weight at least 0.8) token TIS did no measurable harm "
        f"({_quoted(tis08['vs_reference']['greedy_reward'])}, {tis08['n']} seeds)",
        f"processed top-k 256 / 64 / 16: {k3[0]:.3f} / {k3[1]:.2f} / {k3[2]:.2f}, one-sided",
        f"{_quoted(none['vs_reference']['greedy_reward'])} at top-k 64, {none['n']} seeds)",
        f"token TIS {_quoted(tis['vs_reference']['greedy_reward'])} against the reference at top-k 64, "
        f"{tis['ended_low']['k']}/{tis['n']} ended low (none {none['ended_low']['k']}/{none['n']}), its take-off later "
        f"the smaller k ({delay16} steps at top-k 16)",
        f"token MIS masked every token at top-k 64 and never learned ({_quoted(mis['vs_reference']['greedy_reward'])}, "
        f"{mis['n']} seeds)",
        f"mean K3 {k3[1]:.2f}, {none['n']} seeds): token TIS {_quoted(tis['vs_reference']['greedy_reward'])} "
        f"against the reference, {tis['ended_low']['k']}/{tis['n']} ended low "
        f"(none {none['ended_low']['k']}/{none['n']}, none - "
        f"reference {_quoted(none['vs_reference']['greedy_reward'])})",
        f"({delay16} steps after the reference at top-k 16, {top_k['k16']['token_tis']['n']} seeds); "
        "token MIS rejected every loss token on every step and never learned "
        f"({_quoted(mis['vs_reference']['greedy_reward'])}, "
        f"{mis['ended_low']['k']}/{mis['n']})",
    ]
    _assert_quoted(quoted, prose)

def test_the_long_tail_truncation_prose_figures_come_from_the_archive():
    """docs/study.md's figures on truncation with the 512-id tail beyond its table: the 4-seed
    p = 0.8 difference that 8 seeds did not confirm, the paired SD and MDE, the raw runs' K3 and
    gradient norms against the reference's, the plateau's greedy range, the replay's K3, the
    processed runs' largest ratio (below 1 on every step: processed log-probs renormalise the kept
    mass) and token TIS's gradient norm and stalled runs, each recomputed from the archive or the
    reports."""
    from megatron_mis.testbed.study.report import _fmt_ci
    from megatron_mis.testbed.study.stats import paired_differences

    archive = "sweep-long-tail-truncation"
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    runs = _first_truncation_runs()
    dose = functools.partial(_dose, archive)
    raw = _summary(archive, "long-tail-top-p-raw")
    p09, p08 = dose("long-tail-top-p-raw", "p0.9"), dose("long-tail-top-p-raw", "p0.8")
    k64 = dose("long-tail-top-k-raw", "k64")
    processed = dose("long-tail-top-k-processed", "k64")
    replays = [dose("long-tail-top-p-replay", "p0.9"), dose("long-tail-top-p-replay", "p0.8"),
               dose("long-tail-top-k-replay", "k64")]
    greedy = {key: _greedy(end) for key, (_, end) in runs.items()}

    def first_seeds(setting: str, arm: str, n: int) -> dict:
        """``arm - reference`` on the greedy reward over seeds 0..n-1 of ``setting`` (the reports' bootstrap)."""
        return paired_differences({s: greedy[setting, arm, s] for s in range(n)},
                                  {s: greedy[setting, "ref_fp32", s] for s in range(n)},
                                  confidence=raw["study"]["confidence"], resamples=raw["study"]["bootstrap"])

    first4 = first_seeds("long-tail-top-p-raw-p0.8", "none", 4)
    assert first4["excludes_zero"] and not p08["none_vs_reference"]["excludes_zero"] and p08["arms"]["none"]["n"] == 8
    k3_raw = [d["arms"]["none"]["k3_mean"][0] for d in (p09, p08, k64)]
    k3_replay = [d["arms"]["none"]["k3_mean"][0] for d in replays]
    gn = [d["arms"]["none"]["grad_norm_mean"] for d in (p09, p08, k64)]
    gn_ref = [d["arms"]["ref_fp32"]["grad_norm_mean"] for d in (p09, p08, k64)]
    plateau = sorted(g for (_, arm, _), g in greedy.items() if arm in ("none", "ref_fp32"))
    (slow,) = [key for key, g in greedy.items() if key[1] in ("none", "ref_fp32") and g < 0.3]  # still climbing
    assert slow[:2] == ("long-tail-top-k-processed-k256", "none")
    processed_runs = [records for (s, arm, _), (records, _) in runs.items() if "processed" in s and arm != "ref_fp32"]
    ratio_max = max(r["mis_ratio_max"] for records in processed_runs for r in records)
    tis, none, mis = (processed["arms"][a] for a in ("token_tis", "none", "token_mis"))
    never = tis["steps_to_threshold"]["n"] - tis["steps_to_threshold"]["reached"]
    top_k = {label: dose("long-tail-top-k-processed", label) for label in ("k256", "k64", "k16")}
    assert top_k["k16"]["arms"]["none"]["n"] == none["n"]
    first8 = first_seeds("long-tail-top-k-processed-k64", "token_tis", 8)
    first12 = first_seeds("long-tail-top-k-processed-k64", "token_tis", 12)
    mis_runs = {key: records for key, (records, _) in runs.items() if key[1] == "token_mis"}
    mis64 = [r for (s, _, _), records in mis_runs.items() if s.endswith("-k64") for r in records]
    mis256 = [r for (s, _, _), records in mis_runs.items() if s.endswith("-k256") for r in records]
    tis256 = [r for (s, arm, seed), (records, _) in runs.items() if s == "long-tail-top-k-processed-k256"
              and arm == "token_tis" and (s, "token_mis", seed) in runs for r in records]
    takeoff = [top_k[k]["arms"]["token_tis"]["vs_reference"]["steps_to_threshold"] for k in ("k256", "k64", "k16")]
    none16 = top_k["k16"]["arms"]["none"]["vs_reference"]["steps_to_threshold"]
    tis16 = top_k["k16"]["arms"]["token_tis"]
    assert all(tis16[against]["greedy_reward"]["excludes_zero"] for against in ("vs_reference", "vs_none"))
    # at top-k 64 behind the reference, not none; none took off measurably before the reference at 16 and 64
    assert tis["vs_reference"]["greedy_reward"]["excludes_zero"] and not tis["vs_none"]["greedy_reward"]["excludes_zero"]
    none64 = top_k["k64"]["arms"]["none"]["vs_reference"]["steps_to_threshold"]
    assert none16["high"] < 0 and none64["high"] < 0
    summary = _summary(archive, "long-tail-top-k-processed")
    quoted = [
        f"At the first 4 seeds the report put p = 0.8 at {_quoted(first4)}, measurably behind; 4 more seeds took it to "
        f"{_quoted(p08['none_vs_reference'])}",
        f"paired SD {raw['paired_sd']:.3f}, MDE {raw['minimal_detectable_effect']:.3f} at 4 seeds",
        f"greedy reward {plateau[1]:.2f}-{plateau[-1]:.2f}, exact answers at most "
        f"{max(end['evaluation']['greedy_exact'] for _, end in runs.values()):.1%} in every run; the one, none "
        f"at top-k 256 seed {slow[2]}, was still climbing at step 300, greedy {greedy[slow]:.2f})",
        f"top-p sweep; {summary['paired_sd']:.3f} and {summary['minimal_detectable_effect']:.3f} at "
        f"{summary['seeds_run']} seeds in the processed top-k",
        f"{_quoted(top_k['k256']['none_vs_reference'])} at top-k 256 ({top_k['k256']['arms']['none']['n']} seeds), "
        f"{_quoted(top_k['k16']['none_vs_reference'])} at top-k 16 and "
        f"{_quoted(top_k['k64']['none_vs_reference'])} at top-k 64 ({none['n']} seeds each)",
        f"none reached the threshold {-none16['mean']:.0f} [{-none16['high']:.0f}, {-none16['low']:.0f}] steps "
        f"*before* the reference, at top-k 64 {-none64['mean']:.0f} [{-none64['high']:.0f}, {-none64['low']:.0f}], "
        f"{none['n']} seeds each",
        f"K3 stays at fp32 rounding ({_e(min(k3_raw), 1)} to {_e(max(k3_raw), 1)})",
        f"mean gradient norm is {gn[0]:.2f}, {gn[1]:.2f} and {gn[2]:.2f} at p = 0.9, 0.8 and top-k 64 against the "
        f"reference's {min(gn_ref):.2f}-{max(gn_ref):.2f}",
        "top-k 256's, 64's and 16's mean K3 is "
        + ", ".join(_e(top_k[k]["arms"]["none"]["k3_mean"][0], 1) for k in ("k256", "k64"))
        + f" and {_e(top_k['k16']['arms']['none']['k3_mean'][0], 1)}",
        f"in any step of the {len(processed_runs)} processed runs: {ratio_max:.5f})",
        f"mass (mean K3 {_e(tis['k3_mean'][0], 1)} at top-k 64)",
        f"mean gradient norm {tis['grad_norm_mean']:.2f} against none's {none['grad_norm_mean']:.2f}",
        f"{_quoted(tis['vs_reference']['greedy_reward'])} against the reference at {tis['n']} seeds "
        f"({_quoted(first8)} at the first 8, {_quoted(first12)} at 12)",
        f"reference, not against none ({_quoted(tis['vs_none']['greedy_reward'])})",
        f"{tis['ended_low']['k']} of {tis['n']} of its runs ended low and {never} never took off in 300 steps, against "
        f"{none['ended_low']['k']} of {none['n']} for none",
        "token TIS reached the threshold " + ", ".join(_quoted(d, "{:+.0f}") for d in takeoff[:2])
        + f" and {_quoted(takeoff[2], '{:+.0f}')} steps after the reference at top-k 256, 64 and 16 "
        f"({takeoff[0]['n']}, {takeoff[1]['n']} of {tis['n']}, {takeoff[2]['n']} of "
        f"{top_k['k16']['arms']['token_tis']['n']} seeds), and at top-k 16 "
        f"{top_k['k16']['arms']['token_tis']['collapse']['k']} of its {top_k['k16']['arms']['token_tis']['n']} runs "
        f"collapsed and {top_k['k16']['arms']['token_tis']['ended_low']['k']} ended low",
        f"{_quoted(tis16['vs_reference']['greedy_reward'])}, and none's, {_quoted(tis16['vs_none']['greedy_reward'])} "
        f"({_quoted(first_seeds('long-tail-top-k-processed-k16', 'token_tis', 8))} at the first 8 seeds and "
        f"{_quoted(first_seeds('long-tail-top-k-processed-k16', 'token_tis', 12))} at 12)",
        f"its ratios stayed in [{min(r['mis_ratio_min'] for r in mis64):.3f}, "
        f"{max(r['mis_ratio_max'] for r in mis64):.3f}]",
        f"fraction is 1 on every step of all {mis['n']} runs",
        f"greedy reward {_fmt_ci(mis['greedy_reward'])}, {_quoted(mis['vs_reference']['greedy_reward'])} against the "
        f"reference, {mis['ended_low']['k']} of {mis['n']} never took off",
        f"(smallest ratio {min(r['mis_ratio_min'] for r in mis256):.2f})",
        f"K3 back to rounding: {_e(min(k3_replay), 1)} to {_e(max(k3_replay), 1)}",
        f"replayed top-p at 0.9 ended above the untruncated reference "
        f"({_quoted(replays[0]['none_vs_reference'])}, 4 seeds",
    ]
    _assert_quoted(quoted, prose)
    assert ratio_max < 1.0 and min(r["mis_ratio_max"] for (s, arm, _), (records, _) in runs.items()
                                   if "raw" in s for r in records) >= 1.0  # raw: rounding on both sides of 1
    # token MIS over processed top-k 64: every loss token rejected on every step, so no gradient, ever, and
    # no run took off; at top-k 256 nothing rejected, so the same runs as token TIS, step for step
    assert len(mis64) == mis["n"] * summary["steps"] and mis["steps_to_threshold"]["reached"] == 0
    assert all(r["rejected_token_fraction"] == 1.0 and r["grad_norm"] == 0.0 for r in mis64)
    assert all(r["rejected_token_fraction"] == 0.0 for r in mis256) and len(mis256) == len(tis256) > 0
    assert [(r["reward_mean"], r["grad_norm"]) for r in mis256] == [(r["reward_mean"], r["grad_norm"]) for r in tis256]
    assert min(r["mis_ratio_min"] for r in mis256) > 0.5


def test_the_entropy_bonus_checks_at_top_k_16_come_from_their_archive():
    """docs/study.md's checks of why token TIS over processed top-k 16 log-probs slows learning
    (docs/study/sweep-long-tail-truncation-entropy/runs): token TIS with ``entropy_coef`` lowered to
    0.0044 (0.03 times its mean weight there) and none with it raised to 0.2 (0.03 over it), each
    differing from the archived run of its arm in that coefficient alone; their entropy, take-off,
    collapses and greedy reward against token TIS, none and the reference, and token TIS's weight
    over time, recomputed from both archives with the reports' metrics and bootstrap."""
    import numpy as np

    checks = _entropy_check("long-tail-top-k-processed-k16")
    coefficients = {"raised": 0.2, "lowered": 0.0044}
    assert checks.coefficients == coefficients
    metrics, seeds = checks.metrics, range(8)
    paired = checks.paired

    def steps(arm: str, baseline: str) -> str:
        return _quoted(paired(arm, baseline, "steps_to_threshold"), "{:+.0f}")

    def series(arm: str, key: str) -> np.ndarray:
        return np.array([[r[key] for r in checks.records[arm][s][0]] for s in seeds])

    weight = series("token_tis", "is_weight_mean")
    assert 0.03 / weight.mean() == pytest.approx(coefficients["raised"], abs=0.01)
    assert 0.03 * weight.mean() == pytest.approx(coefficients["lowered"], abs=1e-4)
    entropy = {arm: series(arm, "entropy") for arm in ("ref_fp32", "none", "token_tis", "raised", "lowered")}
    cells = {arm: f"{e[:, 100:150].mean():.2f} / {e[:, 250:300].mean():.2f}" for arm, e in entropy.items()}
    reached = {arm: sum(metrics[arm][s]["steps_to_threshold"] is not None for s in seeds)
               for arm in ("token_tis", "raised", "lowered")}
    collapsed = {arm: sum(metrics[arm][s]["collapsed"] for s in seeds)
                 for arm in ("none", "token_tis", "raised", "lowered")}
    raised_vs_none = paired("raised", "none", "greedy_reward")
    assert raised_vs_none["excludes_zero"] and raised_vs_none["mean"] < 0
    # lowered: level with none on the take-off, resolved ahead of token TIS; the summaries' "a third of its
    # delay" for raised
    assert not paired("lowered", "none", "steps_to_threshold")["excludes_zero"]
    assert paired("lowered", "token_tis", "steps_to_threshold")["high"] < 0
    delays = [paired(arm, "ref_fp32", "steps_to_threshold")["mean"] for arm in ("raised", "token_tis")]
    assert round(3 * delays[0] / delays[1]) == 1, delays
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    quoted = [
        f"token TIS's mean weight at that dose (at top-k 16, {weight.mean():.3f})",
        f"take-off against the reference was {steps('lowered', 'ref_fp32')} steps ({reached['lowered']} of 8 took "
        f"off; none's {steps('none', 'ref_fp32')}), {steps('lowered', 'none')} against none and "
        f"{steps('lowered', 'token_tis')} against token TIS; greedy reward "
        f"{_quoted(paired('lowered', 'ref_fp32', 'greedy_reward'))} against the reference",
        f"steps 101-150 / 251-300: {cells['lowered']}, none {cells['none']})",
        f"steps 101-150 / 251-300: {cells['raised']}, token TIS {cells['token_tis']}, none {cells['none']}, the "
        f"reference {cells['ref_fp32']}",
        f"{0.03 / weight.mean():.1f}** (0.03 over that weight)",
        f"{0.03 * weight.mean():.4f}** (0.03 times that weight)",
        f"{weight[:, :10].mean():.3f} over the first 10 steps, {weight[:, :50].mean():.3f} over the first 50 and "
        f"{weight[:, 250:].mean():.3f} over the last 50",
        f"{steps('raised', 'ref_fp32')} steps after the reference ({reached['raised']} of 8 took off)",
        f"token TIS's {steps('token_tis', 'ref_fp32')} over the same 8 seeds ({reached['token_tis']} of 8)",
        f"{steps('raised', 'token_tis')} steps against token TIS",
        f"greedy reward {_quoted(raised_vs_none)} against none",
        f"{_quoted(paired('raised', 'ref_fp32', 'greedy_reward'))} against the reference",
        f"{collapsed['raised']} of 8 collapsed (token TIS {collapsed['token_tis']}, none {collapsed['none']})",
        # the summaries, the correction table's sampling-mismatch row and the README
        f"that bonus raised to match ended worse than none: {_quoted(raised_vs_none)}, 8 seeds at top-k 16)",
        f"token TIS with that bonus lowered by its mean weight took off with none ({steps('lowered', 'none')} "
        "steps, 8 seeds at top-k 16)",
    ]
    assert collapsed["lowered"] == 0  # "none of its runs collapsed"
    _assert_quoted(quoted, prose)


def test_the_lowered_entropy_check_at_top_k_64_comes_from_its_archive():
    """The same check at top-k 64 (docs/study/sweep-long-tail-truncation-entropy/runs): token TIS
    with ``entropy_coef`` 0.03 times its mean weight there, differing from the archived token TIS in
    that coefficient alone; its take-off against none and token TIS, the runs that ended low and
    the greedy reward, recomputed with the reports' metrics and bootstrap over seeds 0-7."""
    from megatron_mis.testbed.study.report import ended_low

    checks = _entropy_check("long-tail-top-k-processed-k64")
    metrics = checks.metrics
    assert set(metrics) == {"ref_fp32", "none", "token_tis", "lowered"}
    # sized from the 12 seeds of token TIS archived at top-k 64 when the check ran (seeds 12-15 came later)
    weight = _token_tis_mean_weight("long-tail-top-k-processed-k64", range(12))
    assert checks.coefficients["lowered"] == pytest.approx(0.03 * weight, abs=1e-4)
    low = ended_low(metrics, checks.study["collapse_fraction"])["arms"]

    def paired(arm: str, baseline: str, key: str, fmt: str = "{:+.3f}") -> str:
        return _quoted(checks.paired(arm, baseline, key), fmt)

    reached = sum(m["steps_to_threshold"] is not None for m in metrics["lowered"].values())
    quoted = (f"token TIS with the bonus lowered to {0.03 * weight:.4f} (0.03 times its mean weight there, "
              f"{weight:.3f}; 8 seeds) took off with none "
              f"({paired('lowered', 'none', 'steps_to_threshold', '{:+.0f}')} "
              f"steps against none, {paired('lowered', 'token_tis', 'steps_to_threshold', '{:+.0f}')} against token "
              f"TIS over the seeds both took off on), {reached} of 8 took off and {len(low['lowered'])} of 8 ended "
              f"low (token TIS over the same seeds: {len(low['token_tis'])} of 8), and its greedy reward was "
              f"{paired('lowered', 'token_tis', 'greedy_reward')} against token TIS "
              f"({paired('lowered', 'ref_fp32', 'greedy_reward')} against the reference)")
    assert quoted in _prose(_STUDY_DOCS.parent / "study.md"), quoted


def test_the_processed_top_p_figures_on_the_long_tail_come_from_the_archive():
    """docs/study.md on processed top-p over the 512-id tail: every ratio within [p, 1] (rounding
    aside), token TIS and sequence MIS against the reference and none, the sequence log-weight from
    the measured log-ppl gap, the normalised sequence weights, the length at which sequence MIS's
    lower bound rejects everything, and token TIS's take-off delay against its mean weight at every
    processed dose; each from the report or recomputed from the archive."""
    import math

    import numpy as np

    archive = "sweep-long-tail-truncation"
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    runs = _archive_runs(archive)
    top_p = {d["label"]: d["arms"] for d in _summary(archive, "long-tail-top-p-processed")["doses"]}
    top_k = {d["label"]: d["arms"] for d in _summary(archive, "long-tail-top-k-processed")["doses"]}
    setting = "long-tail-top-p-processed-p0.8"
    p08 = [r for (s, arm, _), (records, _) in runs.items() if s == setting and arm != "ref_fp32" for r in records]
    seq = [r for (s, arm, _), (records, _) in runs.items() if s == setting and arm == "sequence_mis" for r in records]
    lo, hi = min(r["mis_ratio_min"] for r in p08), max(r["mis_ratio_max"] for r in p08)
    n08 = sum(1 for (s, arm, _) in runs if s == setting and arm != "ref_fp32")
    assert 0.8 - 1e-5 < lo < 0.8 and hi < 1.0  # the kept mass, at least p up to float32 rounding
    assert all(r["rejected_token_fraction"] == 0.0 and r["rejected_seq_fraction"] == 0.0 for r in p08)
    gap = float(np.mean([r["mis_log_ppl_abs_diff"] for r in seq]))
    tis, none, smis = (top_p["p0.8"][a] for a in ("token_tis", "none", "sequence_mis"))
    p095 = top_p["p0.95"]

    def takeoff(arm: dict) -> str:
        return _quoted(arm["vs_reference"]["steps_to_threshold"], "{:+.0f}")

    doses = [(f"p {label[1:]}", f"long-tail-top-p-processed-{label}", top_p[label]) for label in ("p0.95", "p0.8")]
    doses += [(f"top-k {label[1:]}", f"long-tail-top-k-processed-{label}", top_k[label])
              for label in ("k256", "k64", "k16")]
    delays = [f"{arm['token_tis']['vs_reference']['steps_to_threshold']['mean']:+.0f} steps at {name} (mean weight "
              f"{_token_tis_mean_weight(setting):.2f})" for name, setting, arm in doses]
    quoted = [
        f"(at p = 0.8 the {n08} processed runs' ratios stayed in [{lo:.6f}, {hi:.2f}]; mean K3 "
        f"{_e(none['k3_mean'][0], 1)})",
        f"{_quoted(tis['vs_reference']['greedy_reward'])} against the reference and "
        f"{_quoted(tis['vs_none']['greedy_reward'])} against none ({tis['n']} seeds)",
        f"taking off {takeoff(tis)} steps after the reference (none {takeoff(none)})",
        f"about e^{-64 * gap:.0f} (64 tokens times the mean log-ratio -{gap:.2f})",
        f"(normalised weights in [{min(r['is_weight_min'] for r in seq):.2f}, "
        f"{max(r['is_weight_max'] for r in seq):.2f}]): "
        f"{_quoted(smis['vs_reference']['greedy_reward'])} against the reference",
        f"below p = {math.exp(math.log(1e-8) / 64):.2f} at 64 tokens, {math.exp(math.log(1e-8) / 256):.2f} at 256 and "
        f"{math.exp(math.log(1e-8) / 1024):.3f} at 1,024",
        "its mean weight falls: " + ", ".join(delays[:-1]) + f" and {delays[-1]}; only the last CI excludes 0",
        f"At p = 0.95 (mean K3 {_e(p095['none']['k3_mean'][0], 1)}, below the monitor's K3 bound 1e-2: none of its "
        f"{p095['none']['n'] + p095['token_tis']['n']} processed runs flagged) token TIS was "
        f"{_quoted(p095['token_tis']['vs_reference']['greedy_reward'])} against the reference "
        f"({p095['token_tis']['n']} seeds)",
    ]
    assert [bool(arm["token_tis"]["vs_reference"]["steps_to_threshold"]["excludes_zero"]) for _, _, arm in doses] == [
        False] * (len(doses) - 1) + [True]
    assert all(p095[a]["monitor_flagged"]["k"] == 0 for a in ("none", "token_tis"))
    # the README's monitor paragraph: the K3 bound fires on every step at p 0.8 here, never at p 0.95
    assert min(r["mis_k3_kl"] for r in p08) > 1e-2 and max(r["mis_k3_kl"] for (s, arm, _), (records, _) in runs.items()
                                                         if s.endswith("-p0.95") and arm != "ref_fp32"
                                                         for r in records) < 1e-2
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert (f"on every step of the 512-id one (not p 0.95 there: mean K3 {_e(p095['none']['k3_mean'][0], 1)})"
            in readme)
    _assert_quoted(quoted, prose)


def test_the_self_normalised_token_tis_figures_come_from_the_archive():
    """docs/study.md, the README and ``analyze``'s basis on token TIS self-normalised
    (``token_tis_normalized``) over processed log-probs on the 512-id tail: its weights average 1
    on every step of every run, and per dose its greedy reward against the reference, the runs
    that ended low and took off, and its take-off against the reference, none and token TIS (paired
    per seed with the reports' bootstrap; against token TIS over the seeds both took off on, the
    reference having taken off on every seed), from the processed reports and their archive."""
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS
    from megatron_mis.testbed.study.stats import paired_differences

    archive = "sweep-long-tail-truncation"
    runs = _archive_runs(archive)

    def steps(arm: dict) -> dict:
        return {int(s): d for s, d in arm["vs_reference"]["steps_to_threshold"]["diffs"].items()}

    figures = {}
    for report, label in (("long-tail-top-k-processed", "k16"), ("long-tail-top-k-processed", "k64"),
                          ("long-tail-top-k-processed", "k256"), ("long-tail-top-p-processed", "p0.8")):
        dose, study = _dose(archive, report, label), _summary(archive, report)["study"]
        arms = dose["arms"]
        norm, tis, none = arms["token_tis_normalized"], arms["token_tis"], arms["none"]
        assert norm["seeds"] == tis["seeds"] == none["seeds"], label
        assert arms["ref_fp32"]["steps_to_threshold"]["reached"] == arms["ref_fp32"]["n"], label
        weights = [r["is_weight_mean"] for s in norm["seeds"]
                   for r in runs[dose["setting"], "token_tis_normalized", s][0]]
        assert max(abs(w - 1.0) for w in weights) < 1e-5, label
        vs_tis = paired_differences(steps(norm), steps(tis), confidence=study["confidence"],
                                    resamples=study["bootstrap"])
        figures[label] = {
            "n": norm["n"], "reached": norm["steps_to_threshold"]["reached"], "low": norm["ended_low"]["k"],
            "tis_low": tis["ended_low"]["k"], "none_low": none["ended_low"]["k"],
            "ref": _quoted(norm["vs_reference"]["greedy_reward"]),
            "steps_ref": _quoted(norm["vs_reference"]["steps_to_threshold"], "{:+.0f}"),
            "none_steps_ref": _quoted(none["vs_reference"]["steps_to_threshold"], "{:+.0f}"),
            "steps_none": _quoted(norm["vs_none"]["steps_to_threshold"], "{:+.0f}"),
            "steps_tis": _quoted(vs_tis, "{:+.0f}"), "n_tis": vs_tis["n"],
            "none": _quoted(norm["vs_none"]["greedy_reward"]),
            "ref_mean": norm["vs_reference"]["greedy_reward"]["mean"],
            "after_none": norm["vs_none"]["steps_to_threshold"]["low"] > 0,
        }
    k16, k64, k256, p08 = (figures[label] for label in ("k16", "k64", "k256", "p0.8"))
    quoted = [
        f"at top-k 16 it took off {k16['steps_ref']} steps against the reference ({k16['reached']} of {k16['n']}; "
        f"none {k16['none_steps_ref']}), {k16['steps_none']} against none and {k16['steps_tis']} against token TIS "
        f"(the {k16['n_tis']} seeds token TIS took off on); greedy reward {k16['ref']} against the reference, "
        f"{k16['low']} of {k16['n']} ended low (token TIS {k16['tis_low']}, none {k16['none_low']})",
        f"At top-k 64 ({k64['n']} seeds): {k64['ref']} against the reference, {k64['reached']} of {k64['n']} took "
        f"off, {k64['steps_none']} steps against none and {k64['steps_tis']} against token TIS ({k64['n_tis']} "
        f"seeds), {k64['low']} of {k64['n']} ended low (token TIS {k64['tis_low']})",
        f"(by {-k64['ref_mean']:.3f}, a hundredth of this task's range; {k64['none']} against none)",
        f"at top-k 256 and p 0.8 ({k256['n']} and {p08['n']} seeds), where token TIS had done no measurable harm, it "
        f"did none either: {k256['ref']} and {p08['ref']} against the reference",
        # the section's summary and the "not yet measured" paragraph
        f"it stalled {k64['tis_low']} of {k64['n']} runs at top-k 64 and {k16['tis_low']} of {k16['n']} at top-k 16",
        f"Self-normalising the weight removed the stalls ({k16['low']} of {k16['n']} and {k64['low']} of {k64['n']} "
        f"ended low at top-k 16 and 64; none {k16['none_low']} and {k64['none_low']})",
        # over more seeds the counts before it are the top-k 16 section's test's
        f"; at {k16['n']} seeds each {k16['low'] + k64['low']} and {k16['tis_low'] + k64['tis_low']} of "
        f"{k16['n'] + k64['n']})",
        # the answers table and the correction table
        f"token TIS self-normalised (`token_tis_normalized`) left no run low at top-k 64 ({k64['low']}/{k64['n']}, "
        f"{k64['ref']}",
    ]
    assert k64["low"] == 0 and k64["after_none"]  # "measurably after none"
    # the reference's seeds 8-15 (and 16-25) at top-k 16: the runner copied the top-k 64 runs (its header says so),
    # and the archive stores them in full under top-k 16, the top-k 64 files as copies of them
    root = _STUDY_DOCS / archive / "runs"
    texts = read_archive(root)
    for seed in (*range(8, 16), *_TOP_K_MORE["k64"][1]):  # and so the top-k 16 section's copies of seeds 16-25
        copy = json.loads((root / "long-tail-top-k-processed-k64" / "ref_fp32" / f"seed-{seed}.copy.json").read_text())
        assert copy["body_of"] == f"long-tail-top-k-processed-k16/ref_fp32/seed-{seed}.jsonl"
        header = json.loads(texts[f"long-tail-top-k-processed-k16/ref_fp32/seed-{seed}.jsonl"].split("\n", 1)[0])
        assert header["copied_from"].endswith(f"long-tail-top-k-processed-k64/ref_fp32/seed-{seed}.jsonl")
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted(quoted, prose)
    tis16 = _dose(archive, "long-tail-top-k-processed", "k16")["arms"]["token_tis"]
    behind16 = (f"at top-k 16 it ended measurably behind ({_quoted(tis16['vs_reference']['greedy_reward'])}, "
                f"{tis16['n']} seeds)")
    assert behind16 in prose  # the answers table
    assert (f"token TIS self-normalised (token_tis_normalized) {k64['ref']}, {k64['low']}/{k64['n']} ended low, "
            f"{k64['reached']}/{k64['n']} took off") in " ".join(TRUNCATION_BASIS.split())


def test_the_powered_one_step_lag_figures_come_from_the_archive():
    """docs/study.md and the README on one step of lag (``staleness`` k1, 150 steps) at 120 seeds of
    none and the reference (docs/study/sweep-staleness-k1): none - reference with its CI, the paired
    SD, the minimal detectable effect and the seeds a 0.05 difference needs, collapses, runs that
    ended low, K3 and the monitor's flags (the report's), the figure over the first 8 seeds
    (recomputed from the archive with the report's bootstrap) and the 8-seed sweep's figure (its own
    report, docs/study/sweep-staleness/summary.json)."""
    summary = _summary("sweep-staleness-k1", ".")
    (dose,) = summary["doses"]
    none, ref = dose["arms"]["none"], dose["arms"]["ref_fp32"]
    n = none["n"]
    assert n == ref["n"] == summary["seeds_run"] == 120 and summary["steps"] == 150
    diff = dose["none_vs_reference"]
    assert diff["excludes_zero"] and diff["high"] < 0 and summary["first_dose_none_behind_reference"] == "k1"
    first8 = _k1_paired(summary, "none", "ref_fp32", 8)
    sweep_summary = _summary("sweep-staleness", ".")  # the 8-seed sweep: its k1 and k2 doses
    sweep, sweep_k2 = ({d["label"]: d for d in sweep_summary["doses"]}[label] for label in ("k1", "k2"))
    late = none["vs_reference"]["steps_to_threshold"]
    tis = dose["arms"]["token_tis"]
    tis_none, tis_ref = tis["vs_none"]["final_reward"], tis["vs_reference"]["final_reward"]
    assert tis["n"] == n and tis_none["low"] > 0 and tis_ref["high"] < 0  # helps, measurably, and does not close it
    share = tis_none["mean"] / -diff["mean"]  # the share of none's gap it recovers
    assert late["excludes_zero"] and late["low"] > 0
    assert sweep["none_vs_reference"]["n"] == 8
    # none, the reference and token TIS on one VM; decoupled PPO and bypass later on another
    # (and token / sequence MIS there in a later session: 120 + 60)
    assert summary["runs_made_on"] == {"AMD EPYC [AVX512], Python 3.11.7, torch 2.13.0+cpu": 3 * n,
                                       "AMD EPYC [AVX2], Python 3.11.7, torch 2.13.0+cpu": 2 * (n + n // 2)}
    size = _archive_bytes("sweep-staleness-k1")
    quoted = [
        f"none - reference is {_quoted(diff)} over {n} seeds",
        f"final reward {none['final_reward'][0]:.3f} against the reference's {ref['final_reward'][0]:.3f}",
        f"paired SD {summary['paired_sd']:.3f}, so {n} seeds resolve {summary['minimal_detectable_effect']:.3f} and "
        f"a 0.05 difference needs {summary['seeds_for_target']}",
        f"first 8 of these seeds give {_quoted(first8)}",
        f"the sweep's 8 seeds gave {_quoted(sweep['none_vs_reference'])}",
        f"mean K3 {_e(none['k3_mean'][0], 1)}",
        f"{none['collapse']['k']} of {n} runs of none collapsed (the reference {ref['collapse']['k']})",
        f"{none['ended_low']['k']} ended low (the reference {ref['ended_low']['k']})",
        f"flagged {none['monitor_flagged']['k']} of {n} runs of none on the mismatch and "
        f"{ref['monitor_flagged']['k']} of the reference's",
        f"{none['steps_to_threshold']['reached']} of {n} reached the threshold reward {summary['threshold']} against "
        f"the reference's {ref['steps_to_threshold']['reached']}, and those that did were later "
        f"({_quoted(late, '{:+.0f}')} steps, over the {late['n']} seeds on which both did)",
        f"it is {_quoted(tis_none)} against none and {_quoted(tis_ref)} against the reference (the sweep's 8 seeds "
        f"had it at {_quoted(sweep['arms']['token_tis']['vs_none']['final_reward'])} against none, unresolved); "
        f"{tis['collapse']['k']} of its {tis['n']} runs collapsed and "
        f"{tis['ended_low']['k']} ended low (none {none['collapse']['k']} and {none['ended_low']['k']}), and its mean "
        f"K3 is {_e(tis['k3_mean'][0], 1)} (none {_e(none['k3_mean'][0], 1)})",
        f"about {share:.0%} of the gap",
        f"paired SD ({sweep_summary['paired_sd']:.3f}) that was {sweep_summary['seeds_for_target']} per dose",
        f"k = 1 is measurably behind too: {_quoted(diff)}",
        f"with 3-token responses: {diff['mean']:+.3f} at {n} seeds)",
        f"({2 * n} runs in 50 minutes, about {none['wall_s']:.0f} s per run; 1.7 CPU-hours)",
        f"({sum(a['n'] for a in dose['arms'].values())} runs, {size / 1e6:.1f} MB)",
    ]
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted(quoted, prose)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert (f"**from one step of lag**: {_quoted(diff)} ({n} seeds, MDE {summary['minimal_detectable_effect']:.3f}, "
            f"K3 {none['k3_mean'][0]:.3f})") in readme
    assert f"at one step: token TIS {_quoted(tis_none)}, decoupled PPO" in readme
    assert f"at k = 1 token TIS recovers {_quoted(tis_none)} of the {diff['mean']:+.3f} ({n} seeds)" in prose
    # the answers table's staleness row
    k2 = sweep_k2["arms"]["none"]["k3_mean"][0]
    answers = (f"| k = 1 optimizer step ({_quoted(diff, '{:+.2f}')}, {n} seeds; the sweep's 8 seeds had left it at "
               f"{_quoted(sweep['none_vs_reference'], '{:+.2f}')}) | {none['k3_mean'][0]:.3f} (k = 2: {k2:.2f}) |")
    assert answers in prose, answers


def test_the_one_step_lag_decoupled_and_bypass_figures_come_from_the_archive():
    """docs/study.md, the README and ``analyze``'s recommendation on decoupled PPO (120 seeds) and
    bypass PPO (the first 60) at one step of lag, run on another VM: their differences against
    none and the reference, collapses, runs that ended low or reached the threshold, K3, time per
    run (the report's), decoupled PPO - token TIS and the cross-arm correlations of the final reward
    that justify pairing by seed across machines (recomputed from the archive)."""
    import numpy as np

    from megatron_mis.analysis.recommend import recommend
    from megatron_mis.testbed.study.stats import run_metrics

    summary = _summary("sweep-staleness-k1", ".")
    (dose,) = summary["doses"]
    arms = dose["arms"]
    none, dec, byp = arms["none"], arms["decoupled_ppo"], arms["bypass_ppo"]
    n = dec["n"]
    assert n == none["n"] == 120 and byp["n"] == 60
    final = _committed_finals("sweep-staleness-k1", summary)
    study = summary["study"]
    dec_tis = _k1_paired(summary, "decoupled_ppo", "token_tis", n)
    assert not dec_tis["excludes_zero"]

    def corr(a: str, b: str) -> float:
        return float(np.corrcoef([final[a, s] for s in range(n)], [final[b, s] for s in range(n)])[0, 1])

    dec_none, dec_ref = dec["vs_none"]["final_reward"], dec["vs_reference"]["final_reward"]
    byp_none, byp_ref = byp["vs_none"]["final_reward"], byp["vs_reference"]["final_reward"]
    assert dec_none["low"] > 0 and dec_ref["high"] < 0 and byp_ref["low"] > 0  # bypass above fresh rollouts
    gap = -dose["none_vs_reference"]["mean"]
    early = byp["vs_reference"]["steps_to_threshold"]
    assert early["excludes_zero"] and early["high"] < 0
    sweep = {d["label"]: d for d in _summary("sweep-staleness", ".")["doses"]}["k1"]["arms"]
    ref_reached = sum(  # the reference's runs that reached the threshold on bypass's seeds
        run_metrics(records, end, last_k=study["last_k"], threshold=summary["threshold"],
                    collapse_fraction=study["collapse_fraction"])["steps_to_threshold"] is not None
        for (_, arm, seed), (records, end) in _archive_runs("sweep-staleness-k1").items()
        if arm == "ref_fp32" and seed < byp["n"])
    quoted = [
        f"{_quoted(dec_none)} against none and {_quoted(dec_ref)} against the reference over the same {n} seeds "
        f"(the sweep's 8 seeds: {_quoted(sweep['decoupled_ppo']['vs_none']['final_reward'])}), about "
        f"{dec_none['mean'] / gap:.0%} of the gap; {dec['collapse']['k']} of its {n} runs collapsed and "
        f"{dec['ended_low']['k']} ended low, mean K3 {_e(dec['k3_mean'][0], 1)}. Against token TIS it is "
        f"{_quoted(dec_tis)}",
        f"{_quoted(byp_none)} against none and {_quoted(byp_ref)} against the reference (the sweep's 8 seeds: "
        f"{_quoted(sweep['bypass_ppo']['vs_none']['final_reward'])} and "
        f"{_quoted(sweep['bypass_ppo']['vs_reference']['final_reward'])}). None of its {byp['n']} runs collapsed, "
        f"{byp['ended_low']['k']} ended low, {byp['steps_to_threshold']['reached']} reached the threshold reward "
        f"{summary['threshold']} (the reference {ref_reached} of the same {byp['n']}), "
        f"{-early['mean']:.0f} [{-early['high']:.0f}, {-early['low']:.0f}] steps before the reference on the "
        f"{early['n']} seeds on which both did; mean K3 {_e(byp['k3_mean'][0], 1)}",
        f"({n} runs in 55 minutes, about {dec['wall_s']:.0f} s per run), bypass 19:07-19:36 UTC (60 runs in 29 "
        f"minutes, about {byp['wall_s']:.0f} s per run); 2.8 CPU-hours (decoupled PPO's runs took "
        f"{dec['wall_s'] / none['wall_s']:.1f} times as long as none's on the third VM)",
        f"Final rewards correlate {corr('decoupled_ppo', 'none'):.2f} between decoupled PPO (fourth VM) and none "
        f"(third VM) over the {n} seeds, the same as token TIS and none on one VM ({corr('token_tis', 'none'):.2f}), "
        f"and {corr('none', 'ref_fp32'):.2f} between none and the reference on one VM",
        f"decoupled PPO {_quoted(dec_none)} ({n}), token MIS",  # the answers table's staleness row
        f"bypass {_quoted(byp_none)} ({byp['n']}; {_quoted(byp_ref)} above fresh rollouts) |",
    ]
    assert byp["collapse"]["k"] == 0
    prose = _prose(_STUDY_DOCS.parent / "study.md")
    _assert_quoted(quoted, prose)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert f"decoupled PPO {_quoted(dec_none)}, token MIS" in readme
    assert f"{_quoted(byp_none)} over none at one step ({byp['n']} seeds)" in readme
    reason = " ".join(recommend(0.044, 3).reason.split())
    tmis_none = arms["token_mis"]["vs_none"]["final_reward"]
    assert (f"none fell {_quoted(dose['none_vs_reference'])} behind fresh rollouts ({n} seeds), token TIS recovered "
            f"{_quoted(arms['token_tis']['vs_none']['final_reward'])}, decoupled PPO {_quoted(dec_none)} and token MIS "
            f"{_quoted(tmis_none)} (masking {_rejected_share('token_mis'):.1%} of the tokens), bypass "
            f"{_quoted(byp_none)} ({byp['n']} seeds)") in reason


def _rejected_share(arm: str, field: str = "rejected_token_fraction") -> float:
    """The mean over ``arm``'s runs at one step of lag (docs/study/sweep-staleness-k1) of its runs'
    mean per-step ``field``: the fraction of loss tokens (or, ``rejected_seq_fraction``, of
    sequences) the correction rejected."""
    import numpy as np

    return float(np.mean([np.mean([r[field] for r in records])
                          for (_, a, _), (records, _) in _archive_runs("sweep-staleness-k1").items() if a == arm]))


def _k1_paired(summary: dict, arm: str, other: str, seeds: int) -> dict:
    """``arm - other`` in final reward over the first ``seeds`` seeds at one step of lag
    (docs/study/sweep-staleness-k1), recomputed from the archive with the report's bootstrap."""
    from megatron_mis.testbed.study.stats import paired_differences

    final = _committed_finals("sweep-staleness-k1", summary)
    study = summary["study"]
    return paired_differences({s: final[arm, s] for s in range(seeds)}, {s: final[other, s] for s in range(seeds)},
                              confidence=study["confidence"], resamples=study["bootstrap"])


def _archive_bytes(sweep: str) -> int:
    """The size of docs/study/SWEEP/runs, every file's bytes."""
    return sum(f.stat().st_size for f in (_STUDY_DOCS / sweep / "runs").rglob("*") if f.is_file())


def test_the_one_step_lag_token_and_sequence_mis_figures_come_from_the_archive():
    """docs/study.md and the README on token MIS (120 seeds) and sequence MIS (the first 60) at one
    step of lag, run on the fourth VM in a later session: their differences against none, the
    reference and token TIS (recomputed from the archive), the share of the gap, the tokens and
    sequences they masked (recomputed), collapses, runs that ended low, K3, time per run and the
    archive's size; the answers table's row."""
    summary = _summary("sweep-staleness-k1", ".")
    (dose,) = summary["doses"]
    arms = dose["arms"]
    tmis, smis = arms["token_mis"], arms["sequence_mis"]
    n, m = tmis["n"], smis["n"]
    assert n == 120 and m == 60 and sum(a["n"] for a in arms.values()) == 720
    tmis_tis = _k1_paired(summary, "token_mis", "token_tis", n)
    smis_tis = _k1_paired(summary, "sequence_mis", "token_tis", m)
    assert not tmis_tis["excludes_zero"] and not smis_tis["excludes_zero"]
    t_none, t_ref = tmis["vs_none"]["final_reward"], tmis["vs_reference"]["final_reward"]
    s_none, s_ref = smis["vs_none"]["final_reward"], smis["vs_reference"]["final_reward"]
    assert t_none["low"] > 0 and t_ref["high"] < 0 and s_none["low"] > 0 and s_ref["high"] < 0
    gap = -dose["none_vs_reference"]["mean"]
    shares = [arms[a]["vs_none"]["final_reward"]["mean"] / gap for a in arms if a not in ("none", "ref_fp32",
                                                                                       "bypass_ppo")]
    seq_share = _rejected_share("sequence_mis", "rejected_seq_fraction")
    sweep = {d["label"]: d for d in _summary("sweep-staleness", ".")["doses"]}["k1"]["arms"]
    size = _archive_bytes("sweep-staleness-k1")
    quoted = [
        f"{_quoted(t_none)} against none and {_quoted(t_ref)} against the reference over the same {n} seeds (the "
        f"sweep's 8 seeds had it at {sweep['token_mis']['vs_none']['final_reward']['mean']:+.3f}), about "
        f"{t_none['mean'] / gap:.0%} of the gap; it masked {_rejected_share('token_mis'):.1%} of the loss "
        f"tokens, {tmis['collapse']['k']} of its {n} runs collapsed and {tmis['ended_low']['k']} ended low, mean K3 "
        f"{_e(tmis['k3_mean'][0], 1)}; against token TIS {_quoted(tmis_tis)}",
        f"on the first {m} seeds: {_quoted(s_none)} against none and {_quoted(s_ref)} against the reference; it "
        f"masked {seq_share:.1%} of the sequences, {smis['collapse']['k']} of {m} runs collapsed and "
        f"{smis['ended_low']['k']} ended low; against token TIS on those seeds {_quoted(smis_tis)}",
        f"every IS weight recovers about half of the gap ({min(shares) * 100:.0f}-{max(shares):.0%})",
        f"about {tmis['wall_s']:.0f} s per token MIS run and {smis['wall_s']:.0f} s per sequence MIS run",
        f"({sum(a['n'] for a in arms.values())} runs, {size / 1e6:.1f} MB)",
        f"token MIS {_quoted(t_none)} ({n}), sequence MIS {_quoted(s_none)} ({m}), bypass",
    ]
    _assert_quoted(quoted, _prose(_STUDY_DOCS.parent / "study.md"))
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    assert f"token MIS {_quoted(t_none)} ({n} seeds), sequence MIS {_quoted(s_none)} ({m})" in readme


@functools.cache
def _temperature_run(sweep: str, temperature: float) -> tuple:
    """A rollout-only temperature dose's committed archive and report (docs/study/SWEEP): 60 seeds
    of none, the reference, token TIS and token MIS, checked, and none - reference recomputed as the
    report quotes it and not excluding 0; returns the summary, its dose, the runs, a paired-difference
    function over the final or the greedy reward (each pair bootstrapped once), none's step-1
    gradient norm over the reference's per seed (at equal weights the uncorrected gradient is T
    times the reference's on the first response token: each within 0.01 of T) and the share of
    loss tokens token MIS masked, all recomputed from the archive once per dose (the T = 1.25 test
    reads T = 1.5's too)."""
    import numpy as np

    from megatron_mis.testbed.study.stats import paired_differences

    summary = _summary(sweep, ".")
    (dose,) = summary["doses"]
    setting = dose["setting"]
    assert setting == f"temperature-t{temperature:g}"
    arms = dose["arms"]
    n = arms["none"]["n"]
    core = {"none", "ref_fp32", "token_tis", "token_mis"}
    assert n == 60 and all(arms[a]["n"] == n for a in arms) and core <= set(arms)
    assert set(arms) == core or temperature == 1.5  # T = 1.5 also ran the token TIS diagnostics
    runs = _archive_runs(sweep)
    study = summary["study"]
    final = _committed_finals(sweep, summary)

    @functools.cache
    def paired(arm: str, other: str, key: str = "final_reward") -> dict:
        if key == "final_reward":
            a, b = ({s: final[x, s] for s in range(n)} for x in (arm, other))
        else:
            a, b = ({s: runs[setting, x, s][1]["evaluation"][key] for s in range(n)} for x in (arm, other))
        return paired_differences(a, b, confidence=study["confidence"], resamples=study["bootstrap"])

    none_ref = dose["none_vs_reference"]
    assert _quoted(none_ref) == _quoted(paired("none", "ref_fp32")) and not none_ref["excludes_zero"]
    step1 = [runs[setting, "none", s][0][0]["grad_norm"] / runs[setting, "ref_fp32", s][0][0]["grad_norm"]
             for s in range(n)]
    assert all(abs(r - temperature) < 0.01 for r in step1)
    masked = float(np.mean([np.mean([r["rejected_token_fraction"] for r in runs[setting, "token_mis", s][0]])
                            for s in range(n)]))
    return summary, dose, runs, paired, step1, masked


def _temperature_section(dose: dict) -> str:
    """The prose of the docs/study.md section that reports a temperature dose's 60-seed runs."""
    return _section(f"(`temperature` {dose['setting'].removeprefix('temperature-')}, ")


def _assert_temperature_quotes(summary: dict, dose: dict, runs: dict, paired, step1: list, masked: float,
                               local: list[str], answers: list[str]) -> None:
    """What every temperature section quotes alike (the first six arguments are
    :func:`_temperature_run`'s result): none - reference (final and greedy reward, K3), the paired SD
    and detectable effect, the step-1 gradient-norm ratio, the archive's size and the time per run,
    each in the dose's own section with the section's ``local`` quotes (the sections share
    sentences of this shape, so a figure found in another dose's section must not pass); the dose's
    row in the table that puts the three doses side by side (none - reference, token TIS and token
    MIS against none, token MIS - token TIS, the share token MIS masked, the runs that reached 0.5
    and that ended low per arm); and the ``answers`` quotes in the section with the answers table and
    its summary."""
    local_quotes, row = _temperature_quotes(summary, dose, runs, paired, step1, masked)
    _assert_quoted([*local_quotes, *local], _temperature_section(dose), dose["setting"])
    _assert_quoted([row], _section("the three doses side by side"), dose["setting"])
    _assert_quoted(answers, _section("The answers so far, per mechanism"), dose["setting"])


def _temperature_quotes(summary: dict, dose: dict, runs: dict, paired, step1: list,
                        masked: float) -> tuple[list[str], str]:
    """:func:`_assert_temperature_quotes`' shared figures: the section's sentences and the table row."""
    import numpy as np

    arms, none_ref = dose["arms"], dose["none_vs_reference"]
    n, mde = arms["none"]["n"], summary["minimal_detectable_effect"]
    order = ("none", "ref_fp32", "token_tis", "token_mis")
    row = [dose["setting"].removeprefix("temperature-t"), _e(arms["none"]["k3_mean"][0], 1), _quoted(none_ref),
           *(_quoted(paired(a, b)) for a, b in (("token_tis", "none"), ("token_mis", "none"),
                                               ("token_mis", "token_tis"))),
           f"{masked:.1%}", " / ".join(str(arms[a]["steps_to_threshold"]["reached"]) for a in order),
           " / ".join(str(arms[a]["ended_low"]["k"]) for a in order)]
    return [
        f"none - reference is {_quoted(none_ref)} (final reward {arms['none']['final_reward'][0]:.3f} against "
        f"{arms['ref_fp32']['final_reward'][0]:.3f}; greedy reward after training "
        f"{_quoted(paired('none', 'ref_fp32', 'greedy_reward'))}) at a mean K3 of {_e(arms['none']['k3_mean'][0], 1)}",
        f"The paired SD is {summary['paired_sd']:.3f}, so {n} seeds detect {mde:.3f} and a 0.05 difference needs "
        f"{summary['seeds_for_target']}",
        f"none's gradient norm is {min(step1):.3f} to {max(step1):.3f} of the reference's over the {n} seeds "
        f"(median {np.median(step1):.3f})",
        f"`docs/study/sweep-{dose['setting']}/runs` ({len(runs)} runs, "
        f"{_archive_bytes('sweep-' + dose['setting']) / 1e6:.1f} MB)",
        f"about {np.mean([arms[a]['wall_s'] for a in order]):.0f} s per run",
    ], "| " + " | ".join(row) + " |"


def test_the_rollout_only_temperature_figures_come_from_the_archive():
    """docs/study.md on a rollout-only temperature of 0.5 at 60 seeds
    (docs/study/sweep-temperature-t0.5): none against the reference, token TIS and token MIS against
    none and the reference (final and greedy reward), the paired SD and the seeds a 0.05 difference
    needs, collapses, runs that ended low, K3, the monitor's flags, the tokens token MIS masked, and
    none's step-1 gradient norm over the reference's (the temperature: at equal weights the
    uncorrected gradient is T times the reference's), recomputed from the archive."""
    sweep = "sweep-temperature-t0.5"
    summary, dose, runs, paired, step1, masked = _temperature_run(sweep, 0.5)
    arms = dose["arms"]
    n = arms["none"]["n"]
    none_ref = dose["none_vs_reference"]
    tis, tmis = arms["token_tis"], arms["token_mis"]
    mde = summary["minimal_detectable_effect"]
    tis_greedy = paired("token_tis", "ref_fp32", "greedy_reward")
    assert tis_greedy["excludes_zero"] and tis_greedy["low"] < 0.005  # the one interval that excludes 0, barely
    local = [
        f"{arms['none']['collapse']['k']} of {n} runs of none collapsed and {arms['none']['ended_low']['k']} ended low "
        f"(the reference {arms['ref_fp32']['collapse']['k']} and {arms['ref_fp32']['ended_low']['k']})",
        f"The monitor flagged {arms['none']['monitor_flagged']['k']} of {n} runs of none",
        f"the mean gradient norm over the runs is {arms['none']['grad_norm_mean']:.3f} against the reference's "
        f"{arms['ref_fp32']['grad_norm_mean']:.3f}",
        f"token TIS {_quoted(tis['vs_none']['final_reward'])} against none and "
        f"{_quoted(tis['vs_reference']['final_reward'])} against the reference (on the greedy reward "
        f"{_quoted(tis_greedy)}",
        f"token MIS {_quoted(tmis['vs_none']['final_reward'])} against none and "
        f"{_quoted(tmis['vs_reference']['final_reward'])} against the reference, masking {masked:.1%} of the loss "
        f"tokens, {tmis['collapse']['k']} of its {n} runs collapsed and {tmis['ended_low']['k']} ended low",
        f"token MIS - token TIS {_quoted(paired('token_mis', 'token_tis'))}",
    ]
    answers = [
        f"(+{none_ref['mean']:.3f} [{none_ref['low']:+.3f}, {none_ref['high']:+.3f}] at 0.5, {n} seeds; MDE {mde:.3f};",
        f"at 0.5 on an AVX2 VM's seeds no correction differs from none (token TIS "
        f"{_quoted(tis['vs_none']['final_reward'])}, token MIS {_quoted(tmis['vs_none']['final_reward'])}, {n} seeds)",
    ]
    _assert_temperature_quotes(summary, dose, runs, paired, step1, masked, local, answers)
    from megatron_mis.analysis.recommend import recommend

    # analyze's advice for a two-sided K3 this large quotes the same figures
    rec = recommend(arms["none"]["k3_mean"][0], 3, share_ratio_above=0.102)
    assert rec.regime == "config-bug" and "sweep-temperature-t0.5" in rec.basis
    assert (f"at T 0.5 (K3 {arms['none']['k3_mean'][0]:.2f}, {n} seeds) none - reference {_quoted(none_ref)}, "
            f"token MIS {_quoted(tmis['vs_none']['final_reward'])} against none") in " ".join(rec.reason.split())


def test_the_rollout_temperature_above_1_figures_come_from_the_archive():
    """docs/study.md and ``analyze`` on a rollout-only temperature of 1.5 at 60 seeds
    (docs/study/sweep-temperature-t1.5): none level with the reference, token TIS and token MIS
    measurably behind none (final reward), token MIS behind token TIS, the tokens token MIS masked,
    the step-1 gradient-norm ratio (T), recomputed from the archive; and token MIS - token TIS at
    one step of lag (docs/study/sweep-staleness-k1), which analyze's config-bug advice quotes."""
    from megatron_mis.analysis.recommend import recommend

    summary, dose, runs, paired, step1, masked = _temperature_run("sweep-temperature-t1.5", 1.5)
    arms = dose["arms"]
    n = arms["none"]["n"]
    none_ref = dose["none_vs_reference"]
    tis, tmis = paired("token_tis", "none"), paired("token_mis", "none")
    mis_tis = paired("token_mis", "token_tis")
    assert tis["excludes_zero"] and tmis["excludes_zero"] and mis_tis["excludes_zero"] and mis_tis["high"] < 0
    assert _quoted(tis) == _quoted(arms["token_tis"]["vs_none"]["final_reward"])
    k1_mis_tis = _k1_paired(_summary("sweep-staleness-k1", "."), "token_mis", "token_tis", 120)
    mde = summary["minimal_detectable_effect"]
    reached = {a: arms[a]["steps_to_threshold"]["reached"] for a in arms}
    local = [
        f"token TIS {_quoted(tis)} against none ({_quoted(paired('token_tis', 'ref_fp32'))} against the reference; "
        f"greedy reward {_quoted(paired('token_tis', 'none', 'greedy_reward'))})",
        f"token MIS {_quoted(tmis)} against none ({_quoted(paired('token_mis', 'ref_fp32'))} against the reference; "
        f"greedy reward {_quoted(paired('token_mis', 'none', 'greedy_reward'))}), masking {masked:.1%} of the loss "
        f"tokens",
        f"token MIS - token TIS {_quoted(mis_tis)}",
        f"{reached['none']} of {n} runs of none reached a 10-step mean reward of 0.5, {reached['ref_fp32']} of the "
        f"reference's, {reached['token_tis']} of token TIS's and {reached['token_mis']} of token MIS's",
        f"{arms['token_mis']['collapse']['k']} of token MIS's runs collapsed and {arms['token_mis']['ended_low']['k']} "
        f"ended low (none {arms['none']['collapse']['k']} and {arms['none']['ended_low']['k']})",
        f"at one step of lag token MIS - token TIS is {_quoted(k1_mis_tis)} (120 seeds)",
    ]
    answers = [
        f"{_quoted(none_ref)} at 1.5, {n} seeds; MDE {mde:.3f})",
        f"{_quoted(tis)} at 1.5 against none, {n} seeds each) and token MIS at 1.5 ({_quoted(tmis)})",
    ]
    _assert_temperature_quotes(summary, dose, runs, paired, step1, masked, local, answers)
    rec = recommend(arms["none"]["k3_mean"][0], 3, share_ratio_above=0.298)
    reason = " ".join(rec.reason.split())
    assert rec.regime == "config-bug" and rec.correction == "token_tis" and "sweep-temperature-t1.5" in rec.basis
    assert (f"token MIS - token TIS was {_quoted(k1_mis_tis)} at one step of lag and {_quoted(mis_tis)} at a rollout "
            "temperature of 1.5") in reason
    assert (f"at T 1.5 (K3 {arms['none']['k3_mean'][0]:.3f}, {n} seeds) none - reference {_quoted(none_ref)}, where "
            f"token TIS cost {_quoted(tis)} and token MIS {_quoted(tmis)} against none (masking {masked:.0%}") in reason


def test_the_rollout_temperature_of_1_25_figures_come_from_the_archive():
    """docs/study.md on a rollout-only temperature of 1.25 at 60 seeds
    (docs/study/sweep-temperature-t1.25): none level with the reference, token TIS measurably
    behind none but not the reference, token MIS not resolved either way, the tokens token MIS
    masked, the smallest and largest token TIS weights against T = 1.5's, the step-1 gradient-norm
    ratio (T), its row of the three doses' table; the summary sentences that quote 1.25 and 1.5
    together; and analyze's advice at the K3 and two-sided share its dump gave, all recomputed
    from the archives."""
    import numpy as np

    from megatron_mis.analysis.recommend import recommend

    sweep = "sweep-temperature-t1.25"
    summary, dose, runs, paired, step1, masked = _temperature_run(sweep, 1.25)
    arms = dose["arms"]
    n = arms["none"]["n"]
    none_ref = dose["none_vs_reference"]
    tis, tmis, mis_tis = paired("token_tis", "none"), paired("token_mis", "none"), paired("token_mis", "token_tis")
    tis_ref = paired("token_tis", "ref_fp32")
    assert tis["excludes_zero"] and tis["high"] < 0 and not tis_ref["excludes_zero"]
    assert not tmis["excludes_zero"] and not mis_tis["excludes_zero"]
    assert _quoted(tis) == _quoted(arms["token_tis"]["vs_none"]["final_reward"])
    reached = {a: arms[a]["steps_to_threshold"]["reached"] for a in arms}
    collapses = sum(a["collapse"]["k"] for a in arms.values())
    _, dose15, runs15, paired15, _, masked15 = _temperature_run("sweep-temperature-t1.5", 1.5)

    def weights(setting: str, arm_runs: dict) -> tuple:
        """Over token TIS's runs: the mean of a step's smallest weight, the largest ratio seen, and
        the range of the per-run mean weight."""
        tis_runs = [arm_runs[setting, "token_tis", s][0] for s in range(n)]
        smallest = np.mean([np.mean([r["is_weight_min"] for r in recs]) for recs in tis_runs])
        largest = max(r["mis_ratio_max"] for recs in tis_runs for r in recs)
        means = [np.mean([r["is_weight_mean"] for r in recs]) for recs in tis_runs]
        return smallest, largest, min(means), max(means)

    w, w15 = weights(dose["setting"], runs), weights(dose15["setting"], runs15)
    tis15 = paired15("token_tis", "none")
    local = [
        f"token TIS {_quoted(tis)} against none ({_quoted(tis_ref)} against the reference; greedy reward "
        f"{_quoted(paired('token_tis', 'none', 'greedy_reward'))}): a cost of the same size as at T = 1.5 "
        f"({tis15['mean']:+.3f})",
        f"Token MIS is not resolved here: {_quoted(tmis)} against none, masking {masked:.1%} of the loss tokens "
        f"({masked15:.1%} at T = 1.5), and token MIS - token TIS {_quoted(mis_tis)}",
        f"{reached['none']} of {n} runs of none reached a 10-step mean reward of 0.5, {reached['ref_fp32']} of the "
        f"reference's, {reached['token_tis']} of token TIS's and {reached['token_mis']} of token MIS's",
        f"the smallest token TIS weight of a step averaged {w[0]:.2f} ({w15[0]:.2f} at T = 1.5), the largest ratio "
        f"{w[1]:.2f} ({w15[1]:.2f}), and the weight's mean per run {w[2]:.3f}-{w[3]:.3f}",
    ]
    assert collapses == 0  # "no run of any arm collapsed"
    answers = [
        f"{_quoted(none_ref)} at 1.25, {n} seeds; MDE {summary['minimal_detectable_effect']:.3f}",
        f"above 1 token TIS costs reward ({_quoted(tis)} at 1.25, {_quoted(tis15)} at 1.5 against none, {n} seeds "
        "each) and token MIS at 1.5",
        f"at T = 1.25 and 1.5 token TIS cost {-tis['mean']:.3f} and {-tis15['mean']:.3f}",
    ]
    _assert_temperature_quotes(summary, dose, runs, paired, step1, masked, local, answers)
    # seed 0's dump: mean K3 0.024, 20.7% of the tokens at a ratio of 1.12 or more (docs/study.md)
    rec = recommend(0.0238, 3, share_ratio_above=0.207)
    assert rec.regime == "config-bug" and rec.correction == "token_tis"


#: The token TIS diagnostics run at T = 1.5 (docs/study.md, "What of the token TIS weight costs reward").
_DIAGNOSTICS = ("token_tis_floor1", "token_tis_cap1", "token_tis_shuffled")
#: the two diagnostics of the zero-sum account, run a session after the three
_GROUP_DIAGNOSTICS = ("token_tis_group_mean", "token_tis_balanced")
#: the group mean's placebo, run a session after them (docs/study.md, "A placebo and a null arm")
_PLACEBO = "token_tis_group_permuted"
#: every arm of the T = 1.5 report made on the Zen 1 VM (the others on a Zen 3 one)
_ZEN1_ARMS = (*_DIAGNOSTICS, *_GROUP_DIAGNOSTICS, _PLACEBO)


def _weight_extremes(setting: str, runs: dict, arm: str, n: int, first: int = 0) -> tuple[float, float, float, float]:
    """Over ``arm``'s runs of seeds ``first`` .. ``first + n - 1``: the mean of a step's smallest and of
    its largest weight, and the range of the per-run mean weight."""
    import numpy as np

    recs = [runs[setting, arm, s][0] for s in range(first, first + n)]
    means = [np.mean([r["is_weight_mean"] for r in rs]) for rs in recs]
    return (float(np.mean([np.mean([r["is_weight_min"] for r in rs]) for rs in recs])),
            float(np.mean([np.mean([r["is_weight_max"] for r in rs]) for rs in recs])), min(means), max(means))


def _diagnostic_row(arm: str, formula: str, extremes: tuple, arms: dict, paired) -> str:
    """A row of the T = 1.5 diagnostics' tables: the arm, its weight, its weights' mean smallest and
    largest value (``extremes``: :func:`_weight_extremes`) and per-run mean, its final reward against
    none, token TIS and the reference, its greedy reward against none, and the runs that reached 0.5
    and that ended low."""
    lo, hi, m_lo, m_hi = extremes
    return "| " + " | ".join([
        f"`{arm}`", formula, f"{lo:.2f} / {hi:.2f}", f"{m_lo:.3f}-{m_hi:.3f}", _quoted(paired(arm, "none")),
        "-" if arm == "token_tis" else _quoted(paired(arm, "token_tis")), _quoted(paired(arm, "ref_fp32")),
        _quoted(paired(arm, "none", "greedy_reward")), str(arms[arm]["steps_to_threshold"]["reached"]),
        str(arms[arm]["ended_low"]["k"])]) + " |"


def test_the_token_tis_diagnostics_at_1_5_come_from_the_archive():
    """docs/study.md on the three token TIS diagnostics at a rollout temperature of
    1.5 (60 seeds each, beside the committed arms in docs/study/sweep-temperature-t1.5): each arm's
    row of the section's table (its weights' mean smallest and largest value and per-run mean, its
    difference to none, token TIS and the reference in final reward and to none in greedy reward,
    the runs that reached 0.5 and that ended low), the differences between the diagnostics, and
    that none of the three is resolved against none or against token TIS, recomputed from the
    archive; the runs were made on a Zen 1 VM, the other arms on a Zen 3 one."""
    import numpy as np

    summary, dose, runs, paired, _, _ = _temperature_run("sweep-temperature-t1.5", 1.5)
    arms, setting = dose["arms"], dose["setting"]
    n = arms["none"]["n"]
    assert set(_DIAGNOSTICS) <= set(arms)
    headers = _archive_headers("sweep-temperature-t1.5")
    machines = {a: {headers[setting, a, s]["machine"]["cpu_family_model"] for s in range(n)} for a in arms}
    assert all(machines[a] == {"23/1"} for a in _ZEN1_ARMS), machines  # the Zen 1 VM
    assert all(machines[a] == {"25/1"} for a in set(arms) - set(_ZEN1_ARMS)), machines  # Zen 3
    formulas = {"token_tis": "min(r, 2)", "token_tis_floor1": "clamp(r, 1, 2)", "token_tis_cap1": "min(r, 1)",
                "token_tis_shuffled": "min(r, 2), shuffled"}
    extremes = {arm: _weight_extremes(setting, runs, arm, n) for arm in formulas}
    rows = [_diagnostic_row(arm, formula, extremes[arm], arms, paired) for arm, formula in formulas.items()]
    costs = {arm: paired(arm, "none") for arm in formulas}
    for arm in _DIAGNOSTICS:  # "none of the three is resolved against none or token TIS" on the final reward
        assert not costs[arm]["excludes_zero"] and not paired(arm, "token_tis")["excludes_zero"], arm
        assert 0.5 < costs[arm]["mean"] / costs["token_tis"]["mean"] < 0.8, arm  # "about two thirds"
    shuffled_greedy = paired("token_tis_shuffled", "none", "greedy_reward")
    assert costs["token_tis"]["excludes_zero"] and shuffled_greedy["excludes_zero"]
    pairs = [("token_tis_floor1", "token_tis_cap1"), ("token_tis_shuffled", "token_tis_floor1"),
             ("token_tis_shuffled", "token_tis_cap1")]
    assert not any(paired(a, b)["excludes_zero"] for a, b in pairs)
    steps = {a: arms[a]["vs_reference"]["steps_to_threshold"] for a in _DIAGNOSTICS}
    collapsed = {a: arms[a]["collapse"]["k"] for a in ("token_tis", *_DIAGNOSTICS)}
    assert collapsed == {"token_tis": 0, "token_tis_floor1": 0, "token_tis_cap1": 0, "token_tis_shuffled": 1}
    cost_means = [costs[a]["mean"] for a in _DIAGNOSTICS]
    quoted = [
        *rows,
        *(f"{a} - {b} {_quoted(paired(a, b))}" for a, b in pairs),
        f"(none: {arms['none']['steps_to_threshold']['reached']} of {n} runs reached a 10-step mean reward of 0.5, "
        f"{arms['none']['ended_low']['k']} ended low)",
        f"each ends about two thirds of token TIS's cost behind none ({max(cost_means):+.3f} to "
        f"{min(cost_means):+.3f}), level with token TIS "
        f"({min(paired(a, 'token_tis')['mean'] for a in _DIAGNOSTICS):+.3f} to "
        f"{max(paired(a, 'token_tis')['mean'] for a in _DIAGNOSTICS):+.3f})",
        f"on the greedy reward the shuffled weights are ({_quoted(shuffled_greedy)})",
        f"(+{steps['token_tis_cap1']['mean']:.0f} [{steps['token_tis_cap1']['low']:+.0f}, "
        f"{steps['token_tis_cap1']['high']:+.0f}] and +{steps['token_tis_shuffled']['mean']:.0f} "
        f"[{steps['token_tis_shuffled']['low']:+.0f}, {steps['token_tis_shuffled']['high']:+.0f}] steps over the "
        f"{steps['token_tis_cap1']['n']} seeds where both did; the floor +{steps['token_tis_floor1']['mean']:.0f} "
        f"[{steps['token_tis_floor1']['low']:+.0f}, {steps['token_tis_floor1']['high']:+.0f}])",
        f"the floor's weights vary least (1 to {extremes['token_tis_floor1'][1]:.2f} against "
        f"{extremes['token_tis'][0]:.2f} to {extremes['token_tis'][1]:.2f})",
        f"mean weights ({extremes['token_tis_floor1'][2]:.2f}-{extremes['token_tis_floor1'][3]:.2f} and "
        f"{extremes['token_tis_cap1'][2]:.2f}-{extremes['token_tis_cap1'][3]:.2f} per run)",
        f"about {np.mean([arms[a]['wall_s'] for a in _DIAGNOSTICS]):.0f} s per run, "
        f"{sum(arms[a]['n'] * arms[a]['wall_s'] for a in _DIAGNOSTICS) / 3600:.1f} CPU-hours",
        f"token TIS's cost there ({costs['token_tis']['mean']:+.3f} against none)",
    ]
    assert steps["token_tis_cap1"]["n"] == steps["token_tis_shuffled"]["n"]
    _assert_quoted(quoted, _section("What of the token TIS weight costs reward at T = 1.5"))
    # the T = 1.5 section's account says it was tested and is not supported
    assert "tested a day later, it is not supported" in _temperature_section(dose)


def _zero_sum_quotes() -> list[str]:
    """The figures of docs/study.md's "The zero-sum account tested" section, recomputed from the
    T = 1.5 archive (:func:`test_the_zero_sum_diagnostics_at_1_5_come_from_the_archive`)."""
    import numpy as np

    summary, dose, runs, paired, _, _ = _temperature_run("sweep-temperature-t1.5", 1.5)
    arms, setting = dose["arms"], dose["setting"]
    n = arms["none"]["n"]
    assert all(arms[a]["n"] == n for a in _GROUP_DIAGNOSTICS)
    formulas = {"token_tis": "min(r, 2)", "token_tis_group_mean": "min(r, 2), its group's mean",
                "token_tis_balanced": "min(r, 2), first tokens balanced"}
    extremes = {arm: _weight_extremes(setting, runs, arm, n) for arm in formulas}
    rows = [_diagnostic_row(arm, formula, extremes[arm], arms, paired) for arm, formula in formulas.items()]
    gm, bal = "token_tis_group_mean", "token_tis_balanced"
    five = (*_DIAGNOSTICS, *_GROUP_DIAGNOSTICS)
    # the group mean alone is resolved against none; nothing is against token TIS or between the five
    assert [a for a in five if paired(a, "none")["excludes_zero"]] == [gm]
    assert not any(paired(a, "token_tis")["excludes_zero"] for a in _GROUP_DIAGNOSTICS)
    between = [paired(a, b) for a in _GROUP_DIAGNOSTICS for b in _DIAGNOSTICS] + [paired(gm, bal)]
    assert not any(d["excludes_zero"] for d in between)
    spread = max(abs(d["mean"]) for d in between)
    steps = arms[gm]["vs_reference"]["steps_to_threshold"]
    assert steps["excludes_zero"]
    grads = {a: arms[a]["grad_norm_mean"] for a in ("none", "token_tis", *five)}
    costs = [paired(a, "none")["mean"] for a in five]
    lo, hi = extremes[gm][:2]
    per_token = [_weight_extremes(setting, runs, a, n) for a in five if a != gm]
    first = {a: [next(i + 1 for i, (x, y) in enumerate(zip(runs[setting, a, s][0], runs[setting, "none", s][0]))
                      if x["reward_mean"] != y["reward_mean"]) for s in range(n)] for a in five}
    assert min(min(f) for f in first.values()) == 2  # every arm shares step 1 (its rollout) with none
    flagged = arms[gm]["monitor_flagged"]["k"]
    assert flagged < n == arms["none"]["monitor_flagged"]["k"]
    return [
        *rows,
        f"Weights constant within each group cost {_quoted(paired(gm, 'none'))} against none",
        f"reached 0.5 later than the reference (+{steps['mean']:.0f} [{steps['low']:+.0f}, {steps['high']:+.0f}] "
        f"steps over the {steps['n']} seeds where both did)",
        f"The balanced arm cost {_quoted(paired(bal, 'none'))}, not resolved",
        f"Against token TIS they are {_quoted(paired(gm, 'token_tis'))} and {_quoted(paired(bal, 'token_tis'))}, "
        f"against each other {_quoted(paired(gm, bal))}, against the three diagnostics above within "
        f"+-{spread:.3f} (none resolved)",
        f"their weights range from {min(e[0] for e in per_token):.2f} to {max(e[1] for e in per_token):.2f} per "
        f"token or from {lo:.2f} to {hi:.2f} per group",
        f"their mean gradient norms run from {min(grads[a] for a in five):.2f} to {max(grads[a] for a in five):.2f} "
        f"(none {grads['none']:.2f}, token TIS {grads['token_tis']:.2f})",
        f"each ends {-max(costs):.3f} to {-min(costs):.3f} behind none at {n} seeds",
        f"a group weight within {max(1 - lo, hi - 1):.0%} of 1 included",
        f"between steps 2 and {max(max(f) for f in first.values())} (median {np.median(first[gm]):.0f} for the group "
        f"mean)",
        f"the group mean's K3 is {_e(arms[gm]['k3_mean'][0], 1)} (none's {_e(arms['none']['k3_mean'][0], 1)}), and the "
        f"monitor flagged {flagged} of its {n} runs on it",
        f"about {np.mean([arms[a]['wall_s'] for a in _GROUP_DIAGNOSTICS]):.0f} s per run "
        f"(the VM ran slower than in the session before), "
        f"{sum(arms[a]['n'] * arms[a]['wall_s'] for a in _GROUP_DIAGNOSTICS) / 3600:.1f} CPU-hours",
    ]


def test_the_zero_sum_diagnostics_at_1_5_come_from_the_archive():
    """docs/study.md on the two diagnostics of the zero-sum account at a rollout temperature of 1.5
    (60 seeds each, the Zen 1 VM, beside the other arms in docs/study/sweep-temperature-t1.5): each
    arm's row (weights' extremes and per-run mean, final reward against none, token TIS and the
    reference, greedy reward against none, runs that reached 0.5 and ended low), which differences
    are resolved, the group mean's take-off delay, what the five diagnostics share (their gradient
    norms, their costs, the step their batch reward first leaves none's), the K3 the engine reports
    for the rewritten pairs and the time the runs took, all recomputed from the archive."""
    _assert_quoted(_zero_sum_quotes(), _section("The zero-sum account tested"))
    assert "tested in the next section and not supported" in _section("What of the token TIS weight costs reward")


#: The arms of docs/study/sweep-temperature-t1.5/seeds-100, every one at seeds 0-99: none and token TIS
#: (seeds 60-99 added 2026-12-01), then the group mean, its placebo and the shuffled weights (2026-12-02).
_HUNDRED_SEED_ARMS = ("none", "token_tis", "token_tis_group_mean", "token_tis_group_permuted", "token_tis_shuffled")


def _paired_over(final: dict, runs: dict, setting: str, study: dict, default_seeds: range):
    """A paired-difference function ``paired(arm, other, seeds, key, comparisons)`` over a report's
    runs (``final``: :func:`_committed_finals`, ``runs``: :func:`_archive_runs`), the final or the
    greedy reward on ``seeds`` (default ``default_seeds``), each computed once; ``comparisons`` > 1:
    the interval Bonferroni-corrected for that many (confidence 1 - (1 - the report's) / comparisons,
    the report's bootstrap)."""
    from megatron_mis.testbed.study.stats import paired_differences

    @functools.cache
    def paired(arm: str, other: str, seeds: range = default_seeds, key: str = "final_reward",
               comparisons: int = 1) -> dict:
        if key == "final_reward":
            a, b = ({s: final[x, s] for s in seeds} for x in (arm, other))
        else:
            a, b = ({s: runs[setting, x, s][1]["evaluation"][key] for s in seeds} for x in (arm, other))
        return paired_differences(a, b, confidence=1 - (1 - study["confidence"]) / comparisons,
                                  resamples=study["bootstrap"])

    return paired


@functools.cache
def _hundred_seeds() -> tuple:
    """The 100-seed report at T = 1.5 (docs/study/sweep-temperature-t1.5/seeds-100) and its archive:
    the dose's arms, every run's final reward, the runs, the setting and a paired-difference function
    ``paired(arm, other, seeds, key, comparisons)`` over the final or the greedy reward (each computed
    once); the report's arms are checked to be :data:`_HUNDRED_SEED_ARMS` at 100 seeds, its vs-none
    differences to be the recomputed ones, and seeds 60-99 to come from the Zen 1 VM."""
    summary = _summary("sweep-temperature-t1.5", "seeds-100")
    (dose,) = summary["doses"]
    arms, study = dose["arms"], summary["study"]
    assert sorted(arms) == sorted(_HUNDRED_SEED_ARMS) and all(arms[a]["n"] == 100 for a in arms)
    final = _committed_finals("sweep-temperature-t1.5", summary)
    runs = _archive_runs("sweep-temperature-t1.5")
    headers = _archive_headers("sweep-temperature-t1.5")
    setting = dose["setting"]
    assert {headers[setting, a, s]["machine"]["cpu_family_model"] for a in arms for s in range(60, 100)} == {"23/1"}
    paired = _paired_over(final, runs, setting, study, range(100))
    for arm in _HUNDRED_SEED_ARMS[1:]:
        assert _quoted(paired(arm, "none")) == _quoted(arms[arm]["vs_none"]["final_reward"]), arm
    return arms, final, runs, setting, paired


def _fresh_seed_quotes() -> tuple[list[str], str, str]:
    """The figures of docs/study.md's section on token TIS against none at T = 1.5 over 100 seeds
    (seeds 60-99 of none and token TIS added to the archive's 60; :func:`_hundred_seeds`),
    recomputed from the archive: the 100-seed report's difference, the 40 new seeds' own and each
    block's mean final reward per arm; with the new seeds' and the 100 seeds' token TIS - none as
    quoted."""
    import numpy as np

    arms, final, runs, setting, paired = _hundred_seeds()
    whole, fresh = paired("token_tis", "none"), paired("token_tis", "none", range(60, 100))
    first = paired("token_tis", "none", range(60))
    assert _quoted(first) == _quoted(_summary("sweep-temperature-t1.5", ".")["doses"][0]["arms"]["token_tis"]["vs_none"]
                                      ["final_reward"])
    assert whole["excludes_zero"] and fresh["excludes_zero"]
    blocks = {0: range(60), 60: range(60, 100)}
    mean = {(a, lo): float(np.mean([final[a, s] for s in seeds])) for a in ("none", "token_tis")
            for lo, seeds in blocks.items()}
    wall = [runs[setting, a, s][1]["wall_s"] for a in ("none", "token_tis") for s in range(60, 100)]
    return [
        f"and token TIS {-first['mean']:.3f} behind, all against the same 60 runs of none",
        f"token TIS - none is {_quoted(fresh)} over the 40 new seeds alone",
        f"{_quoted(whole)} over all 100 (greedy reward {_quoted(paired('token_tis', 'none', key='greedy_reward'))})",
        f"none's mean final reward was {mean['none', 0]:.3f} on seeds 0-59 and {mean['none', 60]:.3f} on seeds "
        f"60-99, token TIS's {mean['token_tis', 0]:.3f} and {mean['token_tis', 60]:.3f}",
        f"{arms['none']['steps_to_threshold']['reached']} of 100 runs of none and "
        f"{arms['token_tis']['steps_to_threshold']['reached']} of token TIS's reached 0.5, and "
        f"{arms['none']['collapse']['k']} and {arms['token_tis']['collapse']['k']} collapsed",
        f"about {np.mean(wall):.0f} s per run, {sum(wall) / 3600:.1f} CPU-hours",
    ], _quoted(fresh), _quoted(whole)


def test_the_token_tis_cost_at_1_5_on_100_seeds_comes_from_the_archive():
    """docs/study.md on token TIS against none at a rollout temperature of 1.5 over
    100 seeds (the 60 of the archive's report and 40 new ones, the Zen 1 VM): the new seeds' own
    difference, the 100-seed one and each block's means, recomputed from the archive."""
    quotes, fresh, whole = _fresh_seed_quotes()
    _assert_quoted(quotes, _section("Token TIS against none at T = 1.5 on 40 more seeds"))
    paired = _temperature_run("sweep-temperature-t1.5", 1.5)[3]
    gm, bal = (_quoted(paired(a, "none")) for a in _GROUP_DIAGNOSTICS)
    _assert_quoted([f"token TIS's cost held on 40 new seeds, {whole} over 100",
                    f"or made constant within each GRPO group; token TIS's own cost held over 100 seeds, {whole}, "
                    f"and group weights independent of the samples"],
                   _section("The answers so far, per mechanism"))


def _hundred_seed_row(arm: str, paired, final: dict, reached: int) -> str:
    """A row of docs/study.md's 100-seed table at T = 1.5: the arm's final reward - none on seeds
    0-59, on seeds 60-99 and on all 100, - token TIS over 100, greedy reward - none over 100, its mean
    final reward on each block and the runs that reached 0.5."""
    import numpy as np

    blocks = (range(60), range(60, 100))
    means = " / ".join(f"{np.mean([final[arm, s] for s in seeds]):.3f}" for seeds in blocks)
    return "| " + " | ".join([
        f"`{arm}`", *(_quoted(paired(arm, "none", seeds)) for seeds in (*blocks, range(100))),
        "-" if arm == "token_tis" else _quoted(paired(arm, "token_tis")),
        _quoted(paired(arm, "none", key="greedy_reward")), means, str(reached)]) + " |"


def _placebo_quotes() -> list[str]:
    """The figures of docs/study.md's "A placebo and a null arm" section, recomputed from the T = 1.5
    archive: the placebo's row at 60 seeds (:func:`_diagnostic_row`) and its weights beside the group
    mean's, the 100-seed table (:func:`_hundred_seed_row`) and the differences the prose quotes,
    which of them are resolved, and the runs' times."""
    import numpy as np

    _, dose, runs60, paired60, _, _ = _temperature_run("sweep-temperature-t1.5", 1.5)
    arms60, setting = dose["arms"], dose["setting"]
    gm, pl, sh = "token_tis_group_mean", _PLACEBO, "token_tis_shuffled"
    extremes = {a: _weight_extremes(setting, runs60, a, 60) for a in (gm, pl)}
    row60 = _diagnostic_row(pl, "min(r, 2), another group's mean", extremes[pl], arms60, paired60)
    arms, final, runs, _, paired = _hundred_seeds()
    rows = [_hundred_seed_row(a, paired, final, arms[a]["steps_to_threshold"]["reached"])
            for a in _HUNDRED_SEED_ARMS[1:]]
    fresh = range(60, 100)
    # resolved at 100 seeds: every weighted arm against none; the placebo against neither token TIS nor
    # the group mean; the group mean above token TIS
    assert all(paired(a, "none")["excludes_zero"] for a in (pl, gm, "token_tis"))
    assert not paired(pl, "token_tis")["excludes_zero"] and not paired(pl, gm)["excludes_zero"]
    assert paired(gm, "token_tis")["excludes_zero"] and paired(pl, gm, fresh)["excludes_zero"]
    assert not paired60(pl, "none")["excludes_zero"] and not paired60(pl, gm)["excludes_zero"]
    assert not paired(sh, "none")["excludes_zero"] and paired(sh, "token_tis")["excludes_zero"]
    # "no weight tried ended above none": every weighted arm of both reports, against none
    assert all(paired60(a, "none")["mean"] < 0 for a in arms60 if a not in ("none", "ref_fp32"))
    assert all(paired(a, "none")["mean"] < 0 for a in _HUNDRED_SEED_ARMS[1:])
    # about ten comparisons: with Bonferroni's correction (99.5% intervals) two still exclude 0, two do not
    strict = {(a, b): paired(a, b, comparisons=10) for a, b in ((pl, "none"), ("token_tis", "none"),
                                                                (gm, "token_tis"), (sh, "token_tis"))}
    assert [k for k, d in strict.items() if d["excludes_zero"]] == [(pl, "none"), ("token_tis", "none")]
    swing = {a: paired(a, "none", range(60))["mean"] - paired(a, "none", fresh)["mean"] for a in (gm, pl, sh)}
    assert max(swing, key=lambda a: abs(swing[a])) == pl
    wall60 = [runs60[setting, pl, s][1]["wall_s"] for s in range(60)]
    wall_fresh = [runs[setting, a, s][1]["wall_s"] for a in (gm, pl) for s in fresh]
    wall_shuffled = [runs[setting, sh, s][1]["wall_s"] for s in fresh]
    lo, hi = extremes[pl][:2]
    return [
        row60,
        f"Its weights run from {lo:.2f} to {hi:.2f} per group, the group mean's from {extremes[gm][0]:.2f} to "
        f"{extremes[gm][1]:.2f}",
        f"at 60 seeds the placebo cost {_quoted(paired60(pl, 'none'))} against none, not resolved, and "
        f"{_quoted(paired60(pl, gm))} against the group mean",
        f"its mean gradient norm was {arms60[pl]['grad_norm_mean']:.2f} (none {arms60['none']['grad_norm_mean']:.2f}, "
        f"the group mean {arms60[gm]['grad_norm_mean']:.2f})",
        *rows,
        f"**The placebo costs reward**: {_quoted(paired(pl, 'none'))} against none over 100 seeds (greedy reward "
        f"{_quoted(paired(pl, 'none', key='greedy_reward'))})",
        f"level with token TIS ({_quoted(paired(pl, 'token_tis'))}) and with the group mean "
        f"({_quoted(paired(pl, gm))})",
        f"The group mean's cost holds at 100 seeds and is smaller: {_quoted(paired(gm, 'none'))} against none, "
        f"above token TIS ({_quoted(paired(gm, 'token_tis'))}). The shuffled weights cost "
        f"{_quoted(paired(sh, 'none'))}, also above token TIS ({_quoted(paired(sh, 'token_tis'))})",
        f"the placebo against none, {_quoted(strict[pl, 'none'])}",
        f"token TIS against none, {_quoted(strict['token_tis', 'none'])}",
        f"The group mean and the shuffled weights against token TIS do not: {_quoted(strict[gm, 'token_tis'])} and "
        f"{_quoted(strict[sh, 'token_tis'])}",
        f"about {(paired(gm, 'token_tis')['mean'] + paired(sh, 'token_tis')['mean']) / 2:.3f}. This is resolved per "
        f"comparison but not after the correction",
        f"On the new seeds alone the placebo fell {_quoted(paired(pl, gm, fresh))} behind the group mean",
        f"one arm's difference to none moved by up to {max(abs(v) for v in swing.values()):.3f} (the placebo's)",
        f"Group weights within about {max(1 - lo, hi - 1):.0%} of 1 that carry nothing",
        f"a mean-1 factor within {max(1 - lo, hi - 1):.0%} of 1 per group would cost "
        f"{-paired(gm, 'none')['mean']:.2f}-{-paired(pl, 'none')['mean']:.2f} reward",
        f"(none's {np.mean([final['none', s] for s in range(60)]):.3f} and "
        f"{np.mean([final['none', s] for s in fresh]):.3f}) and the runs that reached 0.5 "
        f"(none's {arms['none']['steps_to_threshold']['reached']})",
        f"about {np.mean(wall60):.0f} s per run, {sum(wall60) / 3600:.1f} CPU-hours",
        f"80 runs, about {np.mean(wall_fresh):.0f} s per run, {sum(wall_fresh) / 3600:.1f} CPU-hours",
        f"40 runs, about {np.mean(wall_shuffled):.0f} s per run, {sum(wall_shuffled) / 3600:.1f} CPU-hours",
    ]


def test_the_placebo_at_1_5_comes_from_the_archive():
    """docs/study.md on the group mean's placebo at a rollout temperature of 1.5 (60 seeds beside the
    other diagnostics in the archive's report, then 100 seeds of it, the group mean and the shuffled
    weights in the seeds-100 report, the Zen 1 VM): its row, its weights beside the group mean's, the
    100-seed table, which differences are resolved and the runs' times, recomputed from the archive;
    and the section above names it as the next test."""
    _assert_quoted(_placebo_quotes(), _section("A placebo and a null arm"))
    assert "The next section runs that placebo" in _section("Token TIS against none at T = 1.5 on 40 more seeds")
    paired = _hundred_seeds()[4]
    placebo = _quoted(paired(_PLACEBO, "none"))
    gm, sh = (paired(a, "none")["mean"] for a in ("token_tis_group_mean", "token_tis_shuffled"))
    _assert_quoted([f"a placebo, group weights independent of the samples, cost {placebo} over 100 on a Zen 1 VM, "
                    f"but on 100 new seeds of an Intel VM",
                    f"group weights independent of the samples, a placebo, cost {placebo} over 100 seeds while weights "
                    f"of exactly 1 repeat none bit for bit; over 100 seeds the group mean and the shuffled weights "
                    f"cost {gm:+.3f} and {sh:+.3f};"], _section("The answers so far, per mechanism"))


#: The arms of docs/study/sweep-temperature-t1.5/noise-dose, every one at seeds 100-199 on an Intel VM
#: (2026-12-02): none, token TIS, the placebo and the placebo's weights raised to the powers 1/2 and 2.
_NOISE_DOSES = {"none": 0.0, "token_tis_group_permuted_half": 0.5, _PLACEBO: 1.0,
                "token_tis_group_permuted_double": 2.0}
_NOISE_SEEDS = range(100, 200)


#: The machines of the T = 1.5 reports made on one VM each: ``(cpu family/model, torch's kernels)`` of the run headers.
_INTEL = ("6/167", "AVX512")
_ZEN4 = ("25/17", "AVX512")
_ZEN5 = ("26/2", "AVX512")


def _one_vm_report(report: str, arm_names, seeds: range = _NOISE_SEEDS, machine: tuple | dict = _INTEL,
                   sweep: str = "sweep-temperature-t1.5") -> tuple:
    """A report of docs/study/``sweep`` (default the T = 1.5 archive) made on one VM, or on VMs of one
    kind (``machine``, default the Intel VM of family 6 model 167 with AVX-512 kernels; ``{arm: machine}``
    where the arms ran on different VMs) and its archive: the dose's arms, every run's final reward, the
    runs, the setting, the paired-difference function of :func:`_paired_over` on ``seeds`` and the
    report's study settings. The report's arms are checked to be ``arm_names`` at ``seeds``, their
    vs-none differences the recomputed ones and every arm's runs to come from its VM."""
    summary = _summary(sweep, report)
    (dose,) = summary["doses"]
    arms, study = dose["arms"], summary["study"]
    assert sorted(arms) == sorted(arm_names)
    assert all(list(arms[a]["seeds"]) == list(seeds) for a in arms)
    final = _committed_finals(sweep, summary)
    runs = _archive_runs(sweep)
    headers = _archive_headers(sweep)
    setting = dose["setting"]
    by_arm = machine if isinstance(machine, dict) else dict.fromkeys(arms, machine)
    for a in arms:
        machines = {(headers[setting, a, s]["machine"]["cpu_family_model"], headers[setting, a, s]["machine"]
                     ["cpu_capability"]) for s in seeds}
        assert machines == {by_arm[a]}, (a, machines)
    paired = _paired_over(final, runs, setting, study, seeds)
    for arm in arms:
        if arm != "none":
            assert _quoted(paired(arm, "none")) == _quoted(arms[arm]["vs_none"]["final_reward"]), arm
    return arms, final, runs, setting, paired, study


@functools.cache
def _noise_dose() -> tuple:
    """The noise-dose report at T = 1.5 (docs/study/sweep-temperature-t1.5/noise-dose;
    :func:`_one_vm_report`): its arms none, token TIS and the three doses at seeds 100-199, each dose's
    power its ``REWRITE_EXPONENT``."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT

    assert {a: REWRITE_EXPONENT.get(a, 1.0) for a in _NOISE_DOSES if a != "none"} == {
        a: p for a, p in _NOISE_DOSES.items() if a != "none"}
    return _one_vm_report("noise-dose", {*_NOISE_DOSES, "token_tis"})


def _dose_slope(final: dict, seeds: range, study: dict, doses: dict = _NOISE_DOSES) -> dict:
    """Per seed, the least-squares slope of the final reward on the power p of ``doses`` (``{arm: p}``;
    default the placebo's: none p = 0 and its three doses 0.5, 1, 2); their mean with the reports'
    paired bootstrap against 0."""
    from megatron_mis.testbed.study.stats import paired_differences

    mean_p = sum(doses.values()) / len(doses)
    sxx = sum((p - mean_p) ** 2 for p in doses.values())
    slopes = {s: sum((p - mean_p) * final[a, s] for a, p in doses.items()) / sxx for s in seeds}
    return paired_differences(slopes, dict.fromkeys(seeds, 0.0), confidence=study["confidence"],
                              resamples=study["bootstrap"])


def _noise_dose_quotes() -> tuple[list[str], dict, dict]:
    """The figures of docs/study.md's section on the placebo's noise at three doses (seeds 100-199, the
    Intel VM; :func:`_noise_dose`), recomputed from the archive: each arm's row, the dose slope, which
    differences are resolved, the 100 seeds of the Zen 1 VM they replicate, and the runs' times."""
    import numpy as np

    arms, final, runs, setting, paired, study = _noise_dose()
    pl, half, double = _PLACEBO, "token_tis_group_permuted_half", "token_tis_group_permuted_double"
    order = ("none", half, pl, double, "token_tis")
    extremes = {a: _weight_extremes(setting, runs, a, len(_NOISE_SEEDS), _NOISE_SEEDS[0]) for a in order}
    power = {**{a: f"{p:g}" for a, p in _NOISE_DOSES.items()}, "token_tis": "-"}
    formula = {"none": "1 (PPO)", half: "w ** 0.5", pl: "w, another group's mean", double: "w ** 2",
               "token_tis": "min(r, 2)"}

    def row(arm: str) -> str:
        lo, hi = extremes[arm][:2]
        return "| " + " | ".join([
            f"`{arm}`", power[arm], formula[arm], f"{lo:.2f} / {hi:.2f}",
            "-" if arm == "none" else _quoted(paired(arm, "none")),
            "-" if arm in ("none", pl) else _quoted(paired(arm, pl)),
            "-" if arm in ("none", "token_tis") else _quoted(paired(arm, "token_tis")),
            "-" if arm == "none" else _quoted(paired(arm, "none", key="greedy_reward")),
            f"{np.mean([final[arm, s] for s in _NOISE_SEEDS]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
            str(arms[arm]["collapse"]["k"])]) + " |"

    slope = _dose_slope(final, _NOISE_SEEDS, study)
    zen1 = _hundred_seeds()[4]
    both = _paired_over(final, runs, setting, study, range(200))  # every pair from one machine
    weighted = [a for a in order if a != "none"]
    # resolved: token TIS against none and against the placebo, also Bonferroni-corrected for ten comparisons;
    # no dose of the placebo against none or against another dose, and no slope
    assert [a for a in weighted if paired(a, "none")["excludes_zero"]] == ["token_tis"]
    assert all(paired("token_tis", a)["excludes_zero"] for a in (half, pl, double))
    strict = {(a, b): paired(a, b, comparisons=10) for a, b in (("token_tis", "none"), ("token_tis", pl), (pl, "none"))}
    assert [k for k, d in strict.items() if d["excludes_zero"]] == [("token_tis", "none"), ("token_tis", pl)]
    assert not any(paired(a, b)["excludes_zero"] for a, b in ((double, half), (double, pl), (half, pl)))
    assert not slope["excludes_zero"]
    assert zen1(pl, "none")["excludes_zero"] and not both(pl, "none")["excludes_zero"]
    blocks = [np.array([final[pl, s] - final["none", s] for s in seeds]) for seeds in (range(100), _NOISE_SEEDS)]
    z = (blocks[1].mean() - blocks[0].mean()) / np.sqrt(sum(b.var(ddof=1) / b.size for b in blocks))
    wall = [runs[setting, a, s][1]["wall_s"] for a in arms for s in _NOISE_SEEDS]
    grads = {a: arms[a]["grad_norm_mean"] for a in arms}
    doses = [grads[a] for a in (half, pl, double)]
    assert len({f"{g:.2f}" for g in doses}) == 1, doses  # "each dose of the placebo" at two decimals
    assert arms["none"]["collapse"]["k"] == 0
    return [
        f"500 runs, about {np.mean(wall):.0f} s per run, {sum(wall) / 3600:.1f} CPU-hours",
        *(row(a) for a in order),
        f"weights from {extremes[half][0]:.2f}-{extremes[half][1]:.2f} to {extremes[double][0]:.2f}-"
        f"{extremes[double][1]:.2f}",
        f"The slope of the final reward on p, fitted per seed over none and the three doses, is {_quoted(slope)} per "
        f"unit of p; double - half {_quoted(paired(double, half))}",
        f"If noise in the weights had cost {-zen1(pl, 'none')['mean']:.3f} at p = 1",
        f"placebo - none is {_quoted(paired(pl, 'none'))} on these seeds against {_quoted(zen1(pl, 'none'))} on "
        f"seeds 0-99 (the Zen 1 VM)",
        f"The two blocks differ by {blocks[1].mean() - blocks[0].mean():.3f}, {z:.1f} standard errors; pooled over "
        f"200 seeds on two machines (each pair from one machine) the placebo costs {_quoted(both(pl, 'none'))}",
        f"token TIS - none is {_quoted(paired('token_tis', 'none'))} on these seeds against "
        f"{_quoted(zen1('token_tis', 'none'))} on seeds 0-99 (the AVX2 VMs), and it is below the placebo on the same "
        f"seeds, {_quoted(paired('token_tis', pl))}",
        f"With the Bonferroni correction for ten comparisons (99.5% intervals) token TIS stays below none "
        f"({_quoted(strict['token_tis', 'none'])}) and below the placebo ({_quoted(strict['token_tis', pl])})",
        f"Its mean gradient norm was {grads['token_tis']:.2f} (none {grads['none']:.2f}, each dose of the placebo "
        f"{doses[0]:.2f}), and {arms['token_tis']['collapse']['k']} of its 100 runs collapsed "
        f"(none {arms['none']['collapse']['k']})",
        f"none's mean final reward was {np.mean([final['none', s] for s in _NOISE_SEEDS]):.3f}",
        f"no weight of the double dose reached the engine's bound of 2 (the largest of its 100 runs "
        f"{max(r['is_weight_max'] for s in _NOISE_SEEDS for r in runs[setting, double, s][0]):.2f})",
    ], {a: paired(a, "none") for a in weighted}, slope


def test_the_noise_dose_at_1_5_comes_from_the_archive():
    """docs/study.md and its answers on the placebo's noise at three doses and token TIS
    at a rollout temperature of 1.5 (seeds 100-199 on an Intel VM, docs/study/sweep-temperature-t1.5/
    noise-dose): each arm's row, the dose slope, which differences are resolved (also after the
    correction), the placebo's and token TIS's figures beside the Zen 1 / AVX2 seeds 0-99 they
    replicate, and the runs' times, recomputed from the archive; the placebo's section points to it."""
    quotes, costs, slope = _noise_dose_quotes()
    _assert_quoted(quotes, _section("The placebo's noise at three doses"))
    assert "The next section runs that dose" in _section("A placebo and a null arm")
    tis, placebo = _quoted(costs["token_tis"]), _quoted(costs[_PLACEBO])
    double = _quoted(costs["token_tis_group_permuted_double"])
    answers = _section("The answers so far, per mechanism")
    _assert_quoted([f"on 100 new seeds of an Intel VM token TIS cost {tis} while the placebo cost {placebo} and "
                    f"twice its noise {double}"], answers)


#: The arms of docs/study/sweep-temperature-t1.5/token-weights, every one at seeds 100-199 on the Intel VM: none,
#: token TIS and the placebo of the noise-dose report, and (a session later, 2026-12-02) the group mean, the
#: shuffled weights and the shuffled weights raised to the powers 1/2 and 2: ``{arm: its power p}`` of the shuffled
#: weights' doses (none p = 0), then the others.
_SHUFFLED_DOSES = {"none": 0.0, "token_tis_shuffled_half": 0.5, "token_tis_shuffled": 1.0,
                   "token_tis_shuffled_double": 2.0}
_TOKEN_WEIGHT_ARMS = (*_SHUFFLED_DOSES, "token_tis", _PLACEBO, "token_tis_group_mean")


@functools.cache
def _token_weights() -> tuple:
    """The token-weights report at T = 1.5 (docs/study/sweep-temperature-t1.5/token-weights;
    :func:`_one_vm_report`): its arms :data:`_TOKEN_WEIGHT_ARMS` at seeds 100-199, each dose of the shuffled
    weights' power its ``REWRITE_EXPONENT`` and its rewrite the shuffled arm's."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    doses = {a: p for a, p in _SHUFFLED_DOSES.items() if a != "none"}
    assert {a: REWRITE_EXPONENT.get(a, 1.0) for a in doses} == doses
    assert {REWRITTEN_TIS[a] for a in doses} == {"shuffle"}
    return _one_vm_report("token-weights", _TOKEN_WEIGHT_ARMS)


def _token_weight_quotes() -> tuple[list[str], dict]:
    """The figures of docs/study.md's section on token TIS's weights per group and per token at three
    doses on the Intel seeds 100-199 (:func:`_token_weights`), recomputed from the archive: each arm's
    row, the 200-seed table over these seeds and the AVX2 seeds 0-99 (each pair from one machine), the
    shuffled weights' dose slope, which differences are resolved (also after a correction for ten
    comparisons) and the runs' times; with the 200-seed differences the answers quote."""
    import numpy as np

    arms, final, runs, setting, paired, study = _token_weights()
    pl, gm, sh = _PLACEBO, "token_tis_group_mean", "token_tis_shuffled"
    half, double = "token_tis_shuffled_half", "token_tis_shuffled_double"
    order = ("none", pl, gm, half, sh, double, "token_tis")
    extremes = {a: _weight_extremes(setting, runs, a, len(_NOISE_SEEDS), _NOISE_SEEDS[0]) for a in order}
    formula = {"none": "1 (PPO)", pl: "another group's mean", gm: "its group's mean", half: "shuffled, ** 0.5",
               sh: "min(r, 2), shuffled", double: "shuffled, ** 2", "token_tis": "min(r, 2)"}
    per = {"none": "-", pl: "group", gm: "group", half: "token", sh: "token", double: "token", "token_tis": "token"}

    def row(arm: str) -> str:
        lo, hi = extremes[arm][:2]
        return "| " + " | ".join([
            f"`{arm}`", per[arm], formula[arm], f"{lo:.2f} / {hi:.2f}",
            "-" if arm == "none" else _quoted(paired(arm, "none")),
            "-" if arm in ("none", "token_tis") else _quoted(paired(arm, "token_tis")),
            "-" if arm in ("none", pl) else _quoted(paired(arm, pl)),
            "-" if arm == "none" else _quoted(paired(arm, "none", key="greedy_reward")),
            f"{np.mean([final[arm, s] for s in _NOISE_SEEDS]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
            str(arms[arm]["collapse"]["k"])]) + " |"

    avx2 = _hundred_seeds()[4]  # seeds 0-99: the Zen 3 / Zen 1 VMs
    both = _paired_over(final, runs, setting, study, range(200))  # every pair from one machine

    def row200(arm: str) -> str:
        return "| " + " | ".join([f"`{arm}`", _quoted(avx2(arm, "none")), _quoted(paired(arm, "none")),
                                  _quoted(both(arm, "none")),
                                  "-" if arm == "token_tis" else _quoted(both(arm, "token_tis"))]) + " |"

    slope = _dose_slope(final, _NOISE_SEEDS, study, _SHUFFLED_DOSES)
    ten = (("token_tis", "none"), (sh, "none"), (gm, "none"), (pl, "none"), (gm, "token_tis"), (sh, "token_tis"),
           (sh, gm), (gm, pl), (sh, pl), ("token_tis", pl))
    strict = {k: both(*k, comparisons=10) for k in ten}
    # over 200 seeds: token TIS below none and the shuffled weights too, after the correction as well; the group
    # mean and the placebo not; the group mean above token TIS (also corrected), the shuffled weights above it (not
    # corrected); the group mean level with the placebo
    assert [k for k in ten if both(*k)["excludes_zero"]] == [("token_tis", "none"), (sh, "none"), (gm, "token_tis"),
                                                            (sh, "token_tis"), ("token_tis", pl)]
    assert [k for k in ten if strict[k]["excludes_zero"]] == [("token_tis", "none"), (sh, "none"), (gm, "token_tis"),
                                                             ("token_tis", pl)]
    assert [a for a in (half, sh, double, gm, pl) if paired(a, "none")["excludes_zero"]] == [half, sh, double]
    assert slope["excludes_zero"] and not any(paired(a, b)["excludes_zero"] for a, b in ((half, sh), (double, half)))
    assert not any(paired(*k)["excludes_zero"] for k in ((gm, pl), (sh, "token_tis"), (double, "token_tis")))
    wall = {k: [runs[setting, a, s][1]["wall_s"] for a in arms_ for s in _NOISE_SEEDS]
            for k, arms_ in (("first", (gm, sh)), ("doses", (half, double)))}
    times = {k: f"about {np.mean(w):.0f} s per run and {sum(w) / 3600:.1f} CPU-hours" for k, w in wall.items()}
    assert times["first"] == times["doses"], times  # quoted once: "each"
    at_bound = np.mean([r["is_weight_max"] >= 2 - 1e-6 for s in _NOISE_SEEDS for r in runs[setting, double, s][0]])
    blocks = {a: [np.array([final[a, s] - final["none", s] for s in seeds]) for seeds in (range(100), _NOISE_SEEDS)]
              for a in (gm, sh)}
    moved = {a: (b[1].mean() - b[0].mean(), (b[1].mean() - b[0].mean()) / np.sqrt(sum(x.var(ddof=1) / x.size
                                                                                       for x in b)))
             for a, b in blocks.items()}
    grads = {a: arms[a]["grad_norm_mean"] for a in arms}
    greedy = {a: paired(a, "none", key="greedy_reward")["mean"] for a in (half, sh, double)}
    placebo_slope = _dose_slope(final, _NOISE_SEEDS, study)  # the same archive: the placebo's doses
    s_lo, s_hi = extremes[sh][:2]
    return [
        f"both cost about half of token TIS's cost on seeds 0-99 of the AVX2 VMs ({avx2(gm, 'none')['mean']:.3f} and "
        f"{avx2(sh, 'none')['mean']:.3f})",
        f"200 runs each, {times['first']} each",
        f"the double dose reached that bound on {at_bound:.0%} of its steps (wherever a shuffled weight was above "
        f"1.41)",
        *(row(a) for a in order),
        *(row200(a) for a in (pl, gm, sh, "token_tis")),
        f"Against none the half dose cost {_quoted(paired(half, 'none'))}, the shuffled weights "
        f"{_quoted(paired(sh, 'none'))} and the double dose {_quoted(paired(double, 'none'))} (greedy reward "
        f"{greedy[half]:.3f}, {greedy[sh]:.3f} and {greedy[double]:.3f})",
        f"The slope of the final reward on p, fitted per seed over none and the three doses, is {_quoted(slope)} per "
        f"unit of p, where the placebo's was {_quoted(placebo_slope)}",
        f"the half dose is level with the shuffled weights ({_quoted(paired(half, sh))}), and double - half is "
        f"{_quoted(paired(double, half))}",
        f"Weights from {extremes[half][0]:.2f} to {extremes[half][1]:.2f} cost as much as weights from {s_lo:.2f} to "
        f"{s_hi:.2f}",
        f"group mean cost {_quoted(paired(gm, 'none'))} against none on these seeds and is level with the placebo "
        f"({_quoted(paired(gm, pl))}). Over 200 seeds the group mean cost {_quoted(both(gm, 'none'))} and the placebo "
        f"{_quoted(both(pl, 'none'))}, level with each other ({_quoted(both(gm, pl))})",
        f"(they differ by {moved[gm][0]:.3f} and {moved[sh][0]:.3f}, {moved[gm][1]:.1f} and {abs(moved[sh][1]):.1f} "
        f"standard errors)",
        f"(shuffled - token TIS {_quoted(paired(sh, 'token_tis'))}) and with the double dose "
        f"({_quoted(paired(double, 'token_tis'))}). Over 200 seeds the shuffled weights are "
        f"{_quoted(both(sh, 'token_tis'))} above token TIS",
        f"(99.5%: {_quoted(strict[sh, 'token_tis'])}). With that correction token TIS "
        f"({_quoted(strict['token_tis', 'none'])}) and the shuffled weights ({_quoted(strict[sh, 'none'])}) stay "
        f"below none, and the group mean stays above token TIS ({_quoted(strict[gm, 'token_tis'])})",
        f"mean gradient norms were {grads[half]:.2f}, {grads[sh]:.2f} and {grads[double]:.2f} (none "
        f"{grads['none']:.2f}, the group mean {grads[gm]:.2f}), token TIS's {grads['token_tis']:.2f}",
        f"shuffled, they cost {both(sh, 'none')['mean']:.3f} of its {both('token_tis', 'none')['mean']:.3f} over 200 "
        f"seeds",
        f"the widest group dose (the placebo's double, {_noise_dose_extremes()}) is narrower than the narrowest token "
        f"dose ({extremes[half][0]:.2f} / {extremes[half][1]:.2f})",
        f"the shuffled weights at p = 0.1 and 0.25 (weights of about {s_lo ** 0.1:.2f} / {s_hi ** 0.1:.2f} and "
        f"{s_lo ** 0.25:.2f} / {s_hi ** 0.25:.2f}",
    ], {"sh": both(sh, "none"), "slope": slope}


def _noise_dose_extremes() -> str:
    """The placebo's double dose's mean smallest / largest weight over seeds 100-199 (:func:`_noise_dose`)."""
    _, _, runs, setting, _, _ = _noise_dose()
    lo, hi = _weight_extremes(setting, runs, "token_tis_group_permuted_double", len(_NOISE_SEEDS), _NOISE_SEEDS[0])[:2]
    return f"{lo:.2f} / {hi:.2f}"


def test_the_token_weights_at_1_5_come_from_the_archive():
    """docs/study.md on token TIS's weights per group and per token at three doses at a rollout
    temperature of 1.5 (seeds 100-199 on the Intel VM, docs/study/sweep-temperature-t1.5/token-weights,
    pooled with the AVX2 VMs' seeds 0-99): each arm's row, the 200-seed table, the shuffled weights'
    dose slope, which differences are resolved and the runs' times, recomputed from the archive; the
    section before points to it."""
    quotes, costs = _token_weight_quotes()
    _assert_quoted(quotes, _section("Token TIS's weights per group and per token"))
    assert "The next section reruns them on these seeds" in _section("The placebo's noise at three doses")
    _, _, runs, setting, paired, _ = _token_weights()
    sh, half, double = "token_tis_shuffled", "token_tis_shuffled_half", "token_tis_shuffled_double"
    shuffled = _quoted(costs["sh"])
    _assert_quoted([f"token TIS's weights shuffled onto random tokens cost {shuffled} over 200 seeds of both machines, "
                    f"and at twice their log-spread {_quoted(paired(double, 'none'))} on the Intel seeds",
                    f"token TIS's weights shuffled onto random tokens cost {shuffled} over 200 seeds, and noise from "
                    f"token to token cost at every dose run on the Intel VM, slope {_quoted(costs['slope'])} per "
                    f"unit of power"],
                   _section("The answers so far, per mechanism"))
    hours = sum(runs[setting, a, s][1]["wall_s"] for a in ("token_tis_group_mean", sh, half, double)
                for s in _NOISE_SEEDS) / 3600
    _assert_quoted([f"3.3 for the 500 of seeds 100-199 and {hours:.1f} for 400 more of them (Intel VM)"],
                   _section("What has been run, and what the rest would cost"))


#: The arms of docs/study/sweep-temperature-t1.5/shuffled-low-doses, every one at seeds 200-299 on a Zen 4 VM
#: (family 25 model 17, AVX-512 kernels; 2026-12-02): none and the shuffled weights raised to the powers 1/10 and
#: 1/4 (``{arm: p}``, none p = 0).
_LOW_DOSES = {"none": 0.0, "token_tis_shuffled_tenth": 0.1, "token_tis_shuffled_quarter": 0.25}
_LOW_SEEDS = range(200, 300)


@functools.cache
def _low_doses() -> tuple:
    """The shuffled-low-doses report at T = 1.5 (docs/study/sweep-temperature-t1.5/shuffled-low-doses;
    :func:`_one_vm_report` on the Zen 4 VM): its arms :data:`_LOW_DOSES` at seeds 200-299, each dose's
    power its ``REWRITE_EXPONENT`` and its rewrite the shuffled arm's."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    doses = {a: p for a, p in _LOW_DOSES.items() if a != "none"}
    assert {a: REWRITE_EXPONENT[a] for a in doses} == doses
    assert {REWRITTEN_TIS[a] for a in doses} == {"shuffle"}
    return _one_vm_report("shuffled-low-doses", _LOW_DOSES, _LOW_SEEDS, _ZEN4)


def _weights_k3(runs: dict, setting: str, arm: str, seeds: range) -> float:
    """``arm``'s mean K3 over ``seeds`` (each run's mean over its steps). The engine measures the pairs
    it weighs, so for an arm that rewrites its weights (placebo, group mean, shuffled weights and
    their doses) this is the K3 of its weights w, mean(w - 1 - log w) over the loss tokens (before the
    engine's bound of 2): a per-token measure of their spread, whether they vary per group or per token."""
    import numpy as np

    return float(np.mean([np.mean([r["mis_k3_kl"] for r in runs[setting, arm, s][0]]) for s in seeds]))


def _paired_noise(d: dict, summary: dict) -> tuple[float, float, int]:
    """The paired SD of ``d`` (a :func:`~megatron_mis.testbed.study.stats.paired_differences` result), its MDE
    (:func:`_paired_mde`) and the seeds a 0.05 difference needs at that SD, each checked against the report's
    ``summary`` (its summary.json)."""
    import numpy as np

    from megatron_mis.testbed.study.stats import seeds_for_effect

    sd, mde = float(np.std(list(d["diffs"].values()), ddof=1)), _paired_mde(d)
    assert sd == pytest.approx(summary["paired_sd"], rel=1e-9)
    assert mde == pytest.approx(summary["minimal_detectable_effect"], rel=1e-9)
    needed = seeds_for_effect(sd, 0.05)
    assert needed == summary["seeds_for_target"]
    return sd, mde, needed


def _paired_mde(d: dict) -> float:
    """The minimal detectable effect of a paired difference (``d``: a
    :func:`~megatron_mis.testbed.study.stats.paired_differences` result) at its own number of pairs, from the SD
    of its per-seed differences."""
    import numpy as np

    from megatron_mis.testbed.study.stats import minimal_detectable_effect

    diffs = list(d["diffs"].values())
    return minimal_detectable_effect(float(np.std(diffs, ddof=1)), len(diffs))


def _kinds(headers) -> set:
    """``{(cpu family/model, torch kernels)}`` of run headers (an iterable of header records): the machine kinds
    their runs were made on, e.g. ``{_ZEN3}``."""
    return {(h["machine"]["cpu_family_model"], h["machine"]["cpu_capability"]) for h in headers}


def _fisher_one_sided(k: int, total: int, n: int) -> float:
    """One-sided Fisher exact p of ``k`` or more of ``total`` events falling in the first of two arms of ``n``
    seeds each (the hypergeometric tail)."""
    return sum(math.comb(n, x) * math.comb(n, total - x) for x in range(k, total + 1)) / math.comb(2 * n, total)


def _cost_gap(cost: dict, a: str, b: str) -> str:
    """Two arms' costs against their own none (``cost``: ``{arm: paired difference}``, on two machines'
    seeds or the same): the difference of their means and its size in standard errors of independent
    samples."""
    import numpy as np

    d = [np.array(list(cost[x]["diffs"].values())) for x in (a, b)]
    gap = d[0].mean() - d[1].mean()
    return f"{gap:+.3f}, {abs(gap) / np.sqrt(sum(x.var(ddof=1) / x.size for x in d)):.1f} standard errors"


def _k3_row(arm: str, rewritten: dict, setting: str, k3: dict, cost: dict) -> str:
    """A row of the T = 1.5 tables of rewritten arms by the K3 of their weights: the arm, what its
    weights vary per, its power, its machine and seeds (``rewritten[arm]``: ``(varies per, paired
    function, runs, seeds, machine)``), its mean smallest / largest weight, its K3 (``k3``) and its
    cost against its own none (``cost``)."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT

    per, _, r, seeds, machine = rewritten[arm]
    lo, hi = _weight_extremes(setting, r, arm, len(seeds), seeds[0])[:2]
    return "| " + " | ".join([f"`{arm}`", per, f"{REWRITE_EXPONENT.get(arm, 1.0):g}", f"{machine}, {seeds[0]}-"
                              f"{seeds[-1]}", f"{lo:.2f} / {hi:.2f}", _e(k3[arm], 1), _quoted(cost[arm])]) + " |"


@functools.cache
def _low_dose_quotes() -> tuple[list[str], dict, dict, dict]:
    """The figures of docs/study.md's section on the shuffled weights at a tenth and a quarter of the
    dose (seeds 200-299, the Zen 4 VM; :func:`_low_doses`), recomputed from the archive: each arm's row,
    the dose slope, the table of every rewritten arm at T = 1.5 by the K3 of its weights (each against
    its own machine's none: the Intel arms on seeds 100-199), which differences are resolved and the
    runs' times; with every rewritten arm's difference against its none (the answers
    quote the two doses'), the K3 of every rewritten arm's weights (and none's) and the table's arms
    (``{arm: (varies per, paired function, runs, seeds, machine)}``)."""
    import numpy as np

    arms, final, runs, setting, paired, study = _low_doses()
    tenth, quarter = "token_tis_shuffled_tenth", "token_tis_shuffled_quarter"
    order = ("none", tenth, quarter)
    extremes = {a: _weight_extremes(setting, runs, a, len(_LOW_SEEDS), _LOW_SEEDS[0]) for a in order}

    def row(arm: str) -> str:
        lo, hi = extremes[arm][:2]
        return "| " + " | ".join([
            f"`{arm}`", f"{_LOW_DOSES[arm]:g}", "1 (PPO)" if arm == "none" else f"shuffled, ** {_LOW_DOSES[arm]:g}",
            f"{lo:.2f} / {hi:.2f}", "-" if arm == "none" else _e(all_k3[arm], 1),
            "-" if arm == "none" else _quoted(paired(arm, "none")),
            "-" if arm == "none" else _quoted(paired(arm, "none", key="greedy_reward")),
            f"{np.mean([final[arm, s] for s in _LOW_SEEDS]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
            str(arms[arm]["collapse"]["k"])]) + " |"

    # every rewritten arm at T = 1.5 on one VM's seeds, against that VM's none, by the K3 of its weights
    _, _, nd_runs, _, nd_paired, _ = _noise_dose()
    _, tw_final, tw_runs, _, tw_paired, _ = _token_weights()
    pl = _PLACEBO
    rewritten = {  # arm: (varies per, paired function, runs, seeds, machine); its power is its REWRITE_EXPONENT
        "token_tis_group_permuted_half": ("group", nd_paired, nd_runs, _NOISE_SEEDS, "Intel"),
        pl: ("group", nd_paired, nd_runs, _NOISE_SEEDS, "Intel"),
        "token_tis_group_permuted_double": ("group", nd_paired, nd_runs, _NOISE_SEEDS, "Intel"),
        "token_tis_group_mean": ("group", tw_paired, tw_runs, _NOISE_SEEDS, "Intel"),
        tenth: ("token", paired, runs, _LOW_SEEDS, "Zen 4"),
        quarter: ("token", paired, runs, _LOW_SEEDS, "Zen 4"),
        "token_tis_shuffled_half": ("token", tw_paired, tw_runs, _NOISE_SEEDS, "Intel"),
        "token_tis_shuffled": ("token", tw_paired, tw_runs, _NOISE_SEEDS, "Intel"),
        "token_tis_shuffled_double": ("token", tw_paired, tw_runs, _NOISE_SEEDS, "Intel"),
    }
    all_k3 = {a: _weights_k3(r, setting, a, seeds) for a, (_, _, r, seeds, _) in rewritten.items()}
    all_k3["none"] = _weights_k3(runs, setting, "none", _LOW_SEEDS)
    for a in order:  # the report's own K3, averaged the same way
        assert all_k3[a] == pytest.approx(arms[a]["k3_mean"][0], rel=1e-9), a
    cost = {a: f(a, "none") for a, (_, f, _, _, _) in rewritten.items()}

    def k3_row(arm: str) -> str:
        return _k3_row(arm, rewritten, setting, all_k3, cost)

    by_k3 = sorted(rewritten, key=all_k3.get)  # none is not a rewritten arm
    # below K3 1e-2 (both low doses, every group dose) nothing is resolved against none; above it (the three Intel
    # token doses) everything is
    assert [a for a in by_k3 if cost[a]["excludes_zero"]] == [a for a in by_k3 if all_k3[a] > 1e-2] == by_k3[-3:]
    assert {rewritten[a][0] for a in by_k3[-3:]} == {"token"}
    assert not any(paired(a, b)["excludes_zero"] for a, b in ((tenth, "none"), (quarter, "none"), (quarter, tenth)))

    def between(a: str, b: str) -> str:
        return _cost_gap(cost, a, b)

    slope = _dose_slope(final, _LOW_SEEDS, study, _LOW_DOSES)
    low, high = by_k3[:-3], by_k3[-3:]
    wall = [runs[setting, a, s][1]["wall_s"] for a in arms for s in _LOW_SEEDS]
    return [
        f"300 runs, about {np.mean(wall):.0f} s per run, {sum(wall) / 3600:.1f} CPU-hours",
        *(row(a) for a in order),
        *(k3_row(a) for a in by_k3),
        f"The slope of the final reward on p, fitted per seed over none and the two doses, is {_quoted(slope)} per "
        f"unit of p; quarter - tenth {_quoted(paired(quarter, tenth))}",
        f"none's mean final reward was {np.mean([final['none', s] for s in _LOW_SEEDS]):.3f}",
        f"tenth - placebo {between(tenth, pl)}; quarter - the placebo's double "
        f"{between(quarter, 'token_tis_group_permuted_double')}",
        f"tenth - half {between(tenth, 'token_tis_shuffled_half')}; quarter - half "
        f"{between(quarter, 'token_tis_shuffled_half')}",
        f"from {_e(all_k3[quarter], 1)} (the quarter dose) to {_e(all_k3['token_tis_shuffled_half'], 1)} (the half "
        f"dose)",
        f"group dose, up to {_e(max(all_k3[a] for a in low), 1)}) cost {min(cost[a]['mean'] for a in low):+.3f} to "
        f"{max(cost[a]['mean'] for a in low):+.3f}",
        f"They cost {max(cost[a]['mean'] for a in high):+.3f} to {min(cost[a]['mean'] for a in high):+.3f}",
        f"close to the Intel VM's {np.mean([tw_final['none', s] for s in _NOISE_SEEDS]):.3f}",
        f"placebo raised to a power of about {np.sqrt(all_k3['token_tis_shuffled_half'] / all_k3[pl]):.1f}",
        f"the shuffled weights' K3 ({_e(all_k3['token_tis_shuffled'], 1)}) is "
        f"{all_k3['token_tis_shuffled'] / all_k3['token_tis_group_mean']:.0f} times the group mean's "
        f"({_e(all_k3['token_tis_group_mean'], 1)})",
    ], cost, all_k3, rewritten


def test_the_shuffled_low_doses_at_1_5_come_from_the_archive():
    """docs/study.md on the shuffled weights at a tenth and a quarter of the dose at a rollout
    temperature of 1.5 (seeds 200-299 on the Zen 4 VM, docs/study/sweep-temperature-t1.5/
    shuffled-low-doses): each arm's row, the table of every rewritten arm by the K3 of its weights,
    the dose slope, which differences are resolved, the between-machine comparisons and the runs'
    times, recomputed from the archive; the section before points to it, and the answers, the status
    row quote the two doses (the archive's size is the T = 1.5 section's test's)."""
    quotes, cost = _low_dose_quotes()[:2]
    _assert_quoted(quotes, _section("The shuffled weights at a tenth and a quarter of the dose"))
    assert "The next section runs the shuffled weights at p = 0.1 and 0.25" in _section(
        "Token TIS's weights per group and per token")
    tenth, quarter = (_quoted(cost[f"token_tis_shuffled_{d}"]) for d in ("tenth", "quarter"))
    _assert_quoted([f"but at a tenth and a quarter of it, as spread as the placebo's weights, {tenth} and {quarter} on "
                    f"100 seeds of a Zen 4 VM",
                    f"but not at a tenth and a quarter of the power, as spread as the placebo's weights: {tenth} and "
                    f"{quarter} on a Zen 4 VM"], _section("The answers so far, per mechanism"))
    runs, setting = _low_doses()[2:4]
    hours = sum(runs[setting, a, s][1]["wall_s"] for a in _LOW_DOSES for s in _LOW_SEEDS) / 3600
    _assert_quoted([f"{hours:.1f} for the 300 of seeds 200-299 (Zen 4 VM)"],
                   _section("What has been run, and what the rest would cost"))


#: The placebo's wide doses at seeds 200-299 (``{arm: p}``, none p = 0): none, the Zen 4 VM's runs of the
#: shuffled-low-doses report, and the placebo raised to the powers 3.5 and 6, run a day later on a Zen 5 VM (family
#: 26 model 2, AVX-512 kernels) that repeated the Zen 4 VM's seed 200 of none bit for bit; the arms of
#: docs/study/sweep-temperature-t1.5/group-wide-doses with the shuffled weights' half dose, run after them on the
#: same VM and seeds.
_GROUP_WIDE = {"none": 0.0, "token_tis_group_permuted_wide": 3.5, "token_tis_group_permuted_wider": 6.0}
_GROUP_WIDE_ARMS = (*_GROUP_WIDE, "token_tis_shuffled_half")
_GROUP_WIDE_SEEDS = range(200, 300)


@functools.cache
def _group_wide() -> tuple:
    """The group-wide-doses report at T = 1.5 (docs/study/sweep-temperature-t1.5/group-wide-doses;
    :func:`_one_vm_report`, none from the Zen 4 VM and the other arms from the Zen 5 VM): its arms
    :data:`_GROUP_WIDE_ARMS` at seeds 200-299, each wide dose's power its ``REWRITE_EXPONENT`` and its
    rewrite the placebo's."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    doses = {a: p for a, p in _GROUP_WIDE.items() if a != "none"}
    assert {a: REWRITE_EXPONENT[a] for a in doses} == doses
    assert {REWRITTEN_TIS[a] for a in doses} == {REWRITTEN_TIS[_PLACEBO]}
    return _one_vm_report("group-wide-doses", _GROUP_WIDE_ARMS, _GROUP_WIDE_SEEDS,
                          {"none": _ZEN4, **dict.fromkeys(_GROUP_WIDE_ARMS[1:], _ZEN5)})


@functools.cache
def _group_wide_quotes() -> tuple[list[str], dict, dict, dict]:
    """The figures of docs/study.md's section on the placebo as spread as the token doses (seeds
    200-299; :func:`_group_wide`), recomputed from the archive: each arm's row, how often the wide doses'
    weights reached the bound of 2, the dose slope, the table of every rewritten arm at T = 1.5 by the K3
    of its weights (:func:`_low_dose_quotes`' and the two wide doses), the wide doses against the token
    doses of the same K3 on two machines and on the same seeds, the half dose's two blocks, which
    differences are resolved and the runs' times; with every rewritten arm's difference against its none
    (the wide doses' on these seeds), the half dose's over both machines' 200 seeds and the CPU-hours of
    the wide doses' and of the half dose's runs (``{"wide": h, "half": h}``)."""
    import numpy as np

    arms, final, runs, setting, paired, study = _group_wide()
    wide, wider = "token_tis_group_permuted_wide", "token_tis_group_permuted_wider"
    tenth, quarter = "token_tis_shuffled_tenth", "token_tis_shuffled_quarter"
    half, sh = "token_tis_shuffled_half", "token_tis_shuffled"
    seeds = _GROUP_WIDE_SEEDS
    extremes = {a: _weight_extremes(setting, runs, a, len(seeds), seeds[0]) for a in _GROUP_WIDE_ARMS}
    _, low_cost, low_k3, low_rewritten = _low_dose_quotes()
    # the table of the section above (the half dose's Intel block) with the two wide doses
    rewritten = {**low_rewritten, **{a: ("group", paired, runs, seeds, "Zen 5") for a in (wide, wider)}}
    new_k3 = {a: _weights_k3(runs, setting, a, seeds) for a in _GROUP_WIDE_ARMS}
    for a in _GROUP_WIDE_ARMS:  # the report's own K3, averaged the same way
        assert new_k3[a] == pytest.approx(arms[a]["k3_mean"][0], rel=1e-9), a
    k3 = {**low_k3, wide: new_k3[wide], wider: new_k3[wider]}
    cost = {**low_cost, wide: paired(wide, "none"), wider: paired(wider, "none")}
    # the same seeds and none as the shuffled weights' tenth and quarter doses (the Zen 4 VM): paired with them
    same = _paired_over({**_low_doses()[1], **final}, runs, setting, study, seeds)
    p = {**_GROUP_WIDE, half: 0.5}
    weight = {"none": "1 (PPO)", wide: "placebo, ** 3.5", wider: "placebo, ** 6", half: "shuffled, ** 0.5"}

    def row(arm: str) -> str:
        lo, hi = extremes[arm][:2]
        return "| " + " | ".join([
            f"`{arm}`", f"{p[arm]:g}", weight[arm], f"{lo:.2f} / {hi:.2f}",
            "-" if arm == "none" else _e(new_k3[arm], 1),
            "-" if arm == "none" else _quoted(paired(arm, "none")),
            "-" if arm == "none" else _quoted(paired(arm, "none", key="greedy_reward")),
            f"{np.mean([final[arm, s] for s in seeds]):.3f}",
            str(arms[arm]["steps_to_threshold"]["reached"]), str(arms[arm]["collapse"]["k"])]) + " |"

    by_k3 = sorted(rewritten, key=k3.get)
    slope = _dose_slope(final, seeds, study, _GROUP_WIDE)
    at_bound = {a: np.mean([r["is_weight_max"] >= 2 - 1e-6 for s in seeds for r in runs[setting, a, s][0]])
                for a in (wide, wider)}
    wall = {k: [runs[setting, a, s][1]["wall_s"] for a in arms_ for s in seeds]
            for k, arms_ in (("wide", (wide, wider)), ("half", (half,)))}
    mde = {a: _paired_mde(paired(a, "none")) for a in (wide, wider)}
    blocks = {"Zen 5": paired(half, "none"), "Intel": low_cost[half]}
    # the half dose over both blocks, each pair from one kind of machine: the Intel VM's seeds 100-199 and these
    both = _paired_over({**_token_weights()[1], **final}, runs, setting, study, range(100, 300))(half, "none")
    hours = {k: sum(w) / 3600 for k, w in wall.items()}
    return [
        *(f"{len(wall[k])} runs, about {np.mean(wall[k]):.0f} s per run, {hours[k]:.1f} CPU-hours" for k in wall),
        *(row(a) for a in _GROUP_WIDE_ARMS),
        *(_k3_row(a, rewritten, setting, k3, cost) for a in by_k3),
        f"largest weight reached that bound on {at_bound[wide]:.0%} and {at_bound[wider]:.0%} of their steps",
        f"The slope of the final reward on p, fitted per seed over none and the two doses, is {_quoted(slope)} per "
        f"unit of p; wider - wide {_quoted(paired(wider, wide))}",
        f"wide - half {_cost_gap(cost, wide, half)}; wider - shuffled {_cost_gap(cost, wider, sh)}",
        f"wide - quarter {_quoted(same(wide, quarter))}, wide - tenth {_quoted(same(wide, tenth))} and wider - "
        f"quarter {_quoted(same(wider, quarter))}",
        f"detect about {mde[wide]:.3f} and {mde[wider]:.3f}",
        f"half - none {_quoted(paired(half, 'none'))}, against {_quoted(low_cost[half])} on the Intel VM's seeds (the "
        f"two blocks differ by {_cost_gap(blocks, 'Zen 5', 'Intel')})",
        f"wide - half {_quoted(paired(wide, half))}; wider - half {_quoted(paired(wider, half))}",
        f"over both blocks, 200 seeds, the half dose cost {_quoted(both)}",
        f"the token doses' at the same K3 ({low_cost[half]['mean']:.3f} and {low_cost[sh]['mean']:.3f} on the Intel "
        f"VM)",
        f"(the difference's interval runs from {paired(wide, half)['low']:+.3f} to {paired(wide, half)['high']:+.3f})",
        f"resolved only over 200 seeds (the half dose, {both['mean']:.3f})",
        f"The wider dose's weights reach the bound of 2 on {at_bound[wider]:.0%} of its steps",
    ], cost, both, hours


def test_the_placebo_s_wide_doses_at_1_5_come_from_the_archive():
    """docs/study.md on the placebo as spread as the token doses at a rollout temperature of 1.5 (seeds
    200-299, docs/study/sweep-temperature-t1.5/group-wide-doses): each arm's row, the table of every
    rewritten arm by the K3 of its weights, the dose slope, the comparisons with the token doses,
    which differences are resolved and the runs' times, recomputed from the archive; the section
    before points to it, and the answers, the status row and table quote the wide doses."""
    quotes, cost, both, hours = _group_wide_quotes()
    _assert_quoted(quotes, _section("The placebo as spread as the token doses"))
    assert "The next section runs it, at p = 3.5 and 6." in _section("The shuffled weights at a tenth and a quarter")
    _, final, _, _, paired, study = _group_wide()
    wide, wider, half = "token_tis_group_permuted_wide", "token_tis_group_permuted_wider", "token_tis_shuffled_half"
    # neither wide dose is resolved from none, from the other or from the half dose on the same seeds, nor is the
    # half dose from none on these seeds; the slope on p is not resolved either
    assert not any(paired(a, b)["excludes_zero"] for a, b in ((wide, "none"), (wider, "none"), (wider, wide),
                                                             (wide, half), (wider, half), (half, "none")))
    assert not _dose_slope(final, _GROUP_WIDE_SEEDS, study, _GROUP_WIDE)["excludes_zero"]
    q = {a: _quoted(cost[a]) for a in (wide, wider)}
    _assert_quoted([f"group weights as spread as the half dose and the shuffled weights cost {q[wide]} and {q[wider]} "
                    f"on the same seeds (Zen 5 VM), level with the half dose on those seeds "
                    f"({_quoted(paired(wide, half))}): the weights' cost follows their spread"],
                   _section("The answers so far, per mechanism"))
    _assert_quoted([f"the placebo as spread as the half dose and the shuffled weights cost {q[wide]} and {q[wider]}"],
                   _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours['wide']:.1f} for the 200 of the placebo's wide doses and {hours['half']:.1f} for the 100 "
                    f"of the half dose on seeds 200-299 (Zen 5 VM)"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t1.5/dose-curves: every rewritten arm at T = 1.5 on the Intel VM's seeds 100-199
#: with none, so both grains' doses pair with one none on one kind of machine (``{arm: (varies per, p)}``): the
#: noise-dose and token-weights reports' runs (2026-12-02) with the placebo's two wide doses and the shuffled
#: weights' quarter dose, run on a third Intel VM of the same kind (family 6 model 167, AVX-512 kernels) that
#: repeated seed 100 of none bit for bit (2026-12-03).
_DOSE_CURVES = {"none": ("-", 0.0), "token_tis_group_permuted_half": ("group", 0.5), _PLACEBO: ("group", 1.0),
                "token_tis_group_mean": ("group", 1.0), "token_tis_group_permuted_double": ("group", 2.0),
                "token_tis_group_permuted_wide": ("group", 3.5), "token_tis_group_permuted_wider": ("group", 6.0),
                "token_tis_shuffled_quarter": ("token", 0.25), "token_tis_shuffled_half": ("token", 0.5),
                "token_tis_shuffled": ("token", 1.0), "token_tis_shuffled_double": ("token", 2.0)}
#: the arms first run on the Intel seeds that session
_CURVE_NEW = ("token_tis_group_permuted_wide", "token_tis_group_permuted_wider", "token_tis_shuffled_quarter")


@functools.cache
def _dose_curves() -> tuple:
    """The dose-curves report at T = 1.5 (docs/study/sweep-temperature-t1.5/dose-curves;
    :func:`_one_vm_report` on the Intel VMs): its arms :data:`_DOSE_CURVES` at seeds 100-199, each
    arm's power its ``REWRITE_EXPONENT`` and its grain its rewrite's."""
    from megatron_mis.testbed.demo.config import REWRITE_EXPONENT, REWRITTEN_TIS

    grain = {"group_mean_permuted": "group", "group_mean": "group", "shuffle": "token"}
    assert {a: (grain[REWRITTEN_TIS[a]], REWRITE_EXPONENT.get(a, 1.0)) for a in _DOSE_CURVES if a != "none"} == {
        a: v for a, v in _DOSE_CURVES.items() if a != "none"}
    return _one_vm_report("dose-curves", _DOSE_CURVES)


@functools.cache
def _dose_curve_quotes() -> tuple[list[str], dict, dict, dict]:
    """The figures of docs/study.md's section on both grains' dose curves on the Intel seeds 100-199
    (:func:`_dose_curves`), recomputed from the archive: the table of every arm by the K3 of its
    weights, how often the wide doses' weights reached the bound of 2, the group doses' slope on p, the
    arms of the same K3 against each other, the new arms over both machines' 200 seeds (each block
    against its own none: seeds 200-299 from :func:`_group_wide` and :func:`_low_doses`), the two
    blocks against each other, which differences are resolved and the runs' times; with the new
    arms' and the half dose's costs over 200 seeds, the CPU-hours of the new runs
    (``{"wide": h, "quarter": h}``) and the placebo doses' slope on p."""
    import numpy as np

    arms, final, runs, setting, paired, study = _dose_curves()
    wide, wider = "token_tis_group_permuted_wide", "token_tis_group_permuted_wider"
    quarter, half, sh = "token_tis_shuffled_quarter", "token_tis_shuffled_half", "token_tis_shuffled"
    double = "token_tis_group_permuted_double"
    seeds = _NOISE_SEEDS
    k3 = {a: _weights_k3(runs, setting, a, seeds) for a in _DOSE_CURVES}
    for a in _DOSE_CURVES:  # the report's own K3, averaged the same way
        assert k3[a] == pytest.approx(arms[a]["k3_mean"][0], rel=1e-9), a
    by_k3 = sorted((a for a in _DOSE_CURVES if a != "none"), key=k3.get)
    cost = {a: paired(a, "none") for a in by_k3}
    low = [a for a in by_k3 if k3[a] < 1e-2]

    def row(arm: str) -> str:
        per, p = _DOSE_CURVES[arm]
        lo, hi = _weight_extremes(setting, runs, arm, len(seeds), seeds[0])[:2]
        rest = ["-"] * 3 if arm == "none" else [_e(k3[arm], 1), _quoted(cost[arm]),
                                                 _quoted(paired(arm, "none", key="greedy_reward"))]
        return "| " + " | ".join([
            f"`{arm}`", per, "-" if arm == "none" else f"{p:g}", f"{lo:.2f} / {hi:.2f}", *rest,
            f"{np.mean([final[arm, s] for s in seeds]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
            str(arms[arm]["collapse"]["k"])]) + " |"

    at_bound = {a: np.mean([r["is_weight_max"] >= 2 - 1e-6 for s in seeds for r in runs[setting, a, s][0]])
                for a in (wide, wider)}
    group = {a: p for a, (per, p) in _DOSE_CURVES.items() if per == "group" and a != "token_tis_group_mean"}
    slope = _dose_slope(final, seeds, study, {"none": 0.0, **group})
    # seeds 200-299, each pair from one kind of machine: none, the wide doses and the half dose (Zen 4 / Zen 5 VMs)
    # and the quarter dose (the Zen 4 VM)
    zen_final = {**_low_doses()[1], **_group_wide()[1]}
    zen = _paired_over(zen_final, runs, setting, study, _GROUP_WIDE_SEEDS)
    both = _paired_over({**final, **zen_final}, runs, setting, study, range(100, 300))
    pooled = {a: both(a, "none") for a in (*_CURVE_NEW, half)}
    blocks = {a: _cost_gap({"Intel": paired(a, "none"), "Zen": zen(a, "none")}, "Intel", "Zen")
              for a in _CURVE_NEW}
    mde = {a: _paired_mde(pooled[a]) for a in _CURVE_NEW}
    wall = {k: [runs[setting, a, s][1]["wall_s"] for a in arms_ for s in seeds]
            for k, arms_ in (("wide", (wide, wider)), ("quarter", (quarter,)))}
    hours = {k: sum(w) / 3600 for k, w in wall.items()}
    return [
        *(f"{len(wall[k])} runs, about {np.mean(wall[k]):.0f} s per run, {hours[k]:.1f} CPU-hours" for k in wall),
        row("none"), *(row(a) for a in by_k3),
        f"largest weight reached the bound of 2 on {at_bound[wide]:.0%} and {at_bound[wider]:.0%} of their steps here",
        f"slope of the final reward on p over none and the five placebo doses is {_quoted(slope)} per unit of p",
        f"Below K3 1e-2 no arm of either grain is resolved from none ({min(cost[a]['mean'] for a in low):+.3f} to "
        f"{max(cost[a]['mean'] for a in low):+.3f}); above it every arm is but the wide dose "
        f"({_quoted(cost[wide])}): the wider dose {_quoted(cost[wider])}",
        f"wide - half {_quoted(paired(wide, half))}; wider - shuffled {_quoted(paired(wider, sh))}; quarter - the "
        f"placebo's double {_quoted(paired(quarter, double))}",
        f"against its own none): wide {_quoted(pooled[wide])}, wider {_quoted(pooled[wider])}, quarter "
        f"{_quoted(pooled[quarter])}, half {_quoted(pooled[half])}",
        f"(over 200 seeds wide - half {_quoted(both(wide, half))})",
        f"they differ by {blocks[wide]} (wide), {blocks[wider]} (wider) and {blocks[quarter]} (quarter)",
        f"the Intel seeds the quarter dose cost {_quoted(cost[quarter])}, on the Zen 4 VM's "
        f"{_quoted(zen(quarter, 'none'))}",
        f"the quarter dose (K3 {_e(k3[quarter], 1)}, {_quoted(pooled[quarter])} over 200 seeds) may cost a little: its "
        f"interval reaches {pooled[quarter]['low']:+.3f}",
        f"the half dose's spread it cost about {pooled[wide]['mean'] / pooled[half]['mean']:.0%} as much over 200 "
        f"seeds ({pooled[wide]['mean']:+.3f} against {pooled[half]['mean']:+.3f}), unresolved",
        f"detect about {mde[wide]:.3f}, {mde[wider]:.3f} and {mde[quarter]:.3f}",
    ], pooled, hours, slope


def test_both_grains_dose_curves_at_1_5_come_from_the_archive():
    """docs/study.md on both grains' dose curves at a rollout temperature of 1.5 on the Intel seeds
    100-199 (docs/study/sweep-temperature-t1.5/dose-curves): the table of every arm by the K3 of its
    weights, the group doses' slope, the same-K3 comparisons, the new arms over both machines' 200
    seeds, which differences are resolved and the runs' times, recomputed from the archive; the
    section before points to it, and the answers, the status table quote it."""
    quotes, pooled, hours, slope = _dose_curve_quotes()
    _assert_quoted(quotes, _section("Both grains' dose curves on one machine's seeds"))
    assert "The next section runs both wide doses and the quarter dose on the Intel VM's seeds." in _section(
        "The placebo as spread as the token doses")
    paired = _dose_curves()[4]
    wide, wider = "token_tis_group_permuted_wide", "token_tis_group_permuted_wider"
    quarter, half = "token_tis_shuffled_quarter", "token_tis_shuffled_half"
    # on the Intel seeds: the wider dose and the placebo's dose slope are resolved, the wide and the quarter dose
    # are not, nor is any pair of the same K3
    assert paired(wider, "none")["excludes_zero"] and slope["excludes_zero"]
    assert not any(paired(a, b)["excludes_zero"] for a, b in (
        (wide, "none"), (quarter, "none"), (wide, half), (wider, "token_tis_shuffled"),
        (quarter, "token_tis_group_permuted_double")))
    # over 200 seeds: only the wider and the half dose
    assert [a for a in pooled if pooled[a]["excludes_zero"]] == [wider, half]
    q, slope = {a: _quoted(pooled[a]) for a in pooled}, _quoted(slope)
    _assert_quoted([f"with both grains' doses beside one none on the Intel seeds the placebo's cost rose with its "
                    f"power ({slope} per unit of p), and over 200 seeds of two machines the placebo as spread as the "
                    f"shuffled weights cost {q[wider]}, as spread as the half dose {q[wide]} and the quarter dose "
                    f"{q[quarter]}"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours['wide']:.1f} for the 200 of the placebo's wide doses and {hours['quarter']:.1f} for the "
                    f"100 of the quarter dose on seeds 100-199 (Intel VM)"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t0.5/shuffled-intel: none and token TIS's weights shuffled onto random tokens at a
#: rollout-only temperature of 0.5, seeds 100-199 on the third Intel VM of family 6 model 167 (2026-12-03), the VM
#: of the dose-curves report's new arms, then token TIS on the same seeds and VM
_T05_SHUFFLED_ARMS = ("none", "token_tis_shuffled", "token_tis")


def _report_seeds(report: tuple) -> range:
    """The seeds of a :func:`_one_vm_report` (every arm's, checked there to be the same consecutive range)."""
    seeds = report[0]["none"]["seeds"]
    return range(seeds[0], seeds[-1] + 1)


def _shuffled_row(report: tuple, k3: dict, arm: str) -> str:
    """``arm``'s row of a shuffled-intel or shuffled-zen4 section's table (``report``: :func:`_one_vm_report` of
    :data:`_T05_SHUFFLED_ARMS`; ``k3``: each arm's :func:`_weights_k3`): smallest / largest weight, K3, the final and
    the greedy reward against none, the mean final reward, the runs that reached 0.5 and the collapses."""
    import numpy as np

    arms, final, runs, setting, paired, _ = report
    seeds = _report_seeds(report)
    lo, hi = _weight_extremes(setting, runs, arm, len(seeds), seeds[0])[:2]
    return "| " + " | ".join([
        f"`{arm}`", f"{lo:.2f} / {hi:.2f}", _e(k3[arm], 1),
        "-" if arm == "none" else _quoted(paired(arm, "none")), "-" if arm == "none" else _quoted(
            paired(arm, "none", key="greedy_reward")),
        f"{np.mean([final[arm, s] for s in seeds]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
        str(arms[arm]["collapse"]["k"])]) + " |"


@functools.cache
def _t05_shuffled_quotes() -> tuple[list[str], dict, dict, dict]:
    """The figures of docs/study.md's section on the shuffled weights at T = 0.5 (seeds 100-199 of the
    Intel VM; :func:`_shuffled_intel`), recomputed from the archive: each arm's row, the MDE, the same
    arm at T = 1.5 on the same seeds (:func:`_dose_curves`), token TIS at T = 0.5 on the AVX2 VM's
    seeds 0-59 (docs/study/sweep-temperature-t0.5), token TIS on these seeds and the runs' times;
    with the shuffled weights' and token TIS's costs against none and the CPU-hours of their runs
    (``{"shuffled": h, "token TIS": h}``: none's runs with the shuffled weights')."""
    import numpy as np

    report = _shuffled_intel("0.5")
    _, _, runs, setting, paired, _ = report
    sh, seeds = "token_tis_shuffled", _NOISE_SEEDS
    k3, (_, *rows), mde, _ = _shuffled_figures(report)
    cost = paired(sh, "none")

    _, _, hot_runs, hot_setting, hot_paired, _ = _dose_curves()
    hot = {"T = 0.5": cost, "T = 1.5": hot_paired(sh, "none")}
    hot_k3 = _weights_k3(hot_runs, hot_setting, sh, seeds)
    t05 = _summary("sweep-temperature-t0.5", ".")["doses"][0]["arms"]["token_tis"]["vs_none"]["final_reward"]
    wall = {k: [runs[setting, a, s][1]["wall_s"] for a in arms_ for s in seeds]
            for k, arms_ in (("shuffled", ("none", sh)), ("token TIS", ("token_tis",)))}
    tis = paired("token_tis", "none")
    hours = {k: sum(w) / 3600 for k, w in wall.items()}
    return [
        *(f"{len(wall[k])} runs, about {np.mean(wall[k]):.0f} s per run, {hours[k]:.1f} CPU-hours" for k in wall),
        f"token TIS cost {_quoted(tis)} against none on these seeds; the shuffled weights - token TIS "
        f"{_quoted(paired(sh, 'token_tis'))}",
        *rows,
        f"the shuffled weights cost {_quoted(cost)} against none at T = 0.5",
        f"100 seeds detect about {mde:.3f}",
        f"at T = 1.5 on the same seeds they cost {_quoted(hot['T = 1.5'])} (K3 of the weights {_e(hot_k3, 1)})",
        f"two temperatures' costs differ by {_cost_gap(hot, 'T = 0.5', 'T = 1.5')}",
        f"token TIS cost {_quoted(t05)} against none at T = 0.5",
        f"so their K3 is that of the arm's own pairs ({_e(k3[sh], 1)} here, none's {_e(k3['none'], 1)}), "
        f"{k3[sh] / hot_k3:.1f} times the shuffled weights' K3 at T = 1.5",
    ], cost, tis, hours


def test_the_shuffled_weights_at_0_5_come_from_the_archive():
    """docs/study.md on the shuffled weights at a rollout temperature of 0.5 (seeds 100-199 of the
    Intel VM, docs/study/sweep-temperature-t0.5/shuffled-intel): each arm's row, the cost against
    none and at T = 1.5 on the same seeds, token TIS at T = 0.5 and the runs' times, recomputed from
    the archive; the section before points to it, and the answers quote the cost."""
    quotes, cost, tis, hours = _t05_shuffled_quotes()
    _assert_quoted(quotes, _section("The shuffled weights at T = 0.5"))
    assert cost["excludes_zero"] and _shuffled_intel("0.5")[4]("token_tis_shuffled", "token_tis")["excludes_zero"]
    assert not tis["excludes_zero"]
    assert "The next section runs the shuffled weights at T = 0.5." in _section("Both grains' dose curves")
    _assert_quoted([f"at T = 0.5 token TIS's weights shuffled onto random tokens cost {_quoted(cost)} on 100 seeds of "
                    f"an Intel VM"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours['shuffled']:.1f} for the 200 of the shuffled weights and none at t0.5 on seeds 100-199 "
                    f"(Intel VM) and {hours['token TIS']:.1f} for the 100 of token TIS there"],
                   _section("What has been run, and what the rest would cost"))


#: The shuffled-intel reports: T = 0.5's (above), and docs/study/sweep-temperature-t1.25/shuffled-intel and
#: t0.75/shuffled-intel, its arms at rollout-only temperatures of 1.25 and then 0.75, seeds 100-199 on the same
#: third Intel VM of family 6 model 167, a session later (2026-12-03; 0.75 queued before any run of 1.25 ended)
@functools.cache
def _shuffled_intel(temperature: str) -> tuple:
    """The shuffled-intel report at a rollout temperature (docs/study/sweep-temperature-tT/shuffled-intel;
    :func:`_one_vm_report` on the Intel VM): none, the shuffled weights and token TIS at seeds 100-199."""
    return _one_vm_report("shuffled-intel", _T05_SHUFFLED_ARMS, _NOISE_SEEDS, _INTEL,
                          f"sweep-temperature-t{temperature}")


@functools.cache
def _placement(temperatures: tuple[str, ...] = ("0.5", "1.25", "1.5")) -> dict:
    """Token TIS's weights in place and shuffled onto random tokens at rollout-only temperatures where both ran on
    the Intel seeds 100-199 (T = 1.5: the token-weights report, :func:`_token_weights`; the T = 1.25 section's
    table: the default three): ``{T: (the shuffled weights' K3, shuffled - none, token TIS - none,
    shuffled - token TIS)}``."""
    sh, out = "token_tis_shuffled", {}
    for t in temperatures:
        _, _, runs, setting, paired, _ = _token_weights() if t == "1.5" else _shuffled_intel(t)
        out[t] = (_weights_k3(runs, setting, sh, _NOISE_SEEDS), paired(sh, "none"), paired("token_tis", "none"),
                  paired(sh, "token_tis"))
    return out


def _shuffled_figures(report: tuple) -> tuple[dict, list[str], float, float]:
    """The figures a shuffled-intel or shuffled-zen4 report's section quotes of its own runs (``report``:
    :func:`_one_vm_report` of :data:`_T05_SHUFFLED_ARMS`): each arm's K3 (checked against the report's), its lines
    (the runs, their mean time and CPU-hours, and each arm's row), the MDE of the shuffled weights against
    none and the CPU-hours."""
    arms, _, runs, setting, paired, _ = report
    seeds = _report_seeds(report)
    k3 = {a: _weights_k3(runs, setting, a, seeds) for a in _T05_SHUFFLED_ARMS}
    for a in _T05_SHUFFLED_ARMS:  # the report's own K3, averaged the same way
        assert k3[a] == pytest.approx(arms[a]["k3_mean"][0], rel=1e-9), a
    mde = _paired_mde(paired("token_tis_shuffled", "none"))
    line, hours = _runs_line(runs, setting, _T05_SHUFFLED_ARMS, seeds)
    return k3, [line,
                *(_shuffled_row(report, k3, a) for a in _T05_SHUFFLED_ARMS)], mde, hours


def _placement_rows(place: dict) -> list[str]:
    """The rows of a placement table (:func:`_placement`): T, the shuffled weights' K3, their cost and token TIS's
    against none, and shuffled - token TIS."""
    return [f"| {t} | {_e(k, 1)} | {_quoted(s)} | {_quoted(i)} | {_quoted(g)} |" for t, (k, s, i, g) in place.items()]


@functools.cache
def _t125_shuffled_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on the weights in place and shuffled at T = 1.25 (seeds
    100-199 of the Intel VM; :func:`_shuffled_intel`), recomputed from the archives: each arm's row, the
    three temperatures' placement table (:func:`_placement`), the MDE, token TIS at T = 1.25 on the
    AVX2 VM's seeds 0-59 (docs/study/sweep-temperature-t1.25), the shuffled weights' K3 beside the
    half dose's at T = 1.5 and that dose's cost over 200 seeds (:func:`_dose_curve_quotes`), and the
    runs' times; with :func:`_placement` and the runs' CPU-hours."""
    report = _shuffled_intel("1.25")
    sh, half, seeds = "token_tis_shuffled", "token_tis_shuffled_half", _NOISE_SEEDS
    k3, table, mde, hours = _shuffled_figures(report)
    place = _placement()
    assert place["1.25"][0] == k3[sh]
    cost, tis, gap = place["1.25"][1:]
    avx2 = _summary("sweep-temperature-t1.25", ".")["doses"][0]["arms"]["token_tis"]["vs_none"]["final_reward"]
    _, _, hot_runs, hot_setting, _, _ = _dose_curves()
    half_k3, half_cost = _weights_k3(hot_runs, hot_setting, half, seeds), _dose_curve_quotes()[1][half]
    return [
        *table, *_placement_rows(place),
        f"the shuffled weights cost {_quoted(cost)} against none at T = 1.25 (100 seeds detect about {mde:.3f})",
        f"token TIS cost {_quoted(tis)} against none on these seeds ({_quoted(avx2)} on the AVX2 VM's seeds 0-59)",
        f"the shuffled weights - token TIS {_quoted(gap)}",
        f"the shuffled weights' K3 here is {_e(k3[sh], 1)}, {k3[sh] / half_k3:.1f} times that of the half dose at "
        f"T = 1.5 ({_e(half_k3, 1)}), which cost {_quoted(half_cost)} over 200 seeds",
    ], place, hours


def test_the_weights_in_place_and_shuffled_at_1_25_come_from_the_archive():
    """docs/study.md on token TIS's weights in place and shuffled onto random tokens at a rollout
    temperature of 1.25 (seeds 100-199 of the Intel VM, docs/study/sweep-temperature-t1.25/shuffled-intel):
    each arm's row, the three temperatures' placement table, token TIS on the AVX2 VM's seeds, the
    spread-matched dose at T = 1.5 and the runs' times, recomputed from the archives; which differences
    resolve; the section before points to it, and the answers and the plan quote it."""
    quotes, place, hours = _t125_shuffled_quotes()
    _assert_quoted(quotes, _section("Token TIS's weights in place and shuffled at T = 1.25"))
    # the placement gap resolves at T = 0.5 only; at 1.25 token TIS's cost resolves, its shuffled weights' does not
    assert [t for t in place if place[t][3]["excludes_zero"]] == ["0.5"]
    assert place["1.25"][2]["excludes_zero"] and not place["1.25"][1]["excludes_zero"]
    assert "The next section runs the same three arms at T = 1.25." in _section("The shuffled weights at T = 0.5")
    sh, tis, gap = (_quoted(x) for x in place["1.25"][1:])
    _assert_quoted([f"while at T = 1.25 on the same seeds the shuffled weights cost {sh} and token TIS in place {tis}, "
                    f"level with each other ({gap})"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 300 of none, the shuffled weights and token TIS at t1.25 on seeds 100-199 "
                    f"(Intel VM)"], _section("What has been run, and what the rest would cost"))


@functools.cache
def _t075_shuffled_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on the weights in place and shuffled at T = 0.75 (seeds
    100-199 of the Intel VM; :func:`_shuffled_intel`), recomputed from the archives: each arm's row, the
    four temperatures' placement table (:func:`_placement`), the MDE, the archive's size and the runs'
    times; with the placement and the runs' CPU-hours."""
    report = _shuffled_intel("0.75")
    runs, sh = report[2], "token_tis_shuffled"
    k3, table, mde, hours = _shuffled_figures(report)
    place = _placement(("0.5", "0.75", "1.25", "1.5"))
    cost, tis, gap = place["0.75"][1:]
    return [
        *table, *_placement_rows(place),
        f"the shuffled weights cost {_quoted(cost)} against none at T = 0.75 (100 seeds detect about {mde:.3f})",
        f"token TIS cost {_quoted(tis)} against none on these seeds; the shuffled weights - token TIS {_quoted(gap)}",
        f"none's K3 here is {_e(k3['none'], 1)}, the shuffled weights' {_e(k3[sh], 1)}",
        f"`docs/study/sweep-temperature-t0.75/runs` ({len(runs)} runs, "
        f"{_archive_bytes('sweep-temperature-t0.75') / 1e6:.1f} MB)",
    ], place, hours


def test_the_weights_in_place_and_shuffled_at_0_75_come_from_the_archive():
    """docs/study.md on token TIS's weights in place and shuffled at a rollout temperature of 0.75
    (seeds 100-199 of the Intel VM, docs/study/sweep-temperature-t0.75/shuffled-intel): each arm's row,
    the four temperatures' placement table, the archive and the runs' times, recomputed from the
    archives; that nothing resolves at 0.75 while the shuffled weights there are more spread than at
    1.25; the section before points to it, and the answers and the plan quote it."""
    quotes, place, hours = _t075_shuffled_quotes()
    _assert_quoted(quotes, _section("Token TIS's weights in place and shuffled at T = 0.75"))
    assert not any(place["0.75"][i]["excludes_zero"] for i in (1, 2, 3))
    # more spread by K3 at 0.75 than at 1.25, yet cheaper there
    assert place["0.75"][0] > place["1.25"][0] and place["0.75"][1]["mean"] > place["1.25"][1]["mean"] + 0.03
    assert "The next section runs it." in _section("Token TIS's weights in place and shuffled at T = 1.25")
    sh, tis = (_quoted(x) for x in place["0.75"][1:3])
    _assert_quoted([f"and at T = 0.75 neither cost (the shuffled weights {sh}, token TIS {tis})"],
                   _section("The answers so far, per mechanism"))
    _assert_quoted([f"(Intel VM) and {hours:.1f} for the 300 of them at t0.75"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t0.5/shuffled-zen4: the shuffled-intel report's three arms at T = 0.5 on seeds
#: 200-299 of a Zen 4 VM (family 25 model 17, AVX-512 kernels; 2026-12-04), a second kind of VM whose trajectories
#: differ from the Intel VM's: the only temperature where the weights' placement resolved, repeated
@functools.cache
def _shuffled_zen4() -> tuple:
    """The shuffled-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): none, the shuffled weights and token TIS at
    T = 0.5, seeds 200-299."""
    return _one_vm_report("shuffled-zen4", _T05_SHUFFLED_ARMS, _LOW_SEEDS, _ZEN4, "sweep-temperature-t0.5")


@functools.cache
def _t05_zen4_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on the weights in place and shuffled at T = 0.5 on the Zen 4 VM's seeds
    200-299 (:func:`_shuffled_zen4`), recomputed from the archive: each arm's row, the machines' table (the Intel
    seeds 100-199, these, and both pooled over 200 seeds), the MDEs, the machines' gaps and the runs' times; with
    ``{machine: (shuffled - none, token TIS - none, shuffled - token TIS)}`` (``"both"``: the two pooled;
    ``"three"``: token TIS - none alone, over the AVX2 VM's seeds 0-59 too) and the CPU-hours."""
    report = _shuffled_zen4()
    _, final, runs, setting, paired, study = report
    sh, tis = "token_tis_shuffled", "token_tis"
    k3, table, mde, hours = _shuffled_figures(report)
    both = _paired_over(final, runs, setting, study, range(100, 300))
    _, _, intel_runs, intel_setting, intel, _ = _shuffled_intel("0.5")
    intel_k3 = {a: _weights_k3(intel_runs, intel_setting, a, _NOISE_SEEDS) for a in ("none", sh)}
    pairs = ((sh, "none"), (tis, "none"), (sh, tis))
    machines = {"Intel": tuple(intel(*p) for p in pairs), "Zen 4": tuple(paired(*p) for p in pairs),
                "both": tuple(both(*p) for p in pairs)}
    labels = {"Intel": "100-199", "Zen 4": "200-299", "both": "100-299"}
    pooled_mde = _paired_mde(machines["both"][0])
    cost, in_place, gap = machines["Zen 4"]
    gaps = _cost_gap({"Intel": machines["Intel"][2], "Zen 4": gap}, "Intel", "Zen 4")
    # token TIS with the AVX2 VM's seeds 0-59 too (the T = 0.5 report's, docs/study/sweep-temperature-t0.5): the
    # same archive and dose, so one paired function covers all three machines' seeds
    three = both(tis, "none", (*range(60), *range(100, 300)))
    avx2 = _summary("sweep-temperature-t0.5", ".")["doses"][0]["arms"][tis]
    return [
        *table,
        *(f"| {m} | {labels[m]} | " + " | ".join(_quoted(d) for d in machines[m]) + " |" for m in machines),
        f"the shuffled weights cost {_quoted(cost)} against none at T = 0.5 on these seeds (100 seeds detect about "
        f"{mde:.3f}), not resolved; pooled they cost {machines['both'][0]['mean']:+.3f}, resolved",
        f"token TIS - none was {_quoted(in_place)} on these seeds",
        f"the shuffled weights - token TIS {_quoted(gap)}, about the Intel seeds' {machines['Intel'][2]['mean']:+.3f}",
        f"With the AVX2 VM's seeds 0-59 ({_quoted(avx2['vs_none']['final_reward'])} there) token TIS - none is "
        f"{_quoted(three)} over {len(three['diffs'])} seeds of three kinds of machine",
        f"none - reference was {_quoted(_summary('sweep-temperature-t0.5', '.')['doses'][0]['none_vs_reference'])} and "
        f"token TIS - reference {_quoted(avx2['vs_reference']['final_reward'])}",
        f"Token TIS took off in {report[0][tis]['steps_to_threshold']['reached']} of 100 runs here (none "
        f"{report[0]['none']['steps_to_threshold']['reached']}, the shuffled weights "
        f"{report[0][sh]['steps_to_threshold']['reached']})",
        f"they sit {-machines['both'][2]['mean']:.3f} above the same weights on random tokens and "
        f"{machines['both'][1]['mean']:.3f} above no weight",
        f"none's K3 here is {_e(k3['none'], 1)}, the shuffled weights' {_e(k3[sh], 1)} ({_e(intel_k3['none'], 1)} and "
        f"{_e(intel_k3[sh], 1)} on the Intel seeds)",
        f"the two machines' gaps differ by {gaps}",
        f"over 200 seeds of both machines the shuffled weights cost {_quoted(machines['both'][0])} against none (200 "
        f"seeds detect about {pooled_mde:.3f}), token TIS {_quoted(machines['both'][1])} and the shuffled weights - "
        f"token TIS {_quoted(machines['both'][2])}",
    ], {**machines, "three": (three,)}, hours


def test_the_weights_in_place_and_shuffled_at_0_5_on_the_zen4_seeds_come_from_the_archive():
    """docs/study.md on token TIS's weights in place and shuffled at a rollout temperature of 0.5 on a second kind of
    VM (seeds 200-299 of the Zen 4 VM, docs/study/sweep-temperature-t0.5/shuffled-zen4): each arm's row, the two
    machines' table and their pooled 200 seeds, token TIS over 260 seeds of three machines and the runs' times,
    recomputed from the archives; that the placement gap the Intel seeds showed repeats here, and which of
    the other differences resolve; the section before points to it, and the answers and the plan quote it."""
    quotes, machines, hours = _t05_zen4_quotes()
    _assert_quoted(quotes, _section("Token TIS's weights in place and shuffled at T = 0.5, on a Zen 4 VM's seeds"))
    (cost, tis, gap), pooled, (three,) = machines["Zen 4"], machines["both"], machines["three"]
    # the pre-stated repeat: shuffled - token TIS below 0, excluding it, on these seeds as on the Intel seeds
    assert gap["excludes_zero"] and gap["high"] < 0 and machines["Intel"][2]["high"] < 0
    # here token TIS is ahead of none and the shuffled weights' cost is not resolved; pooled, all three are
    assert tis["excludes_zero"] and tis["low"] > 0 and not cost["excludes_zero"]
    assert all(d["excludes_zero"] for d in pooled) and pooled[0]["high"] < 0 < pooled[1]["low"]
    assert three["excludes_zero"] and three["low"] > 0 and len(three["diffs"]) == 260
    assert "The next section repeats T = 0.5 on a second kind of VM." in _section(
        "Token TIS's weights in place and shuffled at T = 0.75")
    q = {k: [_quoted(d) for d in v] for k, v in machines.items()}
    _assert_quoted([f"and over 200 seeds of that and a Zen 4 VM the shuffled weights cost {q['both'][0]} and token TIS "
                    f"in place {q['both'][1]} ({q['three'][0]} over 260 seeds of three kinds of machine), the shuffled "
                    f"weights - token TIS {machines['Intel'][2]['mean']:+.3f} and {gap['mean']:+.3f} on each "
                    f"machine's seeds",
                    f"there no weight helped beyond token TIS's {q['three'][0]} at T = 0.5 (260 seeds of three kinds "
                    f"of machine)"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 300 of them at t0.5 on seeds 200-299 (Zen 4 VM)"],
                   _section("What has been run, and what the rest would cost"))


def _reference_table(report: tuple, sweep: str, name: str, arm_names, seeds, ended_low: bool = True) -> tuple:
    """The table and noise of a reference-zen4 report (``report``: :func:`_one_vm_report` of ``arm_names`` at
    ``seeds``, docs/study/``sweep``/``name``): each arm's row (K3, against the reference and none, mean final reward,
    runs that reached 0.5, collapsed and, with ``ended_low``, ended low), none - reference, its paired SD, the MDE
    and the seeds a 0.05 difference needs, each checked against the report's summary.json; as ``(rows,
    none - reference, SD, MDE, seeds for 0.05)``."""
    import numpy as np

    arms, final, _, _, paired, _ = report
    ref = "ref_fp32"
    none_ref = paired("none", ref)
    summary = _summary(sweep, name)
    assert _quoted(none_ref) == _quoted(summary["doses"][0]["none_vs_reference"])
    sd, mde, needed = _paired_noise(none_ref, summary)

    def row(arm: str) -> str:
        vs_ref = "-" if arm == ref else _quoted(paired(arm, ref))
        vs_none = "-" if arm == "none" else _quoted(paired(arm, "none"))
        counts = [arms[arm]["steps_to_threshold"]["reached"], arms[arm]["collapse"]["k"]]
        counts += [arms[arm]["ended_low"]["k"]] if ended_low else []
        return "| " + " | ".join([f"`{arm}`", _e(arms[arm]["k3_mean"][0], 1), vs_ref, vs_none,
                                  f"{np.mean([final[arm, s] for s in seeds]):.3f}", *map(str, counts)]) + " |"

    return [row(a) for a in arm_names], none_ref, sd, mde, needed


#: docs/study/sweep-temperature-t0.5/reference-zen4: the reference (the trainer at the rollout's T = 0.5) on the
#: Zen 4 VM's seeds 200-299, right after the shuffled-zen4 runs on the same VM, beside those three arms
_T05_REFERENCE_ARMS = ("none", "ref_fp32", "token_tis_shuffled", "token_tis")


@functools.cache
def _reference_zen4() -> tuple:
    """The reference-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): :data:`_T05_REFERENCE_ARMS` at T = 0.5,
    seeds 200-299."""
    return _one_vm_report("reference-zen4", _T05_REFERENCE_ARMS, _LOW_SEEDS, _ZEN4, "sweep-temperature-t0.5")


@functools.cache
def _t05_reference_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on the reference at T = 0.5 on the Zen 4 VM's seeds 200-299
    (:func:`_reference_zen4`), recomputed from the archive: each arm's row against the reference and none, the paired
    SD of none - reference and the MDE and seeds a 0.05 difference needs, none and token TIS against the reference
    over these seeds and the AVX2 VM's seeds 0-59 (160 seeds of two machines) and the runs' times; with ``{name:
    paired difference}`` and the CPU-hours."""
    report = _reference_zen4()
    arms, _, runs, setting, paired, _ = report
    seeds, ref = _LOW_SEEDS, "ref_fp32"
    two = (*range(60), *seeds)
    rows, none_ref, sd, mde, needed = _reference_table(report, "sweep-temperature-t0.5", "reference-zen4",
                                                       _T05_REFERENCE_ARMS, seeds, ended_low=False)
    figures = {"none - ref": none_ref, "token TIS - ref": paired("token_tis", ref),
               "none - ref, 160": paired("none", ref, two), "token TIS - ref, 160": paired("token_tis", ref, two)}
    line, hours = _runs_line(runs, setting, (ref,), seeds)
    return [
        line,
        *rows,
        f"none - reference was {_quoted(figures['none - ref'])} on these seeds and token TIS - reference "
        f"{_quoted(figures['token TIS - ref'])}",
        f"The paired SD of none - reference is {sd:.3f}, so 100 seeds detect about {mde:.3f} and a 0.05 difference "
        f"needs {needed}",
        f"over 160 seeds of both machines none - reference is {_quoted(figures['none - ref, 160'])} and token TIS - "
        f"reference {_quoted(figures['token TIS - ref, 160'])}",
        f"The reference never collapsed ({arms[ref]['collapse']['k']} of 100; none {arms['none']['collapse']['k']}, "
        f"token TIS {arms['token_tis']['collapse']['k']})",
    ], figures, hours


def test_the_reference_at_0_5_on_the_zen4_seeds_comes_from_the_archive():
    """docs/study.md on the reference at a rollout temperature of 0.5 on the Zen 4 VM's seeds 200-299
    (docs/study/sweep-temperature-t0.5/reference-zen4): each arm against the reference and none, the paired SD, the
    MDE, none and token TIS against the reference over 160 seeds of two machines and the runs' times,
    recomputed from the archive; that none is level with the reference and token TIS above it; the section before
    points to it, and the answers and the plan quote it."""
    quotes, figures, hours = _t05_reference_quotes()
    _assert_quoted(quotes, _section("The reference at T = 0.5 on the Zen 4 VM's seeds"))
    # the pre-stated questions: none does not fall behind the reference; token TIS lies above it, here and pooled
    assert not figures["none - ref"]["excludes_zero"] and not figures["none - ref, 160"]["excludes_zero"]
    assert figures["token TIS - ref"]["low"] > 0 and figures["token TIS - ref, 160"]["low"] > 0
    assert len(figures["none - ref, 160"]["diffs"]) == 160
    assert "The next section runs the reference on these seeds." in _section(
        "Token TIS's weights in place and shuffled at T = 0.5, on a Zen 4 VM's seeds")
    q = {k: _quoted(v) for k, v in figures.items()}
    _assert_quoted([f"MDE 0.056; {q['none - ref, 160']} over 160 seeds of two machines;",
                    f"and token TIS - reference {q['token TIS - ref, 160']} over 160 seeds of two machines"],
                   _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 100 of the reference there"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t0.5/floor-cap-zen4: token TIS's raise alone (``token_tis_floor1``) and its discount
#: alone (``token_tis_cap1``) at T = 0.5 on the Zen 4 VM's seeds 200-299, a session after the reference-zen4 runs on a
#: VM of the same kind, beside none, the reference and token TIS
_T05_FLOOR_CAP_ARMS = ("none", "ref_fp32", "token_tis", "token_tis_floor1", "token_tis_cap1")
#: each weighed arm's weight, as the T = 1.5 diagnostics' table writes it
_FLOOR_CAP_FORMULAS = {"token_tis": "min(r, 2)", "token_tis_floor1": "clamp(r, 1, 2)", "token_tis_cap1": "min(r, 1)"}


@functools.cache
def _floor_cap_zen4() -> tuple:
    """The floor-cap-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): :data:`_T05_FLOOR_CAP_ARMS` at T = 0.5,
    seeds 200-299."""
    return _one_vm_report("floor-cap-zen4", _T05_FLOOR_CAP_ARMS, _LOW_SEEDS, _ZEN4, "sweep-temperature-t0.5")


@functools.cache
def _t05_floor_cap_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on token TIS's raise and discount apart at T = 0.5 on the Zen 4 VM's
    seeds 200-299 (:func:`_floor_cap_zen4`), recomputed from the archive: each weighed arm's row (its weight, its
    weights' mean smallest and largest value and per-run mean, its final reward against none, token TIS and the
    reference, its greedy reward against none, the runs that reached 0.5 and the collapses), the differences between
    the two halves, the MDE and the runs' times; with ``{name: paired difference}`` and the CPU-hours."""
    import numpy as np

    arms, final, runs, setting, paired, study = _floor_cap_zen4()
    seeds, fl, cap, tis = _LOW_SEEDS, "token_tis_floor1", "token_tis_cap1", "token_tis"
    extremes = {a: _weight_extremes(setting, runs, a, len(seeds), seeds[0]) for a in _FLOOR_CAP_FORMULAS}

    def row(arm: str) -> str:
        lo, hi, m_lo, m_hi = extremes[arm]
        return "| " + " | ".join([
            f"`{arm}`", _FLOOR_CAP_FORMULAS[arm], f"{lo:.2f} / {hi:.2f}", f"{m_lo:.3f}-{m_hi:.3f}",
            _quoted(paired(arm, "none")), "-" if arm == tis else _quoted(paired(arm, tis)),
            _quoted(paired(arm, "ref_fp32")), _quoted(paired(arm, "none", key="greedy_reward")),
            f"{np.mean([final[arm, s] for s in seeds]):.3f}", str(arms[arm]["steps_to_threshold"]["reached"]),
            str(arms[arm]["collapse"]["k"])]) + " |"

    figures = {"floor - none": paired(fl, "none"), "cap - none": paired(cap, "none"),
               "floor - cap": paired(fl, cap), "floor - TIS": paired(fl, tis), "cap - TIS": paired(cap, tis),
               "TIS - none": paired(tis, "none")}
    line, hours = _runs_line(runs, setting, (fl, cap), seeds)
    return [
        line,
        *(row(a) for a in _FLOOR_CAP_FORMULAS),
        f"into the T = 0.5 archive ({len(runs)} runs, {_archive_bytes('sweep-temperature-t0.5') / 1e6:.1f} MB)",
        f"(100 seeds detect about {_paired_mde(figures['floor - none']):.3f} and "
        f"{_paired_mde(figures['cap - none']):.3f})",
        f"token_tis_floor1 - token_tis_cap1 {_quoted(figures['floor - cap'])}",
        f"the raise alone is ahead of none by {_quoted(figures['floor - none'])} and the discount alone by "
        f"{_quoted(figures['cap - none'])}",
        f"Neither is measurably behind token TIS ({_quoted(figures['floor - TIS'])} and {_quoted(figures['cap - TIS'])})",
        f"token TIS's gain over none ({_quoted(figures['TIS - none'])} on these seeds)",
        f"its mean weight per run is {extremes[fl][2]:.3f}-{extremes[fl][3]:.3f}, its largest weight "
        f"{extremes[fl][1]:.2f}), the discount moves many a little ({extremes[cap][2]:.3f}-{extremes[cap][3]:.3f} per "
        f"run, smallest {extremes[cap][0]:.2f})",
        f"none: {np.mean([final['none', s] for s in seeds]):.3f} mean final reward, "
        f"{arms['none']['steps_to_threshold']['reached']} runs reached 0.5, {arms['none']['collapse']['k']} collapsed; "
        f"the reference {np.mean([final['ref_fp32', s] for s in seeds]):.3f}, "
        f"{arms['ref_fp32']['steps_to_threshold']['reached']} and {arms['ref_fp32']['collapse']['k']}",
    ], figures, hours


def test_token_tis_s_raise_and_discount_apart_at_0_5_on_the_zen4_seeds_come_from_the_archive():
    """docs/study.md on token TIS's raise alone (clamp(r, 1, 2)) and its discount alone (min(r, 1)) at a rollout
    temperature of 0.5 on the Zen 4 VM's seeds 200-299 (docs/study/sweep-temperature-t0.5/floor-cap-zen4): each arm's
    row, the differences between the halves and to token TIS, the MDEs, the archive and the runs' times, recomputed
    from the archive; the outcome of the rule fixed before the sweep (both halves ahead of none, neither behind token
    TIS), the T = 1.5 diagnostics' costs it is set beside; the section before points to it, and the answers and the plan
    quote it."""
    quotes, figures, hours = _t05_floor_cap_quotes()
    section = _section("Token TIS's raise and its discount apart at T = 0.5")
    _assert_quoted(quotes, section)
    # the rule fixed before the sweep: "both" when both halves' intervals against none exclude 0 above it
    assert figures["floor - none"]["low"] > 0 and figures["cap - none"]["low"] > 0
    assert "**Both halves carry it**, by the rule fixed before the sweep" in section
    # "neither is measurably behind token TIS, nor are they apart"
    assert not any(figures[k]["excludes_zero"] for k in ("floor - TIS", "cap - TIS", "floor - cap"))
    t15 = _summary("sweep-temperature-t1.5", ".")["doses"][0]["arms"]
    _assert_quoted([f"(the raise {t15['token_tis_floor1']['vs_none']['final_reward']['mean']:+.3f}, the discount "
                    f"{t15['token_tis_cap1']['vs_none']['final_reward']['mean']:+.3f} against none, 60 seeds)"], section)
    assert "the next section takes the weight apart on these seeds." in _section(
        "The reference at T = 0.5 on the Zen 4 VM's seeds")
    q = {k: _quoted(v) for k, v in figures.items()}
    _assert_quoted([f"token TIS's raise alone {q['floor - none']} and its discount alone {q['cap - none']} against "
                    f"none on 100 seeds of a Zen 4 VM"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 200 of token TIS's raise and discount apart there"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t1.25/reference-zen4: none and the reference (the trainer at the rollout's T = 1.25) on
#: a Zen 4 VM's seeds 200-299, the pre-registered test of whether the mismatch costs none at T = 1.25 on new seeds
_T125_REFERENCE_ARMS = ("none", "ref_fp32")
#: the seeds of that sweep, as registered before it ran (run in two parts, two sessions apart: docs/study.md says why)
_T125_ZEN4_SEEDS = range(200, 300)


@functools.cache
def _t125_reference_zen4() -> tuple:
    """The T = 1.25 reference-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): none and the reference at
    T = 1.25, seeds 200-299."""
    return _one_vm_report("reference-zen4", _T125_REFERENCE_ARMS, _T125_ZEN4_SEEDS, _ZEN4,
                          "sweep-temperature-t1.25")


@functools.cache
def _t125_reference_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on the reference at T = 1.25 on the Zen 4 VM's seeds 200-299
    (:func:`_t125_reference_zen4`), recomputed from the archive: each arm's row, none - reference in final and greedy
    reward, its paired SD, the MDE and the seeds a 0.05 difference needs, none - reference over these seeds and the
    AVX2 VM's seeds 0-59 (160 seeds of two machines), the archive and the runs' times; with ``{name: paired
    difference}`` and the CPU-hours."""
    report = _t125_reference_zen4()
    _, _, runs, setting, paired, _ = report
    seeds, ref = _T125_ZEN4_SEEDS, "ref_fp32"
    rows, none_ref, sd, mde, needed = _reference_table(report, "sweep-temperature-t1.25", "reference-zen4",
                                                       _T125_REFERENCE_ARMS, seeds)
    figures = {"none - ref": none_ref, "none - ref, greedy": paired("none", ref, key="greedy_reward"),
               "none - ref, 160": paired("none", ref, (*range(60), *seeds)),
               "none - ref, 0-59": paired("none", ref, range(60))}
    line, hours = _runs_line(runs, setting, _T125_REFERENCE_ARMS, seeds)
    return [
        line,
        *rows,
        f"none - reference was {_quoted(figures['none - ref'])} on these seeds (greedy reward "
        f"{_quoted(figures['none - ref, greedy'])})",
        f"The paired SD of none - reference is {sd:.3f}, so {len(seeds)} seeds detect about {mde:.3f} and a 0.05 "
        f"difference needs {needed}",
        f"over 160 seeds of both machines none - reference is {_quoted(figures['none - ref, 160'])}",
    ], figures, hours


def test_the_reference_at_1_25_on_the_zen4_seeds_comes_from_the_archive():
    """docs/study.md on none against the reference at a rollout temperature of 1.25 on the Zen 4 VM's seeds 200-299
    (docs/study/sweep-temperature-t1.25/reference-zen4): each arm's row, none - reference in final and greedy reward,
    the paired SD, the MDE, none - reference over 160 seeds of two machines, the archive and the runs' times,
    recomputed from the archive; the outcome of the question fixed before the sweep; the 60-seed section points to
    it, and the answers and the plan quote it."""
    quotes, figures, hours = _t125_reference_quotes()
    section = _section("The reference at T = 1.25 on the Zen 4 VM's seeds")
    _assert_quoted(quotes, section)
    assert len(figures["none - ref, 160"]["diffs"]) == 160
    # the 60-seed figure the question was set against is the AVX2 VM's
    assert _quoted(figures["none - ref, 0-59"]) == _quoted(
        _summary("sweep-temperature-t1.25", ".")["doses"][0]["none_vs_reference"])
    # the question fixed before the sweep: does none - reference exclude 0 below it?
    harm = figures["none - ref"]["high"] < 0
    assert ("**The mismatch cost none" if harm else "**No harm shown, again**") in section
    assert "see \"The reference at T = 1.25 on the Zen 4 VM's seeds\" below" in _section(
        "A rollout-only temperature of 1.25 at 60 seeds")
    q = {k: _quoted(v) for k, v in figures.items()}
    _assert_quoted([f"MDE 0.065; {q['none - ref']} on 100 seeds of a Zen 4 VM; {q['none - ref, 160']} over 160 seeds "
                    "of two machines;"],
                   _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 200 of none and the reference at t1.25 on seeds 200-299 (Zen 4 VM)"],
                   _section("What has been run, and what the rest would cost"))


#: docs/study/sweep-temperature-t0.75/reference-zen4 and sweep-temperature-t1.25/token-tis-zen4: none, the reference
#: (the trainer at the rollout's T) and token TIS at T = 0.75, and token TIS at T = 1.25 beside that temperature's
#: none and reference, on the Zen 4 VM's seeds 200-299: runs a session left in the archives uncommitted after the
#: T = 1.25 reference sweep (2026-12-04), committed unchanged on 2026-12-06
_ZEN4_TEMPERATURE_ARMS = ("none", "ref_fp32", "token_tis")


@functools.cache
def _t075_reference_zen4() -> tuple:
    """The T = 0.75 reference-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): none, the reference and token TIS
    at T = 0.75, seeds 200-299."""
    return _one_vm_report("reference-zen4", _ZEN4_TEMPERATURE_ARMS, _LOW_SEEDS, _ZEN4, "sweep-temperature-t0.75")


@functools.cache
def _t125_token_tis_zen4() -> tuple:
    """The T = 1.25 token-tis-zen4 report (:func:`_one_vm_report` on the Zen 4 VM): none, the reference and token TIS
    at T = 1.25, seeds 200-299 (none's and the reference's runs those of the reference-zen4 report)."""
    return _one_vm_report("token-tis-zen4", _ZEN4_TEMPERATURE_ARMS, _LOW_SEEDS, _ZEN4, "sweep-temperature-t1.25")


def _runs_line(runs: dict, setting: str, arm_names, seeds) -> tuple[str, float]:
    """``"N runs, about S s per run, H CPU-hours"`` of ``arm_names`` at ``seeds`` (their end records' ``wall_s``),
    and the CPU-hours."""
    import numpy as np

    wall = [runs[setting, a, s][1]["wall_s"] for a in arm_names for s in seeds]
    hours = sum(wall) / 3600
    return f"{len(wall)} runs, about {np.mean(wall):.0f} s per run, {hours:.1f} CPU-hours", hours


@functools.cache
def _t075_reference_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on none, the reference and token TIS at T = 0.75 on the Zen 4 VM's seeds
    200-299 (:func:`_t075_reference_zen4`), recomputed from the archive: each arm's row, none - reference in final
    and greedy reward, its paired SD, the MDE and the seeds a 0.05 difference needs, token TIS against the reference
    and none, token TIS - none over these seeds and the Intel VM's seeds 100-199 (200 seeds of two machines), the
    archive and the runs' times; with ``{name: paired difference}`` and the CPU-hours."""
    report = _t075_reference_zen4()
    _, _, runs, setting, paired, _ = report
    seeds, ref = _LOW_SEEDS, "ref_fp32"
    rows, none_ref, sd, mde, needed = _reference_table(report, "sweep-temperature-t0.75", "reference-zen4",
                                                       _ZEN4_TEMPERATURE_ARMS, seeds)
    figures = {"none - ref": none_ref, "none - ref, greedy": paired("none", ref, key="greedy_reward"),
               "token TIS - ref": paired("token_tis", ref), "token TIS - none": paired("token_tis", "none"),
               "token TIS - none, Intel": paired("token_tis", "none", _NOISE_SEEDS),
               "token TIS - none, 200": paired("token_tis", "none", (*_NOISE_SEEDS, *seeds))}
    line, hours = _runs_line(runs, setting, _ZEN4_TEMPERATURE_ARMS, seeds)
    q = {k: _quoted(v) for k, v in figures.items()}
    return [
        line,
        f"into the T = 0.75 archive ({len(runs)} runs, {_archive_bytes('sweep-temperature-t0.75') / 1e6:.1f} MB)",
        *rows,
        f"none - reference was {q['none - ref']} on these seeds (greedy reward {q['none - ref, greedy']})",
        f"The paired SD of none - reference is {sd:.3f}, so {len(seeds)} seeds detect about {mde:.3f} and a 0.05 "
        f"difference needs {needed}",
        f"token TIS - reference {q['token TIS - ref']}, token TIS - none {q['token TIS - none']}",
        f"on the Intel seeds 100-199 token TIS - none was {q['token TIS - none, Intel']}; over the 200 seeds of both "
        f"machines it is {q['token TIS - none, 200']}",
    ], figures, hours


def test_the_reference_and_token_tis_at_0_75_on_the_zen4_seeds_come_from_the_archive():
    """docs/study.md on none, the reference and token TIS at a rollout temperature of 0.75 on the Zen 4 VM's seeds
    200-299 (docs/study/sweep-temperature-t0.75/reference-zen4): each arm's row, none - reference in final and greedy
    reward, the paired SD, the MDE, token TIS against both, token TIS - none over 200 seeds of two machines, the
    archive and the runs' times, recomputed from the archive; the reading follows the figures (harm only where
    none - reference excludes 0 below it); the answers and the plan quote it."""
    quotes, figures, hours = _t075_reference_quotes()
    section = _section("none, the reference and token TIS at T = 0.75 on the Zen 4 VM's seeds")
    _assert_quoted(quotes, section)
    assert len(figures["token TIS - none, 200"]["diffs"]) == 200
    harm = figures["none - ref"]["high"] < 0
    assert ("**The mismatch cost none" if harm else "**No harm shown at T = 0.75 either**") in section
    q = {k: _quoted(v) for k, v in figures.items()}
    _assert_quoted([f"T = 0.75: none - reference {q['none - ref']} on 100 seeds of a Zen 4 VM (MDE "
                    f"{_paired_mde(figures['none - ref']):.3f})"], _section("The answers so far, per mechanism"))
    _assert_quoted([f"{hours:.1f} for the 300 of none, the reference and token TIS at t0.75 on seeds 200-299 "
                    "(Zen 4 VM)"], _section("What has been run, and what the rest would cost"))


@functools.cache
def _t125_token_tis_quotes() -> tuple[list[str], dict, float]:
    """The figures of docs/study.md's section on token TIS at T = 1.25 on the Zen 4 VM's seeds 200-299
    (:func:`_t125_token_tis_zen4`), recomputed from the archive: each arm's row, token TIS against none (final and
    greedy reward) and the reference, token TIS - none on each machine's seeds (the AVX2 VM's 0-59, the Intel VM's
    100-199, these) and over all 260, token TIS - reference over the 160 seeds with a reference, the archive and the
    runs' times; with ``{name: paired difference}`` and the CPU-hours."""
    import numpy as np

    report = _t125_token_tis_zen4()
    _, _, runs, setting, paired, _ = report
    seeds, ref = _LOW_SEEDS, "ref_fp32"
    rows, none_ref, _, _, _ = _reference_table(report, "sweep-temperature-t1.25", "token-tis-zen4",
                                               _ZEN4_TEMPERATURE_ARMS, seeds)
    # the reference-zen4 report's none - reference, by the same runs
    assert _quoted(none_ref) == _quoted(_t125_reference_quotes()[1]["none - ref"])
    every = (*range(60), *_NOISE_SEEDS, *seeds)
    figures = {"token TIS - none": paired("token_tis", "none"),
               "token TIS - none, greedy": paired("token_tis", "none", key="greedy_reward"),
               "token TIS - ref": paired("token_tis", ref),
               "token TIS - none, 0-59": paired("token_tis", "none", range(60)),
               "token TIS - none, Intel": paired("token_tis", "none", _NOISE_SEEDS),
               "token TIS - none, 260": paired("token_tis", "none", every),
               "token TIS - ref, 160": paired("token_tis", ref, (*range(60), *seeds))}
    # the other machines' figures are those their reports quote
    assert _quoted(figures["token TIS - none, 0-59"]) == _quoted(
        _summary("sweep-temperature-t1.25", ".")["doses"][0]["arms"]["token_tis"]["vs_none"]["final_reward"])
    assert _quoted(figures["token TIS - none, Intel"]) == _quoted(
        _summary("sweep-temperature-t1.25", "shuffled-intel")["doses"][0]["arms"]["token_tis"]["vs_none"]["final_reward"])
    line, hours = _runs_line(runs, setting, ("token_tis",), seeds)
    q = {k: _quoted(v) for k, v in figures.items()}

    def se(d: dict) -> float:  # the standard error of a paired mean
        return float(np.std(list(d["diffs"].values()), ddof=1) / np.sqrt(len(d["diffs"])))

    zen4, intel = figures["token TIS - none"], figures["token TIS - none, Intel"]
    gap = zen4["mean"] - intel["mean"]
    return [
        line,
        f"The Zen 4 seeds' estimate lies {gap:.3f} above the Intel seeds', {gap / np.hypot(se(zen4), se(intel)):.1f} "
        "times the standard error of that difference",
        f"into the T = 1.25 archive ({len(runs)} runs, {_archive_bytes('sweep-temperature-t1.25') / 1e6:.1f} MB)",
        *rows,
        f"token TIS - none {q['token TIS - none']} (greedy reward {q['token TIS - none, greedy']}), token TIS - "
        f"reference {q['token TIS - ref']}",
        f"| AVX2 VM, 0-59 | {q['token TIS - none, 0-59']} |",
        f"| Intel VM, 100-199 | {q['token TIS - none, Intel']} |",
        f"| Zen 4 VM, 200-299 | {q['token TIS - none']} |",
        f"| all 260 | {q['token TIS - none, 260']} |",
        f"over the 160 seeds with a reference token TIS - reference is {q['token TIS - ref, 160']}",
    ], figures, hours


def test_token_tis_at_1_25_on_the_zen4_seeds_comes_from_the_archive():
    """docs/study.md on token TIS at a rollout temperature of 1.25 on the Zen 4 VM's seeds 200-299
    (docs/study/sweep-temperature-t1.25/token-tis-zen4): each arm's row, token TIS against none and the reference,
    token TIS - none on the three machines' seeds and over 260, recomputed from the archive; the reading follows
    the figures (whether token TIS's cost repeats on these seeds, and whether it holds over 260); the answers, the
    plan and the 60-seed section point to or quote it."""
    quotes, figures, hours = _t125_token_tis_quotes()
    section = _section("Token TIS at T = 1.25 on the Zen 4 VM's seeds")
    _assert_quoted(quotes, section)
    assert len(figures["token TIS - none, 260"]["diffs"]) == 260
    repeats = figures["token TIS - none"]["high"] < 0
    assert ("**Token TIS's cost repeats**" if repeats else "**Token TIS's cost does not repeat on these seeds**") in section
    holds = figures["token TIS - none, 260"]["high"] < 0
    assert ("the cost still excludes 0 over all 260 seeds" if holds else "over all 260 seeds the cost no longer "
            "excludes 0") in section
    q = {k: _quoted(v) for k, v in figures.items()}
    _assert_quoted([f"at T = 1.25 token TIS - none was {q['token TIS - none']} on 100 seeds of a Zen 4 VM and "
                    f"{q['token TIS - none, 260']} over 260 seeds of three kinds of machine",
                    f"over 260 seeds of three kinds of machine token TIS's cost there was {q['token TIS - none, 260']}"],
                   _section("The answers so far, per mechanism"))
    assert "see \"Token TIS at T = 1.25 on the Zen 4 VM's seeds\" below" in _section(
        "A rollout-only temperature of 1.25 at 60 seeds")
    _assert_quoted([f"{hours:.1f} for the 100 of token TIS at t1.25 on seeds 200-299 (Zen 4 VM)"],
                   _section("What has been run, and what the rest would cost"))


def _readme_study_section() -> str:
    """The prose of the README's section on the study (:func:`_section` of README.md)."""
    return _section("Does the correction change the outcome?", _STUDY_DOCS.parents[1] / "README.md")


def test_every_interval_of_the_readme_s_study_section_is_one_docs_study_md_quotes():
    """Every interval the README's study section quotes (a mean difference and its 95% CI, written as the docs write
    them) is one docs/study.md quotes, where the tests of each section recompute it from the run archives or the
    reports: the README summarises the study and measures nothing of its own."""
    readme = _readme_study_section()
    study_md = _prose(_STUDY_DOCS.parent / "study.md")
    figures = re.findall(r"[+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]", readme)
    assert len(figures) >= 25, figures  # the answers table and the claims' paragraph
    missing = [f for f in figures if f not in study_md]
    assert not missing, missing


def test_the_readme_s_temperature_row_comes_from_the_archives():
    """The README's rollout-temperature row: none - reference at every dose with the most seeds run there (0.5 and
    1.25 over two machines' 160 seeds, 0.75 over the Zen 4 VM's 100, 1.5 over the AVX2 VM's 60), each including 0
    ("none at any dose"), and the weights' cost above T = 1 (token TIS at 1.25 over 260 seeds of three machines,
    token TIS and token MIS at 1.5 over 60), recomputed from the archives."""
    readme = _readme_study_section()
    t05 = _t05_reference_quotes()[1]["none - ref, 160"]
    t075 = _t075_reference_quotes()[1]["none - ref"]
    t125 = _t125_reference_quotes()[1]["none - ref, 160"]
    dose15 = _summary("sweep-temperature-t1.5", ".")["doses"][0]
    t15, n15 = dose15["none_vs_reference"], len(dose15["none_vs_reference"]["diffs"])
    assert all(d["low"] < 0 < d["high"] for d in (t05, t075, t125, t15))
    assert (f"**none at any dose**: T = 0.5 {_quoted(t05)} ({len(t05['diffs'])} seeds), 0.75 {_quoted(t075)} "
            f"({len(t075['diffs'])}), 1.25 {_quoted(t125)} ({len(t125['diffs'])}), 1.5 {_quoted(t15)} ({n15})") in readme
    tis125 = _t125_token_tis_quotes()[1]["token TIS - none, 260"]
    tis15, mis15 = (dose15["arms"][a]["vs_none"]["final_reward"] for a in ("token_tis", "token_mis"))
    assert all(d["high"] < 0 for d in (tis125, tis15, mis15))  # "costs reward"
    assert (f"above T = 1 token TIS costs reward ({_quoted(tis125)} at 1.25 over 260 seeds of three machines; "
            f"{_quoted(tis15)} at 1.5, {n15} seeds) and token MIS more ({_quoted(mis15)} at 1.5)") in readme


#: docs/study/sweep-moe-noise/n0.4-seeds-100 and n0.2-seeds-100: none, the reference and R3 at rollout router noise
#: sigma 0.4 and 0.2 on seeds 100 on of a Zen 3 VM (2026-12-06), the MoE mechanism's rerun past the first sweep's 4
#: seeds per dose, with its question fixed before any result was read; the seeds are those finished when the
#: session's time ended (the reference ran at sigma 0.4 and is copied to 0.2: it resets the noise)
_MOE_NOISE_ARMS = ("none", "ref_fp32", "r3")
_MOE_NOISE_SEEDS = range(100, 100 + 30)
_ZEN3 = ("25/1", "AVX2")


def _moe_noise_references_made(seeds) -> list[tuple[str, int]]:
    """``(dose, seed)`` of the reference runs made at router noise sigma 0.2 and 0.4 on ``seeds``: the reference
    resets the noise, so for each seed it ran at one dose and the other dose's is a copy of it (checked)."""
    headers = _archive_headers("sweep-moe-noise")
    made = [(d, s) for s in seeds for d in ("n0.2", "n0.4")
            if headers[f"moe-noise-{d}", "ref_fp32", s].get("copied_from") is None]
    assert [s for _, s in made] == list(seeds), made
    return made


@functools.cache
def _moe_noise_quotes() -> tuple[list[str], dict]:
    """The figures of docs/study.md's section on the MoE router noise at sigma 0.4 and 0.2 on seeds
    :data:`_MOE_NOISE_SEEDS` (one report per dose, :func:`_one_vm_report` on the Zen 3 VM), recomputed from the
    archive: each dose's row (expert flips and K3 of none, none - reference in final and greedy reward, R3 against
    none and the reference, the MDE), the arms' rows, the paired SD and the seeds a 0.05 difference needs, the
    reference's copies and the runs' times; with ``{(dose, name): paired difference}``."""
    import numpy as np

    quotes, figures, walls = [], {}, []
    for dose, sigma in (("n0.4", "0.4"), ("n0.2", "0.2")):
        name = f"{dose}-seeds-100"
        report = _one_vm_report(name, _MOE_NOISE_ARMS, _MOE_NOISE_SEEDS, _ZEN3, "sweep-moe-noise")
        arms, _, runs, setting, paired, _ = report
        rows, none_ref, sd, mde, needed = _reference_table(report, "sweep-moe-noise", name, _MOE_NOISE_ARMS,
                                                           _MOE_NOISE_SEEDS)
        ref = "ref_fp32"
        f = {"none - ref": none_ref, "none - ref, greedy": paired("none", ref, key="greedy_reward"),
             "r3 - none": paired("r3", "none"), "r3 - ref": paired("r3", ref)}
        figures.update({(dose, k): v for k, v in f.items()})
        flips = arms["none"]["route_flip_mean"][0]
        q = {k: _quoted(v) for k, v in f.items()}
        quotes += [
            f"| {sigma} | {100 * flips:.1f}% | {_e(arms['none']['k3_mean'][0], 1)} | {q['none - ref']} | "
            f"{q['none - ref, greedy']} | {q['r3 - none']} | {q['r3 - ref']} | {mde:.3f} |",
            *(f"| {sigma} {row[2:]}" for row in rows),
            f"at sigma {sigma} the paired SD of none - reference is {sd:.3f} and a 0.05 difference needs {needed} seeds",
        ]
        # R3 replays the rollout's experts: its mismatch is rounding
        assert arms["r3"]["k3_mean"][0] < 1e-10
        walls += [(s, runs[setting, a, s][1]["wall_s"]) for a in ("none", "r3") for s in _MOE_NOISE_SEEDS]
    walls += [(s, _archive_runs("sweep-moe-noise")[f"moe-noise-{d}", "ref_fp32", s][1]["wall_s"])
              for d, s in _moe_noise_references_made(_MOE_NOISE_SEEDS)]
    late = [w for s, w in walls if s >= 120]  # made by workers replaced every RUNS_PER_WORKER runs
    quotes.append(f"{len(walls)} runs, {sum(w for _, w in walls) / 3600:.1f} CPU-hours")
    quotes.append(f"{len(late)} runs of seeds 120-129, {np.median(late):.0f} s per run (median)")
    return quotes, figures


def test_the_moe_router_noise_at_more_seeds_comes_from_the_archive():
    """docs/study.md's section on the MoE router noise past 4 seeds: every figure recomputed from the archive; the
    outcome of the question fixed before any result was read (harm at a dose only where none - reference excludes
    0 below it); the answers quote its R3 figures."""
    quotes, figures = _moe_noise_quotes()
    section = _section(f"MoE router noise at {len(_MOE_NOISE_SEEDS)} seeds")
    _assert_quoted(quotes, section)
    for dose, sigma in (("n0.4", "0.4"), ("n0.2", "0.2")):
        harm = figures[dose, "none - ref"]["high"] < 0
        assert (f"**Harm at sigma {sigma}**" if harm else f"**No harm shown at sigma {sigma}**") in section
    # the answers and the README quote R3 from here, none - reference from the section on more seeds (next test)
    q = {k: _quoted(v) for k, v in figures.items()}
    r3 = f"R3 - none {q['n0.4', 'r3 - none']} at sigma 0.4 and {q['n0.2', 'r3 - none']} at sigma 0.2 ({len(_MOE_NOISE_SEEDS)} seeds"
    assert r3 in _section("The answers so far, per mechanism")


#: docs/study/sweep-moe-noise/n0.4-none-ref and n0.2-none-ref: none and the reference at router noise sigma 0.4 and
#: 0.2 on seeds 100 on of the Zen 3 VM, the 30 seeds above (:data:`_MOE_NOISE_SEEDS`) and the seeds the next session
#: added (2026-12-06, from 130, each dose's question fixed before its added runs started) toward a 0.05
#: resolution; cut where that session's time ended. Both doses have the same seeds: the reference is shared
_MOE_NOISE_MORE_ARMS = ("none", "ref_fp32")
_MOE_NOISE_MORE_DOSES = ("n0.4", "n0.2")
_MOE_NOISE_MORE_SEEDS = range(100, 100 + 130)
#: docs/study/sweep-moe-noise/n0.4-none-ref-180 and n0.2-none-ref-180: the same arms and doses with the seeds the
#: session after added (2026-12-06, from 230, the question fixed before any of them ran), cut where its time ended
_MOE_NOISE_180_SEEDS = range(100, 100 + 180)


@functools.cache
def _moe_noise_none_ref_quotes(seeds: range, added: range, suffix: str) -> tuple[list[str], dict]:
    """The figures of a docs/study.md section on none and the reference at router noise sigma 0.4 and 0.2 on
    ``seeds`` (the reports DOSE-``suffix`` of :data:`_MOE_NOISE_MORE_DOSES`, :func:`_one_vm_report` on the Zen 3
    VM), recomputed from the archive: per dose the arms' rows, none - reference in final and greedy reward over
    every seed and over the ``added`` seeds alone, the expert flips and K3 of none, the paired SD, the MDE and the
    seeds a 0.05 difference needs; the added runs' times; the reference runs whose routing flipped at fp32
    rounding; with ``{(dose, name): paired difference}``."""
    import numpy as np

    quotes, figures, walls, ref = [], {}, [], "ref_fp32"
    archive = _archive_runs("sweep-moe-noise")
    for dose in _MOE_NOISE_MORE_DOSES:
        sigma, name = dose[1:], f"{dose}-{suffix}"
        report = _one_vm_report(name, _MOE_NOISE_MORE_ARMS, seeds, _ZEN3, "sweep-moe-noise")
        arms, _, runs, setting, paired, _ = report
        rows, none_ref, sd, mde, needed = _reference_table(report, "sweep-moe-noise", name, _MOE_NOISE_MORE_ARMS,
                                                           seeds)
        f = {"none - ref": none_ref, "none - ref, greedy": paired("none", ref, key="greedy_reward"),
             "none - ref, added": paired("none", ref, added),
             "none - ref, added, greedy": paired("none", ref, added, key="greedy_reward")}
        figures.update({(dose, k): v for k, v in f.items()})
        q = {k: _quoted(v) for k, v in f.items()}
        quotes += [
            *(f"| {sigma} {row[2:]}" for row in rows),
            f"| {sigma} | {len(seeds)} | {100 * arms['none']['route_flip_mean'][0]:.1f}% | "
            f"{_e(arms['none']['k3_mean'][0], 1)} | {q['none - ref']} | {q['none - ref, greedy']} | {mde:.3f} |",
            f"at sigma {sigma}, on the {len(added)} added seeds alone, {q['none - ref, added']} (greedy "
            f"{q['none - ref, added, greedy']})",
            f"at sigma {sigma} the paired SD of none - reference is {sd:.3f}, so a 0.05 difference needs {needed} seeds",
        ]
        walls += [runs[setting, "none", s][1]["wall_s"] for s in added]
    walls += [archive[f"moe-noise-{d}", ref, s][1]["wall_s"] for d, s in _moe_noise_references_made(added)]
    quotes.append(f"{len(walls)} runs, {sum(walls) / 3600:.1f} CPU-hours, {np.median(walls):.0f} s per run (median)")
    # the reference's mean K3 comes from the few runs where fp32 rounding flipped an expert choice at a tie
    steps = {s: archive["moe-noise-n0.4", ref, s][0] for s in seeds}
    flipped = [(s, r) for s, records in steps.items() for r in records if r["route_flip_fraction"] > 0]
    k3 = {s: np.mean([r["mis_k3_kl"] for r in records]) for s, records in steps.items()}
    flipped_seeds = {s for s, _ in flipped}
    rest = [v for s, v in k3.items() if s not in flipped_seeds]
    assert sorted(k3, key=k3.get)[len(rest):] == sorted(flipped_seeds, key=k3.get)
    figures["ref flips"] = [(s, r["step"]) for s, r in flipped]
    quotes += [f"seed {s}, where at step {r['step']} fp32 rounding flipped one expert choice near a tie "
               f"({100 * r['route_flip_fraction']:.2f}% of the routes, that step's K3 {_e(r['mis_k3_kl'], 1)})"
               for s, r in flipped]
    quotes.append(f"the other {len(rest)} reference runs stay at {_e(min(rest), 0)} to {_e(max(rest), 0)} and never flip")
    return quotes, figures


def _assert_moe_noise_none_ref_section(seeds: range, added: range, suffix: str, title: str) -> dict:
    """Every figure of the docs/study.md section ``title`` recomputed (:func:`_moe_noise_none_ref_quotes`) and the
    outcome of each dose's question, fixed before its added seeds ran (harm only where none - reference excludes 0
    below it, with the MDE reported); returns the figures."""
    quotes, figures = _moe_noise_none_ref_quotes(seeds, added, suffix)
    section = _section(title)
    _assert_quoted(quotes, section)
    for dose in _MOE_NOISE_MORE_DOSES:
        sigma, d = dose[1:], figures[dose, "none - ref"]
        assert (f"**Harm at sigma {sigma}**" if d["high"] < 0 else f"**No harm shown at sigma {sigma}**") in section
    return figures


def test_the_moe_router_noise_toward_a_0_05_resolution_comes_from_the_archive():
    """docs/study.md's section on none and the reference at router noise sigma 0.4 and 0.2 on 130 seeds: every
    figure recomputed from the archive, with each dose's outcome."""
    added = range(_MOE_NOISE_SEEDS.stop, _MOE_NOISE_MORE_SEEDS.stop)
    figures = _assert_moe_noise_none_ref_section(_MOE_NOISE_MORE_SEEDS, added, "none-ref",
                                                 "MoE router noise toward a 0.05 resolution")
    assert figures["ref flips"] == [(213, 12)]  # "The reference's mean K3 of 4.6e-11 is one run"


def test_the_moe_router_noise_at_180_seeds_comes_from_the_archive():
    """docs/study.md's section on none and the reference at router noise sigma 0.4 and 0.2 on 180 seeds: every
    figure recomputed from the archive, with each dose's outcome; the answers and the README quote it."""
    seeds = _MOE_NOISE_180_SEEDS
    figures = _assert_moe_noise_none_ref_section(seeds, range(_MOE_NOISE_MORE_SEEDS.stop, seeds.stop), "none-ref-180",
                                                 f"MoE router noise at {len(seeds)} seeds")
    answers, readme = _section("The answers so far, per mechanism"), _readme_study_section()
    for dose in _MOE_NOISE_MORE_DOSES:
        quoted = f"{_quoted(figures[dose, 'none - ref'])} at sigma {dose[1:]} ({len(seeds)} seeds"
        assert quoted in answers and quoted in readme, quoted


def _took_off(a: dict, b: dict) -> dict:
    """Steps to the threshold, a - b per seed (``{seed: step or None}`` each), over the seeds where both reached it,
    as the reports pair them."""
    return {s: a[s] - b[s] for s in a if a[s] is not None and b[s] is not None}


def _steps_of(metrics: dict, arm: str, seeds) -> dict:
    """``{seed: the step at which the arm's run reached the threshold, or None}`` (``metrics``: a report's
    :func:`_committed_metrics`)."""
    return {s: metrics[arm, s]["steps_to_threshold"] for s in seeds}


@functools.cache
def _precision_dose_zen4(dose: str, seeds: range) -> SimpleNamespace:
    """One dose of long-tail-precision on the Zen 4 VM's ``seeds`` (:func:`_one_vm_report` of its report
    docs/study/sweep-long-tail-precision/DOSE-zen4), recomputed from the archive, with the first machine's seeds (its
    summary.json: int4 0-3, bf16 and int8 0-1; their runs were not kept), each seed's difference on its own machine:
    none - reference on the final reward (``reward``: :func:`_pooled_look` of the earlier and the added seeds;
    ``adjusted``: pooled with the 5% split over the two looks) and on the steps to the take-off threshold (``steps``:
    the same over the seeds where both reached it); none's K3, mean final rewards, collapses, runs ended low and runs
    reaching the threshold per arm; the none runs' wall times. Checks that the none runs were made on the Zen 4 VM at
    one thread and the reference runs are the k2 archive's, copied."""
    import numpy as np

    sweep, ref = "sweep-long-tail-precision", "ref_fp32"
    k2 = _archive_records("sweep-long-tail-stale-128-k2")
    records, walls = _archive_records(sweep), []
    arms, final, runs, setting, paired, study = _one_vm_report(f"{dose}-zen4", ("none", ref), seeds, _ZEN4, sweep)
    summary = _summary(sweep, f"{dose}-zen4")
    assert setting == f"long-tail-precision-{dose}" and summary["steps"] == 300
    metrics = _committed_metrics(sweep, summary)
    for s in seeds:
        none, copy = records[setting, "none", s][0], records[setting, ref, s]
        assert none["config"]["threads"] == 1 and "copied_from" not in none, s  # made here, one thread
        # the reference is the k2 archive's run of the seed, its header renamed
        assert copy[0]["copied_from"].endswith(f"long-tail-stale-128-k2/ref_fp32/seed-{s}.jsonl"), s
        assert copy[1:] == k2["long-tail-stale-128-k2", ref, s][1:], s
        walls.append(runs[setting, "none", s][1]["wall_s"])
    first = _dose(sweep, ".", dose)
    earlier = {int(s): v for s, v in first["none_vs_reference"]["diffs"].items()}
    first_steps = first["arms"]["none"]["vs_reference"]["steps_to_threshold"]["diffs"]
    assert sorted(earlier) == list(range({"int4": 4, "bf16": 2, "int8": 2}[dose]))
    reward = _pooled_look(earlier, paired("none", ref)["diffs"], study)
    assert _quoted(reward.alone) == _quoted(summary["doses"][0]["none_vs_reference"])
    steps = _pooled_look({int(s): v for s, v in first_steps.items()},
                         _took_off(_steps_of(metrics, "none", seeds), _steps_of(metrics, ref, seeds)), study)
    assert _quoted(steps.alone, "{:+.0f}") == _quoted(arms["none"]["vs_reference"]["steps_to_threshold"], "{:+.0f}")
    return SimpleNamespace(
        study=study, final=final, metrics=metrics, k3=arms["none"]["k3_mean"][0], reward=reward, steps=steps,
        adjusted=_mean_ci(reward.pooled["diffs"], study, looks=2),
        mean={a: float(np.mean([final[a, s] for s in seeds])) for a in ("none", ref)},
        collapsed={a: arms[a]["collapse"]["k"] for a in ("none", ref)},
        low={a: arms[a]["ended_low"]["k"] for a in ("none", ref)},
        reached={a: arms[a]["steps_to_threshold"]["reached"] for a in ("none", ref)}, walls=walls)


@functools.cache
def _precision_128_zen4() -> SimpleNamespace:
    """long-tail-precision at int4 and bf16 on the Zen 4 VM's seeds :data:`_PRECISION_128_SEEDS`
    (:func:`_precision_dose_zen4` of each), int4 - bf16 on them (the final reward and the take-off) and the none runs'
    wall times."""
    seeds = _PRECISION_128_SEEDS
    out = {dose: _precision_dose_zen4(dose, seeds) for dose in _PRECISION_128_DOSES}
    int4, bf16 = out["int4"], out["bf16"]
    dose_final = _mean_ci({s: int4.final["none", s] - bf16.final["none", s] for s in seeds}, int4.study)
    dose_steps = _mean_ci(_took_off(_steps_of(int4.metrics, "none", seeds), _steps_of(bf16.metrics, "none", seeds)),
                          int4.study)
    return SimpleNamespace(doses=out, dose_final=dose_final, dose_steps=dose_steps,
                           walls=[w for x in out.values() for w in x.walls])


def _precision_rows(dose: str, x: SimpleNamespace) -> tuple[str, str]:
    """A precision section's two table rows for one dose (``x``: :func:`_precision_dose_zen4`): none - reference on
    the final reward (the added seeds alone, the earlier, pooled, paired SD, MDE, seeds for 0.05, the 5% split over
    the two looks) and on the steps to the take-off (alone, earlier, pooled, each with its seeds)."""
    w, t, steps = x.reward, x.steps, functools.partial(_quoted, fmt="{:+.0f}")
    return (f"| {dose} | {_e(x.k3, 1)} | {_quoted(w.alone)} | {_seed_ranges(w.earlier['diffs'])} | "
            f"{_quoted(w.earlier)} | {_quoted(w.pooled)} | {w.pooled['n']} | {w.sd:.3f} | {w.mde:.3f} | {w.needed} | "
            f"{_quoted(x.adjusted)} |",
            f"| {dose} | {steps(t.alone)} ({t.alone['n']} seeds) | {steps(t.earlier)} ({t.earlier['n']}) | "
            f"{steps(t.pooled)} ({t.pooled['n']}) |")


def _precision_outcome(dose: str, x: SimpleNamespace) -> list[str]:
    """What a precision section says of one dose's none - reference on the final reward (``x``:
    :func:`_precision_dose_zen4`): the verdict from the pooled interval, the pooled figure and its seeds, whether the
    MDE meets the 0.05 target, the added seeds alone and how many of them fell below 0, and the 5% split over the
    two looks."""
    w = x.reward
    verdict = "behind" if w.pooled["high"] < 0 else "ahead of" if w.pooled["low"] > 0 else "not measurably behind"
    below = sum(v < 0 for v in w.alone["diffs"].values())
    return [f"**None is {verdict} the reference at {dose}**",
            f"{_quoted(w.pooled)} over {w.pooled['n']} seeds",
            f"**MDE {w.mde:.3f}: the 0.05 target is {'met' if w.mde <= 0.05 else 'not met'}**",
            f"on the added seeds alone {_quoted(w.alone)}",
            f"below 0 on {below} of {len(w.alone['diffs'])}",
            f"With the 5% split over the two looks: {_quoted(x.adjusted)}"]


def test_rollout_precision_at_128_tokens_on_more_seeds_comes_from_the_archive():
    """docs/study.md's section on none at int4 and bf16 rollouts of the 128-token task on the Zen 4 VM's seeds
    (:func:`_precision_128_zen4`): both tables, the runs' count and times, the means, collapses and runs ended low,
    the spread's seeds, the dose's comparison and its span of K3, recomputed from the archive and the first machine's
    summary.json; the outcome of each question fixed before the runs, each from its rule; the answers, the summary,
    the plan, the guidance table, the README and ``analyze`` quote it."""
    import numpy as np

    from megatron_mis.analysis.recommend import S_MEASURED_HARMLESS, S_SEQUENCE_DEGENERATE, recommend

    r = _precision_128_zen4()
    seeds, d = _PRECISION_128_SEEDS, r.doses
    int4, bf16 = d["int4"], d["bf16"]
    section = _section("Rollout precision at 128 tokens on more seeds")
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    rows = [_precision_rows(dose, x)[i] for i in (0, 1) for dose, x in d.items()]  # the reward table, then the steps'
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    # the take-off's earlier seeds are the first machine's report's, every pair of them reached the threshold
    assert [x.steps.earlier["n"] for x in d.values()] == [len(x.reward.earlier["diffs"]) for x in d.values()]
    quotes = [*rows, f"{len(r.walls)} runs, {sum(r.walls) / 3600:.1f} CPU-hours, {np.median(r.walls) / 60:.1f} min "
              f"per run (median)",
              f"On seeds {seeds.start}-{seeds.stop - 1} the mean final rewards were none {int4.mean['none']:.3f} at "
              f"int4, {bf16.mean['none']:.3f} at bf16 and the reference {int4.mean['ref_fp32']:.3f}",
              f"int4 - bf16 {_quoted(r.dose_final)} on the final reward and {steps(r.dose_steps)} steps on the "
              f"take-off ({r.dose_steps['n']} seeds), across {np.log10(int4.k3 / bf16.k3):.1f} decades of K3"]
    assert int4.mean["ref_fp32"] == bf16.mean["ref_fp32"]  # one reference
    # "no run of either arm collapsed or ended low", "every run of both arms reaching the threshold"
    assert all(x.collapsed == x.low == {"none": 0, "ref_fp32": 0} for x in d.values())
    assert all(x.reached == {"none": len(seeds), "ref_fp32": len(seeds)} for x in d.values())
    for dose, x in d.items():
        quotes += _precision_outcome(dose, x)
    assert int4.reward.pooled["low"] > -0.01  # "the interval excluding a cost of 0.01"
    assert f"the lowest {min(int4.reward.alone['diffs'].values()):.3f}" in section
    spread = sorted(bf16.reward.alone["diffs"].values())[:2]  # bf16's spread: its two lowest seeds, far below the rest
    assert spread[1] < 3 * sorted(bf16.reward.alone["diffs"].values())[2]
    quotes.append(f"its spread from two seeds ({spread[0]:.3f} and {spread[1]:.3f}; below 0 on")
    held = any(x.steps.alone["low"] > 0 for x in d.values())
    quotes += ["**The later take-off holds**" if held else "**The later take-off does not hold**",
               f"on the added seeds none took off {steps(int4.steps.alone)} steps from the reference at int4 and "
               f"{steps(bf16.steps.alone)} at bf16",
               f"pooled, {steps(int4.steps.pooled)} and {steps(bf16.steps.pooled)}. The "
               f"{bf16.steps.earlier['mean']:+.0f} and {int4.steps.earlier['mean']:+.0f} steps of 2-4 seeds"]
    costs_more = r.dose_final["high"] < 0
    quotes.append("**The larger dose costs more**" if costs_more else "**The larger dose costs no more, measurably**")
    s_int4 = float(np.sqrt(2 * 128 * int4.k3))
    assert S_MEASURED_HARMLESS < s_int4 <= S_SEQUENCE_DEGENERATE  # "in analyze's "sequence-level" range"
    quotes.append(f"at int4 (s = {s_int4:.1f}, in `analyze`'s \"sequence-level\" range)")
    _assert_quoted(quotes, section)
    # the quotes elsewhere: the answers' summary, the plan, the guidance table, the README and analyze
    n4, n16 = int4.reward.pooled["n"], bf16.reward.pooled["n"]
    q4 = _quoted(int4.reward.pooled)
    # (the answers' row quotes all three doses at 128 tokens: the int8 section's test checks it)
    assert (f"Numeric precision (none - reference at 128 tokens {q4} at int4 over {n4} seeds of two machines, MDE "
            f"{int4.reward.mde:.3f})") in _section("The answers so far, per mechanism")
    _assert_quoted([
        f"{sum(r.walls) / 3600:.1f} for the {len(r.walls)} runs of seeds {seeds.start}-{seeds.stop - 1} (Zen 4 VM, "
        f"{np.median(r.walls) / 60:.1f} min per run)",
        f"int4 and bf16: none x {len(seeds)} more on a Zen 4 VM, the reference copied from the k2 archive ({n4} and "
        f"{n16} seeds, MDE {int4.reward.mde:.3f} and {bf16.reward.mde:.3f}: **resolved**, none not hurt;",
    ], _section("What has been run, and what the rest would cost"))
    assert max(int4.reward.mde, bf16.reward.mde) <= 0.05  # "resolved"
    guidance = (f"none itself again at L = 128 on {n4} seeds of two machines (`long-tail-precision` int4, `s` "
                f"{s_int4:.1f}): {q4} against the reference, MDE {int4.reward.mde:.3f}.")
    assert guidance in _section("Which correction for which K3 and response length")
    assert f"int4, 128 tokens, {q4} ({n4} seeds, MDE {int4.reward.mde:.3f})" in _readme_study_section()
    advice = recommend(int4.k3, 128)
    basis = " ".join(advice.basis.split())
    assert advice.regime == "sequence-level"
    assert (f"none itself at 128 tokens on {n4} seeds of two machines (long-tail-precision int4, s {s_int4:.1f}): "
            f"{q4} against the fp32 reference, MDE {int4.reward.mde:.3f}") in basis
    # the section above points here, and the take-off section's k0 cell at 128 tokens quotes it
    assert "noise at n = 2-4 until repeated, as the next section does at int4 and bf16" in _section(
        "Rollout precision with 128-token responses")
    assert (f"that 128-token cell, repeated on {len(seeds)} more seeds, is {steps(int4.steps.pooled)} over "
            f"{int4.steps.pooled['n']}") in _section("Steps to take-off in the long-tail sweeps")


def test_int8_rollouts_at_128_tokens_on_more_seeds_come_from_the_archive():
    """docs/study.md's section on none at int8 rollouts of the 128-token task on the Zen 4 VM's seeds
    (:func:`_precision_dose_zen4`): both tables of none - reference (the final reward, the take-off), the runs' count
    and times, the means, collapses and runs ended low, and the dose curve on the seeds the three doses share (each
    dose's K3 there, int4 - int8 and bf16 - int8 on the final reward and the take-off), recomputed from the archive and
    the first machine's summary.json; the spread of int8's K3 over its runs and the monitor's warnings, from the
    archive's records; the outcome of each question fixed before the runs, each from its rule; the answers, the plan,
    the guidance table, the README and ``analyze`` quote it."""
    import numpy as np

    from megatron_mis.analysis.recommend import recommend

    seeds, ref = _PRECISION_INT8_SEEDS, "ref_fp32"
    x = _precision_dose_zen4("int8", seeds)
    bf16, int4 = (_precision_dose_zen4(dose, _PRECISION_128_SEEDS) for dose in ("bf16", "int4"))
    section = _section("int8 rollouts at 128 tokens on more seeds")
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    w, t = x.reward, x.steps
    rows = list(_precision_rows("int8", x))
    # the dose curve: the seeds where the section above ran int4 and bf16, int8's K3 over those seeds
    shared = [s for s in _PRECISION_128_SEEDS if s in seeds]
    k3 = {"int8": float(np.mean([x.metrics["none", s]["k3_mean"] for s in shared]))}
    curve = {}
    for dose, y in (("bf16", bf16), ("int4", int4)):
        k3[dose] = float(np.mean([y.metrics["none", s]["k3_mean"] for s in shared]))
        assert k3[dose] == y.k3 or len(shared) < len(_PRECISION_128_SEEDS)  # its report's K3 where all seeds shared
        curve[dose] = (
            float(np.mean([y.final["none", s] for s in shared])),
            _mean_ci({s: y.final["none", s] - x.final["none", s] for s in shared}, x.study),
            _mean_ci(_took_off(_steps_of(y.metrics, "none", shared), _steps_of(x.metrics, "none", shared)), x.study))
    int8_mean = float(np.mean([x.final["none", s] for s in shared]))
    rows.append(f"| int8 | {_e(k3['int8'], 1)} | {int8_mean:.3f} | - | - |")
    rows += [f"| {dose} | {_e(k3[dose], 1)} | {m:.3f} | {_quoted(f)} | {steps(st)} ({st['n']} seeds) |"
             for dose, (m, f, st) in curve.items()]
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert t.earlier["n"] == len(w.earlier["diffs"])  # every earlier pair reached the threshold
    below = sum(v < 0 for v in w.alone["diffs"].values())
    smallest = min(k3, key=k3.get) == "int8"
    costs_more = any(f["low"] > 0 or f["high"] < 0 for _, f, _ in curve.values())
    quotes = [*rows,
              f"{len(x.walls)} runs, {sum(x.walls) / 3600:.1f} CPU-hours, {np.median(x.walls) / 60:.1f} min per run "
              f"(median)",
              f"the mean final rewards were none {x.mean['none']:.3f} and the reference {x.mean[ref]:.3f}",
              *_precision_outcome("int8", x),
              f"on the added seeds alone {_quoted(w.alone)} (below 0 on {below} of {len(seeds)}, the lowest "
              f"{min(w.alone['diffs'].values()):.3f})",
              "**The later take-off holds**" if t.alone["low"] > 0 else "**The later take-off does not hold**",
              f"on the added seeds none took off {steps(t.alone)} steps from the reference, pooled {steps(t.pooled)}",
              f"**int8's K3 is {'the smallest' if smallest else 'not the smallest'} of the three on these seeds**",
              "**A larger K3 costs more, measurably**" if costs_more else
              "**A larger K3 costs no more, measurably**",
              f"bf16 - int8 {_quoted(curve['bf16'][1])} and int4 - int8 {_quoted(curve['int4'][1])} on the final "
              f"reward, {curve['bf16'][2]['mean']:+.0f} and {curve['int4'][2]['mean']:+.0f} steps on the take-off, "
              f"across {np.log10(k3['int4'] / k3['int8']):.1f} decades of K3",
              f"the {t.earlier['mean']:+.0f} of {t.earlier['n']} seeds was noise"]
    # "no run of either arm collapsed or ended low, and every run reached the threshold"
    assert x.collapsed == x.low == {"none": 0, ref: 0}
    assert x.reached == {"none": len(seeds), ref: len(seeds)}
    # int8's K3 from seed to seed: its runs' means, and the seeds above bf16's mean
    run_k3 = {s: x.metrics["none", s]["k3_mean"] for s in seeds}
    above = [s for s in seeds if run_k3[s] > k3["bf16"]]
    bf16_k3 = [bf16.metrics["none", s]["k3_mean"] for s in shared]
    assert min(bf16_k3) < min(run_k3.values()) < max(bf16_k3)  # "run by run the two overlap"
    quotes += [f"its runs' mean K3 went from {_e(min(run_k3.values()), 1)} to {_e(max(run_k3.values()), 1)} (bf16's "
               f"on seeds {shared[0]}-{shared[-1]} from {_e(min(bf16_k3), 1)} to {_e(max(bf16_k3), 1)}), "
               f"{len(above)} seeds ({' and '.join(map(str, above))}) above bf16's mean",
               f"{np.log10(k3['bf16'] / k3['int8']):.1f} decades below bf16's"]
    # the monitor: runs of none with a warning on the mismatch (each with one on K3), the reference's, the example
    records = _archive_records("sweep-long-tail-precision")

    def mismatch_warnings(arm: str, s: int) -> list:
        return [m for r in records["long-tail-precision-int8", arm, s] if r["type"] == "step"
                for m in r.get("monitor_warnings") or [] if m.startswith("mis_")]

    flagged = [s for s in seeds if mismatch_warnings("none", s)]
    assert all(any(m.startswith("mis_k3_kl") for m in mismatch_warnings("none", s)) for s in flagged)
    assert not any(mismatch_warnings(ref, s) for s in seeds)
    example = re.fullmatch(r"mis_k3_kl=(\S+) at step (\d+) is (\S+)x the median \S+ of the previous 30 steps",
                           mismatch_warnings("none", seeds.start)[0])
    quotes += [f"warned on the mismatch in {len(flagged)} of the {len(seeds)} runs of none (the reference: 0 of "
               f"{len(seeds)})",
               f"(for example {example[1]} at step {example[2]} of seed {seeds.start}, {example[3]}x the median of the "
               f"30 steps before)"]
    for dose in ("int4", "bf16"):  # "where it warned on 12 of 12 at each dose"
        assert _dose("sweep-long-tail-precision", f"{dose}-zen4", dose)["arms"]["none"]["monitor_flagged"] == {
            "k": len(_PRECISION_128_SEEDS), "n": len(_PRECISION_128_SEEDS)}
    quotes.append(f"where it warned on {len(_PRECISION_128_SEEDS)} of {len(_PRECISION_128_SEEDS)} at each dose")
    _assert_quoted(quotes, section)
    # the earlier sections' int8 sentence points here
    assert "int8 (K3 2.3e-6, below bf16's) was left at 2 seeds here: the next section repeats it." in _section(
        "Rollout precision at 128 tokens on more seeds")
    # the quotes elsewhere: the answers' row (all three doses at 128 tokens), the plan and the README
    row = (f"int4 and bf16 at 128 tokens, {int4.reward.pooled['n']} and {bf16.reward.pooled['n']} seeds of two "
           f"machines; int8 at 128 tokens, {w.pooled['n']} seeds of two machines) | none (at 128 tokens none - "
           f"reference {_quoted(int4.reward.pooled)} at int4, MDE {int4.reward.mde:.3f}, "
           f"{_quoted(bf16.reward.pooled)} at bf16, "
           f"MDE {bf16.reward.mde:.3f}, and {_quoted(w.pooled)} at int8, MDE {w.mde:.3f}; take-off not measurably "
           f"later: {steps(int4.steps.pooled)}, {steps(bf16.steps.pooled)} and {steps(t.pooled)} steps) |")
    assert not any(y.steps.pooled["low"] > 0 for y in (int4, bf16, x))  # "take-off not measurably later"
    answers = _section("The answers so far, per mechanism")
    assert row in answers and "the long responses' int8 dose" not in answers
    assert all(y.reward.mde <= 0.05 and y.reward.pooled["low"] < 0 < y.reward.pooled["high"] for y in (int4, bf16, x))
    n = sorted(y.reward.pooled["n"] for y in (int4, bf16, x))
    open_part = f"and `long-tail-precision`'s none and reference ({n[0]}-{n[-1]} seeds at each dose), are the open part"
    assert (f"all three precision doses are now resolved to the 0.05 target with 128-token responses "
            f"({int4.reward.pooled['n']}, {bf16.reward.pooled['n']} and {w.pooled['n']} seeds of two machines)"
            ) in section
    _assert_quoted([
        f"{sum(x.walls) / 3600:.1f} for the {len(x.walls)} int8 runs of seeds {seeds.start}-{seeds.stop - 1} "
        f"(Zen 4 VM, {np.median(x.walls) / 60:.1f} min per run)",
        f"int8: none x {len(seeds)} more on a Zen 4 VM, the reference copied from the k2 archive ({w.pooled['n']} "
        f"seeds, MDE {w.mde:.3f}: **{'resolved' if w.mde <= 0.05 else 'not resolved'}**",
    ], _section("What has been run, and what the rest would cost"))
    assert open_part in _section("What has been run, and what the rest would cost")
    assert f"int8, 128 tokens, {_quoted(w.pooled)} ({w.pooled['n']} seeds, MDE {w.mde:.3f})" in _readme_study_section()
    # analyze's "measured-harmless" basis: bf16 and int8 at 128 tokens, each dose's s from its K3 on the added seeds
    doses = (("bf16", bf16), ("int8", x))
    s_of = {name: float(np.sqrt(2 * 128 * y.k3)) for name, y in doses}
    assert (f"at 128 tokens bf16 and int8 (s {s_of['bf16']:.2f} and {s_of['int8']:.2f}): none - reference "
            f"{_quoted(bf16.reward.pooled)} and {_quoted(w.pooled)} ({bf16.reward.pooled['n']} and {w.pooled['n']} "
            f"seeds, MDE {bf16.reward.mde:.3f} and {w.mde:.3f}) |") in _section(
        "Which correction for which K3 and response length")
    for name, y in doses:
        advice = recommend(y.k3, 128)
        assert advice.regime == "measured-harmless", name
        assert (f"{_quoted(y.reward.pooled)} at {name} (s {s_of[name]:.2f}, {y.reward.pooled['n']} seeds, MDE "
                f"{y.reward.mde:.3f})") in " ".join(advice.basis.split()), name


def _never(arm: dict) -> int:
    """The runs of a report's arm row that never reached the take-off threshold."""
    return arm["steps_to_threshold"]["n"] - arm["steps_to_threshold"]["reached"]


@functools.cache
def _top_k_more(label: str) -> SimpleNamespace:
    """Processed top-k at dose ``label`` on the seeds of :data:`_TOP_K_MORE` beside the processed sweep's seeds 0-15,
    recomputed from the archive (each run's greedy reward and steps to the take-off threshold): for each comparison of
    :data:`_TOP_K_PAIRS` on the greedy reward ``reward[name]`` (:func:`_pooled_look` of the earlier and the added
    seeds) and ``adjusted[name]`` (pooled, the 5% split over the two looks); on the take-off ``steps[name]`` (the same
    over the seeds where both reached it; ``steps_adjusted``: pooled with the 5% split); ``greedy`` ``{(arm, seed):
    greedy reward}`` on both seeds' sets; ``metrics``: the runs' metrics (:func:`_committed_metrics`); per arm on the
    added seeds the report's row (``arms``), the runs ended low, never taking off (on seeds 0-15 too: ``first_never``)
    and collapsed; the wall times of the runs made for it. Checks that the report quotes exactly these seeds, its figures are the recomputed ones, the
    earlier figures the processed sweep's report's, and every added run was made on the Zen 4 VM at one thread, not
    copied, but the reference's runs at the seeds of a report listed before it: the untruncated reference is one run
    at every dose, so those are that report's runs, copied (their count ``copied``)."""
    archive = "sweep-long-tail-truncation"
    report, seeds = _TOP_K_MORE[label]
    summary = _summary(archive, report)
    arms, _, runs, setting, _, study = _one_vm_report(report, {a for pair in _TOP_K_PAIRS for a in pair[:2]}, seeds,
                                                      _ZEN4, archive)
    assert setting == f"long-tail-top-k-processed-{label}" and summary["outcome"] == "greedy_reward"
    first = _dose(archive, "long-tail-top-k-processed", label)
    first_study = _summary(archive, "long-tail-top-k-processed")["study"]
    assert all(list(first["arms"][a]["seeds"]) == list(_TOP_K_FIRST) for a in arms)
    assert {k: study[k] for k in ("last_k", "collapse_fraction", "confidence", "bootstrap")} == {
        k: first_study[k] for k in ("last_k", "collapse_fraction", "confidence", "bootstrap")}
    headers = _archive_headers(archive)
    before = list(_TOP_K_MORE)[:list(_TOP_K_MORE).index(label)]  # the reports made before this one, in order
    earlier = {f"long-tail-top-k-processed-{other}/ref_fp32/seed-{s}.jsonl": s
               for other in before for s in _TOP_K_MORE[other][1]}
    made_here = []
    for a in arms:  # made here, at one thread (the VM: _one_vm_report), or the reference copied from an earlier report
        for s in seeds:
            header = headers[setting, a, s]
            assert header["config"]["threads"] == 1, (a, s)
            source = header.get("copied_from")
            if source is None:
                made_here.append((a, s))
            else:
                assert a == "ref_fp32" and earlier.get("/".join(Path(source).parts[-3:])) == s, (a, s, source)
    greedy = {(a, s): _greedy(runs[setting, a, s][1]) for a in arms for s in (*_TOP_K_FIRST, *seeds)}
    # one set of run metrics serves both reports' seeds: the same setting, threshold and statistics settings
    assert summary["threshold"] == _summary(archive, "long-tail-top-k-processed")["threshold"]
    metrics = _committed_metrics(archive, summary)
    reward, adjusted, steps = {}, {}, {}
    for arm, base, name in _TOP_K_PAIRS:
        key = "vs_reference" if base == "ref_fp32" else "vs_none"
        look = _pooled_look({s: greedy[arm, s] - greedy[base, s] for s in _TOP_K_FIRST},
                            {s: greedy[arm, s] - greedy[base, s] for s in seeds}, study)
        assert _quoted(look.alone) == _quoted(arms[arm][key]["greedy_reward"]), name
        assert _quoted(look.earlier) == _quoted(first["arms"][arm][key]["greedy_reward"]), name
        reward[name], adjusted[name] = look, _mean_ci(look.pooled["diffs"], study, looks=2)
        took = _pooled_look(_took_off(_steps_of(metrics, arm, _TOP_K_FIRST),
                                      _steps_of(metrics, base, _TOP_K_FIRST)),
                            _took_off(_steps_of(metrics, arm, seeds), _steps_of(metrics, base, seeds)), study)
        assert _quoted(took.alone, "{:+.0f}") == _quoted(arms[arm][key]["steps_to_threshold"], "{:+.0f}"), name
        assert _quoted(took.earlier, "{:+.0f}") == _quoted(first["arms"][arm][key]["steps_to_threshold"],
                                                           "{:+.0f}"), name
        steps[name] = took
    return SimpleNamespace(
        seeds=seeds, first=first, arms=arms, study=study, summary=summary, metrics=metrics, reward=reward,
        adjusted=adjusted,
        steps=steps, steps_adjusted={name: _mean_ci(s.pooled["diffs"], study, looks=2) for name, s in steps.items()},
        greedy=greedy, low={a: arms[a]["ended_low"]["k"] for a in arms},
        never={a: _never(arms[a]) for a in arms}, first_never={a: _never(first["arms"][a]) for a in arms},
        collapsed={a: arms[a]["collapse"]["k"] for a in arms},
        walls=[runs[setting, a, s][1]["wall_s"] for a, s in made_here], copied=len(seeds) * len(arms) - len(made_here))


def _top_k_rows(x: SimpleNamespace) -> list[str]:
    """A section's three tables' rows (``x``: :func:`_top_k_more`), in order: the added seeds', one row per arm from
    the report (its seeds, mean K3, greedy reward, against the reference and none, runs ended low, runs that took off,
    runs the monitor warned on the mismatch); per comparison the pooled looks on the greedy reward (added seeds alone,
    seeds 0-15, pooled, its seeds, paired SD, MDE, seeds for 0.05, the 5% split); and on the take-off."""
    from megatron_mis.testbed.study.report import _fmt_ci, _fmt_diff

    rows = []
    for arm in ("ref_fp32", "none", "token_tis", "token_tis_normalized"):
        a = x.arms[arm]
        mon, n = a["monitor_flagged"], a["n"]
        rows.append(f"| {arm} | {n} | {_e(a['k3_mean'][0], 1)} | {_fmt_ci(a['greedy_reward'])} | "
                    f"{_fmt_diff(a['vs_reference']['greedy_reward'])} | {_fmt_diff(a['vs_none']['greedy_reward'])} | "
                    f"{x.low[arm]}/{n} | {n - x.never[arm]}/{n} | {mon['k']}/{mon['n']} |")
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    rows += [f"| {name} | {_quoted(r.alone)} | {_quoted(r.earlier)} | {_quoted(r.pooled)} | {r.pooled['n']} | "
             f"{r.sd:.3f} | {r.mde:.3f} | {r.needed} | {_quoted(x.adjusted[name])} |" for name, r in x.reward.items()]
    rows += [f"| {name} | {steps(t.alone)} ({t.alone['n']}) | {steps(t.earlier)} ({t.earlier['n']}) | "
             f"{steps(t.pooled)} ({t.pooled['n']}) |" for name, t in x.steps.items()]
    return rows



def _look_verdict(pooled: dict, adjusted: dict, subject: str, other: str, looks: str = "two") -> str:
    """How the section reads a pooled difference ``subject - other`` at a later look (``pooled``: its unadjusted
    paired-differences result; ``adjusted``: with the 5% split over the ``looks`` looks): behind or ahead where both
    intervals exclude 0, qualified where only the unadjusted one does."""
    for side, word in (("high", "behind"), ("low", "ahead of")):
        if (pooled[side] < 0) if side == "high" else (pooled[side] > 0):
            held = (adjusted[side] < 0) if side == "high" else (adjusted[side] > 0)
            return f"**{subject} is {word} {other}" + (
                "**" if held else f" unadjusted, not with the 5% split over the {looks} looks**")
    return f"**{subject} is not measurably different from {other}**"


@functools.cache
def _top_k_none() -> SimpleNamespace:
    """None and the reference at processed top-k 16 on the seeds of :data:`_TOP_K_NONE` beside seeds 0-15 and 16-29
    (:func:`_top_k_more` ``("k16")``), recomputed from the archive: none - reference on the greedy reward (``reward``:
    :func:`_pooled_look` of seeds 0-29 and the added seeds; ``adjusted``: pooled, the 5% split over the three looks)
    and on the steps to the take-off (``steps``, ``steps_adjusted``: the same over the seeds where both reached it);
    ``greedy`` ``{(arm, seed): greedy reward}`` on every seed; per arm on the added seeds the report's row (``arms``),
    the runs ended low, collapsed and never taking off; the wall times of the runs. Checks that the report quotes
    exactly these seeds with its study settings the top-k 16 section's, its figures are the recomputed ones, seeds
    0-29's are that section's pooled figures, and every added run was made on the Zen 4 VM at one thread, none
    copied."""
    archive = "sweep-long-tail-truncation"
    report, seeds = _TOP_K_NONE
    k16 = _top_k_more("k16")
    summary = _summary(archive, report)
    arms, _, runs, setting, _, study = _one_vm_report(report, {"none", "ref_fp32"}, seeds, _ZEN4, archive)
    assert setting == "long-tail-top-k-processed-k16" and summary["outcome"] == "greedy_reward"
    keys = ("last_k", "collapse_fraction", "confidence", "bootstrap")
    assert {k: study[k] for k in keys} == {k: k16.study[k] for k in keys}
    assert (summary["threshold"], summary["steps"]) == (k16.summary["threshold"], k16.summary["steps"])
    headers = _archive_headers(archive)
    for a in arms:
        for s in seeds:
            assert headers[setting, a, s]["config"]["threads"] == 1 and not headers[setting, a, s].get("copied_from")
    earlier = (*_TOP_K_FIRST, *k16.seeds)
    greedy = {**{(a, s): k16.greedy[a, s] for a in arms for s in earlier},
              **{(a, s): _greedy(runs[setting, a, s][1]) for a in arms for s in seeds}}
    metrics = _committed_metrics(archive, summary)
    reward = _pooled_look(*({s: greedy["none", s] - greedy["ref_fp32", s] for s in ss} for ss in (earlier, seeds)),
                          study)
    steps = _pooled_look(*(_took_off(_steps_of(metrics, "none", ss), _steps_of(metrics, "ref_fp32", ss))
                           for ss in (earlier, seeds)), study)
    row = arms["none"]["vs_reference"]
    assert _quoted(reward.alone) == _quoted(row["greedy_reward"])
    assert _quoted(steps.alone, "{:+.0f}") == _quoted(row["steps_to_threshold"], "{:+.0f}")
    assert _quoted(reward.earlier) == _quoted(k16.reward["none - reference"].pooled)  # as that section pooled them
    assert _quoted(steps.earlier, "{:+.0f}") == _quoted(k16.steps["none - reference"].pooled, "{:+.0f}")
    return SimpleNamespace(
        seeds=seeds, k16=k16, summary=summary, arms=arms, study=study, metrics=metrics, greedy=greedy, reward=reward,
        adjusted=_mean_ci(reward.pooled["diffs"], study, looks=3), steps=steps,
        steps_adjusted=_mean_ci(steps.pooled["diffs"], study, looks=3),
        low={a: arms[a]["ended_low"]["k"] for a in arms}, collapsed={a: arms[a]["collapse"]["k"] for a in arms},
        never={a: _never(arms[a]) for a in arms}, walls=[runs[setting, a, s][1]["wall_s"] for a in arms for s in seeds])


@functools.cache
def _top_k_replay() -> SimpleNamespace:
    """The replay's none at top-k 16 on the seeds of :data:`_TOP_K_REPLAY` beside the processed none and the reference
    on the same seeds (:func:`_top_k_none`), recomputed from the archive, paired per seed on the greedy reward
    (``reward``) and on the steps to the take-off (``steps``, over the seeds where both reached it): ``{name:
    (:func:`_mean_ci` result, paired SD, MDE, seeds for 0.05)}`` for replay - reference, replay - none (processed) and
    none (processed) - reference; ``greedy`` ``{(arm, seed): greedy reward}`` with the replay's runs as ``"replay"``;
    the report's rows (``arms``), the runs ended low, collapsed and never taking off, and the wall times of the runs made
    here; ``stuck``: the seeds whose replay run ended with its entropy within 1e-3 of ln 16, the most the kept ids'
    entropy can be (every kept distribution uniform). Checks that the report quotes exactly these seeds with the top-k
    16 sections' study settings, its figures are the recomputed ones, every replay run was made on the Zen 4 VM at one
    thread with the truncated log-probs recorded and the support replayed, and every reference run is a copy of the
    processed sweep's reference at that seed (the untruncated reference is one run at every dose)."""
    import numpy as np

    from megatron_mis.testbed.demo.config import DemoConfig
    from megatron_mis.testbed.study.runner import _comparable
    from megatron_mis.testbed.study.stats import seeds_for_effect

    archive = "sweep-long-tail-truncation"
    report, seeds = _TOP_K_REPLAY
    x = _top_k_none()
    summary = _summary(archive, report)
    arms, _, runs, setting, _, study = _one_vm_report(report, {"none", "ref_fp32"}, seeds, _ZEN4, archive)
    processed = "long-tail-top-k-processed-k16"
    assert setting == "long-tail-top-k-replay-k16" and summary["outcome"] == "greedy_reward"
    keys = ("last_k", "collapse_fraction", "confidence", "bootstrap")
    assert {k: study[k] for k in keys} == {k: x.study[k] for k in keys}
    assert (summary["threshold"], summary["steps"]) == (x.summary["threshold"], x.summary["steps"])
    headers, defaults = _archive_headers(archive), DemoConfig().to_dict()
    for s in seeds:
        config = headers[setting, "none", s]["config"]
        assert not headers[setting, "none", s].get("copied_from"), s
        assert (config["threads"], config["top_k"], config["rollout_logprobs"], config["trainer_truncation"]) == (
            1, 16, "processed", True), s
        assert headers[setting, "ref_fp32", s].get("copied_from"), s
        assert runs[setting, "ref_fp32", s] == runs[processed, "ref_fp32", s], s  # the same run, step for step
        # the run without the replay: only the replay differs (as the runner compares configurations: a key a run
        # file lacks, written before its field existed, counts as the field's default)
        other = headers[processed, "none", s]["config"]
        assert _comparable({**defaults, **other, "trainer_truncation": True}) == _comparable({**defaults, **config}), s
        assert other["trainer_truncation"] is False, s
    greedy = {**{(a, s): x.greedy[a, s] for a in ("none", "ref_fp32") for s in seeds},
              **{("replay", s): _greedy(runs[setting, "none", s][1]) for s in seeds}}
    metrics = _committed_metrics(archive, summary)
    steps_of = {"replay": _steps_of(metrics, "none", seeds), "none": _steps_of(x.metrics, "none", seeds),
                "ref_fp32": _steps_of(x.metrics, "ref_fp32", seeds)}
    assert steps_of["ref_fp32"] == _steps_of(metrics, "ref_fp32", seeds)  # the copies take off where their sources do
    reward, steps = {}, {}
    for a, b, name in (("replay", "ref_fp32", "replay - reference"), ("replay", "none", "replay - none"),
                       ("none", "ref_fp32", "none - reference")):
        d = _mean_ci({s: greedy[a, s] - greedy[b, s] for s in seeds}, study)
        sd = float(np.std(list(d["diffs"].values()), ddof=1))
        reward[name] = (d, sd, _paired_mde(d), seeds_for_effect(sd, 0.05))
        steps[name] = _mean_ci(_took_off(steps_of[a], steps_of[b]), study)
    row = arms["none"]["vs_reference"]
    assert _quoted(reward["replay - reference"][0]) == _quoted(row["greedy_reward"])
    assert _quoted(steps["replay - reference"], "{:+.0f}") == _quoted(row["steps_to_threshold"], "{:+.0f}")
    return SimpleNamespace(
        seeds=seeds, none=x, summary=summary, arms=arms, study=study, metrics=metrics, greedy=greedy, reward=reward,
        steps=steps, stuck=[s for s in seeds if abs(runs[setting, "none", s][0][-1]["entropy"] - math.log(16)) < 1e-3],
        low={a: arms[a]["ended_low"]["k"] for a in arms},
        collapsed={a: arms[a]["collapse"]["k"] for a in arms}, never={a: _never(arms[a]) for a in arms},
        walls=[runs[setting, "none", s][1]["wall_s"] for s in seeds])


def test_top_k_64_over_processed_log_probs_on_more_seeds_comes_from_the_archive():
    """docs/study.md's section on processed top-k 64 past the processed sweep's 16 seeds (:func:`_top_k_more`): its
    three tables (the added seeds' rows, the pooled looks on the greedy reward, the pooled take-off), the runs' count
    and times, the runs ended low, never taking off, collapsed and below the plateau, and the outcome of each question
    fixed before the runs, each from its rule; recomputed from the archive and both reports."""
    import numpy as np

    x = _top_k_more("k64")
    assert x.copied == 0
    seeds, all_seeds = x.seeds, (*_TOP_K_FIRST, *x.seeds)
    section = _section("Top-k 64 over processed log-probs on more seeds")
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    rows = _top_k_rows(x)
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    r, t, adj = x.reward, x.steps, x.adjusted
    first = x.first["arms"]
    tis_none, tis_ref = r["token TIS - none"], r["token TIS - reference"]
    norm_ref, none_ref = r["self-normalised - reference"], r["none - reference"]
    metrics = x.metrics
    (low_none,) = x.arms["none"]["ended_low"]["seeds"]
    (low_norm,) = x.arms["token_tis_normalized"]["ended_low"]["seeds"]
    assert x.arms["token_tis_normalized"]["collapse"]["k"] == 1 and x.collapsed["none"] == x.collapsed["token_tis"] == 0
    below = {a: [s for s in all_seeds if x.greedy[a, s] < 0.3] for a in x.arms}  # below the plateau (0.32-0.46)
    assert not below["none"] and not below["ref_fp32"] and not below["token_tis_normalized"]
    others = min(x.greedy[a, s] for a in ("none", "ref_fp32", "token_tis_normalized") for s in all_seeds)
    quotes = [
        f"all {len(x.walls)} runs finished by",
        f"every one made here: {len(x.walls)} runs, {sum(x.walls) / 3600:.1f} CPU-hours, "
        f"{np.median(x.walls) / 60:.1f} min per run (median)",
        # question 1
        _look_verdict(tis_none.pooled, adj["token TIS - none"], "Token TIS", "none") + " (question 1)",
        f"{_quoted(tis_none.pooled)} over {tis_none.pooled['n']} seeds; on the added seeds alone "
        f"{_quoted(tis_none.alone)}, the same mean as seeds 0-15's; with the 5% split over the two looks "
        f"{_quoted(adj['token TIS - none'])}",
        _look_verdict(tis_ref.pooled, adj["token TIS - reference"], "Token TIS", "the reference")
        + f": {_quoted(tis_ref.pooled)} pooled, {_quoted(adj['token TIS - reference'])} with the split",
        f"{x.low['token_tis']} of the {len(seeds)} added token TIS runs ended low and {x.never['token_tis']} never "
        "took "
        f"off (seeds 0-15: {first['token_tis']['ended_low']['k']} and {x.first_never['token_tis']}); none "
        f"{x.low['none']} of {len(seeds)} (seed {low_none}: its training reward, sampled through the truncation, ended "
        f"at {metrics['none', low_none]['final_reward']:.2f} against the bar "
        f"{x.arms['none']['ended_low']['bar']:.2f}, while its greedy reward, {x.greedy['none', low_none]:.3f}, was on "
        f"the plateau)",
        f"{len(below['token_tis'])} of its {len(all_seeds)} runs ended below 0.3 (seeds "
        + ", ".join(str(s) for s in below["token_tis"][:-1]) + f" and {below['token_tis'][-1]}, the lowest "
        f"{min(x.greedy['token_tis', s] for s in all_seeds):.3f}), none of the {len(all_seeds)} of none, the reference "
        f"or self-normalised token TIS (their lowest {others:.3f})",
        f"{steps(t['token TIS - none'].pooled)} steps pooled "
        f"({t['token TIS - none'].pooled['n']} seeds; {steps(x.steps_adjusted['token TIS - none'])} with the split), "
        f"though on the added seeds alone {steps(t['token TIS - none'].alone)}",
        # question 2
        _look_verdict(norm_ref.pooled, adj["self-normalised - reference"], "Self-normalised token TIS",
                      "the reference") + " (question 2)",
        f"{_quoted(norm_ref.pooled)} over {norm_ref.pooled['n']} seeds (added seeds alone {_quoted(norm_ref.alone)}), "
        f"and {_quoted(r['self-normalised - none'].pooled)} against none",
        f"The 16 seeds' \"just measurably below\" ({_quoted(norm_ref.earlier)}) does not hold",
        ("**Its later take-off than none's holds**" if t["self-normalised - none"].pooled["low"] > 0
         else "**Its later take-off than none's does not hold**")
        + f" either: {steps(t['self-normalised - none'].alone)} steps on the added seeds, "
        f"{steps(t['self-normalised - none'].pooled)} pooled",
        f"{x.low['token_tis_normalized']} of its {len(seeds)} added runs ended low (seed {low_norm}, counted also as a "
        f"collapse: its {x.study['last_k']}-step mean training reward peaked at "
        f"{metrics['token_tis_normalized', low_norm]['peak_reward']:.3f} and ended at "
        f"{metrics['token_tis_normalized', low_norm]['final_reward']:.3f}), while its greedy reward, "
        f"{x.greedy['token_tis_normalized', low_norm]:.3f}, was on the plateau",
        # question 3
        _look_verdict(none_ref.pooled, adj["none - reference"], "None", "the reference")[:-2]
        + " at top-k 64** (question 3)",
        f"{_quoted(none_ref.pooled)} over {none_ref.pooled['n']} seeds, **MDE {none_ref.mde:.3f}: the 0.05 target is "
        f"{'met' if none_ref.mde <= 0.05 else 'not met'}**",
        f"earlier take-off of none at top-k 64 ({steps(t['none - reference'].earlier)} steps, 16 seeds) does not hold "
        f"either: {steps(t['none - reference'].alone)} on the added seeds, {steps(t['none - reference'].pooled)} "
        "pooled",
        # what it changes
        f"its runs alone end below the plateau ({len(below['token_tis'])} of {len(all_seeds)}); against none its "
        f"deficit is {tis_none.pooled['mean']:.3f} at {tis_none.pooled['n']} seeds, resolved unadjusted only",
    ]
    # the rules behind the phrases: the verdicts above, and the readings of 16 seeds that did not survive
    assert tis_none.pooled["high"] < 0 < adj["token TIS - none"]["high"] and adj["token TIS - reference"]["high"] < 0
    assert norm_ref.earlier["high"] < 0 < norm_ref.pooled["high"] and t["none - reference"].earlier["high"] < 0
    assert t["self-normalised - none"].earlier["low"] > 0 and t["none - reference"].pooled["high"] > 0
    assert t["token TIS - none"].pooled["low"] > 0 and x.steps_adjusted["token TIS - none"]["low"] > 0
    assert abs(tis_none.alone["mean"] - tis_none.earlier["mean"]) < 0.0025  # "the same mean"
    mdes = [look.mde for look in r.values()]
    assert max(mdes) <= 0.05  # "All five comparisons now resolve the 0.05 target"
    assert len(mdes) == 5
    assert tis_none.earlier["low"] < 0 < tis_none.earlier["high"]  # "the CI that straddled 0"
    first_n = len(_TOP_K_FIRST)
    quotes += [f"So the CI that straddled 0 at {first_n} seeds now just excludes it",
               f"token TIS is measurably behind the reference ({len(all_seeds)} seeds)",
               f"Three readings of {first_n} seeds did not survive {len(seeds)} more",
               f"into the sweep's archive beside seeds {_TOP_K_FIRST.start}-{_TOP_K_FIRST.stop - 1}:"]
    quotes.append(f"All five comparisons now resolve the 0.05 target (MDE {min(mdes):.3f}-{max(mdes):.3f})")
    _assert_quoted(quotes, section)
    # the quotes elsewhere: the section above, the answers' row, "Not yet measured", the plan, the README, analyze
    n = len(all_seeds)
    assert (f"The next section adds seeds {seeds.start}-{seeds.stop - 1} at top-k 64 (none, the reference, token TIS "
            "and self-normalised token TIS): token TIS stays behind the reference, and three readings of these "
            f"{len(_TOP_K_FIRST)} seeds do not hold there") in _section("Top-p and top-k on the long-tail task")
    answers = _section("The answers so far, per mechanism")
    assert (f"at top-k 64 over {n} seeds ({len(seeds)} added) token TIS {_quoted(tis_ref.pooled)} against the "
            f"reference, {len(below['token_tis'])} of its {n} runs below the plateau, self-normalised "
            f"{_quoted(norm_ref.pooled)} and none {_quoted(none_ref.pooled)} (MDE {none_ref.mde:.3f});") in answers
    assert f"top-k 256 / 64 / 16 at 4-{len(_TOP_K_FIRST)} seeds ({n} at top-k 64 and " in answers  # with top-k 16's
    plan = _section("What has been run, and what the rest would cost")
    _assert_quoted([
        f"{sum(x.walls) / 3600:.1f} for the {len(x.walls)} runs of seeds {seeds.start}-{seeds.stop - 1} at processed "
        f"top-k 64 (Zen 4 VM, {np.median(x.walls) / 60:.1f} min per run)",
        f"processed top-k 64: none, the reference, token TIS and self-normalised token TIS x {len(seeds)} more on a "
        f"Zen 4 VM ({n} seeds, MDE {min(mdes):.3f}-{max(mdes):.3f}: **resolved**, none not hurt, token TIS behind the "
        "reference;"], plan)
    assert (f") and {_quoted(tis_ref.pooled)} at top-k 64 ({n} seeds; "  # after top-k 16's (its test)
            f"self-normalised {_quoted(norm_ref.pooled)}, none {_quoted(none_ref.pooled)})") in _prose(
        _STUDY_DOCS.parents[1] / "README.md")
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS

    assert (f"at {n} seeds ({len(seeds)} more, {_TOP_K_MORE['k64'][0]}) token TIS {_quoted(tis_ref.pooled)} against "
            f"the reference and {_quoted(tis_none.pooled)} against none (not excluding 0 with the 5% split over the two "
            f"looks), {len(below['token_tis'])}/{n} below the plateau (greedy reward under 0.3; no run of none, the "
            f"reference or token_tis_normalized), token_tis_normalized {_quoted(norm_ref.pooled)}, none "
            f"{_quoted(none_ref.pooled)}") in " ".join(TRUNCATION_BASIS.split())


def test_top_k_16_over_processed_log_probs_on_more_seeds_comes_from_the_archive():
    """docs/study.md's section on processed top-k 16 past the processed sweep's 16 seeds (:func:`_top_k_more`): its
    three tables, the runs made and copied and their times, the runs ended low, collapsed, never taking off and below
    the plateau, and the outcome of each question fixed before the runs, each from its rule; and its figures where the
    answers, the plan, the README, the self-normalised preset and analyze's basis quote them; recomputed from the
    archive and both reports."""
    import numpy as np

    x, k64 = _top_k_more("k16"), _top_k_more("k64")
    seeds, all_seeds = x.seeds, (*_TOP_K_FIRST, *x.seeds)
    n, n64 = len(all_seeds), len(_TOP_K_FIRST) + len(k64.seeds)
    section = _section("Top-k 16 over processed log-probs on more seeds")
    rows = _top_k_rows(x)
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    r, t, adj, t_adj = x.reward, x.steps, x.adjusted, x.steps_adjusted
    first = x.first["arms"]
    tis_none, tis_ref = r["token TIS - none"], r["token TIS - reference"]
    norm_ref, norm_none, none_ref = r["self-normalised - reference"], r["self-normalised - none"], r["none - reference"]
    metrics = x.metrics
    low_norm = x.arms["token_tis_normalized"]["ended_low"]["seeds"]
    assert [s for s in seeds if metrics["token_tis_normalized", s]["collapsed"]] == low_norm == [26, 29]
    assert x.collapsed["token_tis_normalized"] == len(low_norm) and x.collapsed["none"] == 1
    below = {a: [s for s in all_seeds if x.greedy[a, s] < 0.3] for a in x.arms}  # below the plateau (0.32-0.46)
    (none_below,), (norm_below,) = below["none"], below["token_tis_normalized"]
    assert not below["ref_fp32"] and norm_below == low_norm[0] and x.greedy["token_tis_normalized", low_norm[1]] > 0.3
    # the rules behind the phrases
    assert tis_ref.pooled["high"] < 0 and adj["token TIS - reference"]["high"] < 0
    assert tis_none.pooled["high"] < 0 < adj["token TIS - none"]["high"]
    assert 0.4 < tis_ref.alone["mean"] / tis_ref.earlier["mean"] < 0.6  # "half of seeds 0-15's"
    assert t["token TIS - reference"].pooled["low"] > 0 and t_adj["token TIS - reference"]["low"] > 0
    assert all(look.pooled["low"] < 0 < look.pooled["high"] for look in (norm_ref, norm_none))
    assert len(below["token_tis"]) > max(len(b) for a, b in below.items() if a != "token_tis")  # "more often than"
    assert t["self-normalised - reference"].pooled["high"] < 0 and t_adj["self-normalised - reference"]["high"] < 0
    sn_none = t["self-normalised - none"]
    assert sn_none.pooled["low"] < 0 < sn_none.pooled["high"] and sn_none.earlier["low"] < 0 < sn_none.earlier["high"]
    assert none_ref.pooled["low"] < 0 < none_ref.pooled["high"] and none_ref.alone["high"] < 0
    assert t["none - reference"].pooled["high"] < 0 < t_adj["none - reference"]["high"]
    mdes = [look.mde for look in r.values()]
    assert len(mdes) == 5 and max(mdes) <= 0.05  # "All five comparisons resolve the 0.05 target"
    quotes = [
        f"The cut stopped it at 19:30\nUTC with seeds {seeds.start}-{seeds.stop - 1} finished",
        f"{len(x.walls)} runs made here, {sum(x.walls) / 3600:.1f} CPU-hours, {np.median(x.walls) / 60:.1f} min per "
        f"run (median), and the\nreference's {x.copied} runs at seeds {k64.seeds.start}-{k64.seeds.stop - 1} copied",
        "--first-seed 16 --seeds " + str(len(seeds)),
        # question 1
        _look_verdict(tis_ref.pooled, adj["token TIS - reference"], "Token TIS", "the reference") + " (question 1): "
        f"{_quoted(tis_ref.pooled)} over {n} seeds, {_quoted(adj['token TIS - reference'])} with the 5% split over the "
        f"two looks; on the added seeds alone {_quoted(tis_ref.alone)}, half of seeds 0-15's "
        f"{tis_ref.earlier['mean']:.3f}",
        _look_verdict(tis_none.pooled, adj["token TIS - none"], "Token TIS", "none")
        + f": {_quoted(tis_none.pooled)} pooled, {_quoted(adj['token TIS - none'])} with the split; on the added seeds "
        f"alone {_quoted(tis_none.alone)}",
        f"Its take-off stays later than the reference's: {steps(t['token TIS - reference'].pooled)} steps pooled "
        f"({t['token TIS - reference'].pooled['n']} seeds; {steps(t_adj['token TIS - reference'])} with the split)",
        f"{x.low['token_tis']} of the {len(seeds)} added token TIS runs ended low, {x.collapsed['token_tis']} "
        f"collapsed and {x.never['token_tis']} never took off (seeds 0-15: {first['token_tis']['ended_low']['k']}, "
        f"{first['token_tis']['collapse']['k']} and {x.first_never['token_tis']})",
        # question 2
        _look_verdict(norm_ref.pooled, adj["self-normalised - reference"], "Self-normalised token TIS",
                      "the reference") + f" (question 2): {_quoted(norm_ref.pooled)} over {n} seeds, and "
        f"{_quoted(norm_none.pooled)} against none",
        f"Its earlier take-off than the reference's holds: {steps(t['self-normalised - reference'].pooled)} steps "
        f"pooled ({steps(t_adj['self-normalised - reference'])} with the split); against none {steps(sn_none.pooled)}, "
        f"not excluding 0 (the 16 seeds' {steps(sn_none.earlier)} neither)",
        f"{x.low['token_tis_normalized']} of its {len(seeds)} added runs ended low (seeds {low_norm[0]} and "
        f"{low_norm[1]}, both counted also as collapses; {first['token_tis_normalized']['ended_low']['k']} of 16 "
        f"before): seed {low_norm[0]}'s",
        *[f"seed {s}'s peaked at {metrics['token_tis_normalized', s]['peak_reward']:.3f} and ended at "
          f"{metrics['token_tis_normalized', s]['final_reward']:.3f}" for s in low_norm[1:]],
        f"seed {low_norm[0]}'s {x.study['last_k']}-step mean training reward peaked at "
        f"{metrics['token_tis_normalized', low_norm[0]]['peak_reward']:.3f} and ended at "
        f"{metrics['token_tis_normalized', low_norm[0]]['final_reward']:.3f}, its greedy reward "
        f"{x.greedy['token_tis_normalized', low_norm[0]]:.3f}, below",
        f"while its greedy reward, {x.greedy['token_tis_normalized', low_norm[1]]:.3f}, was on",
        # question 3
        "**None is not measurably different from the reference pooled, but the added seeds alone put it\n  behind** "
        f"(question 3): {_quoted(none_ref.pooled)} over {n} seeds ({_quoted(adj['none - reference'])} with the\n  "
        f"split), **MDE {none_ref.mde:.3f}: the 0.05 target is met**; the interval leaves a cost up to "
        f"{-none_ref.pooled['low']:.3f}",
        f"On the\n  added seeds alone {_quoted(none_ref.alone)}",
        f"where {x.low['none']} of its {len(seeds)} runs ended\n  low ({first['none']['ended_low']['k']} of 16 "
        f"before) and one collapsed",
        f"None's earlier take-off holds unadjusted, not with the\n  split: {steps(t['none - reference'].pooled)} steps "
        f"pooled, {steps(t_adj['none - reference'])} with the split ({steps(t['none - reference'].alone)} on the added"
        f"\n  seeds alone)",
        # below the plateau, and what it changes
        f"{len(below['token_tis'])} of token\n  TIS's {n} runs ended with a greedy reward below 0.3 (seeds "
        + ", ".join(str(s) for s in below["token_tis"][:-1]) + f" and {below['token_tis'][-1]}), 1 of\n  none's "
        f"(seed {none_below}, {x.greedy['none', none_below]:.3f}), 1 of self-normalised token TIS's (seed "
        f"{norm_below}) and none of the reference's",
        f"measurably behind the reference ({n} seeds)",
        f"(MDE {none_ref.mde:.3f}), though at this dose, the smallest kept\n  mass run, the added seeds alone put it "
        f"{-none_ref.alone['mean']:.3f} behind",
        f"All five comparisons resolve the 0.05 target (MDE {min(mdes):.3f}-{max(mdes):.3f})",
        f"So of the {len(_TOP_K_FIRST)} seeds' \"behind both\", behind the reference holds and behind none is a "
        "second look at the 5% level, not a resolved difference",
        f"a look at {len(seeds)} seeds, not the pre-registered pooled question",
        f"a cost of about {-none_ref.alone['mean']:.2f} at top-k 16 is not excluded",
        f"the two runs of seed {seeds.stop} going then were stopped; none of seed {seeds.stop} reached the archive "
        f"from this run; the section after runs none and the reference from seed {_TOP_K_NONE[1].start}",
    ]
    # past the cut the archive holds only the section after's runs (none and the reference, made there)
    assert _TOP_K_NONE[1].start == seeds.stop
    assert {key[1:] for key in _archive_runs("sweep-long-tail-truncation")
            if key[0] == "long-tail-top-k-processed-k16" and key[2] >= seeds.stop} == {
        (a, s) for a in ("none", "ref_fp32") for s in _TOP_K_NONE[1]}
    _assert_quoted([" ".join(q.split()) for q in quotes], " ".join(section.split()))
    # the quotes elsewhere: the section before it, the answers' row, "Not yet measured", the plan, README, analyze
    assert (f"The section after it adds seeds {seeds.start}-{seeds.stop - 1} at top-k 16: token TIS stays behind the "
            "reference, and behind none only unadjusted; self-normalised token TIS stays level with the reference; "
            f"none is not measurably behind it pooled ({_quoted(none_ref.pooled)}, {n} seeds).") in " ".join(
        _section("Top-p and top-k on the long-tail task").split())
    answers = _section("The answers so far, per mechanism")
    assert (f"; at top-k 16 over {n} seeds ({len(seeds)} added) token TIS {_quoted(tis_ref.pooled)} against the "
            f"reference and {_quoted(tis_none.pooled)} against none (not excluding 0 with the 5% split over the two "
            f"looks), self-normalised {_quoted(norm_ref.pooled)} and none {_quoted(none_ref.pooled)} (MDE "
            f"{none_ref.mde:.3f}; {_quoted(none_ref.alone)} on the {len(seeds)} added seeds alone)") in answers
    mdes64 = [look.mde for look in k64.reward.values()]
    assert (f"top-k 256 / 64 / 16 at 4-{len(_TOP_K_FIRST)} seeds ({n64} at top-k 64 and {n} at top-k 16 for none, "
            "the reference and token TIS with and without self-normalisation, each comparison's MDE at most "
            f"{max(mdes64):.3f} and {max(mdes):.3f}") in " ".join(answers.split())
    plan = " ".join(_section("What has been run, and what the rest would cost").split())
    _assert_quoted([
        f"{sum(x.walls) / 3600:.1f} for the {len(x.walls)} runs of seeds {seeds.start}-{seeds.stop - 1} at processed "
        f"top-k 16 (Zen 4 VM, {np.median(x.walls) / 60:.1f} min per run)",
        f"processed top-k 16: the same four arms x {len(seeds)} more on a Zen 4 VM ({n} seeds, MDE "
        f"{min(mdes):.3f}-{max(mdes):.3f}: **resolved**, none not measurably behind pooled, token TIS behind the "
        "reference;",
        f"every long-tail sweep but `long-tail-top-k-processed` k64's and k16's none, reference, token TIS and "
        f"self-normalised token TIS ({n64} and {n} seeds"], plan)
    assert (f"token TIS hurts, {_quoted(tis_ref.pooled)} at top-k 16 ({n} seeds; self-normalised "
            f"{_quoted(norm_ref.pooled)},") in _prose(
        _STUDY_DOCS.parents[1] / "README.md")
    # "Not yet measured": the runs ended low over both sections' seeds
    low = {a: x.first["arms"][a]["ended_low"]["k"] + x.low[a] + k64.first["arms"][a]["ended_low"]["k"] + k64.low[a]
           for a in ("token_tis_normalized", "token_tis")}
    assert (f"self-normalised, token TIS ended low in {low['token_tis_normalized']} of {n + n64} runs at top-k 16 and "
            f"64 (unnormalised {low['token_tis']} of {n + n64};") in " ".join(answers.split())
    preset = " ".join(line.lstrip("# ") for line in (_STUDY_DOCS.parents[1] / "configs" / "presets" /
                                                    "token_tis_normalized.yaml").read_text().splitlines())
    assert (f"ended measurably below the reference on the greedy reward "
            f"({_quoted(k64.reward['token TIS - reference'].pooled)} at top-k 64, {n64} seeds; "
            f"{_quoted(tis_ref.pooled)} at top-k 16, {n} seeds); self-normalised, it was level with the reference "
            f"({_quoted(k64.reward['self-normalised - reference'].pooled)} and {_quoted(norm_ref.pooled)})"
            ) in " ".join(preset.split())
    assert all(look.pooled["low"] < 0 < look.pooled["high"]
               for look in (k64.reward["self-normalised - reference"], norm_ref))  # "level with the reference"
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS

    assert (f"at top-k 16 over {n} seeds ({len(seeds)} more, {_TOP_K_MORE['k16'][0]}) token TIS "
            f"{_quoted(tis_ref.pooled)} against the reference and {_quoted(tis_none.pooled)} against none (not "
            f"excluding 0 with the 5% split), token_tis_normalized {_quoted(norm_ref.pooled)}, none "
            f"{_quoted(none_ref.pooled)}") in " ".join(TRUNCATION_BASIS.split())


def _one_machine(summary: dict, runs_made: int) -> SimpleNamespace:
    """The one machine kind a report's runs were made on, as the sections name it (``cpu``, ``family``, ``model``,
    ``python``, ``torch``: the version without its build suffix), checked against the report's ``runs_made_on``: one
    kind, AVX-512 kernels, ``runs_made`` runs (a copied run counts on its source's machine)."""
    machine = summary["machine"]
    (made_on,) = summary["runs_made_on"]
    family, model = machine["cpu_family_model"].split("/")
    assert made_on == (f"{machine['cpu']} (family {family} model {model}) [AVX512], Python {machine['python']}, "
                       f"torch {machine['torch']}") and summary["runs_made_on"][made_on] == runs_made
    return SimpleNamespace(cpu=machine["cpu"], family=family, model=model, python=machine["python"],
                           torch=machine["torch"].split("+")[0])


def test_none_and_the_reference_at_top_k_16_on_more_seeds_come_from_the_archive():
    """docs/study.md's section on none and the reference at processed top-k 16 past seed 29 (:func:`_top_k_none`): its
    three tables, the runs made and their times, the runs ended low, collapsed and below the plateau, and the outcome
    of each question fixed before the runs, each from its rule; and its figures where the answers, the plan, the
    README and analyze's basis quote them; recomputed from the archive and the three reports."""
    import numpy as np

    from megatron_mis.testbed.study.report import _fmt_ci, _fmt_diff

    x = _top_k_none()
    k16, seeds, r, t = x.k16, x.seeds, x.reward, x.steps
    first, second = k16.reward["none - reference"], k16.steps["none - reference"]
    all_seeds = (*_TOP_K_FIRST, *k16.seeds, *seeds)
    n = len(all_seeds)
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    section = _section("None and the reference at top-k 16 on more seeds")
    span = f"seeds {seeds.start}-{seeds.stop - 1}"
    rows = [f"| {arm} | {a['n']} | {_e(a['k3_mean'][0], 1)} | {_fmt_ci(a['greedy_reward'])} | "
            f"{_fmt_diff(a['vs_reference']['greedy_reward'])} | {x.low[arm]}/{a['n']} | {x.collapsed[arm]}/{a['n']} | "
            f"{a['n'] - x.never[arm]}/{a['n']} | {a['monitor_flagged']['k']}/{a['monitor_flagged']['n']} |"
            for arm, a in ((arm, x.arms[arm]) for arm in ("ref_fp32", "none"))]
    rows += [f"| comparison | {span} alone | seeds 0-15 | seeds {k16.seeds.start}-{k16.seeds.stop - 1} | pooled |",
             f"| none - reference | {_quoted(r.alone)} | {_quoted(first.earlier)} | {_quoted(first.alone)} | "
             f"{_quoted(r.pooled)} | {r.pooled['n']} | {r.sd:.3f} | {r.mde:.3f} | {r.needed} | {_quoted(x.adjusted)} |",
             f"| none - reference | {steps(t.alone)} ({t.alone['n']}) | {steps(second.earlier)} "
             f"({second.earlier['n']}) | {steps(second.alone)} ({second.alone['n']}) | {steps(t.pooled)} "
             f"({t.pooled['n']}) | {steps(x.steps_adjusted)} |"]
    _assert_quoted(rows, section)
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert section.count("| none - reference |") == 2  # one row in each table of looks, no other
    assert section.count(rows[2]) == 2  # both tables of looks name the three sets of seeds
    assert x.collapsed == {"none": 0, "ref_fp32": 0} and x.never == {"none": 0, "ref_fp32": 0}
    (low,) = x.arms["none"]["ended_low"]["seeds"]
    assert not x.arms["ref_fp32"]["ended_low"]["seeds"]
    below = {a: [s for s in all_seeds if x.greedy[a, s] < 0.3] for a in x.arms}  # below the plateau (0.32-0.46)
    assert not below["ref_fp32"] and low in below["none"]
    # the rules behind the phrases
    assert r.pooled["high"] < 0 and x.adjusted["high"] < 0  # "None is behind the reference", at a third look
    assert r.alone["low"] < 0 < r.alone["high"]  # the added seeds alone do not exclude 0
    assert t.pooled["high"] < 0 and x.steps_adjusted["high"] < 0  # "None's earlier take-off holds"
    assert r.mde < 0.05
    k64 = _top_k_more("k64").reward["none - reference"]
    norm_none = k16.reward["self-normalised - none"]
    assert k64.pooled["low"] < 0 < k64.pooled["high"] and norm_none.pooled["low"] < 0 < norm_none.pooled["high"]
    cost = -r.pooled["mean"]
    assert norm_none.mde > cost  # "too coarse for" none's cost
    assert 0.2 < cost / 0.05 < 0.3  # "about a quarter of the 0.05 target"
    quotes = [
        f"{len(x.walls)} runs made here, none copied, {sum(x.walls) / 3600:.1f} CPU-hours, "
        f"{np.median(x.walls) / 60:.1f} min per run (median)",
        f"All {len(seeds)} seeds finished before the cut",
        f"--first-seed {seeds.start} --seeds {len(seeds)}",
        f"up to {len(seeds)} seeds ({seeds.start}-{seeds.stop - 1})",
        # question 1
        _look_verdict(r.pooled, x.adjusted, "None", "the reference", looks="three")
        + f" (question 1): {_quoted(r.pooled)} over {n} seeds, "
        f"{_quoted(x.adjusted)} with the 5% split over the three looks; MDE {r.mde:.3f}. The added seeds alone do not "
        f"exclude 0 ({_quoted(r.alone)}, the upper bound {r.alone['high']:+.4f}); the three sets' means are "
        f"{first.earlier['mean']:.3f}, {first.alone['mean']:.3f} and {r.alone['mean']:.3f}. So sampling from the top "
        f"16 of 512 ids cost the uncorrected run about {cost:.3f} of greedy reward, between "
        f"{-x.adjusted['high']:.3f} and {-x.adjusted['low']:.3f} at the split's level: about a quarter of the 0.05 "
        "target",
        # question 2
        f"**None's earlier take-off holds** (question 2): {steps(t.pooled)} steps over {t.pooled['n']} seeds, "
        f"{steps(x.steps_adjusted)} with the split; {steps(t.alone)} on the added seeds alone",
        # question 3
        f"**Ended low** (question 3): {x.low['none']} of none's {len(seeds)} added runs ended low (seed {low}: its "
        f"{x.study['last_k']}-step mean training reward peaked at {x.metrics['none', low]['peak_reward']:.3f} and "
        f"ended at {x.metrics['none', low]['final_reward']:.3f}, its greedy reward {x.greedy['none', low]:.3f}) and "
        "none collapsed; no run of the reference ended low",
        f"over the {n} seeds (a count not fixed before the first runs): {len(below['none'])} of none's (seeds "
        + ", ".join(str(s) for s in below["none"][:-1]) + f" and {below['none'][-1]}: "
        + ", ".join(f"{x.greedy['none', s]:.3f}" for s in below["none"][:-1])
        + f" and {x.greedy['none', below['none'][-1]]:.3f}) and none of the reference's",
        # what it changes
        f"where none falls measurably behind the reference, by about {cost:.3f}; at top-k 64 it did not "
        f"({_quoted(k64.pooled)}, {k64.pooled['n']} seeds, MDE {k64.mde:.3f})",
        f"self-normalised token TIS was level with none ({_quoted(norm_none.pooled)}, {norm_none.pooled['n']} seeds; "
        f"MDE {norm_none.mde:.3f}, too coarse for {cost:.3f})",
        # the pre-registration's figures: the earlier sections'
        f"over 30 seeds ({_quoted(first.pooled)}, MDE {first.mde:.3f}; the section above), but seeds 16-29 alone put "
        f"it behind ({_quoted(first.alone)})",
        f"none's earlier take-off held unadjusted only ({steps(second.pooled)} steps)",
        f"({k16.first['arms']['none']['ended_low']['k']} of seeds 0-15's 16)",
        f"({k16.first['arms']['none']['ended_low']['k']} and {k16.first['arms']['none']['collapse']['k']} of seeds "
        f"0-15's 16 runs, {k16.low['none']} and {k16.collapsed['none']} of seeds 16-29's 14)",
        f"(none {len([s for s in below['none'] if s < seeds.start])} and the reference 0 of 30 before)",
    ]
    # the machine, the report, the take-off's threshold and the other doses' seeds, as the runs and reports give them
    summary = x.summary
    vm = _one_machine(summary, len(x.walls))
    replay = _dose("sweep-long-tail-truncation", "long-tail-top-k-replay", "k64")["arms"]["none"]["n"]
    others = [_dose("sweep-long-tail-truncation", f"long-tail-{kind}-processed", label)["arms"]["none"]["n"]
              for kind, label in (("top-k", "k256"), ("top-p", "p0.95"), ("top-p", "p0.8"))]
    top_k = summary["doses"][0]["label"].removeprefix("k")  # the dose k16 (its setting checked in _top_k_none)
    quotes += [
        f"The added runs, on the Zen 4 VM (AMD EPYC family {vm.family} model {vm.model}, AVX-512 kernels, Python "
        f"{vm.python}, torch {vm.torch}, {summary['threads_per_run']} thread each)",
        f"Report: [{_TOP_K_NONE[0]}/](study/sweep-long-tail-truncation/{_TOP_K_NONE[0]}/report.md)",
        f"into {_TOP_K_NONE[0]}/)", f"archive beside seeds 0-{seeds.start - 1};",
        f"(the {x.study['last_k']}-step mean training reward reaching {summary['threshold']})",
        f"nor at top-k 256 or top-p down to 0.8 ({min(others)}-{max(others)} seeds on this task)",
        f"(run only at top-k 64, {replay} seeds; the section after runs it at top-k 16 and finds the sampling's)",
        "| seeds for 0.05 | pooled, 5% split over three looks |",
        "Below a greedy reward of 0.3 over", f"**What it changes**: top-k {top_k}, the smallest kept mass run",
        f"the support in the trainer at top-k {top_k} would",
        f"({vm.cpu} family {vm.family} model {vm.model}, Zen 4, torch kernels AVX-512, Python {vm.python}, "
        f"torch {vm.torch})"]
    assert first.pooled["n"] == 30 and len(k16.seeds) == 14 and (k16.seeds.start, k16.seeds.stop) == (16, seeds.start)
    _assert_quoted([" ".join(q.split()) for q in quotes], " ".join(section.split()))
    # the quotes elsewhere: the sections before, the answers' row, the summary, "Not yet measured", the plan, README,
    # analyze's basis
    pooled = f"{_quoted(r.pooled)} over {n} seeds (MDE {r.mde:.3f}; a third look, {_quoted(x.adjusted)} with the 5% split"
    assert (f"top-k 256, 64 and 16, on these 4-16 seeds; {n} seeds later put none {cost:.3f} behind at top-k 16"
            in " ".join(_section("Top-p and top-k on the long-tail task").split()))
    for part in ("Top-p and top-k on the long-tail task", "Top-k 16 over processed log-probs on more seeds"):
        assert (f"none's and the reference's seeds {seeds.start}-{seeds.stop - 1}" in _section(part)
                and f"over {n} seeds none is behind" in " ".join(_section(part).split())
                and _quoted(r.pooled) in _section(part)), part
    assert (f"{_quoted(r.pooled)} (a third look; {_quoted(x.adjusted)} with the 5% split over the three looks)."
            in " ".join(_section("Top-p and top-k on the long-tail task").split()))
    answers = " ".join(_section("The answers so far, per mechanism").split())
    k64_n = k64.pooled["n"]
    k256_n = _dose("sweep-long-tail-truncation", "long-tail-top-k-processed", "k256")["arms"]["none"]["n"]
    _assert_quoted([
        f"(`long-tail-top-p-*`, `long-tail-top-k-*`, 64 tokens, 4-{n}, greedy reward) | top-k 16, by about "
        f"{cost:.3f}: none - reference {pooled} over the three looks); none at p = 0.95, 0.9, 0.8 or top-k 256, 64 (",
        f"on the {len(k16.seeds)} added seeds alone); no correction run recovers none's cost at top-k 16 "
        f"(self-normalised token TIS level with none, {_quoted(norm_none.pooled)}, {norm_none.pooled['n']} seeds; MDE "
        f"{norm_none.mde:.3f}) |",
        f"on a 512-id tail p = 0.8 and top-k 256 / 64 at 4-{max(k64_n, k256_n)} seeds) did not; top-k 16 on that tail "
        f"did, by about {cost:.3f} (none - reference {_quoted(r.pooled)}, {n} seeds, a third look).",
        f"and {n} at top-k 16 for none and the reference, MDE {r.mde:.3f}; run there: harmless to none but at top-k "
        f"16, where it cost about {cost:.3f},"], answers)
    plan = " ".join(_section("What has been run, and what the rest would cost").split())
    _assert_quoted([
        f"{sum(x.walls) / 3600:.1f} for the {len(x.walls)} runs of none and the reference at {span} at processed "
        f"top-k 16 (Zen 4 VM, {np.median(x.walls) / 60:.1f} min per run);",
        f"then none and the reference x {len(seeds)} more there ({n} seeds, MDE {r.mde:.3f}: **resolved**, none "
        f"behind the reference by {cost:.3f}, a third look; \"None and the reference at top-k 16 on more seeds\");",
        f"self-normalised token TIS ({k64_n} and {first.pooled['n']} seeds; none and the reference {n} at k16), "
        "`long-tail-top-k-replay` k16's"], plan)
    readme = _prose(_STUDY_DOCS.parents[1] / "README.md")
    _assert_quoted([
        f"| top-k 16 of a 512-id tail, by about {cost:.3f}: {_quoted(r.pooled)} ({n} seeds, MDE {r.mde:.3f}; a third "
        "look, excluding 0 also with the 5% split over the looks); none at top-p 0.95-0.8 or top-k 256-64:",
        "level with none: no correction run recovers none's cost there) and",
        f"did not measurably hurt the uncorrected run at the doses run but one (top-k 16 of a 512-id tail, by about "
        f"{cost:.3f} over {n} seeds,"], readme)
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS

    assert (f"; at top-k 16 over {n} seeds ({len(seeds)} more of none and the reference, {_TOP_K_NONE[0]}) none "
            f"{_quoted(r.pooled)} against the reference ({_quoted(x.adjusted)} with the 5% split over the three looks; "
            f"MDE {r.mde:.3f})") in " ".join(TRUNCATION_BASIS.split())


def test_the_support_replayed_at_top_k_16_comes_from_the_archive():
    """docs/study.md's section on the replay's none at top-k 16 (:func:`_top_k_replay`): its two tables, the runs made
    and their times, the runs ended low, collapsed, never taking off, below the plateau and stuck at the kept ids'
    entropy, each question's outcome from its rule and the reading fixed with them before the runs; recomputed from
    the archive and the reports."""
    import numpy as np

    from megatron_mis.testbed.study.report import _fmt_ci, _fmt_diff

    x = _top_k_replay()
    seeds, r, t, n = x.seeds, x.reward, x.steps, len(x.seeds)
    section = _section("The support replayed at top-k 16")
    steps = functools.partial(_quoted, fmt="{:+.0f}")
    names = {"ref_fp32": "ref_fp32", "none": "none (replay)"}
    rows = [f"| {names[arm]} | {a['n']} | {_e(a['k3_mean'][0], 1)} | {_fmt_ci(a['greedy_reward'])} | "
            f"{_fmt_diff(a['vs_reference']['greedy_reward'])} | {x.low[arm]}/{a['n']} | {x.collapsed[arm]}/{a['n']} | "
            f"{a['n'] - x.never[arm]}/{a['n']} | {a['monitor_flagged']['k']}/{a['monitor_flagged']['n']} |"
            for arm, a in ((arm, x.arms[arm]) for arm in ("ref_fp32", "none"))]
    rows += [f"| {name} | {_quoted(d)} | {sd:.3f} | {mde:.3f} | {needed} | {steps(t[name])} ({t[name]['n']}) |"
             for name, (d, sd, mde, needed) in r.items()]
    _assert_quoted(rows, section)
    assert [section.index(row) for row in rows] == sorted(section.index(row) for row in rows)
    assert sum(section.count(f"| {name} |") for name in r) == len(r)  # one row per comparison, no other
    q1, q2, scale = (r[name][0] for name in ("replay - reference", "replay - none", "none - reference"))
    # the reading fixed before the runs
    if q1["high"] < 0 and q2["low"] < 0 < q2["high"]:
        reading = "the cost is the truncated sampling's"
    elif q2["low"] > 0 and q1["low"] < 0 < q1["high"]:
        reading = "the cost is the mismatch's"
    else:
        reading = f"not separated at {n} seeds"
    stuck = x.stuck
    below = {a: [s for s in seeds if x.greedy[a, s] < 0.3] for a in ("replay", "none", "ref_fp32")}
    never = [s for s in seeds if x.metrics["none", s]["steps_to_threshold"] is None]
    assert len(never) == x.never["none"]
    quotes = [
        f"{len(x.walls)} runs made here, the reference's {n} copied, {sum(x.walls) / 3600:.1f} CPU-hours, "
        f"{np.median(x.walls) / 60:.1f} min per run (median)",
        f"--first-seed {seeds.start} --seeds 50", "up to 50 seeds (0-49)",  # the pre-registered count, cut by the clock
        _look_verdict(q1, q1, "The replay", "the reference") + f" (question 1): {_quoted(q1)} over {n} seeds (MDE "
        f"{r['replay - reference'][2]:.3f})",
        _look_verdict(q2, q2, "The replay", "none without it") + f" (question 2): {_quoted(q2)} (MDE "
        f"{r['replay - none'][2]:.3f}); none without it - reference on the same seeds {_quoted(scale)} (MDE "
        f"{r['none - reference'][2]:.3f})",
        f"**Reading** (the rule fixed before the runs): {reading}",
        f"The replay's mean K3 {_e(x.arms['none']['k3_mean'][0], 1)}: the mismatch is gone, and the monitor warned on "
        f"{x.arms['none']['monitor_flagged']['k'] or 'none'} of the {n} runs",
        f"{x.low['none']} of the replay's {n} runs ended low, {x.collapsed['none']} collapsed and "
        f"{x.never['none']} never took off",
        f"below a greedy reward of 0.3: the replay {len(below['replay'])}, none without it {len(below['none'])}, the "
        f"reference {len(below['ref_fp32'])}",
        "ended with its entropy within 1e-3 of ln 16: seed" + ("s " if len(stuck) > 1 else " ")
        + ", ".join(map(str, stuck)),
    ]
    # the prose's figures: the take-off, none's cost against the interval's upper end, the look without the stuck
    # seeds (not fixed before the runs), the cut, and the earlier section's cost
    back = {name: f"{-t[name]['mean']:.0f} [{-t[name]['high']:.0f}, {-t[name]['low']:.0f}]" for name in t}
    without = {name: _mean_ci({s: x.greedy["replay", s] - x.greedy[b, s] for s in seeds if s not in stuck}, x.study)
               for name, b in (("replay - reference", "ref_fp32"), ("replay - none", "none"))}
    pooled = x.none.reward.pooled
    summary = x.summary
    vm = _one_machine(summary, len(x.walls) + n)  # the replay runs made here and the reference's copies
    top_k = summary["doses"][0]["label"].removeprefix("k")  # the dose k16 (its setting checked in _top_k_replay)
    vocab = _archive_headers("sweep-long-tail-truncation")["long-tail-top-k-replay-k16", "none", 0]["config"][
        "vocab_size"]
    quotes += [
        f"the replay took off {back['replay - reference']} steps before the reference ({t['replay - reference']['n']} "
        f"seeds where both did) and {back['replay - none']} before none without it, then ended lower",
        f"The interval's upper end, {q2['high']:+.3f}, is below none's cost on these seeds ({-scale['mean']:.3f})",
        f"(seeds {', '.join(map(str, below['replay'][:-1]))} and {below['replay'][-1]} of the replay: "
        + ", ".join(f"{x.greedy['replay', s]:.3f}" for s in below["replay"][:-1])
        + f" and {x.greedy['replay', below['replay'][-1]]:.3f})",
        f"replay - reference {_quoted(without['replay - reference'])} and replay - none "
        f"{_quoted(without['replay - none'])} over {without['replay - none']['n']} seeds",
        f"By the cut {n} seeds had finished (seeds {seeds.start}-{seeds.stop - 1}; the runs of seeds {seeds.stop} and "
        f"{seeds.stop + 1} going then were stopped and left out)",
        f"`--seeds {n}` then copied the reference's seeds {seeds.start}-{seeds.stop - 1}",
        f"(0.{round(-pooled['mean'] * 1000):03d} over {pooled['n']} seeds)",
        f"behind the reference ({-q1['mean']:.3f} here, {-without['replay - reference']['mean']:.3f} without seed "
        + ", ".join(map(str, stuck)) + ")",
        f"Report: [{_TOP_K_REPLAY[0]}/](study/sweep-long-tail-truncation/{_TOP_K_REPLAY[0]}/report.md)",
        f"into {_TOP_K_REPLAY[0]}/)",
        # the dose, the seeds and the question numbers as the section names them
        f"against the reference, on the same seeds {seeds.start}-{seeds.stop - 1}, paired per seed:",
        "| comparison | greedy reward | paired SD | MDE | seeds for 0.05 | take-off, steps (seeds where both reached it) |",
        f"Sampling from the top {top_k} ids with the support replayed",
        f"what remains is sampling from the top {top_k} of {vocab} ids itself",
        "**The take-off, ended low and K3** (question 3)", f"seed {stuck[0]}, greedy reward 0);",
        f"Without seed {stuck[0]} (a look not fixed before the runs)", f"**What it changes**: at top-k {top_k} on this",
        f"whether slime's replay also leaves the cost of top-k {top_k} in place",
        f"The replay runs, on the Zen 4 VM (AMD EPYC family {vm.family} model {vm.model}, AVX-512 kernels, Python "
        f"{vm.python}, torch {vm.torch}, {summary['threads_per_run']} thread each)",
    ]
    assert q2["high"] < -scale["mean"]  # "the replay did not win all of it back"
    # "none was not measurably behind at top-k 64 or 256": the wider supports' own looks
    k64 = _top_k_more("k64").reward["none - reference"].pooled
    k256 = _dose("sweep-long-tail-truncation", "long-tail-top-k-processed", "k256")["arms"]["none"]
    k256_ref = k256["vs_reference"]["greedy_reward"]
    assert k64["low"] < 0 < k64["high"] and k256_ref["low"] < 0 < k256_ref["high"]
    quotes.append(f"(none was not measurably behind at top-k 64 or 256, {k64['n']} and {k256['n']} seeds)")
    assert without["replay - reference"]["high"] < 0  # "the finding does not hang on the one run that never learned"
    assert len(stuck) == 1 and x.greedy["replay", stuck[0]] == 0.0  # "greedy reward 0"
    _assert_quoted([" ".join(q.split()) for q in quotes], " ".join(section.split()))
    assert set(stuck) <= set(never)  # a run stuck at the kept ids' entropy never took off
    # the quotes elsewhere (each says the cost is the truncated sampling's: the reading above)
    assert reading == "the cost is the truncated sampling's"
    mde1, mde2 = r["replay - reference"][2], r["replay - none"][2]
    k3 = _e(x.arms["none"]["k3_mean"][0], 1)
    _assert_quoted([
        f"replay removes it (K3 to rounding) but not none's cost at top-k 16, which is the truncated sampling's: the "
        f"replay {_quoted(q1)} against the reference and {_quoted(q2)} against none ({n} seeds, MDE {mde1:.3f} and "
        f"{mde2:.3f}; its entropy bonus over the kept ids, one run of {n} stuck there)",
        f"and {n} seeds of the replay there put the cost on the truncated sampling, not the mismatch (the replay behind "
        f"the reference, {_quoted(q1)}), with the entropy bonus over the kept ids;",
        f"{sum(x.walls) / 3600:.1f} for the {len(x.walls)} runs of the replay at top-k 16 (Zen 4 VM, "
        f"{np.median(x.walls) / 60:.1f} min per run) |",
        f"replay at top-k 16: none x {n} there, the reference copied (MDE {min(mde1, mde2):.3f}-{max(mde1, mde2):.3f}: "
        "**resolved**, the cost is the truncated sampling's, the entropy bonus over the kept ids; \"The support "
        "replayed at top-k 16\") |",
        f"`long-tail-top-k-replay` k16's none ({n} seeds; slime's replay, `long-tail-top-k-replay-full-entropy`, "
        f"{len(_TOP_K_REPLAY_CHECK[1])}), `long-tail-stale-128` k2's"], _prose(_STUDY_DOCS.parent / "study.md"))
    _assert_quoted([f"removes the mismatch, not the top-k 16 cost: {_quoted(q1)} against the reference ({n} seeds, MDE "
                    f"{mde1:.3f}; the entropy bonus over the kept ids)"], _prose(_STUDY_DOCS.parents[1] / "README.md"))
    from megatron_mis.analysis.recommend import TRUNCATION_BASIS

    assert (f"replaying the support there ({n} seeds, {_TOP_K_REPLAY[0]}, the entropy bonus over the kept ids) removed "
            f"the mismatch (mean K3 {k3}) but not the cost: {_quoted(q1)} against the reference, {_quoted(q2)} against "
            "none") in " ".join(TRUNCATION_BASIS.split())


def test_slime_s_replay_on_the_seed_stuck_at_the_kept_ids_entropy_comes_from_the_archive():
    """docs/study.md's check after the replay's cut (:data:`_TOP_K_REPLAY_CHECK`): slime's replay, the entropy bonus
    over the whole softmax, on the seeds whose replay run ended at ln 16 (fixed before it ran), its run the replay's
    but for the entropy, its reference a copy of the archived one; the take-off, the greedy rewards beside the other
    runs of that seed, the entropy, K3 and the run's time as the section quotes them."""
    from megatron_mis.testbed.demo.config import DemoConfig
    from megatron_mis.testbed.study.runner import _comparable

    archive = "sweep-long-tail-truncation"
    report, seeds = _TOP_K_REPLAY_CHECK
    x = _top_k_replay()
    runs, headers = _archive_runs(archive), _archive_headers(archive)
    assert list(seeds) == x.stuck[:2]  # the first two such seeds in seed order (one here)
    summary = _summary(archive, report)
    arms, _, _, setting, _, study = _one_vm_report(report, {"none", "ref_fp32"}, seeds, _ZEN4, archive)
    assert setting == "long-tail-top-k-replay-full-entropy-k16" and summary["threshold"] == x.summary["threshold"]
    defaults = DemoConfig().to_dict()
    (s,) = seeds
    config, kept = headers[setting, "none", s]["config"], headers["long-tail-top-k-replay-k16", "none", s]["config"]
    assert config["replay_entropy"] == "full" and not headers[setting, "none", s].get("copied_from")
    assert _comparable({**defaults, **kept, "replay_entropy": "full"}) == _comparable({**defaults, **config})
    assert runs[setting, "ref_fp32", s] == runs["long-tail-top-k-processed-k16", "ref_fp32", s]
    records, end = runs[setting, "none", s]
    metrics = _committed_metrics(archive, summary)
    took, ref_took = metrics["none", s]["steps_to_threshold"], metrics["ref_fp32", s]["steps_to_threshold"]
    greedy = {name: _greedy(runs[key, arm, s][1]) for name, key, arm in (
        ("full", setting, "none"), ("ref", setting, "ref_fp32"), ("none", "long-tail-top-k-processed-k16", "none"),
        ("kept", "long-tail-top-k-replay-k16", "none"))}
    section = " ".join(_section("The support replayed at top-k 16").split())
    _assert_quoted([
        f"one replay run ended with its entropy at ln 16, seed {s}",
        f"--doses k16 \\ --arms none,ref_fp32 --first-seed {s} --seeds 1 \\ --jobs 1 --threads "
        f"{summary['threads_per_run']} --out-dir",
        f"ran on seed {s} alone, {summary['steps']} steps, the reference copied",
        f"Report: [{report}/](study/sweep-long-tail-truncation/{report}/report.md) (1 run made on the Zen 4 VM, "
        f"{end['wall_s'] / 60:.1f} min)",
        f"seed {s} took off at step {took}, {ref_took - took} steps before the reference, and ended with a greedy "
        f"reward of {greedy['full']:.3f} (the reference {greedy['ref']:.3f}, none without the replay "
        f"{greedy['none']:.3f}, the replay with the kept ids' entropy {greedy['kept']:.3f})",
        f"its entropy stayed between {min(r['entropy'] for r in records):.1f} and "
        f"{max(r['entropy'] for r in records):.1f} ({records[-1]['entropy']:.2f} at the end; ln 512 = "
        f"{math.log(512):.2f}, and {math.log(16):.2f} = ln 16 with the kept ids') and its mean K3 was "
        f"{_e(arms['none']['k3_mean'][0], 1)}"], section)
    assert greedy["kept"] == 0.0 < greedy["ref"] < greedy["full"]
