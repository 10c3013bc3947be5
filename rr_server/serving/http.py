"""HTTP as every rr server speaks it, in one place: the ASGI types, one JSON answer, one error body, a request
body read whole and replayed, and the ``content-length`` rewrite of a changed body.

Used by the API-key middleware, the OpenAI middleware, both engine adapters (``rr_patches.vllm``,
``rr_patches.sglang``) and the sidecar (``rr_server.proxy``). The types are Starlette's (``starlette/types.py``),
stated here so the pure-ASGI middlewares need no framework import.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from starlette.responses import Response

__all__ = [
    "Scope",
    "Message",
    "Receive",
    "Send",
    "ASGIApp",
    "Headers",
    "JSON_MEDIA_TYPE",
    "json_bytes",
    "error_body",
    "send_json",
    "json_response",
    "BodyTooLarge",
    "resume_receive",
    "add_middleware",
    "read_body",
    "replay_receive",
    "with_body",
    "PostBodyMiddleware",
]

# ASGI, as Starlette's types.py states it
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_MEDIA_TYPE = "application/json"
_LENGTH, _TYPE = b"content-length", b"content-type"


_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def json_bytes(obj: Any) -> bytes:
    """The body of every JSON answer rr makes: compact UTF-8 JSON (orjson; numpy values as numbers, and non-string
    keys as strings, as ``json.dumps`` writes them)."""
    try:
        return orjson.dumps(obj, option=_JSON_OPTIONS)
    except orjson.JSONEncodeError:  # what orjson refuses (an int over 64 bits) json writes, as it did before
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def error_body(message: str, status: int, error_type: str | None = None, **extra: Any) -> dict[str, Any]:
    """Every rr error answer's body, shaped like vLLM's/SGLang's: ``{"error": {"message", "type", "code", ...extra},
    "message"}``; ``error_type`` defaults to ``BadRequestError`` below 500, ``InternalServerError`` from 500."""
    kind = error_type or ("BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "code": status, **extra}, "message": message}


async def send_json(send: Send, obj: Any, status: int = 200, headers: Headers | None = None) -> None:
    """One complete JSON answer over raw ASGI (a middleware's); ``headers`` kept, less their length and type."""
    body = json_bytes(obj)
    hdrs = [(k, v) for k, v in (headers or []) if k.lower() not in (_LENGTH, _TYPE)]
    hdrs += [(_TYPE, JSON_MEDIA_TYPE.encode()), (_LENGTH, str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def json_response(obj: Any, status: int = 200) -> Response:
    """The same JSON answer as a Starlette response, for a route handler (FastAPI returns it as it is)."""
    from starlette.responses import Response

    return Response(json_bytes(obj), status_code=status, media_type=JSON_MEDIA_TYPE)


def add_middleware(app: Any, cls: type, *, inside: tuple[type, ...] = (), **options: Any) -> None:
    """Starlette's ``add_middleware`` that also works once the app's stack is built: outermost, or just inside the
    innermost of ``inside`` already on the app, the stack rebuilt when it was. vLLM 0.22 - 0.29's ``build_app``
    returns a built stack (it ends with SageMaker's bootstrap: model_hosting_container_standards
    ``common/fastapi/middleware/core.py`` ``load_middlewares`` sets ``app.middleware_stack``), where Starlette's own
    refuses ("Cannot add middleware after an application has started")."""
    from starlette.middleware import Middleware

    stack = app.user_middleware
    guards = [i for i, m in enumerate(stack) if getattr(m, "cls", None) in inside]
    stack.insert(max(guards) + 1 if guards else 0, Middleware(cls, **options))
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()


class BodyTooLarge(Exception):
    """A request body longer than the limit :func:`read_body` was given (nothing after the limit was read);
    ``head`` holds what was read (a caller may hand the body on with :func:`resume_receive`)."""

    def __init__(self, message: str, head: bytes = b"") -> None:
        super().__init__(message)
        self.head = head


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The whole request body, or None when the client disconnects first; :class:`BodyTooLarge` once more than
    ``limit`` bytes arrived."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body = msg.get("body", b"")
        size += len(body)
        if limit is not None and size > limit:
            raise BodyTooLarge(f"request body over {limit} bytes", b"".join([*chunks, body]))
        chunks.append(body)
        if not msg.get("more_body"):
            return b"".join(chunks)


def replay_receive(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (so disconnects still arrive)."""
    return _first_then(body, receive, more=False)


def resume_receive(head: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``head`` (the start of a body still arriving) once, then the rest from ``receive``."""
    return _first_then(head, receive, more=True)


def _first_then(body: bytes, receive: Receive, *, more: bool) -> Receive:
    """A ``receive`` whose first message is ``body`` (``more_body``: ``more``), then ``receive``'s own."""
    sent = False

    async def first_then() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return first_then


def with_body(scope: Scope, body: bytes) -> Scope:
    """``scope`` for a request whose body is now ``body``: its ``content-length`` header rewritten to match."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != _LENGTH]
    headers.append((_LENGTH, str(len(body)).encode()))
    return dict(scope, headers=headers)


class PostBodyMiddleware:
    """Pure ASGI: a ``POST`` to one of :attr:`paths` is read whole and handed to :meth:`handle`; every other
    request passes untouched, and one whose client left before sending its body gets no answer."""

    paths: tuple[str, ...] = ()

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            return  # the client left before sending its body
        await self.handle(scope, raw, receive, send)

    async def handle(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        """Serve one request whose body is ``raw`` (``receive``: the real one, for what comes after the body)."""
        raise NotImplementedError
