"""The built-in sample of ``megatron-mis analyze`` (no file given): responses sampled from a small
causal language model (random weights, fixed seed) and scored in float32 (the "trainer") and
bfloat16 (the "rollout engine") — a real, not injected, numeric mismatch. Runs in a second or two
on a CPU."""

from __future__ import annotations

import torch

from megatron_mis.analysis.single import LogProbSamples

__all__ = ["builtin_sample"]


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
