"""Host integrations, one entry module per host:

- :mod:`megatron_mis.integrations.slime`: every path slime's flags take (TIS function, rollout-data
  hook, before-train-step hook, the patch's scheduler / monitor calls);
- :mod:`megatron_mis.integrations.miles`: the same for Miles (flags and patches);
- :mod:`megatron_mis.integrations.megatron`: what a plain Megatron-Core loop uses (the loss, the
  global normaliser, routing replay, the LR schedule and monitor).

Implementations: :mod:`~megatron_mis.integrations.tis_functions` (the drop-in TIS functions),
:mod:`~megatron_mis.integrations.scheduler_hooks` (the LR-schedule / monitor hooks),
:mod:`~megatron_mis.integrations.megatron_loss` (:class:`MegatronRLLoss`).
"""
