"""rr's rows on a rank to this rank's Megatron replay targets: one ``[local_tokens, topk]`` int64 tensor per router.

From a :class:`rr_client.RoutingTensors` (padded ``[b, s]``), a :class:`rr_client.PackedRouting` (THD) or a raw
``[b, s, layers, topk]`` tensor: each router takes its own layer's rows (``layer_number``, never list position;
dense layers have no router), the rows are checked for every router at once (width = top-k, ids in range, no
repeated id, a row for every real token but each sample's last), tokens without a row (pads, each sample's last
token) get distinct valid experts, then the batch is laid out as Megatron lays out its tokens: context-parallel
slice, sequence-parallel shard, sequence-first, on the router's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rr_client.core.errors import (ArgumentTypeError, ConfigurationError, ExpertIdOutOfRangeError, MissingRoutingError,
                              ShapeMismatchError, UnrecordedRoutingError)
from rr_client.integrations.megatron._layout import (cp_thd_index, cp_zigzag_index, distinct_pad_row, last_tokens,
                                                     sequence_first, sp_shard)
from rr_client.integrations.megatron._routers import MegatronRouter, find_routers
from rr_client.trainer.layouts import PackedRouting, RoutingTensors

__all__ = ["Parallel", "Feed", "Batch", "MtpPolicy", "router_targets", "feed", "as_batch", "parallel_from_state"]

MtpPolicy = Literal["auto", "rows", "skip"]


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the layouts that change which tokens its routers see (Megatron's parallel state)."""

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False


def parallel_from_state(routers: Sequence[MegatronRouter]) -> Parallel:
    """This rank's :class:`Parallel` from ``megatron.core.parallel_state`` (all 1 / 0 when it is not initialized);
    sequence parallelism from the routers' ``TransformerConfig``."""
    from megatron.core import parallel_state as ps

    sp = any(bool(getattr(r.module.config, "sequence_parallel", False)) for r in routers)
    if not ps.model_parallel_is_initialized():
        return Parallel(sequence_parallel=sp)
    return Parallel(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                    ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), sp)


@dataclass(frozen=True)
class Batch:
    """Rows on a ``[b, s]`` token grid: ``rows`` ``[b, s, L, K]``; ``have`` where a row exists; ``need`` where
    one must (real tokens but each sample's last); ``layers`` the 0-based layer of each ``L`` position;
    ``cu_seqlens`` the packed samples' bounds (THD, ``b = 1``) or None."""

    rows: torch.Tensor
    have: torch.Tensor
    need: torch.Tensor
    layers: list[int]
    cu_seqlens: torch.Tensor | None = None


def _packed_grid(p: PackedRouting) -> Batch:
    """A :class:`PackedRouting` on its token axis as a ``b = 1`` grid (rows of ``append_row=False`` moved to the
    token they route)."""
    n = int(p.input_ids.shape[0])
    cu = p.cu_seqlens.long().cpu()
    rows = p.routed_experts
    dev = rows.device
    mask = p.routed_experts_mask.to(dev).bool()
    if rows.shape[0] != n:  # append_row=False: sample i's rows rcu[i]..rcu[i+1] route tokens cu[i]..
        rcu = p.routing_cu_seqlens.long().cpu()
        grid = torch.zeros((n, *rows.shape[1:]), dtype=rows.dtype, device=dev)
        have = torch.zeros(n, dtype=torch.bool, device=dev)
        for i in range(cu.numel() - 1):
            r0, r1, t0 = int(rcu[i]), int(rcu[i + 1]), int(cu[i])
            grid[t0:t0 + r1 - r0], have[t0:t0 + r1 - r0] = rows[r0:r1], mask[r0:r1]
        rows, mask = grid, have
    real = torch.zeros(n, dtype=torch.bool, device=dev)
    real[: int(cu[-1])] = True
    last = torch.zeros(n, dtype=torch.bool, device=dev)
    ends = cu[1:][cu[1:] > cu[:-1]] - 1
    last[ends.to(dev)] = True
    return Batch(rows.unsqueeze(0), mask.unsqueeze(0), (real & ~last).unsqueeze(0), list(p.layers), cu)


def as_batch(routing: Any, *, mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             layers: Sequence[int] | None = None) -> Batch:
    """``routing`` (RoutingTensors, PackedRouting or a ``[b, s, L, K]`` tensor) as a :class:`Batch`."""
    if isinstance(routing, PackedRouting):
        return _packed_grid(routing)
    if isinstance(routing, RoutingTensors):
        rows, b_s = routing.routed_experts, tuple(routing.input_ids.shape)
        if tuple(rows.shape[:2]) != b_s:
            if tuple(rows.shape[1:3]) != b_s:
                raise ShapeMismatchError(f"routed_experts {tuple(rows.shape)} fits input_ids {b_s} neither "
                                         "token-major nor layer-major")
            rows = rows.permute(1, 2, 0, 3)
        real = routing.attention_mask.to(rows.device).bool()
        return Batch(rows, routing.routed_experts_mask.to(rows.device).bool(), real & ~last_tokens(real),
                     list(routing.layers))
    if not isinstance(routing, torch.Tensor):
        raise ArgumentTypeError(f"routing must be RoutingTensors, PackedRouting or a [b, s, layers, topk] tensor, "
                                f"got {type(routing).__name__}")
    if routing.dim() != 4:
        raise ShapeMismatchError(f"routing tensor must be [b, s, layers, topk], got {tuple(routing.shape)}")
    if layers is None:
        raise ConfigurationError("a routing tensor needs layers= (the 0-based decoder layer of each layer position)")
    shape = tuple(routing.shape[:2])
    for name, m in (("mask", mask), ("attention_mask", attention_mask)):
        if m is not None and tuple(m.shape) != shape:
            raise ShapeMismatchError(f"{name} {tuple(m.shape)} does not match the rows' [b, s] = {shape}")
    dev = routing.device
    have = mask.to(dev).bool() if mask is not None else torch.ones(shape, dtype=torch.bool, device=dev)
    real = attention_mask.to(dev).bool() if attention_mask is not None else \
        torch.ones(shape, dtype=torch.bool, device=dev)
    need = real & ~last_tokens(real) if mask is not None else have
    return Batch(routing, have, need, [int(x) for x in layers])


@dataclass
class Feed:
    """One micro-batch's targets: ``targets`` (router module -> ``[local_tokens, topk]`` int64 on its device), the
    MTP routers left to the model on purpose (``left``), the local token count, and ``have`` (``[local_tokens]``
    bool on the rows' device, the router's token order: tokens with a rollout row; the others are pads given
    distinct experts). The layout runs where the rows are; each router's targets then move to its device once."""

    targets: dict[Any, torch.Tensor]
    left: list[MegatronRouter] = field(default_factory=list)
    tokens: int = 0
    have: torch.Tensor | None = None
    batch: int = 1  #: the micro-batch's ``b``: the router sees ``[tokens // batch, batch]`` (sequence-first)


def _plan(routers: Sequence[MegatronRouter], layers: list[int], mtp: MtpPolicy) -> tuple[list[MegatronRouter],
                                                                                       list[int], list[MegatronRouter]]:
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
            raise ShapeMismatchError(f"{r.describe()} reads layer {r.row_layer} of the rows, which has no {what}; "
                                     f"the rows hold layers {layers[:8]}{'...' if len(layers) > 8 else ''}")
        take.append(r)
        cols.append(col)
    return take, cols, left


def _check(sel: torch.Tensor, batch: Batch, routers: Sequence[MegatronRouter]) -> None:
    """Refuse rows Megatron would take silently: wrong width, missing rows, ids out of range, repeated ids."""
    k = int(sel.shape[-1])
    for r in routers:
        if r.topk != k:
            raise ShapeMismatchError(f"{r.describe()}: rows are {k} experts wide, the router's top-k is {r.topk}")
    miss = batch.need & ~batch.have
    if bool(miss.any()):
        b, t = (int(x) for x in miss.nonzero()[0])
        raise MissingRoutingError(f"{int(miss.sum())} real tokens have no routing row (first: sample {b}, position "
                                  f"{t}); Megatron would route them with rows of other tokens or none: resend "
                                  "the full prompt's routing (no routed_experts_start offset)")
    rows = sel[batch.have]  # [n, M, K]
    if rows.numel() == 0:
        return
    srt = rows.sort(dim=-1).values
    limit = torch.tensor([r.num_experts for r in routers], device=sel.device)
    low, high = srt[..., 0] < 0, srt[..., -1] >= limit
    dup = (srt[..., 1:] == srt[..., :-1]).any(dim=-1) if k > 1 else torch.zeros_like(low)
    verdict = torch.stack([low.any(0), high.any(0), dup.any(0)]).tolist()
    for i, r in enumerate(routers):
        if verdict[0][i] or verdict[1][i]:
            col = rows[:, i]
            raise ExpertIdOutOfRangeError(f"{r.describe()}: expert ids span [{int(col.min())}, {int(col.max())}], "
                                          f"the router has {r.num_experts} experts")
        if verdict[2][i]:
            raise UnrecordedRoutingError(f"{r.describe()}: a row repeats an expert id (Megatron would route the "
                                         "token to fewer experts, silently); pad rows need the routing mask")


def _local(t: torch.Tensor, batch: Batch, par: Parallel, cu_seqlens_padded: Any) -> torch.Tensor:
    """``[b, s, ...]`` to this rank's tokens, sequence-first: CP slice (zigzag, or per packed sample), SP shard."""
    s = int(t.shape[1])
    if par.cp_size > 1:
        if batch.cu_seqlens is not None:
            bounds = cu_seqlens_padded if cu_seqlens_padded is not None else \
                torch.cat([batch.cu_seqlens[:-1], torch.tensor([s])])
            idx = cp_thd_index(bounds, s, par.cp_size, par.cp_rank)
        else:
            idx = cp_zigzag_index(s, par.cp_size, par.cp_rank)
        t = t.index_select(1, idx.to(t.device))
    if par.sequence_parallel and par.tp_size > 1:
        t = t[:, sp_shard(int(t.shape[1]), par.tp_size, par.tp_rank)]
    return sequence_first(t)


def _to_padded(batch: Batch, cu_padded: torch.Tensor) -> Batch:
    """A packed batch moved onto Megatron's per-sample padded THD axis (sample i from ``cu_padded[i]``)."""
    cu = batch.cu_seqlens
    assert cu is not None
    dev = batch.rows.device
    if cu_padded.numel() != cu.numel():
        raise ShapeMismatchError(f"cu_seqlens_padded has {cu_padded.numel() - 1} samples, the rows "
                                 f"{cu.numel() - 1}")
    n = int(cu_padded[-1])
    lengths, padded = cu[1:] - cu[:-1], cu_padded[1:] - cu_padded[:-1]
    if bool((padded < lengths).any()):
        raise ShapeMismatchError(f"cu_seqlens_padded {cu_padded.tolist()} is shorter than the samples "
                                 f"{cu.tolist()}")
    src = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])])
    dst = torch.cat([torch.arange(int(a), int(a) + int(ln)) for a, ln in zip(cu_padded[:-1], lengths)])
    src, dst = src.to(dev), dst.to(dev)
    rows = torch.zeros((1, n, *batch.rows.shape[2:]), dtype=batch.rows.dtype, device=dev)
    have, need = torch.zeros(1, n, dtype=torch.bool, device=dev), torch.zeros(1, n, dtype=torch.bool, device=dev)
    rows[0, dst], have[0, dst], need[0, dst] = batch.rows[0, src], batch.have[0, src], batch.need[0, src]
    return Batch(rows, have, need, batch.layers, cu_padded)


def feed(routers: Sequence[MegatronRouter], routing: Any, *, parallel: Parallel | None = None, mtp: MtpPolicy = "auto",
         mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
         layers: Sequence[int] | None = None, cu_seqlens_padded: Any = None) -> Feed:
    """This rank's :class:`Feed` for ``routers`` from ``routing`` (see :func:`router_targets`)."""
    batch = as_batch(routing, mask=mask, attention_mask=attention_mask, layers=layers)
    par = parallel if parallel is not None else parallel_from_state(routers)
    if cu_seqlens_padded is not None:
        if batch.cu_seqlens is None:
            raise ConfigurationError("cu_seqlens_padded applies to packed (THD) routing only")
        cu_seqlens_padded = torch.as_tensor(cu_seqlens_padded).long().flatten().cpu()
        if not torch.equal(cu_seqlens_padded, batch.cu_seqlens):
            batch = _to_padded(batch, cu_seqlens_padded)
    take, cols, left = _plan(routers, batch.layers, mtp)
    have = _local(batch.have[..., None], batch, par, cu_seqlens_padded)[:, 0]
    if not take:
        return Feed({}, left, int(have.numel()), have, int(batch.rows.shape[0]))
    dev = batch.rows.device
    sel = batch.rows.index_select(2, torch.tensor(cols, device=dev)).long()  # [b, s, M, K]
    _check(sel, batch, take)
    k = int(sel.shape[-1])
    pads = torch.stack([distinct_pad_row(k, r.num_experts) for r in take]).to(dev)  # [M, K]
    sel = torch.where(batch.have[..., None, None], sel, pads)
    local = _local(sel, batch, par, cu_seqlens_padded)  # [tokens, M, K]
    targets = {r.module: local[:, i].contiguous().to(r.device) for i, r in enumerate(take)}
    return Feed(targets, left, int(local.shape[0]), have, int(batch.rows.shape[0]))


def router_targets(model_chunks: Any, routing: Any, *, cp_size: int | None = None, cp_rank: int | None = None,
                   tp_size: int | None = None, tp_rank: int | None = None, sequence_parallel: bool | None = None,
                   cu_seqlens_padded: Any = None, mtp: MtpPolicy = "auto", mask: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None,
                   layers: Sequence[int] | None = None) -> dict[Any, torch.Tensor]:
    """This rank's replay targets: ``{TopKRouter: [local_tokens, topk] int64 on its device}`` for every router of
    ``model_chunks`` that takes rows, from ``routing`` (RoutingTensors, PackedRouting, or a ``[b, s, L, K]`` tensor
    with ``layers`` and optional ``mask`` / ``attention_mask``). Parallel sizes and ranks default to Megatron's
    ``parallel_state``; ``cu_seqlens_padded``: the packed samples' padded bounds Megatron's THD batch uses;
    ``mtp``: MTP routers take rows (``"rows"``), are left to the model (``"skip"``), or take them when the rows
    hold their layers (``"auto"``)."""
    routers = find_routers(model_chunks)
    state = parallel_from_state(routers)
    par = Parallel(cp_size if cp_size is not None else state.cp_size, cp_rank if cp_rank is not None else state.cp_rank,
                   tp_size if tp_size is not None else state.tp_size, tp_rank if tp_rank is not None else state.tp_rank,
                   sequence_parallel if sequence_parallel is not None else state.sequence_parallel)
    return feed(routers, routing, parallel=par, mtp=mtp, mask=mask, attention_mask=attention_mask, layers=layers,
                cu_seqlens_padded=cu_seqlens_padded).targets
