"""Offline mismatch analysis: load per-sample rollout and training log-probs, run the MIS engine,
and format a report (what ``megatron-mis analyze`` prints).

Input formats
-------------
JSONL (``.jsonl`` / ``.json``)
    One sample per line: ``{"rollout_log_probs": [...], "train_log_probs": [...],
    "loss_mask": [...]}``; ``loss_mask`` is optional (default: all ones). Lists of equal length.
torch (``.pt`` / ``.pth``)
    ``torch.save({"rollout_log_probs": [Tensor, ...], "train_log_probs": [Tensor, ...],
    "loss_masks": [Tensor, ...]})``; ``loss_masks`` optional. One 1-D tensor per sample.

With no file, :func:`builtin_sample` generates samples at run time from a small causal language
model (random weights, fixed seed) evaluated in float32 (the "trainer") and bfloat16 (the
"rollout engine"): a real, not injected, numeric mismatch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_mis.config.mis import MISConfig
from megatron_mis.core.engine import MISResult, compute_mis_from_lists
from megatron_mis.core.metrics import METRIC_DOCS

__all__ = ["LogProbSamples", "load_samples", "builtin_sample", "analyze", "format_report"]


@dataclass
class LogProbSamples:
    """Per-sample log-probs (each list has one 1-D float tensor per sample)."""

    train_log_probs: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    source: str

    @property
    def num_samples(self) -> int:
        return len(self.train_log_probs)

    @property
    def num_tokens(self) -> int:
        return int(sum(int(t.numel()) for t in self.train_log_probs))


def _as_tensor(values, what: str, index: int) -> torch.Tensor:
    try:
        t = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sample {index}: {what} must be a list of numbers ({exc})") from None
    if t.dim() != 1:
        raise ValueError(f"sample {index}: {what} must be 1-D, got shape {tuple(t.shape)}")
    return t


def load_samples(path: str | Path) -> LogProbSamples:
    """Read a JSONL or ``.pt`` file (see module docstring).

    Raises:
        FileNotFoundError, ValueError: naming the sample and the missing / malformed field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {str(path)!r}")
    train, rollout, masks = [], [], []
    if path.suffix in (".pt", ".pth"):
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a dict with rollout_log_probs / train_log_probs, got {type(data).__name__}")
        missing = [k for k in ("rollout_log_probs", "train_log_probs") if k not in data]
        if missing:
            raise ValueError(f"{path}: missing key(s) {missing}; found {sorted(data)}")
        n = len(data["train_log_probs"])
        masks_in = data.get("loss_masks")
        if len(data["rollout_log_probs"]) != n or (masks_in is not None and len(masks_in) != n):
            raise ValueError(
                f"{path}: {n} train_log_probs, {len(data['rollout_log_probs'])} rollout_log_probs and "
                f"{'no' if masks_in is None else len(masks_in)} loss_masks; one entry per sample is needed"
            )
        for i in range(n):
            train.append(_as_tensor(data["train_log_probs"][i], "train_log_probs", i))
            rollout.append(_as_tensor(data["rollout_log_probs"][i], "rollout_log_probs", i))
            masks.append(_as_tensor(masks_in[i], "loss_masks", i) if masks_in is not None else torch.ones_like(train[-1]))
    else:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
                i = len(train)
                missing = [k for k in ("rollout_log_probs", "train_log_probs") if k not in row]
                if missing:
                    raise ValueError(f"{path}:{lineno}: missing key(s) {missing}; found {sorted(row)}")
                train.append(_as_tensor(row["train_log_probs"], "train_log_probs", i))
                rollout.append(_as_tensor(row["rollout_log_probs"], "rollout_log_probs", i))
                masks.append(_as_tensor(row["loss_mask"], "loss_mask", i) if "loss_mask" in row else torch.ones_like(train[-1]))
    for i, (a, b, m) in enumerate(zip(train, rollout, masks)):
        if not a.shape == b.shape == m.shape:
            raise ValueError(
                f"{path}: sample {i}: train_log_probs {tuple(a.shape)}, rollout_log_probs {tuple(b.shape)} and "
                f"loss mask {tuple(m.shape)} must have the same length"
            )
    return LogProbSamples(train, rollout, masks, source=str(path))


class _TinyCausalLM(torch.nn.Module):
    """A 2-layer causal transformer used only to make a realistic built-in sample."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(max_len, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n, device=tokens.device))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device, dtype=x.dtype)
        return self.head(self.body(x, mask=causal, is_causal=True))


@torch.no_grad()
def builtin_sample(num_samples: int = 48, prompt_len: int = 8, response_len: int = 40, seed: int = 0) -> LogProbSamples:
    """Sample responses from a small random causal LM in float32 and score them in float32
    ("train") and bfloat16 ("rollout"). Runs in a second or two on a CPU."""
    g = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    vocab, total = 96, prompt_len + response_len
    model = _TinyCausalLM(vocab, 64, 2, 4, total).eval()
    torch.random.set_rng_state(torch_state)
    # Make the output distribution peaked enough that sampling visits low-probability tokens.
    model.head.weight.mul_(6.0)
    seqs = torch.randint(0, vocab, (num_samples, prompt_len), generator=g)
    for _ in range(response_len):
        logits = model(seqs)[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        seqs = torch.cat([seqs, nxt], 1)

    def score(m: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        logits = m.to(dtype)(seqs)[:, prompt_len - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)

    train = score(model, torch.float32)
    rollout = score(model, torch.bfloat16)
    mask = torch.ones_like(train)
    return LogProbSamples(list(train), list(rollout), list(mask), source="built-in sample (random 2-layer LM, fp32 vs bf16)")


def analyze(samples: LogProbSamples, config: MISConfig | None = None) -> MISResult:
    """Run the engine over all samples as one batch."""
    return compute_mis_from_lists(samples.train_log_probs, samples.rollout_log_probs, samples.loss_masks, config or MISConfig())


_MISMATCH_KEYS = (
    "mis_k3_kl", "mis_kl", "mis_log_ppl_abs_diff", "mis_log_ppl_diff", "mis_training_log_ppl", "mis_rollout_log_ppl",
    "mis_ppl_ratio", "mis_chi2_token", "mis_chi2_seq", "mis_tv", "mis_ess_token", "mis_ess_seq",
    "mis_nonfinite_token_fraction",
)


def format_report(samples: LogProbSamples, result: MISResult, config: MISConfig, config_source: str) -> str:
    """The human-readable report of ``megatron-mis analyze``."""
    s = result.scalars()
    lines = [
        "megatron-mis mismatch report",
        f"  data:   {samples.source}",
        f"  batch:  {samples.num_samples} samples, {samples.num_tokens} tokens, {int(s['num_loss_tokens'])} in the loss mask",
        f"  config: {config_source}",
        "",
        "Mismatch (rollout vs training log-probs)",
    ]
    for key in _MISMATCH_KEYS:
        lines.append(f"  {key:<30} {_fmt(s[key]):>12}   {METRIC_DOCS.get(key, '')}")
    lines += ["", "What this configuration does"]
    action_keys = [k for k in s if k.startswith(("mis_tis_", "mis_rs_", "mis_prob_veto", "mis_rejected", "mis_weight_", "mis_batch_norm"))]
    action_keys += ["num_kept_tokens", "num_kept_sequences"]
    for key in action_keys:
        lines.append(f"  {key:<34} {_fmt(s[key]):>12}   {METRIC_DOCS.get(key, '')}")
    lines += ["", "Mismatch by rollout-probability bucket (seed 001: it grows as probabilities approach 0)",
              f"  {'p_rollout bucket':<22} {'tokens':>8} {'mean |log r|':>14} {'mean k3':>12}"]
    table = result.bucket_table
    edges = table["edges"].tolist()
    for i in range(len(edges) - 1):
        label = f"[{edges[i]:g}, {edges[i + 1]:g}{']' if i == len(edges) - 2 else ')'}"
        lines.append(
            f"  {label:<22} {int(table['num_tokens'][i]):>8} {_fmt(float(table['mean_abs_log_ratio'][i])):>14} "
            f"{_fmt(float(table['mean_k3'][i])):>12}"
        )
    return "\n".join(lines)


def _fmt(value: float) -> str:
    if value == 0 or (1e-3 <= abs(value) < 1e5):
        return f"{value:.4f}"
    if math.isfinite(value):
        return f"{value:.3e}"
    return str(value)
