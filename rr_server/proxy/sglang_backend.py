"""SGLang upstream: forward ``/generate`` with routing always on, transcode int32 -> rr, strip unasked routing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import orjson

from rr_client.core.codec import expected_rows
from rr_client.core.indexer import INDEXER_FIELD
from rr_client.core.info import RRInfo
from rr_server.proxy.errors import ProxyError
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.proxy.provenance import attach, sglang_provenance
from rr_server.proxy.routing import ROUTING_KEYS, off_loop_if_store_blocks, upstream_routing_fields
from rr_server.proxy.upstream import Upstream
from rr_server.serving.generate_protocol import (
    SSE_DONE,
    GenerateRequest,
    NormalizedGenerate,
    SamplingParamsIn,
    sse_line,
)
from rr_server.serving.http import error_body
from rr_server.serving.indexer_fields import indexer_fields
from rr_server.serving.store import refs_made_under
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["SGLangBackend", "validation_view", "upstream_body"]

# rr's request fields the sidecar serves itself; the upstream never sees them
_START_KEYS = ("routed_experts_start", "routed_experts_start_len", "routed_experts_format", "indexer_topk_format")


def validation_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a SGLang body rr's parser understands; other SGLang fields pass through unvalidated."""
    view = {k: v for k, v in body.items() if k in GenerateRequest.model_fields}
    known = SamplingParamsIn.model_fields
    sp = view.get("sampling_params")
    if isinstance(sp, Mapping):
        view["sampling_params"] = {k: v for k, v in sp.items() if k in known}
    elif isinstance(sp, list):
        view["sampling_params"] = [
            {k: v for k, v in s.items() if k in known} if isinstance(s, Mapping) else s for s in sp
        ]
    return view


def upstream_body(body: Mapping[str, Any], *, force_routing: bool = True) -> dict[str, Any]:
    """Routing forced on for every request (SGLang's mixed-batch and router bugs); start handled here.

    ``force_routing=False`` passes the caller's flag through: only ``rr-server doctor --engine sglang`` does
    that, to expose what the bare engine does to callers that talk to it directly.
    """
    out = {k: v for k, v in body.items() if k not in _START_KEYS}
    out["return_routed_experts"] = True if force_routing else bool(body.get("return_routed_experts"))
    return out


class SGLangBackend:
    """Serves ``/generate`` from an unpatched SGLang server started with ``--enable-return-routed-experts``."""

    def __init__(
        self,
        up: Upstream,
        info: Callable[[], Awaitable[tuple[RRInfo, str]]],
        metrics: ProxyMetrics,
        *,
        force_routing: bool = True,
        epoch: WeightEpoch | None = None,
    ) -> None:
        self._up, self._info, self._metrics = up, info, metrics
        self._force = force_routing
        self._epoch = epoch or WeightEpoch()  # the sidecar's count of the weight routes it forwards

    def _prompt_ids(self, req: NormalizedGenerate, j: int, index: int | None) -> list[int] | None:
        """Token ids of the prompt behind reply item ``j`` (or the stream ``index``), when sent as ids."""
        counts = [s.n for s in req.sampling]
        p = (
            index
            if index is not None
            else next((k for k in range(len(counts)) if sum(counts[: k + 1]) > j), len(counts) - 1)
        )
        prompt = req.prompts[min(p, len(req.prompts) - 1)]
        return prompt if isinstance(prompt, list) else None

    def transcode(
        self,
        item: Any,
        req: NormalizedGenerate,
        info: RRInfo,
        j: int,
        *,
        final: bool = True,
        index: int | None = None,
        mark: WeightMark | None = None,
        indexer: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One SGLang reply item in rr form: routing validated + re-encoded, or removed when not asked; a final
        item gets its ``rr_provenance`` (``mark``: the sidecar's weight epoch when the request was sent) and its
        indexer fields (``indexer``: already checked off the event loop by :meth:`indexer_of`, else checked here)."""
        if not isinstance(item, Mapping) or not isinstance(item.get("meta_info"), Mapping):
            raise ProxyError(502, "upstream_protocol", f"upstream /generate item {j} has no meta_info object")
        out = dict(item)
        meta = dict(item["meta_info"])
        upstream_meta = dict(meta)
        for k in ROUTING_KEYS:
            meta.pop(k, None)
        meta.pop(INDEXER_FIELD, None)  # SGLang's raw int32: rr's checked rows replace it below, or nothing does
        out["meta_info"] = meta
        prov = (
            sglang_provenance(upstream_meta, self._epoch, mark, self._prompt_ids(req, j, index), item.get("output_ids"))
            if final
            else None
        )
        if req.return_indexer_topk and final:
            meta.update(indexer if indexer is not None else self.indexer_of(item, req, info, mark=mark) or {})
        if prov is not None:
            attach(meta, prov)  # the indexer ref made just now carries it too
        if not (req.return_routed_experts and final):
            return out
        pt, ct = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if not isinstance(pt, int) or not isinstance(ct, int):
            raise ProxyError(502, "upstream_protocol", f"upstream item {j}: prompt_tokens/completion_tokens missing")
        start = req.routed_experts_start
        ids = self._prompt_ids(req, j, index)
        if ids is not None and len(ids) != pt:
            raise ProxyError(
                502,
                "upstream_protocol",
                f"upstream item {j}: prompt_tokens={pt} but the prompt has {len(ids)} token ids",
            )
        with refs_made_under(mark.version if mark is not None else None):  # a ref: the weights it ran on
            meta.update(
                upstream_routing_fields(
                    upstream_meta,
                    info,
                    rows=expected_rows(pt, ct, start),
                    start=start,
                    drop_rows=start,
                    where=f"item {j}",
                    hint="was the upstream started with --enable-return-routed-experts?",
                    fmt=req.routed_experts_format,
                    metrics=self._metrics,
                )
            )
        if prov is not None:
            attach(meta, prov)  # the ref made just now carries it too
        if ids is not None:
            meta["prompt_token_ids"] = ids
        return out

    def indexer_of(
        self, item: Any, req: NormalizedGenerate, info: RRInfo, *, mark: WeightMark | None = None
    ) -> dict[str, Any] | None:
        """rr's indexer fields of one final reply item (None when it has no ``meta_info``): SGLang's rows checked by
        the one full check, by reference or inline. The heavy part of an answer: the async paths run it in a
        worker thread (:meth:`indexer_off_loop`)."""
        meta = item.get("meta_info") if isinstance(item, Mapping) else None
        if not isinstance(meta, Mapping):
            return None
        with refs_made_under(mark.version if mark is not None else None):  # a ref: the weights it ran on
            return indexer_fields(
                info,
                meta.get(INDEXER_FIELD),
                prompt_tokens=int(meta.get("prompt_tokens", 0)),
                completion_tokens=int(meta.get("completion_tokens", 0)),
                start=req.routed_experts_start,
                fmt=req.indexer_topk_format,
            )

    async def indexer_off_loop(
        self, items: list[Any], req: NormalizedGenerate, info: RRInfo, mark: WeightMark | None
    ) -> list[dict[str, Any] | None]:
        """:meth:`indexer_of` of final items, in a worker thread: the sidecar's event loop streams every request."""
        if not req.return_indexer_topk:
            return [None] * len(items)
        return await asyncio.to_thread(lambda: [self.indexer_of(it, req, info, mark=mark) for it in items])

    async def generate(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> Any:
        """Non-streaming: one upstream call, every item transcoded; same shape (dict or list) as SGLang's."""
        info, _ = await self._info()
        mark = self._epoch.mark()
        reply = await self._up.call("POST", "/generate", upstream_body(body, force_routing=self._force))
        if isinstance(reply, list):
            want = sum(s.n for s in req.sampling)
            if len(reply) != want:
                raise ProxyError(
                    502, "upstream_protocol", f"upstream /generate returned {len(reply)} items, expected {want}"
                )
            idx = await self.indexer_off_loop(reply, req, info, mark)
            return await off_loop_if_store_blocks(
                lambda: [self.transcode(it, req, info, j, mark=mark, indexer=idx[j]) for j, it in enumerate(reply)]
            )
        (idx0,) = await self.indexer_off_loop([reply], req, info, mark)
        return await off_loop_if_store_blocks(lambda: self.transcode(reply, req, info, 0, mark=mark, indexer=idx0))

    async def stream(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> AsyncIterator[str]:
        """Streaming: pass chunks through; routing (final chunk only) transcoded or stripped; errors as events."""
        info, _ = await self._info()
        mark = self._epoch.mark()
        async with self._up.stream_lines("/generate", upstream_body(body, force_routing=self._force)) as lines:
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = orjson.loads(data)
                    if isinstance(chunk, Mapping) and "error" in chunk:
                        yield sse_line(chunk)
                        continue
                    meta = chunk.get("meta_info") if isinstance(chunk, Mapping) else None
                    final = isinstance(meta, Mapping) and meta.get("finish_reason") is not None
                    idx = chunk.get("index") if isinstance(chunk.get("index"), int) else None
                    fields = (await self.indexer_off_loop([chunk], req, info, mark))[0] if final else None
                    item = (  # a final chunk's ref written to an object store: off the event loop
                        await off_loop_if_store_blocks(
                            partial(self.transcode, chunk, req, info, idx or 0, index=idx, mark=mark, indexer=fields)
                        )
                        if final
                        else self.transcode(chunk, req, info, idx or 0, final=False, index=idx, mark=mark)
                    )
                    yield sse_line(item)
                except orjson.JSONDecodeError as e:
                    self._metrics.errors.labels("upstream_protocol").inc()
                    yield sse_line(error_body(f"upstream stream chunk is not JSON: {e}", 502))
                    break
                except ProxyError as e:
                    self._metrics.errors.labels(e.kind).inc()
                    yield sse_line(error_body(e.message, e.status))
                    break
        yield SSE_DONE
