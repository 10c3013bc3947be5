"""Turn whatever SGLang hands the TokenizerManager (tensor, base64 int32, list) into rr's wire fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rr_client.codec import decode_routed_experts, routing_meta_fields
from rr_client.errors import RoutedExpertsError, ShapeMismatchError
from rr_client.hf_config import moe_layers_from_config, routing_dims_from_config

__all__ = ["Dims", "dims_from_hf_config", "wire_fields", "error_fields"]


@dataclass(frozen=True)
class Dims:
    """Routing shape of the served model: every payload is checked against it."""

    num_layers: int
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]


def dims_from_hf_config(cfg: Mapping[str, Any]) -> Dims:
    """Routing dimensions from an HF ``config.json`` dict (text_config aware)."""
    layers, experts, topk = routing_dims_from_config(cfg)
    return Dims(layers, experts, topk, tuple(moe_layers_from_config(cfg)))


def wire_fields(value: Any, dims: Dims, *, start: int = 0, slice_start: bool = False) -> dict[str, Any]:
    """rr ``meta_info`` fields for one request's routing; typed RoutedExpertsError when it cannot be trusted.

    ``value`` is SGLang's per-request routing: a ``torch.Tensor`` (BatchTokenIDOutput, and everything
    before 0.5.11), a base64 string of headerless int32 (detokenizer output from 0.5.11) or an int list.
    ``slice_start`` drops the first ``start`` rows for versions that ignore ``routed_experts_start_len``.
    """
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("ascii")
    arr = decode_routed_experts(value, num_layers=dims.num_layers, topk=dims.topk, validate=False)
    if start < 0:
        raise ShapeMismatchError(f"routed_experts_start must be >= 0, got {start}")
    if slice_start and start:
        if start > arr.shape[0]:
            raise ShapeMismatchError(f"routed_experts_start={start} exceeds the {arr.shape[0]} rows returned")
        arr = arr[start:]
    return routing_meta_fields(arr, num_experts=dims.num_experts, start=start)


def error_fields(exc: RoutedExpertsError) -> dict[str, Any]:
    """What an answer carries instead of routing the patch refused to forward."""
    return {"routed_experts": None, "routed_experts_error": f"{type(exc).__name__}: {exc}"}
