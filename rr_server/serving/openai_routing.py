"""rr's routing on the OpenAI-compatible endpoints (``/v1/completions``, ``/v1/chat/completions``), engine-agnostic.

Three steps, shared by the vLLM plugin, the SGLang patch (both through
:class:`rr_server.serving.openai_middleware.OpenAIRoutingMiddleware`) and the sidecar:

1. :func:`parse_openai_routing` reads rr's fields (``return_routed_experts``, ``routed_experts_start``,
   ``routed_experts_format``); a body with none of them is not rr's business and passes through untouched.
2. :func:`engine_body` rewrites the body into the engine's own names (vLLM: ``routed_experts_prompt_start``,
   ``return_token_ids``; SGLang: ``routed_experts_start_len``, ``return_routed_experts``).
3. :func:`finish_answer` takes every choice's native routing (vLLM ``choices[].routed_experts`` ``.npy``;
   SGLang: its response-level ``sglext.routed_experts``, int32, which is the FIRST choice's only, or a
   per-choice ``choices[].sgl_ext.routed_experts`` that rr's SGLang patch supplies for every choice), passes
   it through the one full check and writes rr's fields on the choice, with the prompt and output token ids.
   Everything else stays as the engine made it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rr_client.codec import (
    FORMATS,
    check_routing,
    decode_routed_experts,
    expected_rows,
    routing_error_fields,
    routing_meta_fields,
)
from rr_client.errors import MissingRoutingError, RoutedExpertsError
from rr_client.info import RRInfo
from rr_server.serving.generate_protocol import BadRequest, default_routed_experts_format

__all__ = [
    "OPENAI_PATHS",
    "RR_OPENAI_FIELDS",
    "OpenAIRouting",
    "Engine",
    "parse_openai_routing",
    "engine_body",
    "finish_answer",
    "routing_payload_size",
    "pop_ext_routing",
    "ABSENT",
]

Engine = Literal["vllm", "sglang"]
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
# a body that sets any of these is an rr request; one that sets none gets the engine's exact answer
RR_OPENAI_FIELDS = ("return_routed_experts", "routed_experts_start", "routed_experts_format")
_STREAM_REFUSAL = {
    "vllm": "vLLM's streaming chunks carry no routing; rr's vLLM plugin serves streams",
    "sglang": "SGLang's streams carry the first request's routing only; rr's SGLang patch serves streams",
}


@dataclass(frozen=True, slots=True)
class OpenAIRouting:
    """rr's fields of one OpenAI request, validated."""

    want: bool
    start: int
    fmt: str
    stream: bool


def parse_openai_routing(body: Mapping[str, Any], *, engine: Engine, stream_ok: bool = False) -> OpenAIRouting | None:
    """rr's fields of an OpenAI body, or None when it sets none; BadRequest (400) naming the field otherwise.

    On SGLang, ``return_routed_experts`` and ``routed_experts_start_len`` are the engine's own names and count too.
    ``stream_ok``: the server can put routing on a stream's last event (rr's vLLM plugin and SGLang patch); otherwise
    ``stream=true`` with routing is a 400.
    """
    starts = ("routed_experts_start", "routed_experts_start_len") if engine == "sglang" else ("routed_experts_start",)
    if not any(k in body for k in (*RR_OPENAI_FIELDS, *starts)):
        return None
    want = body.get("return_routed_experts", False)
    if not isinstance(want, bool):
        raise BadRequest(f"return_routed_experts must be true or false, got {want!r}")
    start = 0
    for key in starts:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"{key} must be a non-negative integer, got {value!r}")
        start = value
        break
    fmt = body.get("routed_experts_format")
    if fmt is None:
        fmt = default_routed_experts_format()
    elif fmt not in FORMATS:
        raise BadRequest(f"routed_experts_format must be one of {list(FORMATS)}, got {fmt!r}")
    stream = bool(body.get("stream", False))
    if want and stream and not stream_ok:
        raise BadRequest(f"stream=true with return_routed_experts is not served: {_STREAM_REFUSAL[engine]}; "
                         "send stream=false")
    if want and start:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) and start > len(prompt):
            raise BadRequest(f"routed_experts_start {start} is beyond the prompt ({len(prompt)} tokens); "
                             "it must be <= the prompt length")
    return OpenAIRouting(want=want, start=start, fmt=str(fmt), stream=stream)


def engine_body(body: Mapping[str, Any], r: OpenAIRouting, *, engine: Engine) -> dict[str, Any]:
    """The body the engine gets: rr's fields in the engine's own names, token ids asked for when routing is."""
    out = {k: v for k, v in body.items() if k not in RR_OPENAI_FIELDS and k != "routed_experts_start_len"}
    if not r.want:
        return out
    if not r.stream:  # streams: SGLang 0.5.23 chat refuses it there; rr's patch collects the ids itself
        out["return_token_ids"] = True
    if engine == "vllm":
        out["routed_experts_prompt_start"] = r.start
    else:
        out["return_routed_experts"] = True
        out["routed_experts_start_len"] = r.start
    return out


def _int_ids(value: Any) -> list[int] | None:
    """A token-id list from the answer, or None when absent or not a list of ints."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


# what pop_ext_routing returns when there was no routing field (a payload may itself be None)
ABSENT = object()


def pop_ext_routing(container: dict[str, Any], key: str) -> Any:
    """Remove and return ``container[key]["routed_experts"]`` (SGLang's ``sglext``/``sgl_ext``), dropping the
    extension object when nothing else is left in it, as SGLang leaves it out then; ``ABSENT`` if absent."""
    ext = container.get(key)
    if not isinstance(ext, dict) or "routed_experts" not in ext:
        return ABSENT
    payload = ext.pop("routed_experts")
    if not any(v is not None for v in ext.values()):
        del container[key]
    return payload


def _native_payload(choice: dict[str, Any], engine: Engine) -> Any:
    """Remove and return the engine's own routing field of one choice."""
    if engine == "vllm":
        return choice.pop("routed_experts", None)
    payload = pop_ext_routing(choice, "sgl_ext")
    if payload is ABSENT or payload is None:
        payload = choice.pop("routed_experts", None)
    return payload


def _sglext_payload(answer: dict[str, Any]) -> Any:
    """Remove and return SGLang's response-level ``sglext.routed_experts`` (its first request's routing)."""
    payload = pop_ext_routing(answer, "sglext")
    return None if payload is ABSENT else payload


def _rows(prompt_ids: Sequence[int] | None, output_ids: Sequence[int] | None, usage: Any, n_choices: int,
          start: int) -> int | None:
    """Rows the choice must carry: from its token ids, else from ``usage`` when it describes this one choice."""
    if prompt_ids is not None and output_ids is not None:
        return expected_rows(len(prompt_ids), len(output_ids), start)
    if n_choices == 1 and isinstance(usage, Mapping):
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(pt, int) and isinstance(ct, int):
            return expected_rows(pt, ct, start)
    return None


def routing_payload_size(answer: Any) -> int:
    """Characters of routing payload in an answer (to decide whether finishing it belongs off the event loop)."""
    total = 0
    for ch in answer.get("choices", ()) if isinstance(answer, Mapping) else ():
        if isinstance(ch, Mapping):
            for p in (ch.get("routed_experts"), (ch.get("sgl_ext") or {}).get("routed_experts")
                      if isinstance(ch.get("sgl_ext"), Mapping) else None):
                total += len(p) if isinstance(p, str) else 0
    ext = answer.get("sglext") if isinstance(answer, Mapping) else None
    p = ext.get("routed_experts") if isinstance(ext, Mapping) else None
    return total + (len(p) if isinstance(p, str) else 0)


def finish_answer(answer: Any, r: OpenAIRouting, info: RRInfo, *, engine: Engine, drop_rows: int = 0,
                  payload_rows_counted: bool = True) -> Any:
    """Put rr's checked routing fields and token ids on every choice of a non-streaming answer (in place).

    A choice whose routing fails the check carries ``routed_experts: null`` and ``routed_experts_error``
    (the client raises on it); its other fields are untouched. A choice the server side already refused (its
    ``routed_experts_error`` set by rr's SGLang patch, no payload) keeps that reason. On SGLang, the response-level
    ``sglext.routed_experts`` (SGLang's own place: the first choice's routing) is removed, or with
    ``routed_experts_format="sglang"`` replaced by the first choice's checked int32 payload for clients that
    read it there. SGLang's chat ``response_token_ids`` count as the choice's output ids.

    ``drop_rows``: leading rows to remove first (the sidecar asks SGLang for every row: its OpenAI serving
    before 0.5.12 drops ``routed_experts_start_len``). ``payload_rows_counted=False`` (the sidecar): a choice
    whose rows cannot be counted from token ids or usage is refused instead of trusting the payload's length.
    """
    if not r.want or not isinstance(answer, dict):
        return answer
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return answer
    top_prompt = _int_ids(answer.get("prompt_token_ids"))  # vLLM chat: one prompt for all choices
    first = _sglext_payload(answer) if engine == "sglang" else None
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        payload = _native_payload(choice, engine)
        if payload is None and i == 0:
            payload = first  # SGLang's sglext holds the first request's routing, i.e. choice 0's
        prompt_ids = _int_ids(choice.get("prompt_token_ids")) or top_prompt
        output_ids = _int_ids(choice.get("token_ids"))
        if output_ids is None and engine == "sglang":
            output_ids = _int_ids(choice.get("response_token_ids"))  # SGLang 0.5.23 chat
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
        rows = _rows(prompt_ids, output_ids, answer.get("usage"), len(choices), r.start)
        refused = choice.get("routed_experts_error")  # the engine-side check's reason (rr's SGLang patch)
        if payload is None and isinstance(refused, str):
            choice["routed_experts"] = None
            continue
        try:
            if payload is None and engine == "sglang" and i > 0 and first is not None:
                raise MissingRoutingError("SGLang's OpenAI answer carries routing for its first choice only "
                                          "(rr's SGLang patch gives every choice its own)")
            if payload is None:
                raise MissingRoutingError(
                    "the engine returned no routing for this choice (was it started with --enable-return-routed-experts?)")
            arr = decode_routed_experts(payload, num_layers=info.num_hidden_layers, topk=info.topk, validate=False)
            arr = arr[drop_rows:]
            if rows is None:
                if engine != "sglang" or not payload_rows_counted:
                    raise MissingRoutingError("the engine's answer has no token ids to count this choice's rows by")
                rows = int(arr.shape[0])  # SGLang < 0.5.23 without token ids: rr's patch counted the rows already
            fields = routing_meta_fields(check_routing(arr, info, rows=rows, start=r.start), r.fmt)
        except RoutedExpertsError as e:
            fields = routing_error_fields(e)
        choice.update(fields)
        if engine == "sglang" and r.fmt == "sglang" and i == 0 and fields.get("routed_experts") is not None:
            ext = answer.setdefault("sglext", {})
            if isinstance(ext, dict):
                ext["routed_experts"] = fields["routed_experts"]
    return answer
