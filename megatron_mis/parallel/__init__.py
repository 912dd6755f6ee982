"""Parallel adapters: CP layout arithmetic, cross-rank statistics, vocab-parallel log-probs and
the reader of Megatron parallel state. Every collective takes an explicit process group."""
