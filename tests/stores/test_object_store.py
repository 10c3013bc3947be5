"""The object-store routing store beyond the contract: refs that outlive the process that wrote them (two processes
on this machine's disk), objects as written (compressed frame, checksum, who wrote them), retire deleting objects,
the lifetime bound, a failed write refusing its sample only, backpressure, the client's allowed prefixes, and
objects that were changed, swapped or crafted. S3 is moto's S3 server on loopback (tests/support/s3_server.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client import (
    MalformedPayloadError,
    ProtocolError,
    RoutedExpertsClient,
    RoutingChecksumError,
    RoutingExpiredError,
    RoutingRef,
    RoutingStoreWriteError,
    UntrustedHostError,
)
from rr_client.core.objects import MAGIC, decode_object, object_path
from rr_client.core.reference import FramePart, encode_frame
from rr_server.serving.store.ledger import refs_made_under
from rr_server.serving.store.objects import ObjectStore
from tests.support.routing_data import checked_routing, small_moe_info
from tests.support.s3_server import S3

INFO = small_moe_info()
checked = partial(checked_routing, INFO)
REPO = Path(__file__).resolve().parents[2]


def resolve(refs: list[RoutingRef], allowed: list[str], opts: dict[str, Any] | None = None) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        async with RoutedExpertsClient(
            "http://127.0.0.1:9", info=INFO, object_stores=allowed, storage_options=opts
        ) as c:
            return await c.resolve(refs)

    return asyncio.run(run())


WRITER = """
import json, sys
from rr_server.serving.store.objects import ObjectStore
from tests.support.routing_data import checked_routing, small_moe_info
store = ObjectStore(sys.argv[1])
print(json.dumps([store.put(checked_routing(small_moe_info(), n, seed=n)) for n in (4, 9)]))
"""


def test_refs_written_by_another_process_resolve_after_it_exited(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    out = subprocess.run(
        [sys.executable, "-c", WRITER, url], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    refs = [RoutingRef.from_dict(d) for d in json.loads(out.stdout)]  # the writer is gone now
    got = resolve(refs, [url])
    assert [g.tolist() for g in got] == [checked(n, seed=n).array.tolist() for n in (4, 9)]
    # and a server started later at the same URL (a restarted sidecar) answers them on its read route too
    later = ObjectStore(url)
    part = later.read(refs[1].store, refs[1].key)
    assert part.digest == refs[1].checksum and np.array_equal(part.rows, got[1])
    assert later.stats()["entries"] == 2  # the earlier objects count in its lifetime bound


def test_the_object_is_the_compressed_checked_frame_with_who_wrote_it(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}")
    with refs_made_under(7):
        ref = RoutingRef.from_dict(store.put(checked(50, seed=1, start=3)))
    path = Path(object_path(str(tmp_path), 7, ref.key))
    raw = path.read_bytes()
    assert raw.startswith(MAGIC) and ref.weight_version == 7 and path.parent.name == "v7"
    part, meta = decode_object(raw, expect_nbytes=ref.nbytes, where="test")
    assert part.digest == ref.checksum and np.array_equal(part.rows, checked(50, seed=1, start=3).array)
    assert meta["weight_version"] == 7 and meta["start"] == 3 and meta["kind"] == "routing"
    assert {"host", "pid"} <= set(meta["by"])
    st = store.stats()
    assert st["written"] == 1 and st["row_bytes"] == ref.nbytes and st["written_bytes"] == len(raw)


def test_retire_deletes_the_versions_objects_also_an_earlier_runs(s3: S3) -> None:
    url = s3.url("retire")
    first = ObjectStore(url, storage_options=s3.storage_options)
    with refs_made_under(1):
        old = RoutingRef.from_dict(first.put(checked(5, seed=1)))
    with refs_made_under(2):
        kept = RoutingRef.from_dict(first.put(checked(5, seed=2)))
    second = ObjectStore(url, storage_options=s3.storage_options)  # a restart: it wrote none of them
    fs = s3.filesystem()
    assert len(fs.find(f"{s3.bucket}/retire")) == 2
    second.retire(1)
    assert [p.rsplit("/", 2)[-2] for p in fs.find(f"{s3.bucket}/retire")] == ["v2"]
    with pytest.raises(RoutingExpiredError, match="retired"):
        resolve([old], [url], s3.storage_options)
    assert np.array_equal(resolve([kept], [url], s3.storage_options)[0], checked(5, seed=2).array)


def test_the_lifetime_bound_deletes_the_oldest_objects(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    store = ObjectStore(url, max_objects=3)
    refs = [RoutingRef.from_dict(store.put(checked(4, seed=i))) for i in range(5)]
    assert sorted(p.name for p in tmp_path.rglob("*.rr")) == sorted(f"{r.key}.rr" for r in refs[2:])
    with pytest.raises(RoutingExpiredError, match="lifetime bound"):
        resolve(refs[:1], [url])
    restarted = ObjectStore(url, max_objects=3)  # counts what is there, deletes the oldest on its first write
    RoutingRef.from_dict(restarted.put(checked(4, seed=9)))
    assert not (tmp_path / "v0" / f"{refs[2].key}.rr").exists() and len(list(tmp_path.rglob("*.rr"))) == 3
    aged = ObjectStore(f"file://{tmp_path}/aged", max_age=1e-9)  # anything written before the newest is too old
    a = RoutingRef.from_dict(aged.put(checked(4, seed=1)))
    b = RoutingRef.from_dict(aged.put(checked(4, seed=2)))
    assert [p.name for p in (tmp_path / "aged").rglob("*.rr")] == [f"{b.key}.rr"] and a.key != b.key
    assert aged.stats()["aged_out"] == 1


def test_a_failed_write_refuses_that_sample_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the sidecar's producer (``sent_fields``): the sample whose object cannot be written (weight version
    5's folder is a file here, a real filesystem error) is answered with a typed refusal, the others with refs."""
    from rr_server.proxy.metrics import ProxyMetrics
    from rr_server.proxy.routing import sent_fields
    from rr_server.serving.store import install as installed

    store = ObjectStore(f"file://{tmp_path}")
    monkeypatch.setattr(installed, "_STORE", store)
    (tmp_path / "v5").write_text("not a folder")
    fields = []
    metrics = ProxyMetrics()
    for version in (4, 5, 6):
        with refs_made_under(version):
            fields.append(sent_fields(checked(6, seed=version), "ref", metrics, f"sample {version}"))
    assert "routed_experts_ref" in fields[0] and "routed_experts_ref" in fields[2]
    assert fields[1]["routed_experts"] is None
    assert fields[1]["routed_experts_error"].startswith("RoutingStoreWriteError: ")
    assert "v5" in fields[1]["routed_experts_error"]
    assert store.stats()["failed_writes"] == 1 and store.stats()["written"] == 2
    got = resolve(
        [RoutingRef.from_dict(f["routed_experts_ref"]) for f in (fields[0], fields[2])], [f"file://{tmp_path}"]
    )
    assert np.array_equal(got[1], checked(6, seed=6).array)


def test_backpressure_waits_for_room_then_refuses_typed(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}", pending_bytes=1, write_timeout=0.2)
    store._wait_for_room(1, "held by the test")  # another sample's write in flight, never finishing
    with pytest.raises(RoutingStoreWriteError, match="RR_OBJECT_STORE_PENDING_BYTES"):
        store.put(checked(6))
    done: list[dict[str, Any]] = []
    store.write_timeout = 600.0
    t = threading.Thread(target=lambda: done.append(store.put(checked(6, seed=2))))
    t.start()
    with store._room:  # the waiting put holds no room until the test's write ends
        assert store._pending == 1
    with store._room:
        store._pending -= 1
        store._room.notify_all()
    t.join(timeout=600)
    assert len(done) == 1 and store.stats()["written"] == 1 and store.stats()["failed_writes"] == 1


def test_the_client_reads_only_object_stores_it_allows(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/p"
    ref = RoutingRef.from_dict(ObjectStore(url).put(checked(3)))
    for allowed in ([], [f"file://{tmp_path}/other"], [f"file://{tmp_path}/"[:-2]]):  # a prefix of a path part
        with pytest.raises(UntrustedHostError, match="object_stores"):
            resolve([ref], allowed)
    assert resolve([ref], [f"file://{tmp_path}"])[0].shape == (3, 3, 2)
    sneaky = RoutingRef.from_dict({**ref.to_dict(), "key": "../../../etc/passwd"})
    with pytest.raises(ProtocolError, match="not an object store key"):
        resolve([sneaky], [url])


def test_changed_swapped_and_crafted_objects_are_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    store = ObjectStore(url)
    a, b = (RoutingRef.from_dict(store.put(checked(30, seed=s))) for s in (1, 2))
    pa, pb = (Path(object_path(str(tmp_path), r.weight_version, r.key)) for r in (a, b))
    pa.write_bytes(pb.read_bytes())  # another sample's object under a's name
    with pytest.raises(ProtocolError, match=f"the store answered key '{b.key}'"):
        resolve([a], [url])
    moved = Path(object_path(str(tmp_path), 3, b.key))  # b's own object, copied under another weight version
    moved.parent.mkdir()
    moved.write_bytes(pb.read_bytes())
    with pytest.raises(ProtocolError, match="the object says it holds"):
        resolve([RoutingRef.from_dict({**b.to_dict(), "weight_version": 3})], [url])
    raw = bytearray(pb.read_bytes())
    part, meta = decode_object(bytes(raw), expect_nbytes=b.nbytes, where="t")
    rows = part.rows.copy()
    rows[0, 0, 0] ^= 1  # the rows changed, the frame's checksum recomputed: the ref's checksum still holds them
    pb.write_bytes(MAGIC + zlib.compress(encode_frame([FramePart(b.key, 0, 30, rows)], meta=meta)))
    with pytest.raises(RoutingChecksumError):
        resolve([b], [url])
    pb.write_bytes(MAGIC + zlib.compress(b"\0" * (b.nbytes + (2 << 20))))  # inflates past what the ref names
    with pytest.raises(MalformedPayloadError, match="inflates past"):
        resolve([b], [url])
    pb.write_bytes(b"PK\x03\x04 not ours")
    with pytest.raises(MalformedPayloadError, match="not an rr routing object"):
        resolve([b], [url])


def test_the_read_route_never_reads_a_path_of_the_askers_choosing(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/rollouts")
    ref = RoutingRef.from_dict(store.put(checked(3)))
    (tmp_path / "secret.rr").write_bytes(MAGIC + zlib.compress(b"x"))
    for key in ("../../secret", "*", "../*", "v0/" + ref.key):
        with pytest.raises(RoutingExpiredError, match="not a key this store makes"):
            store.read(ref.store, key)
    assert store.read(ref.store, ref.key).digest == ref.checksum


def test_producers_on_an_event_loop_write_objects_from_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one predicate the patched engines and the sidecar ask (``store_blocks``), and the sidecar's helper: with
    an object store the answer is made off the loop, with the memory store where it is."""
    from rr_server.proxy.routing import off_loop_if_store_blocks
    from rr_server.serving.store import MemoryStore
    from rr_server.serving.store import install as installed

    async def where() -> bool:
        loop = threading.get_ident()
        return await off_loop_if_store_blocks(lambda: threading.get_ident() != loop)

    monkeypatch.setattr(installed, "_STORE", MemoryStore(1 << 20, "http://rr.test"))
    assert installed.store_blocks() is False and asyncio.run(where()) is False
    monkeypatch.setattr(installed, "_STORE", ObjectStore(f"file://{tmp_path}"))
    assert installed.store_blocks() is True and asyncio.run(where()) is True


def test_a_bucket_rr_cannot_write_to_is_one_line_before_the_sidecar_starts(s3: S3) -> None:
    env = {**os.environ, **s3.env}
    cmd = [sys.executable, "-m", "rr_server", "proxy", "--upstream", "http://127.0.0.1:9", "--engine", "vllm"]
    out = subprocess.run([*cmd, "--rr-store", "s3://no-such-bucket-rr/run"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip() == (
        "rr-server proxy: routing object store s3://no-such-bucket-rr/run: cannot write there: FileNotFoundError: "
        "The specified bucket does not exist (the server's credentials and endpoint come from its environment or "
        "fsspec's configuration)"
    )
    from rr_server.serving.store.objects import probe_writable

    probe_writable(s3.url("probe"), s3.storage_options)  # a writable store: the probe leaves nothing behind
    assert s3.filesystem().find(f"{s3.bucket}/probe") == []
