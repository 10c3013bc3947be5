"""The sidecar's FastAPI app: ``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/rr/info``, ``/health``,
``/metrics`` and the engine's weight routes (forwarded and counted: ``weight_version``) in front of one upstream, or
in front of a SGLang prefill/decode pair (``prefill_upstream``: :mod:`rr_server.proxy.pd_backend`; ``/generate``
joined at the seam, weight routes sent to both servers, the OpenAI endpoints refused).

``/rr/generate`` is ``/generate`` (same handler, same schema) under a path vllm-router forwards intact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from rr_client.core.engines import EngineName
from rr_client.core.engines import engine as find_engine
from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.info import RRInfo
from rr_server.proxy.backend import Backend
from rr_server.proxy.errors import ProxyError, error_payload
from rr_server.proxy.info import fetch_info
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.proxy.openai import serve_openai
from rr_server.proxy.pd_backend import PDBackend
from rr_server.proxy.pd_weights import UpdateLedger, forward_weights
from rr_server.proxy.sglang_backend import SGLangBackend, validation_view
from rr_server.proxy.upstream import Upstream
from rr_server.proxy.vllm_backend import VLLMBackend
from rr_server.serving.auth import ApiKeyMiddleware, ApiKeys
from rr_server.serving.disaggregation import sglang_pd_refusal
from rr_server.serving.engines import releases
from rr_server.serving.fanout import primed
from rr_server.serving.generate_protocol import (
    SSE_DONE,
    BadRequest,
    NormalizedGenerate,
    parse_generate_request,
    sse_line,
)
from rr_server.serving.http import json_response
from rr_server.serving.openai_routing import OPENAI_PATHS
from rr_server.serving.store import STORE_ROUTES, install_store
from rr_server.serving.weight_epoch import WeightEpoch, WeightUpdateMiddleware

__all__ = ["ProxyConfig", "create_app", "DEFAULT_MAX_BODY_BYTES"]


# Largest request body accepted by default: 256 prompts x 32k token ids as JSON (~7 bytes each) is ~57 MB.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# Paths that never need a key (vLLM and SGLang keep /health open too).
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the sidecar needs to know about its upstream and its own clients."""

    upstream: str
    engine: EngineName
    max_concurrency: int = 64
    timeout: float = 600.0
    model_path: str | None = None
    api_keys: tuple[str, ...] = ()  # clients must send one as ``Authorization: Bearer``; empty = open
    advertise_url: str = ""  # what routing refs name as the place to read their rows (default: host and port)
    upstream_api_key: str | None = None  # sent to the engine as ``Authorization: Bearer``
    metrics_require_key: bool = False  # /metrics is open unless this is set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    force_routing: bool = True  # SGLang: ask on every request (mixed-batch fix); off only for the doctor
    # what the upstream's sampled log-probs mean ("processed" / "raw", rr_client.core.logprobs); None: vLLM unknown,
    # SGLang "processed" (its default)
    upstream_logprobs_mode: str | None = None
    # P/D: ``upstream`` is the decode server, this the prefill server; its bootstrap host (default: its URL's host)
    # and ``--disaggregation-bootstrap-port``
    prefill_upstream: str = ""
    bootstrap_port: int = 0
    bootstrap_host: str = ""
    # the operator states that every weight update of the engine(s) goes through this sidecar; otherwise an update
    # pushed straight to the engine is invisible here and each sample's weight fields say unknown (null)
    weight_updates_via_sidecar: bool = False


class Sidecar:
    """Per-app state: upstream client, metrics, cached info, and the engine backend."""

    def __init__(self, cfg: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.metrics = ProxyMetrics()

        def upstream(url: str) -> Upstream:
            """An engine server behind this sidecar, with the sidecar's limits, key and transport."""
            return Upstream(
                url,
                timeout=cfg.timeout,
                max_concurrency=cfg.max_concurrency,
                metrics=self.metrics,
                transport=transport,
                api_key=cfg.upstream_api_key,
            )

        self.up = upstream(cfg.upstream)
        self._info: tuple[RRInfo, str] | None = None
        self._lock = asyncio.Lock()
        # weight updates forwarded to the upstream through this sidecar (all of them only if the operator says so)
        self.epoch = WeightEpoch(sees_all_updates=cfg.weight_updates_via_sidecar)
        self.prefill: Upstream | None = None  # P/D: the prefill server (``up`` is the decode server)
        self.updates: UpdateLedger | None = None  # P/D: the weight updates each server took through this sidecar
        self.backend: Backend
        if cfg.prefill_upstream:
            if not releases(cfg.engine).supports_pd_pair or cfg.bootstrap_port <= 0:
                raise ValueError("a P/D sidecar needs engine sglang and the prefill server's bootstrap port")
            self.prefill = upstream(cfg.prefill_upstream)
            self.updates = UpdateLedger([self.prefill.url, self.up.url])
            host = cfg.bootstrap_host or urlsplit(cfg.prefill_upstream).hostname or "127.0.0.1"
            self.backend = PDBackend(
                self.prefill, self.up, self.info, self.metrics,
                bootstrap_host=host, bootstrap_port=cfg.bootstrap_port, epoch=self.epoch, updates=self.updates,
            )  # fmt: skip
        elif find_engine(cfg.engine).native_generate:
            self.backend = SGLangBackend(
                self.up, self.info, self.metrics, force_routing=cfg.force_routing, epoch=self.epoch
            )
        else:
            self.backend = VLLMBackend(self.up, self.info, self.metrics, epoch=self.epoch)

    @property
    def upstreams(self) -> list[Upstream]:
        """Every engine server behind this sidecar (P/D: prefill, then decode)."""
        return [self.prefill, self.up] if self.prefill is not None else [self.up]

    async def info(self) -> tuple[RRInfo, str]:
        """RRInfo + upstream model name, fetched once (retried on the next request if the upstream was down)."""
        async with self._lock:
            if self._info is None:
                roles = ("prefill", "decode") if self.prefill is not None else ("null",)  # SGLang's disaggregation_mode
                infos = [
                    await fetch_info(u, self.cfg.engine, self.cfg.model_path, self.cfg.upstream_logprobs_mode, role)
                    for u, role in zip(self.upstreams, roles)
                ]
                if len(infos) == 2:  # P/D: both servers must serve the same routing, or no sample can be joined
                    (p, _), (d, _) = infos
                    if why := _pd_release_refusal(p.engine_version):
                        raise ProxyError(502, "upstream_protocol", f"the prefill server ({self.prefill.url}): {why}")  # type: ignore[union-attr]
                    # routing dimensions, not the model's path: the two machines may mount one checkpoint apart
                    for name in ("num_hidden_layers", "num_experts", "topk", "moe_layers", "wire_dtype"):
                        if getattr(p, name) != getattr(d, name):
                            raise ProxyError(
                                502,
                                "upstream_protocol",
                                f"the prefill server ({self.prefill.url}) and the decode server ({self.up.url}) "  # type: ignore[union-attr]
                                f"differ in {name}: {getattr(p, name)!r} vs {getattr(d, name)!r}",
                            )
                self._info = infos[-1]
            return self._info

    def fail(self, route: str, e: ProxyError) -> Response:
        """Count and answer one error."""
        self.metrics.errors.labels(e.kind).inc()
        self.metrics.requests.labels(route, str(e.status)).inc()
        return json_response(error_payload(e), e.status)


async def role_refusal(cfg: ProxyConfig) -> str | None:
    """Ask the upstream(s) once at startup: why they cannot serve in the part this sidecar gives them (a P/D server
    behind a plain sidecar, a P/D pair's servers swapped); None when they can, or do not answer yet (each request
    then asks and is refused the same way)."""
    sc = Sidecar(cfg)
    try:
        await sc.info()
    except ProxyError as e:
        return e.message if e.kind == "upstream_role" else None
    finally:
        for up in sc.upstreams:
            await up.aclose()
    return None


def _pd_release_refusal(version: str) -> str | None:
    """Why a SGLang prefill server of ``version`` cannot serve P/D with routing (None: it can, or its version is not
    known: each sample's own check then refuses missing rows)."""
    try:
        return sglang_pd_refusal(version, ["--disaggregation-mode", "prefill"])
    except UnsupportedVersionError:  # an unparsable version ("unknown", a dev build)
        return None


def _parse(body: bytes, engine: str) -> tuple[NormalizedGenerate, dict[str, Any]]:
    """Validate a client body; SGLang upstreams also get the fields rr does not model, untouched."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ProxyError(400, "bad_request", f"request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ProxyError(400, "bad_request", "request body must be a JSON object")
    try:
        req = parse_generate_request(validation_view(raw) if find_engine(engine).native_generate else raw)
    except BadRequest as e:
        raise ProxyError(e.status, "bad_request", str(e)) from None
    return req, raw


async def _sse_events(req: NormalizedGenerate, raw: dict[str, Any], backend: Backend) -> AsyncIterator[str]:
    """The backend's SSE lines, primed (errors before the first event get a real status); later errors as events."""
    events = await primed(backend.stream(req, raw))

    async def guarded() -> AsyncIterator[str]:
        try:
            async for ev in events:
                yield ev
        except ProxyError as e:
            yield sse_line(error_payload(e))
            yield SSE_DONE

    return guarded()


def create_app(cfg: ProxyConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build one sidecar app (its own metrics registry and upstream pool)."""
    sc = Sidecar(cfg, transport)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        for up in sc.upstreams:
            await up.aclose()

    app = FastAPI(title="rr sidecar", lifespan=lifespan)
    app.state.sidecar = sc
    store = install_store(cfg.advertise_url)  # routed_experts_format="ref": rows held here, read by key
    sc.metrics.watch_store(store.stats)
    for path, handler, methods in STORE_ROUTES:
        app.add_api_route(path, handler, methods=list(methods))
    open_paths = OPEN_PATHS if cfg.metrics_require_key else OPEN_PATHS | {"/metrics"}
    app.add_middleware(WeightUpdateMiddleware, epoch=sc.epoch)  # inside the key check: refused calls never count
    app.add_middleware(
        ApiKeyMiddleware,
        keys=ApiKeys.of(cfg.api_keys),
        protect=lambda path: path not in open_paths,
        max_body_bytes=cfg.max_body_bytes,
    )

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        sc.metrics.in_flight.inc()
        t0 = time.perf_counter()
        try:
            req, raw = _parse(await request.body(), cfg.engine)
            if req.stream:
                events = await _sse_events(req, raw, sc.backend)
                sc.metrics.requests.labels("/generate", "200").inc()
                return StreamingResponse(events, media_type="text/event-stream")
            out = await sc.backend.generate(req, raw)
            sc.metrics.requests.labels("/generate", "200").inc()
            return json_response(out)
        except ProxyError as e:
            return sc.fail("/generate", e)
        finally:
            sc.metrics.in_flight.dec()
            sc.metrics.request_latency.labels("/generate").observe(time.perf_counter() - t0)

    # The same handler at a path vllm-router forwards untouched (its own /generate drops rr's fields).
    app.add_api_route("/rr/generate", generate, methods=["POST"])

    async def openai(request: Request) -> Response:
        """``/v1/completions`` and ``/v1/chat/completions``: rr's fields served, everything else passed through."""
        route = request.url.path
        sc.metrics.in_flight.inc()
        t0 = time.perf_counter()
        try:
            if sc.prefill is not None:
                raise ProxyError(
                    400,
                    "bad_request",
                    f"{route}: the P/D sidecar serves /generate only (where each sample's two halves are joined)",
                )
            out = await serve_openai(sc, route, await request.body())
            sc.metrics.requests.labels(route, str(out.status_code)).inc()
            return out
        except ProxyError as e:
            return sc.fail(route, e)
        finally:
            sc.metrics.in_flight.dec()
            sc.metrics.request_latency.labels(route).observe(time.perf_counter() - t0)

    for path in OPENAI_PATHS:
        app.add_api_route(path, openai, methods=["POST"])

    async def weights(request: Request) -> Response:
        """An engine weight route: forwarded as it came, the engine's answer returned as it is."""
        route = request.url.path
        content = await request.body()
        try:  # P/D: the prefill server first, then the decode server; the first failure is the answer
            resp = await forward_weights(sc.upstreams, route, content, sc.updates)
        except ProxyError as e:
            return sc.fail(route, e)
        sc.metrics.requests.labels(route, str(resp.status_code)).inc()
        return Response(
            resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type", "application/json")
        )

    # the engine's weight routes, forwarded as they are; the updates among them are counted
    # (rr_server.serving.weight_epoch) for /rr/info weight_version and each sample's rr_provenance
    for path in find_engine(cfg.engine).weight_routes:
        app.add_api_route(path, weights, methods=["POST"])

    @app.get("/rr/info")
    async def rr_info() -> Response:
        try:
            info, _ = await sc.info()
        except ProxyError as e:
            return sc.fail("/rr/info", e)
        sc.metrics.requests.labels("/rr/info", "200").inc()
        pd = {"pd_weight_updates": sc.updates.info()} if sc.updates is not None else {}
        seen = "all" if sc.epoch.sees_all_updates else "through_sidecar"  # updates pushed past it are not seen
        return json_response(
            {**info.model_dump(), **sc.epoch.info(), "weight_updates_seen": seen, **pd, "routing_store": store.stats()}
        )

    @app.get("/health")
    async def health() -> Response:
        checks = [await up.healthy() for up in sc.upstreams]
        ok = all(c[0] for c in checks)
        msg = "; ".join(f"{up.url}: {c[1]}" for up, c in zip(sc.upstreams, checks) if not c[0])
        sc.metrics.upstream_up.set(1 if ok else 0)
        if not ok:
            return sc.fail("/health", ProxyError(503, "upstream_unhealthy", msg))
        sc.metrics.requests.labels("/health", "200").inc()
        return json_response({"status": "ok", "upstream": cfg.upstream, "engine": cfg.engine})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(sc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
