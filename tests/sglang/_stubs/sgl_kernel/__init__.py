"""CPU stand-in for ``sgl_kernel`` (CUDA-only, cannot load here): SGLang's modules import, any kernel call raises."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+rr.cpustub"


class _Missing:
    """Any kernel, op or constant: usable as a decorator target or annotation, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: sgl_kernel is a CPU stub in rr's SGLang tests")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")


def _module_getattr(modname: str) -> Any:
    """Module-level ``__getattr__`` for a stub (sub)module."""

    def getattr_(item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{modname}.{item}")

    return getattr_


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any ``sgl_kernel.*`` submodule on import."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__dict__["__getattr__"] = _module_getattr(spec.name)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())

__getattr__ = _module_getattr(__name__)
