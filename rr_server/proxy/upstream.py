"""HTTP calls to the upstream engine: bounded concurrency, timeouts, and every failure as a ProxyError."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson

from rr_server.proxy.errors import ProxyError
from rr_server.proxy.metrics import ProxyMetrics

__all__ = ["Upstream", "upstream_message"]


def upstream_message(resp: httpx.Response) -> str:
    """The upstream's own error message (vLLM/SGLang/FastAPI shapes), else its raw text."""
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        return resp.text[:300] or f"HTTP {resp.status_code}"
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return err["message"]
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return body[key]
    return resp.text[:300]


def _transport_error(url: str, e: httpx.HTTPError) -> ProxyError:
    """Map an httpx failure: refused -> 503, timeout -> 504, broken connection -> 502."""
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ProxyError(503, "upstream_unavailable", f"upstream {url} is unreachable: {type(e).__name__}: {e}")
    if isinstance(e, httpx.TimeoutException):
        return ProxyError(504, "upstream_timeout", f"upstream {url} timed out ({type(e).__name__})")
    return ProxyError(502, "upstream_disconnected", f"upstream {url} broke the connection: {type(e).__name__}: {e}")


class Upstream:
    """One pooled httpx client to the engine; at most ``max_concurrency`` calls in flight."""

    def __init__(self, base_url: str, *, timeout: float, max_concurrency: int, metrics: ProxyMetrics,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = base_url.rstrip("/")
        self._metrics = metrics
        self._sem = asyncio.Semaphore(max_concurrency)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            # idle pooled connections are dropped before the engine's own 5 s keep-alive closes them,
            # so a request is never written onto a connection the upstream is closing
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency,
                                keepalive_expiry=2.0),
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    def _check(self, resp: httpx.Response, path: str) -> None:
        """Upstream 4xx -> same 4xx (the request was wrong); 5xx -> 502."""
        if resp.status_code >= 500:
            raise ProxyError(502, "upstream_error",
                             f"upstream {path} answered HTTP {resp.status_code}: {upstream_message(resp)}")
        if resp.status_code >= 400:
            raise ProxyError(resp.status_code, "upstream_rejected",
                             f"upstream rejected the request ({path}, HTTP {resp.status_code}): {upstream_message(resp)}")

    async def call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """One JSON call; returns the decoded JSON body or raises ProxyError."""
        content = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        async with self._sem:
            t0 = time.perf_counter()
            try:
                resp = await self._http.request(method, path, content=content, headers=headers, **extra)
            except httpx.HTTPError as e:
                raise _transport_error(self.url, e) from None
            finally:
                self._metrics.upstream_latency.labels(path).observe(time.perf_counter() - t0)
        self._check(resp, path)
        try:
            return orjson.loads(resp.content)
        except orjson.JSONDecodeError as e:
            raise ProxyError(502, "upstream_protocol", f"upstream {path} answered non-JSON: {e}") from None

    @asynccontextmanager
    async def stream_lines(self, path: str, body: Any) -> AsyncIterator[AsyncIterator[str]]:
        """POST and iterate the answer's lines (SSE); transport failures while reading raise ProxyError."""
        async with self._sem:
            t0 = time.perf_counter()
            try:
                async with self._http.stream("POST", path, content=orjson.dumps(body),
                                             headers={"content-type": "application/json"}) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        self._check(resp, path)
                    yield self._lines(resp)
            except httpx.HTTPError as e:
                raise _transport_error(self.url, e) from None
            finally:
                self._metrics.upstream_latency.labels(path).observe(time.perf_counter() - t0)

    async def _lines(self, resp: httpx.Response) -> AsyncIterator[str]:
        """Lines of a streaming answer, with transport errors mapped."""
        try:
            async for line in resp.aiter_lines():
                yield line
        except httpx.HTTPError as e:
            raise _transport_error(self.url, e) from None

    async def healthy(self, timeout: float = 3.0) -> tuple[bool, str]:
        """Probe ``GET /health`` (outside the semaphore, so a busy upstream still reports)."""
        try:
            resp = await self._http.get("/health", timeout=timeout)
        except httpx.HTTPError as e:
            return False, _transport_error(self.url, e).message
        if resp.status_code != 200:
            return False, f"upstream /health answered HTTP {resp.status_code}: {upstream_message(resp)}"
        return True, "ok"
