"""Errors the sidecar turns into HTTP answers; each carries its status and a metrics ``kind``."""

from __future__ import annotations

from typing import Any

from rr_server.protocol import error_body

__all__ = ["ProxyError", "error_payload"]


class ProxyError(Exception):
    """One failed request: HTTP ``status``, a short ``kind`` for metrics, and a message for the client."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def error_payload(err: ProxyError) -> dict[str, Any]:
    """JSON body of an error answer (vLLM/SGLang shaped, plus the kind)."""
    body = error_body(err.message, err.status)
    body["error"]["kind"] = err.kind
    return body
