"""API-key checks without a server: rr's ASGI middleware (sidecar) and the vLLM plugin's use of vLLM's own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from rr_patches.vllm import auth as vllm_auth
from rr_server.serving.auth import ApiKeyMiddleware, ApiKeys, keys_from


def _app(**kw: Any) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def gen(body: dict[str, Any]) -> dict[str, Any]:
        return {"got": len(body)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(ApiKeyMiddleware, **kw)
    return app


def _post(app: FastAPI, path: str, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request("POST" if path != "/health" else "GET", path, headers=headers, **kw)

    return asyncio.run(run())


def test_api_keys_accept_only_bearer_of_a_configured_key() -> None:
    keys = ApiKeys.of(["a", "b", ""])
    assert keys and len(keys.digests) == 2
    assert keys.accepts("Bearer a") and keys.accepts("Bearer b")
    assert not keys.accepts("Bearer c") and not keys.accepts("a") and not keys.accepts(None)
    assert not keys.accepts("Basic a") and not keys.accepts("Bearer ")
    assert not ApiKeys.of([])


def test_keys_from_cli_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RR_API_KEY", "env-key")
    assert keys_from(["x", "y"], "RR_API_KEY") == ["x", "y", "env-key"]
    monkeypatch.delenv("RR_API_KEY")
    assert keys_from(None, "RR_API_KEY") == []


def test_middleware_401_and_open_paths() -> None:
    app = _app(keys=ApiKeys.of(["k"]), protect=lambda p: p != "/health")
    r = _post(app, "/generate", json={"a": 1})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert _post(app, "/generate", {"authorization": "Bearer nope"}, json={"a": 1}).status_code == 401
    assert _post(app, "/generate", {"authorization": "Bearer k"}, json={"a": 1}).json() == {"got": 1}
    assert _post(app, "/health").status_code == 200


def test_middleware_without_keys_is_open() -> None:
    app = _app(keys=ApiKeys.of([]), protect=lambda p: True)
    assert _post(app, "/generate", json={"a": 1, "b": 2}).json() == {"got": 2}


async def _chunks(*parts: bytes) -> Any:
    """An async body without a content-length (sent chunked)."""
    for p in parts:
        yield p


def test_middleware_413_by_content_length_and_by_counting_chunks() -> None:
    app = _app(keys=ApiKeys.of([]), protect=lambda p: True, max_body_bytes=100)
    r = _post(app, "/generate", json={"x": "y" * 200})
    assert r.status_code == 413 and "100 bytes" in r.json()["error"]["message"]
    r = _post(app, "/generate", content=_chunks(b'{"x": "', b"y" * 150, b'"}'))  # chunked: no content-length
    assert r.status_code == 413
    r = _post(app, "/generate", {"content-type": "application/json"}, content=_chunks(b'{"x": ', b'"y"}'))
    assert r.status_code == 200 and r.json() == {"got": 1}


def _vllm_app_with_auth(tokens: list[str]) -> FastAPI:
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    app = FastAPI()
    app.add_middleware(AuthenticationMiddleware, tokens=tokens)
    return app


def test_vllm_plugin_puts_rr_prefixes_behind_vllms_own_middleware() -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    app = _vllm_app_with_auth(["k1", "k2"])
    how = vllm_auth.protect_rr_routes(app, SimpleNamespace(api_key=["k1", "k2"]))
    assert "AuthenticationMiddleware" in how and "self-test passed" in how
    assert set(vllm_auth.RR_PREFIXES) <= set(authenticate.GUARDED_PREFIX)
    assert authenticate.GUARDED_PREFIX[:4] == ("/v1", "/v2", "/inference", "/cohere")  # vLLM's own stay first
    vllm_auth.protect_rr_routes(_vllm_app_with_auth(["k1"]), SimpleNamespace(api_key=["k1"]))  # re-entrant
    assert len(authenticate.GUARDED_PREFIX) == len(set(authenticate.GUARDED_PREFIX))


def test_vllm_plugin_refuses_when_vllms_middleware_would_not_guard_rr_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A future vLLM whose middleware stops reading GUARDED_PREFIX: the server must not start."""
    from vllm.entrypoints.serve.middleware import authenticate

    original = authenticate.AuthenticationMiddleware.__call__

    def only_v1(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        if scope.get("path", "").startswith("/v1"):
            return original(self, scope, receive, send)
        return self.app(scope, receive, send)

    monkeypatch.setattr(authenticate.AuthenticationMiddleware, "__call__", only_v1)
    with pytest.raises(vllm_auth.UnprotectedRoutesError, match="not protected"):
        vllm_auth.protect_rr_routes(_vllm_app_with_auth(["k"]), SimpleNamespace(api_key=["k"]))


def test_vllm_plugin_refuses_keys_without_vllms_middleware() -> None:
    with pytest.raises(vllm_auth.UnprotectedRoutesError, match="not on the app"):
        vllm_auth.protect_rr_routes(FastAPI(), SimpleNamespace(api_key=["k"]))


def test_vllm_keys_follow_vllms_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "env")
    assert vllm_auth.vllm_api_keys(SimpleNamespace(api_key=None)) == ["env"]
    assert vllm_auth.vllm_api_keys(SimpleNamespace(api_key=["cli"])) == ["cli"]  # --api-key wins, as in vLLM
    monkeypatch.delenv("VLLM_API_KEY")
    assert vllm_auth.vllm_api_keys(SimpleNamespace(api_key=None)) == []
