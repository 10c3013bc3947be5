"""Routing by reference without an engine: the ref and frame formats, the store's bounds, and the client's
resolver against the store's real HTTP routes (an in-process Starlette app over httpx's ASGI transport)."""

from __future__ import annotations

import asyncio
import json
import struct
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient
from rr_client.core.codec import check_routing, routing_meta_fields
from rr_client.core.errors import (
    MalformedPayloadError,
    RoutingChecksumError,
    RoutingExpiredError,
    ShapeMismatchError,
    UnrecordedRoutingError,
)
from rr_client.core.reference import FramePart, RoutingRef, checksum, decode_frame, encode_frame
from rr_server.serving.store import STORE_ROUTES, MemoryStore
from rr_server.serving.store import install as rs
from tests.support.routing_data import checked_routing, small_moe_info

INFO = small_moe_info()
URL = "http://rr-store.test"


checked = partial(checked_routing, INFO)  # rows (seed, start) of the small MoE, checked


def test_ref_is_small_whatever_the_length_and_every_field_is_checked() -> None:
    store = MemoryStore(1 << 30, URL)
    small, big = store.put(checked(3)), store.put(checked(40_000, seed=1))
    # a few hundred bytes whatever the length (only the row count's digits grow), never rows x L x K
    assert len(json.dumps(small)) <= len(json.dumps(big)) <= 320
    ref = RoutingRef.from_dict(big)
    assert ref.shape == (40_000, 3, 2) and ref.nbytes == 40_000 * 6 and ref.url == URL
    for bad, what in [
        ({**big, "schema": "rr.routing_ref/0"}, "schema"),
        ({**big, "rows": -1}, "'rows'"),
        ({**big, "dtype": "int32"}, "dtype"),
        ({**big, "extra": 1}, "unknown fields"),
        ({k: v for k, v in big.items() if k != "key"}, "'key'"),
        ([1], "must be an object"),
    ]:
        with pytest.raises(MalformedPayloadError, match=what):
            RoutingRef.from_dict(bad)


def test_frame_round_trip_and_every_lie_is_refused() -> None:
    a, b = checked(5).array, checked(2, seed=3).array
    parts = decode_frame(encode_frame([FramePart("k1", 0, 5, a), FramePart("k2", 1, 2, b[1:2])]))
    assert [(p.key, p.start, p.stop) for p in parts] == [("k1", 0, 5), ("k2", 1, 2)]
    assert np.array_equal(parts[0].rows, a) and np.array_equal(parts[1].rows, b[1:2])
    assert parts[0].digest == checksum(a)
    body = bytearray(encode_frame([FramePart("k1", 0, 5, a)]))
    assert len(body) - 8 - struct.unpack_from("<Q", body)[0] == a.size  # 1.0 byte per uint8 entry, no base64
    body[-1] ^= 0xFF  # one flipped byte in the data
    with pytest.raises(RoutingChecksumError, match="k1"):
        decode_frame(bytes(body))
    with pytest.raises(MalformedPayloadError, match="exceeds"):
        decode_frame(struct.pack("<Q", 1 << 20) + b"{}")
    good = encode_frame([FramePart("k1", 0, 5, a)])
    with pytest.raises(MalformedPayloadError, match="do not fit"):
        decode_frame(good[:-1])  # truncated
    n = struct.unpack_from("<Q", good)[0]
    head = json.loads(good[8 : 8 + n])
    head["parts"][0]["shape"] = [4, 3, 2]  # the header lies about the rows
    lied = json.dumps(head).encode()
    with pytest.raises(MalformedPayloadError, match="rows"):
        decode_frame(struct.pack("<Q", len(lied)) + lied + good[8 + n :])


def test_store_evicts_oldest_first_and_says_why() -> None:
    one = checked(10).array.nbytes
    store = MemoryStore(3 * one, URL)
    keys = [store.put(checked(10, seed=i))["key"] for i in range(4)]
    with pytest.raises(RoutingExpiredError, match="evicted by the routing store's byte cap"):
        store.read(store.instance, keys[0])
    assert np.array_equal(store.read(store.instance, keys[3]).rows, checked(10, seed=3).array)
    st = store.stats()
    assert (st["entries"], st["bytes"], st["evicted"], st["stored"]) == (3, 3 * one, 1, 4)
    with pytest.raises(RoutingExpiredError, match="exceeds the routing store's cap"):
        store.put(checked(40))
    assert store.stats()["refused"] == 1
    with pytest.raises(RoutingExpiredError, match="no such key"):  # a key this store never held
        store.read(store.instance, "0" * 32)


def test_retire_frees_a_weight_version_and_new_refs_carry_the_next() -> None:
    store = MemoryStore(1 << 20, URL)
    old = store.put(checked(4))
    assert old["weight_version"] == 0
    assert store.retire(0) == {"retired": 1, "freed_bytes": checked(4).array.nbytes, "weight_version": 1}
    with pytest.raises(RoutingExpiredError, match="retired with weight version 0"):
        store.read(old["store"], old["key"])
    new = store.put(checked(4, seed=2))
    assert new["weight_version"] == 1 and store.read(new["store"], new["key"]).stop == 4


def test_a_restarted_server_refuses_the_old_instances_refs() -> None:
    ref = MemoryStore(1 << 20, URL).put(checked(4))
    restarted = MemoryStore(1 << 20, URL)
    restarted.put(checked(4))
    with pytest.raises(RoutingExpiredError, match="restarted"):
        restarted.read(ref["store"], ref["key"])


def test_ref_format_needs_a_store_and_goes_through_the_codec() -> None:
    from rr_client.core.errors import MissingRoutingError

    with pytest.raises(MissingRoutingError, match="no routing store"):
        routing_meta_fields(checked(3), "ref")  # the store is passed, never installed in the codec
    store = MemoryStore(1 << 20, URL)
    fields = routing_meta_fields(checked(3, start=2), "ref", store=store)
    assert "routed_experts" not in fields and fields["routed_experts_format"] == "ref"
    assert fields["routed_experts_ref"]["start"] == 2 and fields["routed_experts_shape"] == [3, 3, 2]


# ------------------------------------------------------------------ the resolver over the store's HTTP routes


def store_app(store: MemoryStore) -> Any:
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def info(_: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(INFO.model_dump())

    return Starlette(routes=[Route("/rr/info", info), *(Route(p, h, methods=list(m)) for p, h, m in STORE_ROUTES)])


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> tuple[MemoryStore, httpx.MockTransport]:
    store = MemoryStore(1 << 20, URL)
    monkeypatch.setattr(rs, "_STORE", store)
    calls: list[int] = []
    app = httpx.ASGITransport(app=store_app(store))

    async def counting(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/rr/routing/read" and request.content.startswith(b'{"refs"'):
            calls.append(len(json.loads(request.content)["refs"]))
        return await app.handle_async_request(request)

    transport: Any = httpx.MockTransport(counting)
    transport.calls = calls
    return store, transport


def client(transport: Any) -> RoutedExpertsClient:
    return RoutedExpertsClient(URL, transport=transport, info=INFO)


def test_resolve_many_keys_per_call_checked_as_inline(served: Any) -> None:
    store, transport = served
    want = [checked(n, seed=n) for n in (3, 7, 1, 12)]
    refs = [RoutingRef.from_dict(store.put(c)) for c in want]

    async def run() -> list[np.ndarray]:
        async with client(transport) as c:
            got = await c.resolve(refs)
            assert c.routing_bytes_resolved == sum(r.nbytes for r in refs)
            return got

    got = asyncio.run(run())
    assert all(np.array_equal(g, w.array) for g, w in zip(got, want))
    assert transport.calls == [4]  # one call for the four refs of one server
    assert store.stats()["read_bytes"] == sum(r.nbytes for r in refs)


def test_resolve_expired_tampered_and_unrecorded_are_typed_errors(served: Any) -> None:
    store, transport = served
    refs = [RoutingRef.from_dict(store.put(checked(4, seed=i))) for i in range(2)]
    store.retire(0)
    with pytest.raises(RoutingExpiredError, match="retired"):
        asyncio.run(_resolve(transport, refs))
    ref = RoutingRef.from_dict(store.put(checked(4, seed=5)))
    lying = RoutingRef.from_dict({**ref.to_dict(), "checksum": checksum(checked(4, seed=6).array)})
    with pytest.raises(RoutingChecksumError, match="not the ref's"):
        asyncio.run(_resolve(transport, [lying]))
    wrong_shape = RoutingRef.from_dict({**ref.to_dict(), "rows": 5})
    with pytest.raises(ShapeMismatchError):
        asyncio.run(_resolve(transport, [wrong_shape]))
    # rows that never passed the check cannot get in: the store takes only CheckedRouting, and what it gives
    # back is checked again as an inline answer would be
    zeros = np.zeros((4, 3, 2), dtype=np.uint8)
    with pytest.raises(UnrecordedRoutingError):
        check_routing(zeros, INFO, rows=4)


async def _resolve(transport: Any, refs: list[RoutingRef]) -> list[np.ndarray]:
    async with client(transport) as c:
        return await c.resolve(refs)


def test_read_route_answers_bad_requests_with_400(served: Any) -> None:
    store, transport = served

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url=URL) as h:
            return [
                await h.post("/rr/routing/read", content=b)
                for b in (
                    b"not json",
                    b"{}",
                    b'{"refs": [{"key": 1}]}',
                    b'{"refs": [{"store": "s", "key": "k", "start": -1}]}',
                )
            ] + [await h.post("/rr/routing/retire", content=b'{"through": "x"}')]

    for r in asyncio.run(run()):
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def _recording(store: MemoryStore) -> Any:
    """The store's routes over ASGI, recording each read's (refs asked, status, rows' bytes answered)."""
    app = httpx.ASGITransport(app=store_app(store))
    seen: list[tuple[int, int, int]] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        resp = await app.handle_async_request(request)
        body = await resp.aread()
        data = len(body) - 8 - struct.unpack_from("<Q", body)[0] if resp.status_code == 200 else 0
        seen.append((len(json.loads(request.content)["refs"]), resp.status_code, data))
        return httpx.Response(resp.status_code, headers=resp.headers, content=body)

    transport: Any = httpx.MockTransport(handle)
    transport.seen = seen
    return transport


def test_resolve_splits_a_large_batch_under_the_servers_byte_cap(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose rows exceed the server's per-call byte cap, one ref larger than the cap itself among them,
    still resolves: split into calls under the cap (the larger ref read in row ranges, joined, held to its
    checksum); a client split by a higher cap learns the server's from its 413 and splits by that."""
    from rr_client.client._resolve import RefResolver, plan_reads

    store, _ = served
    cap = 1200  # 200 rows of 3 layers x top-2
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", str(cap))
    want = [checked(30, seed=i) for i in range(12)] + [checked(700, seed=99)]
    refs = [RoutingRef.from_dict(store.put(c)) for c in want]
    refs, want = refs + refs[:1], want + want[:1]  # a ref named twice costs once in its call
    assert sum(r.nbytes for r in refs[:-1]) > 4 * cap and refs[12].nbytes > cap

    async def run(transport: Any, max_bytes: int | None) -> tuple[list[np.ndarray], int]:
        if max_bytes is None:
            async with client(transport) as c:
                return await c.resolve(refs), c.routing_bytes_resolved
        async with httpx.AsyncClient(transport=transport, base_url=URL) as h:
            resolver = RefResolver(lambda _: h, max_bytes=max_bytes)
            return await resolver.resolve(refs, INFO), resolver.bytes_read

    planned = _recording(store)
    got, read = asyncio.run(run(planned, cap))
    assert all(np.array_equal(g, w.array) for g, w in zip(got, want))
    assert all(status == 200 and data <= cap for _, status, data in planned.seen), planned.seen
    assert len(planned.seen) == len(plan_reads(refs, 64, cap)) >= 6  # 4 calls of ranges of the 700-row ref
    assert read == sum(r.nbytes for r in refs)

    learning = _recording(store)  # the client's default split (128 MiB) is above this server's cap
    got, _ = asyncio.run(run(learning, None))
    assert all(np.array_equal(g, w.array) for g, w in zip(got, want))
    assert [s for _, s, _ in learning.seen].count(413) == 1 and learning.seen[0][:2] == (14, 413)
    assert all(data <= cap for _, _, data in learning.seen)

    lying = RoutingRef.from_dict({**refs[12].to_dict(), "checksum": checksum(checked(700, seed=5).array)})
    with pytest.raises(RoutingChecksumError, match="not the ref's"):
        asyncio.run(_resolve(_recording(store), [lying]))  # joined ranges are held to the ref's checksum


def test_a_store_keeps_indexer_rows_under_a_ref_of_their_own_kind() -> None:
    """Indexer rows (a CheckedIndexer) go into the same store under a ref of kind "indexer" that says so on the wire
    (a routing ref omits the field, as older readers expect), reads back through the frame, and an unknown kind is
    refused; a raw array is not taken."""
    from rr_client import IndexerDims, check_indexer

    dims = IndexerDims((0, 1), 4)
    g = np.random.default_rng(0)
    rows = np.stack([np.stack([g.permutation(t + 1)[:4] for _ in range(2)]) for t in range(4, 9)])
    picks = check_indexer(rows, dims, rows=5, start=4)
    store = MemoryStore(url="http://s:1")
    d = store.put(picks)
    ref = RoutingRef.from_dict(json.loads(json.dumps(d)))
    assert (ref.kind, ref.shape, ref.dtype, ref.start) == ("indexer", (5, 2, 4), "uint16", 4)
    part = decode_frame(encode_frame([store.read(ref.store, ref.key)]))[0]
    assert np.array_equal(part.rows, picks.array) and part.digest == ref.checksum
    routing = RoutingRef.from_dict(store.put(checked(3, seed=1)))
    assert routing.kind == "routing" and "kind" not in routing.to_dict()
    with pytest.raises(MalformedPayloadError, match="kind 'experts'"):
        RoutingRef.from_dict({**d, "kind": "experts"})
    with pytest.raises(TypeError, match="CheckedIndexer"):
        store.put(rows)  # type: ignore[arg-type]
