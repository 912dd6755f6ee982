"""What the engine does differently under ``torch.compile`` (pure torch; no Megatron).

Inductor's CPU code is slow for a few patterns the eager engine relies on: it stores and converts
``bool`` tensors and evaluates ``isnan`` element by element inside each vector step, and it
writes a broadcast through an index with an integer division per element. Measured with torch
2.13 on a 2-core CPU, 543k tokens: the compiled token stage took 10.6 ms against 5.9 ms eager
before these changes and 2.8 ms after (weights only). So:

- :func:`is_compiling` lets an elementwise helper pick a form inductor vectorises (a comparison
  instead of ``nan_to_num``; ``bool -> float`` by ``to`` instead of through a ``uint8`` view);
- :func:`index_by_identity` finds a tensor in a list by ``is``: dynamo (torch 2.11, seen on an
  H100) cannot take ``id()`` of an intermediate tensor, so an ``id``-keyed dict breaks
  ``fullgraph=True`` where this does not;
- :func:`opaque_op` registers an eager kernel as a ``torch.library`` custom op, which a compiled
  graph calls as one extern kernel (no graph break, so ``fullgraph=True`` still holds). Without
  ``torch.library.custom_op`` (torch < 2.4) the function is traced inline instead: the same
  values, the slower code.

Both forms compute the same values; ``tests/unit/test_engine_contract.py`` compares the compiled
stages with the eager ones, non-finite inputs included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["index_by_identity", "is_compiling", "opaque_op"]


_CHECK = getattr(getattr(torch, "compiler", None), "is_compiling", None)
if _CHECK is None:  # torch < 2.3 has it under torch._dynamo only
    import torch._dynamo

    _CHECK = torch._dynamo.is_compiling


def is_compiling() -> bool:
    """True while dynamo traces the caller (``torch.compiler.is_compiling``)."""
    return _CHECK()


def index_by_identity(items: list[Any], value: Any) -> int | None:
    """The position of ``value`` itself (``is``, not ``==``) in ``items``, or ``None``."""
    return next((i for i, item in enumerate(items) if item is value), None)


def opaque_op(name: str, fake: Callable[..., torch.Tensor]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as the custom op ``megatron_mis::<name>`` (no mutated
    arguments) with ``fake`` as its shape function, and return the op; or return ``fn``
    itself where torch has no ``torch.library.custom_op``. The op must return a fresh tensor
    whose strides ``fake`` reproduces (contiguous, here)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        custom_op = getattr(torch.library, "custom_op", None)
        if custom_op is None:
            return fn
        op = custom_op(f"megatron_mis::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        return op

    return register
