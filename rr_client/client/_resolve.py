"""Resolving :class:`rr_client.RoutingRef` s: each ref's rows read from the store that holds them, many keys per
call, concurrency-limited, checksum-verified and checked exactly as an inline answer is.

HTTP refs go to ``POST <url>/rr/routing/read`` (one binary frame per call, grouped by server); ``ray://`` refs
to the Ray store actor they name (:mod:`rr_client.stores.ray`, ``rr-replay[ray]``). Given each ref's tokens, every
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

from rr_client.client.http_errors import error_for_status, map_httpx_error
from rr_client.core.codec import check_routing
from rr_client.core.errors import ProtocolError, RoutingChecksumError, RoutingExpiredError, ShapeMismatchError
from rr_client.core.info import RRInfo
from rr_client.core.reference import FRAME_MEDIA_TYPE, READ_PATH, FramePart, RoutingRef, check_ref_tokens, decode_frame

__all__ = ["RefResolver", "READ_PATH", "RAY_SCHEME", "checked_part", "RefTokens", "bind_tokens"]

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
    return check_routing(part.rows, info, rows=ref.rows, start=ref.start).array


class RefResolver:
    """Reads refs' rows: ``batch`` refs per call, at most ``max_concurrency`` calls in flight (over all servers).

    ``http_for(url)``: the HTTP client for a server (the client's own pool where it is one of its replicas).
    """

    def __init__(
        self, http_for: Callable[[str], httpx.AsyncClient], *, max_concurrency: int = 8, batch: int = 64
    ) -> None:
        self._http_for = http_for
        self._sem = asyncio.Semaphore(max_concurrency)
        self._batch = batch
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
            if not url.startswith(RAY_SCHEME):
                self._http_for(url)
        tasks = []
        for url, idx in by_url.items():
            for s in range(0, len(idx), self._batch):
                tasks.append(
                    self._one_call(
                        url, [refs[i] for i in idx[s : s + self._batch]], idx[s : s + self._batch], out, info
                    )
                )
        await asyncio.gather(*tasks)
        return [a for a in out if a is not None]

    async def _one_call(
        self, url: str, refs: list[RoutingRef], idx: list[int], out: list[np.ndarray | None], info: RRInfo
    ) -> None:
        if url.startswith(RAY_SCHEME):
            from rr_client.client._ray_refs import read_parts

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
            raise err
        if resp.headers.get("content-type", "").split(";")[0] != FRAME_MEDIA_TYPE:
            raise ProtocolError(f"{what}: answered {resp.headers.get('content-type')!r}, not {FRAME_MEDIA_TYPE}")
        return decode_frame(resp.content)
