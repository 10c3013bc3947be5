"""rr's routing counters: what every rr server sent, per sample, on its Prometheus ``/metrics``.

Four counters, the same names on a patched engine and on the sidecar:

* ``rr_routing_refused_total{error}``: samples whose routing failed rr's check and went out as
  ``routed_experts: null`` + ``routed_experts_error``; ``error`` is the error class the client raises for it
  (``UnrecordedRoutingError``, ``ShapeMismatchError``, ...; ``MissingRoutingError`` when the text names none).
* ``rr_routing_samples_total{format}``: samples sent with checked routing (``npy``, ``sglang`` or ``ref``).
* ``rr_routing_rows_total{format}``: the routing rows those samples carry.
* ``rr_routing_bytes_total{format}``: base64 payload characters sent (the ``routed_experts`` string); a ``ref``
  sends none (its rows are read later from the routing store, ``rr_routing_store_read_bytes_total``).

Engines: the patches call :func:`count_sample` once per sample (or OpenAI choice) that asked for routing, with the
rr fields it is sent with. Those counters live in prometheus_client's default registry, which both engines'
``/metrics`` serve (vLLM: ``REGISTRY``, or ``PROMETHEUS_MULTIPROC_DIR``'s files with ``--api-server-count > 1``;
SGLang ``--enable-metrics``: always the multiprocess files). prometheus_client is imported on first use (the patch's
startup, :func:`declare`), never at import: by then the engine has set ``PROMETHEUS_MULTIPROC_DIR`` if it uses it.
Without prometheus_client, counting is a no-op (one debug log). They are made once per process; a second copy of
this module finds them in the registry instead of registering them again (re-entrant patching).

The sidecar makes its own :class:`RoutingCounters` in its app's registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import rr_client.core.errors as _errors

__all__ = ["NAMES", "RoutingCounters", "count_sample", "count_answer", "declare", "refusal_class"]

logger = logging.getLogger("rr.metrics")

# metric name (prometheus_client adds ``_total``) -> (help, label)
NAMES: dict[str, tuple[str, str]] = {
    "rr_routing_refused": (
        "Samples whose routing failed rr's check (sent as routed_experts_error), by error class",
        "error",
    ),
    "rr_routing_samples": ("Samples sent with checked routing, by routed_experts_format", "format"),
    "rr_routing_rows": ("Routing rows sent (checked), by routed_experts_format", "format"),
    "rr_routing_bytes": ("Base64 routing payload bytes sent (a ref sends none), by routed_experts_format", "format"),
}


def refusal_class(why: Any) -> str:
    """The error class a ``routed_experts_error`` (``"<ErrorType>: message"``) names, as the client reads it:
    ``MissingRoutingError`` when it names no routing error of :mod:`rr_client.core.errors`."""
    name = str(why).split(":", 1)[0].strip()
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, _errors.RoutedExpertsError):
        return name
    return "MissingRoutingError"


class RoutingCounters:
    """The four counters in ``registry`` (None: prometheus_client's default ``REGISTRY``, reusing counters a
    second copy of this module already registered there)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        reg = REGISTRY if registry is None else registry
        self.counters: dict[str, Any] = {}
        for name, (doc, label) in NAMES.items():
            found = getattr(reg, "_names_to_collectors", {}).get(name)
            self.counters[name] = found if found is not None else Counter(name, doc, [label], registry=reg)

    def count_sample(self, fields: Mapping[str, Any] | None) -> None:
        """Count one sample's rr fields as they are sent: a refusal, or routing inline or by reference."""
        if not isinstance(fields, Mapping):
            return
        c = self.counters
        why = fields.get("routed_experts_error")
        if why:
            c["rr_routing_refused"].labels(refusal_class(why)).inc()
            return
        payload, ref = fields.get("routed_experts"), fields.get("routed_experts_ref")
        if payload is None and ref is None:
            return
        fmt = str(fields.get("routed_experts_format") or ("ref" if ref is not None else "npy"))
        c["rr_routing_samples"].labels(fmt).inc()
        shape = fields.get("routed_experts_shape")
        if isinstance(shape, (list, tuple)) and shape:
            c["rr_routing_rows"].labels(fmt).inc(int(shape[0]))
        if isinstance(payload, str):
            c["rr_routing_bytes"].labels(fmt).inc(len(payload))

    def count_answer(self, answer: Any) -> None:
        """Count every choice of an OpenAI answer rr finished (a choice without rr's fields counts nothing)."""
        choices = answer.get("choices") if isinstance(answer, Mapping) else None
        if isinstance(choices, list):
            for choice in choices:
                self.count_sample(choice)


_lock = threading.Lock()
_engine: RoutingCounters | None = None
_unavailable = False


def _engine_counters() -> RoutingCounters | None:
    """This process's counters in the default registry, made on first use; None without prometheus_client."""
    global _engine, _unavailable
    if _engine is not None or _unavailable:
        return _engine
    with _lock:
        if _engine is None and not _unavailable:
            try:
                _engine = RoutingCounters()
            except ImportError:
                _unavailable = True
                logger.debug("rr: prometheus_client is not installed; rr's routing counters are off")
    return _engine


def declare() -> None:
    """Make the engine's counters now (a patch's startup, after the engine's metrics setup): dashboards see them
    before the first sample."""
    _engine_counters()


def _count(method: str, what: Any) -> None:
    """Call this engine's counters' ``method`` on ``what``; never raises (a counter must not cost an answer)."""
    counters = _engine_counters()
    if counters is not None:
        try:
            getattr(counters, method)(what)
        except Exception:  # noqa: BLE001
            logger.debug("rr: %s failed", method, exc_info=True)


def count_sample(fields: Mapping[str, Any] | None) -> None:
    """Count one sample's rr fields on this engine's ``/metrics`` (never raises)."""
    _count("count_sample", fields)


def count_answer(answer: Any) -> None:
    """Count every choice of an OpenAI answer rr finished on this engine's ``/metrics`` (never raises)."""
    _count("count_answer", answer)
