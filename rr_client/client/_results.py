"""Typed results of ``/generate``: one :class:`GenerateResult` per sample, parsed and validated from the reply."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rr_client.core.codec import _refusal, decode_meta_info, expected_rows, wire_dtype
from rr_client.core.errors import MissingRoutingError, ProtocolError, RoutedExpertsError, ShapeMismatchError
from rr_client.core.indexer import (
    INDEXER_ERROR_FIELD,
    INDEXER_FIELD,
    INDEXER_REF_FIELD,
    INDEXER_START_FIELD,
    CheckedIndexer,
    decode_indexer,
    first_choosing_row,
)
from rr_client.core.info import RRInfo
from rr_client.core.logprobs import parse_token_logprobs
from rr_client.core.provenance import (
    PROVENANCE_FIELD,
    Provenance,
    ProvenanceCheck,
    StalePolicy,
    check_provenance,
    tokens_digest,
)
from rr_client.core.reference import RoutingRef
from rr_client.core.seam import SeamRef

if TYPE_CHECKING:
    from rr_client.trainer.layouts import PackedRouting, RoutingTensors

__all__ = [
    "GenerateResult",
    "GenerateBatch",
    "parse_sample",
    "decode_sample_routing",
    "sample_provenance",
    "checked_result",
]

_PAYLOAD_KEYS = ("routed_experts", "output_routed_experts", "routed_experts_ref")


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One generated sample: tokens, text, finish reason, and its checked routing ``(rows, layers, topk)``;
    asked by reference, ``routing_ref`` instead (``routed_experts`` None until resolved). ``logprobs``: the sampled
    tokens' log-probs (float64, one per output token, NaN where the engine gave none; None unless asked for), of
    ``logprobs_mode`` (the server's ``/rr/info``: "processed" after temperature, "raw" before, None unknown).
    ``provenance``: which cache and weights made the rows (:class:`rr_client.core.provenance.Provenance`, its digest
    checked against these tokens), None from a server that does not say."""

    index: int
    prompt_index: int
    prompt_ids: list[int] | None
    output_ids: list[int]
    text: str | None
    finish_reason: str | None
    routed_experts: np.ndarray | None
    routed_experts_start: int
    meta: dict[str, Any] = field(repr=False)
    routing_ref: RoutingRef | SeamRef | None = None  #: a P/D sample's: both servers' refs and the seam
    logprobs: np.ndarray | None = field(default=None, repr=False)
    logprobs_mode: str | None = None
    provenance: Provenance | None = None
    #: the engine's sparse-attention indexer picks ``[rows, indexer layers, index_topk]`` for tokens
    #: ``indexer_topk_start ..`` (asked with ``return_indexer_topk``; :mod:`rr_client.core.indexer`)
    indexer_topk: np.ndarray | None = field(default=None, repr=False)
    indexer_topk_start: int | None = None
    #: by reference (the server default): the ref of those rows, read by ``resolve_results``
    indexer_ref: RoutingRef | None = None

    def with_routing(self, rows: np.ndarray) -> GenerateResult:
        """This sample with its routing resolved (the ref kept for the record)."""
        return replace(self, routed_experts=rows)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length as the server counted it."""
        return int(self.meta["prompt_tokens"])

    @property
    def completion_tokens(self) -> int:
        """Completion length as the server counted it."""
        return int(self.meta["completion_tokens"])


@dataclass(frozen=True, slots=True)
class GenerateBatch:
    """All samples of one ``generate`` call, in prompt order (``n`` samples per prompt, prompt-major)."""

    results: list[GenerateResult]
    info: RRInfo

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> GenerateResult:
        return self.results[i]

    def __iter__(self) -> Iterator[GenerateResult]:
        return iter(self.results)

    @property
    def provenances(self) -> list[Provenance | None]:
        """Each sample's provenance, in order (None where the server gave none): what
        :func:`rr_client.core.provenance.check_provenance` takes."""
        return [r.provenance for r in self.results]

    def check_provenance(self, stale_rows: StalePolicy = "refuse") -> ProvenanceCheck:
        """:func:`rr_client.core.provenance.check_provenance` of these samples (``StaleRoutingError`` names the sample)."""
        return check_provenance(self.provenances, stale_rows)

    def to_tensors(self, **options: Any) -> RoutingTensors:
        """Pad into trainer-ready torch tensors: :func:`rr_client.to_tensors` of these samples, same options."""
        from rr_client.trainer.layouts import to_tensors

        return to_tensors(self.results, self.info, **options)

    def to_packed(self, **options: Any) -> PackedRouting:
        """Pack into THD torch tensors: :func:`rr_client.to_packed` of these samples, same options."""
        from rr_client.trainer.layouts import to_packed

        return to_packed(self.results, self.info, **options)


def _int_field(meta: Mapping[str, Any], key: str, where: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError(f"{where}: meta_info.{key} must be a non-negative int, got {v!r}")
    return v


def decode_sample_routing(
    fields: Mapping[str, Any],
    info: RRInfo,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    start: int,
    allow_extra_rows: int,
    validate: bool,
    where: str,
) -> np.ndarray:
    """One sample's routing fields (``/generate`` meta_info or an OpenAI choice), checked against the request
    (stated start, ``prompt + completion - 1 - start`` rows) and ``info``; typed errors name ``where``."""
    stated_start = fields.get("routed_experts_start", start)
    if stated_start != start:
        raise ProtocolError(f"{where}: asked routed_experts_start={start}, server says {stated_start}")
    try:
        return decode_meta_info(
            fields,
            rows=expected_rows(prompt_tokens, completion_tokens, start),
            num_layers=info.num_hidden_layers,
            topk=info.topk,
            num_experts=info.num_experts,
            moe_layers=info.moe_layers,
            allow_extra_rows=allow_extra_rows,
            validate=validate,
        )
    except RoutedExpertsError as e:
        raise type(e)(f"{where}: {e}") from e


def sample_provenance(
    fields: Mapping[str, Any],
    *,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int],
    ref: RoutingRef | None,
    where: str,
) -> Provenance | None:
    """One sample's ``rr_provenance`` (else its ref's ``provenance``; None when the server gave neither), every
    field checked and its ``tokens_digest`` held to the sample's tokens (:class:`ProtocolError` naming the sample:
    the server paired it with another sample). Unchecked only when the prompt's ids are unknown (a text prompt
    the server did not echo)."""
    raw = fields.get(PROVENANCE_FIELD)
    prov = None if raw is None else Provenance.from_dict(raw, f"{where}: {PROVENANCE_FIELD}")
    on_ref = ref.provenance if ref is not None else None
    if prompt_ids is not None:
        digest = tokens_digest(prompt_ids, output_ids)
        for what, p in ((PROVENANCE_FIELD, prov), ("routed_experts_ref.provenance", on_ref)):
            if p is not None and p.tokens_digest is not None and p.tokens_digest != digest:
                raise ProtocolError(
                    f"{where}: {what}.tokens_digest {p.tokens_digest} is not the digest of this "
                    f"sample's {len(prompt_ids)} prompt + {len(output_ids)} output ids ({digest}): "
                    "the server paired it with another sample"
                )
    return prov if prov is not None else on_ref


def sample_ref(
    fields: Mapping[str, Any], info: RRInfo, *, prompt_tokens: int, completion_tokens: int, start: int, where: str
) -> RoutingRef:
    """One sample's ``routed_experts_ref``, held to the request and ``info`` like an inline payload: rows
    (``prompt + completion - 1 - start``), layers, top-k, wire dtype and start."""
    if fields.get("routed_experts_error"):
        raise MissingRoutingError(
            f"{where}: the server refused this sample's routing: {fields['routed_experts_error']}"
        )
    ref = RoutingRef.from_dict(fields.get("routed_experts_ref"), f"{where}: routed_experts_ref")
    rows = expected_rows(prompt_tokens, completion_tokens, start)
    want = (rows, info.num_hidden_layers, info.topk, wire_dtype(info.num_experts).name, start)
    got = (ref.rows, ref.layers, ref.topk, ref.dtype, ref.start)
    if got != want:
        raise ShapeMismatchError(f"{where}: routing ref for (rows, layers, topk, dtype, start) {got}, expected {want}")
    return ref


def parse_sample(
    reply: Any,
    *,
    index: int,
    prompt_index: int,
    prompt_ids: Sequence[int] | None,
    info: RRInfo,
    want_routing: bool,
    start: int = 0,
    allow_extra_rows: int = 0,
    validate: bool = True,
    by_reference: bool = False,
    want_indexer: bool = False,
) -> GenerateResult:
    """Check one reply dict of ``/generate`` against the request and ``info``; decode its routing (or, asked
    ``by_reference``, parse and check its :class:`RoutingRef`) and, asked ``want_indexer``, its indexer picks."""
    where = f"sample {index}"
    if not isinstance(reply, Mapping) or not isinstance(reply.get("meta_info"), Mapping):
        raise ProtocolError(f"{where}: reply must be an object with a meta_info object")
    meta = dict(reply["meta_info"])
    prompt_tokens = _int_field(meta, "prompt_tokens", where)
    completion_tokens = _int_field(meta, "completion_tokens", where)
    output_ids = reply.get("output_ids")
    if not isinstance(output_ids, list):
        raise ProtocolError(f"{where}: output_ids must be a list of token ids")
    if len(output_ids) != completion_tokens:
        raise ProtocolError(f"{where}: {len(output_ids)} output_ids but completion_tokens={completion_tokens}")
    ids = list(prompt_ids) if prompt_ids is not None else meta.get("prompt_token_ids")
    if ids is not None and len(ids) != prompt_tokens:
        raise ProtocolError(f"{where}: prompt has {len(ids)} tokens but the server counted {prompt_tokens}")
    routing: np.ndarray | None = None
    ref: RoutingRef | None = None
    if want_routing and by_reference:
        ref = sample_ref(
            meta, info, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, start=start, where=where
        )
    elif want_routing:
        routing = decode_sample_routing(
            meta,
            info,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            start=start,
            allow_extra_rows=allow_extra_rows,
            validate=validate,
            where=where,
        )
    elif any(k in meta for k in _PAYLOAD_KEYS):
        raise ProtocolError(f"{where}: routing was not requested but the server sent some")
    for k in _PAYLOAD_KEYS:
        meta.pop(k, None)
    indexer = (
        sample_indexer(
            meta, info, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, start=start, where=where
        )
        if want_indexer
        else None
    )
    lp_rows = meta.get("output_token_logprobs")
    logprobs = None if lp_rows is None else parse_token_logprobs(lp_rows, output_ids, where=where)
    fr = meta.get("finish_reason")
    finish = fr.get("type") if isinstance(fr, Mapping) else (fr if isinstance(fr, str) else None)
    result = checked_result(
        meta,
        info,
        index=index,
        prompt_index=prompt_index,
        prompt_ids=ids,
        output_ids=output_ids,
        text=reply.get("text"),
        finish_reason=finish,
        routing=routing,
        start=start,
        meta=meta,
        ref=ref,
        logprobs=logprobs,
        where=where,
    )
    if indexer is None:
        return result
    if isinstance(indexer, RoutingRef):
        return replace(result, indexer_ref=indexer, indexer_topk_start=indexer.start)
    return replace(result, indexer_topk=indexer.array, indexer_topk_start=indexer.start)


def sample_indexer(
    meta: dict[str, Any], info: RRInfo, *, prompt_tokens: int, completion_tokens: int, start: int, where: str
) -> CheckedIndexer | RoutingRef:
    """One sample's indexer picks (taken out of ``meta``): inline, checked by the one full check; by reference, the
    ref held to the request (kind, rows, layers, width, start); the server's refusal as the typed error it names."""
    error = meta.pop(INDEXER_ERROR_FIELD, None)
    payload = meta.pop(INDEXER_FIELD, None)
    raw_ref = meta.pop(INDEXER_REF_FIELD, None)
    first = meta.pop(INDEXER_START_FIELD, None)
    if error:
        raise _refusal(str(error))
    dims = info.indexer
    if dims is None:
        raise ShapeMismatchError(f"{where}: asked for the indexer top-k, but the server's model has no indexer")
    want_first = first_choosing_row(dims.index_topk, start)
    if raw_ref is not None:
        ref = RoutingRef.from_dict(raw_ref, f"{where}: {INDEXER_REF_FIELD}")
        rows = max(prompt_tokens + completion_tokens - 1 - want_first, 0)
        want = ("indexer", rows, len(dims.layers), dims.index_topk, want_first)
        got = (ref.kind, ref.rows, ref.layers, ref.topk, ref.start)
        if got != want:
            raise ShapeMismatchError(
                f"{where}: indexer ref for (kind, rows, layers, index_topk, start) {got}, expected {want}"
            )
        return ref
    if payload is None:
        raise MissingRoutingError(f"{where}: asked for the indexer top-k, the server sent none")
    try:
        checked = decode_indexer(
            payload, dims, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, start=start
        )
    except RoutedExpertsError as e:
        raise type(e)(f"{where}: indexer_topk: {e}") from e
    if first is not None and first != checked.start:
        raise ShapeMismatchError(f"{where}: indexer_topk_start={first}, the rows start at token {checked.start}")
    return checked


def checked_result(
    fields: Mapping[str, Any],
    info: RRInfo,
    *,
    index: int,
    prompt_index: int,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int],
    text: Any,
    finish_reason: str | None,
    routing: np.ndarray | None,
    start: int,
    meta: dict[str, Any],
    ref: RoutingRef | None,
    logprobs: np.ndarray | None,
    where: str,
) -> GenerateResult:
    """One checked sample as a :class:`GenerateResult`, built alike from a ``/generate`` reply and an OpenAI choice:
    the ids copied, ``text`` kept only when a string, the log-probs' mode from ``info`` when log-probs came, and
    the provenance read from ``fields`` (the sample's meta_info or choice) and held to its tokens."""
    provenance = sample_provenance(fields, prompt_ids=prompt_ids, output_ids=output_ids, ref=ref, where=where)
    return GenerateResult(
        index=index,
        prompt_index=prompt_index,
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
        output_ids=list(output_ids),
        text=text if isinstance(text, str) else None,
        finish_reason=finish_reason,
        routed_experts=routing,
        routed_experts_start=start,
        meta=meta,
        routing_ref=ref,
        logprobs=logprobs,
        logprobs_mode=info.logprobs_mode if logprobs is not None else None,
        provenance=provenance,
    )
