"""Optional dependencies, checked in one place: which extra provides each, and one typed error when absent.

``require("trl")`` imports and returns the module, or raises :class:`rr_client.core.errors.MissingDependencyError`
naming the ``rr-replay`` extra that installs it. Nothing here imports an optional package at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from rr_client.core.errors import MissingDependencyError

__all__ = ["EXTRAS", "require", "available"]

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
