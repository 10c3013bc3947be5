"""Routing agreement: which (token, layer) top-k expert-id *sets* two routings share (order inside a set ignored).

The one implementation: the trainer metric (:func:`rr_client.trainer.metrics.routing_agreement`), ``rr-server doctor``,
the demo and the tests all count with it. numpy only; torch tensors are accepted (copied to the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rr_client.core.errors import ConfigurationError

__all__ = ["count_matches", "routing_agreement", "set_matches"]


def _ids(x: Any) -> np.ndarray:
    """Expert ids (or a mask) as a numpy array; a torch tensor is detached and copied to the CPU."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def set_matches(a: Any, b: Any, *, layers: Sequence[int] | None = None) -> np.ndarray:
    """Bools ``[...]``: True where the top-k id sets on the last axis of ``a`` and ``b`` are equal.

    ``a`` and ``b``: ``[..., L, K]`` expert ids of the same shape, so the result is ``[..., L]`` (or ``[..., K]``
    rows of one layer: ``[...]``). ``layers``: positions of the layer axis (``-2``) to keep; with an absolute layer
    axis pass the MoE layers (dense layers are zero on both sides and would count as agreeing).
    """
    x, y = _ids(a), _ids(b)
    if x.shape != y.shape:
        raise ConfigurationError(f"routing shapes differ: {x.shape} vs {y.shape}")
    if layers is not None:
        idx = list(layers)
        x, y = x[..., idx, :], y[..., idx, :]
    return np.all(np.sort(x.astype(np.int64), axis=-1) == np.sort(y.astype(np.int64), axis=-1), axis=-1)


def count_matches(a: Any, b: Any, *, layers: Sequence[int] | None = None) -> tuple[int, int]:
    """``(equal, total)`` (row, layer) top-k sets, over ``layers`` (see :func:`set_matches`)."""
    same = set_matches(a, b, layers=layers)
    return int(same.sum()), int(same.size)


def routing_agreement(own: Any, replayed: Any, mask: Any = None, *, layers: Sequence[int] | None = None) -> float:
    """Share of (token, layer) cells whose top-k id *sets* are equal (order inside a set does not matter).

    ``own`` and ``replayed``: ``[..., L, K]`` expert ids (e.g. what ``record_routing`` saw vs. the rollout's);
    ``mask``: ``[...]`` rows to count (e.g. ``routed_experts_mask`` & response); ``layers``: positions of the
    layer axis to count (pass the MoE layers with an absolute layer axis: dense layers are zero on both sides).
    """
    same = set_matches(own, replayed, layers=layers)
    if mask is not None:
        m = _ids(mask).astype(bool)
        if m.shape != same.shape[:-1]:
            raise ConfigurationError(f"mask {m.shape} does not match routing rows {same.shape[:-1]}")
        same = same[m]
    if same.size == 0:
        raise ConfigurationError("no (token, layer) cells selected")
    return float(same.mean())
