"""ReplicaServer: the TEST-ONLY ProtocolTestServer plus ``/health`` and ``/rr/generate``, restartable on its port.

Not an engine: it lets the multi-replica client tests take replicas down (5xx, a stopped server) and
bring them back on the same URL, over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.protocol_server import ProtocolTestServer

__all__ = ["ReplicaServer"]


class ReplicaServer(ProtocolTestServer):
    """``/generate`` as ProtocolTestServer, the same handler at ``/rr/generate``, ``/health`` 503 while failing."""

    def __init__(self, *, port: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.health_calls = 0
        self.alias_calls = 0
        if port is not None:  # a restart: the same URL as the replica it replaces
            self._rebind(port)

    def _rebind(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-replica-{port}", daemon=True)

    def _build_app(self) -> FastAPI:
        app = super()._build_app()
        generate = next(r.endpoint for r in app.routes if getattr(r, "path", None) == "/generate")

        @app.get("/health")
        async def health() -> JSONResponse:
            self.health_calls += 1
            ok = self.behaviour.fail_5xx == 0
            return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

        @app.post("/rr/generate")
        async def rr_generate(request: Request) -> JSONResponse:
            self.alias_calls += 1
            return await generate(request)  # type: ignore[no-any-return]

        return app

    def crash(self) -> None:
        """Stop now without waiting for open requests: their connections break (a dead replica)."""
        self._server.force_exit = True
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=15)
