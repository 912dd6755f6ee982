"""Old import paths kept for one release: a module-level ``__getattr__`` that warns and hands back
the object from its new home.

The old module keeps no copy of the moved names, so every access (``from old import name``,
``old.name``, a host's ``importlib`` look-up of a dotted flag value) goes through the warning and
returns the very object the new module holds. The new module is imported by name when first asked
for, so a shim adds no import edge (and no cycle) between the two.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]

#: The release after which the old paths go away.
REMOVED_IN = "0.3"


def moved_names(
    old_module: str, moved: Mapping[str, str], *, fallback: Callable[[str], Any] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old_module`` whose names in ``moved`` now live elsewhere.

    Args:
        old_module: the dotted name of the module keeping the shim (for the messages).
        moved: old attribute name -> new dotted path (``"package.module.name"``).
        fallback: the module's own ``__getattr__`` for names that did not move (lazy exports).

    Returns:
        The ``__getattr__`` to assign in the old module: each access emits a
        ``DeprecationWarning`` naming both paths and returns the new object; an unknown name
        raises ``AttributeError`` listing the names the module still serves.
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(
                f"module {old_module!r} has no attribute {name!r} (it only forwards the moved names "
                f"{', '.join(sorted(moved))})"
            )
        module, _, attr = target.rpartition(".")
        warnings.warn(
            f"{old_module}.{name} is deprecated and will be removed in megatron-mis {REMOVED_IN}; "
            f"use {target}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), attr)

    return __getattr__
