"""ThreadedServer: an ASGI app under uvicorn in a daemon thread on a free 127.0.0.1 port.

The one copy of this helper: ``ProtocolTestServer``, the FAKE upstreams and ``SidecarServer`` all
run through it, over real HTTP on loopback.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Self

import uvicorn

from rr_server.launch.process import free_port

__all__ = ["ThreadedServer"]


class ThreadedServer:
    """Serve ``app`` on ``self.url`` between ``__enter__`` and ``__exit__`` (or ``start()`` / ``stop()``).

    ``uvicorn_options`` go to :class:`uvicorn.Config` (defaults: ``log_level="warning"``, ``lifespan="off"``).
    """

    def __init__(
        self, app: Any, *, name: str = "test server", startup_timeout: float | None = None, **uvicorn_options: Any
    ) -> None:
        self.app = app
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # a loaded machine starts a thread late: the deadline is the suite's (RR_TEST_STARTUP_TIMEOUT), not a guess
        self._startup_timeout = startup_timeout or float(os.environ.get("RR_TEST_STARTUP_TIMEOUT", "420"))
        options: dict[str, Any] = {"log_level": "warning", "lifespan": "off", **uvicorn_options}
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, **options))
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{name}", daemon=True)

    def start(self) -> Self:
        """Start serving; raise if uvicorn is not listening within ``startup_timeout`` seconds."""
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"{self.name} on port {self.port} exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on port {self.port} did not start in {self._startup_timeout}s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and join its thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
