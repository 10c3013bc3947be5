"""The OpenAI-compatible endpoints from the client's side: request bodies, and choices parsed into GenerateResults.

rr servers put on every choice of ``/v1/completions`` and ``/v1/chat/completions`` the same routing fields as
``/generate`` (``routed_experts`` ``.npy``, ``routed_experts_shape/_dtype/_format/_start``) plus
``prompt_token_ids`` and ``token_ids``, and ``rr_provenance``; a choice is checked exactly like a ``/generate``
sample. A stream carries them on its routing event (the last before ``[DONE]``): :func:`parse_stream`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rr_client.client._results import GenerateResult, checked_result, decode_sample_routing, sample_ref
from rr_client.core.errors import ProtocolError
from rr_client.core.info import RRInfo
from rr_client.core.logprobs import parse_openai_logprobs

__all__ = ["COMPLETIONS_PATH", "CHAT_PATH", "openai_body", "parse_choices", "parse_stream"]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# SGLang sampling names (what ``generate`` takes) -> OpenAI names; others pass through (both engines take them)
_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
_ROUTING_KEYS = (
    "routed_experts",
    "routed_experts_shape",
    "routed_experts_dtype",
    "routed_experts_format",
    "routed_experts_start",
    "routed_experts_error",
    "routed_experts_ref",
)


def openai_body(
    params: Mapping[str, Any] | None,
    *,
    model: str,
    want: bool,
    start: int | None,
    extra: Mapping[str, Any] | None,
    by_reference: bool = False,
) -> dict[str, Any]:
    """An OpenAI request body: sampling params in OpenAI names, rr's fields, token ids always asked for."""
    body: dict[str, Any] = {"model": model, "stream": False, "return_token_ids": True}
    for k, v in (params or {}).items():
        body[_RENAMES.get(k, k)] = v
    body["return_routed_experts"] = want
    # rr_client always asks explicitly (servers may default to "sglang"); "ref": the rows stay on the server
    body["routed_experts_format"] = "ref" if by_reference and want else "npy"
    if start is not None:
        body["routed_experts_start"] = start
    body.update(extra or {})
    return body


def _ids(value: Any, what: str, where: str) -> list[int]:
    """A list of token ids from the answer, or ProtocolError naming the missing field."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"{where}: the answer has no {what} (is the server rr-patched or the rr sidecar?)")
    return value


def parse_choices(
    answer: Any,
    *,
    path: str,
    info: RRInfo,
    want_routing: bool,
    start: int,
    sent_prompt_ids: Sequence[int] | None,
    prompt_index: int = 0,
    first_index: int = 0,
    allow_extra_rows: int = 0,
    validate: bool = True,
    by_reference: bool = False,
) -> list[GenerateResult]:
    """Every choice of one answer as a GenerateResult (choice order), each checked like a ``/generate`` sample."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
        raise ProtocolError(f"{path}: answer must be an object with a non-empty 'choices' list")
    top_prompt = answer.get("prompt_token_ids")
    out = []
    for j, choice in enumerate(answer["choices"]):
        where = f"{path} choice {j}"
        if not isinstance(choice, Mapping):
            raise ProtocolError(f"{where}: choice is not an object")
        prompt_ids = _ids(choice.get("prompt_token_ids", top_prompt), "prompt_token_ids", where)
        output_ids = _ids(choice.get("token_ids"), "token_ids", where)
        if sent_prompt_ids is not None and list(sent_prompt_ids) != prompt_ids:
            raise ProtocolError(f"{where}: the engine's prompt_token_ids differ from the token ids sent")
        routing = None
        ref = None
        if want_routing and by_reference:
            ref = sample_ref(
                choice, info, prompt_tokens=len(prompt_ids), completion_tokens=len(output_ids), start=start, where=where
            )
        elif want_routing:
            routing = decode_sample_routing(
                choice,
                info,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(output_ids),
                start=start,
                allow_extra_rows=allow_extra_rows,
                validate=validate,
                where=where,
            )
        message = choice.get("message")
        text = choice.get("text")
        if not isinstance(text, str) and isinstance(message, Mapping):
            text = message.get("content")
        meta = {k: v for k, v in choice.items() if k not in _ROUTING_KEYS}
        meta.update(
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(output_ids),
            id=answer.get("id"),
            usage=answer.get("usage"),
        )
        logprobs = parse_openai_logprobs(choice.get("logprobs"), output_ids, where=where)
        fr = choice.get("finish_reason")
        out.append(
            checked_result(
                choice,
                info,
                index=first_index + j,
                prompt_index=prompt_index,
                prompt_ids=prompt_ids,
                output_ids=output_ids,
                text=text,
                finish_reason=fr if isinstance(fr, str) else None,
                routing=routing,
                start=start,
                meta=meta,
                ref=ref,
                logprobs=logprobs,
                where=where,
            )
        )
    return out


def parse_stream(
    events: Sequence[Any],
    *,
    path: str,
    info: RRInfo,
    want_routing: bool,
    start: int,
    sent_prompt_ids: Sequence[int] | None,
    **options: Any,
) -> list[GenerateResult]:
    """A streamed answer's decoded ``data:`` events (``"[DONE]"`` allowed): its routing event (the last whose
    choices carry ``token_ids``) parsed by :func:`parse_choices`, each choice's text joined from the chunks'
    deltas; ``options`` as :func:`parse_choices` takes them."""
    body = [e for e in events if e != "[DONE]"]
    if not body or not all(isinstance(e, Mapping) for e in body):
        raise ProtocolError(f"{path}: a stream must be a non-empty list of event objects")
    final = body[-1]
    choices = final.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, Mapping) and "token_ids" in c for c in choices):
        raise ProtocolError(
            f"{path}: the stream's last event carries no token_ids (not an rr server's routing "
            "event: is the server rr-patched?)"
        )
    texts: dict[int, list[str]] = {}
    for e in body[:-1]:
        for c in e.get("choices") or []:
            if not isinstance(c, Mapping):
                continue
            delta = c.get("delta")
            piece = c.get("text") if "text" in c else (delta.get("content") if isinstance(delta, Mapping) else None)
            if isinstance(piece, str) and isinstance(c.get("index"), int):
                texts.setdefault(c["index"], []).append(piece)
    merged = [
        {**c, "text": c["text"]}
        if isinstance(c.get("text"), str)
        else {**c, "text": "".join(texts.get(c.get("index", j), []))}
        for j, c in enumerate(choices)
    ]
    return parse_choices(
        {**final, "choices": merged},
        path=path,
        info=info,
        want_routing=want_routing,
        start=start,
        sent_prompt_ids=sent_prompt_ids,
        **options,
    )
