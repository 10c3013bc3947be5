"""Pure-ASGI middleware that serves rr's fields on an engine's own ``/v1/completions`` and ``/v1/chat/completions``.

Installed in the engine's app (vLLM plugin, SGLang patch): the engine's serving code runs unchanged. The
middleware only rewrites the request body into the engine's names and finishes the JSON answer with
:mod:`rr_server.serving.openai_routing`. A body without rr's fields, any other path and every non-200 answer pass
through byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from rr_client.core.engines import ABSENT, EngineName, pop_ext_routing
from rr_client.core.engines import engine as find_engine
from rr_client.core.info import RRInfo
from rr_server.serving.generate_protocol import BadRequest
from rr_server.serving.http import (
    ASGIApp,
    Message,
    PostBodyMiddleware,
    Receive,
    Scope,
    Send,
    add_middleware,
    error_body,
    replay_receive,
    send_json,
    with_body,
)
from rr_server.serving.openai_routing import (
    OPENAI_PATHS,
    OpenAIRouting,
    engine_body,
    finish_answer,
    parse_openai_routing,
)
from rr_server.serving.routing_metrics import count_answer

__all__ = ["OpenAIRoutingMiddleware", "install_openai_routing"]

logger = logging.getLogger("rr.openai")

# Routing payload characters above which an answer is finished in a worker thread (keeps the loop serving).
_THREAD_MIN_CHARS = 1 << 20
# ``native(r)``: entered around the engine's handling of a request that wants routing (``r``: its rr fields);
# yields ``fill(answer)``, applied to the parsed answer (or a stream's routing event) before rr's finish: the
# SGLang patch gives each choice its own routing there, the vLLM plugin a stream's routing.
# ``fill`` may return each choice's already-checked routing (the SGLang patch), handed to finish_answer(checked=).
Native = Callable[[OpenAIRouting], AbstractContextManager[Callable[[Any], Sequence[Any] | None]]]


class OpenAIRoutingMiddleware(PostBodyMiddleware):
    """Adds rr's routing fields to the engine's OpenAI endpoints; ``info(app)`` gives the served model's dims."""

    paths = OPENAI_PATHS

    def __init__(
        self,
        app: ASGIApp,
        *,
        engine: EngineName,
        info: Callable[[Any], RRInfo],
        routing_enabled: Callable[[Any], bool] | None = None,
        native: Native | None = None,
    ) -> None:
        super().__init__(app)
        self.engine, self.info, self.routing_enabled = engine, info, routing_enabled
        self.native = native  # with it, streams get rr's routing on their last event (it knows every choice)

    async def handle(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        """One OpenAI request with its body read: rr's fields taken out, the engine's answer finished."""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # not ours to judge: the engine answers it
        try:
            r = (
                parse_openai_routing(body, engine=self.engine, stream_ok=self.native is not None)
                if isinstance(body, dict)
                else None
            )
            if r is not None and r.want and self.routing_enabled is not None and not self.routing_enabled(scope["app"]):
                raise BadRequest("this server was started without --enable-return-routed-experts")
        except BadRequest as e:
            await send_json(send, error_body(str(e), e.status), e.status)
            return
        if r is None:
            await self.app(scope, replay_receive(raw, receive), send)
            return
        new = json.dumps(engine_body(body, r, engine=self.engine)).encode()  # type: ignore[arg-type]
        inner = with_body(scope, new)
        if not r.want:
            await self.app(inner, replay_receive(new, receive), send)
            return
        if r.stream and self.native is not None:
            with self.native(r) as fill:
                stream = _RoutingStream(
                    send,
                    lambda answer: self._finish_stream(answer, r, fill, scope["app"]),
                    find_engine(self.engine).answer_routing_ext,
                )
                await self.app(inner, replay_receive(new, receive), stream.send)
            return
        captured = _Captured(send)
        with self.native(r) if self.native is not None else contextlib.nullcontext(None) as fill:
            await self.app(inner, replay_receive(new, receive), captured.send)
        if captured.status != 200 or not captured.complete:
            await captured.flush()  # errors and anything unexpected go out as the engine made them
            return
        try:
            answer = json.loads(b"".join(captured.body))
        except ValueError:
            await captured.flush()
            return
        checked = fill(answer) if fill is not None else None
        info = self.info(scope["app"])
        size = len(captured.body[0]) if len(captured.body) == 1 else sum(map(len, captured.body))
        if size > _THREAD_MIN_CHARS:
            answer = await asyncio.to_thread(finish_answer, answer, r, info, engine=self.engine, checked=checked)
        else:
            answer = finish_answer(answer, r, info, engine=self.engine, checked=checked)
        count_answer(answer)
        await send_json(send, answer, 200, captured.headers)

    def _finish_stream(
        self, answer: dict[str, Any], r: OpenAIRouting, fill: Callable[[Any], Sequence[Any] | None], app: Any
    ) -> Any:
        """The routing event of a stream: every choice's checked rr fields and token ids."""
        checked = fill(answer)
        answer = finish_answer(answer, r, self.info(app), engine=self.engine, checked=checked)
        count_answer(answer)
        return answer


class _Captured:
    """Buffers the inner app's response; streams (non-JSON) are forwarded as they come."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.complete = False
        self._passthrough = False
        self._start: Message | None = None

    async def send(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = int(msg["status"])
            self.headers = list(msg.get("headers", []))
            ctype = dict((k.lower(), v) for k, v in self.headers).get(b"content-type", b"")
            if self.status != 200 or not ctype.startswith(b"application/json"):
                self._passthrough = True
                await self._send(msg)
            else:
                self._start = msg
            return
        if self._passthrough:
            await self._send(msg)
            return
        if msg["type"] == "http.response.body":
            self.body.append(msg.get("body", b""))
            if not msg.get("more_body"):
                self.complete = True

    async def flush(self) -> None:
        """Send what was buffered unchanged (no-op when already passed through)."""
        if self._passthrough or self._start is None:
            return
        await self._send(self._start)
        await self._send({"type": "http.response.body", "body": b"".join(self.body)})


class _RoutingStream:
    """Forwards an SSE answer event by event; drops the engine's own routing (SGLang's ``sglext``, the first
    request's only; vLLM's chunks carry none) and sends one event with every choice's rr routing right before
    ``data: [DONE]``.

    ``routing_event(answer)`` gets ``{"id", "object", "model", "choices": [{"index": i}, ...]}`` (one entry per
    choice index the stream showed) and returns it finished.
    """

    def __init__(self, send: Send, routing_event: Callable[[dict[str, Any]], Any], ext: str | None) -> None:
        self._send, self._routing_event, self._ext = send, routing_event, ext  # ext: the engine's (SGLang: sglext)
        self._sse = False
        self._pending = b""
        self._indices: set[int] = set()
        self._head: dict[str, Any] = {}

    async def send(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            ctype = dict((k.lower(), v) for k, v in msg.get("headers", [])).get(b"content-type", b"")
            self._sse = int(msg["status"]) == 200 and ctype.startswith(b"text/event-stream")
            await self._send(msg)
            return
        if not self._sse or msg["type"] != "http.response.body":
            await self._send(msg)
            return
        data = self._pending + msg.get("body", b"")
        *events, self._pending = data.split(b"\n\n")
        out = [self._event(e) for e in events]
        more = bool(msg.get("more_body"))
        tail = b"" if more else self._pending
        await self._send({"type": "http.response.body", "body": b"".join(out) + tail, "more_body": more})

    def _event(self, event: bytes) -> bytes:
        """One SSE event, rewritten if it carries routing; the routing event goes out before ``[DONE]``."""
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        payload = event[5:].strip()
        if payload == b"[DONE]":
            answer = {**self._head, "choices": [{"index": i} for i in sorted(self._indices or {0})]}
            routed = json.dumps(self._routing_event(answer), separators=(",", ":")).encode()
            return b"data: " + routed + b"\n\n" + event + b"\n\n"
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        self._head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        for ch in obj.get("choices") or ():
            if isinstance(ch, dict) and isinstance(ch.get("index"), int):
                self._indices.add(ch["index"])
        # the engine's partial routing (SGLang's sglext): rr's event replaces it
        if self._ext is None or pop_ext_routing(obj, self._ext) is ABSENT:
            return event + b"\n\n"
        if self._ext not in obj and not obj.get("choices"):
            return b""  # the event held nothing else
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def install_openai_routing(
    app: Any,
    *,
    engine: EngineName,
    info: Callable[[Any], RRInfo],
    routing_enabled: Callable[[Any], bool] | None = None,
    native: Native | None = None,
) -> bool:
    """Add :class:`OpenAIRoutingMiddleware` to a Starlette/FastAPI app once (re-entrant); True if added now."""
    if getattr(app.state, "rr_openai_routing", False):
        return False
    add_middleware(  # an app whose stack vLLM 0.22 - 0.29 built already is rebuilt
        app, OpenAIRoutingMiddleware, engine=engine, info=info, routing_enabled=routing_enabled, native=native
    )
    app.state.rr_openai_routing = True
    logger.info("rr: routing fields served on %s (%s)", ", ".join(OPENAI_PATHS), engine)
    return True
