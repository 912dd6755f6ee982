"""Fuzzing the dump readers (issue 12): whatever a file holds, ``analyze`` either analyses it or
raises a :class:`DumpError` that names the file — never another exception, never a NaN in the
JSON. Outcomes are classified; only "analysed" and "clear error" pass."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_mis.analysis import DumpError, analyze_history, to_json
from megatron_mis.config import MISConfig

_KEYS = ["train_log_probs", "rollout_log_probs", "loss_mask", "loss_masks", "rollout_id", "step", "input", "output",
         "format_version", "samples", "rollout_data", "response_lengths", "log_probs", "cp_size", "cp_rank",
         "sample_indices", "qkv_format", "total_lengths"]

_floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([-3e38, 3e38, -1e-45, 0.0, -0.5])
_scalars = st.none() | st.booleans() | st.integers(-3, 2**70) | _floats | st.text(max_size=3)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4), max_leaves=12)
_numbers = st.lists(st.floats(-30, 0, width=32) | _floats, min_size=0, max_size=6)
_good_row = st.fixed_dictionaries(
    {"train_log_probs": _numbers, "rollout_log_probs": _numbers},
    optional={"loss_mask": st.lists(st.sampled_from([0, 1, 2, 0.5, True]), max_size=6), "rollout_id": st.integers(-1, 3)},
)
_row = _good_row | st.dictionaries(st.sampled_from(_KEYS), _json, max_size=5) | _json


def _classify(path: Path) -> str:
    try:
        report = analyze_history([str(path)], MISConfig(), "default", progress=False).report
    except DumpError as exc:
        return "clear error" if str(exc).startswith(str(path)) or str(path) in str(exc) else f"unclear: {exc}"
    except Exception as exc:  # noqa: BLE001 - the point is to catch anything else
        return f"unclear: {type(exc).__name__}: {exc}"
    text = to_json(report)
    json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(AssertionError(name)))
    return "analysed"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_row, min_size=0, max_size=3))
def test_fuzz_jsonl(rows):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        outcome = _classify(path)
    assert outcome in ("analysed", "clear error"), outcome


def _tensorize(value, draw_tensor: bool):
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value) and draw_tensor:
        return torch.tensor(value)
    if isinstance(value, list):
        return [_tensorize(v, draw_tensor) for v in value]
    if isinstance(value, dict):
        return {k: _tensorize(v, draw_tensor) for k, v in value.items()}
    return value


@st.composite
def _near_valid(draw):
    """A valid slime / Miles / own payload with at most one field replaced by something odd."""
    n = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    vals = lambda length: torch.tensor(draw(st.lists(st.floats(-20, 0, width=32) | _floats, min_size=length, max_size=length)), dtype=torch.float32)  # noqa: E731
    train = [vals(length) for length in lengths]
    rollout = [vals(length) for length in lengths]
    masks = [torch.ones(length, dtype=torch.int32) for length in lengths]
    kind = draw(st.sampled_from(["pt", "slime", "legacy", "miles"]))
    if kind == "pt":
        payload = {"train_log_probs": train, "rollout_log_probs": rollout, "loss_masks": masks, "rollout_id": 0}
        target = payload
    elif kind == "slime":
        samples = [{"log_probs": t, "rollout_log_probs": r, "loss_masks": m, "response_lengths": len(t), "sample_index": i}
                   for i, (t, r, m) in enumerate(zip(train, rollout, masks))]
        payload = {"format_version": 2, "rollout_id": 1, "rank": 0, "samples": samples}
        target = samples[draw(st.integers(0, n - 1))] if draw(st.booleans()) else payload
    else:
        cols = {"log_probs": train, "rollout_log_probs": rollout, "loss_masks": masks, "response_lengths": lengths,
                "total_lengths": [length + 3 for length in lengths], "sample_indices": list(range(n))}
        payload = {"rollout_id": 2, "rank": 0, "rollout_data": cols}
        if kind == "miles":
            cp_size = draw(st.sampled_from([1, 1, 2]))
            payload.update({"cp_rank": draw(st.integers(0, cp_size - 1)), "cp_size": cp_size,
                            "qkv_format": draw(st.sampled_from(["thd", "bshd"]))})
        target = cols if draw(st.booleans()) else payload
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(target)))
        target[key] = draw(_json | st.just(torch.zeros(2, 2)) | st.just(torch.zeros(7)) | st.just([torch.zeros(1)] * n))
    return payload


_pt_payload = st.one_of(
    _near_valid(),
    _near_valid(),
    st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6),
    st.fixed_dictionaries({"format_version": st.sampled_from([2, 2, 1, "2"]), "rollout_id": st.integers(0, 3) | _json,
                           "samples": st.lists(st.dictionaries(st.sampled_from(_KEYS), _json | _numbers, max_size=6), max_size=3)}),
    st.fixed_dictionaries({"rollout_id": st.integers(0, 3), "rank": st.integers(0, 3),
                           "rollout_data": st.dictionaries(st.sampled_from(_KEYS), st.lists(_numbers | _json, max_size=3), max_size=6)},
                          optional={"cp_size": st.integers(0, 3) | _json, "cp_rank": st.integers(0, 3)}),
    _json,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_pt_payload, as_tensors=st.booleans())
def test_fuzz_pt(payload, as_tensors):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.pt"
        torch.save(_tensorize(payload, as_tensors), path)
        outcome = _classify(path)
    assert outcome in ("analysed", "clear error"), outcome


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200), cut=st.integers(0, 4000))
def test_fuzz_bytes_and_truncation(data, cut):
    with tempfile.TemporaryDirectory() as d:
        raw = Path(d) / "raw.pt"
        raw.write_bytes(data)
        assert _classify(raw) == "clear error"
        good = Path(d) / "good.pt"
        torch.save({"train_log_probs": [torch.zeros(50)], "rollout_log_probs": [torch.zeros(50)]}, good)
        blob = good.read_bytes()
        cut_file = Path(d) / "cut.pt"
        cut_file.write_bytes(blob[: min(cut, len(blob) - 1)])
        assert _classify(cut_file) == "clear error"
