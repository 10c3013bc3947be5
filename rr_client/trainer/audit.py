"""The trainer's audit, defined once for every target (routers, indexers) and every backend (the Hugging Face
hooks, Megatron-core, verl's Megatron engine): when a step is audited (:class:`AuditClock`), what a layer's audit
counted (:class:`LayerCounts`) and the one writer of the ``r3/`` audit keys from those counts (:func:`layer_keys`,
:func:`segment_keys`). "No rows" has one meaning everywhere: NaN (:func:`share`), never 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rr_client.core.errors import ConfigurationError
from rr_client.trainer import keys as K

__all__ = ["AuditClock", "LayerCounts", "share", "worst", "layer_keys", "merged_keys", "segment_keys"]


def share(part: float, whole: float) -> float:
    """``part / whole``; NaN where ``whole`` is 0 (no rows: nothing was shown either way)."""
    return part / whole if whole else math.nan


def worst(shares: Iterable[float]) -> float:
    """The lowest of ``shares`` that are numbers; NaN when none is (no rows anywhere)."""
    vals = [v for v in shares if not math.isnan(v)]
    return min(vals) if vals else math.nan


class AuditClock:
    """When a step runs under the audit: the first step, then every ``every``-th (0: never). The session owns one;
    every backend and adapter asks it (:attr:`audited`) and the session alone advances it (:meth:`tick`)."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ConfigurationError(f"audit_every={every} must be >= 0 (0: never audit)")
        self.every = every
        self.steps = 0  #: finished steps

    @property
    def audited(self) -> bool:
        """Whether the current step runs under the audit."""
        return self.every > 0 and self.steps % self.every == 0

    def tick(self) -> None:
        """The current step is finished (audited or not, refused or not)."""
        self.steps += 1


@dataclass
class LayerCounts:
    """One layer's audit counts over a block or a step (rows: (token, layer) cells of real tokens)."""

    layer: int  #: the rows' layer index (absolute, as the wire's layer axis)
    replayed: int = 0  #: rows forced to the engine's choice in forwards (recomputes not counted again)
    checked: int = 0  #: replayed rows whose consumer (experts / attention) was checked
    applied: int = 0  #: checked rows the consumer received exactly as replayed
    agreed: int = 0  #: replayed rows the model's own choice equals
    left: int | None = None  #: real-token rows left to the model's own choice (None: not counted here)


def layer_keys(counts: Sequence[LayerCounts], *, indexer: bool = False, audited: bool = True) -> dict[str, float]:
    """The ``r3/`` keys (``r3/indexer/`` with ``indexer``) of per-layer counts: rows replayed (and left), the applied
    share and the agreement over all layers and per layer, NaN where no rows were checked / replayed or the step
    was not ``audited``. The one function that writes ``applied_share``; a caller adds its own counters
    (forwards, orphan routers, ...)."""
    nan = math.nan
    replayed = sum(c.replayed for c in counts)
    checked = sum(c.checked for c in counts)
    applied = sum(c.applied for c in counts)
    agreed = sum(c.agreed for c in counts)
    left = [c.left for c in counts if c.left is not None]
    if indexer:
        out = {
            K.INDEXER_LAYERS: float(len(counts)),
            K.INDEXER_REPLAYED_ROWS: float(replayed),
            K.INDEXER_APPLIED_SHARE: share(applied, checked) if audited else nan,
            K.INDEXER_AGREEMENT: share(agreed, replayed) if audited else nan,
        }
        name = K.indexer_layer
    else:
        out = {
            K.MOE_LAYERS: float(len(counts)),
            K.REPLAYED_ROWS: float(replayed),
            K.APPLIED_SHARE: share(applied, checked) if audited else nan,
            K.AGREEMENT: share(agreed, replayed) if audited else nan,
        }
        if left:
            out[K.LEFT_ROWS] = float(sum(left))
        name = K.layer
    for c in counts:
        out[name(c.layer, "replayed_rows")] = float(c.replayed)
        out[name(c.layer, "applied_share")] = share(c.applied, c.checked) if audited else nan
        out[name(c.layer, "agreement")] = share(c.agreed, c.replayed) if audited else nan
        if c.left is not None and not indexer:
            out[name(c.layer, "left_rows")] = float(c.left)
    return out


def merged_keys(reports: Sequence[Mapping[str, float]], *, indexer: bool = False) -> dict[str, float]:
    """The step's applied share and agreement from its blocks' :func:`layer_keys` (``r3/indexer/`` with
    ``indexer``): the worst block's applied share (and, for routers, the worst layer's), agreement weighted by
    replayed rows; NaN where no block had rows. The merge of what :func:`layer_keys` wrote, beside it."""
    shr, agr, rep = (
        (K.INDEXER_APPLIED_SHARE, K.INDEXER_AGREEMENT, K.INDEXER_REPLAYED_ROWS)
        if indexer
        else (K.APPLIED_SHARE, K.AGREEMENT, K.REPLAYED_ROWS)
    )
    rows = sum(r.get(rep, 0.0) for r in reports)
    out = {
        shr: worst(r.get(shr, math.nan) for r in reports),
        agr: share(sum(r[agr] * r[rep] for r in reports if r.get(rep)), rows),
    }
    if not indexer:
        out[K.APPLIED_SHARE_MIN_LAYER] = worst(
            v for r in reports for k, v in r.items() if K.is_layer_key(k) and k.endswith("/applied_share")
        )
    return out


def segment_keys(vec: Sequence[int] | None, names: Sequence[tuple[str, int | None]]) -> dict[str, float]:
    """The per-segment keys of a ``[agreed per code..., discarded, replayed per code..., discarded]`` count vector:
    ``r3/[turn<t>/]<segment>/replayed_rows`` and ``.../agreement`` (absent where no rows), per turn and, for
    trajectories, per segment over every turn."""
    s = len(names)
    vec = list(vec) if vec else [0] * (2 * (s + 1))
    out: dict[str, float] = {}
    whole: dict[str, list[int]] = {}
    for code, (name, turn) in enumerate(names):
        agree, rep = vec[code], vec[s + 1 + code]
        out[K.segment(name, "replayed_rows", turn)] = float(rep)
        if rep:
            out[K.segment(name, "agreement", turn)] = agree / rep
        if turn is not None:
            tot = whole.setdefault(name, [0, 0])
            tot[0], tot[1] = tot[0] + agree, tot[1] + rep
    for name, (agree, rep) in whole.items():
        out[K.segment(name, "replayed_rows")] = float(rep)
        if rep:
            out[K.segment(name, "agreement")] = agree / rep
    return out
