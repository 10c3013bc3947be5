"""The client's key stays home (issue 36, item 6): a ref naming a host that is not one of the client's replicas is
refused before anything is sent to it, unless the user trusts that host (key sent) or allows it keyless (read
without the key); an ``http://`` ref is refused while the client's servers are ``https://``.

Two real loopback listeners (uvicorn) serve the routing store's real routes and record every request's headers:
the client's replica, and a "foreign" one a ref can be pointed at (its checksum covers the rows, not the URL).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from rr_client import RoutedExpertsClient, RoutingRef, UntrustedHostError
from rr_client.core.codec import check_routing
from rr_client.core.errors import ConfigurationError
from rr_server.serving.store import STORE_ROUTES, MemoryStore
from rr_server.serving.store import install as rs
from tests.support.routing_data import make_routing, small_moe_info
from tests.support.threaded_server import ThreadedServer

KEY = "secret-key"
INFO = small_moe_info()


class Recorder:
    """ASGI wrapper: every request's path and headers, in order."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]}))
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ThreadedServer, ThreadedServer, RoutingRef, np.ndarray]]:
    """(replica, foreign, a ref held by the store both serve, its rows)."""

    async def info(_: Any) -> JSONResponse:
        return JSONResponse(INFO.model_dump())

    app = Starlette(routes=[Route("/rr/info", info), *(Route(p, h, methods=list(m)) for p, h, m in STORE_ROUTES)])
    with pytest.MonkeyPatch.context() as mp:
        store = MemoryStore(1 << 20, "http://unused.test")
        mp.setattr(rs, "_STORE", store)
        rows = make_routing(5, 3, 2, 8, moe_layers=INFO.moe_layers, seed=3)
        checked = check_routing(rows, INFO, rows=5)
        ref = RoutingRef.from_dict(store.put(checked))
        with (
            ThreadedServer(Recorder(app), name="replica") as replica,
            ThreadedServer(Recorder(app), name="foreign") as foreign,
        ):
            yield replica, foreign, ref, checked.array


def _seen(server: ThreadedServer) -> list[tuple[str, dict[str, str]]]:
    return server.app.seen  # type: ignore[no-any-return]


def _read(base: str, refs: list[RoutingRef], **kw: Any) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        async with RoutedExpertsClient(base, info=INFO, **kw) as c:
            return await c.resolve(refs)

    return asyncio.run(run())


@pytest.fixture()
def fresh(servers: Any) -> Any:
    for s in servers[:2]:
        _seen(s).clear()
    return servers


def test_a_ref_naming_a_foreign_host_never_receives_the_key(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, foreign, ref, rows = fresh
    monkeypatch.delenv("RR_TRUSTED_HOSTS", raising=False)
    monkeypatch.delenv("RR_KEYLESS_HOSTS", raising=False)
    away = ref.with_url(foreign.url)  # same host, another port: another server
    for refs in ([away], [ref.with_url(replica.url), away]):  # a mixed batch: nothing is read, not even the replica's
        with pytest.raises(UntrustedHostError, match=f"127.0.0.1:{foreign.port}.*RR_TRUSTED_HOSTS"):
            _read(replica.url, refs, api_key=KEY)
    with pytest.raises(UntrustedHostError, match="localhost"):  # another name for the same machine: not a replica
        _read(replica.url, [ref.with_url(f"http://localhost:{replica.port}")], api_key=KEY)
    with pytest.raises(UntrustedHostError):  # custom headers are credentials too
        _read(replica.url, [away], headers={"cookie": "session=1"})
    assert _seen(foreign) == [] and _seen(replica) == []


def test_the_replica_gets_the_key(fresh: Any) -> None:
    replica, foreign, ref, rows = fresh
    got = _read(replica.url, [ref.with_url(replica.url)], api_key=KEY)
    assert np.array_equal(got[0], rows)
    assert [h.get("authorization") for _, h in _seen(replica)] == [f"Bearer {KEY}"]


def test_a_keyless_host_is_read_without_the_key_or_headers(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, foreign, ref, rows = fresh
    got = _read(
        replica.url,
        [ref.with_url(foreign.url)],
        api_key=KEY,
        headers={"x-team": "rl"},
        keyless_hosts=[f"127.0.0.1:{foreign.port}"],
    )
    assert np.array_equal(got[0], rows)
    monkeypatch.setenv("RR_KEYLESS_HOSTS", f"other.test, 127.0.0.1:{foreign.port}")
    _read(replica.url, [ref.with_url(foreign.url)], api_key=KEY)
    assert [p for p, _ in _seen(foreign)] == ["/rr/routing/read"] * 2
    assert all("authorization" not in h and "x-team" not in h for _, h in _seen(foreign))


def test_a_trusted_host_gets_the_key(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, foreign, ref, rows = fresh
    _read(replica.url, [ref.with_url(foreign.url)], api_key=KEY, trusted_hosts=["127.0.0.1"])  # any port
    monkeypatch.setenv("RR_TRUSTED_HOSTS", f"http://127.0.0.1:{foreign.port}")
    _read(replica.url, [ref.with_url(foreign.url)], api_key=KEY)
    assert [h.get("authorization") for _, h in _seen(foreign)] == [f"Bearer {KEY}"] * 2


def test_a_client_without_credentials_reads_any_host(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, foreign, ref, rows = fresh
    monkeypatch.delenv("RR_API_KEY", raising=False)
    assert np.array_equal(_read(replica.url, [ref.with_url(foreign.url)])[0], rows)
    assert ["authorization" in h for _, h in _seen(foreign)] == [False]


def test_an_http_ref_is_refused_when_the_clients_servers_are_https(fresh: Any) -> None:
    replica, foreign, ref, rows = fresh
    https = f"https://127.0.0.1:{replica.port}"
    for kw in ({"api_key": KEY, "trusted_hosts": ["127.0.0.1"]}, {"keyless_hosts": ["127.0.0.1"]}, {}):
        with pytest.raises(UntrustedHostError, match="http:// while this client's servers are https://"):
            _read(https, [ref.with_url(foreign.url)], **kw)
    assert _seen(foreign) == []


def test_bad_host_lists_and_ref_urls_are_typed(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, foreign, ref, rows = fresh
    with pytest.raises(ConfigurationError, match="host-list entry"):
        RoutedExpertsClient(replica.url, trusted_hosts=["host/path"])
    monkeypatch.setenv("RR_TRUSTED_HOSTS", "a.test:notaport")
    with pytest.raises(ConfigurationError):
        RoutedExpertsClient(replica.url)
    monkeypatch.delenv("RR_TRUSTED_HOSTS")
    with pytest.raises(UntrustedHostError, match="http://"):
        _read(replica.url, [ref.with_url("http://")], api_key=KEY)
    for url in ("file:///etc/passwd", "gopher://127.0.0.1:70"):  # object stores: only those the client lists
        with pytest.raises(UntrustedHostError, match="was not configured to read: list its prefix in object_stores="):
            _read(replica.url, [ref.with_url(url)], api_key=KEY)


def test_the_policy_on_ipv6_case_ports_and_mixed_schemes() -> None:
    """Pure rules: the same origin whatever its spelling; an http replica of a mixed pool keeps its key; another
    http server under an https replica is refused even when trusted."""
    from rr_client.client._hosts import HostPolicy

    p = HostPolicy.of(
        ["http://[::1]:8000", "https://a.test"],
        trusted="[::1]:9000, b.test",
        keyless=["https://c.test:444"],
        credentials=True,
    )
    assert [
        p.decide(u)
        for u in (
            "http://[::1]:8000/x",
            "https://A.TEST:443",
            "https://[::1]:9000",
            "https://b.test:1",
            "https://c.test:444",
        )
    ] == ["key"] * 4 + ["keyless"]
    for url, why in (
        ("http://[::1]:9000", "travel in clear"),
        ("https://c.test", "none of this client's replicas"),
        ("http://[::1", "not a URL"),
        ("http://h:99999", "not a URL"),
        ("ray://ns/actor", "not an http"),
    ):
        with pytest.raises(UntrustedHostError, match=re.escape(why)):
            p.decide(url)
