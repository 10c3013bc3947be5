"""HTTP calls to the upstream engine: bounded concurrency, timeouts, and every failure as a ProxyError."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import orjson

from rr_client.client.http_errors import map_httpx_error, response_message
from rr_server.proxy.errors import ProxyError, upstream_transport_error
from rr_server.proxy.metrics import ProxyMetrics

__all__ = ["Upstream"]


class Upstream:
    """One pooled httpx client to the engine; at most ``max_concurrency`` calls in flight."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        max_concurrency: int,
        metrics: ProxyMetrics,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = base_url.rstrip("/")
        self._metrics = metrics
        self._sem = asyncio.Semaphore(max_concurrency)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            # idle pooled connections are dropped before the engine's own 5 s keep-alive closes them,
            # so a request is never written onto a connection the upstream is closing
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency, keepalive_expiry=2.0
            ),
            transport=transport,
            headers={"authorization": f"Bearer {api_key}"} if api_key else None,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    def _check(self, resp: httpx.Response, path: str) -> None:
        """Upstream 401/403 -> 502 (the sidecar's own key is wrong); other 4xx -> same 4xx; 5xx -> 502."""
        code = resp.status_code
        if code >= 500:
            raise ProxyError(
                502, "upstream_error", f"upstream {path} answered HTTP {code}: {response_message(resp, 300)}"
            )
        if code in (401, 403):
            raise ProxyError(
                502,
                "upstream_auth",
                f"upstream authentication failed ({path}, HTTP {code}): the sidecar's upstream API key "
                f"(--upstream-api-key / RR_UPSTREAM_API_KEY) is missing or wrong: {response_message(resp, 300)}",
            )
        if code >= 400:
            raise ProxyError(
                code,
                "upstream_rejected",
                f"upstream rejected the request ({path}, HTTP {code}): {response_message(resp, 300)}",
            )

    @contextmanager
    def _mapped(self, path: str) -> Iterator[None]:
        """httpx transport failures inside the block -> the sidecar's ProxyError (httpx's ``map_httpcore_exceptions``)."""
        try:
            yield
        except httpx.HTTPError as e:
            raise upstream_transport_error(self.url, map_httpx_error(e, path, origin=False)) from None

    @asynccontextmanager
    async def _exchange(self, path: str) -> AsyncIterator[None]:
        """One upstream exchange: a concurrency slot, its latency in the metrics, transport failures mapped."""
        async with self._sem:
            t0 = time.perf_counter()
            try:
                with self._mapped(path):
                    yield
            finally:
                self._metrics.upstream_latency.labels(path).observe(time.perf_counter() - t0)

    async def call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """One JSON call; returns the decoded JSON body or raises ProxyError."""
        content = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        async with self._exchange(path):
            resp = await self._http.request(method, path, content=content, headers=headers, **extra)
        self._check(resp, path)
        try:
            return orjson.loads(resp.content)
        except orjson.JSONDecodeError as e:
            raise ProxyError(502, "upstream_protocol", f"upstream {path} answered non-JSON: {e}") from None

    async def forward(self, path: str, content: bytes) -> httpx.Response:
        """POST bytes as they came and return the engine's answer whatever its status (pass-through)."""
        async with self._exchange(path):
            return await self._http.post(path, content=content, headers={"content-type": "application/json"})

    @asynccontextmanager
    async def forward_stream(self, path: str, content: bytes) -> AsyncIterator[httpx.Response]:
        """POST bytes and hand back the open streaming answer, whatever its status (pass-through)."""
        async with (
            self._exchange(path),
            self._http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as resp,
        ):
            yield resp

    @asynccontextmanager
    async def stream_lines(self, path: str, body: Any) -> AsyncIterator[AsyncIterator[str]]:
        """POST and iterate the answer's lines (SSE); transport failures while reading raise ProxyError."""
        async with (
            self._exchange(path),
            self._http.stream(
                "POST", path, content=orjson.dumps(body), headers={"content-type": "application/json"}
            ) as resp,
        ):
            if resp.status_code >= 400:
                await resp.aread()
                self._check(resp, path)
            yield self._lines(resp, path)

    async def _lines(self, resp: httpx.Response, path: str) -> AsyncIterator[str]:
        """Lines of a streaming answer, with transport errors mapped."""
        with self._mapped(path):
            async for line in resp.aiter_lines():
                yield line

    async def healthy(self, timeout: float = 3.0) -> tuple[bool, str]:
        """Probe ``GET /health`` (outside the semaphore, so a busy upstream still reports)."""
        try:
            with self._mapped("GET /health"):
                resp = await self._http.get("/health", timeout=timeout)
        except ProxyError as e:
            return False, e.message
        if resp.status_code != 200:
            return False, f"upstream /health answered HTTP {resp.status_code}: {response_message(resp, 300)}"
        return True, "ok"
