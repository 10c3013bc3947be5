"""The routing store behind ``routed_experts_format="ref"``: rows held by the server, read later by key.

One row-store protocol (:class:`RowStore`, :mod:`.base`) with three stores behind it: in memory (:mod:`.memory`, the
default), on Ray's object store (:mod:`.ray`, ``RR_ROUTING_STORE=ray``), and as objects under an fsspec URL whose
refs outlive the server (:mod:`.objects`, ``--rr-store s3://...`` / ``file:///...``). All make refs one way
(:class:`NewRows`); memory and Ray keep the same bookkeeping (:mod:`.ledger`) and answer for the server's sibling
processes (:mod:`.siblings`), objects are read by anyone allowed to. This process's store is :func:`current_store` (:mod:`.install`); the HTTP routes are apart
(:mod:`.routes`).
"""

from rr_server.serving.store.base import Ask, NewRows, RowStore, StorePair, read_many
from rr_server.serving.store.install import (
    INDEXER_BYTES_ENV,
    advertised_url,
    current_store,
    indexer_store,
    install_store,
)
from rr_server.serving.store.ledger import admitted_version, refs_made_under
from rr_server.serving.store.memory import DEFAULT_MAX_BYTES, MemoryStore
from rr_server.serving.store.routes import MAX_REFS_PER_READ, STORE_ROUTES, TooManyRefs, parse_read

__all__ = [
    "Ask",
    "NewRows",
    "RowStore",
    "StorePair",
    "read_many",
    "advertised_url",
    "current_store",
    "install_store",
    "indexer_store",
    "INDEXER_BYTES_ENV",
    "admitted_version",
    "refs_made_under",
    "DEFAULT_MAX_BYTES",
    "MemoryStore",
    "MAX_REFS_PER_READ",
    "STORE_ROUTES",
    "TooManyRefs",
    "parse_read",
]
