"""Compact encoding in SGLang's detokenizer process (0.5.22+, where SGLang loads plugins there).

SGLang's detokenizer base64-encodes each request's int32 routing tensor and ships the string to the
TokenizerManager, which rr then transcodes. From 0.5.22 rr's plugin also loads in the detokenizer, so the
detokenizer encodes rr's ``.npy`` (uint8 while every id < 256, else uint16) straight from the tensor: a
quarter of the bytes to encode and to move over zmq, and the TokenizerManager decodes a compact payload.
The TokenizerManager still runs the one full check per request (rows, start, ids) before anything is sent;
this step only changes the container. Any tensor it cannot encode goes out as SGLang's own int32 base64.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pybase64

__all__ = ["DETOK_PATH", "DETOK_METHOD", "around_handle_batch_token_id_out", "compact_payload"]

logger = logging.getLogger("rr.sglang")
DETOK_PATH = "sglang.srt.managers.detokenizer_manager.DetokenizerManager"
DETOK_METHOD = "handle_batch_token_id_out"


def compact_payload(tensor: Any) -> str:
    """A narrower container for one request's ``(rows, layers, topk)`` ids between SGLang's processes.

    Base64 ``.npy`` (numpy's own writer) in uint8 when every id is in [0, 256), uint16 in [0, 65536); SGLang's
    int32 base64 otherwise. Not rr's wire encoder: nothing is checked here, the TokenizerManager checks the
    decoded rows once (:func:`rr_patches.sglang.convert.checked_value`) and encodes them for the client.
    """
    arr = tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
    if arr.ndim == 3 and arr.dtype.kind in "iu" and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo >= 0 and hi < 65536:
            buf = io.BytesIO()
            np.lib.format.write_array(
                buf,
                np.ascontiguousarray(arr, dtype=np.uint8 if hi < 256 else "<u2"),
                version=(1, 0),
                allow_pickle=False,
            )
            return pybase64.b64encode(buf.getbuffer()).decode("ascii")
        logger.debug("rr: detokenizer leaves routing as SGLang's int32: ids in [%d, %d]", lo, hi)
    return pybase64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


def around_handle_batch_token_id_out(original: Callable[..., Any], self: Any, recv_obj: Any) -> Any:
    """AROUND hook: SGLang's own output without its int32 encode, then rr's compact payload per request."""
    tensors = getattr(recv_obj, "routed_experts", None)
    if not tensors:
        return original(self, recv_obj)
    recv_obj.routed_experts = None  # SGLang skips its own base64 of the int32 tensors
    try:
        out = original(self, recv_obj)
    finally:
        recv_obj.routed_experts = tensors
    out.routed_experts = [compact_payload(t) if t is not None else None for t in tensors]
    return out
