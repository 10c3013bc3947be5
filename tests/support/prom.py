"""Read rr's counters out of a Prometheus text exposition (an engine's or the sidecar's ``/metrics``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["rr_samples"]


def rr_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(sample name, sorted labels) -> value`` for every ``rr_*_total`` sample in ``text``."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("rr_") and s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out
