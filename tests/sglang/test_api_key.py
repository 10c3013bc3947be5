"""SGLang's own API-key middleware covers rr's ``GET /rr/info`` (issue #11), on SGLang's real app.

rr adds no authentication of its own on SGLang: ``/rr/info`` is an ordinary route on SGLang's FastAPI app
(``sglang.srt.entrypoints.http_server.app``), so whatever SGLang's launcher puts in front of that app
for ``--api-key`` must guard it exactly as it guards SGLang's own ``/generate``. These tests check that
with SGLang's own middleware code doing the checking, wired exactly as each version's launcher
(``launch_server``) wires it:

- 0.5.7: ``from sglang.srt.utils import add_api_key_middleware`` and, when ``server_args.api_key`` is set,
  ``add_api_key_middleware(app, server_args.api_key)``: a function middleware
  (``@app.middleware("http")``, so Starlette's BaseHTTPMiddleware) that requires exactly
  ``Authorization: Bearer <key>`` on every path except ``/health*`` and ``/metrics*``.
- 0.5.9+: ``from sglang.srt.utils.auth import add_api_key_middleware`` and, when ``api_key`` or
  ``admin_api_key`` is set or the app has an ADMIN_FORCE route (``app_has_admin_force_endpoints``),
  ``add_api_key_middleware(app, api_key=..., admin_api_key=...)``: a pure-ASGI middleware that resolves
  the matched route's ``@auth_level`` per request. A route without the ``_auth_level`` attribute (rr's)
  is NORMAL: it needs exactly ``--api-key`` when that is set (the admin key is not accepted), and is
  open otherwise. 0.5.23 reads the keys from ``get_serving()`` (the config the process published)
  instead of ``server_args``; the values are the same.

How the middleware gets onto the app without breaking other tests: the app is a module-level singleton,
and Starlette refuses ``add_middleware`` once the app has served a request (``middleware_stack`` is
built). The fixture ``launcher_auth`` therefore saves ``app.user_middleware`` and ``app.middleware_stack``,
sets ``middleware_stack`` back to None, makes the launcher's own call on the real ``http_server.app``,
and restores both lists afterwards. Requests then go through ``http_server.app`` itself, so Starlette
builds the stack exactly as in production (SGLang's auth middleware outermost among the user
middlewares, around CORS and the router, and with the real app as 0.5.9+'s ``fastapi_app`` for route
matching). Nothing rr-side checks keys here; the test only asserts what SGLang's middleware answers.
The route is added before the middleware, as in production (the TokenizerManager, whose patched
``__init__`` adds ``/rr/info``, is built before ``launch_server`` wires authentication).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client.core.info import RRInfo
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.conftest import HAVE
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang

KEY = "rr-test-api-key"
ADMIN_KEY = "rr-test-admin-key"
# sglang.srt.utils.auth (per-route auth levels); without SGLang (main venv) these tests are deselected,
# but the module must still import there
HAS_AUTH_LEVELS = HAVE is not None and profile_for().release >= (0, 5, 8)  # 0.5.8 added sglang.srt.utils.auth
needs_auth_levels = pytest.mark.sglang_since("0.5.8")  # SGLang < 0.5.8 has no auth levels / admin key


def _wire_like_launcher(app: Any, server_args: Any) -> bool:
    """Make the call SGLang's ``launch_server`` makes for API keys; True when it added a middleware."""
    from sglang.srt.entrypoints import http_server

    if not HAS_AUTH_LEVELS:  # 0.5.7 only; http_server.py:1731-1733 (module-level import from sglang.srt.utils)
        from sglang.srt.utils import add_api_key_middleware

        assert http_server.add_api_key_middleware is add_api_key_middleware  # what the launcher calls
        if server_args.api_key:
            add_api_key_middleware(app, server_args.api_key)
            return True
        return False
    # 0.5.9 http_server.py:1939-1950, 0.5.12 :2191-2202, 0.5.23 :2887-2898 (keys from get_serving())
    from sglang.srt.utils.auth import (
        add_api_key_middleware,
        app_has_admin_force_endpoints,
    )

    get_serving = getattr(http_server, "get_serving", None)
    keys = get_serving() if get_serving is not None else server_args
    assert (keys.api_key, keys.admin_api_key) == (server_args.api_key, server_args.admin_api_key)
    if keys.api_key or keys.admin_api_key or app_has_admin_force_endpoints(app):
        add_api_key_middleware(app, api_key=keys.api_key, admin_api_key=keys.admin_api_key)
        return True
    return False


@pytest.fixture()
def launcher_auth() -> Iterator[Callable[[Harness], bool]]:
    """``wire(h)``: SGLang's API-key middleware on the real app for ``h``'s ServerArgs; undone at teardown."""
    from sglang.srt.entrypoints.http_server import app

    saved_user = list(app.user_middleware)
    saved_stack = app.middleware_stack

    def wire(h: Harness) -> bool:
        assert h.server_args.tokenizer_worker_num == 1  # the launcher wires auth in single-tokenizer mode only
        before = list(app.user_middleware)
        app.middleware_stack = None  # let add_middleware through; Starlette rebuilds the stack on the next call
        added = _wire_like_launcher(app, h.server_args)
        new = [m for m in app.user_middleware if m not in before]
        assert len(new) == int(added), f"expected {int(added)} new middleware, got {new}"
        if added:
            assert app.user_middleware[0] is new[0]  # outermost user middleware, as in production
        return added

    try:
        yield wire
    finally:
        app.user_middleware[:] = saved_user
        app.middleware_stack = saved_stack


def _client(h: Harness, authorization: str | None = None) -> httpx.AsyncClient:
    """A client on SGLang's real app (``http_server.app``), optionally sending ``Authorization``."""
    headers = {"Authorization": authorization} if authorization is not None else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=h.http.app), base_url="http://sglang", headers=headers, timeout=60
    )


async def _get_info(h: Harness, authorization: str | None = None) -> httpx.Response:
    async with _client(h, authorization) as c:
        return await c.get("/rr/info")


def _assert_info(resp: httpx.Response) -> RRInfo:
    """A 200 with a valid RRInfo for the tiny model."""
    assert resp.status_code == 200, resp.text
    info = RRInfo.model_validate(resp.json())
    assert info.engine == "sglang" and info.engine_version == profile_for().version
    assert (info.num_hidden_layers, info.num_experts, info.topk) == (3, 8, 2)
    return info


def _assert_unauthorized(resp: httpx.Response) -> None:
    """SGLang's own rejection (every version): 401 ``{"error": "Unauthorized"}``."""
    assert resp.status_code == 401, resp.text
    assert resp.json() == {"error": "Unauthorized"}


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {KEY}-wrong", "Bearer ", KEY, f"Basic {KEY}"],
    ids=["no_header", "wrong_key", "empty_key", "no_scheme", "basic_scheme"],
)
async def test_rr_info_rejected_without_the_api_key(
    tiny_moe: Path, patched: None, launcher_auth: Any, authorization: str | None
) -> None:
    """``--api-key``: ``/rr/info`` without the right ``Bearer`` key is refused by SGLang's middleware."""
    h = Harness(tiny_moe, api_key=KEY)
    assert launcher_auth(h)
    _assert_unauthorized(await _get_info(h, authorization))


async def test_rr_info_with_the_api_key(tiny_moe: Path, patched: None, launcher_auth: Any) -> None:
    """``--api-key``: ``Authorization: Bearer <key>`` reaches rr's route and gets a valid RRInfo."""
    h = Harness(tiny_moe, api_key=KEY)
    assert launcher_auth(h)
    _assert_info(await _get_info(h, f"Bearer {KEY}"))


async def test_sglang_routes_behave_the_same(tiny_moe: Path, patched: None, launcher_auth: Any) -> None:
    """Sanity on the same wiring: SGLang's ``/generate`` is refused without the key and served with it;
    ``/health`` stays open (SGLang exempts it; it answers 503 here since the server never finished starting)."""
    h = Harness(tiny_moe, api_key=KEY)
    assert launcher_auth(h)
    body = {
        "input_ids": [3, 17, 29, 41],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
        "return_routed_experts": True,
    }
    async with _client(h) as c:
        _assert_unauthorized(await c.post("/generate", json=body))
        health = await c.get("/health")
    assert health.status_code != 401, health.text
    status, out = await h.post(body, via=_client(h, f"Bearer {KEY}"))
    assert status == 200, out
    assert out["meta_info"]["routed_experts_format"] == "npy"  # through the middleware to rr's patched answer


async def test_rr_info_open_without_a_key(tiny_moe: Path, patched: None, launcher_auth: Any) -> None:
    """No key configured: ``/rr/info`` answers 200 without any header (0.5.9+: even if the launcher
    installed the middleware for SGLang's ADMIN_FORCE routes)."""
    h = Harness(tiny_moe)
    launcher_auth(h)
    _assert_info(await _get_info(h))


@needs_auth_levels
async def test_rr_info_endpoint_has_normal_auth_level(tiny_moe: Path, patched: None) -> None:
    """0.5.9+: rr's endpoint carries no ``@auth_level`` mark, so SGLang resolves ``GET /rr/info`` as NORMAL."""
    from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope

    from rr_patches.sglang.routes import _rr_info_endpoint

    h = Harness(tiny_moe)
    app = h.http.app
    routes = [r for r in app.router.routes if getattr(r, "path", None) == "/rr/info"]
    assert len(routes) == 1 and routes[0].endpoint is _rr_info_endpoint
    assert not hasattr(_rr_info_endpoint, "_auth_level")  # what sglang.srt.utils.auth.auth_level() sets
    scope = {"type": "http", "method": "GET", "path": "/rr/info", "root_path": "", "headers": []}
    assert _get_auth_level_from_app_and_scope(app, scope) is AuthLevel.NORMAL


@needs_auth_levels
@pytest.mark.parametrize(
    "authorization,ok",
    [(f"Bearer {KEY}", True), (f"Bearer {ADMIN_KEY}", False), (None, False)],
    ids=["api_key", "admin_key", "no_header"],
)
async def test_rr_info_needs_exactly_the_api_key(
    tiny_moe: Path, patched: None, launcher_auth: Any, authorization: str | None, ok: bool
) -> None:
    """0.5.9+ with ``--api-key`` and ``--admin-api-key``: NORMAL routes take the API key, not the admin key."""
    h = Harness(tiny_moe, api_key=KEY, admin_api_key=ADMIN_KEY)
    assert launcher_auth(h)
    resp = await _get_info(h, authorization)
    if ok:
        _assert_info(resp)
    else:
        _assert_unauthorized(resp)


@needs_auth_levels
async def test_rr_info_with_only_an_admin_key_is_like_generate(
    tiny_moe: Path, patched: None, launcher_auth: Any
) -> None:
    """0.5.9+ with only ``--admin-api-key``: SGLang leaves NORMAL routes open, ``/rr/info`` as ``/generate``.

    That is SGLang's documented NORMAL semantics (auth.py: "otherwise allow (including the admin_api_key
    only case)"); rr follows it rather than guarding its route more strictly than SGLang's own.
    """
    h = Harness(tiny_moe, admin_api_key=ADMIN_KEY)
    assert launcher_auth(h)
    _assert_info(await _get_info(h))


@pytest.mark.sglang_before("0.5.8")  # 0.5.8+ has auth levels: tested by the three tests above
def test_before_0_5_8_there_is_no_admin_key_to_bypass() -> None:
    """< 0.5.8 (0.5.7): no ``--admin-api-key`` and no auth levels, so the single ``--api-key`` rule above is the whole story."""
    import importlib.util

    from sglang.srt.server_args import ServerArgs

    assert "admin_api_key" not in ServerArgs.__dataclass_fields__
    assert importlib.util.find_spec("sglang.srt.utils.auth") is None


async def test_every_route_but_health_metrics_ready_needs_the_key(
    tiny_moe: Path, patched: None, launcher_auth: Any
) -> None:
    """Issue 36: with ``--api-key`` every route of SGLang's real app (its weight, cache, profiler, LoRA and other
    engine-changing routes, and rr's) refuses a request without the key; only ``/health*``, ``/metrics*`` and
    (0.5.20+) ``/ready*`` pass, as docs/security.md says. The middleware answers before any handler runs."""
    h = Harness(tiny_moe, api_key=KEY)
    assert launcher_auth(h)
    open_prefixes = ("/health", "/metrics", "/ready")
    routes = [
        (sorted(getattr(r, "methods", None) or ["GET"]), r.path)
        for r in h.http.app.router.routes
        if getattr(r, "path", "").startswith("/")
    ]
    assert len(routes) > 30 and any(p == "/rr/info" for _, p in routes)
    wrong = {}
    async with _client(h) as c:
        for methods, path in routes:
            if path.startswith(open_prefixes) or path in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"):
                continue
            method = "POST" if "POST" in methods else methods[0]
            resp = await c.request(method, path.replace("{", "").replace("}", ""), json={})
            if resp.status_code not in (401, 403):
                wrong[f"{method} {path}"] = resp.status_code
    assert wrong == {}
