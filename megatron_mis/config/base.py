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
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

__all__ = ["ConfigBase", "ConfigError", "Interval", "doc", "load_yaml_mapping", "read_yaml_mapping"]


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


@dataclasses.dataclass(frozen=True)
class Interval:
    """The allowed range of a numeric config key, declared in a config class's ``_RANGES``
    (``{field name: Interval}``) and checked for every instance; type errors of that key name it
    too. ``None`` ends are unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = True
    high_open: bool = True
    reason: str = ""

    def __contains__(self, x: float) -> bool:
        if self.low is not None and not (x > self.low if self.low_open else x >= self.low):
            return False
        if self.high is not None and not (x < self.high if self.high_open else x <= self.high):
            return False
        return True

    def phrase(self) -> str:
        """``"be > 0"``, ``"lie in (0, 80]"``, ``"lie in the open interval (0, 1)"``."""
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            if self.low_open and self.high_open:
                return f"lie in the open interval ({lo:g}, {hi:g})"
            return f"lie in {'(' if self.low_open else '['}{lo:g}, {hi:g}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"be {'>' if self.low_open else '>='} {lo:g}"
        if hi is not None:
            return f"be {'<' if self.high_open else '<='} {hi:g}"
        return "be a finite number"


#: Largest config file read (a config is a handful of keys; this keeps a wrong path cheap).
_MAX_FILE_BYTES = 1 << 20


class _Duplicate(NamedTuple):
    key: Any
    line: int
    first_line: int


def _strict_loader(duplicates: list[_Duplicate]) -> type:
    """A safe YAML loader that records every duplicate mapping key (PyYAML keeps the last one)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *anchor` merges on purpose; explicit keys override it
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # unhashable: the base constructor reports it
                        continue
                    line = key_node.start_mark.line + 1
                    if first is None:
                        seen[key] = line
                    else:
                        duplicates.append(_Duplicate(key, line, first))
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


#: Deepest nesting read. PyYAML builds nested values recursively, so a deeply nested file would
#: exhaust the interpreter's stack (slowly); the event parser used to check is not recursive.
_MAX_DEPTH = 64


def _check_depth(text: str, name: str) -> None:
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > _MAX_DEPTH:
                line = event.start_mark.line + 1
                raise ConfigError(
                    name, [f"nested more than {_MAX_DEPTH} levels deep (line {line}); a config is a flat mapping of keys"]
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_yaml_mapping(path: str | Path, *, allow_empty: bool = False) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping of keys.

    Every problem is a :class:`ConfigError` naming the file: a directory, an unreadable or
    non-UTF-8 file, invalid YAML (with its line), a duplicate key (both lines: YAML would keep the
    last value silently), nesting too deep to parse, a top level that is not a mapping, an empty
    file (unless ``allow_empty``; write ``{}`` for "all defaults").

    Raises:
        FileNotFoundError: if nothing exists at ``path``.
        ConfigError: every other problem (see above).
    """
    data, duplicates = read_yaml_mapping(path, allow_empty=allow_empty)
    if duplicates:
        raise ConfigError(str(path), duplicates)
    return data


def read_yaml_mapping(path: str | Path, *, allow_empty: bool = False) -> tuple[dict[str, Any], list[str]]:
    """:func:`load_yaml_mapping`, but duplicate keys are returned rather than raised:
    ``(mapping with each duplicate's last value, one sentence per duplicate key)``, so that a
    caller validating the keys can report the duplicates together with every other problem of the
    file. A non-empty list must still end in a :class:`ConfigError`.

    Raises:
        FileNotFoundError: if nothing exists at ``path``.
        ConfigError: every other problem (with the duplicates, if the file has both).
    """
    import yaml

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path (str or pathlib.Path), got {type(path).__name__}")
    path = Path(path)
    name = str(path)
    try:
        exists = path.exists()
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system
        raise ConfigError(name, [f"is not a usable file path: {exc}"]) from None
    if not exists:
        raise FileNotFoundError(f"config file not found: {name!r}")
    if path.is_dir():
        raise ConfigError(name, ["is a directory, not a YAML file"])
    try:
        with path.open("rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(name, [f"cannot be read: {exc.strerror or exc}"]) from None
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(name, [f"is larger than {_MAX_FILE_BYTES} bytes; a config file is a small mapping of keys"])
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            name, [f"is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line})"]
        ) from None
    duplicates: list[_Duplicate] = []
    try:
        _check_depth(text, name)
        data = yaml.load(text, Loader=_strict_loader(duplicates))  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(name, [f"not valid YAML: {exc}"]) from None
    except RecursionError:
        raise ConfigError(name, ["nested too deeply to parse; a config is a flat mapping of keys"]) from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise ConfigError(name, [f"not a readable YAML value: {exc}"]) from None
    problems = [
        f"duplicate key {_short(d.key)} at line {d.line} (first at line {d.first_line}); YAML would "
        "silently keep only the last value, so write each key once"
        for d in duplicates
    ]
    if data is None:
        if allow_empty:
            return {}, problems
        raise ConfigError(
            name, problems + ["holds no keys (empty, or comments only); write `{}` to mean every default explicitly"]
        )
    if not isinstance(data, Mapping):
        raise ConfigError(name, problems + [f"top level must be a mapping of keys, got {type(data).__name__}"])
    return dict(data), problems


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened in the middle if long (a 400-digit number, a huge list)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return f"<int of about {value.bit_length() * 30103 // 100000} digits>"
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 4:]} ({len(text)} chars)"


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


#: A number written in plain decimal notation (``1e-4``, ``-2.5``, ``.5``): the strings PyYAML leaves
#: unconverted because YAML 1.1 wants a dot in a float. ``nan``, ``inf``, ``1_0`` stay strings.
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")

#: int keys must fit where they end up (tensor sizes, step counters).
_INT64 = (-(2**63), 2**63 - 1)


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
        if isinstance(value, int):
            try:
                return True, float(value)
            except OverflowError:  # a 400-digit integer: reported as not finite
                return True, (math.inf if value > 0 else -math.inf)
        if isinstance(value, float):
            return True, value
        if isinstance(value, str) and _DECIMAL.fullmatch(value):
            return True, float(value)
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
        ranges = type(self)._ranges()
        problems, bad_fields = [], set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ok, coerced = _coerce(value, hints[f.name])
            problem = None
            if not ok:
                extra = ""
                if get_origin(hints[f.name]) is Literal and isinstance(value, str):
                    extra = _closest(value, [a for a in get_args(hints[f.name]) if isinstance(a, str)])
                elif _is_numeric(hints[f.name]):
                    extra = self._allowed(f, hints[f.name], ranges.get(f.name))
                problem = f"{f.name}={_short(value)} is not {_describe(hints[f.name])}{extra}"
            elif isinstance(coerced, float) and not math.isfinite(coerced):
                problem = f"{f.name}={_short(value)} must be a finite number{self._allowed(f, None, ranges.get(f.name))}"
            elif isinstance(coerced, int) and not isinstance(coerced, bool) and not _INT64[0] <= coerced <= _INT64[1]:
                problem = f"{f.name}={_short(value)} must fit in a 64-bit integer{self._allowed(f, None, ranges.get(f.name))}"
            elif isinstance(coerced, (int, float)) and not isinstance(coerced, bool) and f.name in ranges:
                interval = ranges[f.name]
                if coerced not in interval:
                    null = ", or be null" if _allows_none(type(self), f.name) else ""
                    why = f" ({interval.reason})" if interval.reason else ""
                    problem = f"{f.name}={_short(coerced)} must {interval.phrase()}{null}{why}"
            if problem is not None:
                problems.append(problem)
                bad_fields.add(f.name)
            elif coerced is not value:
                object.__setattr__(self, f.name, coerced)
        return problems, bad_fields

    @staticmethod
    def _allowed(f: dataclasses.Field, tp: Any, interval: "Interval | None") -> str:
        """What a numeric key accepts, for a type error: its declared range, else its documentation."""
        if interval is not None:
            what = f"{_describe(tp)} that must " if tp is not None else "it must "
            return f" (allowed: {what}{interval.phrase()})"
        text = f.metadata.get("doc", "")
        return f" ({f.name}: {text})" if text else ""

    @classmethod
    def _ranges(cls) -> dict[str, Interval]:
        """``{field name: Interval}`` declared by the class (``_RANGES``) and its bases."""
        out: dict[str, Interval] = {}
        for klass in reversed(cls.__mro__):
            out.update(klass.__dict__.get("_RANGES", {}))
        return out

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
        return cls._from_mapping(data, source, ignore, [])

    @classmethod
    def _from_mapping(cls, data: Mapping[str, Any], source: str | None, ignore: tuple[str, ...], problems: list[str]):
        """:meth:`from_dict`, reporting ``problems`` (found while reading ``data``) with its own."""
        if not isinstance(data, Mapping):
            raise ConfigError(cls._label(source), [f"expected a mapping of keys, got {type(data).__name__}"])
        valid = cls.field_names()
        problems = list(problems) + [
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
        """Build from a YAML file whose top level holds this config's keys; a duplicate key is
        reported together with every other problem of the file."""
        data, duplicates = read_yaml_mapping(path)
        return cls._from_mapping(data, str(path), ignore, duplicates)

    @classmethod
    def from_namespace(cls, namespace: Any, *, source: str | None = None):
        """Build from an object carrying the keys as attributes (an argparse namespace on which a
        host framework set them). Attributes that are absent or ``None`` take the default; other
        attributes of the namespace are not this config's business and are not looked at."""
        _check_namespace(namespace)
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


def _is_numeric(tp: Any) -> bool:
    """Whether an annotation is ``int`` / ``float``, optionally ``| None``."""
    if get_origin(tp) in (Union, types.UnionType):
        return any(_is_numeric(a) for a in get_args(tp) if a is not type(None))
    return tp in (int, float)


def _check_namespace(namespace: Any) -> None:
    """``args`` must carry the keys as attributes. A dict (or a string, a number, None) carries
    none, so every key would silently take its default: refuse it, naming the type."""
    if isinstance(namespace, Mapping):
        raise TypeError(
            f"args must carry the config keys as attributes (an argparse.Namespace), got a {type(namespace).__name__} "
            "whose keys would all be ignored; pass argparse.Namespace(**mapping), or use from_dict(mapping)"
        )
    if namespace is None or isinstance(namespace, (str, bytes, int, float, list, tuple)):
        raise TypeError(
            f"args must carry the config keys as attributes (an argparse.Namespace), got {type(namespace).__name__}"
        )


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
