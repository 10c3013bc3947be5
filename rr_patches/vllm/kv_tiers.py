"""vLLM's KV tiers outside the device prefix cache (KV connectors: OffloadingConnector, LMCache, ...), and when a
cache clear reaches them (issue 55, item 3; vLLM #27170, #42695, #57810; LMCache #4993).

``/reset_prefix_cache`` resets a configured connector only with ``reset_external=true``, and answers
``{"success": true}`` for a connector without its own ``reset_cache`` (the base class's returns None, which vLLM's
scheduler counts as success): :attr:`ReleaseFacts.resettable_connectors`. So with a connector configured, rr counts a
reset as clearing the cache only when it asked for the tier and every connector's reset is one that clears it and
says so; otherwise the cache stays stale and samples that hit it carry ``cached_under_older_weights``. A ``/pause``
that clears the cache reaches the connector on 0.23+ only (:attr:`ReleaseFacts.pause_resets_connector`), its answer
unread: the same rule.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from rr_server.serving.disaggregation import kv_connectors
from rr_server.serving.engines.base import ReleaseFacts
from rr_server.serving.http import Scope
from rr_server.serving.weight_epoch import WeightUpdateMiddleware

__all__ = ["configured_connectors", "unverified_connectors", "VLLMWeightUpdateMiddleware", "RESET_EXTERNAL"]

RESET_EXTERNAL = "reset_external"  #: the query parameter of vLLM's /reset_prefix_cache that resets the connector too


def configured_connectors(engine_client: Any) -> tuple[str, ...]:
    """The KV connectors vLLM runs (its ``kv_transfer_config``; a MultiConnector and its children), () for none."""
    cfg = getattr(getattr(engine_client, "vllm_config", None), "kv_transfer_config", None)
    if cfg is None:
        return ()
    as_dict = {
        "kv_connector": getattr(cfg, "kv_connector", None),
        "kv_connector_extra_config": getattr(cfg, "kv_connector_extra_config", None) or {},
    }
    return tuple(kv_connectors(as_dict)) or ("(unnamed)",)


def unverified_connectors(names: tuple[str, ...], facts: ReleaseFacts) -> tuple[str, ...]:
    """Those of ``names`` whose reset this release cannot show cleared their tier (a MultiConnector is as good as
    its children: vLLM's counts a child's None as success)."""
    return tuple(n for n in names if n != "MultiConnector" and n not in facts.resettable_connectors)


def _asked_external(scope: Scope) -> bool:
    """The request asked vLLM to reset the connector too (``?reset_external=true``, FastAPI's bool parsing)."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(RESET_EXTERNAL, [])
    return bool(values) and values[-1].lower() in ("true", "1", "yes", "on")


class VLLMWeightUpdateMiddleware(WeightUpdateMiddleware):
    """rr's weight epoch on vLLM: a clear counts only where it reached every KV tier that may hold older KV."""

    _facts: ReleaseFacts | None = None

    def _tiers(self, scope: Scope) -> tuple[tuple[str, ...], ReleaseFacts]:
        """(the configured connectors, this vLLM's facts), read from the app's engine client."""
        if self._facts is None:
            import vllm

            from rr_server.serving.engines.vllm import facts_for

            self._facts = facts_for(str(vllm.__version__))
        app = scope.get("app")
        client = getattr(getattr(app, "state", None), "engine_client", None)
        return configured_connectors(client), self._facts

    def reset_cleared(self, scope: Scope, reply: bytes) -> bool:
        """With a connector: only a reset that asked for ``reset_external`` and reached connectors whose reset is
        verifiable cleared the cache (the device cache alone leaves the tier's older KV)."""
        if not super().reset_cleared(scope, reply):
            return False
        names, facts = self._tiers(scope)
        return not names or (_asked_external(scope) and not unverified_connectors(names, facts))

    def pause_cleared(self, scope: Scope) -> bool:
        """With a connector: a clearing pause counts only where the release resets connectors that can say so."""
        if not super().pause_cleared(scope):
            return False
        names, facts = self._tiers(scope)
        return not names or (facts.pause_resets_connector and not unverified_connectors(names, facts))
