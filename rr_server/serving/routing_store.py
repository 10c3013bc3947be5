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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # the HTTP half; a bare install (no server extra) loads the store and rr's engine plugins without it
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - depends on the environment
    Request = Response = JSONResponse = Any  # type: ignore[misc, assignment]

from rr_client import settings
from rr_client.codec import CheckedRouting, install_reference_store
from rr_client.errors import ConfigurationError, RoutingExpiredError
from rr_client.reference import FRAME_MEDIA_TYPE, FramePart, RoutingRef, checksum, encode_frame

__all__ = ["RoutingStore", "install_store", "current_store", "DEFAULT_MAX_BYTES", "READ_PATH", "RETIRE_PATH",
           "read_endpoint", "retire_endpoint", "STORE_ROUTES", "advertised_url"]

DEFAULT_MAX_BYTES = 2 << 30
READ_PATH = "/rr/routing/read"
RETIRE_PATH = "/rr/routing/retire"
_GONE_REMEMBERED = 1 << 16  # keys whose reason (evicted / retired) is kept for the error message


@dataclass
class _Entry:
    rows: np.ndarray
    weight_version: int


class RoutingStore:
    """Checked rows by key, bounded by ``max_bytes`` (oldest evicted first), retired per weight version.

    Thread-safe (vLLM builds large answers in a worker thread). ``url``: what refs name as the place to read.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, url: str = "", instance: str | None = None) -> None:
        if max_bytes <= 0:
            raise ConfigurationError(f"routing store byte cap must be > 0, got {max_bytes} (RR_ROUTING_STORE_BYTES)")
        self.max_bytes = int(max_bytes)
        self.url = url
        self.instance = instance or uuid.uuid4().hex
        self.weight_version = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self.counts = dict.fromkeys(("stored", "stored_bytes", "reads", "read_rows", "read_bytes", "evicted",
                                     "evicted_bytes", "retired", "retired_bytes", "expired_reads", "refused"), 0)

    # ------------------------------------------------------------------ write
    def put(self, checked: CheckedRouting) -> dict[str, Any]:
        """Keep checked rows; return the :class:`RoutingRef` dict the answer carries instead of them."""
        arr = checked.array
        if arr.nbytes > self.max_bytes:
            with self._lock:
                self.counts["refused"] += 1
            raise RoutingExpiredError(f"routing of {arr.nbytes} bytes exceeds the routing store's cap of "
                                      f"{self.max_bytes} bytes (RR_ROUTING_STORE_BYTES): it could not be held")
        key = uuid.uuid4().hex
        ref = RoutingRef(store=self.instance, url=self.url, key=key, rows=int(arr.shape[0]),
                         layers=int(arr.shape[1]), topk=int(arr.shape[2]), dtype=arr.dtype.name,
                         start=checked.start, weight_version=self.weight_version, checksum=checksum(arr))
        with self._lock:
            while self._entries and self._bytes + arr.nbytes > self.max_bytes:
                old, e = self._entries.popitem(last=False)
                self._bytes -= e.rows.nbytes
                self.counts["evicted"] += 1
                self.counts["evicted_bytes"] += e.rows.nbytes
                self._forget(old, f"evicted by the routing store's byte cap ({self.max_bytes} bytes)")
            self._entries[key] = _Entry(arr, ref.weight_version)
            self._bytes += arr.nbytes
            self.counts["stored"] += 1
            self.counts["stored_bytes"] += arr.nbytes
        return ref.to_dict()

    def _forget(self, key: str, why: str) -> None:
        self._gone[key] = why
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def retire(self, through: int) -> dict[str, int]:
        """Free every row made under weight version <= ``through``; later refs carry ``through + 1`` or more."""
        with self._lock:
            gone = [k for k, e in self._entries.items() if e.weight_version <= through]
            freed = 0
            for k in gone:
                e = self._entries.pop(k)
                freed += e.rows.nbytes
                self._forget(k, f"retired with weight version {e.weight_version} (retire through {through})")
            self._bytes -= freed
            self.counts["retired"] += len(gone)
            self.counts["retired_bytes"] += freed
            self.weight_version = max(self.weight_version, through + 1)
            return {"retired": len(gone), "freed_bytes": freed, "weight_version": self.weight_version}

    # ------------------------------------------------------------------ read
    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key`` (default: all); :class:`RoutingExpiredError` if not held here."""
        with self._lock:
            e = self._entries.get(key) if store == self.instance else None
            if e is None:
                self.counts["expired_reads"] += 1
                if store != self.instance:
                    why = (f"it was made by routing store {store}, this server's is {self.instance} (the server "
                           "restarted, or the ref was sent to another server)")
                else:
                    why = self._gone.get(key, "no such key in this routing store")
                raise RoutingExpiredError(f"routing ref {key}: {why}")
            n = int(e.rows.shape[0])
            a, b = (0 if start is None else start), (n if stop is None else stop)
            if not 0 <= a <= b <= n:
                raise ValueError(f"routing ref {key}: rows [{a}, {b}) outside its {n} rows")
            rows = e.rows[a:b]
            self.counts["reads"] += 1
            self.counts["read_rows"] += b - a
            self.counts["read_bytes"] += rows.nbytes
        return FramePart(key, a, b, rows)

    def stats(self) -> dict[str, Any]:
        """Counters for ``/rr/info`` and metrics: entries and bytes held, cap, weight version, lifetime counts."""
        with self._lock:
            return {"instance": self.instance, "entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes, "weight_version": self.weight_version, **self.counts}


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
