"""tests/trainer: ``@pytest.mark.transformers_since("X.Y")`` deselects (never skips) a test of what the installed
transformers lacks (scripts/test_transformers_lowest.sh runs this directory on the lowest supported release)."""

from __future__ import annotations

import pytest

from tests.support.versions import deselect


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``transformers_since`` tests the installed transformers is older than."""
    import transformers

    have = _release(transformers.__version__)

    def too_old(item: pytest.Item) -> bool:
        marker = item.get_closest_marker("transformers_since")
        return marker is not None and have < _release(marker.args[0])

    deselect(config, items, too_old)
