"""Optional dependencies, checked in one place: which extra provides each, and one typed error when absent.

``require("trl")`` imports and returns the module, or raises :class:`rr_client.core.errors.MissingDependencyError`
naming the ``rr-replay`` extra that installs it. Nothing here imports an optional package at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from rr_client.core.errors import MissingDependencyError

__all__ = ["EXTRAS", "require", "available", "lazy_getattr"]

# importable name -> the rr-replay extra that installs it
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "transformers": "torch",
    "trl": "trl",
    "accelerate": "trl",
    "verl": "verl",
    "megatron.core": "megatron",
    "ray": "ray",
    "matplotlib": "plot",
}


def available(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, *, for_what: str = "") -> ModuleType:
    """Import ``name`` or raise MissingDependencyError saying which extra installs it and what needs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        extra = EXTRAS.get(name, name)
        need = f"{for_what} needs {name}" if for_what else f"{name} is not installed"
        raise MissingDependencyError(f"{need}: pip install 'rr-replay[{extra}]' ({e})") from e


def lazy_getattr(module: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for a layer's public names: ``table[name]`` (a module) is imported on first
    access and the value cached in ``module``, so importing the layer loads neither httpx nor torch."""

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        loaded = importlib.import_module(source)
        value = loaded if source == f"{module}.{name}" else getattr(loaded, name)  # a submodule, or a name in one
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
