"""Exact row validation (id range, distinct ids per MoE row, zero dense rows): C fast path, numpy fallback."""

from __future__ import annotations

import numpy as np

try:  # built by setup.py when a compiler is present
    import rr_client.core._rowcheck_c as _rowcheck_c  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised when the extension is absent
    _rowcheck_c = None

OK, OUT_OF_RANGE, NOT_DISTINCT, DENSE_NONZERO = 0, 1, 2, 3
HAVE_C = _rowcheck_c is not None


def _first(mask: np.ndarray) -> tuple[int, int]:
    """(row, layer) of the first True in a (rows, L) mask."""
    idx = int(np.argmax(mask.reshape(-1)))
    return divmod(idx, mask.shape[1])


def check_rows_numpy(arr: np.ndarray, num_experts: int, moe_mask: np.ndarray) -> tuple[int, int, int]:
    """Reference implementation: returns ``(status, row, layer)``; ``row = layer = -1`` when OK."""
    rows, layers, k = arr.shape
    if arr.size and int(arr.max()) >= num_experts:
        r, l = _first((arr >= num_experts).any(axis=2))
        return OUT_OF_RANGE, r, l
    dense = ~moe_mask
    dup = np.zeros((rows, layers), dtype=bool)
    for a in range(1, k):
        for b in range(a):
            dup |= arr[:, :, a] == arr[:, :, b]
    dup &= moe_mask[None, :]
    nonzero_dense = (arr != 0).any(axis=2) & dense[None, :]
    # report whichever comes first in (row, layer) order, as the C scan does
    bad = dup | nonzero_dense
    if not bad.any():
        return OK, -1, -1
    r, l = _first(bad)
    return (NOT_DISTINCT if moe_mask[l] else DENSE_NONZERO), r, l


def check_rows(arr: np.ndarray, num_experts: int, moe_mask: np.ndarray, *, use_c: bool = True) -> tuple[int, int, int]:
    """Validate a C-contiguous uint8/uint16 ``(rows, L, K)`` array; see :func:`check_rows_numpy`."""
    if use_c and _rowcheck_c is not None and arr.dtype.itemsize in (1, 2) and arr.flags.c_contiguous:
        rows, layers, k = arr.shape
        mask = np.ascontiguousarray(moe_mask, dtype=np.uint8)
        st, r, l = _rowcheck_c.check_rows(
            arr.reshape(-1).view(np.uint8), rows, layers, k, arr.dtype.itemsize, num_experts, mask.tobytes()
        )
        return int(st), int(r), int(l)
    return check_rows_numpy(arr, num_experts, moe_mask)
