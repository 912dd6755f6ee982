"""``RolloutEngine``: sample responses, record rollout log-probs (and, for MoE models, the
routed experts) through the fast or the true-on-policy numeric path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_mis.parallel.tp_logprobs import log_probs_from_shards, log_softmax_from_shards
from megatron_mis.testbed.demo.rollout.aligned import _AlignedModel
from megatron_mis.testbed.demo.rollout.batch import RolloutBatch
from megatron_mis.testbed.demo.rollout.config import RolloutConfig
from megatron_mis.testbed.demo.rollout.fast import _FastModel
from megatron_mis.testbed.demo.rollout.sampling import _as_prompt, _draw, _filter, _sample, processed_log_probs
from megatron_mis.testbed.demo.rollout.weights import ModelArch, RolloutWeights, weights_from_megatron

__all__ = ["RolloutEngine"]


class RolloutEngine:
    """Sample responses and record rollout log-probs; see the module docstring.

    Args:
        weights: from :func:`weights_from_megatron` (refresh with :meth:`load_weights` after every
            optimiser step).
        config: :class:`RolloutConfig`.
    """

    def __init__(self, weights: RolloutWeights, config: RolloutConfig) -> None:
        self.config = config
        self.load_weights(weights)

    @classmethod
    def from_megatron(cls, model: Any, config: RolloutConfig, *, tp_group: Any = None, pp_group: Any = None) -> "RolloutEngine":
        """Build from a GPTModel (collectives over ``tp_group`` / ``pp_group``, see
        :func:`weights_from_megatron`)."""
        return cls(weights_from_megatron(model, tp_group=tp_group, pp_group=pp_group), config)

    def load_weights(self, weights: RolloutWeights) -> None:
        self.weights = weights
        self.arch = weights.arch
        if self.config.true_on_policy:
            self._model: Any = _AlignedModel(weights)
        else:
            self._model = _FastModel(weights, self.config.precision, router_noise=self.config.router_noise)

    # ------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Any], *, generator: torch.Generator | None = None) -> RolloutBatch:
        """Sample one response per prompt.

        Args:
            prompts: ``N`` token sequences (1-D int tensors or lists), lengths may differ.
            generator: the random source for sampling (reproducible runs).
        """
        cfg = self.config
        ps = [_as_prompt(p, self.arch.vocab_size) for p in prompts]
        if not ps:
            raise ValueError("generate needs at least one prompt")
        if cfg.eos_token_id is not None and not 0 <= cfg.eos_token_id < self.arch.vocab_size:
            raise ValueError(f"eos_token_id={cfg.eos_token_id} outside the vocabulary [0, {self.arch.vocab_size})")
        if cfg.true_on_policy:
            return self._generate_aligned(ps, generator)
        return self._generate_fast(ps, generator)

    def _step_bookkeeping(self, tok, logp_tok, alive, out_tokens, out_logps, finished, kept=None, out_support=None) -> None:
        cfg = self.config
        for i in torch.nonzero(alive).flatten().tolist():
            out_tokens[i].append(int(tok[i]))
            out_logps[i].append(logp_tok[i])
            if out_support is not None:
                out_support[i].append(torch.nonzero(kept[i]).flatten().tolist() if kept is not None else [])
        if cfg.eos_token_id is not None:
            hit = alive & (tok == cfg.eos_token_id)
            finished |= hit
            alive &= ~hit

    def _result(self, ps, out_tokens, out_logps, finished, **extra) -> RolloutBatch:
        return RolloutBatch(
            prompts=ps,
            responses=[torch.tensor(t, dtype=torch.long) for t in out_tokens],
            rollout_log_probs=[torch.stack(lp).float() if lp else torch.zeros(0) for lp in out_logps],
            finished=finished,
            precision=self.config.precision,
            true_on_policy=self.config.true_on_policy,
            **extra,
        )

    def _generate_fast(self, ps: list[torch.Tensor], generator) -> RolloutBatch:
        cfg, model = self.config, self._model
        n = len(ps)
        lengths = torch.tensor([p.numel() for p in ps])
        p_max = int(lengths.max())
        pad = p_max - lengths  # left padding per row
        total = p_max + cfg.max_new_tokens
        tokens = torch.full((n, p_max), cfg.pad_token_id, dtype=torch.long)
        for i, p in enumerate(ps):
            tokens[i, int(pad[i]) :] = p
        cols = torch.arange(total)
        key_ok = cols[None, :] >= pad[:, None]  # [N, total]
        positions = (torch.arange(p_max)[None, :] - pad[:, None]).clamp_min(0)
        causal = cols[None, :p_max] <= cols[:p_max, None]  # [P, P]
        mask = (causal[None] & key_ok[:, None, :p_max]) | torch.eye(p_max, dtype=torch.bool)[None]
        cache = model.new_cache(n, total)
        routes = _RouteRecorder(self.arch, ps, pad) if self.arch.is_moe else None
        step_routes = None if routes is None else []
        logits = model.forward(tokens, positions, cache, 0, mask[:, None], step_routes, generator)[:, -1]  # [N, V]
        if routes is not None:
            routes.add_prefill(step_routes)
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
        truncates = bool(cfg.top_k or cfg.top_p < 1)
        out_support: list[list[list[int]]] | None = [[] for _ in range(n)] if cfg.record_support else None
        alive = torch.ones(n, dtype=torch.bool)
        finished = torch.zeros(n, dtype=torch.bool)
        for step in range(cfg.max_new_tokens):
            logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)  # SGLang: fp32 log-softmax
            filtered = _filter(logp, cfg.top_k, cfg.top_p)  # logp itself without top-k / top-p
            tok = _draw(filtered, generator)
            kept = torch.isfinite(filtered) if (truncates and out_support is not None) else None
            if cfg.logprobs == "processed" and truncates:
                logp = torch.log_softmax(filtered, dim=-1)  # what was sampled from (processed_log_probs)
            logp_tok = logp.gather(-1, tok[:, None]).squeeze(-1)
            self._step_bookkeeping(tok, logp_tok, alive, out_tokens, out_logps, finished, kept, out_support)
            if not bool(alive.any()) or step == cfg.max_new_tokens - 1:
                break
            col = p_max + step
            feed = torch.where(alive, tok, torch.full_like(tok, cfg.pad_token_id))
            pos = (lengths + step)[:, None]
            step_mask = key_ok[:, None, None, : col + 1]
            step_routes = None if routes is None else []
            logits = model.forward(feed[:, None], pos, cache, col, step_mask, step_routes, generator)[:, -1]
            if routes is not None:
                routes.add_step(step_routes, alive)
        extra: dict[str, Any] = {} if out_support is None else {"support": out_support}
        if routes is None:
            return self._result(ps, out_tokens, out_logps, finished, **extra)
        return self._result(
            ps, out_tokens, out_logps, finished, routed_experts=routes.result(), moe_layers=self.arch.moe_layers,
            num_experts=self.arch.num_moe_experts, **extra,
        )

    def _generate_aligned(self, ps: list[torch.Tensor], generator) -> RolloutBatch:
        cfg, model = self.config, self._model
        n = len(ps)
        slot = max(p.numel() for p in ps) + cfg.max_new_tokens
        mbs = cfg.micro_batch_size or n
        out_tokens: list[list[int]] = [[] for _ in range(n)]
        out_logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
        finished = torch.zeros(n, dtype=torch.bool)
        for lo in range(0, n, mbs):
            idx = list(range(lo, min(lo + mbs, n)))
            b = len(idx)
            grid = torch.full((b, slot), cfg.pad_token_id, dtype=torch.long)
            cur = torch.tensor([ps[i].numel() for i in idx])  # next position to fill
            for j, i in enumerate(idx):
                grid[j, : ps[i].numel()] = ps[i]
            cu = torch.arange(b + 1, dtype=torch.int32) * slot  # the trainer's cu_seqlens_q_padded
            alive = torch.ones(b, dtype=torch.bool)
            fin = torch.zeros(b, dtype=torch.bool)
            toks: list[list[int]] = [[] for _ in range(b)]
            lps: list[list[torch.Tensor]] = [[] for _ in range(b)]
            for _ in range(cfg.max_new_tokens):
                shards = model.forward(grid.view(1, -1), cu, slot)
                rows = torch.arange(b) * slot + cur - 1  # logit positions of the next tokens
                row_shards = [s[0].index_select(0, rows) for s in shards]  # [b, V/tp], as the trainer selects
                tok = _sample(log_softmax_from_shards(row_shards, temperature=cfg.temperature), cfg, generator)
                # recorded through the trainer's own log-prob arithmetic (parallel.tp_logprobs)
                logp_tok = log_probs_from_shards(row_shards, tok, temperature=cfg.temperature)
                took = alive.clone()
                self._step_bookkeeping(tok, logp_tok, alive, toks, lps, fin)
                for j in torch.nonzero(took).flatten().tolist():
                    grid[j, int(cur[j])] = int(tok[j])
                    cur[j] += 1
                if not bool(alive.any()):
                    break
            for j, i in enumerate(idx):
                out_tokens[i], out_logps[i] = toks[j], lps[j]
            finished[idx] = fin
        return self._result(ps, out_tokens, out_logps, finished, slot_length=slot, micro_batch_size=cfg.micro_batch_size)

    # --------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def score(
        self,
        sequences: Sequence[Any],
        response_lengths: Sequence[int] | torch.Tensor,
        *,
        slot_length: int | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced log-probs of the last ``response_lengths[n]`` tokens of each sequence
        through this engine's numeric path: one prefill (fast path) or the trainer's forward in
        slots of ``slot_length`` tokens (true-on-policy path; default the longest sequence).
        Returns ``N`` float32 ``[R_n]``."""
        cfg = self.config
        seqs = [_as_prompt(s, self.arch.vocab_size) for s in sequences]
        resp = [int(r) for r in response_lengths]
        if len(resp) != len(seqs):
            raise ValueError(f"got {len(resp)} response lengths for {len(seqs)} sequences")
        for i, (s, r) in enumerate(zip(seqs, resp)):
            if not 0 <= r <= s.numel() - 1:
                raise ValueError(f"sequence {i}: response_length={r} must lie in [0, {s.numel() - 1}]")
        if cfg.true_on_policy:
            from megatron_mis.parallel.packing import pack_sequences

            slot = slot_length or max(s.numel() for s in seqs)
            out = []
            mbs = cfg.micro_batch_size or len(seqs)
            for lo in range(0, len(seqs), mbs):
                part = seqs[lo : lo + mbs]
                batch = pack_sequences(part, slot_length=slot, pad_token_id=cfg.pad_token_id)
                shards = self._model.forward(batch.tokens, batch.cu_seqlens_padded.to(torch.int32), slot)
                idx = batch.response_index(resp[lo : lo + mbs])
                logp = log_probs_from_shards(
                    [s[0].index_select(0, idx) for s in shards], batch.labels[0][idx], temperature=cfg.temperature
                )
                counts = torch.bincount(batch.sequence_ids[idx], minlength=len(part))[: len(part)]
                out.extend(torch.split(logp, counts.tolist()))
            return out
        model = self._model
        n = len(seqs)
        lengths = torch.tensor([s.numel() for s in seqs])
        s_max = int(lengths.max())
        tokens = torch.full((n, s_max), cfg.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : s.numel()] = s
        positions = torch.arange(s_max)[None, :].expand(n, -1)
        cols = torch.arange(s_max)
        mask = (cols[None, :] <= cols[:, None])[None, None].expand(n, 1, -1, -1)
        cache = model.new_cache(n, s_max)
        logits = model.forward(tokens, positions, cache, 0, mask)
        logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
        if cfg.logprobs == "processed" and (cfg.top_k or cfg.top_p < 1):
            n_, s_, v_ = logp.shape
            logp = processed_log_probs(logp.reshape(-1, v_), cfg.top_k, cfg.top_p).view(n_, s_, v_)
        out = []
        for i, (s, r) in enumerate(zip(seqs, resp)):
            t = s.numel()
            out.append(logp[i, t - r - 1 : t - 1].gather(-1, s[t - r :, None]).squeeze(-1))
        return out


class _RouteRecorder:
    """Collects the fast path's expert choices into SGLang's per-sequence layout
    ``[P_n + R_n - 1, num_layers, topk]`` (see :class:`RolloutBatch`): the prefill gives the
    prompt rows (left padding skipped), every decoding step one row per sequence still alive (the
    token fed back); the last sampled token is never fed back and has no row."""

    def __init__(self, arch: ModelArch, prompts: list[torch.Tensor], pad: torch.Tensor) -> None:
        from megatron_mis.routing import compact_route_dtype, spread_padding_routes

        self.arch, self.pad = arch, pad
        self.dtype = compact_route_dtype(int(arch.num_moe_experts))
        self.rows: list[list[torch.Tensor]] = [[] for _ in prompts]
        self._filler = lambda n: spread_padding_routes(n, 1, arch.moe_router_topk, int(arch.num_moe_experts))[:, 0]

    def _stack(self, layers: list[torch.Tensor | None], b: int, s: int) -> torch.Tensor:
        """Per-layer ``[B, s, k]`` (``None``: dense) -> ``[B, s, num_layers, k]`` compact."""
        cols = []
        for chosen in layers:
            if chosen is None:
                chosen = self._filler(b * s).view(b, s, -1)
            cols.append(chosen.to(self.dtype))
        return torch.stack(cols, dim=2)

    def add_prefill(self, layers: list[torch.Tensor | None]) -> None:
        b, s = layers[self.arch.moe_layers[0]].shape[:2]
        grid = self._stack(layers, b, s)
        for i in range(b):
            self.rows[i].append(grid[i, int(self.pad[i]) :])

    def add_step(self, layers: list[torch.Tensor | None], fed: torch.Tensor) -> None:
        b = fed.numel()
        grid = self._stack(layers, b, 1)
        for i in torch.nonzero(fed).flatten().tolist():
            self.rows[i].append(grid[i])

    def result(self) -> list[torch.Tensor]:
        return [torch.cat(r).contiguous() for r in self.rows]
