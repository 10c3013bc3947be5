"""What every routing store is (:class:`RowStore`), the one way a ref is made from checked rows (:class:`NewRows`),
and a read of many asks here or in the sibling process that holds them, merged and bounded by bytes
(:func:`read_many`)."""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple, Protocol

import numpy as np

from rr_client.core.codec import CheckedRouting
from rr_client.core.errors import ArgumentTypeError, RoutingExpiredError
from rr_client.core.indexer import CheckedIndexer
from rr_client.core.reference import FramePart, RoutingRef, checksum
from rr_server.serving.store.ledger import row_range
from rr_server.serving.store.siblings import Siblings, merge_stats, process_gauges, retire_everywhere

__all__ = ["RowStore", "NewRows", "StorePair", "read_many", "Read", "ReadTooLarge", "Ask"]

#: one read ask: (store instance, key, start, stop)
Ask = tuple[str, str, int | None, int | None]


class RowStore(Protocol):
    """A routing store: checked rows in (:meth:`put`, the codec's ``store=``), rows out by key, retired per weight
    version, counted. The in-memory store, the Ray store and the object store are three; :meth:`retire` and
    :meth:`stats` reach the server's sibling processes the same way for all."""

    instance: str  #: this store's id, named by every ref it makes
    url: str  #: where refs say their rows are read
    siblings: Siblings | None  #: the server's other API server processes (``install_store``)

    def put(self, checked: CheckedRouting | CheckedIndexer) -> dict[str, Any]:
        """Keep checked rows; the :class:`rr_client.RoutingRef` dict the answer carries instead of them."""
        ...

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key``; :class:`RoutingExpiredError` when not held here, ValueError outside."""
        ...

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
        """(rows, bytes per row) of each (store, key) held here, or why not, without touching the rows: what a
        read costs is known before any row is copied."""
        ...

    def local_retire(self, through: int) -> dict[str, int]:
        """Free this process's rows made under weight version <= ``through``."""
        ...

    def local_stats(self) -> dict[str, Any]:
        """This process's counters."""
        ...

    def advertise(self, url: str) -> None:
        """The server's URL is known: the store's refs name it (or keep naming what they do)."""
        ...

    def retire(self, through: int) -> dict[str, Any]:
        """:meth:`local_retire` here and in every sibling process."""
        return retire_everywhere(self, through)

    def stats(self) -> dict[str, Any]:
        """Counters for ``/rr/info`` and metrics, summed over the server's processes."""
        return merge_stats({**self.local_stats(), **process_gauges()}, self.siblings.stats() if self.siblings else [])


class NewRows:
    """Checked rows a store takes: a fresh key and the rows' checksum; :meth:`ref` is the one constructor of the
    ref that names them (every store makes its refs here)."""

    __slots__ = ("checked", "key", "digest")

    def __init__(self, checked: CheckedRouting | CheckedIndexer) -> None:
        if not isinstance(checked, (CheckedRouting, CheckedIndexer)):  # only rows that passed the check get in
            raise ArgumentTypeError(
                "a routing store takes a CheckedRouting from check_routing or a CheckedIndexer from check_indexer, "
                f"got {type(checked).__name__}"
            )
        self.checked = checked
        self.key = uuid.uuid4().hex
        self.digest = checksum(checked.array)

    def ref(self, store: str, url: str, weight_version: int) -> dict[str, Any]:
        """The :class:`rr_client.RoutingRef` dict naming these rows, held by store ``store`` at ``url`` under
        weight version ``weight_version``: shape, dtype and start as checked."""
        arr = self.checked.array
        return RoutingRef(
            store=store,
            url=url,
            key=self.key,
            rows=int(arr.shape[0]),
            layers=int(arr.shape[1]),
            topk=int(arr.shape[2]),
            dtype=arr.dtype.name,
            start=self.checked.start,
            weight_version=int(weight_version),
            checksum=self.digest,
            kind="indexer" if isinstance(self.checked, CheckedIndexer) else "routing",
        ).to_dict()


class StorePair(RowStore):
    """The routing store and the indexer store behind the one read route: each ask is read from the store whose
    instance it names (every ref names its store, so an indexer ref's ask reaches the indexer store), any other
    instance from the routing store (a sibling process's, or 410 saying why). What :func:`read_many` reads from when
    the process holds both; rows go in through each store's own :meth:`put`."""

    def __init__(self, routing: RowStore, indexer: RowStore) -> None:
        self.routing, self.indexer = routing, indexer
        self.instance, self.url, self.siblings = routing.instance, routing.url, routing.siblings

    def _of(self, instance: str) -> RowStore:
        return self.indexer if instance == self.indexer.instance else self.routing

    def put(self, checked: CheckedRouting | CheckedIndexer) -> dict[str, Any]:
        """Into the store of the rows' kind."""
        return (self.indexer if isinstance(checked, CheckedIndexer) else self.routing).put(checked)

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        return self._of(store).read(store, key, start, stop)

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
        out: list[tuple[int, int] | RoutingExpiredError | None] = [None] * len(keys)
        for s in (self.routing, self.indexer):
            mine = [i for i, (instance, _) in enumerate(keys) if self._of(instance) is s]
            for i, e in zip(mine, s.extents([keys[i] for i in mine]) if mine else []):
                out[i] = e
        return out  # type: ignore[return-value]  # every slot filled

    def local_retire(self, through: int) -> dict[str, int]:
        return self.routing.local_retire(through)

    def local_stats(self) -> dict[str, Any]:
        return self.routing.local_stats()

    def advertise(self, url: str) -> None:
        self.routing.advertise(url)

    def retire(self, through: int) -> dict[str, Any]:
        """Both stores retire through ``through`` (the routing store's answer, the indexer store's under
        ``indexer_store``)."""
        return {**self.routing.retire(through), "indexer_store": self.indexer.retire(through)}


class ReadTooLarge(ValueError):
    """A read whose answer would carry (or hash) more rows' bytes than the per-call cap (answered 413): what it
    would cost, the cap, and how to split, said before any row is read."""

    def __init__(self, nbytes: int, hashed: int, cap: int, asks: int) -> None:
        self.nbytes, self.hashed, self.cap = nbytes, hashed, cap
        super().__init__(
            f"this read would answer {nbytes} bytes of rows (each stored row once, over {asks} distinct asks) and "
            f"hash {hashed} bytes of row ranges for their checksums; this server answers at most {cap} bytes of "
            f"each per call (RR_ROUTING_READ_BYTES): split the refs over several calls of at most {cap} bytes each "
            "(one ref larger than that: ask row ranges of it with start/stop; rr_client's resolve splits so)"
        )


class Read(NamedTuple):
    """What :func:`read_many` found: each ask's part in order (views into ``runs``), the merged reads the frame
    sends (:func:`rr_client.core.reference.encode_frame`'s ``runs``), and every expired key with why."""

    parts: list[FramePart]
    expired: list[dict[str, str]]
    runs: list[FramePart]


def _extents(store: RowStore, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]:
    """(rows, bytes per row) of each (store, key), here or from the sibling that holds it, no row read."""
    out: list[tuple[int, int] | RoutingExpiredError | None] = [None] * len(keys)
    local: list[int] = []
    remote: dict[str, list[int]] = {}
    for i, (instance, _) in enumerate(keys):
        if store.siblings is not None and store.siblings.holder(instance) is not None:
            remote.setdefault(instance, []).append(i)
        else:
            local.append(i)
    for i, e in zip(local, store.extents([keys[i] for i in local])):
        out[i] = e
    for instance, idx in remote.items():
        assert store.siblings is not None
        for i, e in zip(idx, store.siblings.extents(instance, [keys[i][1] for i in idx])):
            out[i] = e
    return out  # type: ignore[return-value]  # every slot filled


def _merge(
    key_of: np.ndarray, a: np.ndarray, b: np.ndarray, n_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Asks' ranges ``[a, b)`` of keys ``key_of`` merged where they overlap or touch, without a loop: (run of each
    ask, each run's key, start, stop). Each key's rows sit at their own base on one line, a row apart from the next
    key's, so one sort and a running max merge every key's ranges at once and never across keys."""
    base = np.concatenate([[0], np.cumsum(n_rows + 1)[:-1]])
    lo, hi = base[key_of] + a, base[key_of] + b
    order = np.lexsort((hi, lo))
    lo_s, hi_s = lo[order], hi[order]
    reach = np.maximum.accumulate(hi_s)
    new = np.ones(len(order), dtype=bool)
    new[1:] = lo_s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    run_of = np.empty(len(order), dtype=np.int64)
    run_of[order] = np.cumsum(new) - 1
    run_key = key_of[order][first]
    return run_of, run_key, lo_s[first] - base[run_key], np.maximum.reduceat(hi_s, first) - base[run_key]


def read_many(store: RowStore, asks: list[Ask], max_bytes: int | None = None) -> Read:
    """Each ask's part, in order, read here or from the sibling process that holds it, bounded by bytes.

    Asks of one (store, key) whose ranges overlap or touch are merged into one run, read (and sent) once; each ask's
    part is a view into its run, with the checksum kept from store time when it is the whole key (else the frame
    hashes its range). What the answer costs is computed from the keys' extents before any row is read: more than
    ``max_bytes`` of rows, or of row ranges to hash, raises :class:`ReadTooLarge`. A key that is gone: no parts,
    every expired key with why. ValueError: a bad row range."""
    distinct = list(dict.fromkeys(asks))
    if not distinct:
        return Read([], [], [])
    keys = list(dict.fromkeys((s, k) for s, k, _, _ in distinct))
    extents = _extents(store, keys)
    gone = {k: str(e) for (_, k), e in zip(keys, extents) if isinstance(e, RoutingExpiredError)}
    if gone:
        return Read([], [{"key": k, "why": why} for k, why in gone.items()], [])
    n_rows = np.array([e[0] for e in extents], dtype=np.int64)  # type: ignore[index]
    row_bytes = np.array([e[1] for e in extents], dtype=np.int64)  # type: ignore[index]
    slot = {k: i for i, k in enumerate(keys)}
    key_of = np.array([slot[(s, k)] for s, k, _, _ in distinct], dtype=np.int64)
    n = n_rows[key_of]
    clip = 1 << 62  # a range end past any key's rows stays past them (JSON ints are unbounded, int64 is not)
    a = np.array([0 if x is None else min(x, clip) for _, _, x, _ in distinct], dtype=np.int64)
    b = np.array([-1 if x is None else min(x, clip) for _, _, _, x in distinct], dtype=np.int64)
    b = np.where(np.array([x is None for _, _, _, x in distinct]), n, b)
    bad = ~((a >= 0) & (a <= b) & (b <= n))
    if bad.any():
        i = int(np.argmax(bad))
        row_range(distinct[i][1], int(n[i]), distinct[i][2], distinct[i][3])  # raises, naming the range
    run_of, run_key, run_a, run_b = _merge(key_of, a, b, n_rows)
    whole = (a == 0) & (b == n)
    nbytes = int(((run_b - run_a) * row_bytes[run_key]).sum())
    hashed = int(((b - a) * row_bytes[key_of])[~whole].sum())
    if max_bytes is not None and max(nbytes, hashed) > max_bytes:
        raise ReadTooLarge(nbytes, hashed, max_bytes, len(distinct))
    runs, expired = _read_runs(
        store, [(*keys[g], ra, rb) for g, ra, rb in zip(run_key.tolist(), run_a.tolist(), run_b.tolist())]
    )
    if expired:
        return Read([], expired, [])
    made = {
        ask: FramePart(ask[1], x, y, runs[r].rows[x - runs[r].start : y - runs[r].start], runs[r].digest if w else "")
        for ask, r, x, y, w in zip(distinct, run_of.tolist(), a.tolist(), b.tolist(), whole.tolist())
    }
    return Read([made[ask] for ask in asks], [], runs)


def _read_runs(store: RowStore, runs: list[Ask]) -> tuple[list[FramePart], list[dict[str, str]]]:
    """The merged runs' rows (store, key, start, stop), here or from the sibling that holds them; else ``[]`` and
    every key gone since its extent was taken (evicted or retired in between), with why."""
    got: list[FramePart | None] = [None] * len(runs)
    gone: dict[str, str] = {}
    remote: dict[str, list[int]] = {}
    for i, (instance, key, a, b) in enumerate(runs):
        if store.siblings is not None and store.siblings.holder(instance) is not None:
            remote.setdefault(instance, []).append(i)
            continue
        try:
            got[i] = store.read(instance, key, a, b)
        except RoutingExpiredError as e:
            gone[key] = str(e)
    for instance, idx in remote.items():
        assert store.siblings is not None
        for i, r in zip(idx, store.siblings.read(instance, [runs[i][1:] for i in idx])):
            if isinstance(r, FramePart):
                got[i] = r
            elif isinstance(r, RoutingExpiredError):
                gone[runs[i][1]] = str(r)
            else:
                raise r
    if gone:
        return [], [{"key": k, "why": why} for k, why in gone.items()]
    return got, []  # type: ignore[return-value]  # every run read
