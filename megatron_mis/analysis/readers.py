"""Readers of the log-prob dumps ``megatron-mis analyze`` understands, one file at a time.

Every reader turns a file into :class:`DumpBatch` es: per-sample 1-D float tensors of the
trainer's log-probs (pi_old), the rollout engine's log-probs and the loss mask, all at full
response length, plus the rollout id and the response lengths. Nothing is kept between files
except what per-rank formats need to join samples split over ranks (TP duplicates, CP pieces).

Formats (``FORMATS``; detected from the content, or forced with ``--format``):

``jsonl``
    megatron-mis' own JSON lines: ``{"train_log_probs": [...], "rollout_log_probs": [...],
    "loss_mask": [...], "rollout_id": 3}`` (``loss_mask`` and ``rollout_id`` optional; a line
    may also name it ``step``).
``pt``
    megatron-mis' own ``torch.save`` dict: ``{"train_log_probs": [T_i], "rollout_log_probs":
    [T_i], "loss_masks": [T_i], "rollout_id": 3}`` (lists of 1-D tensors; the last two optional).
``slime``
    slime's ``--save-debug-train-data PATH`` dump, ``format_version`` 2 (slime since Aug 2026,
    ``slime/observability/train_data_utils.py``): one file per rollout, ``{"format_version": 2,
    "rollout_id", "rank", "samples": [{"log_probs", "rollout_log_probs", "loss_masks",
    "response_lengths", "total_lengths", "sample_index", "rollout_position", ...}], "dp_shards"}``,
    every response-token field already gathered over context parallelism.
``slime-legacy``
    the per-rank dump of older slime and of Miles before it recorded its CP rank: ``{"rollout_id",
    "rank", "rollout_data": {"log_probs": [...], "rollout_log_probs": [...], "loss_masks": [...],
    "response_lengths": [...], "sample_indices": [...], ...}}``, one file per rank. TP duplicates
    are dropped by ``sample_indices``; files written under CP > 1 hold only a rank's piece and no
    CP rank, so they are refused.
``miles``
    Miles' ``--save-debug-train-data PATH`` dump (``miles/utils/train_dump_utils.py``): the
    per-rank dict above plus ``cp_rank``, ``cp_size`` and ``qkv_format``. CP pieces of a sample
    (one file per CP rank) are put back at full response length in the zigzag layout.

Errors are :class:`DumpError` s naming the file, the sample / line and the field, and what was
expected.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMATS", "DumpBatch", "DumpError", "DumpReader", "DumpSkipped", "detect_format", "expand_paths"]

#: Format name -> one-line description (``--format`` choices besides ``auto``).
FORMATS: dict[str, str] = {
    "jsonl": "megatron-mis JSON lines (train_log_probs, rollout_log_probs, loss_mask, rollout_id)",
    "pt": "megatron-mis torch dict (train_log_probs, rollout_log_probs, loss_masks, rollout_id)",
    "slime": "slime --save-debug-train-data, format_version 2 (one file per rollout)",
    "slime-legacy": "slime / Miles per-rank --save-debug-train-data without format_version or cp_rank",
    "miles": "Miles --save-debug-train-data (per rank, with cp_rank / cp_size / qkv_format)",
}

_SUPPORTED_SLIME_VERSIONS = (2,)
_AS_TRAIN = "len(train_log_probs)"
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


class DumpError(ValueError):
    """A file that cannot be read; the message names the file and the field."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        self.detail = message
        super().__init__(f"{path}: {message}")


class DumpSkipped(DumpError):
    """A per-rank file that carries no trainer log-probs by design (a pipeline stage other than
    the last): skipped with a note, not an error, as long as other files carry them."""


@dataclass
class DumpBatch:
    """The samples of one rollout read from one file (or joined from several per-rank files).

    Attributes:
        source: the file (or files) the samples came from.
        format: the format name.
        rollout_id: the rollout / step id (``None``: not recorded; the caller numbers files).
        train_log_probs, rollout_log_probs, loss_masks: one ``[R_i]`` float32 tensor per sample.
        response_lengths: ``R_i`` per sample (the host's response length; the log-probs have it).
    """

    source: str
    format: str
    rollout_id: int | None
    train_log_probs: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    response_lengths: list[int] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return len(self.train_log_probs)


# ------------------------------------------------------------------------------------ helpers
def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def expand_paths(items: list[str]) -> tuple[list[Path], list[DumpError]]:
    """Files named by ``items`` (files, directories — their dump files, not recursive — or glob
    patterns), in natural order (``2.pt`` before ``10.pt``), without duplicates.

    Returns:
        ``(files, errors)``: an error for each item that names nothing.
    """
    out: list[Path] = []
    errors: list[DumpError] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = [c for c in p.iterdir() if c.is_file() and c.suffix in (".pt", ".pth", ".bin", *_JSON_SUFFIXES)]
            if not found:
                errors.append(DumpError(p, "directory holds no .pt / .pth / .bin / .jsonl / .json file"))
            out.extend(sorted(found, key=_natural_key))
        elif p.is_file():
            out.append(p)
        elif any(ch in item for ch in "*?["):
            import glob

            found = [Path(m) for m in glob.glob(item, recursive=True) if Path(m).is_file()]
            if not found:
                errors.append(DumpError(item, "glob pattern matches no file"))
            out.extend(sorted(found, key=_natural_key))
        else:
            errors.append(DumpError(item, "no such file or directory"))
    seen: set[Path] = set()
    unique = []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique, errors


def _is_json_file(path: Path) -> bool:
    if path.suffix in _JSON_SUFFIXES:
        return True
    if path.suffix in (".pt", ".pth", ".bin"):
        return False
    with path.open("rb") as fh:
        head = fh.read(64).lstrip()
    return head[:1] in (b"{", b"[")


def _load_torch(path: Path, trust_pickle: bool) -> Any:
    if path.stat().st_size == 0:
        raise DumpError(path, "empty file (0 bytes): expected a torch.save dict; was it still being written?")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise DumpError(
                path,
                f"holds a Python object ({found.group(1)}) that torch.load(weights_only=True) refuses; if you "
                "trust the file, pass --trust-pickle to unpickle it fully",
            ) from None
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        detail = reason.group(1).strip() if reason else (text.strip().splitlines() or [type(exc).__name__])[0]
        raise DumpError(path, f"not a readable torch.save file (truncated or corrupt?): {detail}") from None
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on corrupt input (IndexError, ...)
        raise DumpError(
            path, f"not a readable torch.save file (truncated or corrupt?): {type(exc).__name__}: {exc}"
        ) from None


_NOT_LOADED = object()


def detect_format(path: Path, data: Any = _NOT_LOADED) -> str:
    """The format of ``path`` (``data``: its loaded content for torch files).

    Raises:
        DumpError: for verl's text-only rollout dumps and for dicts no reader knows.
    """
    if data is _NOT_LOADED:
        if _is_json_file(path):
            return "jsonl"
        data = _load_torch(path, trust_pickle=False)
    if not isinstance(data, dict):
        raise DumpError(
            path,
            f"top level is a {type(data).__name__}; every supported .pt format is a dict "
            f"({', '.join(k for k in FORMATS if k != 'jsonl')})",
        )
    if "format_version" in data or "samples" in data:
        return "slime"
    if "rollout_data" in data:
        return "miles" if "cp_size" in data or "cp_rank" in data else "slime-legacy"
    if "train_log_probs" in data or "rollout_log_probs" in data:
        return "pt"
    raise DumpError(
        path,
        f"dict with keys {_keys(data)} matches no format: expected 'format_version' + 'samples' (slime), "
        "'rollout_data' (slime-legacy / Miles) or 'train_log_probs' + 'rollout_log_probs' (megatron-mis)",
    )


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` on one line, at most ``limit`` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keys(data: dict) -> str:
    names = [str(k) for k in list(data)[:12]]
    return "[" + ", ".join(names) + (", ..." if len(data) > 12 else "") + "]"


def _vector(
    path: Path, where: str, name: str, value: Any, length: int | None = None, *, mask: bool = False,
    length_of: str = "response_length",
) -> torch.Tensor:
    """A 1-D float32 tensor from a tensor / list of numbers, or a :class:`DumpError`."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype == torch.bool:
            t = t.to(torch.float32)
        elif not (t.is_floating_point() or (mask and not t.is_complex())):
            raise DumpError(path, f"{where}: field {name!r} must hold floating-point log-probs, got a {t.dtype} tensor")
        t = t.to("cpu", torch.float32)
    elif isinstance(value, (list, tuple)):
        def number(v: Any) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (mask and isinstance(v, bool))

        at = next((i for i, v in enumerate(value) if not number(v)), None)
        if at is not None:
            bad = value[at]
            raise DumpError(
                path, f"{where}: field {name!r} must be a list of numbers, found {_short(bad)} ({type(bad).__name__}) at position {at}"
            )
        t = torch.tensor([_float32(path, where, name, i, v) for i, v in enumerate(value)], dtype=torch.float32)
    else:
        raise DumpError(path, f"{where}: field {name!r} must be a 1-D tensor or a list of numbers, got {type(value).__name__}")
    if t.dim() != 1:
        raise DumpError(path, f"{where}: field {name!r} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.numel() != length:
        raise DumpError(path, f"{where}: field {name!r} has {t.numel()} values, expected {length_of}={length}")
    if mask:
        if not bool(torch.isfinite(t).all()):
            raise DumpError(path, f"{where}: field {name!r} (a loss mask) holds NaN or inf")
        if bool(((t != 0) & (t != 1)).any()):
            bad = t[(t != 0) & (t != 1)][0].item()
            raise DumpError(path, f"{where}: field {name!r} (a loss mask) must hold 0 / 1 values, found {bad:g}")
    return t


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _float32(path: Path, where: str, name: str, at: int, value: int | float | bool) -> float:
    """``value`` as a float that float32 holds, or a :class:`DumpError` naming the field and the
    position: a JSON integer too large for a float (``float()`` would raise ``OverflowError``) or a
    finite number beyond the float32 range (it would silently become inf). inf / NaN given as such
    pass through (the analysis reports non-finite log-probs itself)."""
    try:
        out = float(value)
    except OverflowError:
        try:
            digits = f"{len(str(abs(value)))}"
        except ValueError:  # beyond Python's int -> str digit limit
            digits = f"about {int(value.bit_length() * 0.30103)}"
        raise DumpError(
            path,
            f"{where}: field {name!r} holds an integer of {digits} digits at position {at}, too large "
            f"for a float; expected log-probs / mask values within +-{_FLOAT32_MAX:.4g} (float32)",
        ) from None
    if math.isfinite(out) and abs(out) > _FLOAT32_MAX:
        raise DumpError(
            path,
            f"{where}: field {name!r} holds {out:.6g} at position {at}, outside the float32 range "
            f"+-{_FLOAT32_MAX:.4g}",
        )
    return out


def _int(path: Path, where: str, name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise DumpError(path, f"{where}: field {name!r} must be an integer, got {_short(value)} ({type(value).__name__})")
    if value < 0:
        raise DumpError(path, f"{where}: field {name!r} must be >= 0, got {value}")
    return value


def _index(path: Path, where: str, value: Any) -> int | None:
    """A sample index (``sample_indices`` entry): an int, or ``None`` when the host had none."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise DumpError(path, f"{where}: field 'sample_indices' entries must be integers or None, got {_short(value)}")
    return value


def _column(path: Path, columns: dict, name: str, n: int, where: str = "rollout_data") -> list:
    value = columns[name]
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        value = list(value)
    if not isinstance(value, (list, tuple)):
        raise DumpError(path, f"{where}[{name!r}] must be a list with one entry per sample, got {type(value).__name__}")
    if len(value) != n:
        raise DumpError(path, f"{where}[{name!r}] has {len(value)} entries, expected one per sample ({n})")
    return list(value)


# ------------------------------------------------------------------------------------- reader
class DumpReader:
    """Reads files one at a time, checking that all share one format and version.

    Args:
        format: a name of :data:`FORMATS` or ``"auto"``.
        trust_pickle: let ``torch.load`` unpickle arbitrary objects (only for trusted files).

    Use :meth:`read` per file, then :meth:`finish` once for samples whose per-rank pieces never
    all arrived (reported as errors).
    """

    def __init__(self, format: str = "auto", *, trust_pickle: bool = False) -> None:
        if format != "auto" and format not in FORMATS:
            raise ValueError(f"format={format!r} is not supported; valid: auto, {', '.join(FORMATS)}")
        self.format = format
        self.trust_pickle = trust_pickle
        self.kind: str | None = None  # format (and version) of the first good file
        self.first_source: str | None = None
        self.num_duplicates = 0
        self._seen: set[tuple[int, Any]] = set()
        # Miles CP pieces waiting for their siblings: (rollout_id, sample_index) -> pieces
        self._pending: dict[tuple[int, Any], dict[str, Any]] = {}

    # -------------------------------------------------------------------------------- public
    def read(self, path: str | Path) -> list[DumpBatch]:
        """The batches of one file (several for a JSONL holding several rollout ids).

        Raises:
            DumpError: for an unreadable or malformed file, or one whose format / version differs
                from the first file read.
        """
        path = Path(path)
        if not path.is_file():
            raise DumpError(path, "no such file")
        forced = self.format
        if forced == "jsonl" or (forced == "auto" and _is_json_file(path)):
            self._check_kind(path, "jsonl")
            return self._read_jsonl(path)
        data = _load_torch(path, self.trust_pickle)
        kind = detect_format(path, data) if forced == "auto" else forced
        if kind == "slime":
            if not isinstance(data, dict) or "format_version" not in data:
                raise DumpError(
                    path,
                    "missing top-level field 'format_version' (slime's train dump carries format_version 2; per-rank "
                    f"dumps without it have 'rollout_data': --format slime-legacy); found "
                    f"{_keys(data) if isinstance(data, dict) else type(data).__name__}",
                )
            version = data["format_version"]
            self._check_kind(path, f"slime (format_version {version})", detail=version)
            return self._read_slime(path, data)
        self._check_kind(path, kind)
        if kind == "pt":
            return self._read_pt(path, data)
        return self._read_per_rank(path, data, kind)

    def finish(self) -> tuple[list[DumpBatch], list[DumpError]]:
        """Report CP pieces whose siblings never arrived (they are not analysed)."""
        errors = []
        for (rid, index), entry in sorted(self._pending.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            have = sorted(entry["pieces"])
            errors.append(
                DumpError(
                    entry["sources"][0],
                    f"rollout {rid}, sample_index {index}: CP pieces from cp_rank(s) {have} only, expected "
                    f"cp_size={entry['cp_size']} (files of the other CP ranks missing or bad); sample skipped",
                )
            )
        self._pending.clear()
        return [], errors

    # ------------------------------------------------------------------------------- helpers
    def _check_kind(self, path: Path, kind: str, detail: Any = None) -> None:
        if kind.startswith("slime (") and not (
            isinstance(detail, int) and not isinstance(detail, bool) and detail in _SUPPORTED_SLIME_VERSIONS
        ):
            raise DumpError(
                path,
                f"field 'format_version' is {_short(detail)}; this reader knows slime's train-dump format_version "
                f"{', '.join(map(str, _SUPPORTED_SLIME_VERSIONS))} (files without it: --format slime-legacy)",
            )
        if self.kind is None:
            self.kind, self.first_source = kind, str(path)
        elif kind != self.kind:
            raise DumpError(
                path,
                f"mixed formats / versions: this file is {kind}, but {self.first_source} (the first file) is "
                f"{self.kind}; analyse one run's dumps at a time",
            )

    def _read_jsonl(self, path: Path) -> list[DumpBatch]:
        groups: dict[int | None, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        n_lines = 0
        try:
            fh = path.open(encoding="utf-8")
            with fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    n_lines += 1
                    where = f"line {lineno}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DumpError(path, f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                    except ValueError as exc:  # e.g. an integer beyond Python's 4300-digit conversion limit
                        raise DumpError(path, f"{where}: not readable JSON ({exc})") from None
                    if not isinstance(row, dict):
                        raise DumpError(path, f"{where}: expected a JSON object per line, got {type(row).__name__}")
                    if "train_log_probs" not in row and {"input", "output"} <= set(row) and ("step" in row or "score" in row):
                        raise DumpError(
                            path,
                            "this is verl's trainer.rollout_data_dir dump (input / output / score / step): it holds "
                            "text and scores but no log-probs, so there is no mismatch to measure (see docs/analyze.md)",
                        )
                    missing = [k for k in ("rollout_log_probs", "train_log_probs") if k not in row]
                    if missing:
                        raise DumpError(path, f"{where}: missing field(s) {missing}; found {sorted(row)}")
                    train = _vector(path, where, "train_log_probs", row["train_log_probs"])
                    rollout = _vector(path, where, "rollout_log_probs", row["rollout_log_probs"], train.numel(), length_of=_AS_TRAIN)
                    mask = (
                        _vector(path, where, "loss_mask", row["loss_mask"], train.numel(), mask=True, length_of=_AS_TRAIN)
                        if row.get("loss_mask") is not None
                        else torch.ones_like(train)
                    )
                    rid_key = "rollout_id" if "rollout_id" in row else ("step" if "step" in row else None)
                    rid = _int(path, where, rid_key, row[rid_key]) if rid_key else None
                    groups.setdefault(rid, []).append((train, rollout, mask))
        except UnicodeDecodeError as exc:
            raise DumpError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start}); expected JSON lines") from None
        if n_lines == 0:
            raise DumpError(path, "no JSON line in the file (empty): expected one JSON object per sample")
        if None in groups and len(groups) > 1:
            raise DumpError(path, "some lines carry 'rollout_id' / 'step' and some do not; give it on every line or on none")
        return [
            DumpBatch(
                source=str(path),
                format="jsonl",
                rollout_id=rid,
                train_log_probs=[s[0] for s in rows],
                rollout_log_probs=[s[1] for s in rows],
                loss_masks=[s[2] for s in rows],
                response_lengths=[int(s[0].numel()) for s in rows],
            )
            for rid, rows in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        ]

    def _read_pt(self, path: Path, data: Any) -> list[DumpBatch]:
        if not isinstance(data, dict):
            raise DumpError(path, f"expected a dict with train_log_probs / rollout_log_probs, got {type(data).__name__}")
        missing = [k for k in ("rollout_log_probs", "train_log_probs") if k not in data]
        if missing:
            raise DumpError(path, f"missing field(s) {missing}; found {_keys(data)}")
        train_in = data["train_log_probs"]
        if not isinstance(train_in, (list, tuple)):
            raise DumpError(path, f"field 'train_log_probs' must be a list of 1-D tensors (one per sample), got {type(train_in).__name__}")
        n = len(train_in)
        rollout_in = _column(path, data, "rollout_log_probs", n, where="dict")
        masks_in = _column(path, data, "loss_masks", n, where="dict") if data.get("loss_masks") is not None else None
        train, rollout, masks = [], [], []
        for i in range(n):
            where = f"sample {i}"
            t = _vector(path, where, "train_log_probs", train_in[i])
            train.append(t)
            rollout.append(_vector(path, where, "rollout_log_probs", rollout_in[i], t.numel(), length_of=_AS_TRAIN))
            masks.append(
                _vector(path, where, "loss_masks", masks_in[i], t.numel(), mask=True, length_of=_AS_TRAIN)
                if masks_in is not None
                else torch.ones_like(t)
            )
        rid = _int(path, "dict", "rollout_id", data["rollout_id"]) if data.get("rollout_id") is not None else None
        return [DumpBatch(str(path), "pt", rid, train, rollout, masks, [int(t.numel()) for t in train])]

    def _read_slime(self, path: Path, data: dict) -> list[DumpBatch]:
        for key in ("rollout_id", "samples"):
            if key not in data:
                raise DumpError(path, f"missing top-level field {key!r} of slime's format_version 2 dump; found {_keys(data)}")
        rid = _int(path, "top level", "rollout_id", data["rollout_id"])
        samples = data["samples"]
        if not isinstance(samples, list):
            raise DumpError(path, f"field 'samples' must be a list of per-sample dicts, got {type(samples).__name__}")
        if not samples:
            raise DumpError(path, "field 'samples' is empty: no sample to analyse")
        train, rollout, masks, lengths = [], [], [], []
        for i, s in enumerate(samples):
            where = f"samples[{i}]"
            if not isinstance(s, dict):
                raise DumpError(path, f"{where}: expected a dict, got {type(s).__name__}")
            self._no_logprobs_hint(path, where, s)
            for key in ("rollout_log_probs", "loss_masks", "response_lengths"):
                if key not in s:
                    raise DumpError(path, f"{where}: missing field {key!r}{_rollout_hint(key)}; found {_keys(s)}")
            length = _int(path, where, "response_lengths", s["response_lengths"])
            train.append(_vector(path, where, "log_probs", s["log_probs"], length))
            rollout.append(_vector(path, where, "rollout_log_probs", s["rollout_log_probs"], length))
            masks.append(_vector(path, where, "loss_masks", s["loss_masks"], length, mask=True))
            lengths.append(length)
        return [DumpBatch(str(path), "slime", rid, train, rollout, masks, lengths)]

    @staticmethod
    def _no_logprobs_hint(path: Path, where: str, columns: dict) -> None:
        if "log_probs" not in columns or columns["log_probs"] is None:
            raise DumpError(
                path,
                f"{where}: missing field 'log_probs' (the trainer's log-probs): written by a rank that did not "
                "compute them (a pipeline stage other than the last) or by a run that skipped the recompute "
                "(--use-rollout-logprobs) with a writer that predates slime's format_version 2",
            )

    def _read_per_rank(self, path: Path, data: Any, kind: str) -> list[DumpBatch]:
        if not isinstance(data, dict) or "rollout_data" not in data:
            raise DumpError(path, f"expected a dict with 'rollout_data' ({FORMATS[kind]}), got {type(data).__name__ if not isinstance(data, dict) else _keys(data)}")
        rid = _int(path, "top level", "rollout_id", data.get("rollout_id"))
        cols = data["rollout_data"]
        if not isinstance(cols, dict):
            raise DumpError(path, f"field 'rollout_data' must be a dict of per-sample lists, got {type(cols).__name__}")
        if cols.get("log_probs") is None:
            raise DumpSkipped(
                path,
                "rollout_data has no 'log_probs' (the trainer's log-probs): written by a rank that did not compute "
                "them (a pipeline stage other than the last), or by a run that skipped the recompute "
                "(--use-rollout-logprobs); skipped",
            )
        for key in ("rollout_log_probs", "loss_masks", "response_lengths"):
            if key not in cols:
                raise DumpError(path, f"rollout_data: missing field {key!r}{_rollout_hint(key)}; found {_keys(cols)}")
        resp = cols["response_lengths"]
        if not isinstance(resp, (list, tuple)):
            raise DumpError(path, f"rollout_data['response_lengths'] must be a list of ints, got {type(resp).__name__}")
        n = len(resp)
        lengths = [_int(path, f"sample {i}", "response_lengths", v) for i, v in enumerate(resp)]
        train_in = _column(path, cols, "log_probs", n)
        rollout_in = _column(path, cols, "rollout_log_probs", n)
        masks_in = _column(path, cols, "loss_masks", n)
        indices = cols.get("sample_indices")
        indices = (
            [_index(path, f"sample {i}", v) for i, v in enumerate(_column(path, cols, "sample_indices", n))]
            if indices is not None
            else [None] * n
        )
        cp_size, cp_rank = 1, 0
        if kind == "miles":
            cp_size = _int(path, "top level", "cp_size", data.get("cp_size", 1))
            cp_rank = _int(path, "top level", "cp_rank", data.get("cp_rank", 0))
            if cp_size < 1 or cp_rank >= cp_size:
                raise DumpError(path, f"fields 'cp_rank'={cp_rank} / 'cp_size'={cp_size}: need 0 <= cp_rank < cp_size")
        if cp_size > 1:
            return self._collect_cp(path, data, rid, cols, lengths, train_in, rollout_in, masks_in, indices, cp_size, cp_rank)
        train, rollout, masks, kept_lengths = [], [], [], []
        for i in range(n):
            where = f"sample {i} (sample_index {indices[i]})" if indices[i] is not None else f"sample {i}"
            if indices[i] is not None:
                key = (rid, indices[i])
                if key in self._seen:  # a tensor-parallel (or otherwise redundant) copy
                    self.num_duplicates += 1
                    continue
            t = _vector(path, where, "log_probs", train_in[i])
            if t.numel() != lengths[i]:
                hint = (
                    " (a dump written under context parallelism holds only this rank's piece, and this "
                    "format records no CP rank to put it back: write the dump with slime's format_version 2 "
                    "or Miles' writer that records cp_rank)"
                    if t.numel() < lengths[i]
                    else ""
                )
                raise DumpError(path, f"{where}: field 'log_probs' has {t.numel()} values, expected response_length={lengths[i]}{hint}")
            train.append(t)
            rollout.append(_vector(path, where, "rollout_log_probs", rollout_in[i], lengths[i]))
            masks.append(_vector(path, where, "loss_masks", masks_in[i], lengths[i], mask=True))
            kept_lengths.append(lengths[i])
            if indices[i] is not None:
                self._seen.add((rid, indices[i]))
        if not train:
            return []
        return [DumpBatch(str(path), kind, rid, train, rollout, masks, kept_lengths)]

    def _collect_cp(self, path, data, rid, cols, lengths, train_in, rollout_in, masks_in, indices, cp_size, cp_rank):
        from megatron_mis.parallel.layout import local_response_layout

        layout = data.get("qkv_format")
        layout = "thd" if layout is None else layout
        if not isinstance(layout, str) or layout not in ("thd", "bshd"):
            raise DumpError(path, f"field 'qkv_format' is {_short(layout)}; expected 'thd' or 'bshd'")
        total_in = cols.get("total_lengths")
        if total_in is None:
            raise DumpError(path, "rollout_data: missing field 'total_lengths' (needed to place CP pieces, cp_size > 1)")
        totals = [_int(path, f"sample {i}", "total_lengths", v) for i, v in enumerate(_column(path, cols, "total_lengths", len(lengths)))]
        max_lens = cols.get("max_seq_lens")
        if layout == "bshd":
            if max_lens is None:
                raise DumpError(path, "rollout_data: missing field 'max_seq_lens' (qkv_format 'bshd', cp_size > 1)")
            max_lens = [_int(path, f"sample {i}", "max_seq_lens", v) for i, v in enumerate(_column(path, cols, "max_seq_lens", len(lengths)))]
        out_train, out_rollout, out_masks, out_lengths = [], [], [], []
        for i, length in enumerate(lengths):
            where = f"sample {i} (sample_index {indices[i]})"
            if indices[i] is None:
                raise DumpError(path, f"{where}: field 'sample_indices' is needed to join CP pieces (cp_size={cp_size})")
            key = (rid, indices[i])
            if key in self._seen:
                self.num_duplicates += 1
                continue
            try:
                lay = local_response_layout(
                    [totals[i]], [length], cp_size, cp_rank, layout=layout,
                    max_seq_lens=[max_lens[i]] if layout == "bshd" else None,
                )
            except ValueError as exc:
                raise DumpError(path, f"{where}: lengths do not fit the CP layout ({exc})") from None
            n_local = lay.num_local_tokens
            t = _vector(path, where, "log_probs", train_in[i], n_local)
            r = _vector(path, where, "rollout_log_probs", rollout_in[i], n_local)
            m = _vector(path, where, "loss_masks", masks_in[i], length, mask=True)
            entry = self._pending.setdefault(
                key, {"pieces": {}, "cp_size": cp_size, "length": length, "sources": [], "mask": m}
            )
            if entry["cp_size"] != cp_size or entry["length"] != length:
                raise DumpError(
                    path,
                    f"{where}: cp_size={cp_size}, response_length={length} disagree with {entry['sources'][0]} "
                    f"(cp_size={entry['cp_size']}, response_length={entry['length']})",
                )
            if cp_rank in entry["pieces"]:  # a TP copy of a piece we hold
                self.num_duplicates += 1
                continue
            entry["pieces"][cp_rank] = (lay.local_to_full_index(), t, r)
            entry["sources"].append(str(path))
            if len(entry["pieces"]) == cp_size:
                full_t = torch.full((length,), float("nan"))
                full_r = torch.full((length,), float("nan"))
                for idx, pt, pr in entry["pieces"].values():
                    full_t[idx] = pt
                    full_r[idx] = pr
                out_train.append(full_t)
                out_rollout.append(full_r)
                out_masks.append(entry["mask"])
                out_lengths.append(length)
                del self._pending[key]
                self._seen.add(key)
        if not out_train:
            return []
        return [DumpBatch(str(path), "miles", rid, out_train, out_rollout, out_masks, out_lengths)]


def _rollout_hint(key: str) -> str:
    if key == "rollout_log_probs":
        return " (the rollout engine's log-probs: the host stores them when TIS / mismatch metrics are on)"
    return ""


def finite_or_none(value: float) -> float | None:
    """``value`` if finite, else ``None`` (JSON has no NaN / Infinity)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
