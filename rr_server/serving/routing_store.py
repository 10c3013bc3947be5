"""The routing store every rr server holds for ``routed_experts_format="ref"``, and its HTTP routes.

Rows enter only as :class:`rr_client.core.codec.CheckedRouting` (checked once, when stored, as for an inline answer)
and leave by key and row range as a binary frame (:mod:`rr_client.core.reference`). Bounded by bytes, oldest evicted
first; retired per weight version (``POST /rr/routing/retire`` after a weight push). A key never gets other rows
(keys are random and never reused); a key that is gone answers 410 with why (evicted / retired / another store
instance: the server restarted), which the client raises as :class:`rr_client.RoutingExpiredError`.

Routes (behind the same auth as every rr route): ``POST /rr/routing/read`` (``{"refs": [{"store", "key",
"start"?, "stop"?}]}`` -> frame; at most :data:`MAX_REFS_PER_READ` refs, each distinct one read once, the frame
built in a worker thread, off the engine's event loop, with the checksums kept from store time),
``POST /rr/routing/retire`` (``{"through": V}``), counters on ``/rr/info`` under ``routing_store``. The API
server processes of one server (vLLM's ``--api-server-count``) answer for each other's refs
(:mod:`rr_server.serving.store_siblings`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import threading
import uuid
from typing import Any
from urllib.parse import urlsplit

try:  # the HTTP half; a bare install (no server extra) loads the store and rr's engine plugins without it
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - depends on the environment
    Request = Response = JSONResponse = Any  # type: ignore[misc, assignment]

from rr_client.core import settings
from rr_client.core.codec import CheckedRouting, install_reference_store
from rr_client.core.errors import ConfigurationError, RoutingExpiredError
from rr_client.core.reference import (FRAME_MEDIA_TYPE, READ_PATH, RETIRE_PATH, FramePart, RoutingRef, checksum,
                                 encode_frame)
from rr_server.serving.store_ledger import Held, StoreLedger, admitted_version, row_range
from rr_server.serving.store_siblings import Siblings, merge_stats, retire_everywhere

__all__ = ["RoutingStore", "install_store", "current_store", "DEFAULT_MAX_BYTES", "READ_PATH", "RETIRE_PATH",
           "read_endpoint", "retire_endpoint", "STORE_ROUTES", "advertised_url", "MAX_REFS_PER_READ",
           "read_many", "TooManyRefs"]

logger = logging.getLogger("rr.routing_store")
if logger.level == logging.NOTSET:  # the engines' imports raise the root logger to ERROR: keep rr's warnings heard
    logger.setLevel(logging.WARNING)

DEFAULT_MAX_BYTES = 2 << 30
MAX_REFS_PER_READ = 4096  #: refs one ``POST /rr/routing/read`` may name (the client reads 64 per call)


class RoutingStore:
    """Checked rows by key in this process, bounded by ``max_bytes`` (oldest evicted first), retired per weight
    version (:class:`StoreLedger`). Thread-safe (vLLM builds large answers in a worker thread). ``url``: what refs
    name as the place to read."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, url: str = "", instance: str | None = None) -> None:
        self.ledger = StoreLedger(max_bytes, instance)
        self.url = url
        self.siblings: Siblings | None = None  #: the server's other API server processes (install_store)
        self._lock = threading.Lock()

    @property
    def instance(self) -> str:
        return self.ledger.instance

    @property
    def max_bytes(self) -> int:
        return self.ledger.max_bytes

    def put(self, checked: CheckedRouting) -> dict[str, Any]:
        """Keep checked rows; return the :class:`RoutingRef` dict the answer carries instead of them."""
        arr = checked.array
        key, digest = uuid.uuid4().hex, checksum(arr)
        with self._lock:
            self.ledger.admit(arr.nbytes)
            made = admitted_version()  # the engine's weight version at admission, else the retire counter
            version = self.ledger.weight_version if made is None else made
            self.ledger.add(key, Held(arr, int(arr.shape[0]), arr.nbytes, version, digest))
        return RoutingRef(store=self.instance, url=self.url, key=key, rows=int(arr.shape[0]),
                          layers=int(arr.shape[1]), topk=int(arr.shape[2]), dtype=arr.dtype.name,
                          start=checked.start, weight_version=version, checksum=digest).to_dict()

    def local_retire(self, through: int) -> dict[str, int]:
        """Free every row made under weight version <= ``through`` (the engine's version at the request's admission)."""
        with self._lock:
            return self.ledger.retire(through)

    def retire(self, through: int) -> dict[str, Any]:
        """:meth:`local_retire` here and in every sibling process (:func:`retire_everywhere`)."""
        return retire_everywhere(self, through)

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key`` (default: all) with the checksum kept from store time when whole;
        :class:`RoutingExpiredError` if not held here."""
        with self._lock:
            e = self.ledger.find(store, key)
            a, b = row_range(key, e.n_rows, start, stop)
            rows = e.rows[a:b]
            self.ledger.note_read(b - a, rows.nbytes)
        return FramePart(key, a, b, rows, e.digest if (a, b) == (0, e.n_rows) else "")

    def local_stats(self) -> dict[str, Any]:
        """This process's counters (:meth:`StoreLedger.stats`; ``sibling_reads``: asks read from a sibling)."""
        with self._lock:
            return {**self.ledger.stats(), "sibling_reads": self.siblings.forwarded if self.siblings else 0}

    def stats(self) -> dict[str, Any]:
        """Counters for ``/rr/info`` and metrics, summed over the server's processes (:func:`merge_stats`)."""
        return merge_stats(self.local_stats(), self.siblings.stats() if self.siblings else [])


_STORE: RoutingStore | None = None
_NAMED = False  # the store was given the server's URL (and met its siblings)
_INSTALL_LOCK = threading.Lock()


def _warn_if_loopback(url: str) -> None:
    """Say at start that refs name a loopback URL (a trainer on another machine would read its own loopback)."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        logger.warning("rr: routing refs name %s, a loopback address: a trainer rank on another machine would read "
                       "its own loopback. Serve on a reachable --host, or set RR_ADVERTISE_URL to the URL ranks "
                       "reach this server at.", url)


def advertised_url(host: str | None, port: int | None, scheme: str = "http") -> str:
    """``RR_ADVERTISE_URL``, else ``scheme://host:port`` (a wildcard host becomes this machine's name)."""
    given = settings.text("RR_ADVERTISE_URL")
    if given:
        return given.rstrip("/")
    if host is None or port is None:
        return ""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def install_store(url: str = "", max_bytes: int | None = None) -> RoutingStore:
    """This process's routing store (made once; re-entrant), registered with the codec for the ref format.

    Once the server's URL is known (``url``), the store answers for its sibling API server processes
    (:class:`Siblings`), and a loopback URL is logged."""
    global _STORE, _NAMED
    url = url or advertised_url(None, None)
    with _INSTALL_LOCK:
        if _STORE is None:
            cap = max_bytes or settings.integer("RR_ROUTING_STORE_BYTES", default=DEFAULT_MAX_BYTES)
            backend = (settings.text("RR_ROUTING_STORE") or "memory").lower()
            if backend == "ray":
                from rr_server.serving.ray_store import RayRoutingStore

                _STORE = RayRoutingStore(cap)  # type: ignore[assignment]
            elif backend == "memory":
                _STORE = RoutingStore(cap)
            else:
                raise ConfigurationError(f"RR_ROUTING_STORE={backend!r}: expected memory or ray")
            install_reference_store(_STORE.put)  # type: ignore[union-attr]
        if url and not _NAMED:  # once: the server's URL, also the siblings' meeting place
            _NAMED = True
            if not _STORE.url.startswith("ray://"):  # a Ray store's refs name its actor
                _STORE.url = url
                _warn_if_loopback(url)
            _STORE.siblings = Siblings.join(_STORE, url)
        return _STORE


def current_store() -> RoutingStore | None:
    """The routing store of this process, if a server installed one."""
    return _STORE


# ---------------------------------------------------------------------- HTTP (Starlette, shared by every server)


def _json_error(status: int, kind: str, message: str, **extra: Any) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}, "message": message},
                        status_code=status)


def _int_or_none(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return v


class TooManyRefs(ValueError):
    """A read naming more refs than :data:`MAX_REFS_PER_READ` (answered 413)."""


def parse_read(body: bytes) -> list[tuple[str, str, int | None, int | None]]:
    """The (store, key, start, stop) a read body asks for; ValueError (a 400) naming what is wrong."""
    try:
        body = json.loads(body)
    except RecursionError:
        raise ValueError("body is JSON nested too deeply") from None
    refs = body.get("refs") if isinstance(body, dict) else None
    if not isinstance(refs, list) or not refs:
        raise ValueError('body must be {"refs": [{"store", "key", "start"?, "stop"?}, ...]} with at least one')
    if len(refs) > MAX_REFS_PER_READ:
        raise TooManyRefs(f"{len(refs)} refs in one read; this server answers at most {MAX_REFS_PER_READ} per call "
                          "(MAX_REFS_PER_READ): split them over several calls")
    asks = []
    for i, r in enumerate(refs):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str) or not isinstance(r.get("store"), str):
            raise ValueError(f"refs[{i}] must be an object with string store and key")
        asks.append((r["store"], r["key"], _int_or_none(r.get("start"), f"refs[{i}].start"),
                     _int_or_none(r.get("stop"), f"refs[{i}].stop")))
    return asks


def read_many(store: Any, asks: list[tuple[str, str, int | None, int | None]]
              ) -> tuple[list[FramePart], list[dict[str, str]]]:
    """Each ask's part, in order (one :class:`FramePart` per distinct ask, however often it is named), read here
    or from the sibling process that holds it; else ``[]`` and every expired key with why. ValueError: a bad
    row range."""
    got: dict[tuple[str, str, int | None, int | None], FramePart] = {}
    expired: list[dict[str, str]] = []
    remote: dict[str, list[tuple[str, str, int | None, int | None]]] = {}
    for ask in dict.fromkeys(asks):
        if store.siblings is not None and store.siblings.holder(ask[0]) is not None:
            remote.setdefault(ask[0], []).append(ask)
            continue
        try:
            got[ask] = store.read(*ask)
        except RoutingExpiredError as e:
            expired.append({"key": ask[1], "why": str(e)})
    for instance, group in remote.items():
        for ask, r in zip(group, store.siblings.read(instance, [a[1:] for a in group])):
            if isinstance(r, FramePart):
                got[ask] = r
            elif isinstance(r, RoutingExpiredError):
                expired.append({"key": ask[1], "why": str(r)})
            else:
                raise r
    return ([] if expired else [got[a] for a in asks]), expired


def _read_answer(store: Any, body: bytes) -> Response:
    """The read route's whole work (parse, read, hash what has no kept checksum, build the frame): in a thread."""
    try:
        parts, expired = read_many(store, parse_read(body))
    except TooManyRefs as e:
        return _json_error(413, "BadRequestError", str(e))
    except ValueError as e:
        return _json_error(400, "BadRequestError", str(e))
    if expired:
        return _json_error(410, "RoutingExpiredError", "; ".join(x["why"] for x in expired[:4])
                           + (f" (+{len(expired) - 4} more)" if len(expired) > 4 else ""), expired=expired)
    return Response(encode_frame(parts), media_type=FRAME_MEDIA_TYPE)


async def read_endpoint(request: Request) -> Response:
    """``POST /rr/routing/read``: many refs' rows in one binary frame; 410 naming every expired key. Built in a
    worker thread: the engine's event loop streams every request."""
    store = current_store()
    if store is None:
        return _json_error(404, "NotFoundError", "this server holds no routing store")
    return await asyncio.to_thread(_read_answer, store, await request.body())


async def retire_endpoint(request: Request) -> Response:
    """``POST /rr/routing/retire`` ``{"through": V}``: free rows of weight versions <= V (after a weight push)."""
    store = current_store()
    if store is None:
        return _json_error(404, "NotFoundError", "this server holds no routing store")
    try:
        body = json.loads(await request.body())
        through = body.get("through") if isinstance(body, dict) else None
        if not isinstance(through, int) or isinstance(through, bool) or through < 0:
            raise ValueError(f'body must be {{"through": <non-negative int weight version>}}, got {body!r}')
    except ValueError as e:
        return _json_error(400, "BadRequestError", str(e))
    return JSONResponse(await asyncio.to_thread(store.retire, through))  # siblings answer over sockets


#: (path, handler, methods) of the store's routes, added by every rr server next to ``/rr/info``
STORE_ROUTES: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    (READ_PATH, read_endpoint, ("POST",)),
    (RETIRE_PATH, retire_endpoint, ("POST",)),
)
