"""Prometheus metrics of one sidecar app, in their own registry so several apps can coexist."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rr_server.serving.routing_metrics import RoutingCounters

__all__ = ["ProxyMetrics"]

_STORE_GAUGES = {
    "entries": "Routing entries held for refs",
    "bytes": "Routing bytes held for refs",
    "max_bytes": "Byte cap of the routing store",
    "weight_version": "Weight version new refs carry",
}
_STORE_COUNTERS = {
    "stored": "Routing entries stored for refs",
    "reads": "Ref reads answered",
    "read_bytes": "Routing bytes read by reference",
    "evicted": "Entries evicted by the byte cap",
    "retired": "Entries retired with their weight version",
    "expired_reads": "Reads of refs whose rows were gone (410)",
    "refused": "Routing too large for the store (refused)",
}


class _StoreCollector:
    """The routing store's stats as Prometheus metrics, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        st = self._stats()
        for k, doc in _STORE_GAUGES.items():
            yield GaugeMetricFamily(f"rr_routing_store_{k}", doc, value=st[k])
        for k, doc in _STORE_COUNTERS.items():
            yield CounterMetricFamily(f"rr_routing_store_{k}", doc, value=st[k])


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    """Counters for requests, errors by kind, routing rows/bytes, and the upstream latency histogram."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rr_proxy_requests", "Requests answered, by route and status", ["route", "status"], registry=r
        )
        self.errors = Counter("rr_proxy_errors", "Failed requests by kind", ["kind"], registry=r)
        self.routing_rows = Counter("rr_proxy_routing_rows", "Routing rows sent to clients (validated)", registry=r)
        self.routing_bytes = Counter(
            "rr_proxy_routing_bytes", "Base64 routing payload bytes sent to clients", registry=r
        )
        self.upstream_latency = Histogram(
            "rr_proxy_upstream_latency_seconds",
            "Upstream call latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "rr_proxy_request_latency_seconds",
            "Client request latency through the sidecar",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("rr_proxy_in_flight", "Client requests being served", registry=r)
        self.upstream_up = Gauge("rr_proxy_upstream_up", "1 if the last upstream health probe succeeded", registry=r)
        # the same per-sample counters as a patched engine's /metrics (rr_routing_*_total)
        self.routing = RoutingCounters(r)

    def routing_sent(self, rows: int, payload: str | None) -> None:
        """Count one validated routing payload going out (a ref's rows stay in the store: no payload bytes)."""
        self.routing_rows.inc(rows)
        if payload is not None:
            self.routing_bytes.inc(len(payload))

    def watch_store(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Export the routing store's counters (refs) from ``stats()`` at every scrape."""
        self.registry.register(_StoreCollector(stats))

    def render(self) -> bytes:
        """Text exposition format of this registry."""
        return generate_latest(self.registry)
