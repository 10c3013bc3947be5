"""The one patch kit: wrap a third-party function once, after checking it still has the shape rr wraps.

Every engine and trainer patch of rr goes through :func:`wrap_once`: one marker (``__rr_wrapped__``, holding the
original) makes installs re-entrant, a parameter-name check refuses code that moved
(:class:`rr_client.core.errors.UnsupportedVersionError`), and :func:`unwrap` restores the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from rr_client.core.errors import UnsupportedVersionError

__all__ = ["MARKER", "wrap_once", "is_wrapped", "unwrap", "parameters"]

MARKER = "__rr_wrapped__"


def parameters(fn: Any) -> list[str]:
    """Parameter names of ``fn`` with any decorator's ``functools.wraps`` layers removed."""
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


def is_wrapped(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is already rr's wrapper."""
    return getattr(getattr(owner, name, None), MARKER, None) is not None


def wrap_once(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]], *,
              params: Sequence[str] | Sequence[Sequence[str]] | None = None, what: str = "") -> bool:
    """Replace ``owner.name`` by ``wrapper(original)`` unless rr wrapped it already; True when it wrapped now.

    ``params``: the parameter names (or several accepted lists) the original must have; any other shape, or a
    missing attribute, is :class:`UnsupportedVersionError` naming ``what`` (e.g. ``"verl 0.9.1"``) and the shape
    found, and nothing is changed.
    """
    label = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}"
    original = getattr(owner, name, None)
    if original is None:
        raise UnsupportedVersionError(f"{label} is missing{' in ' + what if what else ''}: rr cannot patch it")
    if getattr(original, MARKER, None) is not None:
        return False
    if params is not None:
        shapes = [list(params)] if params and isinstance(params[0], str) else [list(p) for p in params]
        got = parameters(original)
        if got not in shapes:
            raise UnsupportedVersionError(
                f"{label}({', '.join(got)}) does not have the shape rr wraps ({' or '.join(map(str, shapes))})"
                f"{' in ' + what if what else ''}: refusing to patch it")
    wrapped = wrapper(original)
    setattr(wrapped, MARKER, original)
    setattr(owner, name, wrapped)
    return True


def unwrap(owner: Any, name: str) -> bool:
    """Put the original ``owner.name`` back if rr wrapped it; True when it did."""
    original = getattr(getattr(owner, name, None), MARKER, None)
    if original is None:
        return False
    setattr(owner, name, original)
    return True
