"""Per-sample provenance on SGLang (``meta_info["rr_provenance"]``): what SGLang's scheduler reports per request in
its output batch, plus rr's count of the weight routes (:mod:`rr_server.serving.weight_epoch`).

From SGLang's ``BatchTokenIDOutput`` / ``BatchStrOutput`` (every release 0.5.7 - 0.5.23 unless said):

* ``cached_tokens[i]``: prompt tokens served from the radix (prefix) cache;
* ``cached_tokens_details[i]`` (0.5.9+, when SGLang fills it): ``{"device": n, "host": n[, "storage": n]}``; the
  tier is the deepest one that served tokens (host / storage are HiCache restores, #26975), None when not given;
* ``retraction_counts[i]``: times the scheduler retracted the request (re-prefilled on resume);
* ``weight_versions[i]`` (0.5.20+): SGLang's own spans of output tokens per weight version; more than one span
  means SGLang saw its weight version change while the request ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rr_client.core.provenance import Provenance, tokens_digest
from rr_server.serving.provenance_fields import _count, cache_tier, cached_under_older, spans_update, weights_since
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["sglang_spans_update", "batch_provenance", "with_digest"]


def _at(recv_obj: Any, name: str, i: int) -> Any:
    """``recv_obj.<name>[i]``, or None when the field is absent, empty or short."""
    values = getattr(recv_obj, name, None)
    try:
        return values[i] if values is not None and i < len(values) else None
    except TypeError:
        return None


def sglang_spans_update(spans: Any) -> bool:
    """SGLang 0.5.20+'s weight-version spans of one request name more than one version (:func:`spans_update`)."""
    return spans_update(spans)


def batch_provenance(recv_obj: Any, i: int, epoch: WeightEpoch, mark: WeightMark | None) -> dict[str, Any]:
    """The ``rr_provenance`` object of request ``i`` of a finishing batch (``mark``: rr's epoch at its admission);
    its ``tokens_digest`` is set by :func:`with_digest` once the answer's output ids are complete."""
    cached = _count(_at(recv_obj, "cached_tokens", i)) or 0
    admitted, finished, during = weights_since(epoch, mark)
    during = during or sglang_spans_update(_at(recv_obj, "weight_versions", i))
    return Provenance(
        cached_tokens=cached,
        cache_tier=cache_tier(_at(recv_obj, "cached_tokens_details", i), cached),
        preemptions=_count(_at(recv_obj, "retraction_counts", i)),
        weight_version_admitted=admitted,
        weight_version_finished=finished,
        weight_update_during=during,
        cached_under_older_weights=cached_under_older(mark, cached),
    ).to_dict()


def with_digest(prov: dict[str, Any], prompt_ids: Sequence[int] | None, output_ids: Any) -> dict[str, Any]:
    """``prov`` with ``tokens_digest`` of the request's prompt and output ids (left None when either is unknown)."""
    if prompt_ids is None or output_ids is None:
        return prov
    try:
        ids = [int(t) for t in output_ids]
    except (TypeError, ValueError):
        return prov
    return {**prov, "tokens_digest": tokens_digest(list(prompt_ids), ids)}
