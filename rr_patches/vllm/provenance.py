"""Per-sample provenance on the vLLM plugin's answers (``rr_provenance``): what vLLM says about one request's
prefix-cache hit and preemptions, and the server's weight versions at its admission and finish.

``cached_tokens`` is ``RequestOutput.num_cached_tokens``; ``cache_tier`` is ``"device"`` on a hit (vLLM's own
prefix cache), or null when a KV connector is configured (vLLM's ``RequestOutput`` does not split local from
connector hits). ``preemptions`` is ``RequestOutput.metrics.num_preemptions`` (vLLM's output processor counts the
engine's PREEMPTED events per request); null when the server runs with ``--disable-log-stats`` (no metrics), and
for each sample of an ``n`` > 1 request answered whole (vLLM's aggregated output carries one child's counts).
``weight_update_during`` is also set where vLLM itself (0.32+: ``CompletionOutput.weight_versions``, the
weight-version spans of the sample's output tokens from ``vllm/v1/engine/output_processor.py``) names more than one
version: the engine relabelled its weights while the sample ran, even by a path rr's server does not see (an engine
actor called directly, another API server). Older vLLM has no spans: rr's own count only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rr_client.core.provenance import Provenance, tokens_digest
from rr_server.serving.provenance_fields import cached_under_older, spans_update
from rr_server.serving.weight_epoch import WeightMark, current_epoch

__all__ = ["admit", "provenance_of", "connector_configured"]


def admit() -> WeightMark:
    """The weight epoch at a request's admission."""
    return current_epoch().mark()


def connector_configured(engine_client: Any) -> bool:
    """Whether vLLM runs a KV connector (its hits may come from outside the device prefix cache)."""
    cfg = getattr(engine_client, "vllm_config", None)
    return getattr(cfg, "kv_transfer_config", None) is not None


def _preemptions(ro: Any) -> int | None:
    """vLLM's per-request preemption count (None without stats)."""
    n = getattr(getattr(ro, "metrics", None), "num_preemptions", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else None


def provenance_of(
    ro: Any,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int],
    mark: WeightMark,
    *,
    connector: bool = False,
    finish: tuple[int, bool] | None = None,
    shared_by: int = 1,
    spans: Any = None,
) -> Provenance:
    """One finished sample's provenance: ``ro`` its RequestOutput, ``mark`` taken at admission, ``finish``
    :meth:`WeightEpoch.since` at its finish (taken now when not given), ``spans`` the sample's own
    ``CompletionOutput.weight_versions`` (vLLM 0.32+; None before). ``shared_by`` > 1: ``ro`` holds that many
    samples of one request (``n``), and its counts are the last-finishing child's (vLLM's aggregated output): the
    preemptions are unknown for each, and a stale cache may have served any of them."""
    cached = int(getattr(ro, "num_cached_tokens", 0) or 0)
    version, during = finish if finish is not None else current_epoch().since(mark)
    during = during or spans_update(spans)
    shared = shared_by > 1
    return Provenance(
        cached_tokens=cached,
        cache_tier=("device" if cached and not connector else None),
        preemptions=None if shared else _preemptions(ro),
        weight_version_admitted=mark.version,
        weight_version_finished=version,
        weight_update_during=during,
        tokens_digest=tokens_digest(list(prompt_ids or []), list(output_ids)),
        cached_under_older_weights=mark.cache_stale if shared else cached_under_older(mark, cached),
    )
