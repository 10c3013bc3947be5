"""Resolving :class:`rr_client.RoutingRef` s: each ref's rows read from the store that holds them, many keys per
call, concurrency-limited, checksum-verified and checked exactly as an inline answer is.

HTTP refs go to ``POST <url>/rr/routing/read`` (one binary frame per call, grouped by server); ``ray://`` refs
to the Ray store actor they name (:mod:`rr_client.stores.ray`, ``rr-replay[ray]``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence


import httpx
import numpy as np
import orjson

from rr_client.codec import check_routing
from rr_client.errors import ProtocolError, RoutingChecksumError, RoutingExpiredError, ShapeMismatchError
from rr_client.http_errors import error_for_status, map_httpx_error
from rr_client.info import RRInfo
from rr_client.reference import FRAME_MEDIA_TYPE, READ_PATH, FramePart, RoutingRef, decode_frame

__all__ = ["RefResolver", "READ_PATH", "RAY_SCHEME", "checked_part"]

RAY_SCHEME = "ray://"


def checked_part(ref: RoutingRef, part: FramePart, info: RRInfo) -> np.ndarray:
    """The rows a store gave for ``ref``, held to what the ref promised (key, shape, dtype, checksum), then
    through the one full check (:func:`rr_client.check_routing`) against ``info``, as an inline answer."""
    if part.key != ref.key:
        raise ProtocolError(f"routing ref {ref.key}: the store answered key {part.key!r}")
    if part.start != 0 or tuple(part.rows.shape) != ref.shape or part.rows.dtype.name != ref.dtype:
        raise ShapeMismatchError(f"routing ref {ref.key}: rows {tuple(part.rows.shape)} {part.rows.dtype.name}, "
                                 f"the ref says {ref.shape} {ref.dtype}")
    if part.digest != ref.checksum:
        raise RoutingChecksumError(f"routing ref {ref.key}: the rows' checksum {part.digest} is not the ref's "
                                   f"{ref.checksum}")
    return check_routing(part.rows, info, rows=ref.rows, start=ref.start).array


class RefResolver:
    """Reads refs' rows: ``batch`` refs per call, at most ``max_concurrency`` calls in flight (over all servers).

    ``http_for(url)``: the HTTP client for a server (the client's own pool where it is one of its replicas).
    """

    def __init__(self, http_for: Callable[[str], httpx.AsyncClient], *, max_concurrency: int = 8,
                 batch: int = 64) -> None:
        self._http_for = http_for
        self._sem = asyncio.Semaphore(max_concurrency)
        self._batch = batch
        self.bytes_read = 0  #: routing bytes received (frame data), for the benchmark and the curious

    async def resolve(self, refs: Sequence[RoutingRef], info: RRInfo) -> list[np.ndarray]:
        """The checked rows of every ref, in order."""
        out: list[np.ndarray | None] = [None] * len(refs)
        by_url: dict[str, list[int]] = defaultdict(list)
        for i, ref in enumerate(refs):
            if not isinstance(ref, RoutingRef):
                raise ProtocolError(f"refs[{i}] is {type(ref).__name__}, not a RoutingRef")
            if not ref.url:
                raise ProtocolError(f"routing ref {ref.key} names no URL to read it from")
            by_url[ref.url].append(i)
        for url in by_url:  # every server's client first: a ref naming an untrusted host is refused before any read
            if not url.startswith(RAY_SCHEME):
                self._http_for(url)
        tasks = []
        for url, idx in by_url.items():
            for s in range(0, len(idx), self._batch):
                tasks.append(self._one_call(url, [refs[i] for i in idx[s:s + self._batch]], idx[s:s + self._batch],
                                            out, info))
        await asyncio.gather(*tasks)
        return [a for a in out if a is not None]

    async def _one_call(self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None],
                        info: RRInfo) -> None:
        if url.startswith(RAY_SCHEME):
            from rr_client._ray_refs import read_parts

            async with self._sem:
                parts = await asyncio.to_thread(read_parts, url, refs)
        else:
            parts = await self._http_parts(url, refs)
        if len(parts) != len(refs):
            raise ProtocolError(f"{url}: {len(parts)} routing parts for {len(refs)} refs")
        for i, ref, part in zip(idx, refs, parts):
            self.bytes_read += part.rows.nbytes
            out[i] = checked_part(ref, part, info)

    async def _http_parts(self, url: str, refs: list[RoutingRef]) -> list[FramePart]:
        body = orjson.dumps({"refs": [{"store": r.store, "key": r.key} for r in refs]})
        what = f"POST {url}{READ_PATH}"
        async with self._sem:
            try:
                resp = await self._http_for(url).post(url + READ_PATH, content=body,
                                                      headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                raise map_httpx_error(e, what) from e
        if resp.status_code == 410:
            try:
                msg = orjson.loads(resp.content)["error"]["message"]
            except Exception:  # noqa: BLE001 - the status says enough
                msg = resp.text[:500]
            raise RoutingExpiredError(f"{what}: {msg}")
        err = error_for_status(resp, what)
        if err is not None:
            raise err
        if resp.headers.get("content-type", "").split(";")[0] != FRAME_MEDIA_TYPE:
            raise ProtocolError(f"{what}: answered {resp.headers.get('content-type')!r}, not {FRAME_MEDIA_TYPE}")
        return decode_frame(resp.content)


