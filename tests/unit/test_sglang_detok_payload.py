"""rr_patches.sglang.detok.compact_payload: the container the 0.5.22+ detokenizer hands the TokenizerManager."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from rr_client.core.codec import decode_routed_experts
from rr_patches.sglang.detok import compact_payload


def test_uint8_npy_while_ids_fit_then_uint16() -> None:
    ids = torch.tensor([[[1, 7], [0, 0]], [[3, 2], [0, 0]]], dtype=torch.int32)
    arr = np.load(io.BytesIO(base64.b64decode(compact_payload(ids))))
    assert arr.dtype == np.uint8 and np.array_equal(arr, ids.numpy())
    wide = ids.clone()
    wide[0, 0, 0] = 299
    arr = np.load(io.BytesIO(base64.b64decode(compact_payload(wide))))
    assert arr.dtype == np.uint16 and int(arr[0, 0, 0]) == 299


def test_what_it_cannot_encode_goes_out_as_sglangs_int32() -> None:
    """Negative ids (or a non-3-D tensor) stay SGLang's headerless int32: the TokenizerManager's check names them."""
    bad = torch.tensor([[[1, -1]]], dtype=torch.int32)
    raw = base64.b64decode(compact_payload(bad))
    assert raw == bad.numpy().tobytes()
    flat = torch.arange(6, dtype=torch.int32)
    assert np.array_equal(decode_routed_experts(compact_payload(flat), num_layers=3, topk=2).ravel(), np.arange(6))
