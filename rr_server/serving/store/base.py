"""What every routing store is (:class:`RowStore`), the one way a ref is made from checked rows (:class:`NewRows`),
and a read of many asks here or in the sibling process that holds them (:func:`read_many`)."""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from rr_client.core.codec import CheckedRouting
from rr_client.core.errors import ArgumentTypeError, RoutingExpiredError
from rr_client.core.reference import FramePart, RoutingRef, checksum
from rr_server.serving.store.siblings import Siblings, merge_stats, retire_everywhere

__all__ = ["RowStore", "NewRows", "read_many", "Ask"]

#: one read ask: (store instance, key, start, stop)
Ask = tuple[str, str, int | None, int | None]


class RowStore(Protocol):
    """A routing store: checked rows in (:meth:`put`, the codec's ``store=``), rows out by key, retired per weight
    version, counted. The in-memory store and the Ray store are two; :meth:`retire` and :meth:`stats` reach the
    server's sibling processes the same way for both."""

    instance: str  #: this store's id, named by every ref it makes
    url: str  #: where refs say their rows are read
    siblings: Siblings | None  #: the server's other API server processes (``install_store``)

    def put(self, checked: CheckedRouting) -> dict[str, Any]:
        """Keep checked rows; the :class:`rr_client.RoutingRef` dict the answer carries instead of them."""
        ...

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart:
        """Rows ``[start, stop)`` of ``key``; :class:`RoutingExpiredError` when not held here, ValueError outside."""
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
        return merge_stats(self.local_stats(), self.siblings.stats() if self.siblings else [])


class NewRows:
    """Checked rows a store takes: a fresh key and the rows' checksum; :meth:`ref` is the one constructor of the
    ref that names them (both stores make theirs here)."""

    __slots__ = ("checked", "key", "digest")

    def __init__(self, checked: CheckedRouting) -> None:
        if not isinstance(checked, CheckedRouting):  # only rows that passed the check get in
            raise ArgumentTypeError(
                f"a routing store takes a CheckedRouting from check_routing, got {type(checked).__name__}"
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
        ).to_dict()


def read_many(store: RowStore, asks: list[Ask]) -> tuple[list[FramePart], list[dict[str, str]]]:
    """Each ask's part, in order (one :class:`FramePart` per distinct ask, however often it is named), read here
    or from the sibling process that holds it; else ``[]`` and every expired key with why. ValueError: a bad
    row range."""
    got: dict[Ask, FramePart] = {}
    expired: list[dict[str, str]] = []
    remote: dict[str, list[Ask]] = {}
    for ask in dict.fromkeys(asks):
        if store.siblings is not None and store.siblings.holder(ask[0]) is not None:
            remote.setdefault(ask[0], []).append(ask)
            continue
        try:
            got[ask] = store.read(*ask)
        except RoutingExpiredError as e:
            expired.append({"key": ask[1], "why": str(e)})
    for instance, group in remote.items():
        assert store.siblings is not None
        for ask, r in zip(group, store.siblings.read(instance, [a[1:] for a in group])):
            if isinstance(r, FramePart):
                got[ask] = r
            elif isinstance(r, RoutingExpiredError):
                expired.append({"key": ask[1], "why": str(r)})
            else:
                raise r
    return ([] if expired else [got[a] for a in asks]), expired
