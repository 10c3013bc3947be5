"""Rows by reference in an object store (S3-compatible, or a shared filesystem): where a ref's object lies and what
it holds. The one layout the server's object store writes (``rr_server.serving.store.objects``) and every client
reads (``rr_client.client._object_refs``). Core: no httpx; fsspec only when a filesystem is opened.

An object holds one sample's checked rows, written once::

    8 bytes   b"rr.obj1\\n"
    rest      zlib (level 1) of the routing frame (:func:`rr_client.core.reference.encode_frame`): one part, the rows
              with the checksum their ref names, and a ``meta`` header (weight version, first token row, kind, when
              and by which engine process they were written)

at ``<store URL>/v<weight version>/<key>.rr``: a ref (its ``url``, ``weight_version`` and ``key``) names its object
and nothing else, and retiring weight version V deletes ``v0`` .. ``vV`` whole. Reading checks the object whole
(magic, bounded inflate, the frame's header and checksum) before the ref's own check (:func:`checked_part` in the
client) and the one full check of the rows.
"""

from __future__ import annotations

import re
import zlib
from typing import Any
from urllib.parse import urlsplit

from rr_client.core.errors import ConfigurationError, MalformedPayloadError, ProtocolError
from rr_client.core.optional import require
from rr_client.core.reference import FramePart, decode_frame, encode_frame

__all__ = [
    "MAGIC",
    "SUFFIX",
    "is_object_url",
    "object_path",
    "version_dir",
    "version_of_dir",
    "encode_object",
    "decode_object",
    "under_prefix",
    "is_store_key",
    "open_filesystem",
]

MAGIC = b"rr.obj1\n"
SUFFIX = ".rr"
_KEY = re.compile(r"[0-9a-f]{32}")  # a store key (uuid4 hex): never a path of its own
_VERSION_DIR = re.compile(r"v(\d{1,19})")
_NOT_OBJECTS = ("http", "https", "ray")
_HEADER_ROOM = 1 << 20  #: bytes an object's frame may carry beyond its rows (the JSON header)


def is_object_url(url: str) -> bool:
    """A ref's URL names an object store (``s3://bucket/prefix``, ``file:///path``, any fsspec protocol), not an
    rr server (``http(s)://``) nor a Ray store actor (``ray://``)."""
    scheme = urlsplit(url).scheme.lower()
    return bool(scheme) and "://" in url and scheme not in _NOT_OBJECTS


def version_dir(root: str, weight_version: int) -> str:
    """The folder of one weight version's objects under ``root`` (retired whole)."""
    return f"{root.rstrip('/')}/v{int(weight_version)}"


def version_of_dir(name: str) -> int | None:
    """The weight version a folder name ``v<N>`` (its last path part) holds, else None."""
    m = _VERSION_DIR.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def is_store_key(key: str) -> bool:
    """``key`` is a store key (32 hex digits): never a path, a glob or a traversal of its own."""
    return bool(_KEY.fullmatch(key))


def object_path(root: str, weight_version: int, key: str) -> str:
    """Where the object of ``key`` made under ``weight_version`` lies under ``root`` (a store URL or an fsspec
    path); :class:`ProtocolError` for a key that is not a store key (a ref can never name a path of its choosing)."""
    if not is_store_key(key):
        raise ProtocolError(f"routing ref key {key[:80]!r} is not an object store key (32 hex digits)")
    return f"{version_dir(root, weight_version)}/{key}{SUFFIX}"


def under_prefix(url: str, prefixes: tuple[str, ...]) -> bool:
    """``url`` lies at or under one of ``prefixes`` (whole path parts: ``s3://b/p`` covers ``s3://b/p/x``, never
    ``s3://b/px``)."""
    u = url.rstrip("/")
    return any(u == p.rstrip("/") or u.startswith(p.rstrip("/") + "/") for p in prefixes if p.strip("/"))


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, its path of ``url``), for the store that writes and the client that reads; credentials
    and endpoints from ``storage_options``, else fsspec's configuration and the environment
    (``FSSPEC_S3_ENDPOINT_URL``, ``AWS_*``, ``~/.config/fsspec``). fsspec is imported here, on first use."""
    if not is_object_url(url):
        raise ConfigurationError(
            f"routing object store {url!r}: expected a URL such as s3://bucket/prefix or file:///path"
        )
    fsspec = require("fsspec", for_what="routing refs in an object store (rr-replay[objects])")
    opts = dict(storage_options or {})
    if url.split("://", 1)[0].lower() in ("file", "local"):
        opts.setdefault("auto_mkdir", True)  # a shared folder's v<N> folders are made on first write
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError) as e:
        raise ConfigurationError(
            f"routing object store {url!r}: {e} (S3 needs s3fs: pip install 'rr-replay[objects]')"
        ) from None
    return fs, path.rstrip("/")


def encode_object(part: FramePart, meta: dict[str, Any]) -> bytes:
    """The bytes of one sample's object: the magic, then zlib (level 1: fast, the rows are ids) of its frame."""
    return MAGIC + zlib.compress(encode_frame([part], meta=meta), 1)


def decode_object(raw: bytes, *, expect_nbytes: int, where: str) -> tuple[FramePart, dict[str, Any]]:
    """The one part an object holds and its ``meta``, checked whole: magic, an inflate bounded by the ref's own
    size (``expect_nbytes`` of rows plus a header: a crafted object never inflates further), the frame's header
    and checksum. :class:`MalformedPayloadError` naming ``where``."""
    if not raw.startswith(MAGIC):
        raise MalformedPayloadError(f"{where}: not an rr routing object (its first bytes are {bytes(raw[:8])!r})")
    limit = expect_nbytes + _HEADER_ROOM
    inflate = zlib.decompressobj()
    try:
        frame = inflate.decompress(memoryview(raw)[len(MAGIC) :], limit)
    except zlib.error as e:
        raise MalformedPayloadError(f"{where}: the object's data does not inflate: {e}") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise MalformedPayloadError(
            f"{where}: the object inflates past {limit} bytes (its ref names {expect_nbytes} bytes of rows) or is cut"
        )
    parts, meta = decode_frame(frame, with_meta=True)
    if len(parts) != 1:
        raise MalformedPayloadError(f"{where}: an object holds one part, this one {len(parts)}")
    return parts[0], meta
