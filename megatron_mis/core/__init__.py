"""Pure math on local tensors: the MIS engine, metrics, losses, KL and advantage estimators.
Nothing in this package imports Megatron-Core or torch.distributed."""
