"""Provenance fields every rr server derives the same way (patched SGLang, vLLM's plugin and the sidecar): the
weight versions a request saw from :class:`rr_server.serving.weight_epoch.WeightEpoch` and from the engine's own
weight-version spans, and the cache tier from SGLang's ``cached_tokens_details``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rr_client.core.indexer import INDEXER_REF_FIELD
from rr_client.core.provenance import PROVENANCE_FIELD
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["weights_since", "cache_tier", "cached_under_older", "spans_update", "REF_FIELDS", "bind_provenance"]

#: the refs one answer may carry: its routing's and its indexer picks'; each is bound to the sample's tokens
REF_FIELDS = ("routed_experts_ref", INDEXER_REF_FIELD)


def bind_provenance(meta: dict[str, Any], prov: Mapping[str, Any]) -> None:
    """Answer ``prov`` as ``meta["rr_provenance"]`` and in every ref the answer carries (:data:`REF_FIELDS`): its
    ``tokens_digest`` is what binds each ref to its own sample (:func:`rr_client.core.reference.check_ref_tokens`).
    The one binder of rr's SGLang patch and the sidecar, so an indexer ref is bound as a routing ref is."""
    meta[PROVENANCE_FIELD] = dict(prov)
    for key in REF_FIELDS:
        ref = meta.get(key)
        if isinstance(ref, Mapping):
            meta[key] = {**ref, "provenance": dict(prov)}


def weights_since(epoch: WeightEpoch, mark: WeightMark | None) -> tuple[int | None, int, bool]:
    """(version at admission, version now, an update began or ended in between or is under way)."""
    if mark is None:
        return None, epoch.version, epoch.active
    version, during = epoch.since(mark)
    return mark.version, version, during


def spans_update(spans: Any) -> bool:
    """The engine's own weight-version spans of one sample's output tokens name more than one version: the engine
    saw its weights change while the sample ran, whether or not the update passed through rr's server.

    SGLang 0.5.20+ ``weight_versions[i]`` (objects, or ``[version, start, end]`` arrays after its msgspec wire) and
    vLLM 0.32+ ``CompletionOutput.weight_versions`` (``WeightVersionSpan(version, start, end)``); None or anything
    else: no spans (older engines), False."""
    if not isinstance(spans, Sequence) or isinstance(spans, (str, bytes)):
        return False
    versions = set()
    for s in spans:
        v = getattr(s, "version", None)
        if v is None and isinstance(s, Mapping):
            v = s.get("version")
        if v is None and isinstance(s, Sequence) and not isinstance(s, (str, bytes)) and s:
            v = s[0]  # msgspec array_like span after the wire
        versions.add(str(v))
    return len(versions) > 1


def cached_under_older(mark: WeightMark | None, cached: int) -> bool | None:
    """Whether a sample's ``cached`` tokens may be KV from older weights: it hit the prefix cache while the server
    said the cache was stale (not cleared since the last update). None: admitted where rr kept no mark."""
    return None if mark is None else bool(cached and mark.cache_stale)


def _count(v: Any) -> int | None:
    """A non-negative int from the engine, else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def cache_tier(details: Any, cached: int) -> str | None:
    """The deepest tier SGLang says served cached tokens (storage > host > device), else None."""
    if cached and isinstance(details, Mapping):
        for tier in ("storage", "host", "device"):
            if (_count(details.get(tier)) or 0) > 0:
                return tier
    return None
