"""The testbed: everything that runs the package end to end on one machine, and is not the library.

- :mod:`~megatron_mis.testbed.models`: Megatron-Core GPT models that run on CPU (shims, SDPA core
  attention with context parallelism, layer specs, builders);
- :mod:`~megatron_mis.testbed.cpu_moe`: the CPU MoE GPT (router shims) used by routing replay tests;
- :mod:`~megatron_mis.testbed.demo`: ``megatron-mis demo`` (task, rollout engine, GRPO loop, report);
- :mod:`~megatron_mis.testbed.study`: ``megatron-mis study`` (arms x seeds, statistics, report).

The library (``core``, ``parallel``, ``integrations``, ``routing``, ``monitor``, ``config``) never
imports this package (``tests/unit/test_architecture.py``).
"""
