"""One private event loop in a daemon thread, so synchronous trainer hooks can drive the async client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on a loop that lives as long as this object; its HTTP connections are reused across calls.

    A trainer may itself run inside an event loop (a notebook), where ``asyncio.run`` would fail: this loop
    is always a separate thread's.
    """

    def __init__(self, name: str = "rr-client-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and join its thread."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
