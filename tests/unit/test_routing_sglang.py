"""Rollout side of R3: SGLang request fields, decoding both wire formats, validation errors,
compact storage, multi-turn append and spread padding (hand-derived values)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megatron_mis.routing.routes import SampleRoutes, complete_sample_routes, spread_padding_routes
from megatron_mis.routing.sglang import (
    SGLANG_SERVER_FLAG,
    compact_route_dtype,
    decode_routed_experts,
    request_routed_experts,
)


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


ROUTES = np.array(  # 3 rows (4 tokens), 2 layers, top-2, 8 experts
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[7, 0], [1, 2]]], dtype=np.int64
)


def test_request_fields():
    payload = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
    out = request_routed_experts(payload)
    assert out["return_routed_experts"] is True and "routed_experts_start_len" not in out
    assert "return_routed_experts" not in payload  # not modified
    assert request_routed_experts(payload, start_len=5)["routed_experts_start_len"] == 5
    assert SGLANG_SERVER_FLAG == "--enable-return-routed-experts"
    with pytest.raises(ValueError, match="start_len"):
        request_routed_experts(payload, start_len=-1)


@pytest.mark.parametrize("wire", [None, "int32", "uint16", "uint8"])
def test_decode_both_formats(wire):
    meta = {"routed_experts": _b64(ROUTES.astype({None: "<i4", "int32": "<i4", "uint16": "<u2", "uint8": "u1"}[wire]))}
    if wire is not None:
        meta["routed_experts_dtype"] = wire
    out = decode_routed_experts(meta, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    assert out.dtype == torch.uint8 and out.shape == (3, 2, 2)
    assert torch.equal(out.long(), torch.from_numpy(ROUTES))


def test_decode_start_len_and_arrays():
    meta = {"routed_experts": _b64(ROUTES[1:].astype("<i4"))}
    out = decode_routed_experts(meta, num_tokens=4, num_layers=2, topk=2, num_experts=8, start_len=1)
    assert torch.equal(out.long(), torch.from_numpy(ROUTES[1:]))
    # an in-process engine may hand over an array
    out = decode_routed_experts({"routed_experts": ROUTES.tolist()}, num_tokens=4, num_layers=2, topk=2, num_experts=300)
    assert out.dtype == torch.int16 and torch.equal(out.long(), torch.from_numpy(ROUTES))


def test_decode_errors_are_clear():
    good = {"routed_experts": _b64(ROUTES.astype("<i4"))}
    with pytest.raises(ValueError, match=r"has 12 elements but shape \[num_tokens-1-start_len=4, num_layers=2, topk=2\] needs 16"):
        decode_routed_experts(good, num_tokens=5, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="needs 18"):  # layers counted without the dense ones
        decode_routed_experts(good, num_tokens=4, num_layers=3, topk=2, num_experts=8)
    with pytest.raises(ValueError, match=r"expert id 7 at index \(1, 1, 1\) is outside \[0, num_experts=7\)"):
        decode_routed_experts(good, num_tokens=4, num_layers=2, topk=2, num_experts=7)
    neg = ROUTES.copy()
    neg[2, 0, 1] = -1
    with pytest.raises(ValueError, match="expert id -1 .* sentinel"):
        decode_routed_experts({"routed_experts": _b64(neg.astype("<i4"))}, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="'int8' is not a known wire dtype; valid: int32, uint16, uint8"):
        decode_routed_experts({**good, "routed_experts_dtype": "int8"}, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="not a whole number of int32"):
        decode_routed_experts({"routed_experts": _b64(np.zeros(5, "u1"))}, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="not valid base64"):
        decode_routed_experts({"routed_experts": "@@@"}, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(KeyError, match="return_routed_experts.*--enable-return-routed-experts"):
        decode_routed_experts({}, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="topk=9 exceeds num_experts=8"):
        decode_routed_experts(good, num_tokens=4, num_layers=2, topk=9, num_experts=8)


def test_compact_dtype():
    assert compact_route_dtype(256) == torch.uint8
    assert compact_route_dtype(257) == torch.int16
    assert compact_route_dtype(32768) == torch.int16
    assert compact_route_dtype(40000) == torch.int32


def test_spread_padding_hand_values():
    pad = spread_padding_routes(3, 2, 2, 4)
    # [r, l, j] = (r*k + l + j) mod E
    want = torch.tensor([[[0, 1], [1, 2]], [[2, 3], [3, 0]], [[0, 1], [1, 2]]])
    assert torch.equal(pad.long(), want)
    big = spread_padding_routes(64, 3, 8, 16).long()
    assert all(len(set(row.tolist())) == 8 for row in big.reshape(-1, 8))  # distinct within a token
    counts = torch.bincount(big[:, 0].reshape(-1), minlength=16)
    assert int(counts.max() - counts.min()) == 0  # 64 tokens x 8 / 16 experts: every expert 32


def test_complete_sample_routes():
    full = complete_sample_routes(torch.from_numpy(ROUTES), 4, 8)
    assert full.shape == (4, 2, 2) and torch.equal(full[:3].long(), torch.from_numpy(ROUTES))
    assert torch.equal(full[3], spread_padding_routes(1, 2, 2, 8, start=3)[0])
    assert torch.equal(complete_sample_routes(full, 4, 8), full)
    with pytest.raises(ValueError, match="3 rows for a sample of 6 tokens; expected 5"):
        complete_sample_routes(torch.from_numpy(ROUTES), 6, 8)


def test_multi_turn_append_gives_last_token_its_real_route():
    """Turn 1: prompt 2 + 2 generated = 4 tokens -> rows 0..2. Turn 2: + 1 tool token + 2
    generated = 7 tokens, requested from row 3: row 3 is turn 1's last token, routed in turn 2's
    prefill, and must be its real route, not padding."""
    rng = np.random.default_rng(0)
    truth = np.stack([rng.permutation(8)[:2] for _ in range(6 * 2)]).reshape(6, 2, 2)
    s = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    s.extend_from_response({"routed_experts": _b64(truth[:3].astype("<i4"))}, num_tokens=4, start_len=0)
    assert s.num_rows == 3
    start = s.num_rows
    s.extend_from_response(
        {"routed_experts": _b64(truth[start:].astype("u1")), "routed_experts_dtype": "uint8"}, num_tokens=7, start_len=start
    )
    assert torch.equal(s.routes.long(), torch.from_numpy(truth))
    final = s.finalize(7)
    assert final.shape == (7, 2, 2) and torch.equal(final[:6].long(), torch.from_numpy(truth))

    # a server that ignores start_len returns every row: rows held are kept, new ones appended
    t = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    t.append(torch.from_numpy(truth[:3]), start_len=0)
    changed = truth.copy()
    changed[:3] = (changed[:3] + 1) % 8  # a recomputed prefix may differ; the held rows win
    t.append(torch.from_numpy(changed), start_len=0)
    assert torch.equal(t.routes.long(), torch.from_numpy(np.concatenate([truth[:3], changed[3:]])))

    gap = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    gap.append(torch.from_numpy(truth[:3]), start_len=0)
    with pytest.raises(ValueError, match="rows 3..4 would be missing"):
        gap.append(torch.from_numpy(truth[:1]), start_len=5)
    with pytest.raises(ValueError, match="fewer than the 6 route rows"):
        s.finalize(5)
    state = s.state_dict()
    u = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    u.load_state_dict(state)
    assert torch.equal(u.routes, s.routes)


# ------------------------------------------------------------------ unrouted (negative) ids, bad arguments
def test_negative_ids_are_unrouted_positions():
    neg = ROUTES.copy()
    neg[1, 0, :] = -1  # row 1, layer 0: not routed
    neg[2, 1, 1] = -7  # row 2, layer 1: one id missing -> the whole (row, layer) is unrouted
    meta = {"routed_experts": _b64(neg.astype("<i4"))}
    routes, routed = decode_routed_experts(meta, num_tokens=4, num_layers=2, topk=2, num_experts=8, with_mask=True)
    assert routed.tolist() == [[True, True], [False, True], [True, False]]
    assert routes.dtype == torch.uint8
    keep = routed.unsqueeze(2).expand_as(routes)
    assert torch.equal(routes.long()[keep], torch.from_numpy(ROUTES)[keep])
    filler = spread_padding_routes(3, 2, 2, 8)
    assert torch.equal(routes[1, 0], filler[1, 0]) and torch.equal(routes[2, 1], filler[2, 1])
    # without the mask a negative id still refuses (a caller would replay the filler on real tokens)
    with pytest.raises(ValueError, match="with_mask=True"):
        decode_routed_experts(meta, num_tokens=4, num_layers=2, topk=2, num_experts=8)
    # a clean payload: all routed
    _, ok = decode_routed_experts({"routed_experts": _b64(ROUTES.astype("<i4"))}, num_tokens=4, num_layers=2,
                                  topk=2, num_experts=8, with_mask=True)
    assert bool(ok.all())


def test_decoder_bad_arguments_name_the_parameter():
    good = {"routed_experts": _b64(ROUTES.astype("<i4"))}
    kw = dict(num_tokens=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(TypeError, match="meta_info must be the response's meta_info dict .*got NoneType"):
        decode_routed_experts(None, **kw)
    with pytest.raises(TypeError, match="meta_info must be .*got str"):
        decode_routed_experts("abc", **kw)
    with pytest.raises(TypeError, match=r"meta_info\['routed_experts'\] must be base64 text, bytes or an integer array"):
        decode_routed_experts({"routed_experts": {"a": 1}}, **kw)
    with pytest.raises(ValueError, match="routed_experts: expert ids must be integers"):
        decode_routed_experts({"routed_experts": [0.5] * 12}, **kw)
    for name, bad in (("num_tokens", None), ("num_layers", 0), ("topk", 1.5), ("num_experts", True), ("start_len", -1)):
        with pytest.raises(ValueError, match=f"{name}="):
            decode_routed_experts(good, **{**kw, name: bad})
    with pytest.raises(TypeError, match="with_mask='yes' must be a bool"):
        decode_routed_experts(good, **kw, with_mask="yes")


def test_decoder_misnamed_argument_is_named_with_the_accepted_ones():
    """issue 27: decode_routed_experts(payload=None, ...) raised Python's bare TypeError about a
    missing positional argument / an unexpected keyword, naming neither what is accepted nor
    where the routes come from."""
    kw = dict(num_tokens=4, num_layers=2, topk=2, num_experts=8)
    accepted = "it accepts meta_info, num_tokens, num_layers, topk, num_experts, start_len, with_mask"
    with pytest.raises(TypeError, match=rf"unknown keyword argument\(s\) 'payload'; {accepted} .*response\['meta_info'\]"):
        decode_routed_experts(payload=None, **kw)
    good = {"routed_experts": _b64(ROUTES.astype("<i4"))}
    with pytest.raises(TypeError, match=rf"unknown keyword argument\(s\) 'top_k'; {accepted}"):
        decode_routed_experts(good, num_tokens=4, num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(TypeError, match="needs meta_info: the response's meta_info dict"):
        decode_routed_experts(**kw)
    with pytest.raises(TypeError, match=r"needs topk, num_experts \(keyword arguments\)"):
        decode_routed_experts(good, num_tokens=4, num_layers=2)
    assert decode_routed_experts(meta_info=good, **kw).shape == (3, 2, 2)  # by keyword, as documented


def test_sample_routes_mask_through_finalize_and_shard():
    from megatron_mis.routing.slicing import RouteShardSpec, shard_routes

    neg = ROUTES.copy()
    neg[1, 1, :] = -1
    s = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    s.extend_from_response({"routed_experts": _b64(neg.astype("<i4"))}, num_tokens=4)
    assert s.num_unrouted == 1
    routes, routed = s.finalize(6, with_mask=True)  # 2 tokens appended after the last request
    assert routes.shape == (6, 2, 2) and torch.equal(routes, s.finalize(6))
    assert routed.tolist() == [[True, True], [True, False], [True, True], [False, False], [False, False], [False, False]]
    state = s.state_dict()
    t = SampleRoutes(num_layers=2, topk=2, num_experts=8)
    t.load_state_dict(state)
    assert torch.equal(t.routed, s.routed)

    shard = shard_routes([routes], [6], RouteShardSpec(layer_ids=(1, 0), num_experts=8), sample_routed=[routed])
    assert shard.valid.tolist() == [True, True, True, False, False, False]
    assert shard.replayed.tolist() == [[True, True], [False, True], [True, True]] + [[False, False]] * 3
    assert shard.num_not_replayed == 7
    with pytest.raises(ValueError, match="sample 0: sample_routed must be a bool"):
        shard_routes([routes], [6], RouteShardSpec(layer_ids=(0,), num_experts=8), sample_routed=[routed[:3]])


@pytest.mark.parametrize("num_experts", [0, -1, True, 2**31, 2**70, 8.0, "8"])
def test_num_experts_outside_the_int32_range_is_named(num_experts):
    meta = {"routed_experts": [[[0, 1]]]}
    with pytest.raises(ValueError, match=r"num_experts=.* must be an integer (>= 1|in \[1, 2147483647\])"):
        decode_routed_experts(meta, num_tokens=2, num_layers=1, topk=2, num_experts=num_experts)
