"""Resolving :class:`rr_client.RoutingRef` s: each ref's rows read from the store that holds them, many keys per
call, concurrency-limited, checksum-verified and checked exactly as an inline answer is.

HTTP refs go to ``POST <url>/rr/routing/read`` (one binary frame per call, grouped by server, each call under the
server's byte cap: a ref larger than it is read in row ranges and joined); ``ray://`` refs
to the Ray store actor they name (:mod:`rr_client.client._ray_refs`, ``rr-replay[ray]``); object-store refs
(``s3://``, ``file://``) straight from the objects, with the client's own credentials, under the prefixes it allows
(:mod:`rr_client.client._object_refs`). Given each ref's tokens, every
ref is bound to them (:func:`rr_client.core.reference.check_ref_tokens`) before any read, HTTP and Ray alike.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Union

import httpx
import numpy as np
import orjson

from rr_client.client._object_refs import ObjectReader
from rr_client.client.http_errors import error_for_status, map_httpx_error
from rr_client.core.codec import check_routing
from rr_client.core.errors import ProtocolError, RoutingChecksumError, RoutingExpiredError, ShapeMismatchError
from rr_client.core.indexer import check_indexer
from rr_client.core.info import RRInfo
from rr_client.core.objects import is_object_url
from rr_client.core.reference import (
    FRAME_MEDIA_TYPE,
    MAX_READ_BYTES,
    READ_PATH,
    FramePart,
    RoutingRef,
    check_ref_tokens,
    checksum,
    decode_frame,
)

__all__ = ["RefResolver", "READ_PATH", "RAY_SCHEME", "checked_part", "RefTokens", "bind_tokens", "plan_reads"]

RAY_SCHEME = "ray://"

RefTokens = Union[tuple[Sequence[int], Sequence[int]], Any, None]  # noqa: UP007 - a runtime alias with Any
"""One ref's tokens: ``(prompt_ids, output_ids)``, a sample with ``prompt_ids`` and ``output_ids`` (a
:class:`rr_client.GenerateResult`), or None (not bound)."""


def _ids(value: Any, what: str, where: str) -> Sequence[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ProtocolError(f"{where}: {what} must be a sequence of token ids, got {type(value).__name__}")
    return value


def bind_tokens(refs: Sequence[RoutingRef], tokens: Sequence[RefTokens]) -> None:
    """Hold every ref to its sample's tokens (``tokens[i]`` for ``refs[i]``): :class:`StaleRoutingError` naming
    the first ref whose provenance digest is another sample's."""
    if len(tokens) != len(refs):
        raise ProtocolError(f"{len(tokens)} token entries for {len(refs)} refs: give one per ref (None to skip)")
    for i, (ref, t) in enumerate(zip(refs, tokens)):
        if t is None:
            continue
        where = f"refs[{i}]"
        if isinstance(t, tuple):
            if len(t) != 2:
                raise ProtocolError(f"{where}: tokens must be (prompt_ids, output_ids), got {len(t)} items")
            prompt, output = t
        else:
            prompt, output = getattr(t, "prompt_ids", None), getattr(t, "output_ids", None)
            if prompt is None:  # a text prompt the server did not echo: nothing to bind to
                continue
        check_ref_tokens(ref, _ids(prompt, "prompt_ids", where), _ids(output, "output_ids", where), where=where)


def checked_part(ref: RoutingRef, part: FramePart, info: RRInfo) -> np.ndarray:
    """The rows a store gave for ``ref``, held to what the ref promised (key, shape, dtype, checksum), then
    through the one full check (:func:`rr_client.check_routing`) against ``info``, as an inline answer."""
    if part.key != ref.key:
        raise ProtocolError(f"routing ref {ref.key}: the store answered key {part.key!r}")
    if part.start != 0 or tuple(part.rows.shape) != ref.shape or part.rows.dtype.name != ref.dtype:
        raise ShapeMismatchError(
            f"routing ref {ref.key}: rows {tuple(part.rows.shape)} {part.rows.dtype.name}, "
            f"the ref says {ref.shape} {ref.dtype}"
        )
    if part.digest != ref.checksum:
        raise RoutingChecksumError(
            f"routing ref {ref.key}: the rows' checksum {part.digest} is not the ref's {ref.checksum}"
        )
    if ref.kind == "indexer":  # sparse-attention indexer picks: their own full check
        if info.indexer is None:
            raise ShapeMismatchError(f"routing ref {ref.key}: indexer rows, but the server's model has no indexer")
        return check_indexer(part.rows, info.indexer, rows=ref.rows, start=ref.start).array
    return check_routing(part.rows, info, rows=ref.rows, start=ref.start).array


#: one planned read call: (index of the ref in its server's list, start, stop); None, None: the whole ref
Call = list[tuple[int, int | None, int | None]]


def plan_reads(refs: Sequence[RoutingRef], batch: int, max_bytes: int) -> list[Call]:
    """One server's refs as read calls of at most ``batch`` refs and ``max_bytes`` of rows each (a key named twice
    in one call costs once, as the server counts it); a ref larger than ``max_bytes`` alone is read as row ranges
    of at most ``max_bytes``, one call each, so that no legitimate read meets the server's cap."""
    calls: list[Call] = []
    cur: Call = []
    cur_bytes = 0
    seen: set[tuple[str, str]] = set()
    for j, r in enumerate(refs):
        if r.nbytes > max_bytes:
            step = max(1, max_bytes // (r.nbytes // r.rows))  # rows per call (a row over the cap: one row)
            calls.extend([[(j, a, min(a + step, r.rows))] for a in range(0, r.rows, step)])
            continue
        cost = 0 if (r.store, r.key) in seen else r.nbytes
        if cur and (len(cur) >= batch or cur_bytes + cost > max_bytes):
            calls.append(cur)
            cur, cur_bytes, seen, cost = [], 0, set(), r.nbytes
        cur.append((j, None, None))
        cur_bytes += cost
        seen.add((r.store, r.key))
    return [*calls, cur] if cur else calls


class _OverCap(Exception):
    """A server answered 413 naming a byte cap lower than the one the reads were split by."""

    def __init__(self, max_bytes: int, error: Exception) -> None:
        super().__init__(str(error))
        self.max_bytes, self.error = max_bytes, error


class RefResolver:
    """Reads refs' rows: ``batch`` refs and at most ``max_bytes`` of rows per call (:func:`plan_reads`; a server
    whose cap is lower says so in its 413 and is split by that from then on), at most ``max_concurrency`` calls in
    flight (over all servers).

    ``http_for(url)``: the HTTP client for a server (the client's own pool where it is one of its replicas).
    """

    def __init__(
        self,
        http_for: Callable[[str], httpx.AsyncClient],
        *,
        max_concurrency: int = 8,
        batch: int = 64,
        max_bytes: int = MAX_READ_BYTES,
        objects: ObjectReader | None = None,
    ) -> None:
        self._http_for = http_for
        self._objects = objects  #: an ObjectReader (the client's allowed object stores), made on first use if None
        self._sem = asyncio.Semaphore(max_concurrency)
        self._batch = batch
        self._max_bytes = max_bytes
        self._cap: dict[str, int] = {}  #: per server URL, the byte cap its 413 named (below ``max_bytes``)
        self.bytes_read = 0  #: routing bytes received (frame data), for the benchmark and the curious

    async def resolve(
        self, refs: Sequence[RoutingRef], info: RRInfo, tokens: Sequence[RefTokens] | None = None
    ) -> list[np.ndarray]:
        """The checked rows of every ref, in order; with ``tokens`` (one per ref), each ref bound to its sample's
        tokens first (:func:`bind_tokens`)."""
        out: list[np.ndarray | None] = [None] * len(refs)
        by_url: dict[str, list[int]] = defaultdict(list)
        for i, ref in enumerate(refs):
            if not isinstance(ref, RoutingRef):
                raise ProtocolError(f"refs[{i}] is {type(ref).__name__}, not a RoutingRef")
            if not ref.url:
                raise ProtocolError(f"routing ref {ref.key} names no URL to read it from")
            by_url[ref.url].append(i)
        if tokens is not None:
            bind_tokens(refs, tokens)
        for url in by_url:  # every server's client first: a ref naming an untrusted host is refused before any read
            if is_object_url(url):  # s3://, file:// ... (never ray:// nor http(s)://)
                self._object_reader().allow(url)
            elif not url.startswith(RAY_SCHEME):
                self._http_for(url)
        tasks = []
        for url, idx in by_url.items():
            if is_object_url(url):
                for s in range(0, len(idx), self._batch):
                    part = idx[s : s + self._batch]
                    tasks.append(self._object_call(url, [refs[i] for i in part], part, out, info))
            elif url.startswith(RAY_SCHEME):
                for s in range(0, len(idx), self._batch):
                    tasks.append(
                        self._ray_call(
                            url, [refs[i] for i in idx[s : s + self._batch]], idx[s : s + self._batch], out, info
                        )
                    )
            else:
                tasks.append(self._http_server(url, [refs[i] for i in idx], idx, out, info))
        await asyncio.gather(*tasks)
        return [a for a in out if a is not None]

    def _object_reader(self) -> ObjectReader:
        """The client's object reader (a resolver made without one: ``RR_OBJECT_STORES``'s prefixes)."""
        if self._objects is None:
            self._objects = ObjectReader(None)
        return self._objects

    async def _object_call(
        self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None], info: RRInfo
    ) -> None:
        """One call's refs read from the objects under ``url`` (no server, no byte cap), each checked whole."""
        async with self._sem:
            parts = await asyncio.to_thread(self._object_reader().read_parts, url, refs)
        for i, ref, part in zip(idx, refs, parts):
            self.bytes_read += part.rows.nbytes
            out[i] = checked_part(ref, part, info)

    async def _ray_call(
        self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None], info: RRInfo
    ) -> None:
        """One call's refs read from the Ray store actor ``url`` names (no HTTP, no byte cap)."""
        from rr_client.client._ray_refs import read_parts

        async with self._sem:
            parts = await asyncio.to_thread(read_parts, url, refs)
        if len(parts) != len(refs):
            raise ProtocolError(f"{url}: {len(parts)} routing parts for {len(refs)} refs")
        for i, ref, part in zip(idx, refs, parts):
            self.bytes_read += part.rows.nbytes
            out[i] = checked_part(ref, part, info)

    async def _http_server(
        self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None], info: RRInfo
    ) -> None:
        """One server's refs, split under its byte cap; split again by a lower cap its 413 names (once per cap)."""
        while True:
            cap = self._cap.get(url, self._max_bytes)
            try:
                await self._http_planned(url, refs, idx, out, info, cap)
                return
            except _OverCap as e:
                if e.max_bytes >= cap:  # split under the cap and still refused: not a cap this client can meet
                    raise e.error from None
                self._cap[url] = e.max_bytes

    async def _http_planned(
        self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None], info: RRInfo, cap: int
    ) -> None:
        """``refs`` read in the calls :func:`plan_reads` makes under ``cap``; a ref read in row ranges is joined
        and held to its checksum as a whole."""
        calls = plan_reads(refs, self._batch, cap)
        answers = await asyncio.gather(*(self._http_parts(url, [(refs[j], a, b) for j, a, b in c]) for c in calls))
        pieces: dict[int, list[FramePart]] = defaultdict(list)
        for call, parts in zip(calls, answers):
            if len(parts) != len(call):
                raise ProtocolError(f"{url}: {len(parts)} routing parts for {len(call)} refs")
            for (j, a, _), part in zip(call, parts):
                self.bytes_read += part.rows.nbytes
                if a is None:
                    out[idx[j]] = checked_part(refs[j], part, info)
                else:
                    pieces[j].append(part)
        for j, got in pieces.items():
            out[idx[j]] = checked_part(refs[j], _joined(refs[j], got), info)

    async def _http_parts(self, url: str, asks: list[tuple[RoutingRef, int | None, int | None]]) -> list[FramePart]:
        """One ``POST /rr/routing/read`` of ``asks`` (a ref, and a row range of it or the whole)."""
        body = orjson.dumps(
            {
                "refs": [
                    {"store": r.store, "key": r.key}
                    if a is None
                    else {"store": r.store, "key": r.key, "start": a, "stop": b}
                    for r, a, b in asks
                ]
            }
        )
        what = f"POST {url}{READ_PATH}"
        async with self._sem:
            try:
                resp = await self._http_for(url).post(
                    url + READ_PATH, content=body, headers={"content-type": "application/json"}
                )
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
            cap = _named_cap(resp) if resp.status_code == 413 else None
            raise err if cap is None else _OverCap(cap, err)
        if resp.headers.get("content-type", "").split(";")[0] != FRAME_MEDIA_TYPE:
            raise ProtocolError(f"{what}: answered {resp.headers.get('content-type')!r}, not {FRAME_MEDIA_TYPE}")
        return decode_frame(resp.content)


def _named_cap(resp: httpx.Response) -> int | None:
    """The byte cap a read route's 413 names (``error.max_bytes``), if it names a positive one."""
    try:
        cap = orjson.loads(resp.content)["error"]["max_bytes"]
    except Exception:  # noqa: BLE001 - a 413 without it (too many refs, an older server) is raised as it is
        return None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def _joined(ref: RoutingRef, pieces: list[FramePart]) -> FramePart:
    """A ref read in row ranges, as one part: the ranges in order, covering its rows exactly once, the checksum
    taken over the joined rows (which :func:`checked_part` holds to the ref's)."""
    pieces = sorted(pieces, key=lambda p: p.start)
    starts = np.array([p.start for p in pieces])
    stops = np.array([p.stop for p in pieces])
    if pieces[0].key != ref.key or starts[0] != 0 or stops[-1] != ref.rows or (starts[1:] != stops[:-1]).any():
        raise ProtocolError(
            f"routing ref {ref.key}: the store's row ranges {list(zip(starts.tolist(), stops.tolist()))} "
            f"do not cover its {ref.rows} rows"
        )
    rows = np.concatenate([p.rows for p in pieces])
    return FramePart(ref.key, 0, ref.rows, rows, checksum(rows))
