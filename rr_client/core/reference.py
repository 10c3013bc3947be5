"""Routing by reference: :class:`RoutingRef` (a few hundred bytes that point at checked rows held where they were
made) and the binary frame the read route answers with. Torch- and httpx-free (core).

A server asked for ``routed_experts_format="ref"`` keeps the checked rows in its bounded store and answers
``meta_info["routed_experts_ref"]`` instead of the array; a trainer rank resolves only its own samples' refs,
straight from the server (``POST /rr/routing/read``) or from Ray's object store. Spec: docs/wire-format.md.

The frame (``application/x-rr-routing``), safetensors-style::

    8 bytes   little-endian u64: N, the header's length
    N bytes   UTF-8 JSON: {"schema": "rr.routing_rows/1", "parts": [{"key", "start", "stop", "shape", "dtype",
              "offset", "nbytes", "checksum"}, ...]}   (offsets into the data, parts in request order)
    data      each part's rows, C order, raw (1 byte per routing entry as uint8: no base64); parts that are the
              same rows (one key asked twice) share one offset, parts whose rows overlap (ranges of one key the
              server read as one run) name offsets inside the same bytes: each stored row is sent once

Every header field is checked before any byte of data is used.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from rr_client.core.codec import checked_count
from rr_client.core.errors import MalformedPayloadError, RoutingChecksumError, StaleRoutingError
from rr_client.core.provenance import Provenance, tokens_digest

__all__ = [
    "REF_SCHEMA",
    "ROWS_SCHEMA",
    "FRAME_MEDIA_TYPE",
    "READ_PATH",
    "RETIRE_PATH",
    "MAX_READ_BYTES",
    "RoutingRef",
    "checksum",
    "encode_frame",
    "decode_frame",
    "FramePart",
    "check_ref_tokens",
]

REF_SCHEMA = "rr.routing_ref/1"
ROWS_SCHEMA = "rr.routing_rows/1"
FRAME_MEDIA_TYPE = "application/x-rr-routing"
READ_PATH = "/rr/routing/read"  #: every rr server's read route (POST, JSON refs -> frame)
#: rows' bytes one read may answer (and hash) by default: the server's cap (``RR_ROUTING_READ_BYTES``), the
#: client's split (a server with a lower cap says it in its 413, and the client splits by that)
MAX_READ_BYTES = 128 << 20
RETIRE_PATH = "/rr/routing/retire"  #: every rr server's retire route (POST {"through": V})
_DTYPES = ("uint8", "uint16", "uint32")  # uint32: indexer rows of samples over 65,536 tokens
KINDS = ("routing", "indexer")  #: what a ref holds: expert routing, or sparse-attention indexer picks
_MAX_HEADER = 64 * 1024 * 1024
_MAX_DEPTH = 8  #: nesting a frame header may have (its own is 4: object, parts, part, shape)
_MAX_AXIS = 65536  #: layers and top-k of a part (MAX_EXPERTS bounds top-k; no model has more layers)
_JSON_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _json_depth(raw: bytes) -> int:
    """How deep ``raw``'s arrays and objects nest (brackets inside strings not counted), without recursion."""
    brackets = np.frombuffer(_JSON_STRINGS.sub(b'""', raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def checksum(rows: np.ndarray) -> str:
    """``blake2b-128:<hex>`` of the rows' bytes in C order (what a ref promises and the frame carries)."""
    return "blake2b-128:" + hashlib.blake2b(np.ascontiguousarray(rows).data, digest_size=16).hexdigest()


def _field(d: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    v = d.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0):
        raise MalformedPayloadError(
            f"{where}: field {name!r} must be a{' non-negative' if kind is int else ''} {kind.__name__}, got {v!r}"
        )
    return v


@dataclass(frozen=True, slots=True)
class RoutingRef:
    """Where one sample's checked routing rows are held, and what they must be.

    ``store``: the id of the store instance that holds them (a restarted server has a new one, so its old refs
    are refused, never answered with other rows); ``url``: where to read them (``http(s)://`` an rr server,
    ``ray://<actor>`` a Ray store actor); ``key``: the rows' key in that store; ``rows`` x ``layers`` x ``topk``
    in ``dtype``; ``start``: the request's ``routed_experts_start`` (row 0 is token row ``start``);
    ``weight_version``: the server's weight version when the rows were made (retired with it);
    ``checksum``: of the rows' bytes (:func:`checksum`); ``provenance``: which cache and weights made the rows and
    the digest of the tokens they belong to (:class:`rr_client.core.provenance.Provenance`; None from a server without
    it), what :func:`check_ref_tokens` binds the ref to its sample with.
    """

    store: str
    url: str
    key: str
    rows: int
    layers: int
    topk: int
    dtype: str
    start: int
    weight_version: int
    checksum: str
    schema: str = REF_SCHEMA
    provenance: Provenance | None = None
    kind: str = "routing"  #: :data:`KINDS`: ``layers`` x ``topk`` are indexer layers x index_topk for "indexer"

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, self.layers, self.topk)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows it points at (1 per entry as uint8, 2 as uint16)."""
        return self.rows * self.layers * self.topk * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        """The JSON object an answer carries as ``routed_experts_ref`` (``provenance`` only when known)."""
        d = asdict(replace(self, provenance=None))
        del d["provenance"]
        if self.kind == "routing":  # the field older readers do not know is sent only when it says something
            del d["kind"]
        if self.provenance is not None:
            d["provenance"] = self.provenance.to_dict()
        return d

    def with_url(self, url: str) -> RoutingRef:
        """The same ref read from ``url`` (a client fills in the URL it asked when the server gave none)."""
        return replace(self, url=url)

    @classmethod
    def from_dict(cls, d: Any, where: str = "routed_experts_ref") -> RoutingRef:
        """Parse and check every field (schema, types, dtype); :class:`MalformedPayloadError` names the field."""
        if not isinstance(d, Mapping):
            raise MalformedPayloadError(f"{where} must be an object, got {type(d).__name__}")
        if d.get("schema") != REF_SCHEMA:
            raise MalformedPayloadError(f"{where}: schema {d.get('schema')!r}, this client reads {REF_SCHEMA!r}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise MalformedPayloadError(f"{where}: unknown fields {unknown}")
        kw = {n: _field(d, n, str, where) for n in ("store", "url", "key", "dtype", "checksum")}
        kw.update({n: _field(d, n, int, where) for n in ("rows", "layers", "topk", "start", "weight_version")})
        if kw["dtype"] not in _DTYPES:
            raise MalformedPayloadError(f"{where}: dtype {kw['dtype']!r}, expected one of {list(_DTYPES)}")
        if not kw["key"] or not kw["store"]:
            raise MalformedPayloadError(f"{where}: empty key or store")
        prov = d.get("provenance")
        kw["provenance"] = None if prov is None else Provenance.from_dict(prov, f"{where}: provenance")
        kw["kind"] = d.get("kind", "routing")
        if kw["kind"] not in KINDS:
            raise MalformedPayloadError(f"{where}: kind {kw['kind']!r}, expected one of {list(KINDS)}")
        return cls(**kw)


def check_ref_tokens(ref: RoutingRef, prompt_ids: Sequence[int], output_ids: Sequence[int], *, where: str = "") -> None:
    """:class:`StaleRoutingError` naming the ref when its provenance's ``tokens_digest`` is not the digest of
    ``prompt_ids`` + ``output_ids``: the rows belong to another sample (a trainer's bookkeeping paired them wrong).
    A ref without a digest (a server without provenance) binds to nothing and passes."""
    want = ref.provenance.tokens_digest if ref.provenance is not None else None
    if want is None:
        return
    got = tokens_digest(prompt_ids, output_ids)
    if got != want:
        raise StaleRoutingError(
            f"routing ref {ref.key}{f' ({where})' if where else ''}: its rows belong to other tokens than the sample it was paired with "
            f"(the ref's tokens digest {want}, the sample's {got} over {len(prompt_ids)} prompt + "
            f"{len(output_ids)} output ids): the rows of another sample would be replayed"
        )


@dataclass(frozen=True, slots=True)
class FramePart:
    """One part of a frame: rows ``[start, stop)`` of ``key``, as held, and their :func:`checksum`."""

    key: str
    start: int
    stop: int
    rows: np.ndarray
    digest: str = ""


def encode_frame(
    parts: Sequence[FramePart], runs: Sequence[FramePart] = (), meta: Mapping[str, Any] | None = None
) -> bytes:
    """The read route's body: header (shapes, dtypes, offsets, checksums) then the rows' raw bytes.

    A part's ``digest`` is used as given (a store keeps it from store time), else computed over the bytes the
    entry names. The same part object given twice is written once: both header entries name its offset (a request
    naming one key N times costs one copy of the rows, not N). With ``runs`` (merged reads: each run a key's rows
    ``[start, stop)``, the runs of one key disjoint), every part lies inside a run of its key: only the runs are
    written, once each, and each part's entry names its rows' offset inside its run (asks that overlap share
    bytes; the header is still one entry per part, which readers slice the data by). ``meta``: a JSON object the
    header carries as ``meta`` (an object store's record of who wrote the rows, when, under which weights)."""
    located = _run_index(runs)
    header: list[dict[str, Any]] = []
    data: list[memoryview] = []
    placed: dict[int, dict[str, Any]] = {}
    run_at: dict[int, tuple[int, np.ndarray]] = {}  # id(run) -> (its offset in the data, its rows), once written
    offset = 0
    for p in parts:
        entry = placed.get(id(p))
        if entry is None:
            if runs:
                run = _run_of(located, p)
                if id(run) not in run_at:
                    whole = np.ascontiguousarray(run.rows)
                    run_at[id(run)] = (offset, whole)
                    data.append(whole.data)
                    offset += whole.nbytes
                base, whole = run_at[id(run)]
                a = whole[p.start - run.start : p.stop - run.start]
                at = base + (p.start - run.start) * _row_nbytes(whole)
            else:
                a = np.ascontiguousarray(p.rows)
                at = offset
                data.append(a.data)
                offset += a.nbytes
            entry = placed[id(p)] = {
                "key": p.key,
                "start": p.start,
                "stop": p.stop,
                "shape": list(a.shape),
                "dtype": a.dtype.name,
                "offset": at,
                "nbytes": a.nbytes,
                "checksum": p.digest or checksum(a),
            }
        header.append(entry)
    doc: dict[str, Any] = {"schema": ROWS_SCHEMA, "parts": header}
    if meta is not None:
        doc["meta"] = dict(meta)
    head = json.dumps(doc, separators=(",", ":")).encode()
    return b"".join([struct.pack("<Q", len(head)), head, *data])


def _row_nbytes(rows: np.ndarray) -> int:
    """Bytes of one row of ``rows`` (rows x layers x topk), also of an empty array."""
    return int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.itemsize


def _run_index(runs: Sequence[FramePart]) -> dict[str, tuple[np.ndarray, list[FramePart]]]:
    """Per key, its runs' starts (sorted) and the runs, for :func:`_run_of`."""
    by_key: dict[str, list[FramePart]] = {}
    for r in runs:
        by_key.setdefault(r.key, []).append(r)
    out = {}
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.start)
        out[key] = (np.array([r.start for r in rs], dtype=np.int64), rs)
    return out


def _run_of(located: dict[str, tuple[np.ndarray, list[FramePart]]], p: FramePart) -> FramePart:
    """The run of ``p``'s key that holds its rows (the last one starting at or before it); ValueError (the
    caller's bug) when none does or its rows are not of that run's shape."""
    starts, rs = located.get(p.key, (np.zeros(0, dtype=np.int64), []))
    i = int(np.searchsorted(starts, p.start, side="right")) - 1
    run = rs[i] if i >= 0 else None
    if run is None or not run.start <= p.start <= p.stop <= run.stop:
        raise ValueError(f"frame part {p.key} [{p.start}, {p.stop}) lies inside no run of its key")
    if tuple(p.rows.shape) != (p.stop - p.start, *run.rows.shape[1:]):
        raise ValueError(f"frame part {p.key} [{p.start}, {p.stop}): rows {p.rows.shape} are not its run's")
    return run


def decode_frame(body: bytes | bytearray | memoryview, *, with_meta: bool = False) -> Any:
    """Parse a frame; every header field and every part's checksum is checked before the rows are returned
    (zero-copy views into ``body``). :class:`MalformedPayloadError` or :class:`RoutingChecksumError`. With
    ``with_meta``: (the parts, the header's ``meta`` object, ``{}`` when it has none)."""
    buf = memoryview(body)
    if len(buf) < 8:
        raise MalformedPayloadError(f"routing frame of {len(buf)} bytes: shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(_MAX_HEADER, len(buf) - 8):
        raise MalformedPayloadError(f"routing frame header length {n} exceeds the {len(buf) - 8} bytes after it")
    raw = bytes(buf[8 : 8 + n])
    if (depth := _json_depth(raw)) > _MAX_DEPTH:
        raise MalformedPayloadError(f"routing frame header nests {depth} deep, more than {_MAX_DEPTH}")
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise MalformedPayloadError(f"routing frame header is not JSON: {e}") from None
    if not isinstance(head, dict) or head.get("schema") != ROWS_SCHEMA or not isinstance(head.get("parts"), list):
        raise MalformedPayloadError(f"routing frame header: expected schema {ROWS_SCHEMA!r} with a parts list")
    data = buf[8 + n :]
    out = []
    for i, p in enumerate(head["parts"]):
        where = f"routing frame part {i}"
        if not isinstance(p, dict):
            raise MalformedPayloadError(f"{where} must be an object")
        key = _field(p, "key", str, where)
        start, stop = _field(p, "start", int, where), _field(p, "stop", int, where)
        offset, nbytes = _field(p, "offset", int, where), _field(p, "nbytes", int, where)
        dtype, digest = _field(p, "dtype", str, where), _field(p, "checksum", str, where)
        shape = p.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
            or not (shape[0] >= 0 and 1 <= shape[1] <= _MAX_AXIS and 1 <= shape[2] <= _MAX_AXIS)
        ):
            raise MalformedPayloadError(
                f"{where}: shape must be [rows >= 0, layers, topk] with layers and topk in "
                f"[1, {_MAX_AXIS}], got {str(shape)[:200]}"
            )
        if dtype not in _DTYPES:
            raise MalformedPayloadError(f"{where}: dtype {dtype!r}, expected one of {list(_DTYPES)}")
        if stop < start or shape[0] != stop - start:
            raise MalformedPayloadError(f"{where}: rows [{start}, {stop}) but shape {shape}")
        if offset + nbytes > len(data):  # the body bounds every dimension: rows x layers x topk fit in it
            raise MalformedPayloadError(
                f"{where}: {nbytes} bytes at offset {offset} do not fit in {len(data)} bytes of data"
            )
        checked_count(shape, np.dtype(dtype).itemsize, nbytes, where)
        rows = np.frombuffer(data[offset : offset + nbytes], dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
        if checksum(rows) != digest:
            raise RoutingChecksumError(
                f"{where} (key {key!r}, rows [{start}, {stop})): checksum mismatch: the bytes changed on the way"
            )
        out.append(FramePart(key, start, stop, rows, digest))
    if not with_meta:
        return out
    meta = head.get("meta", {})
    if not isinstance(meta, dict):
        raise MalformedPayloadError(f"routing frame header: meta must be an object, got {type(meta).__name__}")
    return out, meta
