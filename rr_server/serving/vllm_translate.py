"""What serving rr's ``/generate`` from vLLM needs, shared by the vLLM plugin and the sidecar's vLLM backend.

SGLang sampling names to vLLM's, vLLM finish reasons to SGLang's, and the routing fields of one
vLLM sample: checked once through :func:`rr_client.core.codec.check_payload`, then encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rr_client.core.codec import check_payload, expected_rows, routing_meta_fields
from rr_client.core.info import RRInfo
from rr_server.serving.generate_protocol import BadRequest, SamplingParamsIn
from rr_server.serving.store import current_store

__all__ = ["to_vllm_sampling_kwargs", "finish_reason_dict", "checked_routing_fields"]


def to_vllm_sampling_kwargs(sp: SamplingParamsIn, *, routed_experts_start: int, return_logprob: bool) -> dict[str, Any]:
    """Translate SGLang sampling names to ``vllm.SamplingParams`` keyword arguments (also the OpenAI body's)."""
    if sp.top_k < -1:
        raise BadRequest("sampling_params.top_k must be -1 (disabled) or >= 1")
    kw: dict[str, Any] = dict(
        n=sp.n,
        max_tokens=sp.max_new_tokens,
        min_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=0 if sp.top_k in (-1, 0) or sp.top_k >= 1 << 30 else sp.top_k,  # vLLM: 0 = off
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        include_stop_str_in_output=sp.no_stop_trim,
    )
    if sp.stop is not None:
        kw["stop"] = sp.stop
    if sp.stop_token_ids:
        kw["stop_token_ids"] = list(sp.stop_token_ids)
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    if seed is not None:
        kw["seed"] = seed
    if sp.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in sp.logit_bias.items()}
        except ValueError:
            raise BadRequest("sampling_params.logit_bias keys must be token ids") from None
    if routed_experts_start:
        kw["routed_experts_prompt_start"] = routed_experts_start
    if return_logprob:
        kw["logprobs"] = 0
    return kw


def finish_reason_dict(reason: str | None, stop_reason: int | str | None) -> dict[str, Any] | None:
    """vLLM's finish/stop reason as SGLang's ``{"type": ..., "matched": ...}``."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": None}
    if reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": str(reason)}


def checked_routing_fields(
    routing: Any,
    info: RRInfo,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    start: int,
    fmt: str = "npy",
) -> dict[str, Any]:
    """``meta_info`` routing fields of one vLLM sample; raises a typed RoutedExpertsError if the check fails.

    vLLM returns ``prompt + completion - 1 - start`` rows, the last sampled token never having gone
    through a forward pass.
    """
    rows = expected_rows(len(prompt_ids), len(output_ids), start)
    return routing_meta_fields(check_payload(routing, info, rows=rows, start=start), fmt, store=current_store())
