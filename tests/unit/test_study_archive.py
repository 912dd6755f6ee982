"""The study's run archive (``runs.jsonl.gz``): lossless round trip, a copied run's body stored
once, unfinished files skipped, files on disk never overwritten, the same runs giving the same
bytes, and every malformed archive refused with a message naming what is wrong."""

from __future__ import annotations

import gzip
import json

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
    archive = tmp_path / "keep" / "runs.jsonl.gz"
    got = update_archive(archive, out, ["sw-k0", "sw-k1"])
    assert got == {"runs": 4, "from_disk": 4, "stored_once": 1}  # the unfinished run is not archived
    lines = [json.loads(x) for x in gzip.decompress(archive.read_bytes()).decode().splitlines()]
    assert lines[0] == {"format": ARCHIVE_FORMAT}
    shared = [x for x in lines[1:] if "body_of" in x]
    assert [(x["path"], x["body_of"]) for x in shared] == [("sw-k1/ref_fp32/seed-0.jsonl", "sw-k0/ref_fp32/seed-0.jsonl")]
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
    # the same runs give the same bytes (gzip's time stamp is fixed), so an unchanged archive is no git change
    again = tmp_path / "again.jsonl.gz"
    update_archive(again, fresh, ["sw-k0", "sw-k1"])
    assert again.read_bytes() == archive.read_bytes()


def test_restore_keeps_files_on_disk_and_update_merges(tmp_path, out):
    archive = tmp_path / "runs.jsonl.gz"
    update_archive(archive, out, ["sw-k0"])
    target = tmp_path / "target"
    _write(target, "sw-k0/none/seed-0.jsonl", _run_text("sw-k0", "none", 0, [0.7, 0.7]))  # a different run there
    _write(target, "sw-k0/none/seed-1.jsonl", (out / "sw-k0/none/seed-1.jsonl").read_text())  # the same one
    assert restore_runs(archive, target) == {"restored": 1, "present": 2, "differ": 1}
    assert json.loads((target / "sw-k0/none/seed-0.jsonl").read_text().splitlines()[1])["reward_mean"] == 0.7
    # a new seed on disk joins the archive; an entry of a setting not named is kept; disk replaces
    # the archive's entry of the same path
    _write(target, "sw-k0/none/seed-2.jsonl", _run_text("sw-k0", "none", 2, [0.4]))
    update_archive(archive, out, ["other-k0"])
    got = update_archive(archive, target, ["sw-k0"])
    assert got["runs"] == 5 and got["from_disk"] == 4
    runs = read_archive(archive)
    assert "other-k0/none/seed-0.jsonl" in runs and "sw-k0/none/seed-2.jsonl" in runs
    assert runs["sw-k0/none/seed-0.jsonl"] == (target / "sw-k0/none/seed-0.jsonl").read_text()


def _gz(tmp_path, lines: list) -> object:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode()))
    return path


@pytest.mark.parametrize(("lines", "message"), [
    ([{"format": "megatron-mis-study-runs/0"}], "format 'megatron-mis-study-runs/0', expected 'megatron-mis-study-runs/1'"),
    (["{not json"], "line 1 is not JSON"),
    ([], "empty"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "../etc/none/seed-0.jsonl", "text": "x"}], "path '../etc/none/seed-0.jsonl'"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "/abs/none/seed-0.jsonl", "text": "x"}], "path '/abs/none/seed-0.jsonl'"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "s/none/seed-0.json", "text": "x"}], "is not SETTING/ARM/seed-S.jsonl"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "s/none/seed-0.jsonl", "header": "{}", "body_of": "s/none/seed-9.jsonl"}],
     "body_of 's/none/seed-9.jsonl' names no earlier entry"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "s/none/seed-0.jsonl", "text": "a"}, {"path": "s/none/seed-0.jsonl", "text": "b"}],
     "line 3: s/none/seed-0.jsonl appears twice"),
    ([{"format": ARCHIVE_FORMAT}, {"path": "s/none/seed-0.jsonl"}], "line 2: an entry needs 'text', or 'header' and 'body_of'"),
    ([{"format": ARCHIVE_FORMAT}, "[1, 2]"], "line 2 is not an object"),
])
def test_malformed_archives_are_refused_naming_the_problem(tmp_path, lines, message):
    path = _gz(tmp_path, lines)
    with pytest.raises(ArchiveError) as e:
        read_archive(path)
    assert message in str(e.value) and str(path) in str(e.value)
    with pytest.raises(ArchiveError):  # and an update does not overwrite what it cannot read
        update_archive(path, tmp_path, ["s"])
    assert path.read_bytes()[:2] == b"\x1f\x8b"


def test_not_gzip_and_missing(tmp_path):
    path = tmp_path / "plain.jsonl.gz"
    path.write_text(json.dumps({"format": ARCHIVE_FORMAT}))
    with pytest.raises(ArchiveError, match="not a readable gzip archive of runs"):
        read_archive(path)
    with pytest.raises(FileNotFoundError):
        read_archive(tmp_path / "none.jsonl.gz")
