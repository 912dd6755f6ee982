"""Validated configuration dataclasses (no torch, no Megatron)."""

from megatron_mis.config.base import ConfigBase, ConfigError, doc, load_yaml_mapping
from megatron_mis.config.mis import HOST_KEYS, MISConfig

__all__ = ["ConfigBase", "ConfigError", "HOST_KEYS", "MISConfig", "doc", "load_yaml_mapping"]
