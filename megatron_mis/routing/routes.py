"""Compact per-sample route storage, multi-turn append, and padding routes.

A sample's routes are a ``[rows, num_layers, topk]`` tensor of expert ids in the compact dtype of
:func:`~megatron_mis.routing.sglang.compact_route_dtype` (uint8 up to 256 experts). Row ``p`` is
the routing of the token at position ``p`` (the one that predicts token ``p + 1``).

Multi-turn: each turn's request asks for the rows the sample does not have yet
(``routed_experts_start_len = num_rows``). The first new row is the route of the previous turn's
last token, which that turn generated but never fed back — so it gets its real route from the
next turn's prefill instead of a padding row. Rows already held are never overwritten (they are
the routes that produced the earlier turns' log-probs). Only the very last token of the sample
(and any tokens appended after the last request) get filler rows, at :meth:`SampleRoutes.finalize`.

Positions without a rollout route: the filled rows just named, and entries the server sent as
negative sentinel ids (``(row, layer)`` it did not route; counted in
:attr:`SampleRoutes.num_unrouted`). ``finalize(..., with_mask=True)`` returns the
``[num_tokens, num_layers]`` mask of entries that do have one; pass it to
:func:`~megatron_mis.routing.slicing.shard_routes` (``sample_routed``) and routing replay lets the
trainer's router choose at the others, and leaves them out of the agreement metric.

Filler rows are spread over the experts (:func:`spread_padding_routes`), never all sent to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron_mis.routing.sglang import compact_route_dtype, decode_routed_experts, spread_padding_routes, to_compact

__all__ = ["spread_padding_routes", "SampleRoutes", "complete_sample_routes"]


def complete_sample_routes(
    routes: torch.Tensor, num_tokens: int, num_experts: int, *, with_mask: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One route row per token: ``routes`` with ``num_tokens - 1`` rows (as SGLang returns them)
    gets a spread filler row for the last token; ``num_tokens`` rows are returned as they are.

    Args:
        routes: ``[num_tokens - 1 or num_tokens, num_layers, topk]`` integer expert ids.
        num_tokens: tokens of the sample.
        num_experts: routed experts per layer.
        with_mask: also return ``[num_tokens]`` bool, False on the filled row.

    Returns:
        ``[num_tokens, num_layers, topk]`` compact (and the row mask with ``with_mask``).

    Raises:
        ValueError: any other row count, a non-3-d tensor, or ids out of range.
    """
    routes = torch.as_tensor(routes)
    if routes.dim() != 3:
        raise ValueError(f"routes must be [rows, num_layers, topk], got shape {tuple(routes.shape)}")
    rows, num_layers, topk = routes.shape
    if rows == num_tokens:
        out = to_compact(routes, num_experts)
    elif rows == num_tokens - 1:
        pad = spread_padding_routes(1, num_layers, topk, num_experts, start=rows)
        out = torch.cat([to_compact(routes, num_experts), pad], 0)
    else:
        raise ValueError(
            f"routes have {rows} rows for a sample of {num_tokens} tokens; expected {num_tokens - 1} "
            f"(as SGLang returns them) or {num_tokens}"
        )
    if not with_mask:
        return out
    return out, torch.arange(num_tokens) < rows


class SampleRoutes:
    """Routes of one sample, built turn by turn.

    Args:
        num_layers: the model's ``num_hidden_layers`` (all decoder layers).
        topk: experts per token.
        num_experts: routed experts per layer.

    Attributes:
        routes: ``[num_rows, num_layers, topk]`` compact tensor (rows held so far; filler ids
            where the server sent none).
        routed: ``[num_rows, num_layers]`` bool, False where the server sent a negative
            (unrouted) id.
    """

    def __init__(self, *, num_layers: int, topk: int, num_experts: int) -> None:
        for name, v in (("num_layers", num_layers), ("topk", topk), ("num_experts", num_experts)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if topk > num_experts:
            raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        self.routes = torch.zeros(0, num_layers, topk, dtype=compact_route_dtype(num_experts))
        self.routed = torch.zeros(0, num_layers, dtype=torch.bool)

    @property
    def num_unrouted(self) -> int:
        """``(row, layer)`` entries the server sent as negative (unrouted) ids."""
        return int((~self.routed).sum())

    @property
    def num_rows(self) -> int:
        """Rows held; pass it as the next request's ``start_len``."""
        return int(self.routes.shape[0])

    def append(self, routes: torch.Tensor, *, start_len: int, routed: torch.Tensor | None = None) -> None:
        """Add decoded rows that start at row ``start_len``.

        Rows before :attr:`num_rows` that the response repeats (a server that ignores or predates
        ``routed_experts_start_len`` returns everything) are dropped: the rows held are the ones
        that produced the earlier turns. A gap (``start_len > num_rows``) is an error: rows would
        be missing in the middle of the sample.

        Args:
            routes: ``[rows, num_layers, topk]`` expert ids in ``[0, num_experts)``.
            start_len: the row ``routes[0]`` belongs to.
            routed: ``[rows, num_layers]`` bool, False at entries without a route (the mask of
                ``decode_routed_experts(..., with_mask=True)``); default all True.
        """
        routes = torch.as_tensor(routes)
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (self.num_layers, self.topk):
            raise ValueError(
                f"routes must be [rows, num_layers={self.num_layers}, topk={self.topk}], got {tuple(routes.shape)}"
            )
        if not isinstance(start_len, int) or isinstance(start_len, bool) or start_len < 0:
            raise ValueError(f"start_len={start_len!r} must be an integer >= 0")
        if routed is None:
            routed = torch.ones(routes.shape[:2], dtype=torch.bool)
        routed = torch.as_tensor(routed)
        if routed.dtype != torch.bool or tuple(routed.shape) != tuple(routes.shape[:2]):
            raise ValueError(
                f"routed must be a bool [rows={routes.shape[0]}, num_layers={self.num_layers}] mask, "
                f"got {routed.dtype} {tuple(routed.shape)}"
            )
        if start_len > self.num_rows:
            raise ValueError(
                f"routes start at row {start_len} but only {self.num_rows} rows are held: rows "
                f"{self.num_rows}..{start_len - 1} would be missing (send routed_experts_start_len={self.num_rows})"
            )
        skip = self.num_rows - start_len
        new = to_compact(routes[skip:], self.num_experts)
        self.routes = torch.cat([self.routes, new], 0)
        self.routed = torch.cat([self.routed, routed[skip:].cpu()], 0)

    def extend_from_response(self, meta_info: Mapping[str, Any], *, num_tokens: int, start_len: int = 0) -> None:
        """Decode one SGLang response and append its new rows.

        Args:
            meta_info: the response's ``meta_info``.
            num_tokens: tokens the server saw for this request plus the ones it generated
                (``len(input_ids) + completion_tokens``).
            start_len: the ``routed_experts_start_len`` sent with the request.
        """
        rows, routed = decode_routed_experts(
            meta_info,
            num_tokens=num_tokens,
            num_layers=self.num_layers,
            topk=self.topk,
            num_experts=self.num_experts,
            start_len=start_len,
            with_mask=True,
        )
        self.append(rows, start_len=start_len, routed=routed)

    def finalize(self, num_tokens: int, *, with_mask: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The sample's routes with one row per token: ``[num_tokens, num_layers, topk]``.

        Rows not held (the last token, and tokens appended after the last request, e.g. a final
        tool output) get spread filler rows. Asking for fewer tokens than rows held is an error
        (the routes belong to a longer sequence).

        With ``with_mask`` returns ``(routes, routed)``: ``routed`` ``[num_tokens, num_layers]``
        bool is False on the filled rows and on entries the server did not route; give it to
        :func:`~megatron_mis.routing.slicing.shard_routes` as ``sample_routed``.
        """
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            raise ValueError(f"num_tokens={num_tokens!r} must be an integer")
        if num_tokens < self.num_rows:
            raise ValueError(f"num_tokens={num_tokens} is fewer than the {self.num_rows} route rows held")
        extra = num_tokens - self.num_rows
        pad = spread_padding_routes(extra, self.num_layers, self.topk, self.num_experts, start=self.num_rows)
        routes = torch.cat([self.routes, pad], 0)
        if not with_mask:
            return routes
        return routes, torch.cat([self.routed, torch.zeros(extra, self.num_layers, dtype=torch.bool)], 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "topk": self.topk,
            "num_experts": self.num_experts,
            "routes": self.routes,
            "routed": self.routed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("num_layers", "topk", "num_experts"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state has {key}={state[key]}, this object has {getattr(self, key)}")
        routes = torch.as_tensor(state["routes"])
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (self.num_layers, self.topk):
            raise ValueError(f"state routes have shape {tuple(routes.shape)}")
        routed = torch.as_tensor(state.get("routed", torch.ones(routes.shape[:2], dtype=torch.bool)))
        if routed.dtype != torch.bool or tuple(routed.shape) != tuple(routes.shape[:2]):
            raise ValueError(f"state routed mask has {routed.dtype} {tuple(routed.shape)}, expected bool {tuple(routes.shape[:2])}")
        self.routes = to_compact(routes, self.num_experts)
        self.routed = routed.clone()
