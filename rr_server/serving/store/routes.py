"""The routing store's HTTP routes, apart from its logic (behind the same auth as every rr route):

``POST /rr/routing/read`` (``{"refs": [{"store", "key", "start"?, "stop"?}]}`` -> frame; at most
:data:`MAX_REFS_PER_READ` refs, asks of one key whose ranges overlap or touch read and sent once, at most
:func:`read_cap` bytes of rows per call, counted before any row is read; the frame built in a worker thread, off
the engine's event loop, with the checksums kept from store time), ``POST /rr/routing/retire`` (``{"through": V}``);
the counters are on ``/rr/info`` under ``routing_store``. Every rr server adds :data:`STORE_ROUTES`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

try:  # FastAPI reads the handlers' annotations; a bare install (no server extra) loads the store without Starlette
    from starlette.requests import Request
    from starlette.responses import Response
except ImportError:  # pragma: no cover - depends on the environment
    Request = Response = Any  # type: ignore[misc, assignment]

from rr_client.core import settings
from rr_client.core.errors import SettingError
from rr_client.core.reference import FRAME_MEDIA_TYPE, MAX_READ_BYTES, READ_PATH, RETIRE_PATH, encode_frame
from rr_server.serving.http import error_body, json_response
from rr_server.serving.store.base import Ask, ReadTooLarge, RowStore, StorePair, read_many
from rr_server.serving.store.install import current_store, indexer_store

__all__ = [
    "STORE_ROUTES",
    "MAX_REFS_PER_READ",
    "MAX_READ_BYTES",
    "READ_BYTES_ENV",
    "read_cap",
    "TooManyRefs",
    "parse_read",
    "read_endpoint",
    "retire_endpoint",
    "READ_PATH",
    "RETIRE_PATH",
]

MAX_REFS_PER_READ = 4096  #: refs one ``POST /rr/routing/read`` may name (the client reads 64 per call)
READ_BYTES_ENV = "RR_ROUTING_READ_BYTES"  #: overrides :data:`MAX_READ_BYTES`, the cap on one read's rows


def read_cap() -> int:
    """Rows' bytes one read may answer, and hash for row ranges (``RR_ROUTING_READ_BYTES``, default
    :data:`MAX_READ_BYTES`): one call cannot make the engine allocate and hash more. Read per call (a test, or an
    operator's restart, changes it); SettingError when not a positive integer."""
    cap = settings.integer(READ_BYTES_ENV, default=MAX_READ_BYTES)
    if cap <= 0:
        raise SettingError(f"{READ_BYTES_ENV}={cap}: the read route's byte cap must be a positive integer")
    return cap


class TooManyRefs(ValueError):
    """A read naming more refs than :data:`MAX_REFS_PER_READ` (answered 413)."""


def _int_or_none(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return v


def parse_read(body: bytes) -> list[Ask]:
    """The (store, key, start, stop) a read body asks for; ValueError (a 400) naming what is wrong."""
    try:
        body = json.loads(body)
    except RecursionError:
        raise ValueError("body is JSON nested too deeply") from None
    refs = body.get("refs") if isinstance(body, dict) else None
    if not isinstance(refs, list) or not refs:
        raise ValueError('body must be {"refs": [{"store", "key", "start"?, "stop"?}, ...]} with at least one')
    if len(refs) > MAX_REFS_PER_READ:
        raise TooManyRefs(
            f"{len(refs)} refs in one read; this server answers at most {MAX_REFS_PER_READ} per call "
            "(MAX_REFS_PER_READ): split them over several calls"
        )
    asks = []
    for i, r in enumerate(refs):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str) or not isinstance(r.get("store"), str):
            raise ValueError(f"refs[{i}] must be an object with string store and key")
        asks.append(
            (
                r["store"],
                r["key"],
                _int_or_none(r.get("start"), f"refs[{i}].start"),
                _int_or_none(r.get("stop"), f"refs[{i}].stop"),
            )
        )
    return asks


def _parse_retire(body: bytes) -> int:
    """The weight version a retire body names; ValueError (a 400) otherwise."""
    parsed = json.loads(body)
    through = parsed.get("through") if isinstance(parsed, dict) else None
    if not isinstance(through, int) or isinstance(through, bool) or through < 0:
        raise ValueError(f'body must be {{"through": <non-negative int weight version>}}, got {parsed!r}')
    return through


def _error(status: int, kind: str, message: str, **extra: Any) -> Response:
    return json_response(error_body(message, status, kind, **extra), status)


def _stores() -> RowStore | None:
    """What the routes read and retire: the routing store, paired with the indexer store once one was made (each
    ref's ask reaches the store that holds its kind of rows)."""
    store, idx = current_store(), indexer_store(make=False)
    return StorePair(store, idx) if store is not None and idx is not None else store


def _no_store() -> Response:
    return _error(404, "NotFoundError", "this server holds no routing store")


def _read_answer(store: RowStore, body: bytes) -> Response:
    """The read route's whole work (parse, cost, read, hash what has no kept checksum, build the frame): in a
    thread. Too many refs or too many bytes: 413 before any row is read, the server serving on."""
    try:
        cap = read_cap()
    except SettingError as e:
        return _error(500, "InternalServerError", str(e))
    try:
        parts, expired, runs = read_many(store, parse_read(body), cap)
    except TooManyRefs as e:
        return _error(413, "BadRequestError", str(e))
    except ReadTooLarge as e:
        return _error(413, "BadRequestError", str(e), nbytes=e.nbytes, hashed_bytes=e.hashed, max_bytes=e.cap)
    except ValueError as e:
        return _error(400, "BadRequestError", str(e))
    if expired:
        return _error(
            410,
            "RoutingExpiredError",
            "; ".join(x["why"] for x in expired[:4]) + (f" (+{len(expired) - 4} more)" if len(expired) > 4 else ""),
            expired=expired,
        )
    return Response(encode_frame(parts, runs), media_type=FRAME_MEDIA_TYPE)


async def read_endpoint(request: Request) -> Response:
    """``POST /rr/routing/read``: many refs' rows in one binary frame; 410 naming every expired key. Built in a
    worker thread: the engine's event loop streams every request."""
    store = _stores()
    if store is None:
        return _no_store()
    return await asyncio.to_thread(_read_answer, store, await request.body())


async def retire_endpoint(request: Request) -> Response:
    """``POST /rr/routing/retire`` ``{"through": V}``: free rows of weight versions <= V (after a weight push), in the
    routing store and the indexer store alike."""
    store = _stores()
    if store is None:
        return _no_store()
    try:
        through = _parse_retire(await request.body())
    except ValueError as e:
        return _error(400, "BadRequestError", str(e))
    return json_response(await asyncio.to_thread(store.retire, through))  # siblings answer over sockets


#: (path, handler, methods) of the store's routes, added by every rr server next to ``/rr/info``
STORE_ROUTES: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    (READ_PATH, read_endpoint, ("POST",)),
    (RETIRE_PATH, retire_endpoint, ("POST",)),
)
