"""rr's weight-epoch middleware sits inside vLLM's key check, with a body cap (issue 55, item 9).

vLLM 0.22 - 0.29 get rr's routes from the general plugin's ``build_app`` wrap: vLLM's ``build_app`` has already put
its ``AuthenticationMiddleware`` on the app when rr adds its own, and Starlette makes the last one added the
outermost, so the epoch middleware (which reads a ``/collective_rpc`` body to see its method) read any body before
the 401. The app here is that composition: the installed vLLM 0.30's real ``build_app`` (its auth middleware is
0.29's, byte for byte: ``vllm/entrypoints/serve/middleware/authenticate.py``) wrapped by rr's
``_wrap_build_app``, endpoint plugins off; and 0.22 - 0.28's, where vLLM's class lives elsewhere and rr adds its own
``ApiKeyMiddleware`` last. A keyless request with a large chunked body is answered 401 having consumed no chunk; a
keyed one over the cap gets a 413 with a message, having consumed no more than the cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from rr_patches.vllm import auth as vllm_auth
from rr_patches.vllm.kv_tiers import VLLMWeightUpdateMiddleware

KEY = "epoch-key"
CHUNK = b"x" * 4096
CHUNKS = 64  # 256 KiB, sent in pieces with more_body


@pytest.fixture(params=["0.29: vLLM's AuthenticationMiddleware", "0.22-0.28: rr's ApiKeyMiddleware"])
def wrapped_app(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's real app through rr's build_app wrap (dev mode, a key), as the general plugin makes it before 0.30."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rr_patches.vllm.plugin import _wrap_build_app

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("RR_ENABLE", raising=False)  # rr's endpoint plugin stays inert: the wrap adds the routes
    if request.param.startswith("0.22"):  # vLLM's class is not where rr extends its prefixes: rr's own guard
        monkeypatch.setattr(vllm_auth, "_AUTH_MODULE", "vllm.entrypoints.no_such_module")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--api-key", KEY])
    app = _wrap_build_app(build_app)(args, supported_tasks=("generate",))
    assert app.state.rr_routes_installed
    yield app


def _call(app: Any, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes, int]:
    """POST /collective_rpc with a chunked body of :data:`CHUNKS` chunks; (status, body, chunks consumed)."""
    consumed = 0
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal consumed
        if consumed >= CHUNKS:
            await asyncio.sleep(3600)  # the client waits for the answer
        consumed += 1
        return {"type": "http.request", "body": CHUNK, "more_body": consumed < CHUNKS}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/collective_rpc",
        "raw_path": b"/collective_rpc",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }
    asyncio.run(app(scope, receive, send))
    return out["status"], out["body"], consumed


def test_a_keyless_weight_route_body_is_refused_before_it_is_read(wrapped_app: Any) -> None:
    status, body, consumed = _call(wrapped_app, [])
    assert status == 401 and b"Unauthorized" in body
    assert consumed == 0, f"the body was read ({consumed} chunks) before the key check"


def test_an_oversized_weight_route_body_is_a_413_with_a_message(
    wrapped_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(VLLMWeightUpdateMiddleware, "max_body_bytes", 10 * len(CHUNK))
    status, body, consumed = _call(wrapped_app, [(b"authorization", f"Bearer {KEY}".encode())])
    assert status == 413 and b"/collective_rpc exceeds rr's limit of 40960 bytes" in body
    assert consumed == 11  # read up to the cap, then refused
