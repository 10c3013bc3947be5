"""Loading a script of the repository (an example, a benchmark) as a module, the way its tests call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path, name: str) -> ModuleType:
    """``path`` run as module ``name`` (registered in ``sys.modules`` first: dataclasses look their module up while
    it runs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
