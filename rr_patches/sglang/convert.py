"""Turn whatever SGLang hands the TokenizerManager (tensor, base64 int32, list) into rr's wire fields."""

from __future__ import annotations

from typing import Any

from rr_client.codec import check_routing, decode_routed_experts, routing_meta_fields
from rr_client.errors import ShapeMismatchError
from rr_client.info import RRInfo

__all__ = ["wire_fields"]


def wire_fields(value: Any, info: RRInfo, *, rows: int, start: int = 0, slice_start: bool = False,
                fmt: str = "npy") -> dict[str, Any]:
    """rr ``meta_info`` fields for one request's routing; typed RoutedExpertsError when it cannot be trusted.

    ``value`` is SGLang's per-request routing: a ``torch.Tensor`` (BatchTokenIDOutput, and everything
    before 0.5.11), a base64 string of headerless int32 (detokenizer output from 0.5.11) or an int list.
    ``slice_start`` drops the first ``start`` rows for versions that ignore ``routed_experts_start_len``.
    ``rows`` is what the request must carry (``prompt + completion - 1 - start``). ``fmt``: the
    ``routed_experts_format`` to encode in (``"npy"``, rr's; ``"sglang"``, SGLang's headerless int32).
    """
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("ascii")
    arr = decode_routed_experts(value, num_layers=info.num_hidden_layers, topk=info.topk, validate=False)
    if start < 0:
        raise ShapeMismatchError(f"routed_experts_start must be >= 0, got {start}")
    if slice_start and start:
        if start > arr.shape[0]:
            raise ShapeMismatchError(f"routed_experts_start={start} exceeds the {arr.shape[0]} rows returned")
        arr = arr[start:]
    return routing_meta_fields(check_routing(arr, info, rows=rows, start=start), fmt)
