"""The client's replica pool: least-in-flight choice, affinity, taking failed replicas out and back in.

One :class:`Replica` per engine URL, each with its own httpx pool. Requests go to the healthy replica
with the fewest requests in flight (ties: the one that has served fewest); an affinity key pins every
request that carries it to one replica while that replica is healthy. A replica that fails a
connection or answers 5xx is marked down and a background task probes its health path until it
answers 2xx and its ``/rr/info`` still matches the pool's; then it is taken back. When no replica is
healthy, requests go to the least-loaded one anyway; a single URL is never taken out (the single-URL
client behaves as before). Only the probe takes a replica back: an answer to a request sent before it
was taken out proves nothing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from rr_client.core.errors import ConfigurationError, ReplicaMismatchError
from rr_client.core.info import RRInfo

__all__ = ["Replica", "ReplicaPool", "ReplicaStats", "INFO_KEYS", "info_mismatch"]

# /rr/info fields every replica of one pool must agree on (the routing every payload is checked against, and what
# the sampled log-probs mean: every result is labelled with the pool's logprobs_mode).
INFO_KEYS = (
    "model",
    "num_hidden_layers",
    "num_experts",
    "topk",
    "moe_layers",
    "wire_dtype",
    "wire_format",
    "logprobs_mode",
)
_MAX_AFFINITY_KEYS = 65536


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A snapshot of one replica's counters (``RoutedExpertsClient.replica_stats()``)."""

    url: str
    healthy: bool
    requests: int  # requests sent to it (every attempt counts)
    errors: int  # attempts that failed with a connection error or a 5xx
    in_flight: int  # requests waiting for its answer now
    taken_out: int  # times it was marked down
    taken_back: int  # times a probe brought it back
    last_error: str | None


class Replica:
    """One engine URL: its connection pool, health and counters."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http
        self.healthy = True
        self.requests = 0
        self.errors = 0
        self.in_flight = 0
        self.taken_out = 0
        self.taken_back = 0
        self.last_error: str | None = None
        self.info: RRInfo | None = None
        self.probe: asyncio.Task[None] | None = None

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            self.url,
            self.healthy,
            self.requests,
            self.errors,
            self.in_flight,
            self.taken_out,
            self.taken_back,
            self.last_error,
        )


def info_mismatch(ref: RRInfo, other: RRInfo) -> dict[str, tuple[Any, Any]]:
    """The :data:`INFO_KEYS` on which two replicas' ``/rr/info`` disagree, as ``{key: (ref, other)}``."""
    return {k: (getattr(ref, k), getattr(other, k)) for k in INFO_KEYS if getattr(ref, k) != getattr(other, k)}


class ReplicaPool:
    """Replicas of one model behind one client; all methods run on the client's event loop."""

    def __init__(
        self,
        urls: list[str],
        make_http: Callable[[str], httpx.AsyncClient],
        *,
        health_path: str = "/health",
        probe_interval: float = 1.0,
    ) -> None:
        if not urls:
            raise ConfigurationError("no replica URL given")
        if len(set(urls)) != len(urls):
            raise ConfigurationError(f"replica URLs must be distinct: {urls}")
        self.replicas = [Replica(u, make_http(u)) for u in urls]
        self.health_path = health_path
        self.probe_interval = probe_interval
        self.info: RRInfo | None = None  # the pool's reference /rr/info (the first replica that answered)
        self._affinity: OrderedDict[Hashable, Replica] = OrderedDict()
        self._closed = False

    # ------------------------------------------------------------------ choice

    def pick(self, affinity: Hashable | None = None, avoid: Replica | None = None) -> Replica:
        """The replica for the next request: the affinity's replica while healthy, else the least-loaded healthy one.

        ``avoid`` (the replica that just failed this request) is used only when nothing else is left.
        """
        if affinity is not None:
            pinned = self._affinity.get(affinity)
            if pinned is not None and pinned.healthy and pinned is not avoid:
                self._affinity.move_to_end(affinity)
                return pinned
        pool = [r for r in self.replicas if r.healthy and r is not avoid]
        if not pool:
            pool = [r for r in self.replicas if r.healthy] or [r for r in self.replicas if r is not avoid]
        if not pool:
            pool = self.replicas
        chosen = min(pool, key=lambda r: (r.in_flight, r.requests))
        if affinity is not None:
            self._affinity[affinity] = chosen
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > _MAX_AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return chosen

    def replica_of(self, affinity: Hashable) -> str | None:
        """URL of the replica an affinity key is pinned to, if any."""
        r = self._affinity.get(affinity)
        return r.url if r is not None else None

    # ------------------------------------------------------------------ health

    def failed(self, r: Replica, why: str) -> None:
        """A connection error or a 5xx: count it and take the replica out (with several replicas)."""
        r.errors += 1
        r.last_error = why
        if r.healthy and len(self.replicas) > 1:
            r.healthy = False
            r.taken_out += 1
            self._start_probe(r)

    def _take_back(self, r: Replica) -> None:
        r.healthy = True
        r.taken_back += 1
        if r.probe is not None and r.probe is not asyncio.current_task():
            r.probe.cancel()
        r.probe = None

    def _start_probe(self, r: Replica) -> None:
        if self._closed or (r.probe is not None and not r.probe.done()):
            return
        r.probe = asyncio.get_running_loop().create_task(self._probe(r), name=f"rr-probe {r.url}")

    async def _probe(self, r: Replica) -> None:
        """Poll the health path; take the replica back once it answers 2xx and serves the same model."""
        while not r.healthy and not self._closed:
            await asyncio.sleep(self.probe_interval)
            try:
                resp = await r.http.get(self.health_path, timeout=min(self.probe_interval * 5, 10.0))
                if resp.status_code >= 300:
                    r.last_error = f"probe {self.health_path}: HTTP {resp.status_code}"
                    continue
                if self.info is not None:
                    resp = await r.http.get("/rr/info", timeout=10.0)
                    other = RRInfo.model_validate(orjson.loads(resp.content)) if resp.status_code < 300 else None
                    if other is None:
                        r.last_error = f"probe /rr/info: HTTP {resp.status_code}"
                        continue
                    bad = info_mismatch(self.info, other)
                    if bad:  # a different model came up at this URL: never take it back
                        r.last_error = str(ReplicaMismatchError(_mismatch_text(self.info, r.url, bad)))
                        return
                    r.info = other
            except (httpx.HTTPError, ValueError) as e:
                r.last_error = f"probe: {type(e).__name__}: {e}"
                continue
            if not r.healthy:
                self._take_back(r)
            return

    # ------------------------------------------------------------------ info

    def check_info(self, infos: dict[Replica, RRInfo]) -> RRInfo:
        """Set and return the pool's reference info; raise :class:`ReplicaMismatchError` if replicas disagree."""
        ref_replica = next(r for r in self.replicas if r in infos)
        ref = infos[ref_replica]
        problems = []
        for r, inf in infos.items():
            r.info = inf
            bad = info_mismatch(ref, inf)
            if bad:
                problems.append(_mismatch_text(ref, r.url, bad, ref_url=ref_replica.url))
        if problems:
            raise ReplicaMismatchError("replicas do not serve the same model: " + "; ".join(problems))
        self.info = ref
        return ref

    def stats(self) -> list[ReplicaStats]:
        return [r.stats() for r in self.replicas]

    async def aclose(self) -> None:
        self._closed = True
        probes = [r.probe for r in self.replicas if r.probe is not None]
        for p in probes:
            p.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await asyncio.gather(*(r.http.aclose() for r in self.replicas), return_exceptions=True)


def _mismatch_text(ref: RRInfo, url: str, bad: dict[str, tuple[Any, Any]], ref_url: str | None = None) -> str:
    what = ", ".join(f"{k}={b!r} (vs {a!r})" for k, (a, b) in bad.items())
    return f"{url} serves {what}" + (f" compared with {ref_url}" if ref_url else "")
