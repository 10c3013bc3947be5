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
from collections import OrderedDict
from typing import Any

from rr_client import settings
from rr_client.codec import CheckedRouting
from rr_client.errors import RoutingExpiredError
from rr_client.optional import require
from rr_client.reference import FramePart, RoutingRef, checksum

__all__ = ["RayStoreActor", "RayRoutingStore", "NAMESPACE", "actor_name"]

NAMESPACE = "rr"
_GONE_REMEMBERED = 1 << 16


def actor_name(node_id: str) -> str:
    """The store actor of one Ray node."""
    return f"rr-routing-store-{node_id[:16]}"


class RayStoreActor:
    """The Ray actor (``ray.remote`` at install): rows by key as object refs, bounded, retired per version."""

    def __init__(self, max_bytes: int) -> None:
        import uuid

        self.max_bytes = int(max_bytes)
        self.instance = uuid.uuid4().hex
        self.weight_version = 0
        self._entries: OrderedDict[str, tuple[Any, int, int, str]] = OrderedDict()  # key -> (ref, nbytes, v, sum)
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self.counts = dict.fromkeys(("stored", "stored_bytes", "reads", "read_rows", "read_bytes", "evicted",
                                     "evicted_bytes", "retired", "retired_bytes", "expired_reads", "refused"), 0)

    def identity(self) -> tuple[str, int]:
        """(store instance id, the weight version new rows get)."""
        return self.instance, self.weight_version

    def _forget(self, key: str, why: str) -> None:
        self._gone[key] = why
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def put(self, key: str, rows: Any, digest: str) -> int:
        """Hold ``rows`` (numpy) with ``ray.put``; returns the weight version they were stored under."""
        import ray

        n = int(rows.nbytes)
        if n > self.max_bytes:
            self.counts["refused"] += 1
            raise RoutingExpiredError(f"routing of {n} bytes exceeds the Ray routing store's cap of "
                                      f"{self.max_bytes} bytes (RR_ROUTING_STORE_BYTES): it could not be held")
        while self._entries and self._bytes + n > self.max_bytes:
            old, (_, m, _, _) = self._entries.popitem(last=False)
            self._bytes -= m
            self.counts["evicted"] += 1
            self.counts["evicted_bytes"] += m
            self._forget(old, f"evicted by the Ray routing store's byte cap ({self.max_bytes} bytes)")
        self._entries[key] = (ray.put(rows), n, self.weight_version, digest)
        self._bytes += n
        self.counts["stored"] += 1
        self.counts["stored_bytes"] += n
        return self.weight_version

    def locate(self, asks: list[tuple[str, str]]) -> list[Any]:
        """For each (store, key): ``[object ref, digest]`` or ``[None, why it is gone]`` (no raise over Ray)."""
        out: list[Any] = []
        for store, key in asks:
            e = self._entries.get(key) if store == self.instance else None
            if e is None:
                self.counts["expired_reads"] += 1
                why = (f"it was made by routing store {store}, this Ray store is {self.instance} (restarted, or "
                       "sent to another node's store)" if store != self.instance
                       else self._gone.get(key, "no such key in this Ray routing store"))
                out.append([None, f"routing ref {key}: {why}"])
                continue
            self.counts["reads"] += 1
            self.counts["read_bytes"] += e[1]
            out.append([e[0], e[3]])
        return out

    def retire(self, through: int) -> dict[str, int]:
        gone = [k for k, e in self._entries.items() if e[2] <= through]
        freed = 0
        for k in gone:
            _, n, v, _ = self._entries.pop(k)
            freed += n
            self._forget(k, f"retired with weight version {v} (retire through {through})")
        self._bytes -= freed
        self.counts["retired"] += len(gone)
        self.counts["retired_bytes"] += freed
        self.weight_version = max(self.weight_version, through + 1)
        return {"retired": len(gone), "freed_bytes": freed, "weight_version": self.weight_version}

    def stats(self) -> dict[str, Any]:
        return {"instance": self.instance, "entries": len(self._entries), "bytes": self._bytes,
                "max_bytes": self.max_bytes, "weight_version": self.weight_version, "backend": "ray",
                **self.counts}


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
        n = int(rows.shape[0])
        a, b = (0 if start is None else start), (n if stop is None else stop)
        if not 0 <= a <= b <= n:
            raise ValueError(f"routing ref {key}: rows [{a}, {b}) outside its {n} rows")
        return FramePart(key, a, b, rows[a:b])

    def retire(self, through: int) -> dict[str, int]:
        return dict(self._ray.get(self._actor.retire.remote(int(through))))

    def stats(self) -> dict[str, Any]:
        return dict(self._ray.get(self._actor.stats.remote()))
