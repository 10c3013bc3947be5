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
from typing import Any

from rr_client.core.codec import (
    FORMATS,
    CheckedRouting,
    check_payload,
    expected_rows,
    routing_error_fields,
    routing_meta_fields,
)
from rr_client.core.engines import (
    ANSWER_ROUTING_EXTS,
    CHOICE_ROUTING_EXTS,
    Engine,
    EngineName,
    int_ids,
)
from rr_client.core.engines import engine as find_engine
from rr_client.core.errors import MissingRoutingError, RoutedExpertsError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import PROVENANCE_FIELD
from rr_server.serving.generate_protocol import BadRequest, default_routed_experts_format
from rr_server.serving.store import current_store, refs_made_under

__all__ = [
    "OPENAI_PATHS",
    "RR_OPENAI_FIELDS",
    "OpenAIRouting",
    "parse_openai_routing",
    "engine_body",
    "finish_answer",
    "routing_payload_size",
]

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
# a body that sets any of these is an rr request; one that sets none gets the engine's exact answer
RR_OPENAI_FIELDS = ("return_routed_experts", "routed_experts_start", "routed_experts_format")


@dataclass(frozen=True, slots=True)
class OpenAIRouting:
    """rr's fields of one OpenAI request, validated."""

    want: bool
    start: int
    fmt: str
    stream: bool


def parse_openai_routing(
    body: Mapping[str, Any], *, engine: EngineName | Engine, stream_ok: bool = False
) -> OpenAIRouting | None:
    """rr's fields of an OpenAI body, or None when it sets none; BadRequest (400) naming the field otherwise.

    On SGLang, ``return_routed_experts`` and ``routed_experts_start_len`` are the engine's own names and count too.
    ``stream_ok``: the server can put routing on a stream's last event (rr's vLLM plugin and SGLang patch); otherwise
    ``stream=true`` with routing is a 400.
    """
    eng = find_engine(engine)
    starts = eng.start_keys
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
        raise BadRequest(
            f"stream=true with return_routed_experts is not served: {eng.stream_refusal}; send stream=false"
        )
    if want and start:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) and start > len(prompt):
            raise BadRequest(
                f"routed_experts_start {start} is beyond the prompt ({len(prompt)} tokens); "
                "it must be <= the prompt length"
            )
    return OpenAIRouting(want=want, start=start, fmt=str(fmt), stream=stream)


def engine_body(body: Mapping[str, Any], r: OpenAIRouting, *, engine: EngineName | Engine) -> dict[str, Any]:
    """The body the engine gets: rr's fields in the engine's own names, token ids asked for when routing is."""
    out = {k: v for k, v in body.items() if k not in RR_OPENAI_FIELDS and k != "routed_experts_start_len"}
    if not r.want:
        return out
    if not r.stream:  # streams: SGLang 0.5.23 chat refuses it there; rr's patch collects the ids itself
        out["return_token_ids"] = True
    out.update(find_engine(engine).engine_fields(r.start))
    return out


def _rows(
    prompt_ids: Sequence[int] | None, output_ids: Sequence[int] | None, usage: Any, n_choices: int, start: int
) -> int | None:
    """Rows the choice must carry: from its token ids, else from ``usage`` when it describes this one choice."""
    if prompt_ids is not None and output_ids is not None:
        return expected_rows(len(prompt_ids), len(output_ids), start)
    if n_choices == 1 and isinstance(usage, Mapping):
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(pt, int) and isinstance(ct, int):
            return expected_rows(pt, ct, start)
    return None


def _payload_chars(container: Any, ext: str | None) -> int:
    """Characters of the string payload at ``container["routed_experts"]`` (``ext``: ``container[ext][...]``)."""
    if ext is not None:
        container = container.get(ext) if isinstance(container, Mapping) else None
    p = container.get("routed_experts") if isinstance(container, Mapping) else None
    return len(p) if isinstance(p, str) else 0


def routing_payload_size(answer: Any) -> int:
    """Characters of routing payload in an answer (to decide whether finishing it belongs off the event loop)."""
    if not isinstance(answer, Mapping):
        return 0
    total = sum(_payload_chars(ch, ext) for ch in answer.get("choices", ()) for ext in (None, *CHOICE_ROUTING_EXTS))
    return total + sum(_payload_chars(answer, ext) for ext in ANSWER_ROUTING_EXTS)


def finish_answer(
    answer: Any,
    r: OpenAIRouting,
    info: RRInfo,
    *,
    engine: EngineName | Engine,
    drop_rows: int = 0,
    payload_rows_counted: bool = True,
    checked: Sequence[CheckedRouting | str | None] | None = None,
) -> Any:
    """Put rr's checked routing fields and token ids on every choice of a non-streaming answer (in place).

    A choice whose routing fails the check carries ``routed_experts: null`` and ``routed_experts_error``
    (the client raises on it); its other fields are untouched. On SGLang, the response-level
    ``sglext.routed_experts`` (SGLang's own place: the first choice's routing) is removed, or with
    ``routed_experts_format="sglang"`` replaced by the first choice's checked int32 payload for clients that
    read it there. SGLang's chat ``response_token_ids`` count as the choice's output ids.

    ``checked``: one entry per choice from an engine-side collector that already ran the check (rr's SGLang
    patch): a :class:`CheckedRouting` is encoded as it is, a string is the check's refusal, None is missing;
    the rows are never checked twice. Without it each choice's native payload goes through
    :func:`rr_client.core.codec.check_payload` once. ``drop_rows``: leading rows to remove first (the sidecar asks
    SGLang for every row: its OpenAI serving before 0.5.12 drops ``routed_experts_start_len``).
    ``payload_rows_counted=False`` (the sidecar): a choice whose rows cannot be counted from token ids or usage
    is refused instead of trusting the payload's length.
    """
    if not r.want or not isinstance(answer, dict):
        return answer
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return answer
    eng = find_engine(engine)
    top_prompt = int_ids(answer.get("prompt_token_ids"))  # vLLM chat: one prompt for all choices
    first = eng.pop_answer_payload(answer)
    if checked is not None and len(checked) != len(choices):
        checked = None  # counts do not add up: never pair a choice with another's rows
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        payload = eng.pop_choice_payload(choice)
        if payload is None and i == 0:
            payload = first  # SGLang's sglext holds the first request's routing, i.e. choice 0's
        prompt_ids = int_ids(choice.get("prompt_token_ids")) or top_prompt
        output_ids = eng.output_ids(choice)
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
        rows = _rows(prompt_ids, output_ids, answer.get("usage"), len(choices), r.start)
        prov = choice.get(PROVENANCE_FIELD)  # the engine side's rr_provenance for this choice, if it gave one
        try:
            with refs_made_under(_admitted(prov)):  # a ref carries the weight version its request was admitted at
                fields = routing_meta_fields(
                    _choice_routing(
                        eng, i, payload, first, checked, info, rows, r.start, drop_rows, payload_rows_counted
                    ),
                    r.fmt,
                    store=current_store(),
                )
        except RoutedExpertsError as e:
            fields = routing_error_fields(e)
        except _Refused as e:
            fields = {"routed_experts": None, "routed_experts_error": e.reason}
        if isinstance(prov, dict) and isinstance(fields.get("routed_experts_ref"), dict):
            fields["routed_experts_ref"] = {**fields["routed_experts_ref"], "provenance": prov}
        choice.update(fields)
        # the engine's own format: the first choice's rows also where the engine puts them (SGLang's sglext)
        top = eng.answer_routing_ext if r.fmt == eng.native_format and i == 0 else None
        if top and fields.get("routed_experts") is not None:
            ext = answer.setdefault(top, {})
            if isinstance(ext, dict):
                ext["routed_experts"] = fields["routed_experts"]
    return answer


def _admitted(prov: Any) -> int | None:
    """``weight_version_admitted`` of a choice's provenance (None when it has none)."""
    v = prov.get("weight_version_admitted") if isinstance(prov, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Refused(Exception):
    """An engine-side check already refused this choice; ``reason`` is its typed message, kept as it is."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _choice_routing(
    eng: Engine,
    i: int,
    payload: Any,
    first: Any,
    checked: Sequence[CheckedRouting | str | None] | None,
    info: RRInfo,
    rows: int | None,
    start: int,
    drop_rows: int,
    payload_rows_counted: bool,
) -> CheckedRouting:
    """One choice's routing, checked exactly once (here, or already by the engine-side collector)."""
    if checked is not None:
        done = checked[i]
        if isinstance(done, CheckedRouting):
            return done
        if isinstance(done, str):
            raise _Refused(done)
        raise MissingRoutingError("the engine returned no routing for this choice")
    if payload is None and eng.answer_routing_ext and i > 0 and first is not None:
        raise MissingRoutingError(
            f"{eng.name}'s OpenAI answer carries routing for its first choice only "
            f"(rr's {eng.name} patch gives every choice its own)"
        )
    if payload is None:
        raise MissingRoutingError(
            "the engine returned no routing for this choice (was it started with --enable-return-routed-experts?)"
        )
    if rows is None:
        if not (eng.rows_from_payload and payload_rows_counted):
            raise MissingRoutingError("the engine's answer has no token ids to count this choice's rows by")
        # SGLang < 0.5.23 without token ids: rr's patch counted the rows already; the payload's own count then
        rows = _payload_rows(payload, info) - drop_rows
    return check_payload(payload, info, rows=rows, start=start, drop_rows=drop_rows)


def _payload_rows(payload: Any, info: RRInfo) -> int:
    """Rows a payload holds (decoded without the check: the caller checks it next, once)."""
    from rr_client.core.codec import decode_routed_experts

    return int(
        decode_routed_experts(payload, num_layers=info.num_hidden_layers, topk=info.topk, validate=False).shape[0]
    )
