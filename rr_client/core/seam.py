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
sample's provenance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rr_client.core.codec import check_routing
from rr_client.core.errors import MissingRoutingError, SeamMismatchError, StaleRoutingError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance

__all__ = ["Half", "Seam", "merge_halves", "SEAM_FIELD"]

SEAM_FIELD = "rr_seam"  #: the key of a merged sample's seam in its meta / provenance record

_SAME = ("engine", "model", "num_hidden_layers", "num_experts", "topk", "moe_layers", "wire_dtype")


@dataclass(frozen=True, slots=True)
class Half:
    """One server's rows of one sample: ``rows`` ``[m, L, K]`` for the token positions ``start .. start + m``
    (row ``t`` routes token ``t``, the one that predicted token ``t + 1``), the server's :class:`RRInfo`, its name
    (``server``: a URL or a router's worker id) and its per-sample provenance (weight versions, cached tokens)."""

    rows: Any
    start: int
    info: RRInfo
    server: str
    provenance: Provenance | None = None

    @property
    def stop(self) -> int:
        """One past the last token position this half routes."""
        return self.start + int(np.asarray(self.rows).shape[0])


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


def _same_model(p: Half, d: Half, where: str) -> None:
    for name in _SAME:
        a, b = getattr(p.info, name), getattr(d.info, name)
        if a != b:
            raise SeamMismatchError(
                f"{where}: the prefill server ({p.server}) and the decode server ({d.server}) differ in {name}: "
                f"{a!r} vs {b!r}; their rows cannot be joined into one sample"
            )
    pa, da = np.asarray(p.rows), np.asarray(d.rows)
    if pa.dtype != da.dtype or pa.shape[1:] != da.shape[1:]:
        raise SeamMismatchError(
            f"{where}: the prefill rows are {pa.dtype} {list(pa.shape)}, the decode rows {da.dtype} "
            f"{list(da.shape)}: width, layer count or dtype differ"
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


def merge_halves(
    prefill: Half, decode: Half, *, received: int, total_rows: int, first: int = 0, where: str = "sample"
) -> tuple[np.ndarray, Seam]:
    """The sample's rows ``[total_rows, L, K]`` from its prefill and decode halves, joined at token ``received``
    (the tokens whose KV the decode server received), and the :class:`Seam`. ``first``: the sample's first routed
    token (``routed_experts_start``); ``total_rows``: its rows from there, ``prompt + completion - 1 - first``.
    Every refusal is in the module docstring."""
    _same_model(prefill, decode, where)
    p_rows = check_routing(prefill.rows, prefill.info, rows=int(np.asarray(prefill.rows).shape[0])).array
    d_rows = check_routing(decode.rows, decode.info, rows=int(np.asarray(decode.rows).shape[0])).array
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
    if decode.stop != end:
        raise MissingRoutingError(
            f"{where}: the decode rows ({decode.server}) end at token {decode.stop}, the sample's at {end}"
        )
    overlap = prefill.stop - received  # tokens the prefill server routed but whose KV it did not hand over
    if overlap > 0:
        differ = (np.sort(p_rows[received - first :], -1) != np.sort(d_rows[:overlap], -1)).any(axis=(1, 2))
        if differ.any():
            bad = int(np.flatnonzero(differ)[0]) + received
            raise SeamMismatchError(
                f"{where}: both servers returned rows for tokens {received}..{prefill.stop} and they differ "
                f"(first at token {bad}); the decode server recomputed them, the prefill rows are not what ran"
            )
    pv, dv = _version(prefill, "prefill", where), _version(decode, "decode", where)
    if pv is not None and dv is not None and pv != dv:
        raise StaleRoutingError(
            f"{where}: the prefill server ({prefill.server}) is at weight version {pv}, the decode server "
            f"({decode.server}) at {dv}: the decode tokens attended to KV computed under other weights"
        )
    merged = np.concatenate([p_rows[: received - first], d_rows])
    seam = Seam(
        at=received,
        prefill_server=prefill.server,
        prefill_span=(first, received),
        decode_server=decode.server,
        decode_span=(received, end),
        weight_version=pv if pv is not None else dv,
        overlap=max(overlap, 0),
    )
    return merged, seam
