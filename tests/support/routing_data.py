"""Synthetic but realistic routing for unit tests: distinct top-k ids per MoE row, zero dense rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rr_client import RRInfo
from rr_client.core.codec import CheckedRouting, check_routing


def make_routing(
    rows: int, layers: int, topk: int, num_experts: int, *, moe_layers: Sequence[int] | None = None, seed: int = 0
) -> np.ndarray:
    """``(rows, layers, topk)`` int32 ids: a random top-k *set* per MoE row, zeros in dense layers."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, layers, num_experts)), axis=-1)[..., :topk].astype(np.int32)
    if moe_layers is not None:
        dense = [i for i in range(layers) if i not in set(moe_layers)]
        ids[:, dense, :] = 0
    return ids


def checked_routing(info: RRInfo, rows: int, seed: int = 0, start: int = 0) -> CheckedRouting:
    """``rows`` rows of :func:`make_routing` in ``info``'s dims from token ``start``, through rr's one check."""
    ids = make_routing(rows, info.num_hidden_layers, info.topk, info.num_experts, moe_layers=info.moe_layers, seed=seed)
    return check_routing(ids, info, rows=rows, start=start)


def npy_payload(array: np.ndarray, *, num_experts: int) -> str:
    """Base64 ``.npy`` of ``array`` in the wire dtype, NOT checked (numpy's own writer): how a test sends a
    deliberately corrupt payload, or one the engines send, to the decoder and the check."""
    import io

    import pybase64

    dtype = np.uint8 if num_experts <= 256 else np.dtype("<u2")
    buf = io.BytesIO()
    np.lib.format.write_array(
        buf, np.ascontiguousarray(np.asarray(array).astype(dtype)), version=(1, 0), allow_pickle=False
    )
    return pybase64.b64encode(buf.getvalue()).decode("ascii")


def small_moe_info() -> RRInfo:
    """The server info of a small Qwen3-MoE (3 layers, layer 1 dense, 8 experts, top-2) that the store, ref and
    frame tests share: what a server rr patched would say in ``/rr/info``."""
    return dims_info(3, 8, 2, [0, 2])


def dims_info(
    layers: int,
    experts: int,
    topk: int,
    moe_layers: Sequence[int],
    *,
    engine: str = "test",
    engine_version: str = "0",
    **extra: Any,
) -> RRInfo:
    """The server info of a Qwen3-MoE with these routing dims (the other layers dense: its ``mlp_only_layers``), from
    rr's one builder as a server makes it; ``extra`` (e.g. ``model``, ``logprobs_mode``) lands in the info as-is."""
    dense = [i for i in range(layers) if i not in set(moe_layers)]
    cfg = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "mlp_only_layers": dense,
    }
    return RRInfo.from_hf_config(cfg, engine=engine, engine_version=engine_version, **extra)
