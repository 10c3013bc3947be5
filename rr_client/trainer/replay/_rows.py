"""The replayed rows of one ``replay_routing`` block: validated once, for every layer at once, then on the device.

Validation is the rows' one check (:mod:`rr_client.trainer.rows`): it runs where the rows live (CPU rows: no GPU
sync at all; GPU rows: one sync) and reads every layer's verdict with a single ``tolist()``: id range, repeated and
partly padded rows, rows used, and (for the audit) rows at layers no router consumes. The rows then move to each router's device once, as one contiguous ``[N, K]``
int64 tensor per layer (one non-blocking upload per device, from pinned memory), so the router hooks do no
validation, no transfer and no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rr_client.trainer.replay._routers import Router, router_device
from rr_client.trainer.rows import Reader, RowStats, upload

__all__ = ["LayerRows", "BlockRows", "RowStats", "readers_of", "upload", "place_rows"]


@dataclass
class LayerRows:
    """One MoE layer's replayed rows on its router's device.

    ``ids``: ``[N, K]`` int64, negatives clamped to 0; ``use``: ``[N, 1]`` bool, or None when every row is
    replayed (the hook then needs no ``where``); ``ids_sorted``: ``ids`` sorted along K, for the audit's set
    comparisons (None without the audit); ``n_use``: how many rows are replayed.
    """

    ids: torch.Tensor
    use: torch.Tensor | None
    ids_sorted: torch.Tensor | None
    n_use: int


@dataclass
class BlockRows:
    """Every MoE layer's rows for one block, and the layers whose rows no router consumes (audit only)."""

    n_rows: int
    layers: dict[int, LayerRows]
    unconsumed: list[int]


def readers_of(routers: list[Router]) -> list[Reader]:
    """The routers as the rows' readers (:class:`rr_client.trainer.rows.Reader`: their layer, experts, top-k;
    named ``layer <i>`` in messages), for the rows' one check."""
    return [Reader(r.layer, r.num_experts, r.top_k, f"layer {r.layer}") for r in routers]


def place_rows(
    st: RowStats, n_use: list[int], unconsumed: list[int], routers: list[Router], *, audit: bool = False
) -> BlockRows:
    """Each layer's rows on its router's device: one non-blocking upload per device of one layer-major buffer
    (ids, sorted ids with ``audit``, and the rows used), split on the device into contiguous ``[N, K]`` views."""
    n, m, k = (int(x) for x in st.sel.shape)
    nk = n * k
    parts = [st.sel.clamp_min(0).transpose(0, 1).reshape(m, nk)]
    if audit:
        parts.append(st.srt.transpose(0, 1).reshape(m, nk))
    parts.append(st.use.transpose(0, 1).long())
    packed = torch.cat(parts, dim=1)  # [M, NK (+ NK) + N] int64, contiguous
    placed: dict[torch.device, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = {}
    layers: dict[int, LayerRows] = {}
    for i, r in enumerate(routers):
        dev = router_device(r) or st.sel.device
        if dev not in placed:
            up = upload(packed, dev)
            placed[dev] = up.unbind(0), up.narrow(1, up.shape[1] - n, n).bool().unsqueeze(-1).unbind(0)
        rows_d, use_d = placed[dev]
        row = rows_d[i]
        layers[r.layer] = LayerRows(
            row.narrow(0, 0, nk).view(n, k),
            None if n_use[i] == n else use_d[i],
            row.narrow(0, nk, nk).view(n, k) if audit else None,
            n_use[i],
        )
    return BlockRows(n, layers, unconsumed)
