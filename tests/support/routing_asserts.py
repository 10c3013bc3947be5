"""Test-only routing asserts: a failing comparison names its first differing (row, layer) and both id sets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rr_client.core.agreement import set_matches

__all__ = ["assert_routing_sets_equal"]


def assert_routing_sets_equal(got: np.ndarray, ref: np.ndarray, layers: Sequence[int] | None = None) -> None:
    """Raise AssertionError naming the first differing (row, layer) when top-k sets differ (``layers``: all)."""
    if got.shape != ref.shape:
        raise AssertionError(f"shape mismatch: got {got.shape}, reference {ref.shape}")
    layer_list = list(range(got.shape[1])) if layers is None else list(layers)
    bad = np.argwhere(~set_matches(got, ref, layers=layer_list))
    if bad.size:
        row, li = (int(x) for x in bad[0])
        layer = layer_list[li]
        raise AssertionError(
            f"{len(bad)} of {got.shape[0] * len(layer_list)} (row, layer) top-k sets differ; first at row {row}, "
            f"layer {layer}: got {sorted(got[row, layer].tolist())}, expected {sorted(ref[row, layer].tolist())}"
        )
