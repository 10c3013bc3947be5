"""FastAPI routes rr adds to vLLM's API server: SGLang-style ``/generate`` and ``/rr/info``.

Requests go straight to vLLM's in-process ``EngineClient`` (``app.state.engine_client``);
request parsing and reply building live in :mod:`rr_server.protocol` so the sidecar shares them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rr_server.protocol import (
    SSE_DONE,
    BadRequest,
    NormalizedGenerate,
    RoutingDims,
    build_item,
    error_body,
    finish_reason_dict,
    parse_generate_request,
    sse_line,
    to_vllm_sampling_kwargs,
)

__all__ = ["install_routes", "rr_info_dict"]

logger = logging.getLogger("rr.vllm")
_ROUTES = ("/generate", "/rr/info")
# Routing elements above which a reply is built in a worker thread (env override for tests).
_THREAD_MIN_ELEMS = int(os.environ.get("RR_ENCODE_THREAD_MIN_ELEMS", str(1 << 20)))


def _json(obj: Any, status: int = 200) -> Response:
    """Fast JSON response (orjson when available)."""
    try:
        import orjson

        return Response(orjson.dumps(obj), status_code=status, media_type="application/json")
    except ImportError:  # pragma: no cover
        return JSONResponse(obj, status_code=status)


def _error(message: str, status: int) -> Response:
    """4xx/5xx JSON error with a human-readable message."""
    return _json(error_body(message, status), status)


def _status_of(exc: BaseException) -> int:
    """HTTP status for an exception raised while admitting/running a request."""
    try:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
    except ImportError:  # older vLLM
        GracefulHTTPError = VLLMClientError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, BadRequest):
        return exc.status
    if GracefulHTTPError and isinstance(exc, GracefulHTTPError):
        return int(getattr(exc, "http_status", HTTPStatus.SERVICE_UNAVAILABLE))
    if (VLLMClientError and isinstance(exc, VLLMClientError)) or isinstance(exc, (ValueError, TypeError)):
        return 400
    return 500


def _hf_config_dict(app: FastAPI) -> dict[str, Any]:
    """The served model's HF config as a plain dict."""
    cfg = app.state.engine_client.model_config.hf_config
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))


def rr_info_dict(app: FastAPI) -> dict[str, Any]:
    """``/rr/info`` body (an RRInfo), computed once per app from the model's HF config."""
    cached = getattr(app.state, "rr_info", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    import vllm

    import rr_client
    from rr_client.codec import wire_dtype
    from rr_client.hf_config import moe_layers_from_config, routing_dims_from_config
    from rr_client.info import RRInfo

    cfg = _hf_config_dict(app)
    layers, experts, topk = routing_dims_from_config(cfg)
    model_config = app.state.engine_client.model_config
    info = RRInfo(
        engine="vllm",
        engine_version=str(vllm.__version__),
        rr_version=str(getattr(rr_client, "__version__", "0")),
        model=str(model_config.served_model_name or model_config.model),
        num_hidden_layers=layers,
        num_experts=experts,
        topk=topk,
        moe_layers=moe_layers_from_config(cfg),
        wire_dtype=wire_dtype(experts).name,  # type: ignore[arg-type]
        routing_enabled=bool(getattr(model_config, "enable_return_routed_experts", False)),
    )
    body = info.model_dump()
    app.state.rr_info = body
    return body


def _dims(app: FastAPI) -> RoutingDims:
    """Routing dimensions every returned array is checked against."""
    info = rr_info_dict(app)
    return RoutingDims(info["num_hidden_layers"], info["num_experts"], info["topk"])


def _engine_prompt(p: str | list[int]) -> dict[str, Any]:
    """vLLM prompt dict (TextPrompt / TokensPrompt)."""
    return {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}


def _token_logprobs(c: Any) -> list[list[Any]] | None:
    """SGLang ``output_token_logprobs``: ``[logprob, token_id, None]`` per generated token."""
    if c.logprobs is None:
        return None
    out: list[list[Any]] = []
    for tid, pos in zip(c.token_ids, c.logprobs):
        lp = pos.get(tid) if hasattr(pos, "get") else None
        out.append([float(lp.logprob) if lp is not None else None, int(tid), None])
    return out


def _items_for(ro: Any, req: NormalizedGenerate, i: int, rid: str, t0: float, dims: RoutingDims | None,
               final: bool = True) -> list[dict[str, Any]]:
    """SGLang reply entries (one per sample) for the RequestOutput of prompt ``i``."""
    items = []
    outs = sorted(ro.outputs, key=lambda c: c.index)
    n = len(outs)
    for c in outs:
        want = req.return_routed_experts and final
        items.append(build_item(
            rid=rid if n == 1 else f"{rid}-{c.index}",
            text=c.text,
            output_ids=list(c.token_ids),
            prompt_tokens=len(ro.prompt_token_ids or []),
            cached_tokens=int(getattr(ro, "num_cached_tokens", 0) or 0),
            finish_reason=finish_reason_dict(c.finish_reason, c.stop_reason) if final else None,
            e2e_latency=time.perf_counter() - t0,
            routing=getattr(c, "routed_experts", None) if want else None,
            dims=dims,
            routed_experts_start=req.routed_experts_start,
            want_routing=want,
            output_token_logprobs=_token_logprobs(c) if req.return_logprob[i] else None,
            prompt_token_ids=ro.prompt_token_ids,
        ))
        if want and "routed_experts_error" in items[-1]["meta_info"]:
            logger.error("rr: request %s: %s; routing withheld", rid, items[-1]["meta_info"]["routed_experts_error"])
    return items


def _start(app: FastAPI, req: NormalizedGenerate) -> tuple[list[Any], list[str]]:
    """Build SamplingParams and engine generators (lazy; admission errors surface on first step)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = app.state.engine_client
    kind = RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY
    gens, rids = [], []
    base = uuid.uuid4().hex
    for i, (p, sp) in enumerate(zip(req.prompts, req.sampling)):
        kw = to_vllm_sampling_kwargs(sp, routed_experts_start=req.routed_experts_start,
                                     return_logprob=req.return_logprob[i])
        try:
            params = SamplingParams(output_kind=kind, **kw)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid sampling_params: {e}") from None
        internal = f"rr-{base}-{i}"
        rids.append(req.rids[i] or internal)
        gens.append(engine.generate(_engine_prompt(p), params, internal))
    return gens, rids


async def _final(gen: Any) -> Any:
    """Drain one engine generator; return its last RequestOutput."""
    last = None
    async for out in gen:
        last = out
    return last


async def _run_batch(app: FastAPI, req: NormalizedGenerate) -> Response:
    """Non-streaming /generate: run all prompts concurrently, reply in prompt order."""
    t0 = time.perf_counter()
    gens, rids = _start(app, req)
    tasks = [asyncio.ensure_future(_final(g)) for g in gens]
    try:
        finals = await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()  # cancelling a generator aborts its request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, asyncio.CancelledError):
            raise
        return _error(_message(e), _status_of(e))
    dims = _dims(app) if req.return_routed_experts else None

    def build() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for i, ro in enumerate(finals):
            items.extend(_items_for(ro, req, i, rids[i], t0, dims))
        return items

    size = sum(getattr(getattr(c, "routed_experts", None), "size", 0) for ro in finals for c in ro.outputs)
    # Large payloads (~100 ms to check + base64 a 32k-token sample) must not stall the event loop.
    items = await asyncio.to_thread(build) if req.return_routed_experts and size > _THREAD_MIN_ELEMS else build()
    if not req.is_batch and len(items) == 1:
        return _json(items[0])
    return _json(items)


def _message(e: BaseException) -> str:
    """Error text including the cause vLLM wrapped it in."""
    cause = e.__cause__
    msg = str(e) or e.__class__.__name__
    return f"{msg}: {cause}" if cause is not None and str(cause) not in msg else msg


async def _stream(app: FastAPI, req: NormalizedGenerate) -> Response:
    """Streaming /generate: SSE chunks like SGLang (cumulative text/ids); routing on the final chunk."""
    t0 = time.perf_counter()
    gens, rids = _start(app, req)
    iters = [g.__aiter__() for g in gens]
    firsts = [asyncio.ensure_future(it.__anext__()) for it in iters]
    try:
        first_out = await asyncio.gather(*firsts)  # admission errors -> 4xx before any byte is sent
    except BaseException as e:
        for t in firsts:
            t.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for it in iters:
            await it.aclose()
        if isinstance(e, asyncio.CancelledError):
            raise
        return _error(_message(e), _status_of(e))
    dims = _dims(app) if req.return_routed_experts else None

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in iters[i]:
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the client as an error chunk
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        for i, out in enumerate(first_out):
            await queue.put((i, out))
        pumps = [asyncio.ensure_future(pump(i)) for i, out in enumerate(first_out) if not out.finished]
        live = len(pumps)
        try:
            while True:
                if live == 0 and queue.empty():
                    break
                i, out = await queue.get()
                if out is None:
                    live -= 1
                    continue
                if isinstance(out, BaseException):
                    yield sse_line(error_body(_message(out), _status_of(out)))
                    continue
                for item in _items_for(out, req, i, rids[i], t0, dims, final=out.finished):
                    if req.is_batch:
                        item["index"] = i
                    yield sse_line(item)
            yield SSE_DONE
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for it in iters:
                await it.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, req: NormalizedGenerate) -> Response:
    """Run a non-streaming batch, aborting its engine requests if the client disconnects."""
    work = asyncio.ensure_future(_run_batch(request.app, req))
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        return work.result()
    work.cancel()  # cancels the engine generators -> vLLM aborts the requests
    await asyncio.gather(work, return_exceptions=True)
    return Response(status_code=499)


async def generate(request: Request) -> Response:
    """SGLang-compatible ``POST /generate`` with optional routed experts."""
    try:
        req = parse_generate_request(await request.body())
        model_config = request.app.state.engine_client.model_config
        if req.return_routed_experts and not getattr(model_config, "enable_return_routed_experts", False):
            raise BadRequest("this server was started without --enable-return-routed-experts")
        if req.stream:
            return await _stream(request.app, req)
        return await _unless_disconnected(request, req)
    except BadRequest as e:
        return _error(str(e), e.status)


async def rr_info(request: Request) -> Response:
    """``GET /rr/info``: model routing dimensions and wire dtype (an RRInfo)."""
    return _json(rr_info_dict(request.app))


def install_routes(app: FastAPI) -> None:
    """Add rr's routes to a vLLM app once; refuse loudly if vLLM already owns those paths."""
    if getattr(app.state, "rr_routes_installed", False):
        return
    taken = [r.path for r in app.routes if getattr(r, "path", None) in _ROUTES]
    if taken:
        raise RuntimeError(f"rr: vLLM already serves {taken}; refusing to shadow them")
    router = APIRouter()
    router.add_api_route("/generate", generate, methods=["POST"], include_in_schema=True)
    router.add_api_route("/rr/info", rr_info, methods=["GET"])
    app.include_router(router)
    app.state.rr_routes_installed = True
    logger.info("rr: added POST /generate and GET /rr/info")
