"""The SGLang-style ``/generate`` protocol rr serves, engine-agnostic: request schema, reply items, SSE, errors.

Shared by the vLLM plugin and the sidecar: a request is parsed and validated once (pydantic v2);
reply items carry routing fields that the caller made from :class:`rr_client.CheckedRouting`
(or an error marker), never raw arrays. vLLM specifics live in :mod:`rr_server.serving.vllm_translate`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from rr_client.core import settings

__all__ = [
    "BadRequest",
    "SamplingParamsIn",
    "GenerateRequest",
    "NormalizedGenerate",
    "parse_generate_request",
    "build_item",
    "sse_line",
    "SSE_DONE",
    "FORMAT_ENV",
    "default_routed_experts_format",
]

SSE_DONE = "data: [DONE]\n\n"
# Server default for ``routed_experts_format`` when a request does not say ("npy" or "sglang").
FORMAT_ENV = "RR_ROUTED_EXPERTS_FORMAT"

# SGLang fields sent by common trainers with a default we can honour as-is.
_TOLERATED: dict[str, Any] = {"logprob_start_len": -1}
_ANY_VALUE = frozenset({"return_text_in_logprobs", "log_metrics", "no_logs"})


class BadRequest(ValueError):
    """A client error: becomes HTTP 4xx with this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class SamplingParamsIn(BaseModel):
    """SGLang ``sampling_params`` (the subset that maps onto vLLM's SamplingParams)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: StrictInt | None = Field(default=128, ge=1)
    min_new_tokens: StrictInt = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    n: StrictInt = Field(default=1, ge=1, le=64)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    seed: StrictInt | None = None
    sampling_seed: StrictInt | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator(
        "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", mode="before"
    )
    @classmethod
    def _number(cls, v: Any) -> Any:
        """Accept ints for float fields (JSON has one number type) but never bools or strings."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("must be a number")
        return float(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        """Empty stop strings would match everywhere: reject them."""
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v


class GenerateRequest(BaseModel):
    """SGLang ``/generate`` request body (text or token ids; one prompt or a batch)."""

    model_config = ConfigDict(extra="allow", strict=True)

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: StrictBool = False
    return_routed_experts: StrictBool = False
    routed_experts_start: StrictInt | None = Field(default=None, ge=0)
    routed_experts_start_len: StrictInt | None = Field(default=None, ge=0)
    routed_experts_format: Literal["npy", "sglang", "ref"] | None = None
    return_logprob: StrictBool | list[StrictBool] = False
    rid: str | list[str] | None = None
    return_indexer_topk: StrictBool = False  # SGLang 0.5.23+'s sparse-attention indexer picks (rr_client.core.indexer)
    indexer_topk_format: Literal["ref", "npy"] | None = None  # by reference (the default) or inline
    # a prefix-cache namespace (vLLM's prompt ``cache_salt``): requests share cached KV only with the same salt
    cache_salt: str | list[str] | None = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: Any) -> Any:
        """A string or a non-empty list of strings."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            return v
        raise ValueError("must be a string or a non-empty list of strings")

    @field_validator("input_ids")
    @classmethod
    def _input_ids(cls, v: Any) -> Any:
        """A list of token ids or a non-empty list of such lists."""

        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if v is None or ids(v) or (isinstance(v, list) and v and all(ids(x) for x in v)):
            return v
        raise ValueError("must be a list of integer token ids or a non-empty list of such lists")


@dataclass(frozen=True)
class NormalizedGenerate:
    """A validated request, one entry per prompt (batch or not)."""

    prompts: list[str | list[int]]
    sampling: list[SamplingParamsIn]
    is_batch: bool
    stream: bool
    return_routed_experts: bool
    routed_experts_start: int
    return_logprob: list[bool]
    rids: list[str | None]
    routed_experts_format: str = "npy"
    return_indexer_topk: bool = False
    indexer_topk_format: str | None = None  # None: the server's default (rr_server.serving.indexer_fields)
    cache_salts: list[str | None] | None = None  # per prompt (None: no salt)


# sampling keys other APIs spell differently: the /generate (SGLang) name a refusal points to
_SPELLINGS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop_token": "stop_token_ids",
    "logprobs": "return_logprob=true at the top level of the body",
    "return_logprob": "return_logprob at the top level of the body, not in sampling_params",
}


def _fmt_validation(err: ValidationError, prefix: str = "") -> str:
    """One readable line per pydantic error: ``field.path: message``."""
    parts = []
    for e in err.errors()[:8]:
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]])
        hint = ""
        if e["type"] == "extra_forbidden" and e["loc"]:  # OpenAI / vLLM spellings of SGLang's names
            known = _SPELLINGS.get(str(e["loc"][-1]))
            hint = f" (use {known})" if known else ""
        parts.append(f"{loc}: {e['msg']}{hint}")
    return "invalid /generate request: " + "; ".join(parts)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """Broadcast a scalar-or-list field to one value per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries but there are {n} prompts")
        return list(value)
    return [value] * n


def _sampling(raw: Any) -> SamplingParamsIn | list[SamplingParamsIn]:
    """Validate ``sampling_params``: an object, or one object per prompt."""
    if raw is None:
        return SamplingParamsIn()
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for j, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest("sampling_params must be an object or a list of objects")
        try:
            out.append(SamplingParamsIn.model_validate(item))
        except ValidationError as e:
            where = f"sampling_params[{j}]" if isinstance(raw, list) else "sampling_params"
            raise BadRequest(_fmt_validation(e, where)) from None
    return out if isinstance(raw, list) else out[0]


def parse_generate_request(body: bytes | str | Mapping[str, Any]) -> NormalizedGenerate:
    """Parse and validate a ``/generate`` body; raise BadRequest with a clear message."""
    if isinstance(body, (bytes, str)):
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
    else:
        data = dict(body)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        req = GenerateRequest.model_validate(data)
    except ValidationError as e:
        raise BadRequest(_fmt_validation(e)) from None
    extras = {
        k: v
        for k, v in (req.model_extra or {}).items()
        if v not in (None, False, [], {}, "", 0)
        and not (k in _TOLERATED and _TOLERATED[k] == v)
        and k not in _ANY_VALUE
    }
    unsupported = sorted(extras)  # unknown fields are tolerated only with an "off" value
    if unsupported:
        raise BadRequest(f"unsupported /generate field(s) for this server: {', '.join(unsupported)}")

    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("exactly one of 'text' or 'input_ids' is required")
    prompts: list[str | list[int]]
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        prompts = list(req.text) if isinstance(req.text, list) else [req.text]
        if any(p == "" for p in prompts):
            raise BadRequest("empty prompt: 'text' must be non-empty")
    else:
        ids = req.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if is_batch else [list(ids)]  # type: ignore[arg-type]
        if any(len(p) == 0 for p in prompts):
            raise BadRequest("empty prompt: 'input_ids' must be non-empty")
        if any(t < 0 for p in prompts for t in p if isinstance(t, int)):
            raise BadRequest("input_ids must be non-negative token ids")
    if not prompts:
        raise BadRequest("empty batch: at least one prompt is required")
    n = len(prompts)
    sampling = _per_prompt(_sampling(req.sampling_params), n, "sampling_params")
    if req.stream and any(s.n > 1 for s in sampling):
        raise BadRequest("stream=true with sampling_params.n > 1 is not supported; send n separate requests")
    start = req.routed_experts_start if req.routed_experts_start is not None else req.routed_experts_start_len
    rids = _per_prompt(req.rid, n, "rid")
    salts = None if req.cache_salt is None else _per_prompt(req.cache_salt, n, "cache_salt")
    if salts is not None and not all(isinstance(x, str) and x for x in salts):
        raise BadRequest("cache_salt must be a non-empty string or one per prompt")
    return NormalizedGenerate(
        prompts=prompts,
        sampling=sampling,
        is_batch=is_batch,
        stream=req.stream,
        return_routed_experts=req.return_routed_experts,
        routed_experts_start=int(start or 0),
        return_logprob=[bool(x) for x in _per_prompt(req.return_logprob, n, "return_logprob")],
        rids=rids,
        routed_experts_format=req.routed_experts_format or default_routed_experts_format(),
        return_indexer_topk=req.return_indexer_topk,
        indexer_topk_format=req.indexer_topk_format,
        cache_salts=salts,
    )


def default_routed_experts_format() -> str:
    """The server's default ``routed_experts_format`` (env ``RR_ROUTED_EXPERTS_FORMAT``, set by the launcher/sidecar
    flag ``--routed-experts-format``): ``"npy"`` unless changed; a bad value fails loudly at the first request."""
    from rr_client.core.codec import check_format

    value = settings.text(FORMAT_ENV, default="npy")
    try:
        return check_format(value)
    except ValueError as e:
        raise BadRequest(f"server misconfigured: {FORMAT_ENV}: {e}", 500) from None


def build_item(
    *,
    rid: str,
    text: str | None,
    output_ids: Sequence[int],
    prompt_tokens: int,
    cached_tokens: int,
    finish_reason: dict[str, Any] | None,
    e2e_latency: float,
    routing_fields: Mapping[str, Any] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    output_token_logprobs: list[list[Any]] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One SGLang-shaped reply entry.

    ``routing_fields`` comes from :func:`rr_client.routing_meta_fields` (checked routing) or
    :func:`rr_client.routing_error_fields`; with routing, ``prompt_token_ids`` is echoed so clients
    that sent text can align rows with tokens. ``provenance``: the sample's
    :meth:`rr_client.core.provenance.Provenance.to_dict`, answered as ``meta_info["rr_provenance"]`` (and in its ref).
    """
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": len(output_ids),
        "cached_tokens": int(cached_tokens),
        "e2e_latency": e2e_latency,
    }
    if output_token_logprobs is not None:
        meta["output_token_logprobs"] = output_token_logprobs
    if provenance is not None:
        meta["rr_provenance"] = dict(provenance)
    if routing_fields is not None:
        meta.update(routing_fields)
        ref = meta.get("routed_experts_ref")
        if provenance is not None and isinstance(ref, dict):
            meta["routed_experts_ref"] = {**ref, "provenance": dict(provenance)}
        if prompt_token_ids is not None and (meta.get("routed_experts") is not None or "routed_experts_ref" in meta):
            meta["prompt_token_ids"] = list(prompt_token_ids)
    item: dict[str, Any] = {"output_ids": list(output_ids), "meta_info": meta}
    if text is not None:
        item = {"text": text, **item}
    return item


def sse_line(obj: Any) -> str:
    """One SGLang-style server-sent event line."""
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"
