"""The sidecar's ``/v1/completions`` and ``/v1/chat/completions``: rr's fields served from the engine's own answer.

A request with rr's fields (:mod:`rr_server.serving.openai_routing`) is rewritten into the engine's names, and every
choice of the answer gets checked rr routing and token ids. Any other request passes through byte for byte,
streaming included, with one exception: on SGLang the sidecar asks for routing on every request (SGLang
<= 0.5.12 hands one request another's rows when a batch mixes asking and non-asking requests) and removes it
from answers that did not ask, so they read exactly as SGLang would send them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any, Protocol

import orjson
from fastapi.responses import Response, StreamingResponse

from rr_client.core.engines import ABSENT, ANSWER_ROUTING_EXTS, CHOICE_ROUTING_EXTS, pop_ext_routing
from rr_client.core.engines import engine as find_engine
from rr_client.core.info import RRInfo
from rr_server.proxy.errors import ProxyError
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.proxy.provenance import answer_provenance
from rr_server.proxy.upstream import Upstream
from rr_server.serving.generate_protocol import BadRequest
from rr_server.serving.http import json_response
from rr_server.serving.openai_routing import engine_body, finish_answer, parse_openai_routing, routing_payload_size
from rr_server.serving.store import refs_made_under
from rr_server.serving.weight_epoch import WeightEpoch


class _Settings(Protocol):
    engine: str
    force_routing: bool


class SidecarParts(Protocol):
    """What an OpenAI request needs of the sidecar (``app.Sidecar`` is one): the upstream, its settings, the
    server's info, the weight epoch and the metrics. Named here, so this module never imports the app."""

    cfg: _Settings
    up: Upstream
    epoch: WeightEpoch
    metrics: ProxyMetrics

    async def info(self) -> tuple[RRInfo, str]: ...


__all__ = ["serve_openai", "strip_forced_routing"]

_THREAD_MIN_CHARS = 1 << 20
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def strip_forced_routing(answer: Any) -> bool:
    """Remove the routing the sidecar forced on: SGLang's response-level ``sglext.routed_experts`` (and a
    per-choice ``sgl_ext`` one), dropping a container left empty as SGLang would; True if anything went."""
    if not isinstance(answer, dict):
        return False
    found = [pop_ext_routing(answer, ext) for ext in ANSWER_ROUTING_EXTS]
    found += [
        pop_ext_routing(c, ext) for c in answer.get("choices", ()) if isinstance(c, dict) for ext in CHOICE_ROUTING_EXTS
    ]
    return any(f is not ABSENT for f in found)


def _headers(resp: Any) -> dict[str, str]:
    """The engine's answer headers minus hop-by-hop ones (the sidecar's server sets its own)."""
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}


async def _pass_through(sc: SidecarParts, path: str, content: bytes, *, stream: bool, strip: bool) -> Response:
    """Forward to the engine; its answer goes back unchanged (``strip``: minus forced SGLang routing)."""
    if not stream:
        resp = await sc.up.forward(path, content)
        body = resp.content
        if strip and resp.status_code == 200:
            try:
                answer = orjson.loads(body)
                if strip_forced_routing(answer):
                    body = orjson.dumps(answer)
            except orjson.JSONDecodeError:
                pass
        return Response(body, status_code=resp.status_code, headers=_headers(resp))
    stack = AsyncExitStack()
    resp = await stack.enter_async_context(sc.up.forward_stream(path, content))
    if resp.status_code != 200:
        try:
            body = await resp.aread()
        finally:
            await stack.aclose()
        return Response(body, status_code=resp.status_code, headers=_headers(resp))

    async def chunks() -> AsyncIterator[bytes]:
        try:
            if not strip:
                async for raw in resp.aiter_raw():
                    yield raw
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:") and "routed_experts" in line:
                    try:
                        event = orjson.loads(line[5:].strip())
                        if strip_forced_routing(event):
                            line = "data: " + orjson.dumps(event).decode()
                    except orjson.JSONDecodeError:
                        pass
                yield (line + "\n").encode()
        finally:
            await stack.aclose()

    return StreamingResponse(chunks(), status_code=200, headers=_headers(resp))


async def serve_openai(sc: SidecarParts, path: str, raw: bytes) -> Response:
    """One OpenAI-endpoint request through the sidecar."""
    engine = sc.cfg.engine
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None  # not ours to judge: the engine answers it
    try:
        r = parse_openai_routing(body, engine=engine) if isinstance(body, dict) else None
    except BadRequest as e:
        raise ProxyError(e.status, "bad_request", str(e)) from None
    force = find_engine(engine).sidecar_forces_routing and sc.cfg.force_routing and isinstance(body, dict)
    if r is None or not r.want:
        if not isinstance(body, dict) or (r is None and not force):
            return await _pass_through(
                sc, path, raw, stream=isinstance(body, dict) and bool(body.get("stream")), strip=False
            )
        out = engine_body(body, r, engine=engine) if r is not None else dict(body)
        if force:
            out["return_routed_experts"] = True
        return await _pass_through(sc, path, orjson.dumps(out), stream=bool(out.get("stream")), strip=force)
    info, _ = await sc.info()
    # SGLang is asked for every row and the sidecar drops the first ``start`` (its OpenAI serving before 0.5.12
    # ignores routed_experts_start_len); vLLM applies the start itself
    drop = r.start if find_engine(engine).sidecar_slices_start else 0
    sent = engine_body(body, dataclasses.replace(r, start=0) if drop else r, engine=engine)
    mark = sc.epoch.mark()
    answer = await sc.up.call("POST", path, sent)
    finish = functools.partial(finish_answer, r=r, info=info, engine=engine, drop_rows=drop, payload_rows_counted=False)
    with refs_made_under(mark.version):  # refs carry the weight version their request was sent under
        if routing_payload_size(answer) > _THREAD_MIN_CHARS:
            answer = await asyncio.to_thread(finish, answer)
        else:
            answer = finish(answer)
    answer_provenance(answer, sc.epoch, mark)
    for choice in answer.get("choices", ()) if isinstance(answer, dict) else ():
        shape = choice.get("routed_experts_shape") if isinstance(choice, dict) else None
        if shape:
            sc.metrics.routing_sent(int(shape[0]), choice.get("routed_experts"))
    sc.metrics.routing.count_answer(answer)
    return json_response(answer)
