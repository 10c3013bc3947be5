"""The routing store every rr server holds for ``routed_experts_format="ref"``, and its HTTP routes.

Rows enter only as :class:`rr_client.codec.CheckedRouting` (checked once, when stored, as for an inline answer)
and leave by key and row range as a binary frame (:mod:`rr_client.reference`). Bounded by bytes, oldest evicted
first; retired per weight version (``POST /rr/routing/retire`` after a weight push). A key never gets other rows
(keys are random and never reused); a key that is gone answers 410 with why (evicted / retired / another store
instance: the server restarted), which the client raises as :class:`rr_client.RoutingExpiredError`.

Routes (behind the same auth as every rr route): ``POST /rr/routing/read`` (``{"refs": [{"store", "key",
"start"?, "stop"?}]}`` -> frame), ``POST /rr/routing/retire`` (``{"through": V}``), counters on ``/rr/info``
under ``routing_store``.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from typing import Any

try:  # the HTTP half; a bare install (no server extra) loads the store and rr's engine plugins without it
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - depends on the environment
    Request = Response = JSONResponse = Any  # type: ignore[misc, assignment]

from rr_client import settings
from rr_client.codec import CheckedRouting, install_reference_store
from rr_client.errors import ConfigurationError, RoutingExpiredError
from rr_client.reference import (FRAME_MEDIA_TYPE, READ_PATH, RETIRE_PATH, FramePart, RoutingRef, checksum,
                                 encode_frame)
from rr_server.serving.store_ledger import Held, StoreLedger, row_range

__all__ = ["RoutingStore", "install_store", "current_store", "DEFAULT_MAX_BYTES", "READ_PATH", "RETIRE_PATH",
           "read_endpoint", "retire_endpoint", "STORE_ROUTES", "advertised_url"]

DEFAULT_MAX_BYTES = 2 << 30


class RoutingStore:
    """Checked rows by key in this process, bounded by ``max_bytes`` (oldest evicted first), retired per weight
    version (:class:`StoreLedger`). Thread-safe (vLLM builds large answers in a worker thread). ``url``: what refs
    name as the place to read."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, url: str = "", instance: str | None = None) -> None:
        self.ledger = StoreLedger(max_bytes, instance)
        self.url = url
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
            version = self.ledger.weight_version
            self.ledger.add(key, Held(arr, int(arr.shape[0]), arr.nbytes, version, digest))
        return RoutingRef(store=self.instance, url=self.url, key=key, rows=int(arr.shape[0]),
                          layers=int(arr.shape[1]), topk=int(arr.shape[2]), dtype=arr.dtype.name,
                          start=checked.start, weight_version=version, checksum=digest).to_dict()

    def retire(self, through: int) -> dict[str, int]:
        """Free every row made under weight version <= ``through``; later refs carry ``through + 1`` or more."""
        with self._lock:
            return self.ledger.retire(through)

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key`` (default: all); :class:`RoutingExpiredError` if not held here."""
        with self._lock:
            e = self.ledger.find(store, key)
            a, b = row_range(key, e.n_rows, start, stop)
            rows = e.rows[a:b]
            self.ledger.note_read(b - a, rows.nbytes)
        return FramePart(key, a, b, rows)

    def stats(self) -> dict[str, Any]:
        """Counters for ``/rr/info`` and metrics (:meth:`StoreLedger.stats`)."""
        with self._lock:
            return self.ledger.stats()


_STORE: RoutingStore | None = None
_INSTALL_LOCK = threading.Lock()


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
    """This process's routing store (made once; re-entrant), registered with the codec for the ref format."""
    global _STORE
    url = url or advertised_url(None, None)
    with _INSTALL_LOCK:
        if _STORE is None:
            cap = max_bytes or settings.integer("RR_ROUTING_STORE_BYTES", default=DEFAULT_MAX_BYTES)
            backend = (settings.text("RR_ROUTING_STORE") or "memory").lower()
            if backend == "ray":
                from rr_server.serving.ray_store import RayRoutingStore

                _STORE = RayRoutingStore(cap)  # type: ignore[assignment]
            elif backend == "memory":
                _STORE = RoutingStore(cap, url)
            else:
                raise ConfigurationError(f"RR_ROUTING_STORE={backend!r}: expected memory or ray")
            install_reference_store(_STORE.put)  # type: ignore[union-attr]
        elif url and not _STORE.url:  # a Ray store's URL is its actor's, always set
            _STORE.url = url
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


async def read_endpoint(request: Request) -> Response:
    """``POST /rr/routing/read``: many refs' rows in one binary frame; 410 naming every expired key."""
    store = current_store()
    if store is None:
        return _json_error(404, "NotFoundError", "this server holds no routing store")
    try:
        body = json.loads(await request.body())
        refs = body.get("refs") if isinstance(body, dict) else None
        if not isinstance(refs, list) or not refs:
            raise ValueError('body must be {"refs": [{"store", "key", "start"?, "stop"?}, ...]} with at least one')
        asks = []
        for i, r in enumerate(refs):
            if not isinstance(r, dict) or not isinstance(r.get("key"), str) or not isinstance(r.get("store"), str):
                raise ValueError(f"refs[{i}] must be an object with string store and key")
            asks.append((r["store"], r["key"], _int_or_none(r.get("start"), f"refs[{i}].start"),
                         _int_or_none(r.get("stop"), f"refs[{i}].stop")))
    except ValueError as e:
        return _json_error(400, "BadRequestError", str(e))
    parts, expired = [], []
    for s, k, a, b in asks:
        try:
            parts.append(store.read(s, k, a, b))
        except RoutingExpiredError as e:
            expired.append({"key": k, "why": str(e)})
        except ValueError as e:
            return _json_error(400, "BadRequestError", str(e))
    if expired:
        return _json_error(410, "RoutingExpiredError", "; ".join(x["why"] for x in expired[:4])
                           + (f" (+{len(expired) - 4} more)" if len(expired) > 4 else ""), expired=expired)
    return Response(encode_frame(parts), media_type=FRAME_MEDIA_TYPE)


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
    return JSONResponse(store.retire(through))


#: (path, handler, methods) of the store's routes, added by every rr server next to ``/rr/info``
STORE_ROUTES: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    (READ_PATH, read_endpoint, ("POST",)),
    (RETIRE_PATH, retire_endpoint, ("POST",)),
)
