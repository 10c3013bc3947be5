"""The one patch kit: check that third-party code still has the shape rr relies on, then wrap it once.

Every engine and trainer patch of rr goes through here. :func:`check_shapes` refuses code that moved (a method
renamed, its parameters changed, a field dropped, sync turned async) with one
:class:`rr_client.core.errors.UnsupportedVersionError` naming each object, what rr expects and what it found;
verl, SGLang, vLLM and TRL call it before they subclass or wrap anything. :func:`wrap_once` checks with it, then
replaces a function through one marker (``__rr_wrapped__``, holding the original) that makes installs re-entrant;
:func:`unwrap` restores the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rr_client.core.errors import UnsupportedVersionError

__all__ = ["MARKER", "Shape", "check_shapes", "wrap_once", "is_wrapped", "unwrap", "parameters"]

MARKER = "__rr_wrapped__"

#: parameter names a function must have, in order; ``...`` stands for any run of names (``["args", ...]``: ``args``
#: first, then anything). A list of such lists accepts any one of them; None: any parameters.
Params = Sequence[Any] | Sequence[Sequence[Any]] | None


def parameters(fn: Any) -> list[str]:
    """Parameter names of ``fn`` with any decorator's ``functools.wraps`` layers removed."""
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


@dataclass(frozen=True)
class Shape:
    """What rr relies on in one third-party class or module: its ``methods`` (name -> :data:`Params`; each must
    exist and be callable), the ``fields`` it declares (dataclass, msgspec struct or NamedTuple), and which
    methods are coroutine functions (``coroutines``: name -> expected)."""

    owner: Any
    methods: Mapping[str, Params] = field(default_factory=dict)
    fields: Sequence[str] = ()
    coroutines: Mapping[str, bool] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The owner as messages name it (its qualified name)."""
        o = self.owner
        return str(getattr(o, "__qualname__", getattr(o, "__name__", o)))

    def problems(self) -> list[str]:
        """Each way the owner differs from this shape, in words (empty: it matches)."""
        found: list[str] = []
        for name, params in self.methods.items():
            fn = getattr(self.owner, name, None)
            if fn is None:
                found.append(f"{self.label}.{name} is missing")
            elif not callable(fn):
                found.append(f"{self.label}.{name} is a {type(fn).__name__}, not a function")
            elif params is not None:
                found.extend(_param_problem(f"{self.label}.{name}", fn, params))
        declared = _declared_fields(self.owner)
        found += [f"{self.label} has no field {f!r}" for f in self.fields if f not in declared]
        for name, is_async in self.coroutines.items():
            fn = getattr(self.owner, name, None)
            if fn is None and name not in self.methods:  # else named missing above
                found.append(f"{self.label}.{name} is missing")
            elif fn is not None and inspect.iscoroutinefunction(inspect.unwrap(fn)) != is_async:
                found.append(
                    f"{self.label}.{name} is {'not ' if is_async else ''}async def "
                    f"(rr expects {'async def' if is_async else 'def'})"
                )
        return found


def _declared_fields(owner: Any) -> set[str]:
    """Field names a class declares: dataclass, msgspec ``Struct`` or NamedTuple (empty for anything else)."""
    for attr in ("__dataclass_fields__", "__struct_fields__", "_fields"):
        names = getattr(owner, attr, None)
        if names:
            return set(names)
    return set()


def _matches(got: Sequence[str], want: Sequence[Any]) -> bool:
    """Whether the names ``got`` fit ``want`` (``...`` in ``want`` matches any run of names)."""
    if not want:
        return not got
    head, rest = want[0], want[1:]
    if head is ...:
        return any(_matches(got[i:], rest) for i in range(len(got) + 1))
    return bool(got) and got[0] == head and _matches(got[1:], rest)


def _shapes(params: Sequence[Any] | Sequence[Sequence[Any]]) -> list[list[Any]]:
    """``params`` as a list of accepted name lists."""
    if params and all(isinstance(p, (list, tuple)) for p in params):
        return [list(p) for p in params]
    return [list(params)]


def _param_problem(label: str, fn: Any, params: Sequence[Any] | Sequence[Sequence[Any]]) -> list[str]:
    """``[why]`` when ``fn``'s parameter names fit none of ``params``, else ``[]``."""
    try:
        got = parameters(fn)
    except (TypeError, ValueError) as e:  # a builtin without a signature
        return [f"{label} has no readable signature ({e})"]
    shapes = _shapes(params)
    if any(_matches(got, want) for want in shapes):
        return []
    want = " or ".join(f"({', '.join('...' if p is ... else str(p) for p in s)})" for s in shapes)
    return [f"{label}({', '.join(got)}) does not have the shape rr relies on {want}"]


def check_shapes(*shapes: Shape, what: str = "", error: Callable[[str], Exception] = UnsupportedVersionError) -> None:
    """Raise ``error`` (default :class:`UnsupportedVersionError`) naming every difference unless each of ``shapes``
    matches; ``what`` names the package and its installed version (``"verl 0.9.1"``) in the message."""
    problems = [p for shape in shapes for p in shape.problems()]
    if problems:
        raise error(f"{'; '.join(problems)}{' in ' + what if what else ''}: refusing to patch or subclass it")


def is_wrapped(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is already rr's wrapper."""
    return getattr(getattr(owner, name, None), MARKER, None) is not None


def wrap_once(
    owner: Any,
    name: str,
    wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    params: Params = None,
    what: str = "",
    error: Callable[[str], Exception] = UnsupportedVersionError,
) -> bool:
    """Replace ``owner.name`` by ``wrapper(original)`` unless rr wrapped it already; True when it wrapped now.

    ``owner.name`` must exist and fit ``params`` (:data:`Params`): else :func:`check_shapes` raises ``error``
    naming ``what`` (e.g. ``"verl 0.9.1"``) and the shape found, and nothing is changed.
    """
    if is_wrapped(owner, name):
        return False
    check_shapes(Shape(owner, {name: params}), what=what, error=error)
    original = getattr(owner, name)
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
