"""An upstream's routing, decoded from whatever format it sent and passed through the one full check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rr_client.codec import CheckedRouting, check_routing, decode_meta_info
from rr_client.errors import MissingRoutingError, RoutedExpertsError
from rr_client.info import RRInfo
from rr_server.proxy.errors import ProxyError

__all__ = ["checked_upstream_routing", "ROUTING_KEYS"]

# every key an upstream may use for routing; stripped from answers that did not ask for it
ROUTING_KEYS = ("routed_experts", "output_routed_experts", "routed_experts_dtype", "routed_experts_shape",
                "routed_experts_format", "routed_experts_start")


def checked_upstream_routing(
    meta: Mapping[str, Any], info: RRInfo, *, rows: int, start: int, drop_rows: int = 0, where: str, hint: str = ""
) -> CheckedRouting:
    """Parse the upstream's payload (SGLang int32 or vLLM ``.npy``), drop ``drop_rows`` leading rows, then check.

    ``drop_rows`` applies ``routed_experts_start`` for upstreams that return every row. A payload that
    fails is a 502 naming the problem: the sidecar never passes routing on unchecked.
    """
    try:
        arr = decode_meta_info(meta, num_layers=info.num_hidden_layers, topk=info.topk, validate=False)
        return check_routing(arr[drop_rows:], info, rows=rows, start=start)
    except RoutedExpertsError as e:
        extra = f" ({hint})" if hint and isinstance(e, MissingRoutingError) else ""
        raise ProxyError(502, "malformed_routing",
                         f"upstream sent invalid routing for {where}: {type(e).__name__}: {e}{extra}") from None
