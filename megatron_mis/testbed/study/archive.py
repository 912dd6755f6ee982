"""A study's finished run files kept in one compressed file (``runs.jsonl.gz``), so that a study
can be extended later, on another machine, with more seeds, doses or arms: ``megatron-mis study
... --archive FILE`` first writes the archive's runs that are missing into ``OUT_DIR`` (where the
runner reuses every one whose configuration matches, as it reuses its own), then runs what is
left and writes every finished run of the study's settings back into ``FILE``.

The archive is lossless: a restored run file is byte for byte the file that was packed, so a
report written from restored runs equals the report written from the originals.

Format (gzip of UTF-8 JSON lines)::

    {"format": "megatron-mis-study-runs/1"}
    {"path": "SETTING/ARM/seed-S.jsonl", "text": "<the whole run file>"}
    {"path": "SETTING/ARM/seed-S.jsonl", "header": "<its first line>", "body_of": "<an earlier path>"}

The second form stores a run whose lines after the header equal an earlier entry's (a sweep's
reference arm resets the dose, so its run is copied to every dose with only the header changed).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ARCHIVE_FORMAT", "ArchiveError", "read_archive", "restore_runs", "update_archive"]

ARCHIVE_FORMAT = "megatron-mis-study-runs/1"

# SETTING/ARM/seed-S.jsonl: the runner's layout (runner.run_path); nothing else is read or written
_REL_PATH = re.compile(r"^[A-Za-z0-9_.+-]+/[A-Za-z0-9_.+-]+/seed-[0-9]+\.jsonl$")


class ArchiveError(ValueError):
    """An archive that cannot be read: not gzip, another format, a malformed entry or path."""


def _check_path(archive: Path, lineno: int, rel: object) -> str:
    if not isinstance(rel, str) or not _REL_PATH.match(rel) or ".." in rel.split("/"):
        raise ArchiveError(f"{archive}: line {lineno}: path {rel!r} is not SETTING/ARM/seed-S.jsonl")
    return rel


def read_archive(archive: str | Path) -> dict[str, str]:
    """``{"SETTING/ARM/seed-S.jsonl": run file text}`` of every run in ``archive``.

    Raises:
        FileNotFoundError: ``archive`` does not exist.
        ArchiveError: not a gzip file, a format other than :data:`ARCHIVE_FORMAT`, a malformed
            line, an entry with a path outside the runner's layout, a ``body_of`` naming no
            earlier entry, or the same path twice.
    """
    archive = Path(archive)
    runs: dict[str, str] = {}
    try:
        with gzip.open(archive, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ArchiveError(f"{archive}: not a readable gzip archive of runs ({exc})") from exc
    if not lines:
        raise ArchiveError(f"{archive}: empty (expected a {ARCHIVE_FORMAT!r} header line)")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise ArchiveError(f"{archive}: line 1 is not JSON ({exc})") from exc
    if not isinstance(head, dict) or head.get("format") != ARCHIVE_FORMAT:
        found = head.get("format") if isinstance(head, dict) else head
        raise ArchiveError(f"{archive}: format {found!r}, expected {ARCHIVE_FORMAT!r}")
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ArchiveError(f"{archive}: line {lineno} is not JSON ({exc})") from exc
        if not isinstance(entry, dict):
            raise ArchiveError(f"{archive}: line {lineno} is not an object")
        rel = _check_path(archive, lineno, entry.get("path"))
        if rel in runs:
            raise ArchiveError(f"{archive}: line {lineno}: {rel} appears twice")
        if isinstance(entry.get("text"), str):
            runs[rel] = entry["text"]
        elif isinstance(entry.get("header"), str) and isinstance(entry.get("body_of"), str):
            source = runs.get(entry["body_of"])
            if source is None:
                raise ArchiveError(f"{archive}: line {lineno}: body_of {entry['body_of']!r} names no earlier entry")
            header = entry["header"] if entry["header"].endswith("\n") else entry["header"] + "\n"
            runs[rel] = header + _body(source)
        else:
            raise ArchiveError(f"{archive}: line {lineno}: an entry needs 'text', or 'header' and 'body_of'")
    return runs


def _body(text: str) -> str:
    """A run file's lines after its header line."""
    _, _, body = text.partition("\n")
    return body


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
    return text if first.get("type") == "run" and last.get("type") == "end" else None


def update_archive(archive: str | Path, out_dir: str | Path, settings: Iterable[str]) -> dict[str, int]:
    """Write into ``archive`` every finished run file under ``OUT_DIR/SETTING/`` for each of
    ``settings``, keeping the archive's other entries (a file on disk replaces the archive's entry
    of the same path). Unfinished files (no end line) are skipped. The archive is replaced
    atomically; gzip's time stamp is fixed, so the same runs give the same bytes. Returns
    ``{"runs": entries written, "from_disk": files read, "stored_once": bodies shared}``.

    Raises:
        ArchiveError: the existing archive cannot be read (it is not overwritten).
    """
    archive, out = Path(archive), Path(out_dir)
    runs = read_archive(archive) if archive.exists() else {}
    from_disk = 0
    for setting in settings:
        for path in sorted((out / setting).glob("*/seed-*.jsonl")):
            rel = path.relative_to(out).as_posix()
            if not _REL_PATH.match(rel):
                continue
            text = _finished_text(path)
            if text is not None:
                runs[rel] = text
                from_disk += 1
    lines = [json.dumps({"format": ARCHIVE_FORMAT})]
    bodies: dict[str, str] = {}  # sha256 of a body -> the first path that holds it
    shared = 0
    for rel in sorted(runs):
        text = runs[rel]
        header, _, body = text.partition("\n")
        digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
        if body and digest in bodies:
            lines.append(json.dumps({"path": rel, "header": header, "body_of": bodies[digest]}))
            shared += 1
        else:
            bodies.setdefault(digest, rel)
            lines.append(json.dumps({"path": rel, "text": text}))
    data = gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), compresslevel=9, mtime=0)
    _write_atomic(archive, data)
    return {"runs": len(runs), "from_disk": from_disk, "stored_once": shared}
