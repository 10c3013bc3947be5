"""rr client: decode, validate and pad routed experts from SGLang/vLLM for R3 training.

The facade over rr_client's layers, built from each layer's ``__all__`` so a public name cannot go missing:

- :mod:`rr_client.core`: the codec and its one check, errors, :class:`RRInfo`, refs, provenance (no torch, no
  httpx; loaded now).
- :mod:`rr_client.client`: :class:`RoutedExpertsClient` and its results (httpx; loaded on first use).
- :mod:`rr_client.trainer`: layouts, replay and :class:`ReplaySession` (torch; loaded on first use).

Every public error class reports ``rr_client`` as its module (as httpx does), so tracebacks, reprs and pickles
name the import users write, not the file it lives in. Classes and functions with type hints keep their home
module: ``typing.get_type_hints`` and the API reference resolve a hint in the module named by ``__module__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rr_client.client import __all__ as _client_all
from rr_client.core import *  # noqa: F403 - the core is public whole
from rr_client.core import __all__ as _core_all
from rr_client.trainer import __all__ as _trainer_all

if TYPE_CHECKING:
    from rr_client.client import *  # noqa: F403
    from rr_client.trainer import *  # noqa: F403

# name -> layer that offers it; imported on first attribute access (httpx / torch stay unloaded until then)
_LAZY: dict[str, str] = {
    **dict.fromkeys(_client_all, "rr_client.client"),
    **dict.fromkeys(_trainer_all, "rr_client.trainer"),
}

__all__ = [*_core_all, *_client_all, *_trainer_all]


def _public(value: Any) -> Any:
    """Name ``rr_client`` as the module of a public error class (httpx's rule); everything else stays as it is."""
    if isinstance(value, type) and issubclass(value, BaseException):
        value.__module__ = "rr_client"
    return value


for _name in _core_all:
    if not _name.startswith("__"):
        _public(globals()[_name])


def __getattr__(name: str) -> Any:
    """Load the httpx- and torch-backed parts of the public API on first use."""
    layer = _LAZY.get(name)
    if layer is None:
        raise AttributeError(f"module 'rr_client' has no attribute {name!r}")
    value = _public(getattr(importlib.import_module(layer), name))
    globals()[name] = value
    return value
