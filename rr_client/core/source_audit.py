"""The source audit's arithmetic: how far the rows a server returned for a sample agree with the rows the same engine
computes when it re-scores the sample's tokens in one fresh prefill (prefix cache bypassed). numpy only (core).

A healthy engine re-scoring the same tokens differs only on near-ties: 12,478 of 12,478 cells on this machine's CPU
vLLM (float32; docs/doctor.md, "Source audit"). The faults rr has found in engines' GPU paths leave rows that are well
formed but belong to other tokens (decode rows one token late, another request's KV slot, a draft node's rows,
rows cached under older weights): they agree on a few percent of cells. The verdict is per sample and per part: a
sample fails when its cells, or the cells of any token segment (cached prompt, computed prompt, generated) or context
depth bucket, agree below ``threshold``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rr_client.core.agreement import set_matches
from rr_client.core.errors import ConfigurationError, ShapeMismatchError

__all__ = [
    "SEGMENTS",
    "DEPTH_BUCKETS",
    "DEPTH_EDGES",
    "DEFAULT_THRESHOLD",
    "SourceAgreement",
    "compare_rows",
    "compare_picks",
    "merge_agreements",
    "check_threshold",
]

#: token segments, by where the served row came from: prompt tokens served from the prefix cache, prompt tokens the
#: request computed, generated tokens (the trainer's segment keys use the same names)
SEGMENTS: tuple[str, ...] = ("cached_prompt", "computed_prompt", "generated")
#: context-depth buckets (token position), upper edges exclusive; the last is open
DEPTH_EDGES: tuple[int, ...] = (8192, 16384, 32768, 65536)
DEPTH_BUCKETS: tuple[str, ...] = ("0-8k", "8-16k", "16-32k", "32-64k", "64k+")
#: the default share of (token, MoE layer) cells that must agree, per sample and per segment / depth bucket. A
#: healthy CPU engine agrees on every cell; every injected fault scored <= 0.24 (docs/doctor.md); bf16 GPUs flip
#: near-ties on a few percent of cells at most, so 0.9 leaves them room while no fault measured comes near it.
DEFAULT_THRESHOLD = 0.9


def check_threshold(threshold: object) -> float:
    """``threshold`` as a float in (0, 1], else :class:`ConfigurationError`."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigurationError(f"source audit threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


@dataclass(frozen=True)
class SourceAgreement:
    """Agreement counts of one sample (or a batch, merged): ``cells`` (token, MoE layer) cells compared, ``agreed``
    of them equal as sets; ``tokens`` / ``tokens_agreed``: tokens whose every MoE layer agrees; ``by_segment`` /
    ``by_depth``: ``name -> (agreed, cells)``; ``by_layer``: ``[(agreed, cells)]`` per MoE layer, in ``layers``
    order; ``first_disagreement``: the earliest token position whose row differs (None: none)."""

    cells: int
    agreed: int
    tokens: int
    tokens_agreed: int
    by_segment: Mapping[str, tuple[int, int]]
    by_depth: Mapping[str, tuple[int, int]]
    by_layer: tuple[tuple[int, int], ...]
    layers: tuple[int, ...]
    first_disagreement: int | None = None
    samples: int = field(default=1)

    @property
    def agreement(self) -> float:
        """Share of cells that agree (NaN when nothing was compared)."""
        return self.agreed / self.cells if self.cells else float("nan")

    @property
    def token_agreement(self) -> float:
        """Share of tokens whose every MoE layer agrees."""
        return self.tokens_agreed / self.tokens if self.tokens else float("nan")

    def worst_layer(self) -> tuple[int, float] | None:
        """``(layer, agreement)`` of the MoE layer that agrees least (None when nothing was compared)."""
        shares = [(a / c, lay) for (a, c), lay in zip(self.by_layer, self.layers) if c]
        if not shares:
            return None
        share, lay = min(shares)
        return lay, share

    def failing(self, threshold: float = DEFAULT_THRESHOLD) -> list[str]:
        """The parts below ``threshold``: ``"sample"``, segment names and ``"depth <bucket>"`` (empty: it passes)."""
        threshold = check_threshold(threshold)
        out = ["sample"] if self.cells and self.agreement < threshold else []
        out += [name for name, (a, c) in self.by_segment.items() if c and a / c < threshold]
        out += [f"depth {name}" for name, (a, c) in self.by_depth.items() if c and a / c < threshold]
        return out

    def passes(self, threshold: float = DEFAULT_THRESHOLD) -> bool:
        """No part is below ``threshold``."""
        return not self.failing(threshold)

    def describe(self, threshold: float = DEFAULT_THRESHOLD) -> str:
        """One line: agreement, the parts that fell and where (worst layer, first differing token)."""
        fell = self.failing(threshold)
        parts = [f"{self.agreed}/{self.cells} cells agree ({self.agreement:.3f})"]
        for name in fell:
            if name == "sample":
                continue
            seg = name.removeprefix("depth ")
            a, c = (self.by_depth if name.startswith("depth ") else self.by_segment)[seg]
            parts.append(f"{name} {a / c:.3f}")
        worst = self.worst_layer()
        if worst is not None:
            parts.append(f"worst layer {worst[0]} ({worst[1]:.3f})")
        if self.first_disagreement is not None:
            parts.append(f"first differing token {self.first_disagreement}")
        return ("FLAGGED: " if fell else "ok: ") + ", ".join(parts)


def _counts(codes: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """``bincount`` of ``codes`` weighted by ``weights``, length ``n``."""
    return np.bincount(codes, weights=weights, minlength=n)[:n].astype(np.int64)


def compare_rows(
    served: Any,
    rescored: Any,
    *,
    start: int,
    prompt_tokens: int,
    cached_tokens: int = 0,
    moe_layers: Sequence[int] | None = None,
    rescored_start: int = 0,
) -> SourceAgreement:
    """Compare one sample's served rows with the engine's re-score of its tokens.

    ``served``: ``[R, L, K]`` rows of token positions ``start .. start + R - 1`` (what the server answered);
    ``rescored``: ``[R2, L, K]`` rows of positions ``rescored_start .. rescored_start + R2 - 1`` (the re-score, from
    its first token: 0 for routing; indexer picks start at ``index_topk``), covering the served positions.
    ``prompt_tokens`` / ``cached_tokens`` split positions into segments; ``moe_layers`` the layer positions to count
    (dense layers are zero on both sides). Works for any id sets per row: expert ids, or indexer picks (token
    positions, -1 padding; :func:`compare_picks` counts those per pick). One vectorised pass; no loop over tokens."""
    s, r = _aligned(np.asarray(served), np.asarray(rescored), start, rescored_start, "rows")
    layers = tuple(range(s.shape[1])) if moe_layers is None else tuple(int(x) for x in moe_layers)
    same = set_matches(s, r, layers=layers)  # [R, Lm]
    return _aggregate(same.astype(np.int64), np.ones(same.shape, np.int64), start, prompt_tokens, cached_tokens, layers)


def compare_picks(
    served: Any,
    rescored: Any,
    *,
    start: int,
    prompt_tokens: int,
    cached_tokens: int = 0,
    rescored_start: int = 0,
) -> SourceAgreement:
    """Compare a sample's served sparse-attention indexer picks (``[R, indexer layers, index_topk]`` token positions,
    -1 padding, positions ``start ..``) with the re-score's (positions ``rescored_start ..``). A cell is one pick:
    ``agreed`` counts served picks the re-score picked too, so a boundary tie that swaps one of 2,048 picks costs
    1/2,048 of its row, not the row (exact set equality would flag every honest bf16 row); ``tokens_agreed``: rows
    whose every layer's pick set is equal. Vectorised (``np.isin`` over row-keyed values)."""
    s, r = _aligned(
        np.asarray(served).astype(np.int64), np.asarray(rescored).astype(np.int64), start, rescored_start, "picks"
    )
    span = int(max(s.max(initial=0), r.max(initial=0))) + 2  # keys: (row, layer) cell * span + pick
    cell = np.arange(s.shape[0] * s.shape[1], dtype=np.int64).reshape(s.shape[0], s.shape[1], 1) * span
    valid = s >= 0
    hit = np.isin(s + cell, np.where(r >= 0, r + cell, -1)) & valid
    agreed, total = hit.sum(axis=2), valid.sum(axis=2)
    layers = tuple(range(s.shape[1]))
    return _aggregate(agreed, total, start, prompt_tokens, cached_tokens, layers)


def _aligned(s: np.ndarray, r: np.ndarray, start: int, rescored_start: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``s`` and the rows of ``r`` at the same token positions (``s`` from ``start``, ``r`` from ``rescored_start``),
    both ``[rows, layers, k]``; :class:`ShapeMismatchError` when the shapes differ or the re-score does not cover
    every served position. ``what``: "rows" or "picks", for the messages."""
    if s.ndim != 3 or r.ndim != 3 or s.shape[1:] != r.shape[1:]:
        raise ShapeMismatchError(
            f"served {what} {s.shape} and re-scored {what} {r.shape} must both be [rows, layers, k]"
        )
    lo = start - rescored_start
    if start < 0 or lo < 0 or r.shape[0] < lo + s.shape[0]:
        rows = "rows" if what == "rows" else f"{what[:-1]} rows"
        raise ShapeMismatchError(
            f"the re-score has {r.shape[0]} {rows} from token {rescored_start}; served {what} cover positions "
            f"{start}..{start + s.shape[0] - 1}"
        )
    return s, r[lo : lo + s.shape[0]]


def _aggregate(
    agreed: np.ndarray, total: np.ndarray, start: int, prompt_tokens: int, cached_tokens: int, layers: tuple[int, ...]
) -> SourceAgreement:
    """Counts ``[R, L]`` (agreed of total per row and layer, rows at positions ``start ..``) by segment, depth
    bucket and layer, and whole-row agreement."""
    pos = np.arange(start, start + agreed.shape[0])
    seg = np.where(pos < cached_tokens, 0, np.where(pos < prompt_tokens, 1, 2))
    depth = np.searchsorted(np.asarray(DEPTH_EDGES), pos, side="right")
    per_tok = agreed.sum(axis=1).astype(np.float64)
    per_tot = total.sum(axis=1).astype(np.float64)
    seg_a, seg_c = _counts(seg, per_tok, 3), _counts(seg, per_tot, 3)
    dep_a, dep_c = _counts(depth, per_tok, len(DEPTH_BUCKETS)), _counts(depth, per_tot, len(DEPTH_BUCKETS))
    tok_ok = (agreed == total).all(axis=1)
    bad = np.flatnonzero(~tok_ok)
    return SourceAgreement(
        cells=int(total.sum()),
        agreed=int(agreed.sum()),
        tokens=int(pos.size),
        tokens_agreed=int(tok_ok.sum()),
        by_segment={n: (int(seg_a[i]), int(seg_c[i])) for i, n in enumerate(SEGMENTS) if seg_c[i]},
        by_depth={n: (int(dep_a[i]), int(dep_c[i])) for i, n in enumerate(DEPTH_BUCKETS) if dep_c[i]},
        by_layer=tuple((int(a), int(c)) for a, c in zip(agreed.sum(axis=0), total.sum(axis=0))),
        layers=layers,
        first_disagreement=int(pos[bad[0]]) if bad.size else None,
    )


def merge_agreements(parts: Sequence[SourceAgreement]) -> SourceAgreement | None:
    """The sum of several samples' counts (a step's); None for none. Layers must match."""
    if not parts:
        return None
    layers = parts[0].layers
    if any(p.layers != layers for p in parts):
        raise ConfigurationError("source agreements of different MoE layers cannot be merged")

    def add(maps: Sequence[Mapping[str, tuple[int, int]]], names: Sequence[str]) -> dict[str, tuple[int, int]]:
        out = {}
        for n in names:
            got = [m[n] for m in maps if n in m]
            if got:
                out[n] = (sum(a for a, _ in got), sum(c for _, c in got))
        return out

    firsts = [p.first_disagreement for p in parts if p.first_disagreement is not None]
    return SourceAgreement(
        cells=sum(p.cells for p in parts),
        agreed=sum(p.agreed for p in parts),
        tokens=sum(p.tokens for p in parts),
        tokens_agreed=sum(p.tokens_agreed for p in parts),
        by_segment=add([p.by_segment for p in parts], SEGMENTS),
        by_depth=add([p.by_depth for p in parts], DEPTH_BUCKETS),
        by_layer=tuple(
            (sum(p.by_layer[i][0] for p in parts), sum(p.by_layer[i][1] for p in parts)) for i in range(len(layers))
        ),
        layers=layers,
        first_disagreement=min(firsts) if firsts else None,
        samples=sum(p.samples for p in parts),
    )
