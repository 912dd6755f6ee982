"""A study's finished run files kept in a folder of compressed files (the run archive, e.g.
``docs/study/sweep-NAME/runs/``), so that a study can be extended later, on another machine, with
more seeds, doses or arms: ``megatron-mis study ... --archive DIR`` first writes the archive's runs
that are missing into ``OUT_DIR`` (where the runner reuses every one whose configuration matches,
as it reuses its own), then runs what is left and writes every finished run of the study's
settings back into ``DIR``.

The archive is lossless: a restored run file is byte for byte the file that was packed, so a
report written from restored runs equals the report written from the originals. One file per run,
written only when its content changes, so that adding seeds to an archive kept in git adds the
new runs' files and rewrites none of the others.

Layout::

    DIR/format.json                          {"format": "megatron-mis-study-runs/1"}
    DIR/SETTING/ARM/seed-S.jsonl.gz          a run file, gzip (time stamp 0)
    DIR/SETTING/ARM/seed-S.copy.json         {"header": "<its first line>", "body_of": "SETTING/ARM/seed-S.jsonl"}

A ``.copy.json`` stands for a run whose lines after the header equal another run's (a sweep's
reference arm resets the dose, so its run is copied to every dose with only the header changed);
``body_of`` names a run stored in full. Other files in ``DIR`` are not read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["ARCHIVE_FORMAT", "ArchiveError", "read_archive", "restore_runs", "update_archive"]

ARCHIVE_FORMAT = "megatron-mis-study-runs/1"
_FORMAT_FILE = "format.json"

# SETTING/ARM/seed-S.jsonl: the runner's layout (runner.run_path); nothing else is read or written
_NAME = r"[A-Za-z0-9_.+-]+"
_REL_PATH = re.compile(rf"^{_NAME}/{_NAME}/seed-[0-9]+\.jsonl$")
_FULL, _COPY = ".gz", ".copy.json"


class ArchiveError(ValueError):
    """An archive that cannot be read: no or another format, a file that is not gzip or JSON, a
    copy naming no run stored in full, the same run stored twice."""


def _rel(path: Path, root: Path, suffix: str) -> str | None:
    """``SETTING/ARM/seed-S.jsonl`` of an archive file, or ``None`` for a file outside the layout."""
    rel = path.relative_to(root).as_posix()
    if not rel.endswith(suffix):
        return None
    rel = rel[: -len(suffix)] if suffix == _FULL else rel[: -len(suffix)] + ".jsonl"
    return rel if _REL_PATH.match(rel) else None


def _check_format(archive: Path) -> None:
    fmt = archive / _FORMAT_FILE
    try:
        found = json.loads(fmt.read_text(encoding="utf-8")).get("format")
    except FileNotFoundError:
        raise ArchiveError(f"{archive}: no {_FORMAT_FILE}, so not a run archive "
                           f"(expected {{\"format\": {ARCHIVE_FORMAT!r}}})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ArchiveError(f"{fmt}: not a JSON object ({exc})") from exc
    if found != ARCHIVE_FORMAT:
        raise ArchiveError(f"{fmt}: format {found!r}, expected {ARCHIVE_FORMAT!r}")


def _scan(archive: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """``({rel: .jsonl.gz path}, {rel: .copy.json path})`` of the archive's run files."""
    full, copies = {}, {}
    for path in sorted(archive.glob("*/*/seed-*")):
        if not path.is_file():
            continue
        for suffix, found in ((_FULL, full), (_COPY, copies)):
            rel = _rel(path, archive, suffix)
            if rel is not None:
                found[rel] = path
    return full, copies


def _gunzip(path: Path) -> str:
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{path}: not a gzip run file ({exc})") from exc


def _read_copy(path: Path) -> tuple[str, str]:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{path}: not JSON ({exc})") from exc
    if not (isinstance(entry, dict) and isinstance(entry.get("header"), str) and isinstance(entry.get("body_of"), str)):
        raise ArchiveError(f"{path}: a copy needs a 'header' and a 'body_of' string")
    return entry["header"], entry["body_of"]


def read_archive(archive: str | Path) -> dict[str, str]:
    """``{"SETTING/ARM/seed-S.jsonl": run file text}`` of every run in the archive folder.

    Raises:
        FileNotFoundError: ``archive`` does not exist (an empty folder is an empty archive).
        ArchiveError: not a folder; files but no ``format.json`` or another format; a ``.jsonl.gz`` that is
            not gzip; a ``.copy.json`` that is malformed or whose ``body_of`` is not a run stored
            in full in the archive; a run stored both in full and as a copy.
    """
    archive = Path(archive)
    if not archive.exists():
        raise FileNotFoundError(f"{archive}: no such run archive")
    if not archive.is_dir():
        raise ArchiveError(f"{archive}: a run archive is a folder (format.json, SETTING/ARM/seed-S.jsonl.gz)")
    if not any(archive.iterdir()):
        return {}  # an empty folder: a new archive
    _check_format(archive)
    full, copies = _scan(archive)
    runs = {rel: _gunzip(path) for rel, path in full.items()}
    for rel, path in copies.items():
        if rel in runs:
            raise ArchiveError(f"{path}: {rel} is also stored in full ({full[rel]})")
        header, body_of = _read_copy(path)
        if body_of not in full:
            raise ArchiveError(f"{path}: body_of {body_of!r} is not a run stored in full in {archive}")
        runs[rel] = header.rstrip("\n") + "\n" + _body(runs[body_of])
    return runs


def _body(text: str) -> str:
    """A run file's lines after its header line."""
    return text.partition("\n")[2]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def restore_runs(archive: str | Path, out_dir: str | Path) -> dict[str, int]:
    """Write each run of ``archive`` into ``out_dir`` (``OUT_DIR/SETTING/ARM/seed-S.jsonl``) where
    no file is there yet; a file already there is left as it is (counted in ``"differ"`` when its
    text is not the archive's). Returns ``{"restored", "present", "differ"}``.

    Raises:
        FileNotFoundError, ArchiveError: as :func:`read_archive`.
    """
    out = Path(out_dir)
    counts = {"restored": 0, "present": 0, "differ": 0}
    for rel, text in read_archive(archive).items():
        path = out / rel
        if path.is_file():
            counts["present"] += 1
            if path.read_text(encoding="utf-8") != text:
                counts["differ"] += 1
            continue
        _write_atomic(path, text.encode("utf-8"))
        counts["restored"] += 1
    return counts


def _finished_text(path: Path) -> str | None:
    """A run file's text when it is complete (a header and an end line), else ``None``."""
    text = path.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        first, last = json.loads(lines[0]), json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return None
    ok = isinstance(first, dict) and isinstance(last, dict) and first.get("type") == "run" and last.get("type") == "end"
    return text if ok else None


def update_archive(archive: str | Path, out_dir: str | Path, settings: Iterable[str]) -> dict[str, Any]:
    """Add to the archive folder every finished run file under ``OUT_DIR/SETTING/`` for each of
    ``settings`` that it does not hold yet. The archive only grows: a file on disk whose text
    differs from the archive's run of the same path (another configuration, e.g. a ``--quick``
    or ``--steps`` variant run in an out-dir the archive was restored into) is not written and is
    listed in ``"conflicts"``. Unfinished files (no end line) are skipped. A run whose body equals
    an earlier run's (in path order) is stored as a ``.copy.json``. A file is written (atomically)
    only when its content changes, and gzip's time stamp is fixed, so the same runs leave the
    folder as it was. Returns ``{"runs", "from_disk", "added", "stored_once", "written",
    "conflicts"}``.

    Raises:
        ArchiveError: the existing archive cannot be read (nothing is written).
    """
    archive, out = Path(archive), Path(out_dir)
    runs = read_archive(archive) if archive.exists() else {}
    from_disk = added = 0
    conflicts: list[str] = []
    for setting in settings:
        for path in sorted((out / setting).glob("*/seed-*.jsonl")):
            rel = path.relative_to(out).as_posix()
            if not _REL_PATH.match(rel) or (text := _finished_text(path)) is None:
                continue
            from_disk += 1
            if rel not in runs:
                runs[rel] = text
                added += 1
            elif runs[rel] != text:
                conflicts.append(rel)
    if not (archive / _FORMAT_FILE).exists():
        _write_atomic(archive / _FORMAT_FILE, (json.dumps({"format": ARCHIVE_FORMAT}) + "\n").encode("utf-8"))
    full, copies = _scan(archive)
    bodies: dict[str, str] = {}  # sha256 of a body -> the first path (sorted) stored in full with it
    shared = written = 0
    for rel in sorted(runs):
        text = runs[rel]
        header, _, body = text.partition("\n")
        digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
        gz, cp = archive / (rel + _FULL), archive / (rel[: -len(".jsonl")] + _COPY)
        if body and digest in bodies:
            shared += 1
            data = (json.dumps({"header": header, "body_of": bodies[digest]}) + "\n").encode("utf-8")
            if rel not in copies or cp.read_bytes() != data:
                _write_atomic(cp, data)
                written += 1
            if rel in full:
                gz.unlink()
        else:
            bodies.setdefault(digest, rel)
            # a run stored in full already holds this text: the archive's runs are never replaced
            # (read_archive read it from that very file), so only a new or formerly copied run is written
            if rel not in full:
                _write_atomic(gz, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
                written += 1
            if rel in copies:
                cp.unlink()
    return {"runs": len(runs), "from_disk": from_disk, "added": added, "stored_once": shared, "written": written,
            "conflicts": conflicts}
