"""The bookkeeping every routing store keeps beside the rows (the in-memory store of an rr server and the Ray
store actor): entries oldest first under a byte cap, why a key is gone, the weight version, the counters."""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rr_client.core.errors import ConfigurationError, RoutingExpiredError

__all__ = ["Held", "StoreLedger", "row_range", "refs_made_under", "admitted_version"]

_GONE_REMEMBERED = 1 << 16  # keys whose reason (evicted / retired) is kept for the error message
# The engine weight version at admission of the request whose rows are being stored (None: not known here).
_ADMITTED: contextvars.ContextVar[int | None] = contextvars.ContextVar("rr_ref_weight_version", default=None)


@contextlib.contextmanager
def refs_made_under(version: int | None) -> Iterator[None]:
    """Refs stored in this block carry ``version`` (the engine's weight version when their request was admitted),
    so retiring through V frees exactly the rows made under weights <= V."""
    token = _ADMITTED.set(version)
    try:
        yield
    finally:
        _ADMITTED.reset(token)


def admitted_version() -> int | None:
    """The weight version set by :func:`refs_made_under` around this store call, if any."""
    return _ADMITTED.get()


@dataclass
class Held:
    """One key's entry: what holds the rows (a numpy array, or a Ray object ref), their count and bytes, the
    weight version they were made under and their checksum."""

    rows: Any
    n_rows: int
    nbytes: int
    weight_version: int
    digest: str


class StoreLedger:
    """What every routing store keeps beside the rows: entries oldest first under a byte cap, why a key is gone,
    the weight version, the counters. The in-memory store and the Ray store actor share it; not locked (the
    in-memory store locks around it, a Ray actor runs one call at a time). ``what`` and ``moved`` name the store
    and where a ref of another instance came from, in the errors."""

    def __init__(
        self,
        max_bytes: int,
        instance: str | None = None,
        *,
        what: str = "routing store",
        moved: str = "the server restarted, or the ref was sent to another server",
        setting: str = "RR_ROUTING_STORE_BYTES",
    ) -> None:
        if max_bytes <= 0:
            raise ConfigurationError(f"{what} byte cap must be > 0, got {max_bytes} ({setting})")
        self.max_bytes = int(max_bytes)
        self.instance = instance or uuid.uuid4().hex
        self.weight_version = 0
        self.what, self.moved, self.setting = what, moved, setting
        self._entries: OrderedDict[str, Held] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self.counts = dict.fromkeys(
            (
                "stored",
                "stored_bytes",
                "reads",
                "read_rows",
                "read_bytes",
                "evicted",
                "evicted_bytes",
                "retired",
                "retired_bytes",
                "expired_reads",
                "refused",
            ),
            0,
        )

    def admit(self, nbytes: int) -> None:
        """Refuse rows larger than the whole cap (they could never be held)."""
        if nbytes > self.max_bytes:
            self.counts["refused"] += 1
            raise RoutingExpiredError(
                f"routing of {nbytes} bytes exceeds the {self.what}'s cap of "
                f"{self.max_bytes} bytes ({self.setting}): it could not be held"
            )

    def add(self, key: str, held: Held) -> None:
        """Hold one entry (admitted), evicting the oldest until it fits."""
        while self._entries and self._bytes + held.nbytes > self.max_bytes:
            old, e = self._entries.popitem(last=False)
            self._bytes -= e.nbytes
            self.counts["evicted"] += 1
            self.counts["evicted_bytes"] += e.nbytes
            self._forget(old, f"evicted by the {self.what}'s byte cap ({self.max_bytes} bytes)")
        self._entries[key] = held
        self._bytes += held.nbytes
        self.counts["stored"] += 1
        self.counts["stored_bytes"] += held.nbytes

    def _forget(self, key: str, why: str) -> None:
        self._gone[key] = why
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def find(self, store: str, key: str) -> Held:
        """The entry of ``key`` made by this instance; :class:`RoutingExpiredError` saying why it is not held."""
        e = self._entries.get(key) if store == self.instance else None
        if e is None:
            self.counts["expired_reads"] += 1
            why = (
                f"it was made by routing store {store}, this {self.what} is {self.instance} ({self.moved})"
                if store != self.instance
                else self._gone.get(key, f"no such key in this {self.what}")
            )
            raise RoutingExpiredError(f"routing ref {key}: {why}")
        return e

    def note_read(self, rows: int, nbytes: int) -> None:
        self.counts["reads"] += 1
        self.counts["read_rows"] += rows
        self.counts["read_bytes"] += nbytes

    def retire(self, through: int) -> dict[str, int]:
        """Free every entry of weight version <= ``through``; later entries get ``through + 1`` or more."""
        gone = [k for k, e in self._entries.items() if e.weight_version <= through]
        freed = 0
        for k in gone:
            e = self._entries.pop(k)
            freed += e.nbytes
            self._forget(k, f"retired with weight version {e.weight_version} (retire through {through})")
        self._bytes -= freed
        self.counts["retired"] += len(gone)
        self.counts["retired_bytes"] += freed
        self.weight_version = max(self.weight_version, through + 1)
        return {"retired": len(gone), "freed_bytes": freed, "weight_version": self.weight_version}

    def stats(self) -> dict[str, Any]:
        """Entries and bytes held, cap, weight version, lifetime counts."""
        return {
            "instance": self.instance,
            "entries": len(self._entries),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "weight_version": self.weight_version,
            **self.counts,
        }


def row_range(key: str, n: int, start: int | None, stop: int | None) -> tuple[int, int]:
    """``[start, stop)`` of a key's ``n`` rows (default: all); ValueError (a 400) outside them."""
    a, b = (0 if start is None else start), (n if stop is None else stop)
    if not 0 <= a <= b <= n:
        raise ValueError(f"routing ref {key}: rows [{a}, {b}) outside its {n} rows")
    return a, b
