"""The replayed rows of one ``replay_routing`` block: validated once, for every layer at once, then on the device.

Validation runs where the rows live (CPU rows: no GPU sync at all; GPU rows: one sync) and reads every
layer's verdict with a single ``tolist()``: id range, repeated ids, rows used, and (for the audit) rows at
layers no router consumes. The rows then move to each router's device once, as one contiguous ``[N, K]``
int64 tensor per layer (one non-blocking upload per device, from pinned memory), so the router hooks do no
validation, no transfer and no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rr_client.core.errors import ExpertIdOutOfRangeError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.trainer.replay._routers import Router, router_device

__all__ = ["LayerRows", "BlockRows", "RowStats", "layer_positions", "row_stats", "check_rows", "upload", "place_rows",
           "prepare_rows"]


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


def layer_positions(
    n_axis: int, n_hidden: int, routers: list[Router], layers: Sequence[int] | None, extra: Sequence[int] = ()
) -> tuple[dict[int, int], list[int]]:
    """Absolute decoder layer -> position on the layer axis of the replayed tensor; and the axis' layers."""
    moe = [r.layer for r in routers]
    if layers is None:
        if n_axis == n_hidden:
            layers = list(range(n_hidden))
        elif n_axis == len(moe):
            layers = moe
        elif n_axis == len(moe) + len(extra):
            layers = sorted(set(moe) | set(extra))
        else:
            raise ShapeMismatchError(
                f"routed_experts has {n_axis} layers; the model has {n_hidden} decoder layers, {len(moe)} MoE "
                f"layers ({moe}); pass layers=")
    layers = [int(x) for x in layers]
    if len(layers) != n_axis:
        raise ShapeMismatchError(f"layers lists {len(layers)} layers but routed_experts has {n_axis}")
    missing = [layer for layer in moe if layer not in layers]
    if missing:
        raise ShapeMismatchError(f"routed_experts has no rows for MoE layers {missing} (layers={layers})")
    return {layer: layers.index(layer) for layer in moe}, layers


def _recorded(rows: torch.Tensor) -> torch.Tensor:
    """``[N, ...]``: rows that look like recorded routing (no negative id, not all zero, no repeated id)."""
    srt = rows.sort(dim=-1).values
    return (rows >= 0).all(dim=-1) & _distinct(srt) & (rows != 0).any(dim=-1)


def _distinct(srt: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` sorted ids -> ``[...]``: no id repeated (``narrow``, not slicing: no device guard)."""
    k = srt.shape[-1]
    if k < 2:
        return torch.ones(srt.shape[:-1], dtype=torch.bool, device=srt.device)
    return (srt.narrow(-1, 1, k - 1) != srt.narrow(-1, 0, k - 1)).all(dim=-1)


@dataclass
class RowStats:
    """The device side of a block's validation, before its one host read (all on the rows' device).

    ``sel``: ``[N, M, K]`` int64 rows of the M MoE layers; ``srt``: sorted along K; ``use``: ``[N, M]``
    replayed rows; ``stats``: one int64 vector holding every layer's verdict (out of range, rows used,
    repeated ids, and for the audit the spare layers holding recorded rows)."""

    sel: torch.Tensor
    srt: torch.Tensor
    use: torch.Tensor
    stats: torch.Tensor
    spare: list[int]


def row_stats(
    flat: torch.Tensor,
    mask: torch.Tensor | None,
    routers: list[Router],
    pos: dict[int, int],
    unconsumed_positions: dict[int, int] | None,
) -> RowStats:
    """Every layer's verdict on ``flat`` (``[N, L_axis, K]``) as device tensors, with no host read.

    ``mask`` (``[N]`` bool, any device: it is moved to ``flat``'s) keeps the model's own choice where
    False; rows with a negative id do too. ``unconsumed_positions`` (layer -> axis position) are the axis
    layers no router reads: the audit reports those holding recorded rows."""
    k = int(flat.shape[-1])
    cols = upload(torch.tensor([pos[r.layer] for r in routers]), flat.device)
    sel = flat.index_select(1, cols).long()  # [N, M, K]
    use = (sel >= 0).all(dim=-1)  # [N, M]
    m = None if mask is None else upload(mask, flat.device).bool()
    if m is not None:
        use &= m.unsqueeze(1)
    srt = sel.sort(dim=-1).values
    limit = upload(torch.tensor([r.num_experts for r in routers]), flat.device)
    parts = [((srt.select(-1, k - 1) >= limit) & use).any(dim=0), use.sum(dim=0),
             (_distinct(srt).logical_not() & use).any(dim=0)]
    spare = list((unconsumed_positions or {}).items())
    if spare:
        rec = _recorded(flat.index_select(1, upload(torch.tensor([p for _, p in spare]), flat.device)))
        parts.append((rec & m.unsqueeze(1) if m is not None else rec).any(dim=0))
    return RowStats(sel, srt, use, torch.cat([p.long() for p in parts]), [layer for layer, _ in spare])


def check_rows(st: RowStats, routers: list[Router]) -> tuple[list[int], list[int]]:
    """The block's one host read: raise on out-of-range or repeated ids; ``(rows used per layer, unconsumed
    layers)``."""
    stats = st.stats.tolist()
    m = len(routers)
    over, n_use, dup, tail = stats[:m], stats[m:2 * m], stats[2 * m:3 * m], stats[3 * m:]
    for i, r in enumerate(routers):
        if over[i]:
            chosen = st.sel.select(1, i)[st.use.select(1, i)]
            raise ExpertIdOutOfRangeError(
                f"layer {r.layer}: replayed expert ids span [{int(chosen.min())}, {int(chosen.max())}], "
                f"model has {r.num_experts} experts")
        if dup[i]:
            raise UnrecordedRoutingError(
                f"layer {r.layer}: a replayed row repeats an expert id (zero padding without its mask?); "
                "pass mask=routed_experts_mask or use pad_experts='distinct'")
    return [int(x) for x in n_use], [layer for layer, hit in zip(st.spare, tail) if hit]


def upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev`` in one copy that does not block the host: from pinned memory and ``non_blocking`` when it
    goes from the host to a GPU (the caching host allocator keeps the pinned buffer until the copy ran)."""
    if t.device == dev:
        return t
    if dev.type == "cpu":
        return t.to(dev)
    if t.device.type == "cpu" and dev.type == "cuda" and torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def place_rows(st: RowStats, n_use: list[int], unconsumed: list[int], routers: list[Router], *,
               audit: bool = False) -> BlockRows:
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
        layers[r.layer] = LayerRows(row.narrow(0, 0, nk).view(n, k), None if n_use[i] == n else use_d[i],
                                    row.narrow(0, nk, nk).view(n, k) if audit else None, n_use[i])
    return BlockRows(n, layers, unconsumed)


def prepare_rows(flat: torch.Tensor, mask: torch.Tensor | None, routers: list[Router], pos: dict[int, int],
                 unconsumed_positions: dict[int, int] | None, *, audit: bool = False) -> BlockRows:
    """Validate ``flat`` for every router at once (one host read, where the rows live), then place each
    layer's rows on its router's device: :func:`row_stats`, :func:`check_rows`, :func:`place_rows`."""
    st = row_stats(flat, mask, routers, pos, unconsumed_positions)
    n_use, unconsumed = check_rows(st, routers)
    return place_rows(st, n_use, unconsumed, routers, audit=audit)
