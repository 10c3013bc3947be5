"""Prefill/decode disaggregation: one sample's rows from two servers, merged at the token where the decode server took
over, or refused (numpy only; core).

Under P/D a prefill server runs the prompt and hands its KV cache to a decode server, which generates. Each server
returns the rows it computed, checked by the one full check (:func:`rr_client.core.codec.check_routing`). The rule a
merge keeps (vLLM RFC #55584): **the rows must match the KV the decode server actually used**. The decode server
received the KV of the first ``received`` tokens (its provenance's ``cached_tokens`` with ``cache_tier="external"``,
or what the router says it transferred), so those tokens' rows are the prefill server's; every later token ran on
the decode server, so its rows are the decode server's. Refused, each with a typed error naming the sample and the
seam, never a merged tensor:

- the two halves of different models or shapes: engine or model, layer count, MoE layers, expert count, top-k or wire
  dtype differ (:class:`~rr_client.core.errors.SeamMismatchError`);
- a half that fails the full check (all-zero rows: SGLang #23885's overlap-scheduled prefill; ids out of range,
  repeats): the check's own errors;
- a gap: tokens before the seam the prefill rows do not cover, or after it the decode rows do not
  (:class:`~rr_client.core.errors.MissingRoutingError`);
- a decode server that returned rows for tokens it says it received (it recomputed what it claims to have
  received), and an overlap where both returned rows for the same token and they differ
  (:class:`~rr_client.core.errors.SeamMismatchError`);
- weights: the two servers at different weight versions, or either half spanning an update
  (:class:`~rr_client.core.errors.StaleRoutingError`).

The merge is recorded as a :class:`Seam` (which server made which rows, their spans and weight versions) for the
sample's provenance. By reference, a sample holds a :class:`SeamRef` (both servers' refs and the seam, every check
that needs no rows made when it is built); the trainer rank resolves both and merges them there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rr_client.core.codec import check_routing
from rr_client.core.errors import MalformedPayloadError, MissingRoutingError, SeamMismatchError, StaleRoutingError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.core.reference import RoutingRef

__all__ = [
    "Half",
    "Seam",
    "SeamRef",
    "joined_provenance",
    "merge_halves",
    "plan_seam",
    "SEAM_FIELD",
    "SEAM_REF_SCHEMA",
]

SEAM_FIELD = "rr_seam"  #: the key of a merged sample's seam in its meta / provenance record
SEAM_REF_SCHEMA = "rr.seam_ref/1"

_SAME = ("engine", "model", "num_hidden_layers", "num_experts", "topk", "moe_layers", "wire_dtype")


@dataclass(frozen=True, slots=True)
class Half:
    """One server's rows of one sample: ``rows`` ``[m, L, K]`` (or the :class:`RoutingRef` that holds them) for the
    token positions ``start .. start + m`` (row ``t`` routes token ``t``, the one that predicted token ``t + 1``),
    the server's :class:`RRInfo`, its name (``server``: a URL or a router's worker id) and its per-sample provenance
    (weight versions, cached tokens)."""

    rows: Any
    start: int
    info: RRInfo
    server: str
    provenance: Provenance | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """``(m, L, K)`` of the rows, held or referenced."""
        return self.rows.shape if isinstance(self.rows, RoutingRef) else np.shape(self.rows)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The rows' wire dtype, held or referenced."""
        return np.dtype(self.rows.dtype if isinstance(self.rows, RoutingRef) else np.asarray(self.rows).dtype)

    @property
    def stop(self) -> int:
        """One past the last token position this half routes."""
        return self.start + int(self.shape[0])


@dataclass(frozen=True, slots=True)
class Seam:
    """Where a P/D sample's rows were joined: token ``at`` is the first whose row is the decode server's."""

    at: int
    prefill_server: str
    prefill_span: tuple[int, int]
    decode_server: str
    decode_span: tuple[int, int]
    weight_version: int | None
    overlap: int = 0  #: tokens both servers returned rows for, equal (the decode server's kept)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object recorded as the sample's ``rr_seam``."""
        return {
            "at": self.at,
            "prefill": {"server": self.prefill_server, "span": list(self.prefill_span)},
            "decode": {"server": self.decode_server, "span": list(self.decode_span)},
            "weight_version": self.weight_version,
            "overlap": self.overlap,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = SEAM_FIELD) -> Seam:
        """Parse :meth:`to_dict`'s object; :class:`MalformedPayloadError` names the field."""
        try:
            p, dc = d["prefill"], d["decode"]
            seam = cls(
                at=int(d["at"]),
                prefill_server=str(p["server"]),
                prefill_span=(int(p["span"][0]), int(p["span"][1])),
                decode_server=str(dc["server"]),
                decode_span=(int(dc["span"][0]), int(dc["span"][1])),
                weight_version=None if d["weight_version"] is None else int(d["weight_version"]),
                overlap=int(d.get("overlap", 0)),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MalformedPayloadError(f"{where}: not a seam object ({type(e).__name__}: {e})") from None
        # a one-token completion's decode span is empty: its only token was sampled by the prefill server
        if not seam.prefill_span[0] < seam.at == seam.prefill_span[1] == seam.decode_span[0] <= seam.decode_span[1]:
            raise MalformedPayloadError(
                f"{where}: spans {list(seam.prefill_span)} and {list(seam.decode_span)} do not meet at token {seam.at}"
            )
        return seam


@dataclass(frozen=True, slots=True)
class SeamRef:
    """A P/D sample's routing by reference: the prefill server's ref (the prompt's rows), the decode server's (the
    rest) and the :class:`Seam` they join at, checked when built (:func:`plan_seam`); the trainer rank resolves both
    and merges them (:meth:`rr_client.RoutedExpertsClient.resolve_results`). ``weight_version`` is the decode
    half's; ``provenance`` is built from both halves (:func:`joined_provenance`)."""

    prefill: RoutingRef
    decode: RoutingRef
    seam: Seam
    schema: str = SEAM_REF_SCHEMA

    @property
    def weight_version(self) -> int:
        return self.decode.weight_version

    @property
    def provenance(self) -> Provenance | None:
        """The sample's provenance from both halves (:func:`joined_provenance`)."""
        return joined_provenance(self.prefill.provenance, self.decode.provenance)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows both refs point at."""
        return self.prefill.nbytes + self.decode.nbytes

    def halves(self, info: RRInfo, prefill_rows: Any, decode_rows: Any) -> tuple[Half, Half]:
        """The two :class:`Half` of this sample once its refs' rows are read."""
        s = self.seam
        return (
            Half(prefill_rows, self.prefill.start, info, s.prefill_server, self.prefill.provenance),
            Half(decode_rows, self.decode.start, info, s.decode_server, self.decode.provenance),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a P/D sample carries as its ref (to ship to trainer ranks)."""
        return {
            "schema": self.schema,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "seam": self.seam.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "seam ref") -> SeamRef:
        """Parse and check :meth:`to_dict`'s object (schema, both refs, the seam)."""
        if not isinstance(d, Mapping) or d.get("schema") != SEAM_REF_SCHEMA:
            got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
            raise MalformedPayloadError(f"{where}: expected schema {SEAM_REF_SCHEMA!r}, got {got!r}")
        seam = Seam.from_dict(d.get("seam"), f"{where}: seam")
        p = RoutingRef.from_dict(d.get("prefill"), f"{where}: prefill")
        dc = RoutingRef.from_dict(d.get("decode"), f"{where}: decode")
        if p.start != seam.prefill_span[0] or dc.start != seam.at or dc.start + dc.rows != seam.decode_span[1]:
            raise MalformedPayloadError(
                f"{where}: the refs cover tokens {p.start}..{p.start + p.rows} and {dc.start}..{dc.start + dc.rows}, "
                f"not the seam's {list(seam.prefill_span)} and {list(seam.decode_span)}"
            )
        return cls(p, dc, seam)


def joined_provenance(prefill: Provenance | None, decode: Provenance | None) -> Provenance | None:
    """A P/D sample's one provenance from its two halves', so a stale prefill half is refused like a stale decode
    half: the cache from the prefill half (the prompt's KV and rows came from its cache), weight-version spans from
    either half (an update on either server shows), preemptions and the tokens digest from the decode half (it ran
    the sample to its end). The decode server's own cache hits (SGLang's decode radix cache) under older weights keep
    the sample stale too. A half without provenance leaves what only it could say unknown (None); both: None."""
    if prefill is None and decode is None:
        return None
    p, d = prefill or Provenance(), decode or Provenance()
    first = p if prefill is not None else d  # the prompt's cache, as the decode server relays it when alone
    p_old = bool(p.cached_under_older_weights and p.cached_tokens)
    d_old = bool(d.cached_under_older_weights and d.cached_tokens)
    if p_old or d_old:
        older: bool | None = True
    elif prefill is None or p.cached_under_older_weights is None or d.cached_under_older_weights is None:
        older = None  # the prompt's cache epoch, or the decode server's own, not said
    else:
        older = False
    if p.spans_update or d.spans_update:
        during: bool | None = True
    elif prefill is None or decode is None or p.weight_update_during is None or d.weight_update_during is None:
        during = None  # a server that could not see every update (rr's sidecar), or did not say
    else:
        during = False
    admitted = p.weight_version_admitted if p.weight_version_admitted is not None else d.weight_version_admitted
    finished = d.weight_version_finished if d.weight_version_finished is not None else p.weight_version_finished
    return Provenance(
        cached_tokens=max(first.cached_tokens, d.cached_tokens) if d_old else first.cached_tokens,
        cache_tier=first.cache_tier,
        preemptions=d.preemptions if decode is not None else None,
        weight_version_admitted=admitted,
        weight_version_finished=finished,
        weight_update_during=during,
        tokens_digest=d.tokens_digest,
        cached_under_older_weights=older,
    )


def _same_model(p: Half, d: Half, where: str) -> None:
    for name in _SAME:
        a, b = getattr(p.info, name), getattr(d.info, name)
        if a != b:
            raise SeamMismatchError(
                f"{where}: the prefill server ({p.server}) and the decode server ({d.server}) differ in {name}: "
                f"{a!r} vs {b!r}; their rows cannot be joined into one sample"
            )
    for h in (p, d):
        if len(h.shape) != 3:  # the one check names what is wrong with it
            check_routing(h.rows, h.info)
    if p.dtype != d.dtype or p.shape[1:] != d.shape[1:]:
        raise SeamMismatchError(
            f"{where}: the prefill rows are {p.dtype} {list(p.shape)}, the decode rows {d.dtype} "
            f"{list(d.shape)}: width, layer count or dtype differ"
        )


def _version(h: Half, role: str, where: str) -> int | None:
    pv = h.provenance
    if pv is None:
        return None
    if pv.spans_update:
        raise StaleRoutingError(
            f"{where}: the {role} server ({h.server}) ran this sample across a weight update "
            f"(versions {pv.weight_version_admitted} -> {pv.weight_version_finished})"
        )
    return pv.weight_version_finished


def plan_seam(
    prefill: Half, decode: Half, *, received: int, total_rows: int, first: int = 0, where: str = "sample"
) -> Seam:
    """Every check of a join that needs no rows (held or by reference): the same model and shapes, the spans (no gap,
    no decode rows for received tokens), the weight versions; the :class:`Seam` it would make. ``received``,
    ``total_rows``, ``first``: as in :func:`merge_halves`."""
    _same_model(prefill, decode, where)
    end = first + total_rows
    if not first < received <= end:
        raise SeamMismatchError(
            f"{where}: the decode server received the KV of {received} tokens, outside the sample's routed tokens "
            f"{first}..{end}"
        )
    if prefill.start != first:
        raise MissingRoutingError(
            f"{where}: the prefill rows ({prefill.server}) start at token {prefill.start}, the sample's at {first}"
        )
    if prefill.stop < received:
        raise MissingRoutingError(
            f"{where}: the prefill rows ({prefill.server}) cover tokens {first}..{prefill.stop}, the decode server "
            f"received the KV of {received}: tokens {prefill.stop}..{received} have no row"
        )
    if decode.start < received:
        raise SeamMismatchError(
            f"{where}: the decode server ({decode.server}) returned rows from token {decode.start} on, yet says it "
            f"received the KV of tokens 0..{received}: it never ran those tokens (SGLang's decode rows there are "
            "leftovers of its buffer) or recomputed what it claims to have received; ask it for rows from token "
            f"{received} (routed_experts_start_len)"
        )
    if decode.start > received:
        raise MissingRoutingError(
            f"{where}: the decode rows ({decode.server}) start at token {decode.start}, the decode server took over "
            f"at {received}: tokens {received}..{decode.start} have no row"
        )
    if prefill.stop > end:
        raise SeamMismatchError(
            f"{where}: the prefill server ({prefill.server}) returned {prefill.shape[0]} rows (tokens "
            f"{prefill.start}..{prefill.stop}), past the sample's {end - first} routed tokens ({first}..{end}): its "
            "rows are not this sample's"
        )
    if decode.stop != end:
        raise MissingRoutingError(
            f"{where}: the decode rows ({decode.server}) end at token {decode.stop}, the sample's at {end}"
        )
    pv, dv = _version(prefill, "prefill", where), _version(decode, "decode", where)
    if pv is not None and dv is not None and pv != dv:
        raise StaleRoutingError(
            f"{where}: the prefill server ({prefill.server}) is at weight version {pv}, the decode server "
            f"({decode.server}) at {dv}: the decode tokens attended to KV computed under other weights"
        )
    return Seam(
        at=received,
        prefill_server=prefill.server,
        prefill_span=(first, received),
        decode_server=decode.server,
        decode_span=(received, end),
        weight_version=pv if pv is not None else dv,
        overlap=max(prefill.stop - received, 0),
    )


def merge_halves(
    prefill: Half,
    decode: Half,
    *,
    received: int,
    total_rows: int,
    first: int = 0,
    where: str = "sample",
    checked: bool = False,
) -> tuple[np.ndarray, Seam]:
    """The sample's rows ``[total_rows, L, K]`` from its prefill and decode halves, joined at token ``received``
    (the tokens whose KV the decode server received), and the :class:`Seam`. ``first``: the sample's first routed
    token (``routed_experts_start``); ``total_rows``: its rows from there, ``prompt + completion - 1 - first``;
    ``checked``: both halves' rows already passed the one full check (a parsed answer, a resolved ref), so it is not
    run twice. Every refusal is in the module docstring."""
    seam = plan_seam(prefill, decode, received=received, total_rows=total_rows, first=first, where=where)
    if checked:
        p_rows, d_rows = np.asarray(prefill.rows), np.asarray(decode.rows)
    else:
        p_rows = check_routing(prefill.rows, prefill.info, rows=prefill.shape[0]).array
        d_rows = check_routing(decode.rows, decode.info, rows=decode.shape[0]).array
    if seam.overlap:  # tokens the prefill server routed but whose KV it did not hand over
        differ = (np.sort(p_rows[received - first :], -1) != np.sort(d_rows[: seam.overlap], -1)).any(axis=(1, 2))
        if differ.any():
            bad = int(np.flatnonzero(differ)[0]) + received
            raise SeamMismatchError(
                f"{where}: both servers returned rows for tokens {received}..{prefill.stop} and they differ "
                f"(first at token {bad}); the decode server recomputed them, the prefill rows are not what ran"
            )
    return np.concatenate([p_rows[: received - first], d_rows]), seam
