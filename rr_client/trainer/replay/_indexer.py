"""``replay_indexer``: force the engine's sparse-attention indexer picks (DeepSeek-V3.2-style DSA) in a transformers
model's forward, so every replayed token's attention reads exactly the positions it read in the rollout.

transformers' DSA indexers (``DeepseekV32Indexer``, ``GlmMoeDsaIndexer``) return ``[B, S, index_topk]`` int32 key
positions, which the attention scatters into its mask (eager / SDPA) or hands to the sparse kernel. A forward hook
replaces the rows of replayed tokens with the engine's; the rest keep the model's own. Cost rules as for expert
replay: the rows are checked once when the block opens (one host read), moved to the model's device once, and the
hooks never sync. With ``audit=True`` the audit observes what the attention consumes, downstream of rr's hook: the
attention function the family's attention module looks up in transformers' registry (``ALL_ATTENTION_FUNCTIONS``,
read per call) is wrapped for the block, and for each replayed row it checks that the keys the attention's mask
leaves open (eager / SDPA) or the ``indices`` it hands the sparse kernel are exactly the engine's picks. It reports
the share of replayed rows the attention consumed exactly (``r3/indexer/applied_share``) and the share the model's
own indexer picked too (``r3/indexer/agreement``), per layer as well; an attention that never ran, or a replayed row
it did not consume (something between rr's hook and the attention changed the picks), is a :class:`ReplayError`
when the block exits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from rr_client.core.errors import (
    ArgumentTypeError,
    IndexerPositionError,
    ReplayError,
    ShapeMismatchError,
    UnrecordedRoutingError,
    UnsupportedModelError,
)
from rr_client.trainer.audit import LayerCounts, layer_keys
from rr_client.trainer.replay.phase import DeviceTally

__all__ = [
    "replay_indexer",
    "find_indexers",
    "count_indexers",
    "INDEXER_CLASSES",
    "REFUSED_INDEXERS",
]

#: transformers indexers whose output is ``[B, S, index_topk]`` token positions, read by the attention as they are
INDEXER_CLASSES = ("DeepseekV32Indexer", "GlmMoeDsaIndexer")
#: indexers rr refuses, with the reason
REFUSED_INDEXERS = {
    "DeepseekV4Indexer": "it picks among compressed KV entries (compress_rate tokens each), not token positions, "
    "and rr's indexer rows are token positions",
    "Glm5NextTextIndexer": "it pools keys (index_kpool) before its pick and widens the pick afterwards: the engine's "
    "positions are not what its attention reads",
}


def _is_indexer(m: nn.Module) -> bool:
    """Whether ``m`` is a sparse-attention indexer (a transformers ``*Indexer`` with ``index_topk``)."""
    return type(m).__name__.endswith("Indexer") and hasattr(m, "index_topk")


def find_indexers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """Every sparse-attention indexer of ``model`` as ``(decoder layer, module)``, ascending; an indexer rr cannot
    replay is an :class:`UnsupportedModelError` naming it and why."""
    found: list[tuple[int, nn.Module]] = []
    for name, m in model.named_modules():
        if not _is_indexer(m):
            continue
        cls = type(m).__name__
        if cls in REFUSED_INDEXERS:
            raise UnsupportedModelError(f"{name} ({cls}): rr cannot replay this indexer: {REFUSED_INDEXERS[cls]}")
        if cls not in INDEXER_CLASSES:
            raise UnsupportedModelError(
                f"{name} ({cls}): an indexer rr has not checked (replayed: {', '.join(INDEXER_CLASSES)})"
            )
        found.append((int(m.layer_idx), m))
    return sorted(found, key=lambda x: x[0])


def _attention_of(model: nn.Module, indexers: Sequence[tuple[int, nn.Module]]) -> dict[nn.Module, int]:
    """``{attention module: indexer ordinal}``: the attention module holding each indexer (its ``indexer``)."""
    ordinal = {id(m): li for li, (_, m) in enumerate(indexers)}
    return {
        m: ordinal[id(m.indexer)]
        for m in model.modules()
        if isinstance(getattr(m, "indexer", None), nn.Module) and id(m.indexer) in ordinal
    }


class _ObservedAttention:
    """transformers' attention registry as a family's attention module reads it (``ALL_ATTENTION_FUNCTIONS``, looked
    up per call): each lookup returns the attention function wrapped to show ``seen`` the module, the mask and the
    sparse ``indices`` it is called with; everything else is the registry's."""

    def __init__(self, registry: Any, seen: Callable[[Any, Any, Any], None]) -> None:
        self._registry, self._seen = registry, seen

    def get_interface(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        fn = self._registry.get_interface(name, default)
        seen = self._seen

        def attention(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            seen(module, attention_mask, kwargs.get("indices"))
            return fn(module, q, k, v, attention_mask, *args, **kwargs)

        return attention

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


@contextmanager
def _observing(modules: Sequence[nn.Module], seen: Callable[[Any, Any, Any], None]) -> Iterator[None]:
    """For the block, the attention registry of each of ``modules``' transformers modeling modules observed."""
    with ExitStack() as stack:
        for name in dict.fromkeys(type(m).__module__ for m in modules):
            mod = sys.modules[name]
            registry = getattr(mod, "ALL_ATTENTION_FUNCTIONS", None)
            if registry is None:
                raise UnsupportedModelError(
                    f"{name}: its attention reads no ALL_ATTENTION_FUNCTIONS, so rr's indexer audit cannot see "
                    "what it consumes"
                )
            mod.ALL_ATTENTION_FUNCTIONS = _ObservedAttention(registry, seen)
            stack.callback(setattr, mod, "ALL_ATTENTION_FUNCTIONS", registry)
        yield


def _consumed(mask: Any, indices: Any, picks: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: whether the attention reads exactly ``picks`` (``[B, S, K]`` columns) at each row: its sparse
    ``indices`` as a set, else the keys its mask (``[B, 1, S, T]`` bool True = open, or additive: 0 = open) leaves
    open; False where it was given neither."""
    p = picks.long()
    if indices is not None:
        return (indices.long().sort(-1).values == p.sort(-1).values).all(-1)
    if mask is None:
        return torch.zeros(p.shape[:2], dtype=torch.bool, device=p.device)
    m = mask[:, 0] if mask.dim() == 4 else mask
    opened = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    opened = opened.expand(p.shape[0], p.shape[1], -1)
    return opened.gather(-1, p.clamp_min(0)).all(-1) & (opened.sum(-1) == p.shape[-1])


def count_indexers(model: nn.Module) -> int:
    """How many sparse-attention indexers ``model`` runs, replayable or not (never raises)."""
    return sum(_is_indexer(m) for m in model.modules())


def _checked_rows(rows: Any, layers: list[int], topk: int, real: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S, L, K]`` positions (``-1``: not replayed) -> (positions, int16 or int32, ``[B, S, L]`` replayed); the one
    check of every replayed row (causal, distinct, whole; with ``real``, the batch's ``[B, S]`` real tokens: no
    replayed row at a padding column, no pick of one) in one host read."""
    if not isinstance(rows, torch.Tensor):
        raise ArgumentTypeError(f"indexer rows must be a torch tensor [B, S, L, K], got {type(rows).__name__}")
    if rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ArgumentTypeError(f"indexer rows must hold integer positions, got {rows.dtype}")
    if rows.dim() != 4 or rows.shape[2] != len(layers) or rows.shape[3] != topk:
        raise ShapeMismatchError(
            f"indexer rows are {list(rows.shape)}, expected [batch, tokens, {len(layers)} indexer layers {layers}, "
            f"index_topk {topk}]"
        )
    # int16 / int32 kept as they are (to_tensors' dtypes; an int64 copy would be 2-4x the largest tensor of the step)
    beyond = (
        (rows.abs() > torch.iinfo(torch.int32).max).any()
        if rows.dtype == torch.int64 and rows.numel()
        else torch.zeros((), dtype=torch.bool, device=rows.device)
    )
    pos = (
        rows
        if rows.dtype in (torch.int16, torch.int32)
        else rows.to(torch.int32 if rows.dtype != torch.uint8 else torch.int16)
    )
    use = (pos >= 0).all(-1)
    partial = (pos >= 0).any(-1) & ~use
    negative = (pos < -1).any(-1)  # -1 alone means "not replayed": any other negative is a wrapped or wrong position
    t = torch.arange(pos.shape[1], device=pos.device)[None, :, None, None]
    future = ((pos > t) & use[..., None]).any(-1)
    srt = pos.sort(-1).values
    twice = ((srt[..., 1:] == srt[..., :-1]).any(-1)) & use
    on_pad = torch.zeros_like(use)
    picks_pad = torch.zeros_like(use)
    if real is not None:
        r = torch.as_tensor(real).to(pos.device).bool()
        if tuple(r.shape) != tuple(pos.shape[:2]):
            raise ShapeMismatchError(
                f"the batch's real-token mask is {list(r.shape)}, the indexer rows {list(pos.shape[:2])} (batch, "
                "tokens): lay the picks out as the model's input_ids"
            )
        on_pad = use & ~r[:, :, None]
        picked = r.gather(1, pos.clamp_min(0).long().flatten(1)).view(pos.shape)  # is each picked column real?
        picks_pad = (~picked & (pos >= 0)).any(-1) & use
    too_wide, *flags = torch.stack(
        [beyond, negative.any(), partial.any(), future.any(), twice.any(), on_pad.any(), picks_pad.any()]
    ).tolist()  # the one host read
    if too_wide:
        raise IndexerPositionError("indexer rows hold positions beyond int32: not token positions")
    for bad, what in zip(flags, (negative, partial, future, twice, on_pad, picks_pad)):
        if bad:
            b, s, li = (int(i) for i in torch.nonzero(what)[0].tolist())
            row = pos[b, s, li].tolist()[:8]
            if what is on_pad:
                raise IndexerPositionError(
                    f"indexer row (sample {b}, column {s}, layer {layers[li]}) is replayed at a padding column "
                    f"{row}...: the picks are not laid out as the batch's columns"
                )
            if what is picks_pad:
                first = int(r[b].nonzero()[0, 0]) if bool(r[b].any()) else 0
                raise IndexerPositionError(
                    f"indexer row (sample {b}, column {s}, layer {layers[li]}) picks padding columns {row}...: "
                    f"the sample's tokens start at column {first}; engine positions given where batch columns are "
                    f"expected (shift each pick by the sample's left padding)"
                )
            if what is negative:
                raise IndexerPositionError(
                    f"indexer row (sample {b}, token {s}, layer {layers[li]}) holds a negative position other than "
                    f"-1 {row}...: -1 alone marks a row not replayed (positions past 32,767 wrapped in int16?)"
                )
            if what is partial:
                raise UnrecordedRoutingError(
                    f"indexer row (sample {b}, token {s}, layer {layers[li]}) is partly -1 {row}...: a row is "
                    "replayed whole or not at all"
                )
            raise IndexerPositionError(
                f"indexer row (sample {b}, token {s}, layer {layers[li]}) "
                + ("picks a future position" if what is future else "picks a position twice")
                + f" {row}...: token {s} reads positions 0..{s}, each once"
            )
    return pos, use


@contextmanager
def replay_indexer(
    model: nn.Module,
    indexer_topk: Any,
    *,
    layers: Sequence[int] | None = None,
    audit: bool = False,
    real: Any = None,
) -> Iterator[dict[str, float] | None]:
    """Force ``indexer_topk`` (``[B, S, L, index_topk]`` key positions, ``L`` = the model's indexer layers in order,
    rows laid out as the model's ``input_ids``; ``-1`` rows keep the model's own pick, e.g. tokens before
    ``index_topk``, which read every earlier token anyway) as every indexer's pick inside the block.

    Refused, typed, when the block opens: a family whose indexer rr cannot replay (:class:`UnsupportedModelError`),
    wrong shape or width (:class:`ShapeMismatchError`), a future or repeated position (:class:`IndexerPositionError`),
    a partly padded row, rows of other layers than the model's indexers (``layers``: the decoder layers of the rows'
    layer axis, e.g. :attr:`rr_client.RoutingTensors.indexer_layers`); with ``real`` (the batch's ``[B, S]``
    attention mask), a row replayed at a padding column or picking one (:class:`IndexerPositionError`: engine
    positions where batch columns are expected, on a left-padded batch). ``audit=True`` yields a dict filled when
    the block exits (module docstring)."""
    indexers = find_indexers(model)
    if not indexers:
        raise UnsupportedModelError(f"{type(model).__name__} has no sparse-attention indexer to replay")
    own = [layer for layer, _ in indexers]
    if layers is not None and list(layers) != own:
        raise ShapeMismatchError(
            f"the indexer rows are of layers {list(layers)}, the model's indexers run at layers {own}: "
            "rows from another checkpoint's layout"
        )
    topk = int(indexers[0][1].index_topk)
    pos, use = _checked_rows(indexer_topk, own, topk, real)
    # each indexer's rows on its own device (a model split over devices), one copy per device
    devices = [next(m.parameters()).device for _, m in indexers]
    on = {d: (pos.to(d, non_blocking=True), use.to(d, non_blocking=True)) for d in dict.fromkeys(devices)}
    tally = DeviceTally()  # the hooks' counts, kept on the device until the block exits
    ran: set[int] = set()

    def replay(li: int, layer: int) -> Any:
        pos, use = on[devices[li]]

        def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            if tuple(out.shape[:2]) != tuple(pos.shape[:2]):
                raise ShapeMismatchError(
                    f"indexer layer {layer} scores {list(out.shape[:2])} (batch, tokens), the rows are "
                    f"{list(pos.shape[:2])}: lay the rows out as the model's input_ids (no KV cache)"
                )
            u = use[:, :, li]
            if out.shape[-1] != topk:  # a sequence no longer than index_topk: no token chooses
                tally.add(f"unreplayable/{layer}", u.sum())
                return out
            new = torch.where(u[..., None], pos[:, :, li].to(out.dtype), out)
            if audit:
                tally.add(f"rows/{layer}", u.sum())
                own = out.long().sort(-1).values == pos[:, :, li].sort(-1).values
                tally.add(f"agree/{layer}", (own.all(-1) & u).sum())
            return new

        return hook

    attention = _attention_of(model, indexers)

    def seen(module: Any, mask: Any, indices: Any) -> None:
        """The attention of one of the indexers' layers ran: count the replayed rows it consumed exactly."""
        li = attention.get(module)
        if li is None:
            return
        layer = own[li]
        ran.add(layer)
        pos, use = on[devices[li]]
        got = _consumed(mask, indices, pos[:, :, li])
        tally.add(f"applied/{layer}", (got & use[:, :, li]).sum())

    handles = [m.register_forward_hook(replay(li, layer)) for li, (layer, m) in enumerate(indexers)]
    report: dict[str, float] | None = {} if audit else None
    try:
        with ExitStack() as observed:
            if audit:  # downstream of rr's hook: what the attention consumes
                observed.enter_context(_observing(list(attention), seen))
            yield report
    finally:
        for h in handles:
            h.remove()
    counts = tally.read() if tally else {}
    lost = sorted(int(k.split("/")[1]) for k, v in counts.items() if k.startswith("unreplayable/") and v)
    if lost:
        raise ReplayError(
            f"indexer layers {lost} scored sequences no longer than index_topk={topk}, yet rows were given for "
            "them: those tokens read every earlier token, so no row can be replayed there"
        )
    if not audit or report is None:
        return
    report.update(
        layer_keys(
            [
                LayerCounts(
                    layer,
                    replayed=counts.get(f"rows/{layer}", 0),
                    checked=counts.get(f"rows/{layer}", 0),
                    applied=counts.get(f"applied/{layer}", 0),
                    agreed=counts.get(f"agree/{layer}", 0),
                )
                for layer in own
            ],
            indexer=True,
        )
    )
    problems = []
    never = [layer for layer in own if layer not in ran]
    if never:
        problems.append(f"indexer layers {never} never ran inside the block")
    short = [layer for layer in own if counts.get(f"applied/{layer}", 0) < counts.get(f"rows/{layer}", 0)]
    if short:
        problems.append(f"indexer layers {short}: replayed rows did not reach the attention")
    if problems:
        raise ReplayError("indexer replay audit: " + "; ".join(problems), report=report)
