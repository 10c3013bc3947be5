"""The vLLM plugin's /rr/generate alias and its always-return switch, and the routing store's read route
(one copy per key and per overlapping ranges, caps per call on refs and on bytes, off the event loop, checksums
from store time) and its sibling API server processes (a read or retire reaching either one), without an engine:
the store's real Starlette routes over httpx's ASGI transport, its real Unix sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from rr_client.core.errors import RoutingChecksumError
from rr_client.core.reference import READ_PATH, RETIRE_PATH, RoutingRef, decode_frame
from rr_patches.vllm import routes
from rr_patches.vllm.auth import RR_PREFIXES, _is_rr_path
from rr_server.serving.store import MAX_REFS_PER_READ, MemoryStore, read_many
from rr_server.serving.store import install as rs
from rr_server.serving.store.siblings import Siblings
from tests.unit.test_routing_ref import URL, checked, store_app


def test_rr_generate_is_generate_and_behind_the_api_key_prefixes() -> None:
    table = {path: (handler, methods) for path, handler, methods in routes.RR_ROUTES}
    assert table["/rr/generate"] == table["/generate"] == (routes.generate, ("POST",))
    for path in table:  # every route rr adds is under a prefix vLLM's --api-key guards
        assert _is_rr_path(path) and path.startswith(RR_PREFIXES), path


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("false", False), ("1", True), ("true", True)])
def test_always_return_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(routes.ALWAYS_ENV, value)
    assert routes.ALWAYS_ENV == "RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS"
    assert routes.always_return_routing() is on


def test_add_rr_routes_refuses_to_shadow() -> None:
    from fastapi import FastAPI

    app = FastAPI()
    routes.add_rr_routes(app)
    assert {"/generate", "/rr/generate", "/rr/info"} <= {getattr(r, "path", None) for r in app.routes}
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        routes.add_rr_routes(app)


# ------------------------------------------------------------------ the routing store's read route and siblings


def _post(app: Any, path: str, body: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=URL) as h:
            return await h.post(path, content=json.dumps(body))

    return asyncio.run(run())


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    s = MemoryStore(1 << 20, URL)
    monkeypatch.setattr(rs, "_STORE", s)
    return s


def test_one_key_named_many_times_is_one_copy_and_refs_per_call_are_capped(store: MemoryStore) -> None:
    ref = store.put(checked(50))
    ask = {"store": ref["store"], "key": ref["key"]}
    r = _post(store_app(store), READ_PATH, {"refs": [ask] * 1000})
    assert r.status_code == 200
    (head_len,) = struct.unpack_from("<Q", r.content)
    assert len(r.content) == 8 + head_len + checked(50).array.nbytes  # the rows once, not 1000 times
    parts = decode_frame(r.content)
    assert len(parts) == 1000 and all(np.array_equal(p.rows, checked(50).array) for p in parts)
    assert store.stats()["reads"] == 1
    over = _post(store_app(store), READ_PATH, {"refs": [ask] * (MAX_REFS_PER_READ + 1)})
    assert over.status_code == 413 and f"at most {MAX_REFS_PER_READ}" in over.json()["error"]["message"]


def test_the_frame_carries_the_checksum_kept_from_store_time(store: MemoryStore) -> None:
    """Rows that changed in the store after their ref was made are caught by the client (not re-hashed as they
    are now and sent as if right)."""
    ref = RoutingRef.from_dict(store.put(checked(6)))
    store.ledger._entries[ref.key].rows[2, 0, 0] ^= 1  # the held bytes change under the ref
    r = _post(store_app(store), READ_PATH, {"refs": [{"store": ref.store, "key": ref.key}]})
    head = json.loads(r.content[8 : 8 + struct.unpack_from("<Q", r.content)[0]])
    assert head["parts"][0]["checksum"] == ref.checksum
    with pytest.raises(RoutingChecksumError, match="changed on the way"):
        decode_frame(r.content)


def test_the_frame_is_built_off_the_event_loop(store: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = store.put(checked(4))
    where: dict[str, int] = {}
    real = store.read

    def read(*a: Any, **kw: Any) -> Any:
        where["read"] = threading.get_ident()
        return real(*a, **kw)

    monkeypatch.setattr(store, "read", read)

    async def run() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=store_app(store)), base_url=URL) as h:
            r = await h.post(READ_PATH, content=json.dumps({"refs": [{"store": ref["store"], "key": ref["key"]}]}))
            assert r.status_code == 200
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert where["read"] != loop_thread  # the loop's thread never reads or encodes


def _overlapping(
    ref: dict[str, Any], n: int, count: int, seed: int = 0
) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    """``count`` random overlapping row ranges of ``ref``'s ``n`` rows (the issue's amplification request)."""
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, n, count), rng.integers(0, n, count)
    lo, hi = np.minimum(x, y), np.maximum(x, y) + 1
    return [{"store": ref["store"], "key": ref["key"], "start": int(a), "stop": int(b)} for a, b in zip(lo, hi)], lo, hi


def _data_bytes(body: bytes) -> int:
    """Bytes of rows a frame carries (after its 8-byte length and its JSON header)."""
    return len(body) - 8 - struct.unpack_from("<Q", body)[0]


def test_overlapping_ranges_of_one_key_are_read_and_sent_once(store: MemoryStore) -> None:
    """2,000 overlapping ranges of one 12 KB sample answered 12.4 MB before (each ask its own copy); now each
    stored row is read and sent once, every ask still resolving to its own rows through rr_client's reader."""
    c = checked(2000)  # 2000 rows x 3 layers x top-2, uint8: 12,000 bytes
    ref = store.put(c)
    asks, lo, hi = _overlapping(ref, 2000, 2000)
    assert int((hi - lo).sum()) * 6 > 500 * c.array.nbytes  # what one copy per ask would have sent
    r = _post(store_app(store), READ_PATH, {"refs": asks})
    assert r.status_code == 200, r.text
    assert _data_bytes(r.content) <= c.array.nbytes  # at most 1x the sample's bytes, not 1,000x
    assert len(r.content) - _data_bytes(r.content) <= 200 * len(asks)  # the header: one entry per ask, rows-free
    parts = decode_frame(r.content)  # every entry's checksum checked over the bytes it names
    assert len(parts) == 2000 and all(np.array_equal(p.rows, c.array[a:b]) for p, a, b in zip(parts, lo, hi))
    assert store.stats()["reads"] == 1  # one merged run read from the store


def test_touching_and_apart_ranges_merge_only_within_a_key(store: MemoryStore) -> None:
    """Ranges that touch merge, ranges apart stay apart (no row between them sent), keys never merge; the whole
    key keeps its store-time checksum inside a merged run."""
    c1, c2 = checked(10, seed=1), checked(10, seed=2)
    r1, r2 = RoutingRef.from_dict(store.put(c1)), RoutingRef.from_dict(store.put(c2))
    asks = [
        {"store": r1.store, "key": r1.key, "start": 0, "stop": 3},
        {"store": r1.store, "key": r1.key, "start": 3, "stop": 5},  # touches [0, 3): one run [0, 5)
        {"store": r1.store, "key": r1.key, "start": 8, "stop": 10},  # apart: its own run, rows 5-7 not sent
        {"store": r2.store, "key": r2.key},
        {"store": r2.store, "key": r2.key, "start": 2, "stop": 4},  # inside the whole of key 2
    ]
    r = _post(store_app(store), READ_PATH, {"refs": asks})
    assert r.status_code == 200, r.text
    assert _data_bytes(r.content) == (5 + 2 + 10) * 6
    head = json.loads(r.content[8 : 8 + struct.unpack_from("<Q", r.content)[0]])["parts"]
    assert head[1]["offset"] == head[0]["offset"] + 3 * 6 and head[4]["offset"] == head[3]["offset"] + 2 * 6
    assert head[3]["checksum"] == r2.checksum
    want = [c1.array[0:3], c1.array[3:5], c1.array[8:10], c2.array, c2.array[2:4]]
    assert all(np.array_equal(p.rows, w) for p, w in zip(decode_frame(r.content), want))
    assert store.stats()["reads"] == 3


def test_the_byte_cap_refuses_before_reading_and_the_server_serves_on(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rows than ``RR_ROUTING_READ_BYTES`` (or more row ranges to hash): 413 naming the count, the cap and
    how to split, before any row is read; the next read within the cap is answered."""
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", "1000")
    c = checked(300)  # 1,800 bytes
    ref = store.put(c)
    whole = {"store": ref["store"], "key": ref["key"]}
    r = _post(store_app(store), READ_PATH, {"refs": [whole]})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert (err["type"], err["nbytes"], err["max_bytes"]) == ("BadRequestError", 1800, 1000)
    assert "1800 bytes" in err["message"] and "at most 1000" in err["message"]
    assert "RR_ROUTING_READ_BYTES" in err["message"] and "split" in err["message"]
    assert store.stats()["reads"] == 0  # refused from the keys' extents: no row was read
    # few rows, but each a range to hash: 3 x ~1,800 bytes of checksums over a 1,000-byte cap
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", "4000")
    ranges = [{**whole, "start": a, "stop": b} for a, b in ((0, 299), (1, 300), (0, 298))]
    r = _post(store_app(store), READ_PATH, {"refs": ranges})
    assert r.status_code == 413 and r.json()["error"]["hashed_bytes"] == (299 + 299 + 298) * 6 > 4000
    assert store.stats()["reads"] == 0
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", "1000")
    ok = _post(store_app(store), READ_PATH, {"refs": [{**whole, "start": 100, "stop": 200}]})
    assert ok.status_code == 200 and np.array_equal(decode_frame(ok.content)[0].rows, c.array[100:200])
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", "0")
    assert _post(store_app(store), READ_PATH, {"refs": [whole]}).status_code == 500  # a bad cap is said, not 0


@pytest.fixture()
def two_processes() -> Iterator[tuple[MemoryStore, MemoryStore]]:
    """Two API server processes' stores of one server (here: one process, each with its own socket)."""
    base = tempfile.mkdtemp(prefix="rr-", dir="/tmp")  # pytest's tmp_path is too long for a socket's path
    a, b = MemoryStore(1 << 20, URL), MemoryStore(1 << 20, URL)
    a.siblings, b.siblings = Siblings.join(a, URL, base), Siblings.join(b, URL, base)
    yield a, b
    for s in (a, b):
        s.siblings.close()  # type: ignore[union-attr]
    shutil.rmtree(base, ignore_errors=True)


def test_a_read_reaching_either_process_gets_the_rows(two_processes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = two_processes
    want = {s: [checked(5, seed=i) for i in range(3)] for s in ("a", "b")}
    refs = [RoutingRef.from_dict(a.put(c)) for c in want["a"]] + [RoutingRef.from_dict(b.put(c)) for c in want["b"]]
    asks = [{"store": r.store, "key": r.key} for r in refs]
    for answering in (a, b):  # the kernel hands the connection to either process
        monkeypatch.setattr(rs, "_STORE", answering)
        r = _post(store_app(answering), READ_PATH, {"refs": asks + asks[:2]})
        assert r.status_code == 200, r.text
        got = [p.rows for p in decode_frame(r.content)]
        assert all(np.array_equal(g, w.array) for g, w in zip(got, want["a"] + want["b"] + want["a"][:2]))
    st = a.stats()
    assert (st["processes"], st["stored"], st["instances"]) == (2, 6, [a.instance, b.instance])
    assert _post(store_app(a), RETIRE_PATH, {"through": 0}).json() == {
        "retired": 6,
        "freed_bytes": sum(r.nbytes for r in refs),
        "weight_version": 1,
    }
    assert b.local_stats()["weight_version"] == 1 and b.local_stats()["entries"] == 0  # retired in b as well
    r = _post(store_app(a), READ_PATH, {"refs": asks[3:4]})
    assert r.status_code == 410 and "retired" in r.json()["error"]["message"]


def test_a_sibling_gets_merged_runs_and_is_capped_before_sending(
    two_processes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlapping ranges of rows a sibling holds reach it as one run; the cap is counted from its extents, so a
    read over it is refused before any row crosses the socket."""
    a, b = two_processes
    monkeypatch.setattr(rs, "_STORE", a)  # the read reaches process a; b holds the rows
    c = checked(2000)
    ref = b.put(c)
    asks, lo, hi = _overlapping(ref, 2000, 500, seed=1)
    r = _post(store_app(a), READ_PATH, {"refs": asks})
    assert r.status_code == 200 and _data_bytes(r.content) <= c.array.nbytes
    assert all(np.array_equal(p.rows, c.array[x:y]) for p, x, y in zip(decode_frame(r.content), lo, hi))
    assert (a.siblings.forwarded, b.local_stats()["reads"]) == (1, 1)  # type: ignore[union-attr]
    monkeypatch.setenv("RR_ROUTING_READ_BYTES", str(c.array.nbytes - 1))
    over = _post(store_app(a), READ_PATH, {"refs": [{"store": ref["store"], "key": ref["key"]}]})
    assert over.status_code == 413 and over.json()["error"]["nbytes"] == c.array.nbytes
    assert (a.siblings.forwarded, b.local_stats()["reads"]) == (1, 1)  # type: ignore[union-attr]


def test_a_sibling_that_died_answers_410_not_other_rows(two_processes: Any) -> None:
    a, b = two_processes
    ref = RoutingRef.from_dict(b.put(checked(5)))
    b.siblings.close()
    with socket.socket(socket.AF_UNIX) as dead:  # SIGKILLed: its socket file stays, nobody listens
        dead.bind(str(b.siblings.path))
    parts, expired, _ = read_many(a, [(ref.store, ref.key, None, None)])
    assert parts == [] and "does not answer" in expired[0]["why"]
    assert not b.siblings.path.exists()  # the dead socket is cleared


def test_a_loopback_url_is_said_at_start(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("RR_ADVERTISE_URL", raising=False)
    for url, loud in (
        ("http://127.0.0.1:8000", True),
        ("http://localhost:9", True),
        ("http://[::1]:9", True),
        ("http://trainer-node-3:8000", False),
        ("http://10.1.2.3:8000", False),
    ):
        monkeypatch.setattr(rs, "_STORE", None)
        monkeypatch.setattr(rs, "_NAMED", False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rr.routing_store"):
            store = rs.install_store(rs.advertised_url(urlsplit(url).hostname, urlsplit(url).port))
        said = [r.getMessage() for r in caplog.records if "loopback" in r.getMessage()]
        assert bool(said) is loud, (url, said)
        assert not said or ("RR_ADVERTISE_URL" in said[0] and "--host" in said[0])
        store.siblings.close()  # type: ignore[union-attr]
