"""rr client: decode, validate and pad routed experts from SGLang/vLLM for R3 training.

Public surface: :class:`RoutedExpertsClient`, :class:`GenerateBatch`/:class:`GenerateResult`,
:func:`to_tensors`, the codec (:func:`encode_routed_experts`, :func:`decode_routed_experts`,
:func:`decode_meta_info`), :class:`RRInfo`, the HF-config helpers and the error hierarchy.
"""

from rr_client._client import Prompt, RoutedExpertsClient
from rr_client._results import GenerateBatch, GenerateResult, parse_sample
from rr_client._tensors import RoutingTensors, tensor_dtype, to_tensors
from rr_client.codec import (
    decode_meta_info,
    decode_routed_experts,
    encode_routed_experts,
    expected_rows,
    routing_meta_fields,
    wire_dtype,
)
from rr_client.errors import (
    ExpertIdOutOfRangeError,
    MalformedPayloadError,
    MissingRoutingError,
    ProtocolError,
    RequestRejectedError,
    RoutedExpertsError,
    RRError,
    ServerError,
    ShapeMismatchError,
    TransportError,
    UnrecordedRoutingError,
)
from rr_client.hf_config import load_config, moe_layers_from_config, routing_dims_from_config
from rr_client.info import RRInfo

__version__ = "0.1.0"

__all__ = [
    "RoutedExpertsClient", "Prompt", "GenerateBatch", "GenerateResult", "parse_sample",
    "RoutingTensors", "to_tensors", "tensor_dtype",
    "encode_routed_experts", "decode_routed_experts", "decode_meta_info", "routing_meta_fields",
    "wire_dtype", "expected_rows",
    "RRError", "RoutedExpertsError", "MalformedPayloadError", "ShapeMismatchError",
    "ExpertIdOutOfRangeError", "UnrecordedRoutingError", "MissingRoutingError",
    "TransportError", "ServerError", "RequestRejectedError", "ProtocolError",
    "RRInfo", "load_config", "moe_layers_from_config", "routing_dims_from_config",
    "__version__",
]
