"""rr's routes and vLLM's dev-mode and engine-control routes behind vLLM's own ``--api-key`` check.

vLLM's ``AuthenticationMiddleware`` guards only paths under ``GUARDED_PREFIX`` (``/v1``, ``/v2``,
``/inference``, ``/cohere`` in 0.30-0.33), so ``/generate`` and ``/rr/*`` would be open, and so would the
routes ``VLLM_SERVER_DEV_MODE=1`` opens (``/collective_rpc`` runs any worker method) and those that drive the
engine outside dev mode (``/scale_elastic_ep``, the profiler, fault tolerance, SageMaker's ``/adapters``). rr
adds its prefixes, the dev-mode and the engine-control paths to that tuple, so the keys, the Bearer rule, the
constant-time compare and the 401 body are vLLM's own. Where a vLLM has no such tuple, rr guards those paths
with the same rule itself.
Either way :func:`protect_rr_routes` verifies the result and refuses to serve an unprotected route.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from typing import Any

from rr_client.core.errors import ConfigurationError

__all__ = [
    "RR_PREFIXES",
    "DEV_MODE_PATHS",
    "ENGINE_CONTROL_PATHS",
    "vllm_api_keys",
    "dev_route_paths",
    "engine_route_paths",
    "guarded_paths",
    "vllm_key_checks",
    "protect_rr_routes",
    "UnprotectedRoutesError",
]

logger = logging.getLogger("rr.vllm")
# Every route rr adds to vLLM's app lives under one of these.
RR_PREFIXES = ("/generate", "/rr/")
# The routes vLLM 0.30-0.33 serve only with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev/*, and from
# 0.32 vllm/entrypoints/rl/online, which took over the weight-transfer routes): none under vLLM's prefixes.
DEV_MODE_PATHS = (
    "/collective_rpc",
    "/server_info",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/release_kv_cache_memory",
    "/pause",
    "/resume",
    "/abort_requests",
    "/is_paused",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
    "/get_world_size",
)
# Routes that change the engine outside dev mode, served open by vLLM (none under its prefixes): elastic EP
# scaling, the profiler (with --profiler-config), fault tolerance (with --enable-fault-tolerance) and SageMaker's
# LoRA adapter routes (/adapters, with VLLM_ALLOW_RUNTIME_LORA_UPDATING). Read from vLLM 0.30's app.
ENGINE_CONTROL_PATHS = (
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/start_profile",
    "/stop_profile",
    "/fault_tolerance/",
    "/adapters",
)
# Modules whose routes exist only in dev mode: a route a later vLLM adds there is guarded too.
_DEV_MODULES = ("vllm.entrypoints.serve.dev.", "vllm.entrypoints.rl.")
# Modules whose routes drive the engine (scaling, profiling, fault tolerance, adapters): guarded the same way.
_ENGINE_MODULES = (
    "vllm.entrypoints.serve.elastic_ep.",
    "vllm.entrypoints.serve.profile.",
    "vllm.entrypoints.serve.fault_tolerance.",
    "vllm.entrypoints.serve.lora.",
)
_AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"


class UnprotectedRoutesError(ConfigurationError, RuntimeError):
    """vLLM was given API keys but rr cannot put its routes behind them: the server must not start."""


def vllm_api_keys(args: Any) -> list[str]:
    """The keys vLLM enforces: ``--api-key`` (repeatable) takes precedence over ``VLLM_API_KEY``, as in vLLM."""
    from vllm import envs

    cli = getattr(args, "api_key", None)
    return [k for k in (cli or [envs.VLLM_API_KEY]) if k]


def _paths_from(app: Any, modules: tuple[str, ...]) -> tuple[str, ...]:
    """Paths of ``app``'s routes whose handlers are defined in ``modules`` (a path parameter: its prefix)."""
    found: list[str] = []
    for route in getattr(app, "routes", ()):
        module = getattr(getattr(route, "endpoint", None), "__module__", "") or ""
        path = (getattr(route, "path", None) or "").split("{", 1)[0]
        if path and module.startswith(modules) and path not in found:
            found.append(path)
    return tuple(found)


def dev_route_paths(app: Any) -> tuple[str, ...]:
    """Paths of ``app``'s routes defined in vLLM's dev-mode modules (whatever this vLLM calls them)."""
    return _paths_from(app, _DEV_MODULES)


def engine_route_paths(app: Any) -> tuple[str, ...]:
    """Paths of ``app``'s routes defined in vLLM's engine-control modules (elastic EP, profiler, fault tolerance,
    LoRA), so one a later vLLM adds there is guarded too."""
    return _paths_from(app, _ENGINE_MODULES)


def guarded_paths(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every path (prefix) rr puts behind the keys: rr's own, the dev-mode and engine-control paths, and ``extra``."""
    out: list[str] = []
    for p in (*RR_PREFIXES, *DEV_MODE_PATHS, *ENGINE_CONTROL_PATHS, *extra):
        if p not in out:
            out.append(p)
    return tuple(out)


def _extend_vllm_prefixes(extra: tuple[str, ...] = ()) -> Any | None:
    """Add :func:`guarded_paths` to vLLM's guarded tuple (re-entrant); the middleware class, or None if absent."""
    import importlib

    try:
        mod = importlib.import_module(_AUTH_MODULE)
    except ImportError:
        return None
    prefixes = getattr(mod, "GUARDED_PREFIX", None)
    cls = getattr(mod, "AuthenticationMiddleware", None)
    if not isinstance(prefixes, tuple) or cls is None:
        return None
    mod.GUARDED_PREFIX = prefixes + tuple(p for p in guarded_paths(extra) if p not in prefixes)
    return cls


# Where vLLM's AuthenticationMiddleware lives: 0.29+, 0.23 - 0.28, 0.22 (read from the wheels)
_AUTH_CLASS_MODULES = (
    _AUTH_MODULE,
    "vllm.entrypoints.serve.utils.server_utils",
    "vllm.entrypoints.openai.server_utils",
)


def vllm_key_checks() -> tuple[type, ...]:
    """vLLM's own key-check middleware classes in this release (rr's weight epoch goes inside them)."""
    import importlib

    found: list[type] = []
    for name in _AUTH_CLASS_MODULES:
        try:
            cls = getattr(importlib.import_module(name), "AuthenticationMiddleware", None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def _is_rr_path(path: str) -> bool:
    return path.startswith(RR_PREFIXES)


def _guard(extra: tuple[str, ...]) -> Any:
    """``protect(path)`` for rr's own middleware: rr's paths and the dev-mode paths (prefix match, like vLLM)."""
    prefixes = guarded_paths(extra)
    return lambda path: path.startswith(prefixes)


def _probe_paths(extra: tuple[str, ...]) -> tuple[str, ...]:
    """One concrete request path per guarded entry (rr's ``/rr/`` prefix probed as ``/rr/info``)."""
    return tuple("/rr/info" if p == "/rr/" else p for p in guarded_paths(extra))


async def _probe(
    middleware_cls: Any, keys: list[str], kwargs_name: str, paths: tuple[str, ...]
) -> dict[tuple[str, str], int]:
    """Drive one instance of the middleware over ``paths``: no key, a wrong key, the first real key."""
    statuses: dict[tuple[str, str], int] = {}

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = middleware_cls(inner, **{kwargs_name: keys})
    wrong = "rr-probe-" + secrets.token_hex(16)
    for path in paths:
        for label, header in (("none", None), ("wrong", f"Bearer {wrong}"), ("right", f"Bearer {keys[0]}")):
            sent: list[int] = []

            async def send(msg: Any) -> None:
                if msg["type"] == "http.response.start":
                    sent.append(int(msg["status"]))  # noqa: B023 - awaited in this iteration

            async def receive() -> Any:
                return {"type": "http.request", "body": b"", "more_body": False}

            headers = [(b"authorization", header.encode())] if header else []
            scope = {
                "type": "http",
                "method": "POST",
                "path": path,
                "root_path": "",
                "headers": headers,
                "query_string": b"",
            }
            await mw(scope, receive, send)
            statuses[(path, label)] = sent[0] if sent else -1
    return statuses


def _self_test(middleware_cls: Any, keys: list[str], kwargs_name: str, paths: tuple[str, ...]) -> None:
    """Refuse to start unless the middleware, as configured, refuses ``paths`` without the key and admits it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # build_app may run inside vLLM's event loop
        statuses = pool.submit(asyncio.run, _probe(middleware_cls, keys, kwargs_name, paths)).result()
    bad = {k: v for k, v in statuses.items() if v != (200 if k[1] == "right" else 401)}
    if bad:
        raise UnprotectedRoutesError(
            f"rr's routes or vLLM's dev-mode or engine-control routes are not protected by {middleware_cls.__name__} "
            "as expected: "
            f"{bad}; refusing to start"
        )


def _dev_mode_on() -> bool:
    from vllm import envs

    return bool(envs.VLLM_SERVER_DEV_MODE)


def protect_rr_routes(app: Any, args: Any) -> str:
    """Put rr's routes and vLLM's dev-mode and engine-control routes behind vLLM's keys; return how (for the log).

    Raises :class:`UnprotectedRoutesError` when keys are set and a guarded path would still answer without one.
    """
    keys = vllm_api_keys(args)
    dev = dev_route_paths(app) + engine_route_paths(app)
    vllm_cls = _extend_vllm_prefixes(dev)
    if not keys:
        if _dev_mode_on():
            logger.warning(
                "rr: VLLM_SERVER_DEV_MODE=1 without --api-key / VLLM_API_KEY: /collective_rpc and "
                "vLLM's other dev-mode routes answer anyone who reaches this server"
            )
        return "no --api-key / VLLM_API_KEY: rr routes are open, like vLLM's own"
    paths = _probe_paths(dev)
    if vllm_cls is not None:
        if not any(getattr(m, "cls", None) is vllm_cls for m in app.user_middleware):
            raise UnprotectedRoutesError(
                "vLLM was given an API key but its AuthenticationMiddleware is not on the app; "
                "refusing to serve rr's routes and vLLM's dev-mode routes unprotected"
            )
        _self_test(vllm_cls, keys, "tokens", paths)
        return (
            "vLLM's AuthenticationMiddleware (rr prefixes, engine-control and dev-mode paths added to "
            "GUARDED_PREFIX; self-test passed)"
        )
    from rr_server.serving.auth import ApiKeyMiddleware, ApiKeys
    from rr_server.serving.http import add_middleware

    protect = _guard(dev)
    add_middleware(app, ApiKeyMiddleware, keys=ApiKeys.of(keys), protect=protect)  # outermost, stack rebuilt
    _self_test(lambda inner, keys: ApiKeyMiddleware(inner, keys=ApiKeys.of(keys), protect=protect), keys, "keys", paths)
    logger.warning(
        "rr: vLLM has no %s.GUARDED_PREFIX; rr guards its own and the dev-mode routes with the same keys", _AUTH_MODULE
    )
    return "rr's ApiKeyMiddleware with vLLM's keys (self-test passed)"
