"""The sidecar's per-sample ``rr_provenance``: what an unpatched engine's answer says (cached tokens, SGLang's cache
tier, retractions and weight spans) and the weight versions from the sidecar's own count of the weight routes it
forwards (:mod:`rr_server.serving.weight_epoch`). Preemptions stay None unless the engine reports them (vLLM does not).

**What the sidecar cannot see.** An update pushed straight to the engine (e.g. ``DiskWeightSync`` given the
engine's URL) never passes the sidecar, and SGLang's label (``meta_info.weight_version``) stays ``"default"`` unless
the pusher relabels, so nothing in the answer shows it. Unless every update goes through the sidecar (its operator
says so: ``rr-server proxy --weight-updates-via-sidecar``, :attr:`WeightEpoch.sees_all_updates`), the weight fields
say unknown: both versions null, ``weight_update_during`` null unless an update is seen (the engine's own spans name
two versions, or one passed through the sidecar while the request ran), ``cached_under_older_weights`` null for a
cache hit unless the sidecar itself saw the cache go stale (False without cached tokens: nothing cached to be stale)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rr_client.core.engines import OUTPUT_ID_KEYS
from rr_client.core.provenance import Provenance, tokens_digest
from rr_server.serving.provenance_fields import _count, bind_provenance, cache_tier, cached_under_older, weights_since
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["answer_provenance", "sglang_provenance", "completion_provenance", "weights_since", "cache_tier", "attach"]

_RETRACTION_KEYS = ("num_retractions", "total_retractions")  # SGLang meta_info: 0.5.12+ / 0.5.7 - 0.5.11


def _digest(prompt_ids: Sequence[int] | None, output_ids: Any, completion_tokens: Any) -> str | None:
    """tokens_digest when the prompt ids are known and the output ids are the whole completion."""
    if prompt_ids is None or not isinstance(output_ids, list):
        return None
    if isinstance(completion_tokens, int) and len(output_ids) != completion_tokens:
        return None  # an incremental stream chunk: not every output id is here
    try:
        return tokens_digest(list(prompt_ids), [int(t) for t in output_ids])
    except (TypeError, ValueError):
        return None


def _spans_two_versions(spans: Any) -> bool:
    """SGLang 0.5.20+'s ``weight_versions`` spans name more than one version."""
    if not isinstance(spans, list):
        return False
    return len({str(s.get("version")) for s in spans if isinstance(s, Mapping)}) > 1


def _weights(
    epoch: WeightEpoch, mark: WeightMark | None, cached: int, engine_saw_update: bool = False
) -> tuple[int | None, int | None, bool | None, bool | None]:
    """(version at admission, version at finish, an update during, cached tokens from older weights' KV) as far as
    the sidecar can prove them (``engine_saw_update``: the engine's own spans name two versions); None: unknown."""
    admitted, finished, during = weights_since(epoch, mark)
    older = cached_under_older(mark, cached)
    if epoch.sees_all_updates:
        return admitted, finished, during or engine_saw_update, older
    return None, None, True if during or engine_saw_update else None, True if older else (False if not cached else None)


def sglang_provenance(
    meta: Mapping[str, Any],
    epoch: WeightEpoch,
    mark: WeightMark | None,
    prompt_ids: Sequence[int] | None,
    output_ids: Any,
) -> dict[str, Any]:
    """``rr_provenance`` of one final SGLang ``/generate`` item, from its ``meta_info`` and the sidecar's count."""
    cached = _count(meta.get("cached_tokens")) or 0
    admitted, finished, during, older = _weights(epoch, mark, cached, _spans_two_versions(meta.get("weight_versions")))
    retractions = next((_count(meta[k]) for k in _RETRACTION_KEYS if k in meta), None)
    return Provenance(
        cached_tokens=cached,
        cache_tier=cache_tier(meta.get("cached_tokens_details"), cached),
        preemptions=retractions,
        weight_version_admitted=admitted,
        weight_version_finished=finished,
        weight_update_during=during,
        tokens_digest=_digest(prompt_ids, output_ids, meta.get("completion_tokens")),
        cached_under_older_weights=older,
    ).to_dict()


def completion_provenance(
    cached_tokens: Any,
    epoch: WeightEpoch,
    mark: WeightMark | None,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int] | None,
) -> dict[str, Any]:
    """``rr_provenance`` of one completion choice (vLLM's /generate backend, the OpenAI endpoints): the usage's cached
    tokens (no tier), preemptions unknown (an OpenAI answer does not report them)."""
    cached = _count(cached_tokens) or 0
    admitted, finished, during, older = _weights(epoch, mark, cached)
    return Provenance(
        cached_tokens=cached,
        cached_under_older_weights=older,
        preemptions=None,
        weight_version_admitted=admitted,
        weight_version_finished=finished,
        weight_update_during=during,
        tokens_digest=_digest(prompt_ids, list(output_ids) if output_ids is not None else None, None),
    ).to_dict()


def attach(meta: dict[str, Any], prov: Mapping[str, Any]) -> None:
    """Answer ``prov`` as ``meta_info["rr_provenance"]`` and in the sample's refs (routing and indexer), as rr's
    SGLang patch does (:func:`rr_server.serving.provenance_fields.bind_provenance`)."""
    bind_provenance(meta, prov)


def answer_provenance(answer: Any, epoch: WeightEpoch, mark: WeightMark | None) -> None:
    """Give every choice of an OpenAI answer its ``rr_provenance`` (cached tokens from the answer's usage)."""
    if not isinstance(answer, dict):
        return
    usage = answer.get("usage") if isinstance(answer.get("usage"), Mapping) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), Mapping) else {}
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict):
            ids = next((choice[k] for k in OUTPUT_ID_KEYS if choice.get(k) is not None), None)
            prompt = choice.get("prompt_token_ids")
            attach(
                choice,
                completion_provenance(
                    details.get("cached_tokens"),
                    epoch,
                    mark,
                    prompt if isinstance(prompt, list) else None,
                    ids if isinstance(ids, list) else None,
                ),
            )
