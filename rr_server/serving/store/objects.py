"""The routing store in an object store (``RR_ROUTING_STORE=s3://bucket/prefix`` or ``file:///shared/path``, any
fsspec URL; ``rr-replay[objects]``): refs whose rows outlive the engine that made them.

Each sample's checked rows are written once, as one object (:mod:`rr_client.core.objects`: the compressed routing
frame with the ref's checksum and who wrote it), at ``<URL>/v<weight version>/<key>.rr``. A ref names that URL;
any trainer rank reads the object with its own credentials (fsspec's configuration or the environment), without
the engine, which may be gone by then. Credentials are never in a ref: the ref names a bucket and a path, the
client's own settings say how to reach it.

Writes: the producer's thread waits for its sample's write (an answer never names an object that is not there),
at most ``RR_OBJECT_STORE_WRITERS`` at once, and at most ``RR_OBJECT_STORE_PENDING_BYTES`` in flight: a producer
past that waits for room (backpressure) up to ``RR_OBJECT_STORE_WRITE_TIMEOUT`` seconds, then that sample is a
:class:`RoutingStoreWriteError` (its answer carries the refusal, the batch goes on); so is a write that fails.
Producers that run on an event loop build their answers in a worker thread when the store blocks
(:attr:`ObjectStore.blocks`). Retire by weight version deletes the versions' folders whole (also those an earlier
run wrote); a lifetime bound (``RR_OBJECT_STORE_MAX_AGE``, ``RR_OBJECT_STORE_MAX_OBJECTS``) deletes the oldest
objects so a bucket never grows without end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NamedTuple

from rr_client.core import settings
from rr_client.core.codec import CheckedRouting
from rr_client.core.errors import ConfigurationError, RoutingExpiredError, RoutingStoreWriteError
from rr_client.core.indexer import CheckedIndexer
from rr_client.core.objects import (
    SUFFIX,
    decode_object,
    encode_object,
    is_store_key,
    object_path,
    open_filesystem,
    version_dir,
    version_of_dir,
)
from rr_client.core.reference import FramePart
from rr_server.serving.store.base import NewRows, RowStore
from rr_server.serving.store.ledger import admitted_version, row_range
from rr_server.serving.store.siblings import Siblings

__all__ = ["ObjectStore", "probe_writable", "store_instance_prefix"]

logger = logging.getLogger("rr.routing_store")

DEFAULT_WRITERS = 8
DEFAULT_PENDING_BYTES = 256 << 20
DEFAULT_WRITE_TIMEOUT = 60
DEFAULT_MAX_AGE = 7 * 86400
DEFAULT_MAX_OBJECTS = 1_000_000


def probe_writable(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write and delete one empty object under ``url``: :class:`ConfigurationError` saying why rr cannot write
    there (no such bucket, no credentials, a read-only mount), before a server answers any sample."""
    fs, root = open_filesystem(url, storage_options)
    probe = f"{root}/.rr-write-check-{uuid.uuid4().hex[:12]}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001 - any backend's refusal, named
        raise ConfigurationError(
            f"routing object store {url}: cannot write there: {type(e).__name__}: {str(e)[:300]} (the server's "
            "credentials and endpoint come from its environment or fsspec's configuration)"
        ) from None


def store_instance_prefix(url: str) -> str:
    """What every store instance writing at ``url`` starts its id with: refs of any of them (an earlier run's, a
    sibling process's) are read from the same objects."""
    return "obj-" + hashlib.blake2b(url.rstrip("/").encode(), digest_size=8).hexdigest()


class _Written(NamedTuple):
    """One object this store knows of: its weight version, rows, bytes per row, stored bytes, when written."""

    version: int
    n_rows: int
    row_bytes: int
    nbytes: int
    made: float


class ObjectStore(RowStore):
    """Checked rows as objects under ``url`` (see the module). ``max_bytes`` is unused (objects are bounded by age
    and count); it is taken so the store is made like the others."""

    blocks = True  #: a put waits for a network or disk write: producers on an event loop call it from a thread

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        writers: int | None = None,
        pending_bytes: int | None = None,
        write_timeout: float | None = None,
        max_age: float | None = None,
        max_objects: int | None = None,
        what: str = "routing object store",
    ) -> None:
        self.url = url.rstrip("/")
        self.what = what
        self.fs, self.root = open_filesystem(self.url, storage_options)
        self._prefix = store_instance_prefix(self.url)  # every instance at this URL: refs this store reads
        self.instance = f"{self._prefix}-{uuid.uuid4().hex[:12]}"
        self.siblings: Siblings | None = None
        self.writers = writers or settings.integer("RR_OBJECT_STORE_WRITERS", default=DEFAULT_WRITERS)
        self.pending_cap = pending_bytes or settings.integer(
            "RR_OBJECT_STORE_PENDING_BYTES", default=DEFAULT_PENDING_BYTES
        )
        self.write_timeout = write_timeout or float(
            settings.integer("RR_OBJECT_STORE_WRITE_TIMEOUT", default=DEFAULT_WRITE_TIMEOUT)
        )
        self.max_age = max_age or float(settings.integer("RR_OBJECT_STORE_MAX_AGE", default=DEFAULT_MAX_AGE))
        self.max_objects = max_objects or settings.integer("RR_OBJECT_STORE_MAX_OBJECTS", default=DEFAULT_MAX_OBJECTS)
        for name, v in (
            ("writers", self.writers),
            ("pending bytes", self.pending_cap),
            ("max objects", self.max_objects),
        ):
            if v <= 0:
                raise ConfigurationError(f"{what}: {name} must be > 0, got {v}")
        self._pool = ThreadPoolExecutor(self.writers, thread_name_prefix="rr-object-write")
        self._room = threading.Condition()
        self._pending = 0
        self._lock = threading.Lock()
        self._known: OrderedDict[str, _Written] = OrderedDict()  # oldest first: what the lifetime bound deletes
        self.weight_version = 0  #: new rows' version where the engine gives none: the retire counter
        self._counts = {
            "written": 0,
            "written_bytes": 0,
            "row_bytes": 0,
            "failed_writes": 0,
            "read_bytes": 0,
            "retired": 0,
            "aged_out": 0,
            "waited_for_room": 0,
        }
        self._host = {"host": socket.gethostname(), "pid": os.getpid()}
        self._known_from_earlier()

    # --- writing ----------------------------------------------------------------------------------------------
    def put(self, checked: CheckedRouting | CheckedIndexer) -> dict[str, Any]:
        """Write the checked rows as one object, wait for it, and return the ref naming it;
        :class:`RoutingStoreWriteError` when it could not be written (this sample only)."""
        new = NewRows(checked)
        arr = checked.array
        made = admitted_version()
        version = self.weight_version if made is None else made
        meta = {
            "weight_version": version,
            "start": checked.start,
            "written": time.time(),
            "by": self._host,
            "kind": "indexer" if isinstance(checked, CheckedIndexer) else "routing",
        }
        blob = encode_object(FramePart(new.key, 0, int(arr.shape[0]), arr, new.digest), meta)
        path = object_path(self.root, version, new.key)
        self._wait_for_room(len(blob), path)
        try:
            self._write(path, blob)
        finally:
            with self._room:
                self._pending -= len(blob)
                self._room.notify_all()
        rb = arr.nbytes // arr.shape[0] if arr.shape[0] else 0
        with self._lock:
            self._known[new.key] = _Written(version, int(arr.shape[0]), rb, len(blob), time.time())
            self._counts["written"] += 1
            self._counts["written_bytes"] += len(blob)
            self._counts["row_bytes"] += arr.nbytes
        self._bound(keep=new.key)
        return new.ref(self.instance, self.url, version)

    def _write(self, path: str, blob: bytes) -> None:
        """``blob`` written at ``path`` by a writer thread, waited for; :class:`RoutingStoreWriteError` (counted) when
        it fails or takes longer than the write timeout."""
        fut = self._pool.submit(self.fs.pipe_file, path, blob)
        try:
            fut.result(timeout=self.write_timeout)
            return
        except FutureTimeout:
            fut.cancel()
            why = (
                f"writing {path} took more than {self.write_timeout:g} s (RR_OBJECT_STORE_WRITE_TIMEOUT); this "
                "sample's rows are refused, not sent"
            )
        except Exception as e:  # noqa: BLE001 - any backend's failure is this sample's typed refusal
            why = f"writing {path} failed: {type(e).__name__}: {e}"
        with self._lock:
            self._counts["failed_writes"] += 1
        raise RoutingStoreWriteError(f"{self.what} {self.url}: {why}")

    def _wait_for_room(self, nbytes: int, path: str) -> None:
        """Hold ``nbytes`` of the in-flight budget, waiting while it is spent (one object larger than the whole
        budget goes alone)."""
        deadline = time.monotonic() + self.write_timeout

        def full() -> bool:  # another write is in flight and this one would pass the budget
            return bool(self._pending) and self._pending + nbytes > self.pending_cap

        with self._room:
            waited = False
            while full():
                waited = True
                left = deadline - time.monotonic()
                if left <= 0 or not self._room.wait(left):
                    if full():
                        with self._lock:
                            self._counts["failed_writes"] += 1
                        raise RoutingStoreWriteError(
                            f"{self.what} {self.url}: {self._pending} bytes were still being written after "
                            f"{self.write_timeout:g} s (RR_OBJECT_STORE_PENDING_BYTES={self.pending_cap}); "
                            f"{path} was not written, this sample's rows are refused"
                        )
            self._pending += nbytes
            if waited:
                with self._lock:
                    self._counts["waited_for_room"] += 1

    def _bound(self, keep: str) -> None:
        """Delete the oldest objects past the lifetime bound (count, then age), never ``keep`` (the object just
        written, which its answer is about to name)."""
        now = time.time()
        doomed: list[tuple[str, _Written]] = []
        with self._lock:
            while len(self._known) > self.max_objects:
                doomed.append(self._known.popitem(last=False))
            while self._known:
                key, w = next(iter(self._known.items()))
                if key == keep or now - w.made <= self.max_age:
                    break
                doomed.append(self._known.popitem(last=False))
            self._counts["aged_out"] += len(doomed)
        if doomed:
            paths = [object_path(self.root, w.version, k) for k, w in doomed]
            try:
                self.fs.rm(paths)
            except FileNotFoundError:  # retired meanwhile, or another process's bound got there first
                pass

    def _known_from_earlier(self) -> None:
        """Objects already under the URL (an earlier run's, other processes'): counted in the lifetime bound, and
        retired by version with the rest."""
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        rows: list[tuple[float, str, _Written]] = []
        for path, info in found.items():
            rel = path[len(self.root) :].strip("/").split("/")  # v<N>/<key>.rr, nothing deeper (the indexer's)
            version = version_of_dir(rel[0]) if len(rel) == 2 else None
            name = rel[-1]
            if not name.endswith(SUFFIX) or version is None:
                continue
            made = _mtime(info)
            rows.append((made, name[: -len(SUFFIX)], _Written(version, -1, -1, int(info.get("size") or 0), made)))
        rows.sort(key=lambda r: r[0])
        with self._lock:
            for _, key, w in rows:
                self._known[key] = w
            if rows:
                self.weight_version = max(self.weight_version, max(w.version for _, _, w in rows))

    # --- reading (the HTTP read route; clients read the objects themselves) ------------------------------------
    def _mine(self, store: str, key: str) -> None:
        if not store.startswith(self._prefix):
            raise RoutingExpiredError(
                f"routing ref {key}: it names store {store}, not one writing at {self.url} (a ref of another store)"
            )

    def _load(self, store: str, key: str) -> FramePart:
        self._mine(store, key)
        if not is_store_key(key):  # a read route's ask: never a path or a glob of the asker's choosing
            raise RoutingExpiredError(f"routing ref {key[:80]!r}: not a key this store makes (32 hex digits)")
        with self._lock:
            w = self._known.get(key)
        paths = (
            [object_path(self.root, w.version, key)] if w is not None else self.fs.glob(f"{self.root}/v*/{key}{SUFFIX}")
        )
        for path in paths:
            try:
                raw = self.fs.cat_file(path)
            except FileNotFoundError:
                continue
            expect = w.n_rows * w.row_bytes if w is not None and w.n_rows >= 0 else len(raw) * 1024
            part, _ = decode_object(raw, expect_nbytes=expect, where=path)
            with self._lock:
                self._counts["read_bytes"] += part.rows.nbytes
            return part
        raise RoutingExpiredError(
            f"routing ref {key}: no object under {self.url} (retired with its weight version, deleted by the "
            "store's lifetime bound, or never written)"
        )

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        part = self._load(store, key)
        n = int(part.rows.shape[0])
        a, b = row_range(key, n, start, stop)
        return FramePart(key, a, b, part.rows[a:b], part.digest if (a, b) == (0, n) else "")

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
        out: list[tuple[int, int] | RoutingExpiredError] = []
        for store, key in keys:
            with self._lock:
                w = self._known.get(key)
            if w is not None and w.n_rows >= 0 and store.startswith(self._prefix):
                out.append((w.n_rows, w.row_bytes))
                continue
            try:
                p = self._load(store, key)
            except RoutingExpiredError as why:
                out.append(why)
                continue
            n = int(p.rows.shape[0])
            out.append((n, p.rows.nbytes // n if n else 0))
        return out

    # --- retire, counters --------------------------------------------------------------------------------------
    def local_retire(self, through: int) -> dict[str, int]:
        """Delete every object of weight version <= ``through`` (each version's folder, whoever wrote it)."""
        try:
            dirs = [
                d for d in self.fs.ls(self.root, detail=False) if (v := version_of_dir(d)) is not None and v <= through
            ]
        except FileNotFoundError:
            dirs = []
        with self._lock:
            gone = [k for k, w in self._known.items() if w.version <= through]
            freed = sum(self._known.pop(k).nbytes for k in gone)
            self.weight_version = max(self.weight_version, through + 1)
            self._counts["retired"] += len(gone)
        for d in dirs:
            try:
                self.fs.rm(d, recursive=True)
            except FileNotFoundError:  # a sibling process retired it first
                pass
        return {
            "retired": len(gone),
            "freed_bytes": freed,
            "weight_version": self.weight_version,
            "deleted_folders": len(dirs),
        }

    def local_stats(self) -> dict[str, Any]:
        with self._lock:
            written = self._counts["written_bytes"]
            return {
                "backend": "objects",
                "url": self.url,
                "instance": self.instance,
                "entries": len(self._known),
                "bytes": sum(w.nbytes for w in self._known.values()),
                "weight_version": self.weight_version,
                "compression": round(self._counts["row_bytes"] / written, 3) if written else None,
                "max_objects": self.max_objects,
                "max_age_s": self.max_age,
                **self._counts,
            }

    def advertise(self, url: str) -> None:
        """Refs keep naming the object store (read without the server); nothing to change."""

    def version_folder(self, version: int) -> str:
        """The folder weight version ``version``'s objects lie in (for tests and the curious)."""
        return version_dir(self.root, version)

    def close(self) -> None:
        """Stop the writer threads (pending writes finish first)."""
        self._pool.shutdown(wait=True)


def _mtime(info: dict[str, Any]) -> float:
    """When an object was written, from a listing entry (a local file's ``mtime``, S3's ``LastModified``)."""
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
    return time.time()
