"""Ask an SGLang server for the experts its MoE routers chose, and decode its answer.

Facts (checked in SGLang's source, ``python/sglang/srt/state_capturer/``):

- The server must be started with ``--enable-return-routed-experts`` (:data:`SGLANG_SERVER_FLAG`);
  without it the request field is accepted and nothing comes back.
- A ``/generate`` request asks for the routes with ``"return_routed_experts": true``. Newer
  servers also take ``"routed_experts_start_len": S`` and then return only rows ``S ..`` (used
  for multi-turn: ask for the rows you do not have yet).
- The response's ``meta_info["routed_experts"]`` is base64 of a flat row-major array of shape
  ``[prompt + completion - 1 - S, num_hidden_layers, top_k]``: row ``p`` holds, for every
  decoder layer (indexed by GLOBAL layer id, dense layers included, MTP layers not), the
  ``top_k`` expert ids that produced token ``p + 1``. The last token has no row: it was sampled,
  never fed back.
- Positions the server did not route carry **negative** sentinel ids (only possible with a
  signed wire dtype, int32). They are unrouted positions, not errors: decode with
  ``with_mask=True`` to get the ``[rows, num_layers]`` mask of routed entries (a ``(row, layer)``
  is routed only if all its ``top_k`` ids are >= 0); the unrouted entries get spread filler ids
  (:func:`~megatron_mis.routing.routes.spread_padding_routes`) in the returned routes, and
  routing replay lets the trainer's router choose there (docs/routing_replay.md).
- Legacy servers send int32 and no dtype. Newer servers send
  ``meta_info["routed_experts_dtype"]`` naming the wire dtype (``"int32"``, ``"uint16"`` or
  ``"uint8"``, chosen server-side with ``SGLANG_ROUTED_EXPERTS_DTYPE``); a missing field means
  int32.

Nothing here imports ``sglang``: these helpers run in any rollout process.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "SGLANG_SERVER_FLAG",
    "SGLANG_DTYPE_ENV",
    "WIRE_DTYPES",
    "request_routed_experts",
    "decode_routed_experts",
    "compact_route_dtype",
    "to_compact",
    "spread_padding_routes",
]

SGLANG_SERVER_FLAG = "--enable-return-routed-experts"
"""The SGLang server flag that enables route capture (``enable_return_routed_experts`` as a
Python ``ServerArgs`` field)."""

SGLANG_DTYPE_ENV = "SGLANG_ROUTED_EXPERTS_DTYPE"
"""Server-side environment variable choosing the wire dtype of newer SGLang versions."""

WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
}
"""Wire dtypes SGLang may name in ``meta_info["routed_experts_dtype"]`` (little endian)."""


def request_routed_experts(payload: Mapping[str, Any], *, start_len: int = 0) -> dict[str, Any]:
    """A copy of an SGLang ``/generate`` payload that asks for routed experts.

    Args:
        payload: the request body (``input_ids``, ``sampling_params``, ...); not modified.
        start_len: first route row wanted. ``0`` asks for all rows; a multi-turn caller passes
            the number of rows it already holds (:attr:`SampleRoutes.num_rows`). The field is
            only sent when ``start_len > 0``, so servers that predate it keep working for
            single-turn use.

    Returns:
        A new dict with ``return_routed_experts: True`` (and ``routed_experts_start_len``).
        Remember the server flag :data:`SGLANG_SERVER_FLAG`.
    """
    if not isinstance(start_len, int) or isinstance(start_len, bool) or start_len < 0:
        raise ValueError(f"start_len={start_len!r} must be an integer >= 0")
    out = dict(payload)
    out["return_routed_experts"] = True
    if start_len > 0:
        out["routed_experts_start_len"] = start_len
    else:
        out.pop("routed_experts_start_len", None)
    return out


#: Expert ids are int32 on SGLang's wire: no model can have more experts than int32 counts.
_MAX_EXPERTS = 2**31 - 1


def compact_route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed-safe dtype that holds expert ids ``0 .. num_experts-1``:
    ``uint8`` up to 256 experts, ``int16`` up to 32768, else ``int32``."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= _MAX_EXPERTS:
        raise ValueError(
            f"num_experts={num_experts!r} must be an integer in [1, {_MAX_EXPERTS}] (expert ids travel as int32)"
        )
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def to_compact(routes: torch.Tensor, num_experts: int, *, what: str = "routes") -> torch.Tensor:
    """Check that every id lies in ``[0, num_experts)`` and return ``routes`` in
    :func:`compact_route_dtype` (same shape, CPU).

    Raises:
        ValueError: naming the first out-of-range id (its position and value).
    """
    out_dtype = compact_route_dtype(num_experts)  # validates num_experts before any comparison with it
    routes = torch.as_tensor(routes)
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(f"{what}: expert ids must be integers, got dtype {routes.dtype}")
    if routes.numel():
        wide = routes.to(torch.int64)
        bad = (wide < 0) | (wide >= num_experts)
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0])
            value = int(wide[pos])
            hint = (
                " (a negative id is the sentinel of a position the server did not route: decode with "
                "with_mask=True, as SampleRoutes does, to treat it as unrouted)"
                if value < 0
                else ""
            )
            raise ValueError(
                f"{what}: expert id {value} at index {pos} is outside [0, num_experts={num_experts}){hint}; "
                f"{int(bad.sum())} of {routes.numel()} ids are out of range"
            )
    return routes.to("cpu", out_dtype)


def spread_padding_routes(
    num_rows: int, num_layers: int, topk: int, num_experts: int, *, start: int = 0
) -> torch.Tensor:
    """Routes for padding rows that spread over all experts.

    Entry ``[r, l, j] = ((start + r) * topk + l + j) mod num_experts``: within a row the ``topk``
    ids are distinct (consecutive modulo ``num_experts >= topk``), and successive rows move on by
    ``topk`` experts, so ``n`` padding rows load every expert with about ``n * topk / num_experts``
    tokens instead of sending all of them to one.

    Args:
        num_rows, num_layers, topk, num_experts: the shape and the expert count.
        start: row offset (so padding added in pieces keeps cycling).

    Returns:
        ``[num_rows, num_layers, topk]`` in the compact dtype.
    """
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
    r = torch.arange(start, start + num_rows, dtype=torch.int64).view(-1, 1, 1)
    l_ = torch.arange(num_layers, dtype=torch.int64).view(1, -1, 1)
    j = torch.arange(topk, dtype=torch.int64).view(1, 1, -1)
    return ((r * topk + l_ + j) % num_experts).to(compact_route_dtype(num_experts))


def _raw_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        try:
            import pybase64  # optional, faster

            return pybase64.b64decode(value, validate=True)
        except ImportError:
            pass
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"meta_info['routed_experts'] is not valid base64: {exc}") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"unexpected type {type(value).__name__}")


#: Largest token count, layer count, top-k or offset accepted (int32 range: far above any real
#: model or request, and a product of three such dimensions stays inside int64).
_MAX_DIM = 2**31 - 1


#: Marks an argument that was not given (so that a misnamed one gets a clear error, not Python's
#: "missing 1 required positional argument").
_NOT_GIVEN: Any = object()
_DECODE_ARGS = ("meta_info", "num_tokens", "num_layers", "topk", "num_experts", "start_len", "with_mask")


def _check_decode_call(given: Mapping[str, Any], unknown: Mapping[str, Any]) -> None:
    """A ``TypeError`` naming each unknown keyword and the accepted ones (Python's own message
    for ``decode_routed_experts(payload=None, ...)`` names neither what is allowed nor where the
    routes come from)."""
    if unknown:
        names = ", ".join(repr(k) for k in sorted(unknown))
        hint = ""
        if {"payload", "routed_experts", "data", "response"} & set(unknown):
            hint = (
                " Pass the response's meta_info dict, e.g. decode_routed_experts(response['meta_info'], ...); "
                "'payload' is the request body of request_routed_experts(), not an argument here."
            )
        raise TypeError(
            f"decode_routed_experts() got unknown keyword argument(s) {names}; it accepts "
            f"{', '.join(_DECODE_ARGS)} (meta_info first, the rest by keyword).{hint}"
        )
    if given["meta_info"] is _NOT_GIVEN:
        raise TypeError(
            "decode_routed_experts() needs meta_info: the response's meta_info dict, which holds "
            "'routed_experts' (e.g. decode_routed_experts(response['meta_info'], num_tokens=..., ...))"
        )
    missing = [name for name, value in given.items() if value is _NOT_GIVEN]
    if missing:
        raise TypeError(
            f"decode_routed_experts() needs {', '.join(missing)} (keyword arguments): num_tokens = prompt + "
            "completion tokens the server saw, num_layers = the model's num_hidden_layers, topk = "
            "num_experts_per_tok, num_experts = routed experts per layer"
        )


def decode_routed_experts(
    meta_info: Mapping[str, Any] = _NOT_GIVEN,
    *,
    num_tokens: int = _NOT_GIVEN,
    num_layers: int = _NOT_GIVEN,
    topk: int = _NOT_GIVEN,
    num_experts: int = _NOT_GIVEN,
    start_len: int = 0,
    with_mask: bool = False,
    **unknown: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode ``meta_info["routed_experts"]`` of one SGLang response.

    Args:
        meta_info: the response's ``meta_info`` dict.
        num_tokens: tokens of the sequence the server saw after this turn (prompt + completion).
        num_layers: the model's ``num_hidden_layers`` (ALL decoder layers, dense ones included).
        topk: experts per token (``num_experts_per_tok``).
        num_experts: routed experts per layer (ids must lie in ``[0, num_experts)``).
        start_len: the ``routed_experts_start_len`` the request carried (0 if none).
        with_mask: also return the mask of routed entries; negative (unrouted) ids are then
            accepted. Without it a negative id is an error (a caller that ignores the mask would
            replay filler experts on real tokens).

    Returns:
        ``routes``: ``[num_tokens - 1 - start_len, num_layers, topk]`` expert ids on the CPU, in
        :func:`compact_route_dtype` (uint8 for up to 256 experts); with ``with_mask`` the pair
        ``(routes, routed)`` with ``routed`` ``[rows, num_layers]`` bool (False where the server
        sent a negative id; those entries of ``routes`` hold spread filler ids).

    Raises:
        TypeError: ``meta_info`` missing or not a mapping, an unknown keyword argument (e.g.
            ``payload=``; the message lists the accepted ones), or ``routed_experts`` has an
            unusable type.
        KeyError: no ``routed_experts`` in ``meta_info`` (request field or server flag missing).
        ValueError: a bad argument (named), unknown dtype name, bad base64, a byte count that is
            not a whole number of elements, an element count that does not match the expected
            shape, or an expert id out of range — each message names the numbers involved.
    """
    _check_decode_call(
        {"meta_info": meta_info, "num_tokens": num_tokens, "num_layers": num_layers, "topk": topk,
         "num_experts": num_experts},
        unknown,
    )
    if not isinstance(meta_info, Mapping):
        raise TypeError(
            f"meta_info must be the response's meta_info dict (a Mapping), got {type(meta_info).__name__}: "
            f"{meta_info!r:.80}"
        )
    if not isinstance(with_mask, bool):
        raise TypeError(f"with_mask={with_mask!r} must be a bool")
    for name, v, lo in (("num_tokens", num_tokens, 1), ("num_layers", num_layers, 1), ("topk", topk, 1),
                        ("num_experts", num_experts, 1), ("start_len", start_len, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
        if v > _MAX_DIM:  # a tensor dimension (or offset) must fit torch's int64 shape arithmetic
            raise ValueError(f"{name}={v!r} must be an integer in [{lo}, {_MAX_DIM}]")
    compact_route_dtype(num_experts)  # the upper bound: expert ids are int32 on the wire
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
    if start_len > num_tokens - 1:
        raise ValueError(f"start_len={start_len} exceeds num_tokens - 1 = {num_tokens - 1}")
    if "routed_experts" not in meta_info or meta_info["routed_experts"] is None:
        raise KeyError(
            "meta_info has no 'routed_experts': send the request with return_routed_experts=true "
            f"(request_routed_experts) and start the SGLang server with {SGLANG_SERVER_FLAG}"
        )
    value = meta_info["routed_experts"]
    dtype_name = meta_info.get("routed_experts_dtype")
    rows = num_tokens - 1 - start_len
    shape = (rows, num_layers, topk)

    if isinstance(value, (str, bytes, bytearray, memoryview)):
        if dtype_name is None:
            dtype = WIRE_DTYPES["int32"]  # legacy servers: int32, no dtype field
        else:
            key = str(dtype_name).strip().lower()
            if key not in WIRE_DTYPES:
                raise ValueError(
                    f"meta_info['routed_experts_dtype']={dtype_name!r} is not a known wire dtype; "
                    f"valid: {', '.join(WIRE_DTYPES)}"
                )
            dtype = WIRE_DTYPES[key]
        raw = _raw_bytes(value)
        if len(raw) % dtype.itemsize:
            raise ValueError(
                f"routed_experts has {len(raw)} bytes, not a whole number of {dtype.name} elements "
                f"({dtype.itemsize} bytes each); is routed_experts_dtype={dtype_name!r} right?"
            )
        flat = torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("=")))
    else:  # already an array (e.g. from an in-process engine)
        try:
            arr = np.asarray(value)
            if arr.dtype == object:
                raise TypeError("object array")
            if arr.ndim == 0:  # a bare number is no encoding of [rows, layers, topk] routes
                raise TypeError("a scalar, not an array")
            flat = torch.as_tensor(arr).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"meta_info['routed_experts'] must be base64 text, bytes or an integer array, got "
                f"{type(value).__name__} ({exc})"
            ) from None

    expected = rows * num_layers * topk
    if flat.numel() != expected:
        per_row = num_layers * topk
        got_rows = f"{flat.numel() / per_row:g}"
        raise ValueError(
            f"routed_experts has {flat.numel()} elements but shape [num_tokens-1-start_len={rows}, "
            f"num_layers={num_layers}, topk={topk}] needs {expected} ({got_rows} rows of {per_row}); "
            "check num_tokens (prompt + completion of this request), start_len, and that num_layers "
            "is the model's num_hidden_layers (all layers, dense ones included)"
        )
    routes = flat.reshape(shape)
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(f"routed_experts: expert ids must be integers, got dtype {routes.dtype}")
    if not with_mask:
        return to_compact(routes, num_experts, what="routed_experts")
    wide = routes.to(torch.int64)
    routed = (wide >= 0).all(dim=2)  # [rows, num_layers]
    if not bool(routed.all()):
        filler = spread_padding_routes(rows, num_layers, topk, num_experts, start=start_len).to(torch.int64)
        wide = torch.where(routed.unsqueeze(2), wide, filler)
    return to_compact(wide, num_experts, what="routed_experts"), routed
