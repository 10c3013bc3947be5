"""rr's rows on a rank to this rank's Megatron replay targets: one ``[local_tokens, topk]`` int64 tensor per router.

From a :class:`rr_client.RoutingTensors` (padded ``[b, s]``), a :class:`rr_client.PackedRouting` (THD) or a raw
``[b, s, layers, topk]`` tensor: each router takes its own layer's rows (``layer_number``, never list position;
dense layers have no router), the rows are checked for every router at once by the rows' one check
(:meth:`rr_client.trainer.rows.ReplayRows.check`: width = top-k, integer ids in range, no repeated id, no partly
padded row, no layer served dense, a row for every real token but each sample's last), the batch is laid out as
Megatron lays out its tokens (context-parallel slice, sequence-parallel shard, sequence-first), and tokens without
a row (pads, each sample's last token) get pad rows spread over all experts in the router's token order
(:func:`rr_client.trainer.rows.pad_ids`), numbered on across a replay's micro-batches (:class:`PadClock`), then
move to the routers' device in one pinned, non-blocking upload per device (:func:`upload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from rr_client.core.errors import ArgumentTypeError, ConfigurationError, ShapeMismatchError
from rr_client.integrations.megatron._layout import cp_thd_index, cp_zigzag_index, sequence_first, sp_shard
from rr_client.integrations.megatron._routers import MegatronRouter, find_routers
from rr_client.trainer.rows import Reader, ReplayRows, pad_ids

__all__ = [
    "Parallel",
    "Feed",
    "Batch",
    "MtpPolicy",
    "PadClock",
    "router_targets",
    "feed",
    "as_batch",
    "parallel_from_state",
    "upload",
]

MtpPolicy = Literal["auto", "rows", "skip"]


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the layouts that change which tokens its routers see (Megatron's parallel state)."""

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False

    @property
    def shard(self) -> int:
        """This rank's index among the ranks whose routers see other tokens of one micro-batch (context-parallel
        slices, sequence-parallel shards); tensor-parallel ranks without sequence parallelism see the same tokens
        and must route alike, so they share one."""
        tp = self.tp_size if self.sequence_parallel else 1
        return self.cp_rank * tp + (self.tp_rank if self.sequence_parallel else 0)


class PadClock:
    """Each router's next pad ordinal (a device counter), so one replay's pads number on across micro-batches and
    steps: any run of consecutive ordinals puts pad tokens on every expert within one of even
    (:func:`rr_client.trainer.rows.pad_ids`), where ordinals that restart at 0 for every micro-batch load the
    first experts of the cycle with every micro-batch's few pads."""

    def __init__(self) -> None:
        self.next: dict[Any, torch.Tensor] = {}  #: router module -> 0-d int64: its next pad ordinal

    def start(self, modules: Sequence[Any], first: int, device: torch.device) -> torch.Tensor:
        """``[M]`` int64 on ``device``: each module's next ordinal (``first`` for a module not seen yet)."""
        zero = torch.full((), first, dtype=torch.int64, device=device)
        return torch.stack([self.next.get(m, zero).to(device) for m in modules])

    def advance(self, modules: Sequence[Any], after: torch.Tensor) -> None:
        """Each module's next ordinal is ``after`` (``[M]``, on the device: no host read)."""
        for m, n in zip(modules, after):
            self.next[m] = n


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a host tensor goes to an accelerator from pinned memory, non-blocking (an upload from
    pageable memory makes CUDA synchronize the stream first); a tensor already there is returned as it is."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cpu":
        return t.to(device)
    if t.device.type == "cpu" and torch.cuda.is_available() and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def parallel_from_state(routers: Sequence[MegatronRouter]) -> Parallel:
    """This rank's :class:`Parallel` from ``megatron.core.parallel_state`` (all 1 / 0 when it is not initialized);
    sequence parallelism from the routers' ``TransformerConfig``."""
    from megatron.core import parallel_state as ps

    sp = any(bool(getattr(r.module.config, "sequence_parallel", False)) for r in routers)
    if not ps.model_parallel_is_initialized():
        return Parallel(sequence_parallel=sp)
    return Parallel(
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        sp,
    )


#: the feeder's batch is the rows' one form (kept as a name for the feeder's callers)
Batch = ReplayRows


def as_batch(
    routing: Any,
    *,
    mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
) -> ReplayRows:
    """``routing`` (RoutingTensors, PackedRouting, ReplayRows or a ``[b, s, L, K]`` tensor with ``layers``) as
    :class:`rr_client.trainer.rows.ReplayRows` on a ``[b, s]`` grid (its one constructor per source)."""
    if isinstance(routing, torch.Tensor):
        if routing.dim() != 4:
            raise ShapeMismatchError(f"routing tensor must be [b, s, layers, topk], got {tuple(routing.shape)}")
        if layers is None:
            raise ConfigurationError(
                "a routing tensor needs layers= (the 0-based decoder layer of each layer position)"
            )
    elif not isinstance(routing, ReplayRows) and not hasattr(routing, "routed_experts"):
        raise ArgumentTypeError(
            f"routing must be RoutingTensors, PackedRouting, ReplayRows or a [b, s, layers, "
            f"topk] tensor, got {type(routing).__name__}"
        )
    return ReplayRows.of(routing, mask=mask, attention_mask=attention_mask, layers=layers)


@dataclass
class Feed:
    """One micro-batch's targets: ``targets`` (router module -> ``[local_tokens, topk]`` int64 on its device), the
    MTP routers left to the model on purpose (``left``), the local token count, and ``have`` (``[local_tokens]``
    bool on the rows' device, the router's token order: tokens with a rollout row; the others are pads given
    distinct experts; on the routers' device when they share one). The layout runs where the rows are; each
    device's routers' targets then move there in one upload."""

    targets: dict[Any, torch.Tensor]
    left: list[MegatronRouter] = field(default_factory=list)
    tokens: int = 0
    have: torch.Tensor | None = None
    batch: int = 1  #: the micro-batch's ``b``: the router sees ``[tokens // batch, batch]`` (sequence-first)
    segments: torch.Tensor | None = None  #: ``[local_tokens]`` segment codes laid out as ``have`` (-1: none)


def _plan(
    routers: Sequence[MegatronRouter], layers: list[int], mtp: MtpPolicy
) -> tuple[list[MegatronRouter], list[int], list[MegatronRouter]]:
    """The routers that take rows with their position on the rows' layer axis, and the MTP routers left."""
    if mtp not in ("auto", "rows", "skip"):
        raise ConfigurationError(f"mtp must be 'auto', 'rows' or 'skip', got {mtp!r}")
    pos = {layer: i for i, layer in enumerate(layers)}
    take, cols, left = [], [], []
    for r in routers:
        col = pos.get(r.row_layer)
        if r.mtp and (mtp == "skip" or (mtp == "auto" and col is None)):
            left.append(r)
            continue
        if col is None:
            what = "MTP rows (mtp='rows')" if r.mtp else "rows"
            raise ShapeMismatchError(
                f"{r.describe()} reads layer {r.row_layer} of the rows, which has no {what}; "
                f"the rows hold layers {layers[:8]}{'...' if len(layers) > 8 else ''}"
            )
        take.append(r)
        cols.append(col)
    return take, cols, left


def _local(t: torch.Tensor, batch: Batch, par: Parallel, cu_seqlens_padded: Any) -> torch.Tensor:
    """``[b, s, ...]`` to this rank's tokens, sequence-first: CP slice (zigzag, or per packed sample), SP shard."""
    s = int(t.shape[1])
    if par.cp_size > 1:
        if batch.cu_seqlens is not None:
            bounds = (
                cu_seqlens_padded
                if cu_seqlens_padded is not None
                else torch.cat([batch.cu_seqlens.long().cpu()[:-1], torch.tensor([s])])
            )
            idx = cp_thd_index(bounds, s, par.cp_size, par.cp_rank)
        else:
            idx = cp_zigzag_index(s, par.cp_size, par.cp_rank)
        t = t.index_select(1, idx.to(t.device))
    if par.sequence_parallel and par.tp_size > 1:
        t = t[:, sp_shard(int(t.shape[1]), par.tp_size, par.tp_rank)]
    return sequence_first(t)


def _to_padded(batch: ReplayRows, cu_padded: torch.Tensor) -> ReplayRows:
    """A packed batch moved onto Megatron's per-sample padded THD axis (sample i from ``cu_padded[i]``)."""
    assert batch.cu_seqlens is not None
    cu = batch.cu_seqlens.long().cpu()
    dev = batch.rows.device
    if cu_padded.numel() != cu.numel():
        raise ShapeMismatchError(f"cu_seqlens_padded has {cu_padded.numel() - 1} samples, the rows {cu.numel() - 1}")
    n = int(cu_padded[-1])
    lengths, padded = cu[1:] - cu[:-1], cu_padded[1:] - cu_padded[:-1]
    if bool((padded < lengths).any()):
        raise ShapeMismatchError(f"cu_seqlens_padded {cu_padded.tolist()} is shorter than the samples {cu.tolist()}")
    src = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])])
    dst = torch.cat([torch.arange(int(a), int(a) + int(ln)) for a, ln in zip(cu_padded[:-1], lengths)])
    src, dst = src.to(dev), dst.to(dev)

    def move(t: torch.Tensor | None, fill: int = 0) -> torch.Tensor | None:
        if t is None:
            return None
        out = t.new_full((1, n, *t.shape[2:]), fill)
        out[0, dst.to(t.device)] = t[0, src.to(t.device)]
        return out

    codes = batch.segments if isinstance(batch.segments, torch.Tensor) else None
    return replace(
        batch,
        rows=move(batch.rows),
        have=move(batch.have),
        real=move(batch.real),
        need=move(batch.need),
        cu_seqlens=cu_padded,
        shape=(n,),
        segments=move(codes, -1) if codes is not None else batch.segments,
    )


def _segment_codes(segments: Any, batch: ReplayRows) -> torch.Tensor:
    """``segments`` (a :class:`rr_client.trainer.provenance.Segments` or its codes) as ``[b, s]`` codes on the rows'
    grid (``have``'s), on the rows' device (-1: no segment)."""
    codes = torch.as_tensor(getattr(segments, "rows", segments))
    if codes.is_floating_point() or codes.numel() != batch.have.numel():
        raise ShapeMismatchError(
            f"segments has {tuple(codes.shape)} {codes.dtype} codes, the rows' token grid is "
            f"{tuple(batch.have.shape)}: one integer code per row, laid out like the rows"
        )
    return codes.reshape(batch.have.shape).long().to(batch.have.device)


def feed(
    routers: Sequence[MegatronRouter],
    routing: Any,
    *,
    parallel: Parallel | None = None,
    mtp: MtpPolicy = "auto",
    mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    cu_seqlens_padded: Any = None,
    segments: Any = None,
    pads: PadClock | None = None,
) -> Feed:
    """This rank's :class:`Feed` for ``routers`` from ``routing`` (see :func:`router_targets`): the rows' one check
    (:meth:`rr_client.trainer.rows.ReplayRows.check`, every token covered), the layout, then pad rows
    (:func:`rr_client.trainer.rows.pad_ids`) for the tokens without one, numbered in the router's token order on
    from ``pads`` (a replay's :class:`PadClock`; None: from this rank's :attr:`Parallel.shard`, so the ranks of
    one micro-batch start apart), then each device's routers' targets uploaded once (pinned, non-blocking), and
    ``have`` / ``segments`` (laid out as ``have``; given as ``[b, s]`` codes or a ``Segments``) too when every
    router sits on one device."""
    batch = as_batch(routing, mask=mask, attention_mask=attention_mask, layers=layers)
    if segments is not None:
        batch = replace(batch, segments=_segment_codes(segments, batch))
    par = parallel if parallel is not None else parallel_from_state(routers)
    if cu_seqlens_padded is not None:
        if batch.cu_seqlens is None:
            raise ConfigurationError("cu_seqlens_padded applies to packed (THD) routing only")
        cu_seqlens_padded = torch.as_tensor(cu_seqlens_padded).long().flatten().cpu()
        if not torch.equal(cu_seqlens_padded, batch.cu_seqlens.long().cpu()):
            batch = _to_padded(batch, cu_seqlens_padded)
    take, _, left = _plan(routers, list(batch.layers), mtp)
    have = _local(batch.have[..., None], batch, par, cu_seqlens_padded)[:, 0]
    seg = _local(batch.segments[..., None], batch, par, cu_seqlens_padded)[:, 0] if segments is not None else None
    if not take:
        return Feed({}, left, int(have.numel()), have, int(batch.rows.shape[0]), seg)
    readers = [Reader(r.row_layer, r.num_experts, r.topk, r.describe()) for r in take]
    st, _, _ = batch.check(readers, coverage=True)
    b, s = (int(x) for x in batch.rows.shape[:2])
    m, k = len(take), batch.topk
    local = _local(st.sel.view(b, s, m, k), batch, par, cu_seqlens_padded)  # [tokens, M, K]
    use = _local(st.use.view(b, s, m), batch, par, cu_seqlens_padded)  # [tokens, M]
    clock, mods = (pads if pads is not None else PadClock()), [r.module for r in take]
    start = clock.start(mods, par.shard, use.device)
    missing = use.logical_not().long()
    ordinal = missing.cumsum(0) - 1 + start  # each router's pads, in its token order, on from its last micro-batch
    clock.advance(mods, start + missing.sum(0))
    fill = pad_ids(ordinal, [r.layer for r in readers], k, [r.num_experts for r in readers])
    local = torch.where(use.unsqueeze(-1), local, fill)
    targets: dict[Any, torch.Tensor] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, r in enumerate(take):
        by_device.setdefault(r.device, []).append(i)
    for dev, cols in by_device.items():  # each router's rows to its own device only, one upload per device
        block = upload(local[:, cols].permute(1, 0, 2).contiguous(), dev)
        targets.update(zip([take[i].module for i in cols], block.unbind(0)))
    if len(by_device) == 1:
        (dev,) = by_device
        have, seg = upload(have, dev), (upload(seg, dev) if seg is not None else None)
    return Feed(targets, left, int(local.shape[0]), have, b, seg)


def router_targets(
    model_chunks: Any,
    routing: Any,
    *,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    sequence_parallel: bool | None = None,
    cu_seqlens_padded: Any = None,
    mtp: MtpPolicy = "auto",
    mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
) -> dict[Any, torch.Tensor]:
    """This rank's replay targets: ``{TopKRouter: [local_tokens, topk] int64 on its device}`` for every router of
    ``model_chunks`` that takes rows, from ``routing`` (RoutingTensors, PackedRouting, or a ``[b, s, L, K]`` tensor
    with ``layers`` and optional ``mask`` / ``attention_mask``). Parallel sizes and ranks default to Megatron's
    ``parallel_state``; ``cu_seqlens_padded``: the packed samples' padded bounds Megatron's THD batch uses;
    ``mtp``: MTP routers take rows (``"rows"``), are left to the model (``"skip"``), or take them when the rows
    hold their layers (``"auto"``)."""
    routers = find_routers(model_chunks)
    state = parallel_from_state(routers)
    par = Parallel(
        cp_size if cp_size is not None else state.cp_size,
        cp_rank if cp_rank is not None else state.cp_rank,
        tp_size if tp_size is not None else state.tp_size,
        tp_rank if tp_rank is not None else state.tp_rank,
        sequence_parallel if sequence_parallel is not None else state.sequence_parallel,
    )
    return feed(
        routers,
        routing,
        parallel=par,
        mtp=mtp,
        mask=mask,
        attention_mask=attention_mask,
        layers=layers,
        cu_seqlens_padded=cu_seqlens_padded,
    ).targets
