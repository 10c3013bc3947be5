"""rr client: decode, validate and pad routed experts from SGLang/vLLM for R3 training.

The core (codec, errors, :class:`RRInfo`, HF-config helpers) imports neither torch nor httpx.
:class:`RoutedExpertsClient` (httpx) and :func:`to_tensors`/:class:`RoutingTensors` (torch) are
loaded on first use, so ``from rr_client import RoutedExpertsClient`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rr_client._results import GenerateBatch, GenerateResult, parse_sample
from rr_client._version import __version__
from rr_client.codec import (
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
from rr_client.errors import (
    AuthenticationError,
    ConnectError,
    ConnectionLostError,
    ExpertIdOutOfRangeError,
    MalformedPayloadError,
    MissingRoutingError,
    ProtocolError,
    ReplayError,
    ReplicaMismatchError,
    RequestRejectedError,
    RequestTimeoutError,
    RoutedExpertsError,
    RRError,
    ServerError,
    ShapeMismatchError,
    TokenMismatchError,
    RoutingExpiredError,
    RoutingChecksumError,
    TransportError,
    UnrecordedRoutingError,
    UnsupportedModelError,
    WeightSyncError,
    UnsupportedVersionError,
    MissingDependencyError,
    ArgumentTypeError,
    ConfigurationError,
    LogprobsModeError,
    UntrustedHostError,
    SettingError,
    StaleRoutingError,
)
from rr_client.hf_config import hash_layers_from_config, load_config, moe_layers_from_config, routing_dims_from_config
from rr_client.info import RRInfo
from rr_client.provenance import Provenance, ProvenanceCheck, check_provenance, tokens_digest
from rr_client.reference import RoutingRef

if TYPE_CHECKING:
    from rr_client._client import Prompt, RoutedExpertsClient
    from rr_client._replicas import ReplicaStats
    from rr_client.trajectory import ChatTrajectory, Trajectory, TurnSpan
    from rr_client.trainer.layouts import PackedRouting, RoutingTensors, tensor_dtype, to_packed, to_tensors

# name -> module that defines it; imported on first attribute access (httpx / torch stay unloaded until then)
_LAZY = {
    "RoutedExpertsClient": "rr_client._client",
    "Prompt": "rr_client._client",
    "ReplicaStats": "rr_client._replicas",
    "RoutingTensors": "rr_client.trainer.layouts",
    "to_tensors": "rr_client.trainer.layouts",
    "tensor_dtype": "rr_client.trainer.layouts",
    "PackedRouting": "rr_client.trainer.layouts",
    "to_packed": "rr_client.trainer.layouts",
    "Trajectory": "rr_client.trajectory",
    "ChatTrajectory": "rr_client.trajectory",
    "TurnSpan": "rr_client.trajectory",
}


def __getattr__(name: str) -> Any:
    """Load the httpx- and torch-backed parts of the public API on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rr_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "RoutedExpertsClient", "Prompt", "ReplicaStats", "Trajectory", "ChatTrajectory", "GenerateBatch", "GenerateResult", "parse_sample",
    "RoutingTensors", "to_tensors", "tensor_dtype", "PackedRouting", "to_packed",
    "encode_routed_experts", "decode_routed_experts", "decode_meta_info", "routing_meta_fields",
    "routing_error_fields", "check_payload", "check_routing", "CheckedRouting", "wire_dtype", "expected_rows",
    "RRError", "RoutedExpertsError", "MalformedPayloadError", "ShapeMismatchError",
    "ExpertIdOutOfRangeError", "UnrecordedRoutingError", "MissingRoutingError", "TokenMismatchError",
    "RoutingExpiredError", "RoutingChecksumError", "RoutingRef",
    "TransportError", "ConnectError", "RequestTimeoutError", "ConnectionLostError",
    "ServerError", "RequestRejectedError", "AuthenticationError", "ProtocolError",
    "ReplicaMismatchError", "ReplayError", "UnsupportedModelError", "WeightSyncError",
    "UnsupportedVersionError", "MissingDependencyError", "ConfigurationError", "ArgumentTypeError",
    "LogprobsModeError", "UntrustedHostError", "SettingError", "StaleRoutingError",
    "Provenance", "ProvenanceCheck", "check_provenance", "tokens_digest", "TurnSpan",
    "RRInfo", "load_config", "moe_layers_from_config", "hash_layers_from_config", "routing_dims_from_config",
    "__version__",
]
