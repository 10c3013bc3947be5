"""``RoutedExpertsClient``: async batched ``/generate`` with routing, retries, and exact validation."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import orjson

from rr_client._http_errors import error_for_status, map_httpx_error
from rr_client._results import GenerateBatch, GenerateResult, parse_sample
from rr_client.errors import ProtocolError, RequestRejectedError, RRError
from rr_client.info import RRInfo

__all__ = ["RoutedExpertsClient", "Prompt", "API_KEY_ENV"]

API_KEY_ENV = "RR_API_KEY"

Prompt = str | Sequence[int]


class RoutedExpertsClient:
    """Async client for any rr server (patched SGLang/vLLM or the sidecar).

    ``async with RoutedExpertsClient("http://127.0.0.1:8000") as c: batch = await c.generate(prompts)``.
    Large batches are split into requests of ``batch_size`` prompts, at most ``max_concurrency`` in
    flight; connection errors and 5xx are retried ``retries`` times with jittered backoff, 4xx never.
    ``api_key`` (default: env ``RR_API_KEY``) is sent as ``Authorization: Bearer``; a 401/403 raises
    :class:`AuthenticationError`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        max_concurrency: int = 16,
        retries: int = 3,
        batch_size: int = 8,
        backoff: float = 0.25,
        allow_extra_rows: int = 0,
        validate: bool = True,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_concurrency < 1 or batch_size < 1 or retries < 0:
            raise ValueError("max_concurrency and batch_size must be >= 1, retries >= 0")
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        all_headers = dict(headers or {})
        if key:
            all_headers["authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency, keepalive_expiry=2.0
            ),  # close idle connections before servers (uvicorn: 5 s) do, avoiding a write-on-closing race
            headers=all_headers,
            transport=transport,
        )
        self._sem = asyncio.Semaphore(max_concurrency)
        self._retries = retries
        self._backoff = backoff
        self._batch_size = batch_size
        self._allow_extra_rows = allow_extra_rows
        self._validate = validate
        self._info: RRInfo | None = None
        self._info_lock = asyncio.Lock()

    async def __aenter__(self) -> "RoutedExpertsClient":
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    # ------------------------------------------------------------------ transport

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One call with retries on connection errors and 5xx; returns the decoded JSON body."""
        content = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        last: RRError | None = None
        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            what = f"{method} {path}"
            try:
                async with self._sem:
                    resp = await self._http.request(method, path, content=content, headers=headers)
            except httpx.HTTPError as e:
                last = map_httpx_error(e, what)
                continue
            err = error_for_status(resp, what)
            if isinstance(err, RequestRejectedError):  # 4xx (401/403 included): the request is wrong, never retried
                raise err
            if err is not None:  # 5xx
                last = err
                continue
            try:
                return orjson.loads(resp.content)
            except orjson.JSONDecodeError as e:
                raise ProtocolError(f"{what}: body is not JSON: {e}") from e
        assert last is not None
        raise last

    async def info(self) -> RRInfo:
        """``GET /rr/info``, fetched once and cached: every routing payload is checked against it."""
        async with self._info_lock:
            if self._info is None:
                body = await self._request("GET", "/rr/info")
                try:
                    self._info = RRInfo.model_validate(body)
                except ValueError as e:
                    raise ProtocolError(f"/rr/info is invalid: {e}") from e
            return self._info

    # ------------------------------------------------------------------ generate

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = True,
        routed_experts_start: int | None = None,
        return_logprob: bool = False,
    ) -> GenerateBatch:
        """Generate for each prompt (text or token ids); results in prompt order, ``n`` per prompt.

        ``return_logprob`` asks for the sampled tokens' log-probs: each result's
        ``meta["output_token_logprobs"]`` (SGLang's ``[logprob, token_id, None]`` per generated token).
        """
        plist = _normalize_prompts(prompts)
        params = dict(sampling_params or {})
        n = params.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling_params.n must be a positive int, got {n!r}")
        start = routed_experts_start or 0
        if start < 0:
            raise ValueError(f"routed_experts_start must be >= 0, got {start}")
        info = await self.info()
        chunks = [range(i, min(i + self._batch_size, len(plist))) for i in range(0, len(plist), self._batch_size)]
        tasks = [
            self._generate_chunk(plist, c, params, n, info, return_routed_experts, routed_experts_start, return_logprob)
            for c in chunks
        ]
        parts = await asyncio.gather(*tasks)
        results = [r for part in parts for r in part]
        return GenerateBatch(results=results, info=info)

    async def _generate_chunk(
        self,
        prompts: list[str | list[int]],
        idx: range,
        params: dict[str, Any],
        n: int,
        info: RRInfo,
        want: bool,
        start: int | None,
        return_logprob: bool = False,
    ) -> list[GenerateResult]:
        """One ``/generate`` request for prompts ``idx``; checks count and every sample."""
        sub = [prompts[i] for i in idx]
        key = "input_ids" if isinstance(sub[0], list) else "text"
        if any(isinstance(p, list) != (key == "input_ids") for p in sub):
            raise ValueError("a batch must be all text prompts or all token-id prompts")
        body: dict[str, Any] = {key: sub, "sampling_params": params, "return_routed_experts": want}
        if start is not None:
            body["routed_experts_start"] = start
        if return_logprob:
            body["return_logprob"] = True
        reply = await self._request("POST", "/generate", body)
        if not isinstance(reply, list) or len(reply) != len(sub) * n:
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise ProtocolError(f"/generate: expected {len(sub) * n} samples for {len(sub)} prompts x n={n}, got {got}")
        out = []
        for j, item in enumerate(reply):
            p = idx[j // n]
            ids = prompts[p] if key == "input_ids" else None
            out.append(
                parse_sample(
                    item,
                    index=idx.start * n + j,
                    prompt_index=p,
                    prompt_ids=ids,  # type: ignore[arg-type]
                    info=info,
                    want_routing=want,
                    start=start or 0,
                    allow_extra_rows=self._allow_extra_rows,
                    validate=self._validate,
                )
            )
        return out


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a list -> list of ``str`` / ``list[int]``; refuses empty or mixed input."""
    if isinstance(prompts, str):
        plist: list[Any] = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        plist = [list(prompts)]  # a single token-id prompt
    elif isinstance(prompts, Sequence):
        plist = [p if isinstance(p, str) else list(p) for p in prompts]
    else:
        raise TypeError(f"prompts must be a string, a token-id list, or a list of them; got {type(prompts).__name__}")
    if not plist:
        raise ValueError("no prompts given")
    for i, p in enumerate(plist):
        if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise TypeError(f"prompt {i}: token-id prompts must be lists of non-negative ints")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    return plist
