"""Errors the sidecar turns into HTTP answers; each carries its status and a metrics ``kind``."""

from __future__ import annotations

from typing import Any

from rr_client.core.errors import (
    ConnectError,
    ConnectionLostError,
    RequestTimeoutError,
    TransportError,
)
from rr_server.serving.http import error_body

__all__ = ["ProxyError", "error_payload", "upstream_transport_error"]

# rr transport error (mapped from httpx in rr_client.client.http_errors) -> sidecar status and metrics kind
_UPSTREAM_STATUS: tuple[tuple[type[TransportError], int, str], ...] = (
    (ConnectError, 503, "upstream_unavailable"),
    (RequestTimeoutError, 504, "upstream_timeout"),
    (ConnectionLostError, 502, "upstream_disconnected"),
)


class ProxyError(Exception):
    """One failed request: HTTP ``status``, a short ``kind`` for metrics, and a message for the client."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def upstream_transport_error(url: str, err: TransportError) -> ProxyError:
    """Unreachable upstream -> 503, timeout -> 504, broken connection -> 502."""
    for cls, status, kind in _UPSTREAM_STATUS:
        if isinstance(err, cls):
            return ProxyError(status, kind, f"upstream {url}: {err}")
    return ProxyError(502, "upstream_disconnected", f"upstream {url}: {err}")


def error_payload(err: ProxyError) -> dict[str, Any]:
    """JSON body of an error answer (vLLM/SGLang shaped, plus the kind)."""
    return error_body(err.message, err.status, kind=err.kind)
