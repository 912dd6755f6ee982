"""The one registry pattern used across the package (losses, KL estimators, advantage
estimators, schedulers, surge detectors, ...).

A :class:`Registry` maps names to objects. Registering a name twice is an error, and a failed
look-up lists the valid names and suggests the nearest one.

    POLICY_LOSSES = Registry("policy loss")

    @POLICY_LOSSES.register("ppo_clip")
    def ppo_clip(...): ...

    POLICY_LOSSES.get("ppo-clip")
    # RegistryKeyError: unknown policy loss 'ppo-clip' (did you mean 'ppo_clip'?); valid: ...
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "RegistryKeyError", "suggest"]


class RegistryKeyError(KeyError):
    """A failed registry look-up; ``str()`` gives the plain message (no KeyError quoting)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def suggest(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Registry(Generic[T]):
    """A named mapping with loud failures.

    Args:
        kind: what is registered, used in error messages (``"policy loss"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; usable as a decorator when ``obj`` is omitted.

        Raises:
            ValueError: if ``name`` is already registered or is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def _add(item: T) -> T:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (to {self._entries[name]!r}); "
                    "registry names must be unique"
                )
            self._entries[name] = item
            return item

        if obj is None:
            return _add
        return _add(obj)

    def get(self, name: str) -> T:
        """Look ``name`` up.

        Raises:
            RegistryKeyError: (a ``KeyError``) naming the unknown key, the valid keys and the
                nearest match.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            valid = self.names()
            raise RegistryKeyError(
                f"unknown {self.kind} {name!r}{suggest(str(name), valid)}; valid: {', '.join(valid)}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
