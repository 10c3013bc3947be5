"""rr's wire core: the codec and its one full check, the error tree, :class:`RRInfo`, HF-config helpers,
routing refs, provenance and the prefill/decode seam. Imports neither torch nor httpx; every other layer and both servers stand on it.

``__all__`` is the core's public surface; :mod:`rr_client` re-exports it whole.
"""

from __future__ import annotations

from rr_client.core import errors as _errors
from rr_client.core._version import __version__
from rr_client.core.codec import (
    CheckedRouting,
    check_payload,
    check_routing,
    decode_meta_info,
    decode_routed_experts,
    encode_routed_experts,
    expected_rows,
    routing_error_fields,
    routing_meta_fields,
    wire_dtype,
)
from rr_client.core.errors import *  # noqa: F403 - the whole error tree is public
from rr_client.core.hf_config import (
    hash_layers_from_config,
    load_config,
    moe_layers_from_config,
    routing_dims_from_config,
)
from rr_client.core.indexer import CheckedIndexer, IndexerDims, check_indexer, decode_indexer, encode_indexer
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance, ProvenanceCheck, check_provenance, tokens_digest
from rr_client.core.reference import RoutingRef
from rr_client.core.seam import Half, Seam, SeamRef, merge_halves, plan_seam
from rr_client.core.spans import ProvenanceSpan, SequenceBook

__all__ = [
    "__version__",
    "encode_routed_experts",
    "decode_routed_experts",
    "decode_meta_info",
    "routing_meta_fields",
    "routing_error_fields",
    "check_payload",
    "check_routing",
    "CheckedRouting",
    "wire_dtype",
    "expected_rows",
    *_errors.__all__,
    "RoutingRef",
    "ProvenanceSpan",
    "SequenceBook",
    "Provenance",
    "ProvenanceCheck",
    "check_provenance",
    "tokens_digest",
    "Half",
    "Seam",
    "SeamRef",
    "merge_halves",
    "plan_seam",
    "IndexerDims",
    "CheckedIndexer",
    "check_indexer",
    "decode_indexer",
    "encode_indexer",
    "RRInfo",
    "load_config",
    "moe_layers_from_config",
    "hash_layers_from_config",
    "routing_dims_from_config",
]
