"""The engine a test session can import: its version, or None, and deselecting the tests that need another."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

__all__ = ["imported_version", "deselect"]


def imported_version(module: str) -> str | None:
    """``module.__version__`` when ``module`` imports, else None (any import failure means "not available")."""
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - a broken install is as absent as a missing one
        return None


def deselect(config: pytest.Config, items: list[pytest.Item], drop: Callable[[pytest.Item], bool]) -> None:
    """Remove the items ``drop`` picks from the session as deselected (reported as such, never as skipped)."""
    dropped = [i for i in items if drop(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if not drop(i)]
