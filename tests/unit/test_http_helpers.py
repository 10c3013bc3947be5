"""rr_server.serving.http: the one JSON answer (raw ASGI and Starlette), the one error body, body read and replay,
the content-length rewrite, and the POST-body middleware's pass-through."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from rr_server.serving.http import (
    BodyTooLarge,
    Message,
    PostBodyMiddleware,
    Receive,
    Scope,
    Send,
    error_body,
    json_bytes,
    json_response,
    read_body,
    replay_receive,
    send_json,
    with_body,
)


def _receiver(messages: list[Message]) -> Receive:
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    return receive


def test_error_body_shape_is_vllms_and_sglangs() -> None:
    body = error_body("nope", 400)
    assert body == {"error": {"message": "nope", "type": "BadRequestError", "code": 400}, "message": "nope"}
    assert error_body("boom", 502)["error"]["type"] == "InternalServerError"
    assert error_body("big", 413, "RequestTooLarge") == {
        "error": {"message": "big", "type": "RequestTooLarge", "code": 413},
        "message": "big",
    }
    extra = error_body("gone", 410, "RoutingExpiredError", expired=[{"key": "k", "why": "w"}])
    assert list(extra["error"]) == ["message", "type", "code", "expired"]
    assert json_bytes(error_body("x", 503, kind="upstream_unavailable")) == (
        b'{"error":{"message":"x","type":"InternalServerError","code":503,"kind":"upstream_unavailable"},"message":"x"}'
    )


def test_json_bytes_are_compact_utf8_and_take_numpy_scalars() -> None:
    assert json_bytes({"error": "Unauthorized"}) == b'{"error":"Unauthorized"}'  # vLLM's 401 body, to the byte
    assert json_bytes({"t": "é", "n": np.int64(3), "f": np.float32(0.5)}) == '{"t":"é","n":3,"f":0.5}'.encode()
    assert json_bytes({1: "a", None: "b"}) == b'{"1":"a","null":"b"}'  # keys as json.dumps writes them
    assert json_bytes({"big": 1 << 70}) == b'{"big":1180591620717411303424}'  # past orjson's 64 bits


def test_send_json_sends_one_answer_with_length_and_type() -> None:
    sent: list[Message] = []

    async def send(msg: Message) -> None:
        sent.append(msg)

    hdrs = [(b"x-kept", b"1"), (b"Content-Length", b"999"), (b"content-type", b"text/plain")]
    asyncio.run(send_json(send, {"a": [1, 2]}, 201, hdrs))
    start, body = sent
    assert start == {
        "type": "http.response.start",
        "status": 201,
        "headers": [(b"x-kept", b"1"), (b"content-type", b"application/json"), (b"content-length", b"11")],
    }
    assert body == {"type": "http.response.body", "body": b'{"a":[1,2]}'}
    assert orjson.loads(body["body"]) == {"a": [1, 2]}


def test_json_response_is_the_same_answer_for_a_route() -> None:
    r = json_response(error_body("nope", 404), 404)
    assert r.status_code == 404 and r.media_type == "application/json"
    assert r.body == json_bytes(error_body("nope", 404))
    assert dict(r.headers) == {"content-length": str(len(r.body)), "content-type": "application/json"}


def test_read_body_joins_chunks_stops_at_disconnect_and_at_the_limit() -> None:
    chunks = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ]
    assert asyncio.run(read_body(_receiver(chunks))) == b"abcd"
    assert asyncio.run(read_body(_receiver(chunks), limit=4)) == b"abcd"
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(_receiver(chunks), limit=3))
    assert asyncio.run(read_body(_receiver([{"type": "http.disconnect"}]))) is None
    assert asyncio.run(read_body(_receiver([{"type": "http.request"}]))) == b""


def test_replay_receive_gives_the_body_once_then_the_real_receive() -> None:
    async def run() -> list[Message]:
        receive = replay_receive(b"body", _receiver([{"type": "http.disconnect"}]))
        return [await receive(), await receive()]

    first, then = asyncio.run(run())
    assert first == {"type": "http.request", "body": b"body", "more_body": False}
    assert then == {"type": "http.disconnect"}


def test_with_body_rewrites_content_length_only() -> None:
    scope: Scope = {
        "type": "http",
        "path": "/x",
        "headers": [(b"Content-Length", b"2"), (b"content-type", b"application/json")],
    }
    out = with_body(scope, b"12345")
    assert out["headers"] == [(b"content-type", b"application/json"), (b"content-length", b"5")]
    assert out["path"] == "/x" and scope["headers"][0] == (b"Content-Length", b"2")  # the caller's scope untouched
    assert with_body({"type": "http"}, b"")["headers"] == [(b"content-length", b"0")]


class _Echo(PostBodyMiddleware):
    paths = ("/echo",)

    async def handle(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        await send_json(send, {"got": raw.decode()}, 200)


def _call(app: Any, method: str, path: str, messages: list[Message]) -> list[Message]:
    sent: list[Message] = []

    async def send(msg: Message) -> None:
        sent.append(msg)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, _receiver(messages), send))
    return sent


def test_post_body_middleware_reads_its_paths_and_passes_the_rest() -> None:
    inner_saw: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        inner_saw.append(scope["path"])
        await send_json(send, {"inner": True})

    app = _Echo(inner)
    body = [{"type": "http.request", "body": b"hi", "more_body": False}]
    assert orjson.loads(_call(app, "POST", "/echo", body)[1]["body"]) == {"got": "hi"}
    assert orjson.loads(_call(app, "GET", "/echo", body)[1]["body"]) == {"inner": True}
    assert orjson.loads(_call(app, "POST", "/other", body)[1]["body"]) == {"inner": True}
    assert _call(app, "POST", "/echo", [{"type": "http.disconnect"}]) == []  # the client left: no answer
    assert inner_saw == ["/echo", "/other"]
