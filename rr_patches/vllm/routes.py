"""FastAPI routes rr adds to vLLM's API server: SGLang-style ``/generate`` (also at ``/rr/generate``) and ``/rr/info``.

``/rr/generate`` is the same handler and schema under a path that routers forward untouched
(vllm-router 0.1.17 rewrites ``/generate`` and drops ``return_routed_experts``; docs/scale-out.md).
``RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS=1`` returns routing on every ``/generate`` answer, asked or not,
for callers behind a router that drops the flag.

Requests go straight to vLLM's in-process ``EngineClient`` (``app.state.engine_client``). The
protocol lives in :mod:`rr_server.serving.generate_protocol` and the vLLM translation in
:mod:`rr_server.serving.vllm_translate`, shared with the sidecar. Every routing array passes
:func:`rr_client.check_routing` before it is encoded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from rr_client.core import settings
from rr_client.core.codec import routing_error_fields
from rr_client.core.errors import RoutedExpertsError
from rr_client.core.info import RRInfo
from rr_client.core.logprobs import mode_from_vllm
from rr_patches.vllm.auth import protect_rr_routes, vllm_key_checks
from rr_patches.vllm.kv_tiers import VLLMWeightUpdateMiddleware, configured_connectors
from rr_patches.vllm.openai_streams import collecting
from rr_patches.vllm.provenance import admit, connector_configured, provenance_of
from rr_server.serving import test_faults
from rr_server.serving.fanout import gather_or_cancel, merge_streams, primed
from rr_server.serving.generate_protocol import (
    SSE_DONE,
    BadRequest,
    NormalizedGenerate,
    build_item,
    parse_generate_request,
    sse_line,
)
from rr_server.serving.http import error_body, json_response
from rr_server.serving.indexer_fields import vllm_indexer_refusal
from rr_server.serving.openai_middleware import install_openai_routing
from rr_server.serving.routing_metrics import count_sample
from rr_server.serving.routing_metrics import declare as declare_counters
from rr_server.serving.store import STORE_ROUTES, advertised_url, current_store, install_store, refs_made_under
from rr_server.serving.store.install import store_blocks
from rr_server.serving.store.siblings import PROCESS_GAUGES
from rr_server.serving.vllm_translate import (
    checked_routing_fields,
    finish_reason_dict,
    to_vllm_sampling_kwargs,
)
from rr_server.serving.weight_epoch import WeightMark, current_epoch, install_weight_epoch

__all__ = [
    "install_routes",
    "add_rr_routes",
    "rr_info_dict",
    "RR_ROUTES",
    "ALWAYS_ENV",
    "always_return_routing",
    "name_store",
]

logger = logging.getLogger("rr.vllm")
# Give routing to every answer, asked or not: for callers behind a router that drops the flag.
ALWAYS_ENV = "RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS"
# Routing elements above which a reply is built in a worker thread (env override for tests).
_THREAD_MIN_ELEMS = settings.integer("RR_ENCODE_THREAD_MIN_ELEMS", default=1 << 20)


def _error(message: str, status: int) -> Response:
    """4xx/5xx JSON error with a human-readable message."""
    return json_response(error_body(message, status), status)


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


def rr_info(app: FastAPI) -> RRInfo:
    """The served model's :class:`RRInfo`, built once per app from its HF config."""
    cached = getattr(app.state, "rr_info", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    import vllm

    model_config = app.state.engine_client.model_config
    info = RRInfo.from_hf_config(
        _hf_config_dict(app),
        engine="vllm",
        engine_version=str(vllm.__version__),
        model=str(model_config.served_model_name or model_config.model),
        routing_enabled=_routing_enabled(app),
        platform=_platform(),
        speculative=_speculative(app),
        logprobs_mode=mode_from_vllm(getattr(model_config, "logprobs_mode", None)),
    )
    app.state.rr_info = info
    return info


def _platform() -> str | None:
    """vLLM's device type (cpu, cuda, rocm, npu for vllm-ascend, ...): the doctor's platform-specific bugs."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type) or None
    except Exception:  # noqa: BLE001 - informational only
        return None


def _speculative(app: FastAPI) -> str | None:
    """The speculative-decoding method this server runs (None when off): the doctor reports draft pollution."""
    cfg = getattr(getattr(app.state.engine_client, "vllm_config", None), "speculative_config", None)
    return None if cfg is None else str(getattr(cfg, "method", None) or "on")


def rr_info_dict(app: FastAPI) -> dict[str, Any]:
    """``/rr/info`` body: the model's routing dims, and the routing store's counters (refs)."""
    body = rr_info(app).model_dump()
    body.update(current_epoch().info())  # weight_version: weight updates this server has seen complete
    body["requests_in_engine"] = _requests_in_engine(app)
    # the KV connectors outside the device cache (a weight push resets them with reset_external=true): None for none
    body["kv_connector"] = list(configured_connectors(getattr(app.state, "engine_client", None))) or None
    store = current_store()
    if store is not None:
        body["routing_store"] = store.stats()
        # the server's, over its API processes (each counts its own); the processes' sum when they answered
        body["requests_in_engine"] = body["routing_store"].pop("requests_in_engine", body["requests_in_engine"])
    return body


def _requests_in_engine(app: FastAPI) -> int | None:
    """Requests this API process has handed to the engine and not seen finish (vLLM's output processor tracks each
    from just before it is sent to the engine core); the doctor holds a burst until all of it is there. None: not
    readable on this vLLM."""
    client = getattr(app.state, "engine_client", None)  # an app vLLM has not started (yet): none
    states = getattr(getattr(client, "output_processor", None), "request_states", None)
    return len(states) if isinstance(states, dict) else None


def _routing_enabled(app: FastAPI) -> bool:
    """Whether vLLM was started with ``--enable-return-routed-experts`` (0.31+: in aux_output_config)."""
    from rr_patches.vllm.compat import routing_enabled

    return routing_enabled(app.state.engine_client)


def _engine_prompt(p: str | list[int], cache_salt: str | None = None) -> dict[str, Any]:
    """vLLM prompt dict (TextPrompt / TokensPrompt), with its prefix-cache ``cache_salt`` when asked."""
    out: dict[str, Any] = {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out


def _token_logprobs(c: Any) -> list[list[Any]] | None:
    """SGLang ``output_token_logprobs``: ``[logprob, token_id, None]`` per generated token."""
    if c.logprobs is None:
        return None
    out: list[list[Any]] = []
    for tid, pos in zip(c.token_ids, c.logprobs):
        lp = pos.get(tid) if hasattr(pos, "get") else None
        out.append([float(lp.logprob) if lp is not None else None, int(tid), None])
    return out


def _routing_fields(
    c: Any, ro: Any, req: NormalizedGenerate, rid: str, info: RRInfo, version: int | None = None
) -> dict[str, Any]:
    """Checked routing fields of one finished sample (a ref carries ``version``, the engine's weight version at
    admission), or an error marker (logged) when the check fails."""
    try:
        with refs_made_under(version):
            return checked_routing_fields(
                test_faults.inject(
                    getattr(c, "routed_experts", None),
                    rid,
                    prompt_tokens=len(ro.prompt_token_ids or []),
                    cached_tokens=int(getattr(ro, "num_cached_tokens", 0) or 0),
                    start=req.routed_experts_start,
                ),
                info,
                prompt_ids=ro.prompt_token_ids or [],
                output_ids=c.token_ids,
                start=req.routed_experts_start,
                fmt=req.routed_experts_format,
            )
    except RoutedExpertsError as e:
        logger.error("rr: request %s: %s: %s; routing withheld", rid, type(e).__name__, e)
        return routing_error_fields(e)


def _items_for(
    ro: Any,
    req: NormalizedGenerate,
    i: int,
    rid: str,
    t0: float,
    info: RRInfo | None,
    final: bool = True,
    mark: WeightMark | None = None,
    finish: tuple[int, bool] | None = None,
    connector: bool = False,
) -> list[dict[str, Any]]:
    """SGLang reply entries (one per sample) for the RequestOutput of prompt ``i``; a final one carries its
    provenance (``mark``: the weight epoch at admission, ``finish``: at finish)."""
    items = []
    outs = sorted(ro.outputs, key=lambda c: c.index)
    n = len(outs)
    for c in outs:
        sample_rid = rid if n == 1 else f"{rid}-{c.index}"
        fields = None
        prov = (
            provenance_of(
                ro,
                ro.prompt_token_ids,
                c.token_ids,
                mark,
                connector=connector,
                finish=finish,
                shared_by=n,
                spans=getattr(c, "weight_versions", None),  # vLLM 0.32+'s own weight-version spans
            )
            if final and mark is not None
            else None
        )
        if req.return_routed_experts and final and info is not None:
            fields = _routing_fields(c, ro, req, sample_rid, info, mark.version if mark is not None else None)
            count_sample(fields)
        items.append(
            build_item(
                rid=sample_rid,
                text=c.text,
                output_ids=list(c.token_ids),
                prompt_tokens=len(ro.prompt_token_ids or []),
                cached_tokens=int(getattr(ro, "num_cached_tokens", 0) or 0),
                finish_reason=finish_reason_dict(c.finish_reason, c.stop_reason) if final else None,
                e2e_latency=time.perf_counter() - t0,
                routing_fields=fields,
                prompt_token_ids=ro.prompt_token_ids,
                output_token_logprobs=_token_logprobs(c) if req.return_logprob[i] else None,
                provenance=prov.to_dict() if prov is not None else None,
            )
        )
    return items


def _start(app: FastAPI, req: NormalizedGenerate) -> tuple[list[Any], list[str], list[WeightMark]]:
    """Build SamplingParams and engine generators (lazy; admission errors surface on first step), each with
    the weight epoch at its admission."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = app.state.engine_client
    kind = RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY
    gens, rids, marks = [], [], []
    base = uuid.uuid4().hex
    for i, (p, sp) in enumerate(zip(req.prompts, req.sampling)):
        if req.return_routed_experts and isinstance(p, list) and req.routed_experts_start > len(p):
            raise BadRequest(
                f"routed_experts_start {req.routed_experts_start} is beyond prompt {i} "
                f"({len(p)} tokens); it must be <= the prompt length"
            )
        kw = to_vllm_sampling_kwargs(
            sp, routed_experts_start=req.routed_experts_start, return_logprob=req.return_logprob[i]
        )
        try:
            params = SamplingParams(output_kind=kind, **kw)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"invalid sampling_params: {e}") from None
        internal = f"rr-{base}-{i}"
        rids.append(req.rids[i] or internal)
        marks.append(admit())
        salt = req.cache_salts[i] if req.cache_salts else None
        gens.append(engine.generate(_engine_prompt(p, salt), params, internal))
    return gens, rids, marks


async def _final(gen: Any, mark: WeightMark) -> tuple[Any, tuple[int, bool]]:
    """Drain one engine generator; return its last RequestOutput and the weight epoch when it finished."""
    last = None
    async for out in gen:
        last = out
    return last, current_epoch().since(mark)


async def _run_batch(app: FastAPI, req: NormalizedGenerate) -> Response:
    """Non-streaming /generate: run all prompts concurrently, reply in prompt order."""
    t0 = time.perf_counter()
    gens, rids, marks = _start(app, req)
    connector = connector_configured(app.state.engine_client)
    try:
        finals = await gather_or_cancel(_final(g, m) for g, m in zip(gens, marks))
    except Exception as e:  # noqa: BLE001 - engine errors become HTTP errors
        return _error(_message(e), _status_of(e))
    info = rr_info(app) if req.return_routed_experts else None

    def build() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for i, (ro, finish) in enumerate(finals):
            items.extend(_items_for(ro, req, i, rids[i], t0, info, mark=marks[i], finish=finish, connector=connector))
        return items

    size = sum(getattr(getattr(c, "routed_experts", None), "size", 0) for ro, _ in finals for c in ro.outputs)
    # Large payloads (~100 ms to check + base64 a 32k-token sample) must not stall the event loop.
    # So must an object store's writes (a ref's rows go to S3 or a shared disk before the answer names them).
    off_loop = req.return_routed_experts and (size > _THREAD_MIN_ELEMS or store_blocks())
    items = await asyncio.to_thread(build) if off_loop else build()
    if not req.is_batch and len(items) == 1:
        return json_response(items[0])
    return json_response(items)


def _message(e: BaseException) -> str:
    """Error text including the cause vLLM wrapped it in."""
    cause = e.__cause__
    msg = str(e) or e.__class__.__name__
    return f"{msg}: {cause}" if cause is not None and str(cause) not in msg else msg


async def _stream(app: FastAPI, req: NormalizedGenerate) -> Response:
    """Streaming /generate: SSE chunks like SGLang (cumulative text/ids); routing on the final chunk."""
    t0 = time.perf_counter()
    gens, rids, marks = _start(app, req)
    connector = connector_configured(app.state.engine_client)
    info = rr_info(app) if req.return_routed_experts else None
    merged = merge_streams([g.__aiter__() for g in gens])
    try:
        outputs = await primed(merged)  # admission errors -> 4xx before any byte is sent
    except Exception as e:  # noqa: BLE001
        await merged.aclose()
        return _error(_message(e), _status_of(e))

    async def events() -> AsyncIterator[str]:
        try:
            async for i, out in outputs:

                def items(i: int = i, out: Any = out) -> list[dict[str, Any]]:
                    return _items_for(
                        out, req, i, rids[i], t0, info, final=out.finished, mark=marks[i], connector=connector
                    )

                # a final chunk's ref written to an object store: off the event loop, as the batch path
                blocks = out.finished and req.return_routed_experts and store_blocks()
                for item in await asyncio.to_thread(items) if blocks else items():
                    if req.is_batch:
                        item["index"] = i
                    yield sse_line(item)
        except Exception as e:  # noqa: BLE001 - forwarded to the client as an error event
            yield sse_line(error_body(_message(e), _status_of(e)))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

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


def always_return_routing() -> bool:
    """``RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS`` is on (:func:`rr_client.core.settings.flag`'s rule)."""
    return settings.flag(ALWAYS_ENV)


async def generate(request: Request) -> Response:
    """SGLang-compatible ``POST /generate`` (and ``/rr/generate``) with optional routed experts."""
    try:
        req = parse_generate_request(await request.body())
        if not req.return_routed_experts and always_return_routing() and _routing_enabled(request.app):
            req = dataclasses.replace(req, return_routed_experts=True)
        if req.return_routed_experts and not _routing_enabled(request.app):
            raise BadRequest("this server was started without --enable-return-routed-experts")
        if req.return_indexer_topk:
            raise BadRequest(vllm_indexer_refusal())
        if req.stream:
            return await _stream(request.app, req)
        return await _unless_disconnected(request, req)
    except BadRequest as e:
        return _error(str(e), e.status)


async def rr_info_endpoint(request: Request) -> Response:
    """``GET /rr/info``: model routing dimensions and wire dtype (an RRInfo)."""
    return json_response(rr_info_dict(request.app))


# Every route rr adds: (path, handler, methods). ``/rr/generate`` is ``/generate`` under a path routers forward intact.
RR_ROUTES: tuple[tuple[str, Callable[[Request], Any], tuple[str, ...]], ...] = (
    ("/generate", generate, ("POST",)),
    ("/rr/generate", generate, ("POST",)),
    ("/rr/info", rr_info_endpoint, ("GET",)),
    *STORE_ROUTES,  # routing by reference: read rows by key, retire per weight version
)
_ROUTES = tuple(path for path, _, _ in RR_ROUTES)


def add_rr_routes(app: FastAPI) -> None:
    """Include every route of :data:`RR_ROUTES` in ``app`` and rr's fields on vLLM's OpenAI endpoints.

    Refuses loudly if vLLM already serves one of rr's paths.
    """
    taken = [r.path for r in app.routes if getattr(r, "path", None) in _ROUTES]
    if taken:
        raise RuntimeError(f"rr: vLLM already serves {taken}; refusing to shadow them")
    install_store()  # the routing store behind routed_experts_format="ref" (its URL: name_store)
    # counts the weight updates passing through vLLM's weight routes (weight_version), inside vLLM's key check when
    # vLLM's middleware is on the app already (0.22 - 0.29's build_app wrap): a keyless body is never read
    install_weight_epoch(app, VLLMWeightUpdateMiddleware, inside=vllm_key_checks())
    declare_counters()  # rr's counters on vLLM's /metrics (this API server process; after vLLM's metrics setup)
    router = APIRouter()
    for path, handler, methods in RR_ROUTES:
        router.add_api_route(path, handler, methods=list(methods), include_in_schema=True)
    app.include_router(router)
    # rr's fields on vLLM's own /v1/completions and /v1/chat/completions (vLLM's handlers run unchanged);
    # streams get them on one event before [DONE], collected from the engine client's outputs
    install_openai_routing(
        app, engine="vllm", info=rr_info, routing_enabled=_routing_enabled, native=functools.partial(collecting, app)
    )
    PROCESS_GAUGES["requests_in_engine"] = functools.partial(_requests_in_engine, app)  # summed in /rr/info


def name_store(args: Any) -> None:
    """The URL this server's routing refs name: ``RR_ADVERTISE_URL``, else vLLM's ``--host``/``--port``."""
    store = install_store(advertised_url(getattr(args, "host", None) or "127.0.0.1", getattr(args, "port", None)))
    if store.siblings is not None:  # one weight epoch for every API server process (--api-server-count)
        current_epoch().share(store.siblings.dir, fresh=not store.siblings.others_alive())


def install_routes(app: FastAPI, args: Any = None) -> None:
    """Add rr's routes to a vLLM app once, behind vLLM's API keys; refuse loudly if vLLM owns those paths."""
    if getattr(app.state, "rr_routes_installed", False):
        return
    add_rr_routes(app)
    name_store(args)
    how = protect_rr_routes(app, args)
    app.state.rr_routes_installed = True
    logger.info("rr: added POST /generate, POST /rr/generate and GET /rr/info; auth: %s", how)
    if always_return_routing():
        logger.warning("rr: %s is set: every /generate answer carries routing, asked or not", ALWAYS_ENV)
