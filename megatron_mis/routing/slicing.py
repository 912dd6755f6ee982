"""Cut a micro-batch's routes into the shard one rank replays, exactly like its tokens.

A rank's MoE router sees the tokens of its hidden states ``[s_local, b, h]`` flattened
sequence-major (token ``p * b + j`` is position ``p`` of batch row ``j``). Which tokens those are
depends on the data layout of the host framework:

``thd`` (packed, slime / Miles default)
    Samples are concatenated. With context parallelism (CP size ``c > 1``) every sample is
    zigzag-split on its own (chunk ``ceil(T / 2c)``, padded; rank ``r`` keeps chunks ``r`` and
    ``2c-1-r``, see :mod:`megatron_mis.parallel.layout`) and the pieces are concatenated; with
    ``c == 1`` samples are concatenated unpadded. The local stream is then padded at the end to a
    multiple of ``pad_multiple`` (slime: ``tp_size * data_pad_size_multiplier``).
``allgather`` (allgather-CP)
    The concatenated stream is padded to a multiple of ``cp_size * pad_multiple`` and split into
    ``cp_size`` contiguous pieces.
``bshd`` (padded batch)
    ``[b, S]`` with ``S = max_seq_len``; with CP the sequence dimension is zigzag-split with chunk
    ``ceil(S / 2c)``; the router sees positions-major order.

With sequence parallelism (``sequence_parallel`` and TP size ``t > 1``) the local sequence is
split again into ``t`` contiguous pieces and TP rank ``k`` keeps piece ``k``; without it every TP
rank sees the whole local sequence. Pipeline parallelism keeps only the columns (global layer
ids) of the MoE layers this rank builds (:func:`local_moe_layer_ids`).

Padding rows (micro-batch padding, CP padding, the ``bshd`` tail) get
:func:`~megatron_mis.routing.routes.spread_padding_routes`, never one expert for all, and are
replayed as such. Tokens of a sample without a rollout route — its last token (SGLang returns no
row for it), tokens appended after the last request, entries the server sent as negative ids —
are *not* replayed: :attr:`RouteShard.replayed` is False there and the trainer's router chooses
itself. Both padding and those tokens are left out of the agreement metric (:attr:`RouteShard.valid`
is False on a row that has no rollout route in any of the shard's layers, and the agreement
skips every ``(token, layer)`` that is not replayed).

Everything here is pure tensor arithmetic except :func:`local_moe_layer_ids` /
:func:`shard_spec_from_megatron` (they read Megatron's layer layout) and
:func:`scatter_route_shards` (point-to-point sends over an explicit process group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_mis.parallel.layout import allgather_local_length, zigzag_position_ranges
from megatron_mis.routing.routes import complete_sample_routes, spread_padding_routes
from megatron_mis.routing.sglang import compact_route_dtype

__all__ = [
    "RouteShardSpec",
    "RouteShard",
    "local_token_index",
    "shard_routes",
    "moe_layer_pattern",
    "local_moe_layer_ids",
    "shard_spec_from_megatron",
    "scatter_route_shards",
]

TokenLayout = Literal["thd", "bshd", "allgather"]


@dataclass(frozen=True)
class RouteShardSpec:
    """Where one rank sits, for slicing routes (pure data; build it anywhere).

    Attributes:
        layer_ids: global 0-based layer ids whose routes this rank replays (the shard's columns,
            in this order).
        num_experts: routed experts per layer.
        layout: ``"thd"``, ``"bshd"`` or ``"allgather"`` (module docstring).
        cp_size, cp_rank: context parallelism.
        tp_size, tp_rank: tensor parallelism.
        sequence_parallel: whether the router input is split over TP ranks.
        pad_multiple: thd: the local stream is padded to a multiple of this; allgather: the
            global stream to a multiple of ``cp_size * pad_multiple``.
        max_seq_len: bshd only: the padded sequence length ``S`` of the batch.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    layout: TokenLayout = "thd"
    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    pad_multiple: int = 1
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        problems = []
        if self.layout not in ("thd", "bshd", "allgather"):
            problems.append(f"layout={self.layout!r} is not one of 'thd', 'bshd', 'allgather'")
        for size, rank, name in ((self.cp_size, self.cp_rank, "cp"), (self.tp_size, self.tp_rank, "tp")):
            if size < 1 or not 0 <= rank < size:
                problems.append(f"{name}_rank={rank} must lie in [0, {name}_size={size})")
        if self.pad_multiple < 1:
            problems.append(f"pad_multiple={self.pad_multiple} must be >= 1")
        if self.num_experts < 1:
            problems.append(f"num_experts={self.num_experts} must be >= 1")
        if len(set(self.layer_ids)) != len(self.layer_ids) or any(i < 0 for i in self.layer_ids):
            problems.append(f"layer_ids={self.layer_ids} must be distinct and >= 0")
        if self.layout == "bshd" and (self.max_seq_len is None or self.max_seq_len < 1):
            problems.append("layout='bshd' needs max_seq_len (the padded sequence length S)")
        if problems:
            raise ValueError("bad RouteShardSpec: " + "; ".join(problems))

    @property
    def splits_sequence_over_tp(self) -> bool:
        return self.sequence_parallel and self.tp_size > 1


@dataclass(frozen=True)
class RouteShard:
    """The routes one rank replays for one micro-batch.

    Attributes:
        routes: ``[num_tokens, num_layers_local, topk]`` compact expert ids, in router order.
        layer_ids: the global layer id of each column.
        valid: ``[num_tokens]`` bool, True on a sample token with a rollout route (in at least
            one of the shard's layers); False on padding rows and on tokens without a rollout
            route (a sample's last token). Left out of the agreement metric where False.
        replayed: ``[num_tokens, num_layers_local]`` bool or ``None`` (all True): where False
            there is no rollout route (a sample's last token, tokens appended after the last
            request, negative ids from the server) and the router uses its own top-k instead of
            ``routes``; such entries are also left out of the agreement.
    """

    routes: torch.Tensor
    layer_ids: tuple[int, ...]
    valid: torch.Tensor = field(default=None)  # type: ignore[assignment]
    replayed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.routes.dim() != 3:
            raise ValueError(f"RouteShard.routes must be [tokens, layers, topk], got {tuple(self.routes.shape)}")
        if self.routes.shape[1] != len(self.layer_ids):
            raise ValueError(f"RouteShard has {self.routes.shape[1]} columns but {len(self.layer_ids)} layer_ids")
        if self.valid is None:
            object.__setattr__(self, "valid", torch.ones(self.routes.shape[0], dtype=torch.bool))
        if self.valid.shape != (self.routes.shape[0],):
            raise ValueError(f"RouteShard.valid must be [{self.routes.shape[0]}], got {tuple(self.valid.shape)}")
        if self.replayed is not None:
            if self.replayed.dtype != torch.bool or tuple(self.replayed.shape) != tuple(self.routes.shape[:2]):
                raise ValueError(
                    f"RouteShard.replayed must be a bool [{self.routes.shape[0]}, {self.routes.shape[1]}] mask, "
                    f"got {self.replayed.dtype} {tuple(self.replayed.shape)}"
                )

    @property
    def num_not_replayed(self) -> int:
        """``(token, layer)`` entries the router decides itself (no rollout route)."""
        return 0 if self.replayed is None else int((~self.replayed).sum())

    @property
    def num_tokens(self) -> int:
        return int(self.routes.shape[0])

    @property
    def topk(self) -> int:
        return int(self.routes.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the route payload (routes + validity and replay masks)."""
        extra = 0 if self.replayed is None else self.replayed.numel()
        return self.routes.numel() * self.routes.element_size() + self.valid.numel() + extra

    def column(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise KeyError(f"layer {layer_id} is not in this shard (layers {self.layer_ids})") from None


def _lengths(total_lengths: Sequence[int] | torch.Tensor) -> list[int]:
    out = [int(x) for x in (total_lengths.tolist() if isinstance(total_lengths, torch.Tensor) else total_lengths)]
    for i, t in enumerate(out):
        if t < 1:
            raise ValueError(f"sample {i}: total_length={t} must be >= 1")
    return out


def local_token_index(total_lengths: Sequence[int] | torch.Tensor, spec: RouteShardSpec) -> torch.Tensor:
    """For each token a rank's router sees, its index in the concatenation of the full samples.

    Args:
        total_lengths: ``[N]`` tokens per sample (prompt + response).
        spec: the rank's place (only the token layout fields are used).

    Returns:
        ``[num_local_tokens]`` int64 in router order; ``-1`` marks padding.

    Raises:
        ValueError: a bshd sample longer than ``max_seq_len``, or a local sequence that the
            sequence-parallel split cannot divide evenly.
    """
    tl = _lengths(total_lengths)
    total = torch.tensor(tl, dtype=torch.long)
    offsets = torch.cumsum(total, 0) - total
    c, r = spec.cp_size, spec.cp_rank

    if spec.layout == "thd":
        if c == 1:
            idx = torch.arange(int(total.sum()), dtype=torch.long)
        else:
            pieces = []
            for off, t in zip(offsets.tolist(), tl):
                (s0, e0), (s1, e1) = zigzag_position_ranges(t, c, r)
                pos = torch.cat([torch.arange(s0, e0), torch.arange(s1, e1)])
                pieces.append(torch.where(pos < t, pos + off, torch.full_like(pos, -1)))
            idx = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        pad = (-idx.numel()) % spec.pad_multiple
        idx = torch.cat([idx, torch.full((pad,), -1, dtype=torch.long)])
        return _split_sequence(idx.view(-1, 1), spec).reshape(-1)

    if spec.layout == "allgather":
        n_total = int(total.sum())
        local = allgather_local_length(tl, c, spec.pad_multiple)
        pos = torch.arange(r * local, (r + 1) * local, dtype=torch.long)
        idx = torch.where(pos < n_total, pos, torch.full_like(pos, -1))
        return _split_sequence(idx.view(-1, 1), spec).reshape(-1)

    # bshd
    S = int(spec.max_seq_len)  # type: ignore[arg-type]
    for i, t in enumerate(tl):
        if t > S:
            raise ValueError(f"sample {i}: total_length={t} exceeds max_seq_len={S}")
    if c == 1:
        pos = torch.arange(S, dtype=torch.long)
    else:
        (s0, e0), (s1, e1) = zigzag_position_ranges(S, c, r)
        pos = torch.cat([torch.arange(s0, e0), torch.arange(s1, e1)])
    grid = pos.view(-1, 1) + offsets.view(1, -1)  # [s_local, b]
    grid = torch.where(pos.view(-1, 1) < total.view(1, -1), grid, torch.full_like(grid, -1))
    return _split_sequence(grid, spec).reshape(-1)


def _split_sequence(grid: torch.Tensor, spec: RouteShardSpec) -> torch.Tensor:
    """``[s_local, b]`` -> this TP rank's sequence-parallel piece (contiguous in ``s``)."""
    if not spec.splits_sequence_over_tp:
        return grid
    s = grid.shape[0]
    if s % spec.tp_size:
        raise ValueError(
            f"sequence parallelism splits the local sequence of {s} positions over tp_size={spec.tp_size} "
            f"ranks, which does not divide it; pad to a multiple of tp_size (pad_multiple)"
        )
    step = s // spec.tp_size
    return grid[spec.tp_rank * step : (spec.tp_rank + 1) * step]


def shard_routes(
    sample_routes: Sequence[torch.Tensor],
    total_lengths: Sequence[int] | torch.Tensor,
    spec: RouteShardSpec,
    *,
    sample_routed: Sequence[torch.Tensor | None] | None = None,
) -> RouteShard:
    """The shard of one micro-batch's routes that the rank described by ``spec`` replays.

    Args:
        sample_routes: per sample ``[T_i - 1 or T_i, num_layers, topk]`` expert ids over ALL
            layers (as decoded from SGLang; a missing last row gets a filler row that is not
            replayed).
        total_lengths: ``[N]`` tokens per sample ``T_i``.
        spec: the rank's place.
        sample_routed: optional, per sample ``[rows_i, num_layers]`` bool (or ``None``): False at
            entries without a rollout route (``SampleRoutes.finalize(..., with_mask=True)``).

    Returns:
        :class:`RouteShard` with ``[num_local_tokens, len(spec.layer_ids), topk]`` routes in the
        compact dtype, ``valid`` and ``replayed`` masks. Only the selected columns are copied.

    Raises:
        ValueError: mismatched counts, layer ids beyond the routes' layers, ids out of range, a
            mask of the wrong shape or dtype.
    """
    tl = _lengths(total_lengths)
    if len(sample_routes) != len(tl):
        raise ValueError(f"got {len(sample_routes)} route tensors for {len(tl)} samples")
    if sample_routed is not None and len(sample_routed) != len(tl):
        raise ValueError(f"sample_routed has {len(sample_routed)} masks for {len(tl)} samples")
    cols = torch.tensor(spec.layer_ids, dtype=torch.long)
    dtype = compact_route_dtype(spec.num_experts)
    topk = None
    pieces = []
    masks = []
    for i, (routes, t) in enumerate(zip(sample_routes, tl)):
        routes = torch.as_tensor(routes)
        if routes.dim() != 3:
            raise ValueError(f"sample {i}: routes must be [rows, num_layers, topk], got {tuple(routes.shape)}")
        if spec.layer_ids and max(spec.layer_ids) >= routes.shape[1]:
            raise ValueError(
                f"sample {i}: routes cover {routes.shape[1]} layers but layer id {max(spec.layer_ids)} "
                "is asked for (MTP layers have no rollout routes; exclude them)"
            )
        if topk is None:
            topk = int(routes.shape[2])
        elif routes.shape[2] != topk:
            raise ValueError(f"sample {i}: topk {routes.shape[2]} differs from sample 0's {topk}")
        # select columns first: only this rank's layers are ever copied
        try:
            full, has_row = complete_sample_routes(routes.index_select(1, cols), t, spec.num_experts, with_mask=True)
        except ValueError as exc:
            raise ValueError(f"sample {i}: {exc}") from None
        mask = has_row.view(-1, 1).expand(t, len(cols))
        routed = None if sample_routed is None else sample_routed[i]
        if routed is not None:
            routed = torch.as_tensor(routed)
            if routed.dtype != torch.bool or routed.dim() != 2 or tuple(routed.shape) != (routes.shape[0], routes.shape[1]):
                raise ValueError(
                    f"sample {i}: sample_routed must be a bool [{routes.shape[0]}, {routes.shape[1]}] mask "
                    f"(rows, num_layers of its routes), got {routed.dtype} {tuple(routed.shape)}"
                )
            sel = routed.index_select(1, cols)
            mask = mask & torch.cat([sel, torch.zeros(t - sel.shape[0], len(cols), dtype=torch.bool)], 0)
        pieces.append(full)
        masks.append(mask)
    topk = topk or 1
    flat = torch.cat(pieces) if pieces else torch.zeros(0, len(cols), topk, dtype=dtype)
    flat_routed = torch.cat(masks) if masks else torch.zeros(0, len(cols), dtype=torch.bool)
    idx = local_token_index(tl, spec)
    real = idx >= 0
    out = flat[idx.clamp_min(0)] if flat.shape[0] else torch.zeros(idx.numel(), len(cols), topk, dtype=dtype)
    # padding rows replay their filler; sample tokens replay only where they have a rollout route
    replayed = (
        torch.where(real.view(-1, 1), flat_routed[idx.clamp_min(0)], True)
        if flat_routed.shape[0]
        else torch.ones(idx.numel(), len(cols), dtype=torch.bool)
    )
    if not bool(real.all()):
        pad = spread_padding_routes(idx.numel(), len(cols), topk, spec.num_experts)
        out = torch.where(real.view(-1, 1, 1), out, pad)
    valid = real & replayed.any(1) if len(cols) else real
    return RouteShard(out.contiguous(), spec.layer_ids, valid, None if bool(replayed.all()) else replayed.contiguous())


# ----------------------------------------------------------------------------------- layer ids
def moe_layer_pattern(num_layers: int, moe_layer_freq: int | Sequence[int]) -> list[bool]:
    """Which decoder layers are MoE, with Megatron-Core's meaning of ``moe_layer_freq``: an int
    ``k`` makes layers ``0, k, 2k, ...`` MoE; a list gives 1 (MoE) / 0 (dense) per layer (e.g.
    DeepSeek's first dense layers)."""
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq={moe_layer_freq} must be >= 1")
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    pattern = [bool(int(x)) for x in moe_layer_freq]
    if len(pattern) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for num_layers={num_layers}")
    return pattern


def local_moe_layer_ids(
    config: Any,
    *,
    pp_rank: int | None = None,
    include_mtp: bool = False,
) -> tuple[int, ...]:
    """Global 0-based ids of the MoE layers built on pipeline rank ``pp_rank`` (all its virtual
    stages), from a Megatron-Core ``TransformerConfig`` and Megatron's own layer-offset rules
    (``pipeline_model_parallel_layout``, uneven first/last stages, VPP). MTP layers, if
    ``include_mtp``, are numbered ``num_layers + k``.

    ``pp_rank=None`` reads it from the initialised parallel state.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp_rank is None:
        from megatron.core import parallel_state as ps

        pp_rank = ps.get_pipeline_model_parallel_rank()
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    vp_size = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    ids: list[int] = []
    for vp in range(vp_size):
        vp_stage = vp if vp_size > 1 else None
        layout = getattr(config, "pipeline_model_parallel_layout", None)
        if layout is not None:
            from megatron.core.transformer.enums import LayerType

            layers = list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
        else:
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            layers = list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))
        ids += [i for i in layers if pattern[i]]
        if include_mtp and getattr(config, "mtp_num_layers", None):
            from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build

            if get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) > 0:
                ids += [config.num_layers + k for k in range(config.mtp_num_layers)]
    return tuple(ids)


def shard_spec_from_megatron(
    config: Any,
    *,
    layout: TokenLayout = "thd",
    pad_multiple: int = 1,
    max_seq_len: int | None = None,
    include_mtp: bool = False,
    tp_rank: int | None = None,
    cp_rank: int | None = None,
    pp_rank: int | None = None,
) -> RouteShardSpec:
    """A :class:`RouteShardSpec` for a rank of a Megatron-Core model.

    Sizes come from ``config`` (``tensor/context_parallel_size``, ``sequence_parallel``); ranks
    left as ``None`` are read from the initialised parallel state, so a driver that knows the
    layout can build every rank's spec without being that rank.
    """
    if None in (tp_rank, cp_rank, pp_rank):
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        cp_rank = ps.get_context_parallel_rank() if cp_rank is None else cp_rank
        pp_rank = ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    return RouteShardSpec(
        layer_ids=local_moe_layer_ids(config, pp_rank=pp_rank, include_mtp=include_mtp),
        num_experts=config.num_moe_experts,
        layout=layout,
        cp_size=config.context_parallel_size,
        cp_rank=cp_rank,
        tp_size=config.tensor_model_parallel_size,
        tp_rank=tp_rank,
        sequence_parallel=bool(config.sequence_parallel),
        pad_multiple=pad_multiple,
        max_seq_len=max_seq_len,
    )


# ------------------------------------------------------------------------------- distribution
_DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64]


def scatter_route_shards(
    shards: Sequence[RouteShard] | None,
    *,
    src: int,
    group: Any,
) -> RouteShard:
    """Send each rank of ``group`` its own shard, and nothing else.

    Args:
        shards: on the source rank, one :class:`RouteShard` per rank of ``group`` (group-rank
            order); ignored elsewhere (pass ``None``).
        src: the source's rank within ``group``.
        group: an explicit process group (never the WORLD group by default).

    Returns:
        This rank's shard.

    Communication: point-to-point only. The source sends every other rank at most five messages
    (a fixed 5-int header, then its layer ids, routes, validity mask and replay mask, each when
    non-empty and present) — exactly that rank's bytes; a rank receives only its own shard. No
    collective over the whole group runs.
    """
    import torch.distributed as dist

    me = dist.get_rank(group)
    n = dist.get_world_size(group)
    if not 0 <= src < n:
        raise ValueError(f"src={src} is not a rank of a group of {n}")
    if me == src:
        if shards is None or len(shards) != n:
            raise ValueError(f"the source needs one shard per rank of the group ({n}), got {None if shards is None else len(shards)}")
        for dst in range(n):
            if dst == src:
                continue
            s = shards[dst]
            peer = dist.get_global_rank(group, dst)
            has_replayed = s.replayed is not None
            header = torch.tensor(
                [s.num_tokens, len(s.layer_ids), s.topk, _DTYPES.index(s.routes.dtype), int(has_replayed)], dtype=torch.long
            )
            dist.send(header, peer, group=group)
            payloads = [torch.tensor(s.layer_ids, dtype=torch.long), s.routes.contiguous(), s.valid.to(torch.uint8)]
            if has_replayed:
                payloads.append(s.replayed.to(torch.uint8).contiguous())
            for payload in payloads:
                if payload.numel():  # both sides know the sizes from the header
                    dist.send(payload, peer, group=group)
        return shards[src]
    peer = dist.get_global_rank(group, src)
    header = torch.zeros(5, dtype=torch.long)
    dist.recv(header, peer, group=group)
    num_tokens, num_layers, topk, code, has_replayed = (int(x) for x in header)
    layer_ids = torch.zeros(num_layers, dtype=torch.long)
    routes = torch.zeros(num_tokens, num_layers, topk, dtype=_DTYPES[code])
    valid = torch.zeros(num_tokens, dtype=torch.uint8)
    replayed = torch.zeros(num_tokens, num_layers, dtype=torch.uint8) if has_replayed else None
    for payload in (layer_ids, routes, valid, replayed):
        if payload is not None and payload.numel():
            dist.recv(payload, peer, group=group)
    return RouteShard(
        routes, tuple(int(i) for i in layer_ids), valid.bool(), None if replayed is None else replayed.bool()
    )
