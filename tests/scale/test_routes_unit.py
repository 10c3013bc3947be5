"""The vLLM plugin's /rr/generate alias and its always-return switch, and the routing store's read route
(one copy per key, a cap per call, off the event loop, checksums from store time) and its sibling API server
processes (a read or retire reaching either one), without an engine: the store's real Starlette routes over
httpx's ASGI transport, its real Unix sockets."""

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


def test_a_sibling_that_died_answers_410_not_other_rows(two_processes: Any) -> None:
    a, b = two_processes
    ref = RoutingRef.from_dict(b.put(checked(5)))
    b.siblings.close()
    with socket.socket(socket.AF_UNIX) as dead:  # SIGKILLed: its socket file stays, nobody listens
        dead.bind(str(b.siblings.path))
    parts, expired = read_many(a, [(ref.store, ref.key, None, None)])
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
