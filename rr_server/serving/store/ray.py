"""The routing store on Ray's object store (``RR_ROUTING_STORE=ray``, ``rr-replay[ray]``): for users who already
run Ray (verl, OpenRLHF, NeMo-RL) and outgrow one server's memory.

One store actor per engine process (``rr-routing-store-<id>``, namespace ``rr``, pinned to the engine's node),
with that engine's own byte cap (``RR_ROUTING_STORE_BYTES``) and weight version. It is not detached: it goes
away with the engine process that made it (Ray reclaims an actor whose owner died; a clean stop kills it first).
The engine ``ray.put`` s each sample's checked rows once and hands the store actor the object ref; the answer
carries a :class:`rr_client.RoutingRef` whose URL is ``ray://rr/<actor>``; a trainer rank resolves it with Ray
(``rr_client.client._ray_refs``), zero-copy on the node, through Ray's object manager across nodes. Bounded by bytes
(oldest first) and retired per weight version, with the same errors and counters as the in-memory store.
``rr-server ray-stores`` lists the store actors on a cluster and removes leftovers (:func:`list_stores`).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rr_client.core import settings
from rr_client.core.codec import CheckedRouting
from rr_client.core.errors import RoutingExpiredError
from rr_client.core.indexer import CheckedIndexer
from rr_client.core.optional import require
from rr_client.core.reference import FramePart
from rr_server.serving.store.base import NewRows, RowStore
from rr_server.serving.store.ledger import Held, StoreLedger, admitted_version, row_range
from rr_server.serving.store.siblings import Siblings

__all__ = [
    "RayStoreActor",
    "RayStore",
    "NAMESPACE",
    "PREFIX",
    "SCHEME",
    "actor_name",
    "connect",
    "list_stores",
    "remove_stores",
]

SCHEME = "ray://"  #: a Ray store's refs name ``ray://<namespace>/<actor>`` (the client parses it in _ray_refs)
NAMESPACE = "rr"
PREFIX = "rr-routing-store-"  #: every store actor's name starts so (rr before 0.1: one per node, detached)


def actor_name(node_id: str) -> str:
    """A new store actor's name: its node, and a part of its own (one actor per engine process)."""
    return f"{PREFIX}{node_id[:8]}-{uuid.uuid4().hex[:12]}"


class RayStoreActor:
    """The Ray actor (``ray.remote`` at install): rows by key as object refs, bounded and retired per weight
    version by the same :class:`StoreLedger` as the in-memory store. ``engine``: who made it (for the list)."""

    def __init__(
        self,
        max_bytes: int,
        engine: dict[str, Any] | None = None,
        what: str = "Ray routing store",
        setting: str = "RR_ROUTING_STORE_BYTES",
    ) -> None:
        self.ledger = StoreLedger(
            max_bytes,
            what=what,
            moved="its engine restarted, or the ref was sent to another engine's store",
            setting=setting,
        )
        self.engine = dict(engine or {})

    def identity(self) -> tuple[str, int]:
        """(store instance id, the weight version new rows get)."""
        return self.ledger.instance, self.ledger.weight_version

    def describe(self) -> dict[str, Any]:
        """Who made this store, and its counters (``rr-server ray-stores``)."""
        return {"engine": self.engine, **self.stats()}

    def put(self, key: str, held: list[Any], nbytes: int, n_rows: int, digest: str, version: int | None = None) -> int:
        """Hold the object ``held[0]`` (the engine's one ``ray.put``; in a list, so Ray passes the ref, not the
        rows); returns the weight version they were stored under (``version``: the engine's at the request's
        admission; None: the store's retire counter)."""
        self.ledger.admit(nbytes)
        version = self.ledger.weight_version if version is None else int(version)
        self.ledger.add(key, Held(held[0], n_rows, nbytes, version, digest))
        return version

    def locate(self, asks: list[tuple[str, str]]) -> list[Any]:
        """For each (store, key): ``[object ref, digest]`` or ``[None, why it is gone]`` (no raise over Ray)."""

        def read(e: Held) -> list[Any]:
            self.ledger.note_read(e.n_rows, e.nbytes)
            return [e.rows, e.digest]  # nested: the caller gets the object ref and ray.get s it where it runs

        return self._each_held(asks, read)

    def extents(self, asks: list[tuple[str, str]]) -> list[list[Any]]:
        """For each (store, key): ``[rows, bytes per row]`` or ``[None, why it is gone]`` (no raise over Ray): what
        a read costs, known before any row is fetched."""
        return self._each_held(asks, lambda e: [e.n_rows, e.nbytes // e.n_rows if e.n_rows else 0])

    def _each_held(self, asks: list[tuple[str, str]], answer: Callable[[Held], list[Any]]) -> list[list[Any]]:
        """For each (store, key): ``answer`` of its held rows, or ``[None, why it is gone]``: a Ray answer, no raise."""
        out: list[list[Any]] = []
        for store, key in asks:
            try:
                e = self.ledger.find(store, key)
            except RoutingExpiredError as why:
                out.append([None, str(why)])
                continue
            out.append(answer(e))
        return out

    def retire(self, through: int) -> dict[str, int]:
        return self.ledger.retire(through)

    def stats(self) -> dict[str, Any]:
        return {**self.ledger.stats(), "backend": "ray"}


def connect(address: str | None = None) -> Any:
    """Ray, joined at ``address`` (``RR_RAY_ADDRESS``, default ``auto``) unless this process already is."""
    ray = require("ray", for_what="RR_ROUTING_STORE=ray")
    if not ray.is_initialized():
        ray.init(
            address=address or settings.text("RR_RAY_ADDRESS") or "auto",
            namespace=NAMESPACE,
            log_to_driver=False,
            ignore_reinit_error=True,
        )
    return ray


class RayStore(RowStore):
    """The engine side of the Ray store: :class:`rr_server.serving.store.base.RowStore` over this engine's own
    store actor (connects to Ray at ``RR_RAY_ADDRESS``, default ``auto``)."""

    def __init__(
        self,
        max_bytes: int,
        address: str | None = None,
        name: str | None = None,
        *,
        what: str = "Ray routing store",
        setting: str = "RR_ROUTING_STORE_BYTES",
    ) -> None:
        ray = connect(address)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        self.name = name or actor_name(node)
        self.url = f"{SCHEME}{NAMESPACE}/{self.name}"
        self.siblings: Siblings | None = None  #: the server's other API server processes (install_store)
        engine = {"host": socket.gethostname(), "pid": os.getpid(), "node": node, "started": time.time()}
        self._actor = (
            ray.remote(RayStoreActor)
            .options(
                name=self.name,
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(max_bytes, engine, what, setting)
        )
        self.instance, _ = ray.get(self._actor.identity.remote())
        self._ray = ray
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def put(self, checked: CheckedRouting | CheckedIndexer) -> dict[str, Any]:
        """One ``ray.put`` of the checked rows; the actor keeps the object ref (held before the answer names it)."""
        new = NewRows(checked)
        arr = checked.array
        obj = self._ray.put(arr)
        version = self._ray.get(
            self._actor.put.remote(new.key, [obj], int(arr.nbytes), int(arr.shape[0]), new.digest, admitted_version())
        )
        return new.ref(self.instance, self.url, int(version))

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key`` (the HTTP read route on a Ray store), with the kept checksum."""
        ((obj, digest_or_why),) = self._ray.get(self._actor.locate.remote([(store, key)]))
        if obj is None:
            raise RoutingExpiredError(digest_or_why)
        rows = self._ray.get(obj)
        a, b = row_range(key, int(rows.shape[0]), start, stop)
        return FramePart(key, a, b, rows[a:b], digest_or_why if (a, b) == (0, int(rows.shape[0])) else "")

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
        """(rows, bytes per row) of each (store, key) from the actor's ledger, or why it is gone; no rows fetched."""
        if not keys:
            return []
        got = self._ray.get(self._actor.extents.remote([tuple(k) for k in keys]))
        return [RoutingExpiredError(why) if n is None else (int(n), int(why)) for n, why in got]

    def local_retire(self, through: int) -> dict[str, int]:
        """The actor frees the rows made under weight version <= ``through``."""
        return dict(self._ray.get(self._actor.retire.remote(int(through))))

    def local_stats(self) -> dict[str, Any]:
        """The actor's counters (``backend: ray``), and the asks this process read from a sibling."""
        return {
            **self._ray.get(self._actor.stats.remote()),
            "sibling_reads": self.siblings.forwarded if self.siblings else 0,
        }

    def advertise(self, url: str) -> None:
        """Nothing to do: a Ray store's refs name its actor (``ray://``), not the server's URL."""

    def close(self) -> None:
        """Remove the store actor (its rows with it): the engine stops (also at exit, once)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ray.is_initialized():
                self._ray.kill(self._actor)
        except Exception:  # noqa: BLE001 - at exit Ray may be half down; the actor dies with its owner anyway
            pass


def list_stores(address: str | None = None) -> list[dict[str, Any]]:
    """Every routing store actor on the cluster: name, namespace, and who made it with its counters, or
    ``legacy`` (a node-wide detached store of rr before 0.1, never removed) / ``unreachable``."""
    ray = connect(address)
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if not a["name"].startswith(PREFIX):
            continue
        row: dict[str, Any] = {"name": a["name"], "namespace": a["namespace"]}
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            if not hasattr(actor, "describe"):
                row["state"] = "legacy"
            else:
                row.update(ray.get(actor.describe.remote(), timeout=10), state="live")
        except Exception as e:  # noqa: BLE001 - a store that cannot answer is a leftover to list, not a crash
            row.update(state="unreachable", why=f"{type(e).__name__}: {e}")
        out.append(row)
    return out


def remove_stores(names: list[str], address: str | None = None) -> list[str]:
    """Kill the named store actors (namespace ``rr``); the names removed."""
    ray = connect(address)
    done = []
    for name in names:
        if not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not a routing store actor (names start with {PREFIX!r})")
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            continue
        done.append(name)
    return done
