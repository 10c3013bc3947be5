"""Provenance of one sample's routing rows: which KV cache and which weights made them, as the engine says, and the
policy that refuses (or masks) rows that may come from another forward than the sample's tokens. Torch- and
httpx-free (core). Spec: docs/wire-format.md, "Provenance".

Every rr server answers, per sample, ``meta_info["rr_provenance"]`` (an OpenAI choice: ``choice["rr_provenance"]``;
a :class:`rr_client.RoutingRef`: its ``provenance``)::

    {"schema": "rr.provenance/1",
     "cached_tokens": 12,              # prompt tokens served from the prefix cache (their rows were not recomputed)
     "cache_tier": "device",           # where those came from, when the engine says: device | host | storage |
                                       #   external (a KV connector); null when unknown or no hit
     "preemptions": 0,                 # times the request was preempted / retracted and re-prefilled; null: unknown
     "weight_version_admitted": 3,     # the server's weight version (weight updates it has seen) at admission ...
     "weight_version_finished": 3,     # ... and at finish
     "weight_update_during": false,    # a weight update began or ended while the request ran; null: the server
                                       #   could not see every update (rr's sidecar with updates pushed past it)
     "cached_under_older_weights": false,  # its cached tokens may come from KV computed under older weights (the
                                       #   prefix cache was not cleared since the last update); null: not said
     "tokens_digest": "9f..."}         # tokens_digest(prompt ids, output ids): what the rows belong to

and, only on a sample the source audit re-scored (:mod:`rr_client.core.source_audit`; set by the client's
``source_audit``, never by the engine), ``"source_checked": true``, ``"source_agreement"`` (share of cells the
engine's own re-score of the tokens gives back) and ``"source_flagged"`` (the sample, a segment or a depth bucket fell
below the audit's threshold; with ``fail_closed``, also a sample the audit could not re-score). A flagged sample is
stale: the policy refuses or masks it like one recomputed across an update.

A sample that **spans** a weight update without a recompute keeps rows and log-probs that agree token by token (each
token's rows and log-prob come from the same forward): it is kept and flagged. A sample that spans an update and was
preempted (or whose preemptions the engine does not report) **may have been recomputed across it**: its prompt's
(and earlier tokens') rows were overwritten under the new weights while its tokens and log-probs keep the old. The
policy (:func:`check_provenance`) refuses it with :class:`StaleRoutingError`, or with ``stale_rows="mask"`` keeps it
with replay masked off for the whole sample, and counts both. A sample admitted after an update whose prefix-cache
hit may be KV computed before it (``cached_under_older_weights``: the cache was not cleared since) is treated the
same way: its cached tokens' rows and the KV its tokens attended to come from the older weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from rr_client.core.errors import ConfigurationError, MalformedPayloadError, StaleRoutingError
from rr_client.core.source_audit import SourceAgreement, merge_agreements

__all__ = [
    "PROVENANCE_FIELD",
    "PROVENANCE_SCHEMA",
    "CacheTier",
    "StalePolicy",
    "Provenance",
    "ProvenanceCheck",
    "tokens_digest",
    "check_provenance",
    "check_stale_policy",
]

PROVENANCE_FIELD = "rr_provenance"  #: the key of a sample's provenance in meta_info / an OpenAI choice
PROVENANCE_SCHEMA = "rr.provenance/1"

CacheTier = Literal["device", "host", "storage", "external"]
"""Where an engine says a prefix-cache hit came from (``external``: a KV connector, e.g. vLLM's offloading)."""

StalePolicy = Literal["refuse", "mask", "off"]
"""What to do with a sample that may have been recomputed across a weight update: raise (``"refuse"``, rr's default
everywhere rows enter a session), keep it unreplayed (``"mask"``), or nothing (``"off"``: the policy turned off on
purpose; such samples are replayed as they are and counted under ``spans_update``)."""

_TIERS: tuple[str, ...] = get_args(CacheTier)
_POLICIES: tuple[str, ...] = get_args(StalePolicy)


def tokens_digest(prompt_ids: Sequence[int] | np.ndarray, output_ids: Sequence[int] | np.ndarray) -> str:
    """32 hex chars binding rows to their tokens: blake2b over the prompt length and every id (int64 LE), so the
    same ids split differently between prompt and output give another digest."""
    p = np.asarray(prompt_ids, dtype="<i8").ravel()
    o = np.asarray(output_ids, dtype="<i8").ravel()
    h = hashlib.blake2b(digest_size=16)
    h.update(np.array([p.size], dtype="<i8").tobytes())
    h.update(p.tobytes())
    h.update(o.tobytes())
    return h.hexdigest()


def _opt_int(d: Mapping[str, Any], name: str, where: str) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MalformedPayloadError(f"{where}: {name} must be a non-negative int or null, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class Provenance:
    """Which cache and weights made one sample's rows (see the module docstring for each field)."""

    cached_tokens: int = 0
    cache_tier: str | None = None
    preemptions: int | None = None
    weight_version_admitted: int | None = None
    weight_version_finished: int | None = None
    weight_update_during: bool | None = False
    tokens_digest: str | None = None
    cached_under_older_weights: bool | None = None
    source_checked: bool = False
    source_agreement: float | None = None
    source_flagged: bool = False
    #: the audit's counts by segment, depth and layer (client side only; not on the wire)
    source_detail: SourceAgreement | None = field(default=None, compare=False, repr=False)
    #: the same for the sparse-attention indexer's picks, when the sample carried them (client side only)
    source_indexer: SourceAgreement | None = field(default=None, compare=False, repr=False)

    @property
    def spans_update(self) -> bool:
        """A weight update began or ended between the request's admission and its finish."""
        a, f = self.weight_version_admitted, self.weight_version_finished
        return bool(self.weight_update_during) or (a is not None and f is not None and a != f)

    @property
    def weights_unknown(self) -> bool:
        """The server could not see every weight update (``weight_update_during`` null: rr's sidecar, updates pushed
        straight to the engine): whether one ran while the sample did is not known. The policy keeps such a sample
        and counts it as unknown, as it does a sample without provenance."""
        return self.weight_update_during is None

    @property
    def may_be_recomputed_across_update(self) -> bool:
        """Spans an update and was preempted / retracted (or the engine does not say): rows may be from new weights
        while tokens and log-probs are from the old."""
        return self.spans_update and (self.preemptions is None or self.preemptions > 0)

    @property
    def stale(self) -> bool:
        """Rows that may not belong to the weights the tokens were sampled with: recomputed across an update, or
        cached tokens from KV computed under older weights. What the policy refuses or masks."""
        return (
            self.may_be_recomputed_across_update
            or bool(self.cached_under_older_weights and self.cached_tokens)
            or self.source_flagged
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a server answers as ``rr_provenance`` (the source fields only once audited)."""
        audited = (
            {"source_checked": True, "source_agreement": self.source_agreement, "source_flagged": self.source_flagged}
            if self.source_checked
            else {}
        )
        return {
            "schema": PROVENANCE_SCHEMA,
            "cached_tokens": self.cached_tokens,
            "cache_tier": self.cache_tier,
            "preemptions": self.preemptions,
            "weight_version_admitted": self.weight_version_admitted,
            "weight_version_finished": self.weight_version_finished,
            "weight_update_during": self.weight_update_during,
            "cached_under_older_weights": self.cached_under_older_weights,
            "tokens_digest": self.tokens_digest,
            **audited,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = PROVENANCE_FIELD) -> Provenance:
        """Parse and check every field; :class:`MalformedPayloadError` names the one that is wrong."""
        if not isinstance(d, Mapping):
            raise MalformedPayloadError(f"{where} must be an object, got {type(d).__name__}")
        if d.get("schema") != PROVENANCE_SCHEMA:
            raise MalformedPayloadError(f"{where}: schema {d.get('schema')!r}, this client reads {PROVENANCE_SCHEMA!r}")
        unknown = sorted(set(d) - {"schema", *cls.__dataclass_fields__})
        if unknown:
            raise MalformedPayloadError(f"{where}: unknown fields {unknown}")
        cached = _opt_int(d, "cached_tokens", where)
        tier = d.get("cache_tier")
        if tier is not None and tier not in _TIERS:
            raise MalformedPayloadError(f"{where}: cache_tier {tier!r}, expected one of {list(_TIERS)} or null")
        during = d.get("weight_update_during", False)
        if during is not None and not isinstance(during, bool):
            raise MalformedPayloadError(f"{where}: weight_update_during must be a bool or null, got {during!r}")
        older = d.get("cached_under_older_weights")
        if older is not None and not isinstance(older, bool):
            raise MalformedPayloadError(f"{where}: cached_under_older_weights must be a bool or null, got {older!r}")
        digest = d.get("tokens_digest")
        if digest is not None and not (isinstance(digest, str) and len(digest) == 32):
            raise MalformedPayloadError(f"{where}: tokens_digest must be 32 hex chars or null, got {digest!r}")
        checked, flagged, share = (
            d.get("source_checked", False),
            d.get("source_flagged", False),
            d.get("source_agreement"),
        )
        if not isinstance(checked, bool) or not isinstance(flagged, bool):
            raise MalformedPayloadError(f"{where}: source_checked and source_flagged must be bools")
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1
        ):
            raise MalformedPayloadError(f"{where}: source_agreement must be a number in [0, 1] or null, got {share!r}")
        return cls(
            cached_tokens=cached or 0,
            cache_tier=tier,
            preemptions=_opt_int(d, "preemptions", where),
            weight_version_admitted=_opt_int(d, "weight_version_admitted", where),
            weight_version_finished=_opt_int(d, "weight_version_finished", where),
            weight_update_during=during,
            tokens_digest=digest,
            cached_under_older_weights=older,
            source_checked=checked,
            source_agreement=None if share is None else float(share),
            source_flagged=flagged,
        )


@dataclass(frozen=True, slots=True)
class ProvenanceCheck:
    """What :func:`check_provenance` decided for a batch: ``replay[i]`` False for a sample kept with replay masked
    off; counts of samples masked, flagged (spanning an update without a recompute) and without provenance, and of
    samples the source audit re-scored / flagged."""

    replay: tuple[bool, ...]
    masked: int
    spans_update: int
    unknown: int
    cached_tokens: int
    source_checked: int = 0
    source_flagged: int = 0
    source: SourceAgreement | None = None  #: the re-scored samples' counts, summed
    source_indexer: SourceAgreement | None = None  #: the same for their indexer picks


def check_stale_policy(policy: object) -> StalePolicy:
    """``policy`` if it is a :data:`StalePolicy`, else :class:`ConfigurationError` naming what rr accepts."""
    if policy not in _POLICIES:
        raise ConfigurationError(f"stale_rows={policy!r}: expected one of {list(_POLICIES)}")
    return policy  # type: ignore[return-value]


def check_provenance(
    provenances: Sequence[Provenance | None], policy: StalePolicy = "refuse", *, where: str = "sample"
) -> ProvenanceCheck:
    """Apply the stale-rows policy to one batch: a sample that may have been recomputed across a weight update, or
    whose cached tokens come from KV of older weights (:attr:`Provenance.stale`), raises :class:`StaleRoutingError`
    (``"refuse"``, naming it) or is kept unreplayed (``"mask"``); a sample that
    spans an update without a recompute is kept and counted; ``None`` (a server without provenance) and a provenance
    whose weights are unknown (:attr:`Provenance.weights_unknown`) are counted as unknown.
    ``"off"``: nothing is refused or masked (every sample spanning an update is counted as such)."""
    check_stale_policy(policy)
    replay: list[bool] = []
    masked = spans = unknown = cached = checked = flagged = 0
    for i, p in enumerate(provenances):
        if p is None:
            unknown += 1
            replay.append(True)
            continue
        cached += p.cached_tokens
        unknown += p.weights_unknown
        checked += p.source_checked
        flagged += p.source_flagged
        if p.stale and policy != "off":
            if policy == "refuse":
                raise StaleRoutingError(_why_stale(p, f"{where} {i}"))
            masked += 1
            replay.append(False)
            continue
        spans += p.spans_update
        replay.append(True)
    source = merge_agreements([p.source_detail for p in provenances if p is not None and p.source_detail is not None])
    idx = merge_agreements([p.source_indexer for p in provenances if p is not None and p.source_indexer is not None])
    return ProvenanceCheck(tuple(replay), masked, spans, unknown, cached, checked, flagged, source, idx)


def _why_stale(p: Provenance, who: str) -> str:
    """The refusal of a stale sample, naming what made it stale and the way out."""
    if p.source_flagged:
        why = "the engine's own re-score of its tokens does not give its rows back (source audit: " + (
            f"agreement {p.source_agreement:.3f})"
            if p.source_agreement is not None
            else "not re-scored, and the audit fails closed)"
        )
    elif p.may_be_recomputed_across_update:
        why = (
            f"its rows may have been recomputed under other weights than its tokens were sampled with (preemptions "
            f"{p.preemptions}, weight version {p.weight_version_admitted} at admission, {p.weight_version_finished} at "
            f"finish, update during: {p.weight_update_during})"
        )
    else:
        why = (
            f"its {p.cached_tokens} cached tokens may come from KV computed under older weights than version "
            f"{p.weight_version_admitted} (the server's prefix cache was not cleared after the last update: reset it "
            "after each push, e.g. rr's DiskWeightSync, or pause with clear_cache)"
        )
    return f"{who}: {why}; pass stale_rows='mask' to keep such samples without replay"
