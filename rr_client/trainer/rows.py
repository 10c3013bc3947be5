"""``ReplayRows``: the one torch-side form of replay input, and its one check.

Every trainer path (the Hugging Face hooks, TRL, verl, Megatron's feeder) turns what it was given into a
:class:`ReplayRows` (one constructor per source: :class:`rr_client.RoutingTensors`, :class:`rr_client.PackedRouting`,
verl's jagged batch, a raw ``[..., L, K]`` tensor with ``layers=`` and ``mask=``) and validates it with
:meth:`ReplayRows.check` against the routers that read it (:class:`Reader`): top-k width, expert-id range, repeated
ids, partly padded rows, layers the engine served dense, rows at layers no router reads, and (where the consumer
replays every token) coverage. The check runs on the rows' device and reads its verdicts with one ``tolist()``.

One layer-axis rule (:func:`axis_layers`): the ``L`` positions of the rows are absolute decoder layers, named by
``layers=`` (its length must equal the axis), else every decoder layer (``L`` = decoder layers), else the MoE layers
(``L`` = MoE layers), else an error. One meaning for a negative id: no row there (a pad). A token whose every id is
negative has no row; a ``[K]`` row whose ids are all negative has none at that layer; a row mixing negative and
valid ids is partly padded and refused. Pad rows (tokens without a row, where a layout or a feeder must write
experts) come from :func:`pad_ids`: ``K`` distinct ids strided over all experts by pad ordinal and rotated per
layer, so pad tokens per expert stay within one of even (no expert-parallel rank takes every pad).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rr_client.core.errors import (
    ArgumentTypeError,
    ConfigurationError,
    ExpertIdOutOfRangeError,
    MissingRoutingError,
    ShapeMismatchError,
    UnrecordedRoutingError,
)

__all__ = [
    "ReplayRows",
    "Reader",
    "RowStats",
    "axis_layers",
    "axis_positions",
    "pad_ids",
    "fill_pads",
    "last_tokens",
    "row_stats",
    "read_verdict",
    "upload",
    "without_samples",
]

_SIGNED_OR_BYTE = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: a device-side verdict from a constructor (nonzero = broken) and the error it means, built only when it fires
Pending = tuple[torch.Tensor, Callable[[], Exception]]


# ----------------------------------------------------------------------------------------------- small rules


def axis_layers(
    n_axis: int,
    layers: Sequence[int] | None = None,
    *,
    num_hidden_layers: int | None = None,
    moe_layers: Sequence[int] = (),
    extra: Sequence[int] = (),
    what: str = "routed_experts",
) -> list[int]:
    """The absolute decoder layer of each of the ``n_axis`` positions of a rows tensor's layer axis (the one rule).

    ``layers`` given: taken as is, and its length must be ``n_axis`` (rows are never mapped by position). Otherwise
    every decoder layer when ``n_axis == num_hidden_layers``, the MoE layers when ``n_axis == len(moe_layers)``,
    the MoE layers and ``extra`` (hash-routed layers) when that fits; anything else is a
    :class:`ShapeMismatchError` asking for ``layers=``."""
    if layers is not None:
        got = [int(x) for x in layers]
        if len(got) != n_axis:
            raise ShapeMismatchError(
                f"layers= names {len(got)} layers {got[:8]}{'...' if len(got) > 8 else ''} but "
                f"{what}'s layer axis has {n_axis} positions: rows are mapped by absolute "
                "layer, never by position; pass one layer per position"
            )
        if len(set(got)) != len(got) or any(x < 0 for x in got):
            raise ShapeMismatchError(f"layers= {got} must name distinct 0-based decoder layers")
        return got
    moe = [int(x) for x in moe_layers]
    if num_hidden_layers is not None and n_axis == num_hidden_layers:
        return list(range(num_hidden_layers))
    if moe and n_axis == len(moe):
        return moe
    if moe and extra and n_axis == len(moe) + len(extra):
        return sorted(set(moe) | {int(x) for x in extra})
    raise ShapeMismatchError(
        f"{what} has {n_axis} layers; the model has {num_hidden_layers} decoder layers, "
        f"{len(moe)} MoE layers ({moe}); pass layers="
    )


def axis_positions(axis: Sequence[int], readers: Sequence[Reader]) -> list[int]:
    """The position on a layer axis holding ``axis`` (absolute layers) each reader takes its rows from; a reader
    whose layer is not on the axis is refused (:class:`ShapeMismatchError`)."""
    pos = {int(layer): i for i, layer in enumerate(axis)}
    missing = [r.layer for r in readers if r.layer not in pos]
    if missing:
        raise ShapeMismatchError(f"routed_experts has no rows for MoE layers {missing} (layers={list(axis)})")
    return [pos[r.layer] for r in readers]


def pad_ids(ordinal: torch.Tensor, layers: Sequence[int], topk: int, num_experts: int | Sequence[int]) -> torch.Tensor:
    """Pad rows: ``[n]`` (or ``[n, L]``) pad ordinals -> ``[n, L, K]`` int64 expert ids on the ordinals' device,
    ``(ordinal * K + col + layer * K) % E``: K distinct ids, strided across all ``E`` experts by ordinal (pad tokens
    per expert within one of even) and rotated per absolute layer. ``num_experts``: one count, or one per layer."""
    counts = [int(num_experts)] * len(layers) if isinstance(num_experts, int) else [int(e) for e in num_experts]
    if len(counts) != len(layers):
        raise ShapeMismatchError(f"{len(counts)} expert counts for {len(layers)} layers")
    if counts and topk > min(counts):
        raise ShapeMismatchError(f"top-k {topk} exceeds the {min(counts)} experts: no row of distinct pad ids")
    dev = ordinal.device
    o = ordinal.long()
    if o.dim() == 1:
        o = o.unsqueeze(1)
    rot = torch.as_tensor([int(x) * topk for x in layers], dtype=torch.int64).to(dev)
    e = torch.as_tensor(counts, dtype=torch.int64).to(dev)
    ids = o.unsqueeze(-1) * topk + torch.arange(topk, device=dev) + rot.unsqueeze(-1)  # [n, L, K]
    return ids % e.unsqueeze(-1)


def fill_pads(
    rows: torch.Tensor, have: torch.Tensor, layers: Sequence[int], num_experts: int | Sequence[int]
) -> torch.Tensor:
    """``rows`` ``[..., L, K]`` as int64 with every row where ``have`` (``[...]`` bool, or ``[..., L]``) is False
    replaced by a :func:`pad_ids` row, ordinals counted in flattened token order (per layer for ``[..., L]``);
    vectorised, on the rows' device, no host read."""
    lead, (n_layers, k) = tuple(rows.shape[:-2]), tuple(rows.shape[-2:])
    h = have.to(rows.device).bool()
    per_layer = h.dim() == len(lead) + 1
    flat = h.reshape(-1, n_layers) if per_layer else h.reshape(-1)
    ordinal = flat.logical_not().long().cumsum(0) - 1
    pads = pad_ids(ordinal, layers, k, num_experts).reshape(*lead, n_layers, k)
    keep = h.unsqueeze(-1) if per_layer else h.unsqueeze(-1).unsqueeze(-1)
    return torch.where(keep, rows.long(), pads)


def without_samples(mask: torch.Tensor, replay: Sequence[bool], cu_seqlens: Any = None) -> torch.Tensor:
    """The one rule that takes samples out: ``mask`` with every entry of the samples whose ``replay`` is False off
    (bool: False; numbers: 0). Per leading row (``[B, ...]``, one flag per ``b``), or, with ``cu_seqlens``, by the
    packed samples' bounds over the flattened tokens (tokens after the last sample: off). ``mask`` itself when every
    sample replays. Rows (:meth:`ReplayRows.without`), a layout's routing mask, indexer picks and a loss mask all
    take masked samples out through it."""
    if all(replay):
        return mask
    keep = torch.as_tensor(list(replay), dtype=torch.bool)
    if cu_seqlens is None:
        if mask.dim() < 2 or keep.numel() != mask.shape[0]:
            raise ShapeMismatchError(
                f"{keep.numel()} replay flags for rows of leading shape {tuple(mask.shape)}: mask samples of a "
                "packed batch by its cu_seqlens (its PackedRouting), or pass samples= in the rows' order"
            )
        tok = keep.reshape(-1, *([1] * (mask.dim() - 1))).expand(tuple(mask.shape))
    else:
        cu = torch.as_tensor(cu_seqlens).long().cpu()
        if keep.numel() != cu.numel() - 1:
            raise ShapeMismatchError(f"{keep.numel()} replay flags for a batch of {cu.numel() - 1} samples")
        per = torch.repeat_interleave(keep, cu[1:] - cu[:-1])
        tok = torch.cat([per, per.new_zeros(mask.numel() - per.numel())]).reshape(tuple(mask.shape))
    tok = tok.to(mask.device)
    return mask & tok if mask.dtype == torch.bool else mask * tok.to(mask.dtype)


def last_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: each sample's last real token (the one no engine row exists for), from its attention mask."""
    real = attention_mask.bool()
    idx = torch.arange(real.shape[1], device=real.device).expand_as(real)
    last = torch.where(real, idx, torch.full_like(idx, -1)).amax(dim=1)
    return torch.zeros_like(real).scatter_(1, last.clamp_min(0).unsqueeze(1), (last >= 0).unsqueeze(1))


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


def _integer(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` if its dtype holds expert ids (wider unsigned types widened to int64); floats, bools refused."""
    if t.dtype in _SIGNED_OR_BYTE:
        return t
    if t.dtype in tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)):
        return t.to(torch.int64)
    raise ArgumentTypeError(
        f"{what} has dtype {t.dtype}: expert ids must be an integer tensor (uint8, int16, "
        "int32, int64); a float or bool tensor would be truncated to other experts, silently"
    )


# ----------------------------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Reader:
    """One router that reads the rows: the absolute decoder ``layer`` whose rows it takes, its expert count, its
    top-k and its ``name`` in messages (``"layer 3"``, ``"decoder layer 4 (chunk 0, decoder.layers.3.mlp.router)"``)."""

    layer: int
    num_experts: int
    topk: int
    name: str


@dataclass(frozen=True, eq=False)
class ReplayRows:
    """Replay input, one form for every trainer: the rows on a ``[b, s]`` token grid (packed THD: ``b = 1``).

    ``rows``: ``[b, s, L, K]`` integer expert ids, token-major; ``have``: ``[b, s]`` bool, the tokens with a row
    (the source's mask, less tokens whose every id is negative); ``layers``: the absolute decoder layer of each
    ``L`` position (:func:`axis_layers`); ``real``: the real tokens (None: unknown); ``need``: the tokens that must
    have a row where every token is replayed (real tokens but each sample's last; None: no coverage rule);
    ``cu_seqlens``: packed samples' bounds; ``shape``: the source's token shape (``(B, T)`` or ``(N,)``), which a
    mask, token or segment tensor beside the rows must have; ``segments``: the audit's token segments
    (:class:`rr_client.trainer.provenance.Segments`); ``stale`` / ``provenance``: per-sample flags where the
    source has them (:meth:`with_flags`). Constructors only restructure (no host read); :meth:`check` validates.
    """

    rows: torch.Tensor
    have: torch.Tensor
    layers: tuple[int, ...]
    real: torch.Tensor | None = None
    need: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    shape: tuple[int, ...] = ()
    segments: Any = None
    stale: torch.Tensor | None = None
    provenance: tuple[Any, ...] | None = None
    pending: tuple[Pending, ...] = field(default=(), repr=False)  #: constructor verdicts read with the check's

    def __post_init__(self) -> None:
        if self.rows.dim() != 4:
            raise ShapeMismatchError(f"rows must be [b, s, layers, topk], got {tuple(self.rows.shape)}")
        object.__setattr__(self, "rows", _integer(self.rows, "routed_experts"))
        object.__setattr__(self, "layers", tuple(axis_layers(int(self.rows.shape[2]), self.layers)))
        grid = tuple(self.rows.shape[:2])
        for name in ("have", "real", "need"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != grid:
                raise ShapeMismatchError(f"{name} {tuple(t.shape)} does not match the rows' [b, s] = {grid}")
        if not self.shape:
            object.__setattr__(self, "shape", grid)

    # -- views
    @property
    def topk(self) -> int:
        """The rows' width ``K``."""
        return int(self.rows.shape[-1])

    @property
    def device(self) -> torch.device:
        """Where the rows live (the check runs there)."""
        return self.rows.device

    @property
    def flat(self) -> torch.Tensor:
        """``[b * s, L, K]``: the rows in the order a batch-major router sees its tokens."""
        return self.rows.reshape(-1, *self.rows.shape[2:])

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> ReplayRows:
        """The same rows with every tensor on ``device``."""
        moved = {
            n: getattr(self, n).to(device, non_blocking=non_blocking)
            for n in ("rows", "have", "real", "need", "cu_seqlens", "stale")
            if getattr(self, n) is not None
        }
        return replace(self, **moved)

    def with_flags(self, *, stale: Any = None, provenance: Sequence[Any] | None = None) -> ReplayRows:
        """These rows with per-sample flags: ``stale`` (one bool per sample), ``provenance`` (one per sample)."""
        return replace(
            self,
            stale=None if stale is None else torch.as_tensor(stale, dtype=torch.bool),
            provenance=None if provenance is None else tuple(provenance),
        )

    def without(self, replay: Sequence[bool]) -> ReplayRows:
        """These rows with the tokens of the samples whose ``replay`` is False out of ``have`` and ``need`` (a
        consumer leaves them to the router; one that replays every token gives them pad rows)."""
        if all(replay):
            return self
        cu = self.cu_seqlens
        have = without_samples(self.have, replay, cu)
        return replace(self, have=have, need=None if self.need is None else without_samples(self.need, replay, cu))

    def positions(self, readers: Sequence[Reader]) -> list[int]:
        """The layer-axis position each reader takes its rows from (:func:`axis_positions`)."""
        return axis_positions(self.layers, readers)

    # -- the check
    def stats(
        self, readers: Sequence[Reader], *, spare: Sequence[int] | None = None, coverage: bool = False
    ) -> RowStats:
        """The device side of :meth:`check` (no host read): see :func:`row_stats`. ``spare``: axis layers no reader
        takes whose recorded rows are reported (default: none)."""
        cols = self.positions(readers)
        spare_pos = {layer: self.layers.index(layer) for layer in spare} if spare else None
        return row_stats(
            self.flat,
            self.have.reshape(-1),
            readers,
            cols,
            spare=spare_pos,
            need=self.need.reshape(-1) if coverage and self.need is not None else None,
            pending=self.pending,
            grid=tuple(self.rows.shape[:2]),
        )

    def check(
        self,
        readers: Sequence[Reader],
        *,
        spare: Sequence[int] | None = None,
        coverage: bool = False,
        refuse_spare: bool = False,
    ) -> tuple[RowStats, list[int], list[int]]:
        """Validate the rows for ``readers`` where they live, with one host read; ``(stats, rows used per reader,
        spare layers holding recorded rows)``. ``coverage``: every ``need`` token must have a row at every reader's
        layer (a consumer that replays every token); ``refuse_spare``: a spare layer holding recorded rows is a
        :class:`ShapeMismatchError` (a dense layer with rows: the layer axis is off)."""
        st = self.stats(readers, spare=spare, coverage=coverage)
        n_use, unconsumed = read_verdict(st)
        if refuse_spare and unconsumed:
            raise ShapeMismatchError(
                f"dense layer {unconsumed[0]} holds routing rows (layers {unconsumed} have "
                "recorded rows yet no router): the rows' layer axis does not match the model's "
                "MoE layers (a dense/MoE layer mismatch between engine and trainer)"
            )
        return st, n_use, unconsumed

    # -- constructors, one per source
    @classmethod
    def of(
        cls,
        source: Any,
        *,
        mask: Any = None,
        layers: Sequence[int] | None = None,
        attention_mask: Any = None,
        num_hidden_layers: int | None = None,
        moe_layers: Sequence[int] = (),
        extra: Sequence[int] = (),
    ) -> ReplayRows:
        """Whatever a trainer was given as :class:`ReplayRows`: a ReplayRows as is; a
        :class:`rr_client.PackedRouting` / :class:`rr_client.RoutingTensors` (``mask`` / ``layers`` override theirs);
        else a raw ``[..., L, K]`` tensor (:meth:`from_tensor`; the layer axis by :func:`axis_layers`)."""
        if isinstance(source, ReplayRows):
            if mask is not None or layers is not None or attention_mask is not None:
                raise ConfigurationError("ReplayRows already carry their mask and layers: pass neither again")
            return source
        if hasattr(source, "routing_cu_seqlens") and hasattr(source, "cu_seqlens"):
            return cls.from_packed(source, mask=mask, layers=layers)
        if hasattr(source, "routed_experts_mask") and hasattr(source, "attention_mask"):
            return cls.from_routing_tensors(source, mask=mask, layers=layers)
        if not isinstance(source, torch.Tensor) and not hasattr(source, "__array__"):
            raise ArgumentTypeError(
                f"routing must be RoutingTensors, PackedRouting, ReplayRows or a [..., layers, "
                f"topk] tensor, got {type(source).__name__}"
            )
        t = torch.as_tensor(source)
        if t.dim() < 3:
            raise ShapeMismatchError(f"routed_experts must be [..., L, K], got shape {tuple(t.shape)}")
        axis = axis_layers(
            int(t.shape[-2]), layers, num_hidden_layers=num_hidden_layers, moe_layers=moe_layers, extra=extra
        )
        return cls.from_tensor(t, layers=axis, mask=mask, attention_mask=attention_mask)

    @classmethod
    def from_tensor(
        cls, rows: Any, *, layers: Sequence[int], mask: Any = None, attention_mask: Any = None
    ) -> ReplayRows:
        """A raw ``[..., L, K]`` tensor (``[B, T, L, K]`` padded, ``[N, L, K]`` packed) whose layer axis holds
        ``layers``; ``mask`` (the leading shape): tokens with a row; ``attention_mask``: the real tokens (then a
        masked-out real token other than a sample's last must have a row where every token is replayed)."""
        t = _integer(torch.as_tensor(rows), "routed_experts")
        if t.dim() < 3:
            raise ShapeMismatchError(f"routed_experts must be [..., L, K], got shape {tuple(t.shape)}")
        lead = tuple(int(x) for x in t.shape[:-2])
        grid = (1, lead[0]) if len(lead) == 1 else (int(torch.Size(lead[:-1]).numel()), lead[-1])
        dev = t.device
        g = t.reshape(*grid, *t.shape[-2:])
        for name, m in (("mask", mask), ("attention_mask", attention_mask)):
            if m is not None and tuple(torch.as_tensor(m).shape) != lead:
                raise ShapeMismatchError(
                    f"{name} shape {tuple(torch.as_tensor(m).shape)} does not match routed_experts rows {lead}"
                )
        have = (
            upload(torch.as_tensor(mask), dev).bool().reshape(grid)
            if mask is not None
            else torch.ones(grid, dtype=torch.bool, device=dev)
        )
        have = have & _pad_token(g).logical_not()
        real = upload(torch.as_tensor(attention_mask), dev).bool().reshape(grid) if attention_mask is not None else None
        if mask is not None:
            r = real if real is not None else torch.ones(grid, dtype=torch.bool, device=dev)
            need = r & last_tokens(r).logical_not()
        else:
            need = have
        return cls(g, have, tuple(axis_layers(int(t.shape[-2]), layers)), real, need, shape=lead)

    @classmethod
    def from_routing_tensors(cls, rt: Any, *, mask: Any = None, layers: Sequence[int] | None = None) -> ReplayRows:
        """A padded :class:`rr_client.RoutingTensors` (token-major ``[B, T, L, K]`` or layer-major ``[L, B, T, K]``):
        its ``routed_experts_mask`` (or ``mask``), ``attention_mask`` and ``layers`` (or ``layers``)."""
        rows, b_s = torch.as_tensor(rt.routed_experts), tuple(rt.input_ids.shape)
        if rows.dim() != 4:
            raise ShapeMismatchError(f"routed_experts must be [B, T, L, K] or [L, B, T, K], got {tuple(rows.shape)}")
        if tuple(rows.shape[:2]) != b_s:
            if tuple(rows.shape[1:3]) != b_s:
                raise ShapeMismatchError(
                    f"routed_experts {tuple(rows.shape)} fits input_ids {b_s} neither token-major nor layer-major"
                )
            rows = rows.permute(1, 2, 0, 3)
        rows = _integer(rows, "routed_experts")
        dev = rows.device
        m = rt.routed_experts_mask if mask is None else torch.as_tensor(mask)
        if tuple(m.shape) != b_s:
            raise ShapeMismatchError(f"mask shape {tuple(m.shape)} does not match routed_experts rows {b_s}")
        real = upload(rt.attention_mask, dev).bool()
        have = upload(m, dev).bool() & _pad_token(rows).logical_not()
        axis = axis_layers(int(rows.shape[2]), rt.layers if layers is None else layers)
        return cls(rows, have, tuple(axis), real, real & last_tokens(real).logical_not(), shape=b_s)

    @classmethod
    def from_packed(cls, p: Any, *, mask: Any = None, layers: Sequence[int] | None = None) -> ReplayRows:
        """A packed :class:`rr_client.PackedRouting` on its token axis as a ``b = 1`` grid: rows of
        ``append_row=False`` moved to the token they route (vectorised), tokens after ``cu_seqlens[-1]`` not real."""
        rows = _integer(torch.as_tensor(p.routed_experts), "routed_experts")
        if rows.dim() != 3:
            raise ShapeMismatchError(f"packed routed_experts must be [N, L, K], got {tuple(rows.shape)}")
        n, dev = int(p.input_ids.shape[0]), rows.device
        m = p.routed_experts_mask if mask is None else torch.as_tensor(mask)
        if tuple(m.shape) != (int(rows.shape[0]),):
            raise ShapeMismatchError(
                f"mask shape {tuple(m.shape)} does not match routed_experts rows {(int(rows.shape[0]),)}"
            )
        m = upload(m, dev).bool()
        cu = upload(p.cu_seqlens, dev).long()
        if rows.shape[0] != n:  # append_row=False: sample i's rows rcu[i]..rcu[i+1] route tokens cu[i]..
            rcu = upload(p.routing_cu_seqlens, dev).long()
            r = torch.arange(int(rows.shape[0]), device=dev)
            b = int(rcu.numel()) - 1
            sample = torch.searchsorted(rcu.narrow(0, 1, b), r, right=True).clamp_max(max(b - 1, 0))
            inside = r < rcu.narrow(0, b, 1)  # pad rows (pad_to_multiple_of) route no sample's token
            tok = torch.where(
                inside, cu.index_select(0, sample) + r - rcu.index_select(0, sample), torch.full_like(r, n)
            )
            grid = rows.new_zeros((n + 1, *rows.shape[1:])).index_copy_(0, tok, rows).narrow(0, 0, n)
            have = torch.zeros(n + 1, dtype=torch.bool, device=dev).index_copy_(0, tok, m & inside).narrow(0, 0, n)
            rows, m = grid, have
        pos = torch.arange(n, device=dev)
        nb = int(cu.numel()) - 1  # slices of device tensors as narrow (no device guard)
        hi, lo = cu.narrow(0, 1, nb), cu.narrow(0, 0, nb)
        real = pos < cu.narrow(0, nb, 1)
        ends = torch.where(hi > lo, hi - 1, torch.full_like(hi, n))
        last = torch.zeros(n + 1, dtype=torch.bool, device=dev).index_fill_(0, ends, True).narrow(0, 0, n)
        have = m & _pad_token(rows).logical_not()
        axis = axis_layers(int(rows.shape[1]), p.layers if layers is None else layers)
        return cls(
            rows.unsqueeze(0),
            have.unsqueeze(0),
            tuple(axis),
            real.unsqueeze(0),
            (real & last.logical_not()).unsqueeze(0),
            cu,
            shape=(n,),
        )

    @classmethod
    def from_jagged(
        cls, routed: torch.Tensor, offsets: torch.Tensor, *, num_hidden_layers: int, moe_layers: Sequence[int]
    ) -> ReplayRows:
        """verl's micro-batch: a jagged nested ``[B, j, L, K]`` (or its ``[N, L, K]`` values) beside
        ``input_ids.offsets()``, zero rows where the rollout recorded nothing. A token has a row where any id is
        non-zero; in every sample the recorded rows must be a prefix of its tokens, and not empty (verdicts read
        with the check's one host read). Top-1 is refused: an unrecorded row cannot be told from expert 0."""
        values = routed.values() if routed.is_nested else routed
        if values.dim() != 3:
            raise ShapeMismatchError(
                f"routed_experts must be [tokens, layers, topk] per sample, got {tuple(values.shape)}"
            )
        n, n_axis, k = (int(s) for s in values.shape)
        if k == 1:
            raise ShapeMismatchError(
                "top-1 routing: an all-zero row (unrecorded) cannot be told from expert 0; rr "
                "refuses to replay verl's zero-padded layout for top-1 models"
            )
        values = _integer(values, "routed_experts")
        dev = values.device
        off = upload(offsets, dev).long()
        b = int(off.numel()) - 1
        recorded = (values != 0).flatten(1).any(dim=1)
        r = torch.arange(n, device=dev)
        sample = torch.searchsorted(off.narrow(0, 1, b), r, right=True).clamp_max(max(b - 1, 0))
        counts = torch.zeros(max(b, 1), dtype=torch.long, device=dev).index_add_(0, sample, recorded.long())
        pos = r - off.index_select(0, sample)
        prefix = pos < counts.index_select(0, sample)
        lengths = off.narrow(0, 1, b) - off.narrow(0, 0, b)
        counted = counts.narrow(0, 0, b)

        def count_error() -> Exception:
            return ShapeMismatchError(f"routed_experts has {n} rows but input_ids has {int(off[-1])} tokens")

        def hole_error() -> Exception:
            row = int((prefix != recorded).nonzero()[0, 0])
            i = int(sample[row])
            return UnrecordedRoutingError(
                f"micro-batch sample {i} ({int(off[i + 1] - off[i])} tokens): token {int(pos[row])} has an "
                f"all-zero routing row, yet {int(counts[i])} rows are recorded; verl's rows must cover a prefix of "
                "the sample (the rollout lost rows?)"
            )

        def empty_error() -> Exception:
            i = int(((counts[:b] == 0) & (lengths > 1)).nonzero()[0, 0])
            return MissingRoutingError(
                f"micro-batch sample {i} carries no routing rows (all zero): the rollout returned none for it "
                "(is actor_rollout_ref.rollout.enable_rollout_routing_replay=True?)"
            )

        pending = (
            ((off.narrow(0, b, 1) != n).any(), count_error),
            ((prefix != recorded).any(), hole_error),
            (((counted == 0) & (lengths > 1)).any(), empty_error),
        )
        axis = axis_layers(n_axis, num_hidden_layers=num_hidden_layers, moe_layers=moe_layers)
        return cls(
            values.unsqueeze(0), recorded.unsqueeze(0), tuple(axis), None, None, off, shape=(n,), pending=pending
        )


def _pad_token(rows: torch.Tensor) -> torch.Tensor:
    """``[..., L, K]`` -> ``[...]``: tokens whose every id is negative (a pad token: no row)."""
    if rows.dtype == torch.uint8:
        return torch.zeros(rows.shape[:-2], dtype=torch.bool, device=rows.device)
    return (rows < 0).flatten(-2).all(dim=-1)


# ----------------------------------------------------------------------------------------------- the one check


def _distinct(srt: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` sorted ids -> ``[...]``: no id repeated (``narrow``, not slicing: no device guard)."""
    k = srt.shape[-1]
    if k < 2:
        return torch.ones(srt.shape[:-1], dtype=torch.bool, device=srt.device)
    return (srt.narrow(-1, 1, k - 1) != srt.narrow(-1, 0, k - 1)).all(dim=-1)


def _recorded(rows: torch.Tensor) -> torch.Tensor:
    """``[N, ...]``: rows that look like recorded routing (no negative id, not all zero, no repeated id)."""
    srt = rows.sort(dim=-1).values
    return (rows >= 0).all(dim=-1) & _distinct(srt) & (rows != 0).any(dim=-1)


@dataclass
class RowStats:
    """The device side of the check, before its one host read (all on the rows' device).

    ``sel``: ``[N, M, K]`` int64 rows of the M readers' layers; ``srt``: sorted along K; ``use``: ``[N, M]`` rows
    replayed (a row there, none of its ids negative); ``stats``: one int64 vector holding every verdict;
    ``spare``: the spare layers whose recorded rows ``stats`` counts."""

    sel: torch.Tensor
    srt: torch.Tensor
    use: torch.Tensor
    stats: torch.Tensor
    spare: list[int]
    readers: list[Reader] = field(default_factory=list)
    grid: tuple[int, ...] = ()
    need: torch.Tensor | None = None
    pending: tuple[Pending, ...] = ()


def row_stats(
    flat: torch.Tensor,
    have: torch.Tensor | None,
    readers: Sequence[Reader],
    cols: Sequence[int],
    *,
    spare: dict[int, int] | None = None,
    need: torch.Tensor | None = None,
    pending: Sequence[Pending] = (),
    grid: tuple[int, ...] = (),
) -> RowStats:
    """Every verdict on ``flat`` (``[N, L_axis, K]``) for the readers at axis positions ``cols``, as device
    tensors, with no host read. ``have`` (``[N]`` bool, any device: moved to the rows'): tokens with a row;
    ``spare`` (layer -> axis position): layers no reader takes, whose recorded rows are counted; ``need``
    (``[N]``): tokens that must have a row at every reader's layer; ``pending``: constructor verdicts."""
    k = int(flat.shape[-1])
    readers = list(readers)
    for r in readers:
        if r.topk != k:
            raise ShapeMismatchError(
                f"{r.name}: rows are {k} experts wide, the router's top-k is {r.topk} (routed_experts has top-{k})"
            )
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        _integer(flat, "routed_experts")
    dev = flat.device
    sel = flat.index_select(1, upload(torch.tensor([int(c) for c in cols], dtype=torch.int64), dev)).long()
    neg = sel < 0
    use = neg.all(dim=-1).logical_not()  # [N, M]: a row at this layer (not all pads)
    h = None if have is None else upload(have, dev).bool()
    if h is not None:
        use &= h.unsqueeze(1)
    partial = use & neg.any(dim=-1)
    good = use & partial.logical_not()
    srt = sel.sort(dim=-1).values
    limit = upload(torch.tensor([r.num_experts for r in readers], dtype=torch.int64), dev)
    parts = [
        (good & (srt.select(-1, k - 1) >= limit)).any(dim=0),
        use.sum(dim=0),
        (good & _distinct(srt).logical_not()).any(dim=0),
        partial.any(dim=0),
        (use & (sel != 0).any(dim=-1)).any(dim=0),
    ]
    spare_items = list((spare or {}).items())
    if spare_items:
        cols_s = upload(torch.tensor([p for _, p in spare_items], dtype=torch.int64), dev)
        rec = _recorded(flat.index_select(1, cols_s))
        parts.append((rec & h.unsqueeze(1) if h is not None else rec).any(dim=0))
    nd = None if need is None else upload(need, dev).bool()
    if nd is not None:
        parts.append((nd & use.all(dim=1).logical_not()).sum().reshape(1))
    parts += [v.to(dev).reshape(1) for v, _ in pending]
    return RowStats(
        sel,
        srt,
        use,
        torch.cat([p.long() for p in parts]),
        [layer for layer, _ in spare_items],
        readers,
        grid or (1, int(flat.shape[0])),
        nd,
        tuple(pending),
    )


def _where(st: RowStats, flat_index: int) -> str:
    """``"sample b, position t"`` of a flat token index on the rows' grid."""
    s = st.grid[-1]
    return f"sample {flat_index // s}, position {flat_index % s}"


def read_verdict(st: RowStats) -> tuple[list[int], list[int]]:
    """The check's one host read: raise the first typed error its verdicts hold; else ``(rows used per reader,
    spare layers holding recorded rows)``."""
    vals = st.stats.tolist()
    m = len(st.readers)
    over, n_use, dup, partial, nonzero = (vals[i * m : (i + 1) * m] for i in range(5))
    rest = vals[5 * m :]
    tail, rest = rest[: len(st.spare)], rest[len(st.spare) :]
    miss = rest.pop(0) if st.need is not None else 0
    for fired, (_, error) in zip(rest, st.pending):
        if fired:
            raise error()
    for i, r in enumerate(st.readers):
        if partial[i]:
            bad = (st.use[:, i] & (st.sel[:, i] < 0).any(dim=-1)).nonzero()[0, 0]
            raise UnrecordedRoutingError(
                f"{r.name}: the row of {_where(st, int(bad))} is partly padded ({st.sel[bad, i].tolist()}: pad ids "
                "(negative) beside expert ids); a row holds K expert ids or none (all negative, or masked out)"
            )
        if over[i]:
            chosen = st.sel[:, i][st.use[:, i]]
            raise ExpertIdOutOfRangeError(
                f"{r.name}: expert ids span [{int(chosen.min())}, {int(chosen.max())}], "
                f"outside [0, {r.num_experts}): the router has {r.num_experts} experts"
            )
        if n_use[i] >= 2 and not nonzero[i]:
            raise ShapeMismatchError(
                f"{r.name}: all {n_use[i]} rows are zero: the engine served this layer dense while the model builds "
                "it as MoE (their MoE layer maps differ: moe_layer_freq, first_k_dense_replace, mlp_only_layers); "
                "refusing to replay expert 0 for every token"
            )
        if dup[i]:
            raise UnrecordedRoutingError(
                f"{r.name}: a row repeats an expert id (the token would reach fewer experts; zero padding without "
                "its mask?); pass mask=routed_experts_mask or use pad_experts='distinct'"
            )
    fed = [i for i in range(m) if n_use[i]]
    for i, r in enumerate(st.readers):
        if fed and not n_use[i]:
            other = st.readers[fed[0]]
            raise ShapeMismatchError(
                f"{r.name}: no token has a row at layer {r.layer} (all ids negative) while {other.name} has "
                f"{n_use[fed[0]]}: the engine served this layer dense while the model builds it as MoE"
            )
    if miss:
        assert st.need is not None
        bad = int((st.need & st.use.all(dim=1).logical_not()).nonzero()[0, 0])
        raise MissingRoutingError(
            f"{miss} real tokens have no routing row (first: {_where(st, bad)}); replay "
            "would route them with pad rows: resend the full prompt's routing (no "
            "routed_experts_start offset)"
        )
    return [int(x) for x in n_use], [layer for layer, hit in zip(st.spare, tail) if hit]
