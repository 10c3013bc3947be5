"""rr's routes behind vLLM's own ``--api-key`` check.

vLLM's ``AuthenticationMiddleware`` guards only paths under ``GUARDED_PREFIX`` (``/v1``, ``/v2``,
``/inference``, ``/cohere`` in 0.30), so ``/generate`` and ``/rr/*`` would be open. rr adds its
prefixes to that tuple, so the keys, the Bearer rule, the constant-time compare and the 401 body are
vLLM's own. Where a vLLM has no such tuple, rr guards its paths with the same rule itself. Either way
:func:`protect_rr_routes` verifies the result and refuses to serve an unprotected route.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from typing import Any

__all__ = ["RR_PREFIXES", "vllm_api_keys", "protect_rr_routes", "UnprotectedRoutesError"]

logger = logging.getLogger("rr.vllm")
# Every route rr adds to vLLM's app lives under one of these.
RR_PREFIXES = ("/generate", "/rr/")
_AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"


class UnprotectedRoutesError(RuntimeError):
    """vLLM was given API keys but rr cannot put its routes behind them: the server must not start."""


def vllm_api_keys(args: Any) -> list[str]:
    """The keys vLLM enforces: ``--api-key`` (repeatable) takes precedence over ``VLLM_API_KEY``, as in vLLM."""
    from vllm import envs

    cli = getattr(args, "api_key", None)
    return [k for k in (cli or [envs.VLLM_API_KEY]) if k]


def _extend_vllm_prefixes() -> Any | None:
    """Add rr's prefixes to vLLM's guarded tuple (re-entrant); the middleware class, or None if absent."""
    import importlib

    try:
        mod = importlib.import_module(_AUTH_MODULE)
    except ImportError:
        return None
    prefixes = getattr(mod, "GUARDED_PREFIX", None)
    cls = getattr(mod, "AuthenticationMiddleware", None)
    if not isinstance(prefixes, tuple) or cls is None:
        return None
    mod.GUARDED_PREFIX = prefixes + tuple(p for p in RR_PREFIXES if p not in prefixes)
    return cls


def _is_rr_path(path: str) -> bool:
    return path.startswith(RR_PREFIXES)


async def _probe(middleware_cls: Any, keys: list[str], kwargs_name: str) -> dict[tuple[str, str], int]:
    """Drive one instance of the middleware over rr's paths: no key, a wrong key, the first real key."""
    statuses: dict[tuple[str, str], int] = {}

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = middleware_cls(inner, **{kwargs_name: keys})
    wrong = "rr-probe-" + secrets.token_hex(16)
    for path in ("/generate", "/rr/info"):
        for label, header in (("none", None), ("wrong", f"Bearer {wrong}"), ("right", f"Bearer {keys[0]}")):
            sent: list[int] = []

            async def send(msg: Any) -> None:
                if msg["type"] == "http.response.start":
                    sent.append(int(msg["status"]))

            async def receive() -> Any:
                return {"type": "http.request", "body": b"", "more_body": False}

            headers = [(b"authorization", header.encode())] if header else []
            scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers,
                     "query_string": b""}
            await mw(scope, receive, send)
            statuses[(path, label)] = sent[0] if sent else -1
    return statuses


def _self_test(middleware_cls: Any, keys: list[str], kwargs_name: str) -> None:
    """Refuse to start unless the middleware, as configured, refuses rr's paths without the key and admits it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # build_app may run inside vLLM's event loop
        statuses = pool.submit(asyncio.run, _probe(middleware_cls, keys, kwargs_name)).result()
    bad = {k: v for k, v in statuses.items() if v != (200 if k[1] == "right" else 401)}
    if bad:
        raise UnprotectedRoutesError(
            f"rr's routes are not protected by {middleware_cls.__name__} as expected: {bad}; refusing to start")


def protect_rr_routes(app: Any, args: Any) -> str:
    """Put rr's routes behind vLLM's keys; return how (for the log). Raises UnprotectedRoutesError."""
    keys = vllm_api_keys(args)
    vllm_cls = _extend_vllm_prefixes()
    if not keys:
        return "no --api-key / VLLM_API_KEY: rr routes are open, like vLLM's own"
    if vllm_cls is not None:
        if not any(getattr(m, "cls", None) is vllm_cls for m in app.user_middleware):
            raise UnprotectedRoutesError(
                "vLLM was given an API key but its AuthenticationMiddleware is not on the app; "
                "refusing to serve rr's routes unprotected")
        _self_test(vllm_cls, keys, "tokens")
        return "vLLM's AuthenticationMiddleware (rr prefixes added to GUARDED_PREFIX; self-test passed)"
    from rr_server.serving.auth import ApiKeyMiddleware, ApiKeys

    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys.of(keys), protect=_is_rr_path)
    _self_test(lambda inner, keys: ApiKeyMiddleware(inner, keys=ApiKeys.of(keys), protect=_is_rr_path), keys, "keys")
    logger.warning("rr: vLLM has no %s.GUARDED_PREFIX; rr guards its own routes with the same keys", _AUTH_MODULE)
    return "rr's ApiKeyMiddleware with vLLM's keys (self-test passed)"
