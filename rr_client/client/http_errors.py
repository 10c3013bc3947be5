"""httpx failures and HTTP error answers as rr errors: one table, shared by the client and the sidecar.

Like httpx's own ``map_httpcore_exceptions``: the table is walked in order and the first matching
class wins, so a connect timeout counts as unreachable, not as a slow answer.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
import orjson

from rr_client.core.errors import (
    AuthenticationError,
    ConnectError,
    ConnectionLostError,
    RequestRejectedError,
    RequestTimeoutError,
    RRError,
    ServerError,
    TransportError,
)

__all__ = ["map_httpx_error", "error_for_status", "response_message"]

_TRANSPORT_MAP: tuple[tuple[type[httpx.HTTPError], type[TransportError], str], ...] = (
    (httpx.ConnectTimeout, ConnectError, "unreachable"),
    (httpx.ConnectError, ConnectError, "unreachable"),
    (httpx.TimeoutException, RequestTimeoutError, "timed out"),
    (httpx.HTTPError, ConnectionLostError, "connection lost"),
)


def _with_origin(exc: httpx.HTTPError, what: str) -> str:
    """``what`` (``GET /rr/info``) with the failed request's origin before its path (``GET http://h:8000/rr/info``),
    so the message says where; unchanged when the error carries no request."""
    try:
        origin = str(exc.request.url.copy_with(path="/", query=None, fragment=None)).rstrip("/")
    except RuntimeError:  # httpx raises it for an error made without a request
        return what
    method, _, path = what.rpartition(" ")
    return f"{method} {origin}{path}".lstrip() if path.startswith("/") else f"{what} ({origin})"


def map_httpx_error(exc: httpx.HTTPError, what: str, *, origin: bool = True) -> TransportError:
    """The rr :class:`TransportError` subclass for an httpx failure of ``what`` (e.g. ``POST /generate``), naming the
    server it went to (``origin=False``: the caller names it itself)."""
    for httpx_cls, rr_cls, words in _TRANSPORT_MAP:
        if isinstance(exc, httpx_cls):
            detail = f": {exc}" if str(exc) else ""
            where = _with_origin(exc, what) if origin else what
            return rr_cls(f"{where}: {words} ({type(exc).__name__}{detail})")
    raise TypeError(f"not an httpx error: {exc!r}")  # pragma: no cover - the last row matches every HTTPError


def response_message(resp: httpx.Response, limit: int = 500) -> str:
    """The server's own message from a JSON error body (vLLM, SGLang, FastAPI shapes), else the raw text."""
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        return resp.text[:limit] or f"HTTP {resp.status_code}"
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                v = body[key]
                return v if isinstance(v, str) else orjson.dumps(v).decode()
    return resp.text[:limit]


def error_for_status(resp: httpx.Response, what: str) -> RRError | None:
    """None for 1xx-3xx; else the typed error for the answer's status (401/403, other 4xx, 5xx)."""
    code = resp.status_code
    if code < 400:
        return None
    msg = f"{what}: HTTP {code}: {response_message(resp)}"
    if code in (401, 403):
        return AuthenticationError(f"{msg} (authentication failed: missing or wrong API key)", status_code=code)
    if code < 500:
        return RequestRejectedError(msg, status_code=code)
    return ServerError(msg, status_code=code)
