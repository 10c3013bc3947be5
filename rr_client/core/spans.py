"""Provenance spans: a training datum's tokens as slices of sampled sequences, resolved to exactly their routing
rows. The schema hosted R3 services use (a session-scoped ``sequence_id``; a datum's prompt and sampled spans, each
``sequence_id``, ``offset``, ``length``, in tiling order), on rr's refs. Core: no torch, no httpx.

A :class:`SequenceBook` holds one session's sequences: each id names a sample's :class:`RoutingRef` and its tokens,
bound to each other by the ref's tokens digest when added (:func:`rr_client.core.reference.check_ref_tokens`).
:meth:`SequenceBook.plan` turns a datum's spans into the row ranges of the refs to read, after checking them all
(:class:`ProvenanceSpanError` for spans that do not tile, overlap, point past a sequence or its rows, name an
unknown sequence, or whose datum tokens are not the sequence's; :class:`RoutingExpiredError` for a retired one);
:meth:`rr_client.RoutedExpertsClient.resolve_spans` reads the refs with the one check and joins the slices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rr_client.core.errors import ProvenanceSpanError, RoutingExpiredError
from rr_client.core.reference import RoutingRef, check_ref_tokens

__all__ = ["ProvenanceSpan", "SequenceBook", "SpanPlan", "SpanSlice"]

_KINDS = ("prompt", "sampled")


@dataclass(frozen=True, slots=True)
class ProvenanceSpan:
    """``length`` tokens of sequence ``sequence_id`` from its token ``offset`` (prompt and output counted as one
    list), at the datum's next position; ``kind``: ``"prompt"`` or ``"sampled"`` (what the datum says they were);
    ``datum_offset``: where in the datum they start, when the datum states it (checked against the tiling)."""

    sequence_id: str
    offset: int
    length: int
    kind: str = "sampled"
    datum_offset: int | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str = "span") -> ProvenanceSpan:
        """A span from its JSON object (``sequence_id``, ``offset``, ``length``; ``kind`` or ``type``:
        ``prompt``/``sampled``; optional ``datum_offset``); :class:`ProvenanceSpanError` naming the field."""
        if isinstance(d, ProvenanceSpan):
            return d
        if not isinstance(d, Mapping):
            raise ProvenanceSpanError(f"{where} must be an object, got {type(d).__name__}")
        sid = d.get("sequence_id")
        if not isinstance(sid, str) or not sid:
            raise ProvenanceSpanError(f"{where}: sequence_id must be a non-empty string, got {sid!r}")
        kind = d.get("kind", d.get("type", "sampled"))
        if kind not in _KINDS:
            raise ProvenanceSpanError(f"{where}: kind {kind!r}, expected one of {list(_KINDS)}")
        ints = {}
        for name in ("offset", "length", "datum_offset"):
            v = d.get(name)
            if v is None and name == "datum_offset":
                ints[name] = None
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise ProvenanceSpanError(f"{where}: {name} must be an integer, got {v!r}")
            ints[name] = v
        return cls(sid, ints["offset"], ints["length"], kind, ints["datum_offset"])


@dataclass(frozen=True, slots=True)
class SpanSlice:
    """Rows ``[row_start, row_stop)`` of ``ref`` (token rows of the sequence, minus the ref's ``start``)."""

    ref: RoutingRef
    row_start: int
    row_stop: int


@dataclass(frozen=True, slots=True)
class SpanPlan:
    """What a datum's spans read: each span's slice, in datum order."""

    slices: tuple[SpanSlice, ...]

    @property
    def tokens(self) -> int:
        """The datum's token count: what the slices cover."""
        return sum(s.row_stop - s.row_start for s in self.slices)

    @property
    def refs(self) -> list[RoutingRef]:
        """The distinct refs the slices read, in first-use order."""
        return list({(s.ref.store, s.ref.key): s.ref for s in self.slices}.values())


@dataclass(frozen=True, slots=True)
class _Entry:
    ref: RoutingRef
    tokens: tuple[int, ...]


class SequenceBook:
    """One session's sequences by id: each a sample's ref and its tokens (prompt then output), bound by the ref's
    tokens digest. ``session``: a name for messages (ids are unique within a book, not across books)."""

    def __init__(self, session: str = "") -> None:
        self.session = session
        self._seq: dict[str, _Entry] = {}
        self._retired: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, sequence_id: object) -> bool:
        return sequence_id in self._seq

    def add(self, sequence_id: str, ref: RoutingRef, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Hold ``ref`` as sequence ``sequence_id`` with its tokens; :class:`StaleRoutingError` when the ref's
        digest says the rows belong to other tokens, :class:`ProvenanceSpanError` for an id already held or a ref
        without a tokens digest (nothing would bind its rows to these tokens)."""
        if not isinstance(sequence_id, str) or not sequence_id:
            raise ProvenanceSpanError(f"sequence_id must be a non-empty string, got {sequence_id!r}")
        if not isinstance(ref, RoutingRef):
            raise ProvenanceSpanError(f"sequence {sequence_id}: expected a RoutingRef, got {type(ref).__name__}")
        if sequence_id in self._seq or sequence_id in self._retired:
            raise ProvenanceSpanError(
                f"{self._where()}sequence {sequence_id!r} is already held: ids are session-unique"
            )
        if ref.provenance is None or ref.provenance.tokens_digest is None:
            raise ProvenanceSpanError(
                f"{self._where()}sequence {sequence_id!r}: its ref carries no tokens digest (a server without "
                "provenance), so its rows cannot be bound to the sequence's tokens"
            )
        check_ref_tokens(ref, prompt_ids, output_ids, where=f"sequence {sequence_id}")
        self._seq[sequence_id] = _Entry(ref, tuple(int(t) for t in (*prompt_ids, *output_ids)))

    def add_result(self, sequence_id: str, result: Any) -> None:
        """Hold a :class:`rr_client.GenerateResult` (its ``routing_ref``, ``prompt_ids`` and ``output_ids``)."""
        ref = getattr(result, "routing_ref", None)
        if not isinstance(ref, RoutingRef):
            raise ProvenanceSpanError(
                f"sequence {sequence_id}: the result carries no routing ref (ask routed_experts_format='ref')"
            )
        self.add(sequence_id, ref, result.prompt_ids or [], result.output_ids)

    def tokens(self, sequence_id: str) -> tuple[int, ...]:
        """Sequence ``sequence_id``'s tokens (prompt then output)."""
        return self._entry(sequence_id).tokens

    def retire(self, through: int) -> int:
        """Forget every sequence whose rows were made under weight version <= ``through`` (as the store retires
        them); a span naming one then raises :class:`RoutingExpiredError`. How many were retired."""
        gone = [s for s, e in self._seq.items() if e.ref.weight_version <= through]
        for s in gone:
            self._retired[s] = self._seq.pop(s).ref.weight_version
        return len(gone)

    def _where(self) -> str:
        return f"session {self.session}: " if self.session else ""

    def _entry(self, sequence_id: str) -> _Entry:
        e = self._seq.get(sequence_id)
        if e is not None:
            return e
        if sequence_id in self._retired:
            raise RoutingExpiredError(
                f"{self._where()}sequence {sequence_id!r} was retired with weight version {self._retired[sequence_id]}"
            )
        raise ProvenanceSpanError(
            f"{self._where()}no sequence {sequence_id!r} in this book ({len(self._seq)} held): add it first"
        )

    def plan(self, spans: Sequence[ProvenanceSpan | Mapping[str, Any]], datum_tokens: Sequence[int]) -> SpanPlan:
        """The row slices ``spans`` name, checked whole before any row is read: they tile ``datum_tokens`` in order
        (no gap, no overlap, lengths adding up to it), each lies inside its sequence's tokens and rows, and the datum's
        tokens there are the sequence's."""
        datum = [int(t) for t in datum_tokens]
        if not spans:
            raise ProvenanceSpanError("no spans: a datum needs at least one")
        pos = 0
        out: list[SpanSlice] = []
        for i, raw in enumerate(spans):
            where = f"{self._where()}spans[{i}]"
            s = ProvenanceSpan.from_dict(raw, where)
            if s.length < 1 or s.offset < 0:
                raise ProvenanceSpanError(
                    f"{where}: offset {s.offset} and length {s.length}: need offset >= 0, length >= 1"
                )
            if s.datum_offset is not None and s.datum_offset != pos:
                how = "overlaps the span before it" if s.datum_offset < pos else "leaves a gap after the span before it"
                raise ProvenanceSpanError(
                    f"{where} starts at datum token {s.datum_offset}, but the spans before it end at {pos}: it {how}"
                )
            e = self._entry(s.sequence_id)
            stop = s.offset + s.length
            if stop > len(e.tokens):
                raise ProvenanceSpanError(
                    f"{where}: tokens [{s.offset}, {stop}) of sequence {s.sequence_id!r} point past its "
                    f"{len(e.tokens)} tokens"
                )
            first, last = e.ref.start, e.ref.start + e.ref.rows
            if s.offset < first or stop > last:
                raise ProvenanceSpanError(
                    f"{where}: tokens [{s.offset}, {stop}) of sequence {s.sequence_id!r}, which has routing rows "
                    f"for tokens [{first}, {last}) only (the last sampled token is never run)"
                )
            if pos + s.length > len(datum):
                raise ProvenanceSpanError(
                    f"{where}: the spans cover more than the datum's {len(datum)} tokens (through {pos + s.length})"
                )
            if datum[pos : pos + s.length] != list(e.tokens[s.offset : stop]):
                bad = next(j for j, (a, b) in enumerate(zip(datum[pos:], e.tokens[s.offset : stop])) if a != b)
                raise ProvenanceSpanError(
                    f"{where}: datum token {pos + bad} is {datum[pos + bad]}, but sequence {s.sequence_id!r}'s token "
                    f"{s.offset + bad} is {e.tokens[s.offset + bad]}: the span names other tokens than the datum's"
                )
            out.append(SpanSlice(e.ref, s.offset - first, stop - first))
            pos += s.length
        if pos != len(datum):
            raise ProvenanceSpanError(
                f"{self._where()}the spans cover {pos} tokens, the datum has {len(datum)}: they do not tile it"
            )
        return SpanPlan(tuple(out))
