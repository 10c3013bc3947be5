"""One contract, every routing store backend: memory (its real read route over httpx's ASGI transport), Ray (a
local cluster the test starts), a shared filesystem (this machine's disk) and S3 (moto's S3 server on loopback,
tests/support/s3_server.py). Each: rows put are the rows resolved (through the client's one check), a ref whose
checksum lies is refused, retire makes refs typed errors and leaves later ones, a ref of another store is never
answered with other rows, rows that skipped the check never get in, and a 256-sample batch resolves in one call.
What differs is said per backend: object stores' refs survive a new store instance (an engine restart), memory and
Ray refs do not."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import (
    ArgumentTypeError,
    RoutedExpertsClient,
    RoutingChecksumError,
    RoutingExpiredError,
    RoutingRef,
)
from rr_client.core.reference import checksum
from rr_server.serving.store.base import RowStore
from tests.support.routing_data import checked_routing, small_moe_info

INFO = small_moe_info()
checked = partial(checked_routing, INFO)
URL = "http://rr-store.test"


@dataclass
class Backend:
    """A store backend under test: how to make a store (a new instance at the same place each call: an engine's
    restart), how a trainer resolves refs, whether refs survive a new instance."""

    name: str
    make: Callable[[], RowStore]
    resolve: Callable[[list[RoutingRef]], list[np.ndarray]]
    survives_restart: bool


def _client_resolve(refs: list[RoutingRef], **client: Any) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        async with RoutedExpertsClient(client.pop("url", "http://127.0.0.1:9"), info=INFO, **client) as c:
            return await c.resolve(refs)

    return asyncio.run(run())


def _memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    from rr_server.serving.store import MemoryStore
    from rr_server.serving.store import install as installed
    from tests.unit.test_routing_ref import store_app

    held: list[MemoryStore] = []

    def make() -> RowStore:  # the server's store is the newest one (its read route reads that)
        held.append(MemoryStore(1 << 24, URL))
        monkeypatch.setattr(installed, "_STORE", held[-1])
        return held[-1]

    def resolve(refs: list[RoutingRef]) -> list[np.ndarray]:
        # the read route of the newest store: the engine as it is now (an older instance's refs are refused there)
        return _client_resolve(refs, url=URL, transport=httpx.ASGITransport(app=store_app(held[-1])))

    yield Backend("memory", make, resolve, survives_restart=False)


def _ray(request: pytest.FixtureRequest) -> Iterator[Backend]:
    request.getfixturevalue("ray_cluster")
    from rr_server.serving.store.ray import RayStore

    made: list[RayStore] = []

    def make() -> RowStore:
        if made:  # the engine restarts: its store actor goes with it, a new one takes the name
            made[-1].close()
        made.append(RayStore(1 << 24, name="rr-contract-store"))
        return made[-1]

    yield Backend("ray", make, _client_resolve, survives_restart=False)
    for s in made:
        s.close()


def _objects(url: str, opts: dict[str, Any], name: str) -> Iterator[Backend]:
    from rr_server.serving.store.objects import ObjectStore

    made: list[ObjectStore] = []

    def make() -> RowStore:
        made.append(ObjectStore(url, storage_options=opts))
        return made[-1]

    yield Backend(name, make, partial(_client_resolve, object_stores=[url], storage_options=opts), True)
    for s in made:
        s.close()


@pytest.fixture(params=["memory", "ray", "file", "s3"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield from _memory(request.getfixturevalue("monkeypatch"))
    elif request.param == "ray":
        yield from _ray(request)
    elif request.param == "file":
        with tempfile.TemporaryDirectory(prefix="rr-objects-") as d:
            yield from _objects(f"file://{d}/rollouts", {}, "file")
    else:
        s3 = request.getfixturevalue("s3")
        yield from _objects(s3.url(f"contract-{id(request)}"), s3.storage_options, "s3")


def test_rows_put_are_the_rows_resolved(backend: Backend) -> None:
    store = backend.make()
    want = [checked(n, seed=n) for n in (1, 7, 300)]
    refs = [RoutingRef.from_dict(store.put(c)) for c in want]
    assert all(r.store == store.instance and r.url == store.url for r in refs)
    got = backend.resolve(refs)
    assert all(np.array_equal(g, w.array) and g.dtype == np.uint8 for g, w in zip(got, want))


def test_a_256_sample_batch_resolves_in_one_call(backend: Backend) -> None:
    store = backend.make()
    want = [checked(20 + i % 13, seed=i) for i in range(256)]
    refs = [RoutingRef.from_dict(store.put(c)) for c in want]
    got = backend.resolve(refs)
    assert len(got) == 256 and all(np.array_equal(g, w.array) for g, w in zip(got, want))


def test_a_ref_whose_checksum_lies_is_refused(backend: Backend) -> None:
    store = backend.make()
    ref = RoutingRef.from_dict(store.put(checked(10, seed=1)))
    lying = RoutingRef.from_dict({**ref.to_dict(), "checksum": checksum(checked(10, seed=2).array)})
    with pytest.raises(RoutingChecksumError):
        backend.resolve([lying])


def test_retire_refuses_old_refs_and_keeps_later_ones(backend: Backend) -> None:
    store = backend.make()
    old = RoutingRef.from_dict(store.put(checked(10, seed=3)))
    store.retire(old.weight_version)
    new = RoutingRef.from_dict(store.put(checked(10, seed=4)))
    assert new.weight_version > old.weight_version
    with pytest.raises(RoutingExpiredError, match="retired"):
        backend.resolve([old])
    assert np.array_equal(backend.resolve([new])[0], checked(10, seed=4).array)


def test_a_new_store_instance_keeps_or_refuses_refs_never_other_rows(backend: Backend) -> None:
    """An engine restart: object stores' refs still read their own rows; memory's and Ray's are refused."""
    first = backend.make()
    ref = RoutingRef.from_dict(first.put(checked(12, seed=5)))
    second = backend.make()
    assert second.instance != first.instance
    RoutingRef.from_dict(second.put(checked(12, seed=6)))  # the new instance holds other rows now
    if backend.survives_restart:
        assert np.array_equal(backend.resolve([ref])[0], checked(12, seed=5).array)
    else:
        with pytest.raises(RoutingExpiredError):
            backend.resolve([ref])


def test_only_checked_rows_get_in(backend: Backend) -> None:
    store = backend.make()
    with pytest.raises(ArgumentTypeError, match="CheckedRouting"):
        store.put(np.zeros((3, 3, 2), dtype=np.uint8))  # type: ignore[arg-type]
    assert store.stats()["entries"] == 0
