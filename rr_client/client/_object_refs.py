"""Resolving refs whose rows lie in an object store (``s3://bucket/prefix``, ``file:///shared/path``, any fsspec
URL an rr server was told with ``--rr-store``): the client reads each ref's object itself, with its own
credentials, without the engine (which may be gone).

Which object stores a client reads is its own setting, never the ref's: ``object_stores=`` (or ``RR_OBJECT_STORES``)
lists the URL prefixes a ref may name, and a ref naming any other is :class:`UntrustedHostError` before anything is
read, as a ref naming an unknown host is for the API key. How to reach them (endpoint, keys, profile) comes from
``storage_options=`` or fsspec's own configuration and the environment, never from a ref. ``rr-replay[objects]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError, ProtocolError, RoutingExpiredError, UntrustedHostError
from rr_client.core.objects import decode_object, is_object_url, object_path, open_filesystem, under_prefix
from rr_client.core.reference import FramePart, RoutingRef

__all__ = ["ObjectReader", "OBJECT_STORES_ENV"]

OBJECT_STORES_ENV = "RR_OBJECT_STORES"


def _prefixes(given: Iterable[str] | str | None) -> tuple[str, ...]:
    if given is None:
        given = settings.text(OBJECT_STORES_ENV)
        if given is None:
            return ()
    items = [p.strip() for p in (given.split(",") if isinstance(given, str) else given) if p and p.strip()]
    for p in items:
        if not is_object_url(p):
            raise ConfigurationError(
                f"object_stores entry {p!r} is not an object store URL (s3://bucket/prefix, file:///path)"
            )
    return tuple(p.rstrip("/") for p in items)


class ObjectReader:
    """Reads refs' objects under the allowed ``prefixes``, through the filesystem
    :func:`rr_client.core.objects.open_filesystem` opens with ``storage_options`` (the one the store writes with)."""

    def __init__(self, prefixes: Iterable[str] | str | None, storage_options: dict[str, Any] | None = None) -> None:
        self.prefixes = _prefixes(prefixes)
        self.storage_options = dict(storage_options or {})

    def allow(self, url: str) -> None:
        """:class:`UntrustedHostError` unless ``url`` lies under an allowed prefix."""
        if not under_prefix(url, self.prefixes):
            raise UntrustedHostError(
                f"a routing ref names the object store {url!r}, which this client was not configured to read: list "
                f"its prefix in object_stores= or {OBJECT_STORES_ENV} (allowed now: {list(self.prefixes) or 'none'}); "
                "it is read with this client's own storage credentials"
            )

    def read_parts(self, url: str, refs: Sequence[RoutingRef]) -> list[FramePart]:
        """The rows of ``refs`` (all naming ``url``), each object read and checked whole (one batched fetch)."""
        self.allow(url)
        fs, root = open_filesystem(url, self.storage_options)  # fsspec keeps one instance per protocol and options
        paths = [object_path(root, r.weight_version, r.key) for r in refs]
        got = fs.cat(paths, on_error="return")
        if not isinstance(got, dict):  # one path: fsspec answers the bytes
            got = {paths[0]: got}
        out: list[FramePart] = []
        gone: list[str] = []
        for ref, path in zip(refs, paths):
            raw = got.get(path)
            if isinstance(raw, FileNotFoundError) or raw is None:
                gone.append(f"routing ref {ref.key}: no object at {path}")
                continue
            if isinstance(raw, BaseException):
                raise raw
            where = f"routing ref {ref.key} ({path})"
            part, meta = decode_object(raw, expect_nbytes=ref.nbytes, where=where)
            said = {k: meta.get(k) for k in ("weight_version", "start", "kind")}
            if said != {"weight_version": ref.weight_version, "start": ref.start, "kind": ref.kind}:
                raise ProtocolError(f"{where}: the object says it holds {said}, the ref names another sample's")
            out.append(part)
        if gone:
            raise RoutingExpiredError(
                f"{url}: "
                + "; ".join(gone[:4])
                + (f" (+{len(gone) - 4} more)" if len(gone) > 4 else "")
                + ": retired with its weight version, deleted by the store's lifetime bound, or never written"
            )
        return out
