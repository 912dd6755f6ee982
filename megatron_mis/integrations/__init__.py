"""Host integrations: the slime / Miles drop-in TIS functions and the plain Megatron-Core loss."""
