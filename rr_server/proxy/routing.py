"""Decode an upstream's routing strictly against ``/rr/info`` and re-encode it in the rr wire format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rr_client.codec import decode_meta_info, routing_meta_fields
from rr_client.errors import MissingRoutingError, RoutedExpertsError
from rr_client.info import RRInfo
from rr_server.proxy.errors import ProxyError

__all__ = ["validated_routing", "wire_fields", "ROUTING_KEYS"]

# every key an upstream may use for routing; stripped from answers that did not ask for it
ROUTING_KEYS = ("routed_experts", "output_routed_experts", "routed_experts_dtype", "routed_experts_shape",
                "routed_experts_format", "routed_experts_start")


def validated_routing(meta: Mapping[str, Any], info: RRInfo, *, rows: int, where: str, hint: str = "") -> np.ndarray:
    """The upstream's routing as a checked ``(rows, L, K)`` array, or a 502 naming what is wrong."""
    try:
        return decode_meta_info(
            meta, rows=rows, num_layers=info.num_hidden_layers, topk=info.topk,
            num_experts=info.num_experts, moe_layers=info.moe_layers,
        )
    except RoutedExpertsError as e:
        extra = f" ({hint})" if hint and isinstance(e, MissingRoutingError) else ""
        raise ProxyError(502, "malformed_routing",
                         f"upstream sent invalid routing for {where}: {type(e).__name__}: {e}{extra}") from None


def wire_fields(arr: np.ndarray, info: RRInfo, start: int) -> dict[str, Any]:
    """``meta_info`` routing fields of a validated array (rr wire format)."""
    return routing_meta_fields(arr, num_experts=info.num_experts, start=start)
