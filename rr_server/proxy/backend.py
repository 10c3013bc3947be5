"""The interface every sidecar backend (one per engine) implements for ``/generate``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from rr_server.serving.generate_protocol import NormalizedGenerate

__all__ = ["Backend"]


class Backend(Protocol):
    """Serves rr's ``/generate`` from one kind of upstream engine; every failure is a ``ProxyError``."""

    async def generate(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> Any:
        """The whole JSON reply (one object, or a list in prompt order with ``n`` per prompt)."""
        ...

    def stream(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> AsyncIterator[str]:
        """SSE lines, ending with ``data: [DONE]``."""
        ...
