"""An upstream's routing through the one door (:func:`rr_client.core.codec.check_payload`), and the sidecar's one policy.

Policy, the same on ``/generate`` and on the OpenAI endpoints, and the same as the patched engines': a sample
whose upstream routing fails the check is answered with ``routed_experts: null`` and ``routed_experts_error``
(``"<ErrorType>: message"``; the client raises that typed error for that sample), counted as
``rr_proxy_errors_total{kind="malformed_routing"}`` and ``rr_routing_refused_total{error}`` (the name a patched
engine counts it under, :mod:`rr_server.serving.routing_metrics`); the other samples keep their routing. Routing
never passes unchecked. A failure of the upstream itself (unreachable, non-2xx, not JSON, wrong item count) is a 502/504.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rr_client.core.codec import CheckedRouting, check_payload, routing_error_fields, routing_meta_fields
from rr_client.core.errors import MissingRoutingError, RoutedExpertsError
from rr_client.core.info import RRInfo
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.serving.capture_paths import ROUTED_EXPERTS, capture_refusal
from rr_server.serving.store import current_store
from rr_server.serving.store.install import store_blocks

__all__ = ["upstream_routing_fields", "refused_fields", "sent_fields", "ROUTING_KEYS", "off_loop_if_store_blocks"]

T = TypeVar("T")

logger = logging.getLogger("rr.proxy")
# every key an upstream may use for routing; stripped from answers that did not ask for it
ROUTING_KEYS = (
    "routed_experts",
    "output_routed_experts",
    "routed_experts_dtype",
    "routed_experts_shape",
    "routed_experts_format",
    "routed_experts_start",
    "routed_experts_error",
)


async def off_loop_if_store_blocks(make: Callable[[], T]) -> T:
    """``make()``, in a worker thread when the routing store writes each ref to an object store (a network or disk
    write per sample must not hold the sidecar's event loop), else here."""
    if store_blocks():
        return await asyncio.to_thread(make)
    return make()


def upstream_routing_fields(
    meta: Mapping[str, Any],
    info: RRInfo,
    *,
    rows: int,
    start: int,
    fmt: str,
    metrics: ProxyMetrics,
    drop_rows: int = 0,
    where: str,
    hint: str = "",
) -> dict[str, Any]:
    """rr's routing fields of one upstream sample (``meta``: its routing keys), or its per-sample refusal.

    Decodes whatever the upstream sent (SGLang int32 with its stated dtype, vLLM ``.npy``), drops ``drop_rows``
    leading rows (upstreams that return every row), and checks once against ``rows``/``start``.
    """
    refused = capture_refusal(info, ROUTED_EXPERTS)  # the upstream's /rr/info refuses its rows
    payload = meta.get("routed_experts", meta.get("output_routed_experts"))
    if refused is None:
        try:
            if payload is None and isinstance(meta.get("routed_experts_error"), str):
                raise MissingRoutingError(f"the upstream withheld routed_experts: {meta['routed_experts_error']}")
            checked = check_payload(
                payload,
                info,
                rows=rows,
                start=start,
                drop_rows=drop_rows,
                dtype=meta.get("routed_experts_dtype"),
                stated_shape=meta.get("routed_experts_shape"),
            )
        except RoutedExpertsError as e:
            extra = f" ({hint})" if hint and isinstance(e, MissingRoutingError) else ""
            refused = type(e)(f"upstream sent invalid routing for {where}: {e}{extra}")
    fields = refused_fields(refused, metrics) if refused is not None else sent_fields(checked, fmt, metrics, where)
    metrics.routing.count_sample(fields)
    return fields


def refused_fields(e: RoutedExpertsError, metrics: ProxyMetrics) -> dict[str, Any]:
    """A sample's refusal (``routed_experts: null`` and the typed error), counted and logged: the one policy."""
    metrics.errors.labels("malformed_routing").inc()
    logger.warning("rr: refusing upstream routing: %s: %s", type(e).__name__, e)
    return routing_error_fields(e)


def sent_fields(checked: CheckedRouting, fmt: str, metrics: ProxyMetrics, where: str) -> dict[str, Any]:
    """Checked rows as the answer's routing fields in ``fmt`` (a ref: kept in the routing store), counted; the
    refusal when the store cannot hold them."""
    try:
        fields = routing_meta_fields(checked, fmt, store=current_store())
    except RoutedExpertsError as e:  # the ref format: the routing store could not hold it
        metrics.errors.labels("routing_store").inc()
        logger.warning("rr: %s: %s: %s", where, type(e).__name__, e)
        return routing_error_fields(e)
    metrics.routing_sent(checked.array.shape[0], fields.get("routed_experts"))
    return fields
