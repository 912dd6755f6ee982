"""A rollout engine separate from the trainer: pure-torch inference for the architecture of a
Megatron-Core GPTModel (local layer spec), with its own numeric paths.

The trainer (Megatron-Core, float32) and this engine share weights, not code:

- **fast path** (``precision`` = ``fp32`` / ``bf16`` / ``fp16`` / ``int8`` / ``int4``): batched
  autoregressive sampling with a KV cache, batch-first layout, fused ``F.linear``, grouped-query
  SDPA, RMSNorm accumulated in float32 and cast back, rotary embedding from the positions.
  ``bf16`` / ``fp16`` keep weights and activations in that dtype; ``int8`` / ``int4`` quantise
  every linear weight per output channel (symmetric, weight-only; 255 / 15 levels) and multiplies with the dequantised
  weight in float32. Log-probs are recorded the way SGLang returns them: the log-softmax, in
  float32, of ``logits / temperature`` at the sampled token, from the same forward that sampled
  it (before top-k / top-p filtering). The prefill runs the prompt as one block and every new
  token is a ``[B, 1]`` step, so even in fp32 the matmul shapes (and hence reduction orders)
  differ from the trainer's full-sequence forward: a small, real mismatch.
- **true-on-policy path** (``true_on_policy=True``, Let Speed Be With Stability's first solution at this scale):
  every decoding step runs a forward that is the trainer's, operation for operation — the same
  ``[s, b, h]`` layout, ``torch.matmul`` per tensor-parallel shard with the shard-sum of the
  row-parallel all-reduce, the same rotary table, the same packed SDPA kernel, and the
  trainer's own log-prob arithmetic (:func:`megatron_mis.parallel.tp_logprobs.
  log_probs_from_shards`, the code of ``vocab_parallel_log_probs``) — over the SAME shapes as
  the trainer's recompute: all sequences packed in fixed slots of ``max prompt + max_new_tokens``
  tokens, tokens not yet generated filled with padding (causal attention never lets position
  ``t`` see them). Identical kernels on identical shapes give identical reduction orders, so the
  recorded log-probs equal the trainer's bit for bit. The price is the KV cache: each new token
  costs a forward of the whole batch. The trainer must recompute with
  ``pack_sequences(batch.sequences, slot_length=batch.slot_length)`` in micro-batches of
  ``batch.micro_batch_size`` sequences, with the same intra-op thread count.

Weights come from the GPTModel (:func:`weights_from_megatron`): under tensor parallelism the
shards are all-gathered over the explicit TP group and the engine runs unsharded on one
process; Megatron's fused QKV layout (per query group: the group's query heads, then one key
and one value head), RMSNorm / LayerNorm, non-interleaved rotary embedding, GeLU / SwiGLU MLP
and untied output layer are handled.

**MoE models** (Megatron's ``TopKRouter`` + ``SequentialMLP`` experts, see
:mod:`~megatron_mis.testbed.demo.rollout.fast`) run on the fast path: the router logits and the
top-k are computed in the rollout precision, so expert choices flip relative to the trainer's
float32 routing, and :attr:`RolloutBatch.routed_experts` records the chosen experts per token and
layer in the layout SGLang returns (``[prompt + response - 1, num_layers, topk]``), ready for
routing replay (R3, :mod:`megatron_mis.routing`).

Modules: :mod:`~.config` (``RolloutConfig``), :mod:`~.weights` (weight sync, quantisation, the
per-layer tensor reader both paths share), :mod:`~.fast` and :mod:`~.aligned` (the two numeric
paths), :mod:`~.sampling`, :mod:`~.batch` (``RolloutBatch``), :mod:`~.engine` (``RolloutEngine``).
"""

from __future__ import annotations


from megatron_mis.testbed.demo.rollout.aligned import _AlignedModel
from megatron_mis.testbed.demo.rollout.batch import RolloutBatch
from megatron_mis.testbed.demo.rollout.config import DTYPES as _DTYPES
from megatron_mis.testbed.demo.rollout.config import Precision, RolloutConfig
from megatron_mis.testbed.demo.rollout.engine import RolloutEngine
from megatron_mis.testbed.demo.rollout.fast import _FastModel, _Linear, _rotate_half
from megatron_mis.testbed.demo.rollout.sampling import _as_prompt, _filter, _sample
from megatron_mis.testbed.demo.rollout.weights import (
    ModelArch,
    RolloutWeights,
    layer_tensors,
    quantize_int4_per_channel,
    quantize_int8_per_channel,
    weights_from_megatron,
)

__all__ = [
    "Precision",
    "RolloutConfig",
    "ModelArch",
    "RolloutWeights",
    "RolloutBatch",
    "RolloutEngine",
    "weights_from_megatron",
    "quantize_int8_per_channel",
    "quantize_int4_per_channel",
    "layer_tensors",
]
