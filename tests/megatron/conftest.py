"""Megatron-core tests (``.venv`` has megatron-core 0.16.1 from ``rr-replay[megatron]``, scripts/setup.sh).

Without megatron-core installed every test here is deselected, not skipped. ``megatron_process`` is the one-rank
gloo group and ``parallel_state`` (TP = PP = CP = 1) the one-process tests share, torn down (patches undone) after
the package; two-rank tests spawn their own ranks (tests/megatron/launcher.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.versions import deselect


def _installed() -> str | None:
    """megatron-core's installed version, read without importing it (the import takes 10-60 s)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


HAVE = _installed()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless megatron-core is installed."""
    here = str(Path(__file__).parent)
    if HAVE is None:
        deselect(config, items, lambda item: str(item.fspath).startswith(here))


@pytest.fixture(scope="package")
def megatron_process() -> Iterator[None]:
    """One-rank gloo group and Megatron's parallel_state, with the CPU test-side patches (tests/megatron/harness.py);
    all undone after this package's last test, so the rest of a session sees torch and no process group."""
    from tests.megatron import harness

    harness.init_parallel()
    yield
    harness.close_parallel()
