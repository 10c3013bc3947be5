"""Transformers' own router top-k, the reference rows for plain softmax top-k routers: one forward with
``output_router_logits`` and each MoE layer's k largest logits. The tiny MoE's :func:`reference_routing`, the
doctor's fallback and the tests' stand-in engines all read routing from here.

Imports torch only when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["router_forward", "router_topk"]


def router_forward(
    model: Any, token_ids: Sequence[int], moe_layers: Sequence[int], *, device: str = "cpu"
) -> tuple[Any, dict[int, Any]]:
    """One transformers forward of ``token_ids``: the model output and each MoE layer's router logits.

    The logits are float32 torch tensors ``[tokens, experts]``, one per entry of ``moe_layers`` (the layers the
    model's ``router_logits`` come from, in order).
    """
    import torch

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = getattr(out, "router_logits", None)
    if logits is None or len(logits) != len(moe_layers):
        got = None if logits is None else len(logits)
        raise RuntimeError(f"the model returned {got} router_logits tensors for MoE layers {list(moe_layers)}")
    return out, {
        layer: lg.reshape(-1, lg.shape[-1])[: len(token_ids)].float()
        for layer, lg in zip(moe_layers, logits, strict=True)
    }


def router_topk(logits: dict[int, Any], num_layers: int, k: int) -> np.ndarray:
    """The reference routing: ``(tokens, num_layers, k)`` int64 ids of each MoE layer's k largest router logits.

    ``logits`` as :func:`router_forward` returns them; layers without a router (dense) stay 0, like the wire's.
    """
    import torch

    tokens = next(iter(logits.values())).shape[0] if logits else 0
    out = np.zeros((tokens, num_layers, k), dtype=np.int64)
    for layer, lg in logits.items():
        out[:, layer, :] = torch.topk(lg, k, dim=-1).indices.cpu().numpy()
    return out
