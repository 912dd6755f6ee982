"""Validated dataclass configs: the shared machinery behind every component's config.

Every component config is a ``@dataclass(kw_only=True, slots=True)`` deriving from
:class:`ConfigBase`. Each field carries its documentation in ``metadata={"doc": ...}`` (used by
``megatron-mis validate``, the README table test and error messages). Construction validates
everything and raises one :class:`ConfigError` listing *every* problem at once:

- unknown keys (with the nearest valid key suggested and the valid keys listed),
- wrong types (``Literal`` choices, bools, numbers, optional numbers),
- cross-field constraints from the class's ``_check()`` hook.

Settings that are legal but have no effect (a lower bound in truncate mode, ...) produce a
``UserWarning`` from the class's ``_warnings()`` hook instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

__all__ = ["ConfigBase", "ConfigError", "doc", "load_yaml_mapping"]


class ConfigError(ValueError):
    """One or more configuration problems, all reported together.

    Attributes:
        problems: one human-readable sentence per problem.
        config_name: the config class (and source) the problems belong to.
    """

    def __init__(self, config_name: str, problems: list[str]) -> None:
        self.config_name = config_name
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {config_name}:\n{lines}")


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and its documentation string."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": text})
    return dataclasses.field(default=default, metadata={"doc": text})


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping (an empty file gives ``{}``).

    Raises:
        FileNotFoundError: if the file does not exist.
        ConfigError: if the YAML does not parse or its top level is not a mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), [f"top level must be a mapping of keys, got {type(data).__name__}"])
    return dict(data)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        parts = [a for a in get_args(tp) if a is not type(None)]
        inner = " or ".join(_describe(a) for a in parts)
        return f"{inner} or null" if len(parts) < len(get_args(tp)) else inner
    if origin in (list, tuple):
        args = get_args(tp)
        return f"a list of {_describe(args[0])}" if args else "a list"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Try to fit ``value`` to annotation ``tp``. Returns ``(ok, coerced_value)``.

    Accepted coercions are the unambiguous ones YAML and argparse produce: an int for a float
    field, a numeric string for a float field (PyYAML reads ``1e-4`` as a string), a tuple for a
    list field.
    """
    origin = get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return (value in get_args(tp) and not isinstance(value, bool)), value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            return type(None) in args, None
        for arg in args:
            if arg is type(None):
                continue
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        (item_tp,) = get_args(tp)[:1] or (Any,)
        out = []
        for item in value:
            ok, item_out = _coerce(item, item_tp)
            if not ok:
                return False, value
            out.append(item_out)
        return True, (list(out) if origin is list else tuple(out))
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


class ConfigBase:
    """Mixin for validated dataclass configs (see module docstring).

    Subclasses override :meth:`_check` (cross-field errors, returns a list of sentences) and
    optionally :meth:`_warnings` (legal but ineffective settings).
    """

    __slots__ = ()

    # ----------------------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        problems, bad_fields = self._type_problems()
        if bad_fields:
            # Report cross-field problems too, all at once: check the well-typed fields with the
            # badly typed ones at their defaults, and drop sentences about the substituted fields.
            for f in dataclasses.fields(self):
                if f.name in bad_fields:
                    object.__setattr__(self, f.name, _default_of(f))
            problems += [p for p in self._check() if not any(name in p for name in bad_fields)]
        else:
            problems = self._check()
        if problems:
            raise ConfigError(type(self).__name__, problems)
        for message in self._warnings():
            warnings.warn(f"{type(self).__name__}: {message}", UserWarning, stacklevel=3)

    def _type_problems(self) -> tuple[list[str], set[str]]:
        hints = typing.get_type_hints(type(self))
        problems, bad_fields = [], set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ok, coerced = _coerce(value, hints[f.name])
            if not ok:
                extra = ""
                if get_origin(hints[f.name]) is Literal and isinstance(value, str):
                    extra = _closest(value, [a for a in get_args(hints[f.name]) if isinstance(a, str)])
                problems.append(f"{f.name}={value!r} is not {_describe(hints[f.name])}{extra}")
                bad_fields.add(f.name)
            elif isinstance(coerced, float) and not math.isfinite(coerced):
                problems.append(f"{f.name}={value!r} must be a finite number")
                bad_fields.add(f.name)
            elif coerced is not value:
                object.__setattr__(self, f.name, coerced)
        return problems, bad_fields

    def _check(self) -> list[str]:
        """Cross-field validation; return one sentence per problem."""
        return []

    def _warnings(self) -> list[str]:
        """Legal settings that have no effect; return one sentence per warning."""
        return []

    # ------------------------------------------------------------------------------ factories
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_docs(cls) -> dict[str, tuple[str, Any, str]]:
        """``{name: (type description, default, documentation)}`` in declaration order."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            out[f.name] = (_describe(hints[f.name]), _default_of(f), f.metadata.get("doc", ""))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None, ignore: tuple[str, ...] = ()):
        """Build from a mapping; unknown keys are errors (all problems reported together).

        Args:
            data: key -> value.
            source: where ``data`` came from, for error messages (a file path).
            ignore: keys that belong to someone else and are skipped silently.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(cls._label(source), [f"expected a mapping of keys, got {type(data).__name__}"])
        valid = cls.field_names()
        problems = [
            f"unknown key {key!r}{_closest(str(key), valid)}; valid keys: {', '.join(valid)}"
            for key in data
            if key not in valid and key not in ignore
        ]
        kwargs = {k: v for k, v in data.items() if k in valid}
        try:
            obj = cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(cls._label(source), problems + exc.problems) from None
        if problems:
            raise ConfigError(cls._label(source), problems)
        return obj

    @classmethod
    def from_yaml(cls, path: str | Path, *, ignore: tuple[str, ...] = ()):
        """Build from a YAML file whose top level holds this config's keys."""
        return cls.from_dict(load_yaml_mapping(path), source=str(path), ignore=ignore)

    @classmethod
    def from_namespace(cls, namespace: Any, *, source: str | None = None):
        """Build from an object carrying the keys as attributes (an argparse namespace on which a
        host framework set them). Attributes that are absent or ``None`` take the default; other
        attributes of the namespace are not this config's business and are not looked at."""
        kwargs = {}
        defaults = {f.name: f for f in dataclasses.fields(cls)}
        for name in defaults:
            if hasattr(namespace, name):
                value = getattr(namespace, name)
                if value is None and not _allows_none(cls, name):
                    continue
                kwargs[name] = value
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(cls._label(source or "args"), exc.problems) from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any):
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _label(cls, source: str | None) -> str:
        return f"{cls.__name__} ({source})" if source else cls.__name__


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _allows_none(cls: type, name: str) -> bool:
    tp = typing.get_type_hints(cls)[name]
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _closest(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
