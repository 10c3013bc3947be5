"""Provenance fields every rr server derives the same way (patched SGLang and the sidecar): the weight versions a
request saw from :class:`rr_server.serving.weight_epoch.WeightEpoch`, and the cache tier from SGLang's
``cached_tokens_details``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["weights_since", "cache_tier", "cached_under_older"]


def weights_since(epoch: WeightEpoch, mark: WeightMark | None) -> tuple[int | None, int, bool]:
    """(version at admission, version now, an update began or ended in between or is under way)."""
    if mark is None:
        return None, epoch.version, epoch.active
    version, during = epoch.since(mark)
    return mark.version, version, during


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
