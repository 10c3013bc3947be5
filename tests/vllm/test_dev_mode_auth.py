"""vLLM's dev-mode routes behind ``--api-key`` on a real vLLM CPU server (issue 29).

``VLLM_SERVER_DEV_MODE=1 rr-server launch vllm ... --api-key K``: ``/collective_rpc`` (runs any worker method),
``/reset_prefix_cache`` and ``/is_sleeping`` answer 401 without the key or with a wrong one (vLLM's own
middleware and body), 200 with it, and the server keeps serving. Without a key on a non-loopback host the
launcher refuses before starting anything.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_server.launch.vllm import OPEN_DEV_MODE_FLAG
from tests.support.vllm_process import VLLMProcess, launcher_command, server_args

pytestmark = pytest.mark.vllm_server

KEY = "dev-key"
WRONG = "not-the-key"
# (method, path, JSON body, expected answer with the key); every call harmless for the server
DEV_ROUTES = [
    ("POST", "/collective_rpc", {"method": "check_health"}, {"results": [None]}),
    ("POST", "/reset_prefix_cache", None, {"success": True}),
    ("GET", "/is_sleeping", None, {"is_sleeping": False}),
]


def _call(base: str, method: str, path: str, body: Any, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, base + path, json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def dev_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """``VLLM_SERVER_DEV_MODE=1 rr-server launch vllm ... --api-key dev-key``."""
    server = VLLMProcess(
        tiny_models["qwen3_dense"], name="qwen3-dev", extra=["--api-key", KEY], env={"VLLM_SERVER_DEV_MODE": "1"}
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("method,path,body,answer", DEV_ROUTES, ids=[r[1] for r in DEV_ROUTES])
def test_dev_routes_need_the_key(dev_server: VLLMProcess, method: str, path: str, body: Any, answer: Any) -> None:
    for key in (None, WRONG):
        r = _call(dev_server.base_url, method, path, body, key)
        assert r.status_code == 401, (key, r.status_code, r.text)
        assert r.json() == {"error": "Unauthorized"}  # vLLM's own middleware answered
    r = _call(dev_server.base_url, method, path, body, KEY)
    assert r.status_code == 200, r.text
    assert r.json() == answer


def test_server_keeps_serving(dev_server: VLLMProcess) -> None:
    base = dev_server.base_url
    assert _call(base, "POST", "/collective_rpc", {"method": "check_health"}, None).status_code == 401
    assert _call(base, "GET", "/health", None, None).status_code == 200  # open, as in vLLM
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
        "return_routed_experts": True,
    }
    assert _call(base, "POST", "/generate", body, None).status_code == 401
    r = _call(base, "POST", "/generate", body, KEY)
    assert r.status_code == 200 and r.json()["meta_info"]["routed_experts_shape"] == [4, 3, 2]
    assert dev_server.alive()


def test_launcher_refuses_open_dev_mode(tiny_models: dict[str, Path]) -> None:
    """The real ``rr-server launch vllm``: dev mode on every interface without a key exits 2 before vLLM starts."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | {"VLLM_SERVER_DEV_MODE": "1"}
    args = server_args(tiny_models["qwen3_dense"], port=1)
    args[args.index("--host") + 1] = "0.0.0.0"
    done = subprocess.run(launcher_command(args), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    for name in ("VLLM_SERVER_DEV_MODE", "--host 0.0.0.0", "--api-key", OPEN_DEV_MODE_FLAG):
        assert name in done.stderr, (name, done.stderr)
    assert "api_server" not in done.stderr  # refused before the vLLM command was built or logged
