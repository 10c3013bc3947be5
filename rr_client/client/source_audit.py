"""The source audit: re-score a sampled share of served samples on the same engine and flag rows its own forward does
not give back (:mod:`rr_client.core.source_audit` does the counting).

Each chosen sample's tokens (prompt + output) go back to the server as one prompt: one prefill scores every token,
``max_new_tokens=1``, routing from token 0, the prefix cache bypassed by a fresh salt (vLLM's ``cache_salt``; SGLang's
``extra_key``, its radix-cache namespace on every release rr supports), so no row comes from the KV the served
request left behind. A flagged sample's provenance says so (``source_flagged``) and the stale-rows policy refuses or
masks it like any stale sample. Engine-neutral: it goes through the server's ``/generate`` like any request, so a
patched vLLM or SGLang and the sidecar are audited alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from rr_client.core.engines import ENGINES
from rr_client.core.errors import ConfigurationError, RRError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.core.source_audit import DEFAULT_THRESHOLD, check_threshold, compare_picks, compare_rows

from ._results import GenerateResult

__all__ = ["SourceAudit", "SourceAuditStats", "Rescorer", "salt_field"]

logger = logging.getLogger("rr_client.source_audit")


class Rescorer(Protocol):
    """What the audit re-scores through: :class:`RoutedExpertsClient` or :class:`PDClient` (``rescore``)."""

    async def rescore(
        self, tokens: Sequence[int], info: RRInfo, salt_field: str = ..., *, indexer: bool = ...
    ) -> GenerateResult: ...


def salt_field(info: RRInfo) -> str:
    """The request field that puts a request in its own prefix-cache namespace on ``info``'s engine: SGLang's
    ``extra_key`` (0.5.7+; ``cache_salt`` only from 0.5.19), vLLM's ``cache_salt`` (rr's ``/generate`` and the
    sidecar pass it on)."""
    eng = ENGINES.get(info.engine)
    return eng.cache_namespace_field if eng is not None else "cache_salt"  # rr's /generate takes cache_salt


@dataclass
class SourceAuditStats:
    """Running counts of one client's audit: samples re-scored, flagged, and not re-scored (the re-score failed)."""

    checked: int = 0
    flagged: int = 0
    failed: int = 0


class SourceAudit:
    """Re-score ``fraction`` of served samples (chosen by a hash of their tokens and ``seed``, so a retried batch picks
    the same ones) and flag those whose rows agree below ``threshold`` (per sample, token segment and depth bucket;
    :data:`rr_client.core.source_audit.DEFAULT_THRESHOLD`). ``fail_closed``: a sample whose re-score fails is flagged
    too (default: it stays unchecked, counted in ``stats.failed``). Give it to
    ``RoutedExpertsClient(source_audit=...)``, or a fraction (``source_audit=0.01``)."""

    def __init__(
        self,
        fraction: float = 0.01,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        fail_closed: bool = False,
        seed: int = 0,
        max_concurrency: int = 4,
    ) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ConfigurationError(f"source_audit fraction must be in [0, 1], got {fraction!r}")
        if max_concurrency < 1:
            raise ConfigurationError(f"source_audit max_concurrency must be >= 1, got {max_concurrency}")
        self.fraction = float(fraction)
        self.threshold = check_threshold(threshold)
        self.fail_closed = bool(fail_closed)
        self.seed = int(seed)
        self.stats = SourceAuditStats()
        self._sem = asyncio.Semaphore(max_concurrency)

    def chosen(self, result: GenerateResult) -> bool:
        """Whether ``result`` is in the audited share: a uniform draw from a hash of the seed and its tokens."""
        if self.fraction <= 0:
            return False
        h = hashlib.blake2b(digest_size=8)
        h.update(self.seed.to_bytes(8, "little", signed=True))
        h.update(np.asarray(result.prompt_ids or [], dtype="<i8").tobytes())
        h.update(np.asarray(result.output_ids, dtype="<i8").tobytes())
        h.update(result.index.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little") / 2**64 < self.fraction

    async def audit(self, client: Rescorer, results: Sequence[GenerateResult], info: RRInfo) -> list[GenerateResult]:
        """``results`` with the chosen ones' provenance carrying the audit's verdict (the others unchanged)."""
        out = list(results)
        picks = [i for i, r in enumerate(out) if r.routed_experts is not None and self.chosen(r)]
        if not picks:
            return out
        verdicts = await asyncio.gather(*(self._one(client, out[i], info) for i in picks))
        for i, v in zip(picks, verdicts):
            out[i] = v
        return out

    async def _one(self, client: Rescorer, r: GenerateResult, info: RRInfo) -> GenerateResult:
        """One sample re-scored and judged; a failed re-score is logged and leaves it unchecked (or flagged)."""
        try:
            if r.prompt_ids is None:
                raise ConfigurationError("the server did not echo the prompt's token ids (meta_info.prompt_token_ids)")
            want_idx = r.indexer_topk is not None
            async with self._sem:
                again = await client.rescore(
                    list(r.prompt_ids) + list(r.output_ids), info, salt_field(info), indexer=want_idx
                )
            if again.routed_experts is None or (want_idx and again.indexer_topk is None):
                raise ConfigurationError("the re-score came back without its rows")
            return self.judge(
                r, again.routed_experts, info, indexer=again.indexer_topk, indexer_start=again.indexer_topk_start or 0
            )
        except RRError as e:
            self.stats.failed += 1
            logger.warning(
                "rr source audit: sample %d not re-scored (%s: %s)%s",
                r.index,
                type(e).__name__,
                e,
                "; flagged (fail_closed)" if self.fail_closed else "",
            )
            if not self.fail_closed:
                return r
            return replace(r, provenance=replace(_base(r), source_flagged=True))

    def judge(
        self,
        r: GenerateResult,
        rescored: np.ndarray,
        info: RRInfo,
        *,
        indexer: np.ndarray | None = None,
        indexer_start: int = 0,
    ) -> GenerateResult:
        """``r`` with its provenance carrying the verdict on ``rescored`` (the engine's rows for every token of
        ``r``'s prompt + output, from token 0) and, when ``r`` carries indexer picks, on ``indexer`` (the re-score's
        picks from token ``indexer_start``): one log line names the parts that fell when it is flagged."""
        base = _base(r)
        if r.routed_experts is None:
            raise ConfigurationError(f"sample {r.index}: no rows to audit (resolve a ref first)")
        got = compare_rows(
            r.routed_experts,
            rescored,
            start=r.routed_experts_start,
            prompt_tokens=len(r.prompt_ids or []),
            cached_tokens=base.cached_tokens,
            moe_layers=info.moe_layers,
        )
        picks = None
        if r.indexer_topk is not None and indexer is not None:
            picks = compare_picks(
                r.indexer_topk,
                indexer,
                start=r.indexer_topk_start or 0,
                prompt_tokens=len(r.prompt_ids or []),
                cached_tokens=base.cached_tokens,
                rescored_start=indexer_start,
            )
        flagged = not got.passes(self.threshold) or (picks is not None and not picks.passes(self.threshold))
        self.stats.checked += 1
        self.stats.flagged += flagged
        if flagged:
            line = got.describe(self.threshold)
            if picks is not None:
                line += f"; indexer picks {picks.describe(self.threshold)}"
            logger.warning("rr source audit: sample %d %s", r.index, line)
        prov = replace(
            base,
            source_checked=True,
            source_agreement=got.agreement,
            source_flagged=flagged,
            source_detail=got,
            source_indexer=picks,
        )
        return replace(r, provenance=prov)


def _base(r: GenerateResult) -> Provenance:
    """``r``'s provenance, or one that says the weights are unknown (a server without provenance)."""
    return r.provenance or Provenance(weight_update_during=None)


def fresh_salt() -> str:
    """A salt no other request carries: the re-score shares no cached KV (a repeated salt would hit it again)."""
    return f"rr-audit-{uuid.uuid4().hex}"
