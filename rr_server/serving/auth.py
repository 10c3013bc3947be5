"""API keys for rr's HTTP routes: vLLM's rule (``Authorization: Bearer <key>``, constant-time compare, 401).

:class:`ApiKeys` holds the accepted keys; :class:`ApiKeyMiddleware` is a plain ASGI middleware that
guards chosen paths with them and, optionally, refuses request bodies over a size limit with 413
before the app parses them. Used by the sidecar, and by the vLLM/SGLang patches where the engine's
own middleware does not cover rr's routes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rr_client.core import settings
from rr_server.serving.http import (
    ASGIApp,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    error_body,
    read_body,
    replay_receive,
    send_json,
)

__all__ = ["ApiKeys", "ApiKeyMiddleware", "keys_from", "UNAUTHORIZED_BODY"]

# vLLM's AuthenticationMiddleware answers exactly this body with 401.
UNAUTHORIZED_BODY = {"error": "Unauthorized"}


def keys_from(cli: Iterable[str] | None, env_var: str) -> list[str]:
    """Keys given on the command line plus the one in ``env_var`` (so it need not be on the command line)."""
    keys = [k for k in (cli or []) if k]
    env = settings.text(env_var) or ""
    if env and env not in keys:
        keys.append(env)
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """Accepted API keys, kept as SHA-256 digests and compared in constant time (vLLM does the same)."""

    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        """From plain keys; empty strings are ignored."""
        return cls(tuple(hashlib.sha256(k.encode()).digest() for k in keys if k))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def accepts(self, authorization: str | None) -> bool:
        """True if the ``Authorization`` header is ``Bearer <one of the keys>``."""
        if not authorization or not authorization.startswith("Bearer "):
            return False
        given = hashlib.sha256(authorization[len("Bearer ") :].encode()).digest()
        ok = False
        for d in self.digests:  # no early exit: the time taken does not depend on which key matched
            ok |= hmac.compare_digest(given, d)
        return ok

    def accepts_scope(self, scope: Scope) -> bool:
        """:meth:`accepts` on an ASGI scope's ``authorization`` header."""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                return self.accepts(value.decode("latin-1"))
        return False


def _too_large(limit: int) -> dict[str, Any]:
    """The 413 body: the limit and the option that sets it."""
    return error_body(
        f"request body exceeds the sidecar's limit of {limit} bytes (--max-body-bytes)", 413, "RequestTooLarge"
    )


class ApiKeyMiddleware:
    """Guard HTTP paths with :class:`ApiKeys` (401 with vLLM's body) and cap request bodies (413).

    ``protect(path)`` says whether a path needs a key; with no keys nothing is guarded. The size cap
    reads ``content-length`` first and, for chunked bodies, counts bytes before the app sees any.
    """

    def __init__(
        self, app: ASGIApp, *, keys: ApiKeys, protect: Callable[[str], bool], max_body_bytes: int | None = None
    ) -> None:
        self.app = app
        self.keys = keys
        self.protect = protect
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.keys and self.protect(scope["path"]) and not self.keys.accepts_scope(scope):
            await send_json(send, UNAUTHORIZED_BODY, 401, [(b"www-authenticate", b"Bearer")])
            return
        limit = self.max_body_bytes
        if limit is None or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                await send_json(send, _too_large(limit), 413)
                return
            await self.app(scope, receive, send)
            return
        await self._chunked(scope, receive, send, limit)

    async def _chunked(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """A body without content-length: read it up to the limit, then replay it to the app."""
        try:
            raw = await read_body(receive, limit)
        except BodyTooLarge:
            await send_json(send, _too_large(limit), 413)
            return
        if raw is None:
            return
        await self.app(scope, replay_receive(raw, receive), send)
