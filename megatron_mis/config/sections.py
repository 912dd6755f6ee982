"""One YAML, several components: the config sections of megatron-mis.

slime and Miles set every key of ``--custom-config-path`` on ``args``, so one file usually holds
the MIS keys together with the LR-schedule, routing-replay or loss keys. Each component registers
a :class:`ConfigSection` (its keys and how to build its validated config) in
:data:`CONFIG_SECTIONS`; :func:`load_sections` partitions a mapping by owner, builds every
section, and reports unknown keys (with the nearest valid key) together with every section's
problems in one :class:`ConfigError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mis.config.base import ConfigError, read_yaml_mapping
from megatron_mis.registry import Registry

__all__ = ["CONFIG_SECTIONS", "ConfigSection", "load_sections"]


@dataclass(frozen=True)
class ConfigSection:
    """A component's share of a shared YAML.

    Attributes:
        keys: returns the keys this section owns (imported lazily).
        build: builds the section's config object(s) from its keys; raises :class:`ConfigError`.
        describe: turns the built object into a plain dict for printing.
    """

    keys: Callable[[], list[str]]
    build: Callable[[dict[str, Any], str | None], Any]
    describe: Callable[[Any], dict[str, Any]]


CONFIG_SECTIONS: Registry[ConfigSection] = Registry("config section")


def _mis_keys() -> list[str]:
    from megatron_mis.config.mis import HOST_BOUND_FLAGS, MISConfig

    return MISConfig.field_names() + list(HOST_BOUND_FLAGS)


def _mis_build(data: dict[str, Any], source: str | None) -> Any:
    """The MIS keys, with the hosts' bound flags ``tis_clip`` / ``tis_clip_low`` (present in the
    mapping = set) mapped as the host drop-ins map them."""
    from megatron_mis.config.base import ConfigError
    from megatron_mis.config.mis import HOST_BOUND_FLAGS, MISConfig, resolve_host_bound_flags

    flags = {k: v for k, v in data.items() if k in HOST_BOUND_FLAGS}
    values = {k: v for k, v in data.items() if k not in HOST_BOUND_FLAGS}
    changes, problems = resolve_host_bound_flags({k: v for k, v in values.items() if v is not None}, flags)
    try:
        cfg = MISConfig.from_dict({**values, **changes}, source=source)
    except ConfigError as exc:
        raise ConfigError(exc.config_name, problems + exc.problems) from None
    if problems:
        raise ConfigError(MISConfig._label(source), problems)
    return cfg


def _mis_describe(cfg: Any) -> dict[str, Any]:
    out = cfg.to_dict()
    out["# resolved bounds"] = {
        "tis_lower_bound": cfg.tis_lower,
        "tis_upper_bound": cfg.tis_upper_bound,
        "rs_lower_bound": cfg.rs_lower,
        "rs_upper_bound": cfg.rs_upper,
    }
    return out


def _schedule_keys() -> list[str]:
    from megatron_mis.monitor import SCHEDULE_KEYS

    return sorted(SCHEDULE_KEYS)


def _schedule_build(data: dict[str, Any], source: str | None) -> Any:
    from megatron_mis.monitor import load_schedule_configs

    return load_schedule_configs(data, source=source)


def _schedule_describe(cfgs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (cfgs.surge, cfgs.decay, cfgs.monitor):
        out.update(part.to_dict())
    return out


def _routing_keys() -> list[str]:
    from megatron_mis.routing.config import RoutingReplayConfig

    return RoutingReplayConfig.field_names()


def _routing_build(data: dict[str, Any], source: str | None) -> Any:
    from megatron_mis.routing.config import RoutingReplayConfig

    return RoutingReplayConfig.from_dict(data, source=source)


CONFIG_SECTIONS.register("mis", ConfigSection(_mis_keys, _mis_build, _mis_describe))
def _loss_keys() -> list[str]:
    from megatron_mis.config.loss import LossConfig

    return LossConfig.field_names()


def _loss_build(data: dict[str, Any], source: str | None) -> Any:
    from megatron_mis.config.loss import LossConfig

    return LossConfig.from_dict(data, source=source)


CONFIG_SECTIONS.register("loss", ConfigSection(_loss_keys, _loss_build, lambda c: c.to_dict()))
CONFIG_SECTIONS.register("routing_replay", ConfigSection(_routing_keys, _routing_build, lambda c: c.to_dict()))
CONFIG_SECTIONS.register("lr_schedule", ConfigSection(_schedule_keys, _schedule_build, _schedule_describe))


def load_sections(data: Mapping[str, Any] | str | Path, *, source: str | None = None) -> dict[str, Any]:
    """Build every registered section from one mapping (or YAML file).

    Returns:
        ``{section name: built config}`` for every section (sections without keys in ``data`` get
        their defaults).

    Raises:
        ConfigError: every unknown key and every section's problems, together.
    """
    duplicates: list[str] = []
    if isinstance(data, (str, Path)):
        source = source or str(data)
        data, duplicates = read_yaml_mapping(data)
    if not isinstance(data, Mapping):
        raise ConfigError(source or "configuration", [f"expected a mapping of keys, got {type(data).__name__}"])
    owners: dict[str, str] = {}
    for name in CONFIG_SECTIONS:
        for key in CONFIG_SECTIONS.get(name).keys():
            owners[key] = name
    problems: list[str] = list(duplicates)  # reported with every other problem of the file
    for key in data:
        if key not in owners:
            close = difflib.get_close_matches(str(key), list(owners), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                f"unknown key {key!r}{hint}; no megatron-mis component ({', '.join(CONFIG_SECTIONS.names())}) owns it"
            )
    built: dict[str, Any] = {}
    for name in CONFIG_SECTIONS:
        section = CONFIG_SECTIONS.get(name)
        part = {k: v for k, v in data.items() if owners.get(k) == name}
        try:
            built[name] = section.build(part, source)
        except ConfigError as exc:
            problems += [f"[{name}] {p}" for p in exc.problems]
    if problems:
        raise ConfigError(source or "configuration", problems)
    return built
