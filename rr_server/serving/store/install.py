"""This process's routing store: made once by the server that starts here (``RR_ROUTING_STORE``: ``memory``, the
default, ``ray``, or an object store URL: ``s3://bucket/prefix``, ``file:///shared/path``), named by the server's URL once it is known, and met by its sibling processes there. Beside it,
made on first use, the indexer store (:func:`indexer_store`): sparse-attention indexer picks under their own cap.

The producers of answers pass it to the codec (``routing_meta_fields(..., store=current_store())``); the routes
(:mod:`rr_server.serving.store.routes`) read from it.
"""

from __future__ import annotations

import socket
import threading

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError
from rr_client.core.objects import is_object_url
from rr_server.serving.store.base import RowStore
from rr_server.serving.store.memory import DEFAULT_MAX_BYTES, MemoryStore
from rr_server.serving.store.siblings import Siblings

__all__ = [
    "check_store_setting",
    "install_store",
    "current_store",
    "advertised_url",
    "indexer_store",
    "INDEXER_BYTES_ENV",
]

STORE_ENV = "RR_ROUTING_STORE"  #: where rows for refs are held (``--rr-store``): memory, ray or an object store URL
INDEXER_BYTES_ENV = "RR_INDEXER_STORE_BYTES"  #: the indexer store's byte cap (default 2 GiB, as the routing store's)

_STORE: RowStore | None = None
_INDEXER: RowStore | None = None  # the indexer store, made on first use (indexer_store)
_NAMED = False  # the store was given the server's URL (and met its siblings)
_INSTALL_LOCK = threading.Lock()


def advertised_url(host: str | None, port: int | None, scheme: str = "http") -> str:
    """``RR_ADVERTISE_URL``, else ``scheme://host:port`` (a wildcard host becomes this machine's name)."""
    given = settings.text("RR_ADVERTISE_URL")
    if given:
        return given.rstrip("/")
    if host is None or port is None:
        return ""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def check_store_setting(value: str) -> str:
    """``value`` as ``RR_ROUTING_STORE`` / ``--rr-store`` takes it: ``memory``, ``ray``, or an object store URL whose
    filesystem is installed and where this process can write (one empty object written and deleted);
    :class:`ConfigurationError` naming what is wrong (said before any server starts)."""
    if value.lower() in ("memory", "ray"):
        return value.lower()
    if not is_object_url(value):
        raise ConfigurationError(
            f"--rr-store {value!r}: expected memory, ray, or an object store URL (s3://bucket/prefix, file:///path)"
        )
    try:
        import fsspec

        fsspec.get_filesystem_class(value.split("://", 1)[0].lower())
    except (ImportError, ValueError) as e:
        raise ConfigurationError(f"--rr-store {value}: {e} (pip install 'rr-replay[objects]')") from None
    from rr_server.serving.store.objects import probe_writable

    probe_writable(value)
    return value


def _new_store(max_bytes: int | None, *, indexer: bool = False) -> RowStore:
    """The store ``RR_ROUTING_STORE`` names, capped at ``max_bytes`` (default ``RR_ROUTING_STORE_BYTES``; the indexer
    store's: ``RR_INDEXER_STORE_BYTES``)."""
    if indexer:
        cap = max_bytes or settings.integer("RR_INDEXER_STORE_BYTES", default=DEFAULT_MAX_BYTES)
        what, setting = "indexer store", INDEXER_BYTES_ENV
    else:
        cap = max_bytes or settings.integer("RR_ROUTING_STORE_BYTES", default=DEFAULT_MAX_BYTES)
        what, setting = "routing store", "RR_ROUTING_STORE_BYTES"
    given = settings.text(STORE_ENV) or "memory"
    if is_object_url(given):
        from rr_server.serving.store.objects import ObjectStore

        return ObjectStore(given.rstrip("/") + ("/indexer" if indexer else ""), what=f"{what} (objects)")
    backend = given.lower()
    if backend == "ray":
        from rr_server.serving.store.ray import RayStore

        return RayStore(cap, what=f"Ray {what}", setting=setting)
    if backend == "memory":
        return MemoryStore(cap, what=what, setting=setting)
    raise ConfigurationError(
        f"RR_ROUTING_STORE={given!r}: expected memory, ray, or an object store URL (s3://bucket/prefix, file:///path)"
    )


def install_store(url: str = "", max_bytes: int | None = None) -> RowStore:
    """This process's routing store (made once; re-entrant).

    Once the server's URL is known (``url``), the store's refs name it (:meth:`RowStore.advertise`) and the store
    answers for its sibling API server processes (:class:`Siblings`)."""
    global _STORE, _NAMED
    url = url or advertised_url(None, None)
    with _INSTALL_LOCK:
        if _STORE is None:
            _STORE = _new_store(max_bytes)
        if url and not _NAMED:  # once: the server's URL, also the siblings' meeting place
            _NAMED = True
            _STORE.advertise(url)
            _STORE.siblings = Siblings.join(_STORE, url)
        return _STORE


def indexer_store(make: bool = True) -> RowStore | None:
    """This process's indexer store: sparse-attention indexer picks (~512x a sample's routing) held apart from the
    routing store, under their own cap (``RR_INDEXER_STORE_BYTES``), so indexer rows never evict routing rows nor
    routing rows them. Made on first use (``make``) with the routing store's backend, its refs naming the same URL
    (the same read and retire routes serve both, :mod:`.routes`); None where no server installed a routing store.
    It answers in its own process only (no siblings: SGLang's patch and the sidecar serve from one process)."""
    global _INDEXER
    with _INSTALL_LOCK:
        if _STORE is None:
            return None
        if _INDEXER is None and make:
            _INDEXER = _new_store(None, indexer=True)
        if isinstance(_INDEXER, MemoryStore):  # its refs name the server, as the routing store's do
            _INDEXER.url = _STORE.url
        return _INDEXER


def store_blocks() -> bool:
    """This process's routing store writes each ref's rows to an object store (a disk or network write per sample):
    producers that run on an event loop make answers in a worker thread then (the patched engines, the sidecar)."""
    return bool(getattr(_STORE, "blocks", False))


def current_store() -> RowStore | None:
    """The routing store of this process, if a server installed one (what its producers pass to the codec)."""
    return _STORE
