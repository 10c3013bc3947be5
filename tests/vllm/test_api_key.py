"""API keys on real servers: a vLLM CPU server started through ``rr-server launch vllm --api-key``, and the
sidecar with ``--api-key`` / ``--upstream-api-key`` in front of it (issue 11).

Every rr route refuses no key and a wrong key, serves the right one; vLLM's own routes behave as before;
a wrong upstream key is the upstream's failure (502), an oversized body is 413 and the sidecar keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client import AuthenticationError, RoutedExpertsClient, RRInfo
from rr_server.proxy.app import ProxyConfig
from tests.support.proxy_harness import SidecarServer
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server

KEYS = ("key-one", "key-two")  # vLLM takes several keys after one --api-key
WRONG = "not-the-key"
RR_ROUTES = [
    (
        "POST",
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            "return_routed_experts": True,
        },
    ),
    ("GET", "/rr/info", None),
]


def _call(base: str, method: str, path: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, base + path, json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def keyed_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """``rr-server launch vllm ... --api-key key-one key-two``."""
    server = VLLMProcess(tiny_models["qwen3_dense"], name="qwen3-keyed", extra=["--api-key", *KEYS]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed_sidecar(keyed_server: VLLMProcess, tiny_models: dict[str, Path]) -> Iterator[SidecarServer]:
    cfg = ProxyConfig(
        upstream=keyed_server.base_url,
        engine="vllm",
        api_keys=("side-key",),
        upstream_api_key=KEYS[1],
        max_body_bytes=4096,
    )
    with SidecarServer(cfg) as sc:
        yield sc


@pytest.mark.parametrize("method,path,body", RR_ROUTES, ids=[r[1] for r in RR_ROUTES])
def test_patched_vllm_rr_routes_need_the_key(keyed_server: VLLMProcess, method: str, path: str, body: Any) -> None:
    for key in (None, WRONG):
        r = _call(keyed_server.base_url, method, path, body, key)
        assert r.status_code == 401, (key, r.status_code, r.text)
        assert r.json() == {"error": "Unauthorized"}  # vLLM's own body: its middleware answered
    for key in KEYS:  # every configured key works
        r = _call(keyed_server.base_url, method, path, body, key)
        assert r.status_code == 200, r.text
    if path == "/rr/info":
        RRInfo.model_validate(r.json())
    else:
        assert r.json()["meta_info"]["routed_experts_shape"] == [3 + 2 - 1, 3, 2]


def test_patched_vllm_own_routes_unchanged(keyed_server: VLLMProcess) -> None:
    base = keyed_server.base_url
    assert _call(base, "GET", "/health", None, None).status_code == 200  # open, as in vLLM
    assert _call(base, "GET", "/v1/models", None, None).status_code == 401
    assert _call(base, "GET", "/v1/models", None, WRONG).status_code == 401
    assert _call(base, "GET", "/v1/models", None, KEYS[0]).status_code == 200
    body = {"model": "qwen3-keyed", "prompt": [1, 2, 3], "max_tokens": 2}
    assert _call(base, "POST", "/v1/completions", body, None).status_code == 401
    r = _call(base, "POST", "/v1/completions", body, KEYS[0])
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) >= 0


def test_client_api_key_and_authentication_error(keyed_server: VLLMProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run(key: str | None) -> Any:
        async with RoutedExpertsClient(keyed_server.base_url, api_key=key, retries=3, backoff=5.0) as c:
            return await c.generate([[1, 2, 3]], {"max_new_tokens": 2, "ignore_eos": True})

    monkeypatch.delenv("RR_API_KEY", raising=False)
    with pytest.raises(AuthenticationError) as e:  # backoff=5 s x 3 retries would show as a slow test: never retried
        asyncio.run(run(WRONG))
    assert e.value.status_code == 401 and "authentication failed" in str(e.value)
    batch = asyncio.run(run(KEYS[0]))
    assert batch[0].routed_experts is not None and batch[0].routed_experts.shape == (4, 3, 2)
    monkeypatch.setenv("RR_API_KEY", KEYS[1])  # the environment variable is read when api_key is not given
    assert asyncio.run(run(None))[0].routed_experts is not None


@pytest.mark.parametrize("method,path,body", RR_ROUTES, ids=[r[1] for r in RR_ROUTES])
def test_sidecar_routes_need_its_key(keyed_sidecar: SidecarServer, method: str, path: str, body: Any) -> None:
    for key in (None, WRONG, KEYS[0]):  # the engine's key is not the sidecar's
        r = _call(keyed_sidecar.url, method, path, body, key)
        assert r.status_code == 401, (key, r.text)
    r = _call(keyed_sidecar.url, method, path, body, "side-key")
    assert r.status_code == 200, r.text


def test_sidecar_open_paths(keyed_sidecar: SidecarServer) -> None:
    assert _call(keyed_sidecar.url, "GET", "/health", None, None).status_code == 200
    assert _call(keyed_sidecar.url, "GET", "/metrics", None, None).status_code == 200  # open by default


def test_sidecar_wrong_upstream_key_is_a_502(keyed_server: VLLMProcess) -> None:
    cfg = ProxyConfig(upstream=keyed_server.base_url, engine="vllm", api_keys=("side-key",), upstream_api_key=WRONG)
    with SidecarServer(cfg) as sc:
        body = RR_ROUTES[0][2]
        r = _call(sc.url, "POST", "/generate", body, "side-key")
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["kind"] == "upstream_auth" and "upstream authentication failed" in err["message"]


def test_sidecar_oversized_body_413_then_serves(keyed_sidecar: SidecarServer) -> None:
    big = {"input_ids": list(range(1, 2000)), "sampling_params": {"max_new_tokens": 1}}  # > 4096 bytes as JSON
    r = _call(keyed_sidecar.url, "POST", "/generate", big, "side-key")
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    chunked = httpx.post(
        keyed_sidecar.url + "/generate",
        headers={"authorization": "Bearer side-key"},
        content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]),
        timeout=30,
    )  # no content-length
    assert chunked.status_code == 413
    r = _call(keyed_sidecar.url, *RR_ROUTES[0][:2], RR_ROUTES[0][2], "side-key")
    assert r.status_code == 200 and r.json()["meta_info"]["routed_experts_shape"] == [4, 3, 2]


def test_sidecar_metrics_can_require_the_key(keyed_server: VLLMProcess) -> None:
    cfg = ProxyConfig(
        upstream=keyed_server.base_url,
        engine="vllm",
        api_keys=("side-key",),
        upstream_api_key=KEYS[0],
        metrics_require_key=True,
    )
    with SidecarServer(cfg) as sc:
        assert _call(sc.url, "GET", "/metrics", None, None).status_code == 401
        assert _call(sc.url, "GET", "/metrics", None, "side-key").status_code == 200
        assert _call(sc.url, "GET", "/health", None, None).status_code == 200
