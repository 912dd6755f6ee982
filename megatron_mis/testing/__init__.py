"""Test and benchmark helpers shipped with the package (multi-process gloo pool)."""
