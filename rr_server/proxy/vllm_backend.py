"""vLLM upstream: SGLang ``/generate`` -> ``/v1/completions`` (one call per prompt) -> rr replies."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson

from rr_client.core.codec import expected_rows
from rr_client.core.info import RRInfo
from rr_server.proxy.errors import ProxyError
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.proxy.provenance import attach, completion_provenance
from rr_server.proxy.routing import off_loop_if_store_blocks, upstream_routing_fields
from rr_server.proxy.upstream import Upstream
from rr_server.serving.fanout import gather_or_cancel, merge_streams
from rr_server.serving.generate_protocol import (
    SSE_DONE,
    BadRequest,
    NormalizedGenerate,
    build_item,
    sse_line,
)
from rr_server.serving.indexer_fields import vllm_indexer_refusal
from rr_server.serving.store import refs_made_under
from rr_server.serving.vllm_translate import finish_reason_dict, to_vllm_sampling_kwargs
from rr_server.serving.weight_epoch import WeightEpoch

__all__ = ["VLLMBackend"]

_NO_ROUTING_HINT = "was the upstream started with --enable-return-routed-experts?"


def completion_body(req: NormalizedGenerate, i: int, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body for prompt ``i`` (vLLM names, token ids back, prompt start)."""
    try:
        kw = to_vllm_sampling_kwargs(
            req.sampling[i], routed_experts_start=req.routed_experts_start, return_logprob=req.return_logprob[i]
        )
    except BadRequest as e:
        raise ProxyError(e.status, "bad_request", str(e)) from None
    p = req.prompts[i]
    if req.return_routed_experts and isinstance(p, list) and req.routed_experts_start > len(p):
        # vLLM refuses it too (400), with its own message; rr's says which field and prompt
        raise ProxyError(
            400,
            "bad_request",
            f"routed_experts_start {req.routed_experts_start} is beyond prompt {i} "
            f"({len(p)} tokens); it must be <= the prompt length",
        )
    salt = {"cache_salt": req.cache_salts[i]} if req.cache_salts and req.cache_salts[i] else {}
    return {"model": model, "prompt": req.prompts[i], "return_token_ids": True, "stream": False, **kw, **salt}


def _logprobs(choice: Mapping[str, Any], ids: list[int]) -> list[list[Any]] | None:
    """SGLang ``output_token_logprobs`` (``[logprob, token_id, None]``) from an OpenAI logprobs block."""
    lp = choice.get("logprobs")
    if not isinstance(lp, Mapping) or not isinstance(lp.get("token_logprobs"), list):
        return None
    return [[v, t, None] for v, t in zip(lp["token_logprobs"], ids)]


def _int_list(v: Any, what: str) -> list[int]:
    """A list of token ids from the upstream, or a 502."""
    if not isinstance(v, list) or not all(isinstance(t, int) for t in v):
        raise ProxyError(502, "upstream_protocol", f"upstream completion has no valid {what} (need return_token_ids)")
    return v


class VLLMBackend:
    """Serves ``/generate`` from an unpatched vLLM API server started with ``--enable-return-routed-experts``."""

    def __init__(
        self,
        up: Upstream,
        info: Callable[[], Awaitable[tuple[RRInfo, str]]],
        metrics: ProxyMetrics,
        epoch: WeightEpoch | None = None,
    ) -> None:
        self._up, self._info, self._metrics = up, info, metrics
        self._epoch = epoch or WeightEpoch()  # the sidecar's count of the weight routes it forwards

    async def generate(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> Any:
        """The reply: one item, or all items in prompt order (``n`` per prompt); any failure fails it all."""
        items = await self._items(req)
        return items[0] if not req.is_batch and len(items) == 1 else items

    async def _items(self, req: NormalizedGenerate) -> list[dict[str, Any]]:
        """Every sample's reply item, in prompt order."""
        if req.return_indexer_topk:
            raise ProxyError(400, "bad_request", vllm_indexer_refusal())
        info, model = await self._info()
        base = uuid.uuid4().hex
        parts = await gather_or_cancel(self._one(req, i, info, model, base) for i in range(len(req.prompts)))
        return [item for part in parts for item in part]

    async def _one(self, req: NormalizedGenerate, i: int, info: RRInfo, model: str, base: str) -> list[dict[str, Any]]:
        """One upstream completion for prompt ``i``; routing validated before it is re-encoded."""
        t0 = time.perf_counter()
        body = completion_body(req, i, model)
        mark = self._epoch.mark()
        reply = await self._up.call("POST", "/v1/completions", body)
        choices = reply.get("choices") if isinstance(reply, Mapping) else None
        n = req.sampling[i].n
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise ProxyError(
                502, "upstream_protocol", f"upstream /v1/completions returned {got} choices, expected n={n}"
            )
        usage_raw = reply.get("usage")
        usage: Mapping[str, Any] = usage_raw if isinstance(usage_raw, Mapping) else {}
        details_raw = usage.get("prompt_tokens_details")
        details: Mapping[str, Any] = details_raw if isinstance(details_raw, Mapping) else {}
        return await off_loop_if_store_blocks(
            lambda: self._choice_items(req, i, info, choices, details, mark, t0, base)
        )

    def _choice_items(
        self,
        req: NormalizedGenerate,
        i: int,
        info: RRInfo,
        choices: list[Any],
        details: Mapping[str, Any],
        mark: Any,
        t0: float,
        base: str,
    ) -> list[dict[str, Any]]:
        """Prompt ``i``'s upstream choices as rr items (routing checked, kept in the store when asked by ref)."""
        n = req.sampling[i].n
        rid = req.rids[i] or f"rr-{base}-{i}"
        start = req.routed_experts_start
        items = []
        for j, ch in enumerate(choices):
            if not isinstance(ch, Mapping):
                raise ProxyError(502, "upstream_protocol", "upstream completion choice is not an object")
            prompt_ids = _int_list(ch.get("prompt_token_ids"), "prompt_token_ids")
            if isinstance(req.prompts[i], list) and prompt_ids != req.prompts[i]:
                raise ProxyError(
                    502, "upstream_protocol", f"prompt {i}: upstream prompt_token_ids differ from input_ids"
                )
            out_ids = _int_list(ch.get("token_ids"), "token_ids")
            fields = None
            if req.return_routed_experts:
                with refs_made_under(mark.version):  # a ref: the weights its request ran on
                    fields = upstream_routing_fields(
                        {"routed_experts": ch.get("routed_experts")},
                        info,
                        start=start,
                        where=f"prompt {i} sample {j}",
                        rows=expected_rows(len(prompt_ids), len(out_ids), start),
                        hint=_NO_ROUTING_HINT,
                        fmt=req.routed_experts_format,
                        metrics=self._metrics,
                    )
            item = build_item(
                rid=rid if n == 1 else f"{rid}-{j}",
                text=ch.get("text") if isinstance(ch.get("text"), str) else None,
                output_ids=out_ids,
                prompt_tokens=len(prompt_ids),
                cached_tokens=int(details.get("cached_tokens") or 0),
                finish_reason=finish_reason_dict(ch.get("finish_reason"), ch.get("stop_reason")),
                e2e_latency=time.perf_counter() - t0,
                routing_fields=fields,
                prompt_token_ids=prompt_ids,
                output_token_logprobs=_logprobs(ch, out_ids) if req.return_logprob[i] else None,
            )
            attach(
                item["meta_info"],
                completion_provenance(details.get("cached_tokens"), self._epoch, mark, prompt_ids, out_ids),
            )
            items.append(item)
        return items

    async def stream(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> AsyncIterator[str]:
        """SSE: routing off -> live cumulative chunks; routing on -> final chunks (vLLM streams carry no routing)."""
        if req.return_routed_experts:
            items = await self._items(req)
            for k, item in enumerate(items):  # stream=true implies n == 1: item k belongs to prompt k
                if req.is_batch:
                    item["index"] = k
                yield sse_line(item)
            yield SSE_DONE
            return
        _, model = await self._info()
        base = uuid.uuid4().hex
        streams = [self._stream_one(req, i, model, req.rids[i] or f"rr-{base}-{i}") for i in range(len(req.prompts))]
        async for _, ev in merge_streams(streams):
            yield ev
        yield SSE_DONE

    async def _stream_one(self, req: NormalizedGenerate, i: int, model: str, rid: str) -> AsyncIterator[str]:
        """One prompt's upstream stream (deltas) as SGLang chunks (cumulative text and ids)."""
        t0 = time.perf_counter()
        body = {**completion_body(req, i, model), "stream": True}
        text, ids, prompt_tokens = "", [], 0
        async with self._up.stream_lines("/v1/completions", body) as lines:
            async for line in lines:
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError as e:
                    raise ProxyError(502, "upstream_protocol", f"upstream stream chunk is not JSON: {e}") from None
                if not isinstance(chunk, Mapping) or "error" in chunk:
                    raise ProxyError(502, "upstream_error", f"upstream stream failed: {str(chunk)[:300]}")
                for ch in chunk.get("choices") or []:
                    prompt_tokens = len(ch.get("prompt_token_ids") or []) or prompt_tokens
                    text += ch.get("text") or ""
                    ids += _int_list(ch.get("token_ids") or [], "token_ids")
                    meta = {
                        "id": rid,
                        "finish_reason": finish_reason_dict(ch.get("finish_reason"), ch.get("stop_reason")),
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "e2e_latency": time.perf_counter() - t0,
                    }
                    item: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
                    if req.is_batch:
                        item["index"] = i
                    yield sse_line(item)
