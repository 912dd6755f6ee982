"""The end-to-end demo: a GRPO run on Megatron-Core with a separate, mismatched rollout engine
(``megatron-mis demo``, ``examples/megatron/train_grpo.py``; see ``docs/demo.md``).

- :mod:`~megatron_mis.testbed.demo.config`: ``DemoConfig`` (every flag; no torch import);
- :mod:`~megatron_mis.testbed.demo.task`: the synthetic digit task and its reward;
- :mod:`~megatron_mis.testbed.demo.rollout`: the rollout engine (fast paths, true-on-policy path);
- :mod:`~megatron_mis.testbed.demo.scoring`: the trainer's log-probs outside a training step;
- :mod:`~megatron_mis.testbed.demo.train`: the GRPO loop on one rank (``run_rank``);
- :mod:`~megatron_mis.testbed.demo.launch`: one process in place or several on gloo;
- :mod:`~megatron_mis.testbed.demo.report`: the PNG report and the comparison table.
"""
