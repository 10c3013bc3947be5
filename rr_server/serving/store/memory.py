"""The in-memory routing store every rr server holds for ``routed_experts_format="ref"`` (the default backend).

Rows enter only as :class:`rr_client.core.codec.CheckedRouting` (checked once, when stored, as for an inline answer)
and leave by key and row range as a binary frame (:mod:`rr_client.core.reference`). Bounded by bytes, oldest evicted
first; retired per weight version (``POST /rr/routing/retire`` after a weight push). A key never gets other rows
(keys are random and never reused); a key that is gone answers 410 with why (evicted / retired / another store
instance: the server restarted), which the client raises as :class:`rr_client.RoutingExpiredError`. The API
server processes of one server (vLLM's ``--api-server-count``) answer for each other's refs
(:mod:`rr_server.serving.store.siblings`); the HTTP routes are :mod:`rr_server.serving.store.routes`.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import Any
from urllib.parse import urlsplit

from rr_client.core.codec import CheckedRouting
from rr_client.core.errors import RoutingExpiredError
from rr_client.core.indexer import CheckedIndexer
from rr_client.core.reference import FramePart
from rr_server.serving.store.base import NewRows, RowStore
from rr_server.serving.store.ledger import Held, StoreLedger, admitted_version, row_range
from rr_server.serving.store.siblings import Siblings

__all__ = ["MemoryStore", "DEFAULT_MAX_BYTES"]

logger = logging.getLogger("rr.routing_store")
if logger.level == logging.NOTSET:  # the engines' imports raise the root logger to ERROR: keep rr's warnings heard
    logger.setLevel(logging.WARNING)

DEFAULT_MAX_BYTES = 2 << 30


class MemoryStore(RowStore):
    """Checked rows by key in this process, bounded by ``max_bytes`` (oldest evicted first), retired per weight
    version (:class:`StoreLedger`). Thread-safe (vLLM builds large answers in a worker thread). ``url``: what refs
    name as the place to read."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        url: str = "",
        instance: str | None = None,
        *,
        what: str = "routing store",
        setting: str = "RR_ROUTING_STORE_BYTES",
    ) -> None:
        self.ledger = StoreLedger(max_bytes, instance, what=what, setting=setting)
        self.url = url
        self.siblings: Siblings | None = None  #: the server's other API server processes (install_store)
        self._lock = threading.Lock()

    @property
    def instance(self) -> str:  # type: ignore[override]
        return self.ledger.instance

    @property
    def max_bytes(self) -> int:
        return self.ledger.max_bytes

    def put(self, checked: CheckedRouting | CheckedIndexer) -> dict[str, Any]:
        """Keep checked rows; return the :class:`RoutingRef` dict the answer carries instead of them."""
        new = NewRows(checked)
        arr = checked.array
        with self._lock:
            self.ledger.admit(arr.nbytes)
            made = admitted_version()  # the engine's weight version at admission, else the retire counter
            version = self.ledger.weight_version if made is None else made
            self.ledger.add(new.key, Held(arr, int(arr.shape[0]), arr.nbytes, version, new.digest))
        return new.ref(self.instance, self.url, version)

    def local_retire(self, through: int) -> dict[str, int]:
        """Free every row made under weight version <= ``through`` (the engine's version at the request's admission)."""
        with self._lock:
            return self.ledger.retire(through)

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key`` (default: all) with the checksum kept from store time when whole;
        :class:`RoutingExpiredError` if not held here."""
        with self._lock:
            e = self.ledger.find(store, key)
            a, b = row_range(key, e.n_rows, start, stop)
            rows = e.rows[a:b]
            self.ledger.note_read(b - a, rows.nbytes)
        return FramePart(key, a, b, rows, e.digest if (a, b) == (0, e.n_rows) else "")

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
        """(rows, bytes per row) of each (store, key), or why it is not held here: a read's cost, no row touched."""
        out: list[tuple[int, int] | RoutingExpiredError] = []
        with self._lock:
            for store, key in keys:
                try:
                    e = self.ledger.find(store, key)
                except RoutingExpiredError as why:
                    out.append(why)
                    continue
                out.append((e.n_rows, e.nbytes // e.n_rows if e.n_rows else 0))
        return out

    def local_stats(self) -> dict[str, Any]:
        """This process's counters (:meth:`StoreLedger.stats`; ``sibling_reads``: asks read from a sibling)."""
        with self._lock:
            return {**self.ledger.stats(), "sibling_reads": self.siblings.forwarded if self.siblings else 0}

    def advertise(self, url: str) -> None:
        """Refs name ``url`` from now on; a loopback URL is said at start (a trainer on another machine would read
        its own loopback)."""
        self.url = url
        host = urlsplit(url).hostname or ""
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if loopback:
            logger.warning(
                "rr: routing refs name %s, a loopback address: a trainer rank on another machine would "
                "read its own loopback. Serve on a reachable --host, or set RR_ADVERTISE_URL to the URL "
                "ranks reach this server at.",
                url,
            )
