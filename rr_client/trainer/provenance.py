"""The stale-rows policy and the audit's token segments for a trainer's batch of samples.

A sample's provenance (:class:`rr_client.core.provenance.Provenance`) says which cache and weights made its rows.
:func:`check_samples` applies the ``stale_rows`` policy to a batch (a refusal raises before the batch trains;
``"mask"`` keeps a sample with replay off for all its rows) and :func:`provenance_metrics` gives the step's counts.
:func:`build_segments` cuts every sample's tokens into cached prompt, computed prompt and generated (per turn for a
:class:`rr_client.Trajectory`), as one device-ready code tensor per batch, so the audit and the log-prob gap are
reported per segment and a stale cached prefix is not averaged away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from rr_client.core.errors import ConfigurationError, ShapeMismatchError, StaleRoutingError
from rr_client.core.provenance import (
    PROVENANCE_FIELD,
    Provenance,
    ProvenanceCheck,
    StalePolicy,
    check_provenance,
    check_stale_policy,
)
from rr_client.core.source_audit import DEPTH_EDGES, SourceAgreement, merge_agreements
from rr_client.trainer import keys as K
from rr_client.trainer.rows import without_samples

__all__ = [
    "Segments",
    "provenance_of",
    "sample_provenances",
    "check_samples",
    "check_provenances",
    "provenance_metrics",
    "source_metrics",
    "build_segments",
    "mask_samples",
    "mask_rows",
    "mask_indexer",
    "drop_samples",
    "merge_checks",
    "rows_provenance",
    "samples_of",
    "police_rows",
]

CACHED, COMPUTED, GENERATED = range(3)  # positions of keys.SEGMENTS


def provenance_of(result: Any) -> Provenance | None:
    """One generated result's provenance: its ``provenance`` attribute, its routing ref's, or the wire field in its
    ``meta`` (``rr_provenance``, checked by :meth:`Provenance.from_dict`); None when the server gave none."""
    p = getattr(result, "provenance", None)
    if isinstance(p, Provenance):
        return p
    ref = getattr(result, "routing_ref", None)
    p = getattr(ref, "provenance", None) if ref is not None else None
    if isinstance(p, Provenance):
        return p
    meta = getattr(result, "meta", None)
    raw = meta.get(PROVENANCE_FIELD) if isinstance(meta, dict) else None
    if raw is None and isinstance(p, dict):
        raw = p
    return (
        None
        if raw is None
        else Provenance.from_dict(raw, where=f"sample {getattr(result, 'index', '?')}: {PROVENANCE_FIELD}")
    )


def sample_provenances(sample: Any) -> list[Provenance | None]:
    """Per turn for a trajectory (its ``turns``), else the sample's one provenance."""
    turns = getattr(sample, "turns", None)
    if isinstance(turns, list) and turns:
        return [provenance_of(t) for t in turns]
    return [provenance_of(sample)]


def merge_checks(checks: Sequence[ProvenanceCheck]) -> ProvenanceCheck:
    """One check from several (batches, or the turns of one trajectory summed per sample by the caller)."""
    return ProvenanceCheck(
        tuple(x for c in checks for x in c.replay),
        sum(c.masked for c in checks),
        sum(c.spans_update for c in checks),
        sum(c.unknown for c in checks),
        sum(c.cached_tokens for c in checks),
        sum(c.source_checked for c in checks),
        sum(c.source_flagged for c in checks),
        merge_agreements([c.source for c in checks if c.source is not None]),
        merge_agreements([c.source_indexer for c in checks if c.source_indexer is not None]),
    )


def check_samples(samples: Sequence[Any], policy: StalePolicy = "refuse") -> ProvenanceCheck:
    """Apply the stale-rows policy to a batch of samples (results or trajectories), one entry per sample:
    :class:`rr_client.StaleRoutingError` names the first sample (and turn) that may have been recomputed across a
    weight update (``"refuse"``), or ``replay[i]`` is False for it (``"mask"``). Counts are per sample (a
    trajectory counts once: masked if any turn is, flagged if any spans an update, unknown if any turn has none)."""
    check_stale_policy(policy)
    provs = [sample_provenances(s) for s in samples]
    turns = not all(len(p) == 1 and not getattr(s, "turns", None) for s, p in zip(samples, provs))
    return check_provenances(provs, policy, turns=turns)


def check_provenances(
    per_sample: Sequence[Sequence[Provenance | None]], policy: StalePolicy = "refuse", *, turns: bool | None = None
) -> ProvenanceCheck:
    """:func:`check_samples` on provenances already read: per sample, one per turn (``turns``: the samples are
    trajectories, named by turn; default: when a sample has more than one)."""
    check_stale_policy(policy)
    provs = [list(p) for p in per_sample]
    if turns is None:
        turns = any(len(p) != 1 for p in provs)
    if not turns:
        return check_provenance([p[0] for p in provs], policy, where="batch sample")
    replay: list[bool] = []
    masked = spans = unknown = cached = checked = flagged = 0
    parts: list[SourceAgreement] = []
    idx: list[SourceAgreement] = []
    for i, per_turn in enumerate(provs):
        c = check_provenance(per_turn, policy, where=f"batch sample {i}, turn")
        ok = all(c.replay)
        replay.append(ok)
        masked += not ok
        spans += int(ok and c.spans_update > 0)
        unknown += c.unknown > 0
        cached += c.cached_tokens
        checked += c.source_checked > 0
        flagged += c.source_flagged > 0
        parts += [c.source] if c.source is not None else []
        idx += [c.source_indexer] if c.source_indexer is not None else []
    return ProvenanceCheck(
        tuple(replay), masked, spans, unknown, cached, checked, flagged, merge_agreements(parts), merge_agreements(idx)
    )


def samples_of(routing: Any) -> int:
    """How many samples ``routing`` holds: a :class:`RoutingTensors`' ``B``, a :class:`PackedRouting`'s (or packed
    :class:`rr_client.trainer.rows.ReplayRows`') packed samples, a ``[B, T, L, K]`` tensor's ``B``; 1 for a packed
    ``[N, L, K]`` tensor (its samples are not known)."""
    if hasattr(routing, "routing_cu_seqlens"):
        return int(routing.routing_cu_seqlens.numel()) - 1
    if hasattr(routing, "attention_mask") and hasattr(routing, "input_ids"):
        return int(routing.input_ids.shape[0])
    cu = getattr(routing, "cu_seqlens", None)
    if cu is not None and hasattr(routing, "have"):
        return int(cu.numel()) - 1
    if hasattr(routing, "have"):
        return int(routing.rows.shape[0])
    shape = tuple(getattr(routing, "shape", ()))
    return int(shape[0]) if len(shape) >= 4 else 1


def rows_provenance(routing: Any) -> tuple[tuple[Provenance | None, ...], ...] | None:
    """The per-sample (per-turn) provenance ``routing`` carries (``to_tensors`` / ``to_packed`` fill it from the
    samples; a :class:`rr_client.trainer.rows.ReplayRows`' ``provenance``); None when it carries none."""
    got = getattr(routing, "provenance", None)
    if got is None:
        return None
    return tuple(tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in got)


def mask_samples(batch: Any, replay: Sequence[bool]) -> Any:
    """A :class:`RoutingTensors` (``[B, T]`` mask) or :class:`PackedRouting` with every row of the samples whose
    ``replay`` is False masked off (left to the model's own choice, counted as left rows); a
    :class:`rr_client.trainer.rows.ReplayRows` with those tokens out of ``have`` and ``need`` (a feeder that replays
    every token gives them pad rows); the same batch when all replay. Through
    :func:`rr_client.trainer.rows.without_samples`, the one rule."""
    if all(replay):
        return batch
    if hasattr(batch, "have") and hasattr(batch, "rows"):  # ReplayRows
        return batch.without(replay)
    mask = batch.routed_experts_mask
    if mask.dim() == 2:
        idx = getattr(batch, "indexer_topk", None)
        return replace(
            batch,
            routed_experts_mask=without_samples(mask, replay),
            **({} if idx is None else {"indexer_topk": mask_indexer(idx, replay)}),
        )
    return replace(batch, routed_experts_mask=without_samples(mask, replay, batch.routing_cu_seqlens))


def mask_indexer(indexer_topk: torch.Tensor, replay: Sequence[bool]) -> torch.Tensor:
    """``[B, T, L, K]`` indexer picks with the rows of the samples whose ``replay`` is False set to ``-1`` (the model
    keeps its own pick there); the same tensor when all replay."""
    if all(replay):
        return indexer_topk
    keep = without_samples(torch.ones(indexer_topk.shape[:2], dtype=torch.bool), replay)
    return indexer_topk.masked_fill(~keep.to(indexer_topk.device)[..., None, None], -1)


def mask_rows(rows: Any, mask: Any, replay: Sequence[bool]) -> Any:
    """A raw rows tensor's ``mask`` (its leading shape; None: every row) with the rows of the samples whose
    ``replay`` is False masked off: ``[B, T, L, K]`` rows are masked per sample ``b``."""
    if all(replay):
        return mask
    lead = tuple(int(x) for x in torch.as_tensor(rows).shape[:-2])
    base = torch.ones(lead, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    return without_samples(base, replay)


def drop_samples(mask: torch.Tensor, replay: Sequence[bool], cu_seqlens: Any = None) -> torch.Tensor:
    """A loss (or response) ``mask`` (``[B, T]``; packed ``[N]`` with ``cu_seqlens``) with the tokens of the samples
    whose ``replay`` is False set to 0: what Megatron needs under ``stale_rows="mask"`` (its ``RouterReplay``
    replays whole tensors, so a masked sample's tokens run on pad rows and must not train)."""
    if mask.dim() != 2 and cu_seqlens is None and not all(replay):
        raise ConfigurationError("drop_samples on a packed mask needs its cu_seqlens")
    return without_samples(mask, replay, cu_seqlens)


def _packed_tensor(routing: Any) -> bool:
    """A raw packed ``[N, L, K]`` tensor (its samples are not known to the rows)."""
    return isinstance(routing, torch.Tensor) and routing.dim() == 3


def _stale_flags(routing: Any, check: ProvenanceCheck, policy: StalePolicy) -> ProvenanceCheck:
    """Samples a :class:`rr_client.trainer.rows.ReplayRows` flags ``stale`` under the policy too."""
    stale = getattr(routing, "stale", None)
    if stale is None or policy == "off":
        return check
    flags = [bool(x) for x in torch.as_tensor(stale).reshape(-1).tolist()]
    if len(flags) != len(check.replay):
        raise ShapeMismatchError(f"ReplayRows.stale has {len(flags)} flags for {len(check.replay)} samples")
    bad = [i for i, f in enumerate(flags) if f and check.replay[i]]
    if bad and policy == "refuse":
        raise StaleRoutingError(
            f"batch sample {bad[0]}: its rows are flagged stale (ReplayRows.stale); pass "
            "stale_rows='mask' to keep such samples without replay"
        )
    replay = tuple(r and not f for r, f in zip(check.replay, flags))
    return replace(check, replay=replay, masked=check.masked + len(bad))


def _mask_policed(
    routing: Any, mask: Any, replay: Sequence[bool], every_token: bool, layers: Sequence[int] | None, tokens: Any
) -> tuple[Any, Any]:
    """The rows with the masked samples' rows off: left to the router (Hugging Face hooks), or, where every
    token is replayed (Megatron), :class:`rr_client.trainer.rows.ReplayRows` whose masked tokens need no row
    (the feeder gives them pad rows)."""
    if every_token:
        from rr_client.trainer.rows import ReplayRows

        rows = (
            ReplayRows.of(routing, mask=mask, layers=layers, attention_mask=tokens)
            if not isinstance(routing, ReplayRows)
            else routing
        )
        return mask_samples(rows, replay), None
    if hasattr(routing, "routed_experts_mask") or hasattr(routing, "have"):
        if mask is not None and hasattr(routing, "routed_experts_mask"):
            routing, mask = replace(routing, routed_experts_mask=torch.as_tensor(mask).bool()), None
        return mask_samples(routing, replay), mask
    return routing, mask_rows(routing, mask, replay)


def police_rows(
    routing: Any,
    policy: StalePolicy,
    *,
    mask: Any = None,
    samples: Sequence[Any] | None = None,
    every_token: bool = False,
    layers: Sequence[int] | None = None,
    tokens: Any = None,
) -> tuple[Any, Any, ProvenanceCheck]:
    """The stale-rows ``policy`` where rows enter (a :class:`rr_client.trainer.ReplaySession`, a
    :class:`rr_client.integrations.megatron.MegatronReplay`): ``(rows, mask, check)``. The samples' provenance
    comes from ``samples``, else the rows' own (``to_tensors`` / ``to_packed``; a ``ReplayRows``' ``stale`` flags
    too), else is counted unknown (one per sample). ``"refuse"`` raises :class:`rr_client.StaleRoutingError`;
    ``"mask"`` masks the samples off (``every_token``: the backend replays every token, so they become
    :class:`rr_client.trainer.rows.ReplayRows` tokens without a row, given pad rows, with ``mask`` / ``layers`` /
    ``tokens`` folded in and returned as None)."""
    n = samples_of(routing)
    if samples is not None:
        check = check_samples(samples, policy)
        what = "samples="
    else:
        provs = rows_provenance(routing)
        check = check_provenances(provs, policy) if provs is not None else ProvenanceCheck((True,) * n, 0, 0, n, 0)
        what = "the rows' provenance"
    if len(check.replay) != n and not (samples is not None and n == 1 and _packed_tensor(routing)):
        raise ShapeMismatchError(
            f"{what} names {len(check.replay)} samples, the rows hold {n}: a batch cut "
            "into micro-batches must cut its provenance with it (or pass samples=)"
        )
    check = _stale_flags(routing, check, policy)
    if all(check.replay):
        return routing, mask, check
    rows, mask = _mask_policed(routing, mask, check.replay, every_token, layers, tokens)
    return rows, mask, check


def provenance_metrics(check: ProvenanceCheck) -> dict[str, float]:
    """The step's provenance counts under :mod:`rr_client.trainer.keys`."""
    return {
        K.STALE_MASKED: float(check.masked),
        K.SPANS_UPDATE: float(check.spans_update),
        K.PROVENANCE_UNKNOWN: float(check.unknown),
        K.CACHED_TOKENS: float(check.cached_tokens),
        # the source audit's counts only where it ran (a step without it claims nothing of it)
        **(
            {K.SOURCE_CHECKED: float(check.source_checked), K.SOURCE_FLAGGED: float(check.source_flagged)}
            if check.source_checked or check.source_flagged
            else {}
        ),
        **source_metrics(check.source),
        **(
            {K.source("indexer_agreement"): check.source_indexer.agreement}
            if check.source_indexer is not None and check.source_indexer.cells
            else {}
        ),
    }


def source_metrics(agreement: SourceAgreement | None) -> dict[str, float]:
    """The source audit's step keys (:func:`rr_client.trainer.keys.source`): agreement over the step's re-scored
    samples, per token segment and per context-depth bucket, and the worst layer; empty when none was re-scored."""
    if agreement is None or not agreement.cells:
        return {}
    out = {
        K.source("agreement"): agreement.agreement,
        K.source("token_agreement"): agreement.token_agreement,
        K.source("cells"): float(agreement.cells),
    }
    for name, (a, c) in agreement.by_segment.items():
        out[K.source("agreement", name)] = a / c
    for name, (a, c) in agreement.by_depth.items():
        out[K.source("agreement", f"depth_{name}")] = a / c
    worst = agreement.worst_layer()
    if worst is not None:
        out[K.source("worst_layer")] = float(worst[0])
        out[K.source("worst_layer_agreement")] = worst[1]
    return out


@dataclass(frozen=True)
class Segments:
    """Token segments of one batch: ``rows`` and ``logps`` hold a code per row / per log-prob position in the
    batch's layout (-1: none), ``names[code]`` is its ``(segment, turn)`` (turn None for single results);
    ``depths``: shaped like ``logps``, the context-depth bucket of each log-prob's token (an index into
    :data:`rr_client.trainer.keys.DEPTH_BUCKETS`, -1: none), None when not built."""

    rows: torch.Tensor
    logps: torch.Tensor
    names: tuple[tuple[str, int | None], ...]
    depths: torch.Tensor | None = None

    def key(self, code: int, metric: str) -> str:
        """The ``r3/[turn<t>/]<segment>/<metric>`` key of ``code``."""
        name, turn = self.names[code]
        return K.segment(name, metric, turn)

    def narrow(self, start: int, end: int) -> Segments:
        """Samples ``start:end`` of a padded batch (a trainer's chunk)."""
        d = None if self.depths is None else self.depths[start:end]
        return Segments(self.rows[start:end], self.logps[start:end], self.names, d)

    def to(self, device: torch.device | str) -> Segments:
        """On ``device`` (once per batch)."""
        d = None if self.depths is None else self.depths.to(device)
        return Segments(self.rows.to(device), self.logps.to(device), self.names, d)

    def columns(self, width: int, device: torch.device | str) -> Segments:
        """The last ``width`` log-prob columns (a trainer's completion columns), on ``device``."""
        cut = self.logps.shape[1] - width
        d = None if self.depths is None else self.depths[:, cut:].to(device)
        return Segments(self.rows, self.logps[:, cut:].to(device), self.names, d)


def _codes(sample: Any, prov: list[Provenance | None], n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per token position of one sample: the segment code of its row and of its log-prob; and its turn count."""
    rows = np.full(n, -1, dtype=np.int64)
    logps = np.full(n, -1, dtype=np.int64)
    turns = getattr(sample, "turns", None)
    parts = turns if isinstance(turns, list) and turns else [sample]
    spans = getattr(sample, "turn_spans", None) if len(parts) > 1 else None
    if spans:  # a Trajectory's own row ranges per turn (rr_client.client.trajectory.TurnSpan)
        for sp, res in zip(spans, parts):
            for code, (a, b) in enumerate((sp.cached_prompt, sp.computed_prompt, sp.generated)):
                rows[a : min(b, n)] = code + 3 * sp.turn
            n_prompt = len(res.prompt_ids or [])
            logps[n_prompt : min(n_prompt + len(res.output_ids), n)] = GENERATED + 3 * sp.turn
        return rows, logps, len(parts)
    for t, (res, p) in enumerate(zip(parts, prov)):
        n_prompt = len(res.prompt_ids or [])
        end = min(n_prompt + len(res.output_ids), n)
        start = int(getattr(res, "routed_experts_start", 0) or 0) if len(parts) > 1 else 0
        cached = p.cached_tokens if p is not None else 0
        pos = np.arange(start, max(start, end - 1))  # the last token's row comes with the next turn (or never)
        code = np.where(pos < cached, CACHED, np.where(pos < n_prompt, COMPUTED, GENERATED)) + 3 * t
        rows[pos] = code
        logps[n_prompt:end] = GENERATED + 3 * t
    return rows, logps, len(parts)


def build_segments(
    samples: Sequence[Any], batch: Any, provenances: Sequence[list[Provenance | None]] | None = None
) -> Segments:
    """The segments of ``samples`` laid out like ``batch`` (their :class:`RoutingTensors`: real tokens where
    ``attention_mask`` is 1, in order; or :class:`PackedRouting`: ``cu_seqlens``), built on the host once per
    batch. ``provenances``: per sample, per turn (default: read from the samples)."""
    provs = [sample_provenances(s) for s in samples] if provenances is None else list(provenances)
    lengths = [len(s.prompt_ids or []) + len(s.output_ids) for s in samples]
    per = [_codes(s, p, n) for s, p, n in zip(samples, provs, lengths)]
    n_turns = max((t for *_, t in per), default=1)
    names = tuple((seg, None if n_turns == 1 else t) for t in range(n_turns) for seg in K.SEGMENTS)
    if hasattr(batch, "attention_mask"):
        attn = batch.attention_mask.cpu().bool()
        rows = torch.full(tuple(attn.shape), -1, dtype=torch.long)
        logps, depths = rows.clone(), rows.clone()
        for b, (r, lp, _) in enumerate(per):
            cols = attn[b].nonzero().squeeze(-1)
            if cols.numel() != r.size:
                raise ShapeMismatchError(f"sample {b}: {r.size} tokens, the batch holds {cols.numel()}")
            rows[b, cols] = torch.from_numpy(r)
            logps[b, cols] = torch.from_numpy(lp)
            depths[b, cols] = torch.from_numpy(_depth_codes(lp))
        return Segments(rows, logps, names, depths)
    cu = batch.cu_seqlens.cpu().long()
    n_total = int(batch.input_ids.shape[0])
    logps = torch.full((n_total,), -1, dtype=torch.long)
    depths = logps.clone()
    for b, (_, lp, _) in enumerate(per):
        logps[int(cu[b]) : int(cu[b + 1])] = torch.from_numpy(lp)
        depths[int(cu[b]) : int(cu[b + 1])] = torch.from_numpy(_depth_codes(lp))
    rcu = batch.routing_cu_seqlens.cpu().long()
    rows = torch.full((int(batch.routed_experts_mask.shape[0]),), -1, dtype=torch.long)
    for b, (r, _, _) in enumerate(per):
        m = int(rcu[b + 1] - rcu[b])
        rows[int(rcu[b]) : int(rcu[b]) + m] = torch.from_numpy(r[:m])
    return Segments(rows, logps, names, depths)


def _depth_codes(logp_codes: np.ndarray) -> np.ndarray:
    """Per token position of one sample: its context-depth bucket where it has a log-prob code, else -1."""
    pos = np.arange(logp_codes.size)
    return np.where(logp_codes >= 0, np.searchsorted(np.asarray(DEPTH_EDGES), pos, side="right"), -1)
