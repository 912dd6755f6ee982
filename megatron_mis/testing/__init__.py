"""Helpers shipped with the package for running Megatron-Core on a CPU and testing against it:
your own CI, our tests and benchmarks, and ``examples/megatron/train_grpo.py`` on a CPU-only
machine.

- :mod:`megatron_mis.testing.cpu`: :func:`~megatron_mis.testing.cpu.cpu_compat` (the shims
  Megatron-Core needs on a CPU-only PyTorch build) and
  :func:`~megatron_mis.testing.cpu.cpu_gpt_layer_spec` (Megatron's local GPT layer spec with a
  core attention that accepts packed sequences and context parallelism on a CPU);
- :mod:`megatron_mis.testing.attention`: that core attention,
  :class:`~megatron_mis.testing.attention.SDPACoreAttention`;
- :mod:`megatron_mis.testing.distributed`: a multi-process gloo pool for distributed tests.

A GPU machine with Transformer Engine needs none of the CPU helpers; the gloo pool serves any
machine.
"""
