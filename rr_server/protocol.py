"""SGLang-style ``/generate`` request schema and reply builders, engine-agnostic.

Shared by the vLLM plugin and the sidecar: parse + validate a request once (pydantic v2),
translate SGLang sampling names to vLLM's, and build SGLang-shaped replies whose routing
is checked against the model's dimensions before it is ever put on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from rr_client.codec import expected_rows, routing_meta_fields

__all__ = [
    "BadRequest",
    "SamplingParamsIn",
    "GenerateRequest",
    "NormalizedGenerate",
    "RoutingDims",
    "parse_generate_request",
    "to_vllm_sampling_kwargs",
    "finish_reason_dict",
    "build_item",
    "check_routing",
    "sse_line",
    "SSE_DONE",
    "error_body",
]

SSE_DONE = "data: [DONE]\n\n"

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

    @field_validator("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", mode="before")
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
    return_logprob: StrictBool | list[StrictBool] = False
    rid: str | list[str] | None = None

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


@dataclass(frozen=True)
class RoutingDims:
    """What every routing array from this model must look like."""

    num_hidden_layers: int
    num_experts: int
    topk: int


def _fmt_validation(err: ValidationError, prefix: str = "") -> str:
    """One readable line per pydantic error: ``field.path: message``."""
    parts = []
    for e in err.errors()[:8]:
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]])
        parts.append(f"{loc}: {e['msg']}")
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
    extras = {k: v for k, v in (req.model_extra or {}).items()
              if v not in (None, False, [], {}, "", 0) and not (k in _TOLERATED and _TOLERATED[k] == v)
              and k not in _ANY_VALUE}
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
        if any(t < 0 for p in prompts for t in p):  # type: ignore[union-attr]
            raise BadRequest("input_ids must be non-negative token ids")
    if not prompts:
        raise BadRequest("empty batch: at least one prompt is required")
    n = len(prompts)
    sampling = _per_prompt(_sampling(req.sampling_params), n, "sampling_params")
    if req.stream and any(s.n > 1 for s in sampling):
        raise BadRequest("stream=true with sampling_params.n > 1 is not supported; send n separate requests")
    start = req.routed_experts_start if req.routed_experts_start is not None else req.routed_experts_start_len
    rids = _per_prompt(req.rid, n, "rid")
    return NormalizedGenerate(
        prompts=prompts,
        sampling=sampling,
        is_batch=is_batch,
        stream=req.stream,
        return_routed_experts=req.return_routed_experts,
        routed_experts_start=int(start or 0),
        return_logprob=[bool(x) for x in _per_prompt(req.return_logprob, n, "return_logprob")],
        rids=rids,
    )


def to_vllm_sampling_kwargs(sp: SamplingParamsIn, *, routed_experts_start: int, return_logprob: bool) -> dict[str, Any]:
    """Translate SGLang sampling names to ``vllm.SamplingParams`` keyword arguments."""
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
    if sp.top_k < -1:
        raise BadRequest("sampling_params.top_k must be -1 (disabled) or >= 1")
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


def check_routing(
    arr: Any, dims: RoutingDims, *, prompt_tokens: int, completion_tokens: int, start: int
) -> np.ndarray:
    """Return routing as an int ndarray if it matches the expected shape and id range; else raise."""
    if arr is None:
        raise ValueError("engine returned no routing for this request")
    a = np.asarray(arr)
    rows = expected_rows(prompt_tokens, completion_tokens, start)
    want = (rows, dims.num_hidden_layers, dims.topk)
    if a.shape != want:
        raise ValueError(f"routing shape {tuple(a.shape)} != expected {want} "
                         f"(prompt {prompt_tokens} + completion {completion_tokens} - 1 - start {start})")
    if a.size and (a.min() < 0 or a.max() >= dims.num_experts):
        raise ValueError(f"routing has expert ids outside [0, {dims.num_experts})")
    return a


def build_item(
    *,
    rid: str,
    text: str | None,
    output_ids: Sequence[int],
    prompt_tokens: int,
    cached_tokens: int,
    finish_reason: dict[str, Any] | None,
    e2e_latency: float,
    routing: Any = None,
    dims: RoutingDims | None = None,
    routed_experts_start: int = 0,
    want_routing: bool = False,
    output_token_logprobs: list[list[Any]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One SGLang-shaped reply entry; routing is validated first and never sent unchecked.

    With routing, ``prompt_token_ids`` is echoed so clients that sent text can align rows with tokens.
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
    if want_routing:
        if dims is None:
            raise ValueError("routing requested but no model dimensions known")
        try:
            arr = check_routing(routing, dims, prompt_tokens=prompt_tokens,
                                completion_tokens=len(output_ids), start=routed_experts_start)
            meta.update(routing_meta_fields(arr, num_experts=dims.num_experts, start=routed_experts_start))
            if prompt_token_ids is not None:
                meta["prompt_token_ids"] = list(prompt_token_ids)
        except ValueError as e:
            meta["routed_experts_error"] = str(e)
    item: dict[str, Any] = {"output_ids": list(output_ids), "meta_info": meta}
    if text is not None:
        item = {"text": text, **item}
    return item


def sse_line(obj: Any) -> str:
    """One SGLang-style server-sent event line."""
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def error_body(message: str, status: int) -> dict[str, Any]:
    """JSON error body, shaped like vLLM's/SGLang's ``{"error": {...}}``."""
    kind: Literal["BadRequestError", "InternalServerError"] = (
        "BadRequestError" if status < 500 else "InternalServerError"
    )
    return {"error": {"message": message, "type": kind, "code": status}, "message": message}
