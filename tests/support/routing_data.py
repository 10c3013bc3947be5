"""Synthetic but realistic routing for unit tests: distinct top-k ids per MoE row, zero dense rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
