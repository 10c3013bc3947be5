"""Turn whatever SGLang hands the TokenizerManager (tensor, base64 int32 or rr .npy, list) into checked routing."""

from __future__ import annotations

from typing import Any

from rr_client.core.codec import CheckedRouting, check_payload, routing_meta_fields
from rr_client.core.info import RRInfo
from rr_server.serving.store import current_store

__all__ = ["checked_value", "wire_fields"]


def checked_value(value: Any, info: RRInfo, *, rows: int, start: int = 0, slice_start: bool = False) -> CheckedRouting:
    """One request's routing through rr's one door (:func:`rr_client.core.codec.check_payload`), checked once.

    ``value`` is SGLang's per-request routing: a ``torch.Tensor`` (BatchTokenIDOutput, and everything
    before 0.5.11), a base64 string of headerless int32 (detokenizer output from 0.5.11; rr's ``.npy`` from
    0.5.22, made by :mod:`rr_patches.sglang.detok`) or an int list. ``slice_start`` drops the first ``start``
    rows for versions that ignore ``routed_experts_start_len``. ``rows`` is what the request must carry
    (``prompt + completion - 1 - start``). Raises a typed RoutedExpertsError when it cannot be trusted.
    """
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("ascii")
    return check_payload(value, info, rows=rows, start=start, drop_rows=start if slice_start and start > 0 else 0)


def wire_fields(
    value: Any, info: RRInfo, *, rows: int, start: int = 0, slice_start: bool = False, fmt: str = "npy"
) -> dict[str, Any]:
    """rr ``meta_info`` fields of :func:`checked_value` in ``fmt`` (``"npy"``, rr's; ``"sglang"``, headerless int32)."""
    return routing_meta_fields(
        checked_value(value, info, rows=rows, start=start, slice_start=slice_start), fmt, store=current_store()
    )
