"""The routing store on Ray's object store (``RR_ROUTING_STORE=ray``, ``rr-replay[ray]``): for users who already
run Ray (verl, OpenRLHF, NeMo-RL) and outgrow one server's memory.

One store actor per engine node (``rr-routing-store-<node>``, namespace ``rr``, pinned to the node, detached so
it outlives an engine restart) holds each sample's checked rows with ``ray.put``; the engine's answer carries a
:class:`rr_client.RoutingRef` whose URL is ``ray://rr/<actor>``; a trainer rank resolves it with Ray
(:mod:`rr_client._ray_refs`), zero-copy on the node, through Ray's object manager across nodes. Bounded by
bytes (oldest first) and retired per weight version, with the same errors and counters as the in-memory store.
"""

from __future__ import annotations

import threading
from typing import Any

from rr_client import settings
from rr_client.codec import CheckedRouting
from rr_client.errors import RoutingExpiredError
from rr_client.optional import require
from rr_client.reference import FramePart, RoutingRef, checksum
from rr_server.serving.store_ledger import Held, StoreLedger, row_range

__all__ = ["RayStoreActor", "RayRoutingStore", "NAMESPACE", "actor_name"]

NAMESPACE = "rr"


def actor_name(node_id: str) -> str:
    """The store actor of one Ray node."""
    return f"rr-routing-store-{node_id[:16]}"


class RayStoreActor:
    """The Ray actor (``ray.remote`` at install): rows by key as object refs, bounded and retired per weight
    version by the same :class:`StoreLedger` as the in-memory store."""

    def __init__(self, max_bytes: int) -> None:
        self.ledger = StoreLedger(max_bytes, what="Ray routing store",
                                  moved="restarted, or sent to another node's store")

    def identity(self) -> tuple[str, int]:
        """(store instance id, the weight version new rows get)."""
        return self.ledger.instance, self.ledger.weight_version

    def put(self, key: str, rows: Any, digest: str) -> int:
        """Hold ``rows`` (numpy) with ``ray.put``; returns the weight version they were stored under."""
        import ray

        self.ledger.admit(int(rows.nbytes))
        version = self.ledger.weight_version
        self.ledger.add(key, Held(ray.put(rows), int(rows.shape[0]), int(rows.nbytes), version, digest))
        return version

    def locate(self, asks: list[tuple[str, str]]) -> list[Any]:
        """For each (store, key): ``[object ref, digest]`` or ``[None, why it is gone]`` (no raise over Ray)."""
        out: list[Any] = []
        for store, key in asks:
            try:
                e = self.ledger.find(store, key)
            except RoutingExpiredError as why:
                out.append([None, str(why)])
                continue
            self.ledger.note_read(e.n_rows, e.nbytes)
            out.append([e.rows, e.digest])
        return out

    def retire(self, through: int) -> dict[str, int]:
        return self.ledger.retire(through)

    def stats(self) -> dict[str, Any]:
        return {**self.ledger.stats(), "backend": "ray"}


class RayRoutingStore:
    """The engine side of the Ray store: the :class:`rr_server.serving.routing_store.RoutingStore` interface
    over this node's store actor (connects to Ray at ``RR_RAY_ADDRESS``, default ``auto``)."""

    def __init__(self, max_bytes: int, address: str | None = None, name: str | None = None) -> None:
        ray = require("ray", for_what="RR_ROUTING_STORE=ray")
        if not ray.is_initialized():
            ray.init(address=address or settings.text("RR_RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                     log_to_driver=False, ignore_reinit_error=True)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        self.name = name or actor_name(node)
        self.url = f"ray://{NAMESPACE}/{self.name}"
        self._actor = ray.remote(RayStoreActor).options(
            name=self.name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(max_bytes)
        self.instance, _ = ray.get(self._actor.identity.remote())
        self._ray = ray
        self._lock = threading.Lock()

    def put(self, checked: CheckedRouting) -> dict[str, Any]:
        import uuid

        arr = checked.array
        key, digest = uuid.uuid4().hex, checksum(arr)
        version = self._ray.get(self._actor.put.remote(key, arr, digest))  # held before the answer names it
        return RoutingRef(store=self.instance, url=self.url, key=key, rows=int(arr.shape[0]),
                          layers=int(arr.shape[1]), topk=int(arr.shape[2]), dtype=arr.dtype.name,
                          start=checked.start, weight_version=int(version), checksum=digest).to_dict()

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        (ref, why), = self._ray.get(self._actor.locate.remote([(store, key)]))
        if ref is None:
            raise RoutingExpiredError(why)
        rows = self._ray.get(ref)
        a, b = row_range(key, int(rows.shape[0]), start, stop)
        return FramePart(key, a, b, rows[a:b])

    def retire(self, through: int) -> dict[str, int]:
        return dict(self._ray.get(self._actor.retire.remote(int(through))))

    def stats(self) -> dict[str, Any]:
        return dict(self._ray.get(self._actor.stats.remote()))
