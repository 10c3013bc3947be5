"""``RoutedExpertsClient``: async batched ``/generate`` with routing, retries, and exact validation."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson

from rr_client.client._hosts import HostPolicy
from rr_client.client._object_refs import ObjectReader
from rr_client.client._openai import CHAT_PATH, COMPLETIONS_PATH, openai_body, parse_choices
from rr_client.client._replicas import Replica, ReplicaPool, ReplicaStats
from rr_client.client._resolve import RefResolver, RefTokens
from rr_client.client._results import GenerateBatch, GenerateResult, parse_sample
from rr_client.client.http_errors import error_for_status, map_httpx_error
from rr_client.client.source_audit import SourceAudit, fresh_salt
from rr_client.core import settings
from rr_client.core.errors import (
    ArgumentTypeError,
    ConfigurationError,
    NotAnRRServerError,
    ProtocolError,
    RequestRejectedError,
    RRError,
    ServerError,
    TransportError,
)
from rr_client.core.indexer import INDEXER_FORMAT_FIELD
from rr_client.core.info import RRInfo
from rr_client.core.reference import RETIRE_PATH, RoutingRef
from rr_client.core.seam import SeamRef, merge_halves
from rr_client.core.spans import ProvenanceSpan, SequenceBook

if TYPE_CHECKING:
    from rr_client.client.trajectory import ChatTrajectory, Trajectory

__all__ = ["RoutedExpertsClient", "Prompt", "API_KEY_ENV", "ReplicaStats"]

API_KEY_ENV = "RR_API_KEY"

Prompt = str | Sequence[int]


class RoutedExpertsClient:
    """Async client for any rr server (patched SGLang/vLLM or the sidecar), or for several replicas of one.

    ``async with RoutedExpertsClient("http://127.0.0.1:8000") as c: batch = await c.generate(prompts)``.
    Large batches are split into requests of ``batch_size`` prompts, at most ``max_concurrency`` in
    flight; connection errors and 5xx are retried ``retries`` times with jittered backoff, 4xx never.
    ``api_key`` (default: env ``RR_API_KEY``) is sent as ``Authorization: Bearer``; a 401/403 raises
    :class:`AuthenticationError`.

    ``base_url`` may be a list of replica URLs serving the same model (checked on ``/rr/info``;
    :class:`ReplicaMismatchError` otherwise). Each request goes to the healthy replica with the fewest
    requests in flight (``max_concurrency`` is the total over all replicas); the ``n`` samples of a prompt
    are one request, and every request of one ``generate(..., affinity=key)`` key goes to the same
    replica while it is healthy. A replica that fails a connection or answers 5xx is taken out, the
    request moves to another replica at once (no backoff, not counted against ``retries``), and the
    replica is probed on ``health_path`` every ``probe_interval`` s and taken back when it answers and
    serves the same model. ``replica_stats()`` gives per-replica counts. ``generate_path`` names the
    generate route (``"/rr/generate"`` behind routers that rewrite ``/generate``). ``info`` gives the
    served model's routing dimensions up front, for a URL that cannot answer ``/rr/info`` (sglang-router
    404s it): a replica's ``/rr/info`` or ``RRInfo.from_hf_config``; every payload is checked against it.

    Refs are read with the key and ``headers`` only from the replicas (same scheme, host, port) and
    ``trusted_hosts`` (``host`` or ``host:port`` entries; default env ``RR_TRUSTED_HOSTS``, comma-separated);
    from ``keyless_hosts`` (``RR_KEYLESS_HOSTS``) without them; a ref naming any other host raises
    :class:`UntrustedHostError` before anything is sent (a client with no key and no headers reads any host),
    and so does an ``http://`` ref while a replica is ``https://``.

    ``source_audit`` (a fraction such as ``0.01``, or a :class:`rr_client.SourceAudit`): that share of samples
    ``generate`` returns with rows is re-scored on the server before it returns them, and one whose rows the engine's
    own forward does not give back is flagged in its provenance (``source_flagged``), so the stale-rows policy
    refuses or masks it (:mod:`rr_client.client.source_audit`). Off by default.

    Refs a server wrote to an object store (``rr-server launch ... --rr-store s3://bucket/prefix``) are read from the
    objects, by this client itself, under the prefixes ``object_stores`` lists (default env ``RR_OBJECT_STORES``,
    comma-separated; a ref naming another is :class:`UntrustedHostError`), with ``storage_options`` (fsspec's, e.g.
    ``{"endpoint_url": ..., "key": ..., "secret": ...}``) or fsspec's own configuration and the environment.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
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
        generate_path: str = "/generate",
        health_path: str = "/health",
        probe_interval: float = 1.0,
        info: RRInfo | None = None,
        trusted_hosts: Sequence[str] | str | None = None,
        keyless_hosts: Sequence[str] | str | None = None,
        source_audit: float | SourceAudit | None = None,
        object_stores: Sequence[str] | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1 or batch_size < 1 or retries < 0:
            raise ConfigurationError("max_concurrency and batch_size must be >= 1, retries >= 0")
        if probe_interval <= 0:
            raise ConfigurationError("probe_interval must be > 0")
        for name, path in (("generate_path", generate_path), ("health_path", health_path)):
            if not path.startswith("/"):
                raise ConfigurationError(f"{name} must start with '/', got {path!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not all(isinstance(u, str) and u for u in urls):
            raise ArgumentTypeError("base_url must be a URL or a list of URLs")
        for u in urls:
            if not u.startswith(("http://", "https://")) or not urlsplit(u).hostname:
                raise ConfigurationError(f"base_url {u!r} is not an http(s) URL: write http://HOST:PORT")
        key = api_key if api_key is not None else settings.text(API_KEY_ENV)
        all_headers = dict(headers or {})
        if key:
            all_headers["authorization"] = f"Bearer {key}"

        def make_http(url: str, credentials: bool = True) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=url,
                timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                limits=httpx.Limits(
                    max_connections=max_concurrency, max_keepalive_connections=max_concurrency, keepalive_expiry=2.0
                ),  # close idle connections before servers (uvicorn: 5 s) do, avoiding a write-on-closing race
                headers=all_headers if credentials else None,
                transport=transport,
            )

        self._pool = ReplicaPool(
            [u.rstrip("/") for u in urls], make_http, health_path=health_path, probe_interval=probe_interval
        )
        self._make_http = make_http
        self._ref_http: dict[str, httpx.AsyncClient] = {}  # servers refs name that are not replicas of this client
        self._hosts = HostPolicy.of(
            self.urls, trusted=trusted_hosts, keyless=keyless_hosts, credentials=bool(all_headers)
        )
        self._resolver = RefResolver(
            self._http_for,
            max_concurrency=max_concurrency,
            objects=ObjectReader(object_stores, dict(storage_options or {})),
        )
        self._sem = asyncio.Semaphore(max_concurrency)
        self._retries, self._backoff = retries, backoff  # per request: tries after the first, first pause (s)
        self._batch_size = batch_size
        self._allow_extra_rows = allow_extra_rows
        self._validate = validate
        self._generate_path = generate_path
        if info is not None and not isinstance(info, RRInfo):
            raise ArgumentTypeError(f"info must be an RRInfo, got {type(info).__name__}")
        self._info: RRInfo | None = info  # given: /rr/info is never asked (servers behind sglang-router 404 it)
        if source_audit is not None and not isinstance(source_audit, SourceAudit):
            source_audit = SourceAudit(source_audit) if source_audit else None
        self.source_audit: SourceAudit | None = source_audit
        self._info_lock = asyncio.Lock()

    async def __aenter__(self) -> RoutedExpertsClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the health probes and close every replica's connection pool."""
        await self._pool.aclose()
        for http in self._ref_http.values():
            await http.aclose()
        self._ref_http.clear()

    def _http_for(self, url: str) -> httpx.AsyncClient:
        """The HTTP client for a server a ref names: the replica's own, or one made for it with the key only where
        :class:`HostPolicy` allows (UntrustedHostError otherwise)."""
        url = url.rstrip("/")
        how = self._hosts.decide(url)
        for r in self._pool.replicas:
            if r.url == url:
                return r.http
        if url not in self._ref_http:
            self._ref_http[url] = self._make_http(url, how == "key")
        return self._ref_http[url]

    # ------------------------------------------------------------------ routing by reference

    async def resolve(
        self, refs: Sequence[RoutingRef], *, tokens: Sequence[RefTokens] | None = None
    ) -> list[np.ndarray]:
        """The rows of each :class:`RoutingRef` (in order), read from the server (or Ray store) that holds them,
        many per call, concurrency-limited, checksum-verified and checked as an inline answer is (a ref that
        names no URL is read from this client's server, when it has one). A ref whose
        rows are gone raises :class:`RoutingExpiredError`; bytes that differ, :class:`RoutingChecksumError`.
        ``tokens`` (one per ref: ``(prompt_ids, output_ids)``, the sample itself, or None) binds each ref to its
        sample before any read: a ref whose provenance digest is another sample's raises
        :class:`StaleRoutingError` naming it."""
        refs = list(refs)
        if any(isinstance(r, RoutingRef) and not r.url for r in refs) and len(self.urls) == 1:
            refs = [r.with_url(self.urls[0]) if isinstance(r, RoutingRef) and not r.url else r for r in refs]
        return await self._resolver.resolve(refs, await self.info(), tokens)

    async def resolve_spans(
        self, book: SequenceBook, spans: Sequence[ProvenanceSpan | Mapping[str, Any]], datum_tokens: Sequence[int]
    ) -> np.ndarray:
        """The routing rows of a training datum built from provenance spans (``sequence_id``, ``offset``,
        ``length``, in tiling order) of the sequences in ``book``: one row per datum token, each ref read once and
        through the one check, the spans checked whole first (:meth:`SequenceBook.plan`: typed errors for spans that
        do not tile, overlap, point past a sequence or name an unknown or retired one)."""
        plan = book.plan(spans, datum_tokens)
        refs = plan.refs
        rows = dict(zip(((r.store, r.key) for r in refs), await self.resolve(refs)))
        return np.concatenate([rows[(s.ref.store, s.ref.key)][s.row_start : s.row_stop] for s in plan.slices])

    async def resolve_results(self, results: Sequence[GenerateResult]) -> list[GenerateResult]:
        """``results`` with every ``routing_ref`` resolved into ``routed_experts`` (others as they are), each
        ref bound to its own result's tokens: what a trainer rank calls on its own micro-batches only. A P/D
        sample's :class:`SeamRef` is read from both servers in the same reads and merged at its seam; a sample's
        indexer ref (``indexer_ref``) into ``indexer_topk``."""
        todo = [i for i, r in enumerate(results) if r.routing_ref is not None and r.routed_experts is None]
        idx_todo = [i for i, r in enumerate(results) if r.indexer_ref is not None and r.indexer_topk is None]
        refs: list[RoutingRef] = [results[i].indexer_ref for i in idx_todo]  # type: ignore[misc]
        tokens: list[RefTokens] = [results[i] for i in idx_todo]
        for i in todo:
            r, ref = results[i], results[i].routing_ref
            if isinstance(ref, SeamRef):  # the prefill server's sample ends at the first token it sampled
                refs += [ref.prefill, ref.decode]
                tokens += [(r.prompt_ids or [], r.output_ids[:1]), r]
            else:
                refs.append(ref)  # type: ignore[arg-type]
                tokens.append(r)
        rows = iter(await self.resolve(refs, tokens=tokens))
        info = await self.info() if refs else None
        out = list(results)
        for i in idx_todo:  # the indexer's rows, read in the same calls as the routing
            out[i] = replace(results[i], indexer_topk=next(rows))
        for i in todo:
            ref = results[i].routing_ref
            if isinstance(ref, SeamRef):
                s = ref.seam
                merged, _ = merge_halves(
                    *ref.halves(info, next(rows), next(rows)),  # type: ignore[arg-type]
                    received=s.at,
                    total_rows=s.decode_span[1] - s.prefill_span[0],
                    first=s.prefill_span[0],
                    where=f"sample {results[i].index}",
                    checked=True,
                )
                out[i] = out[i].with_routing(merged)
            else:
                out[i] = out[i].with_routing(next(rows))
        return out

    async def retire(self, through: int) -> list[dict[str, int]]:
        """``POST /rr/routing/retire`` on every replica: free rows made under weight versions <= ``through``
        (after a weight push); refs made later carry ``through + 1`` or more. One answer per replica."""
        return [
            await self._request("POST", RETIRE_PATH, {"through": int(through)}, only=r) for r in self._pool.replicas
        ]

    @property
    def routing_bytes_resolved(self) -> int:
        """Routing bytes this client has read by reference (frame data, excluding headers)."""
        return self._resolver.bytes_read

    # ------------------------------------------------------------------ replicas

    @property
    def urls(self) -> list[str]:
        """The replica URLs, in the order given."""
        return [r.url for r in self._pool.replicas]

    def replica_stats(self) -> list[ReplicaStats]:
        """Per-replica counts (requests, errors, in flight, taken out / back) and health, in URL order."""
        return self._pool.stats()

    def replica_for(self, affinity: Hashable) -> str | None:
        """URL of the replica an affinity key is pinned to (None before its first request)."""
        return self._pool.replica_of(affinity)

    # ------------------------------------------------------------------ transport

    async def _request(
        self, method: str, path: str, body: Any = None, *, affinity: Hashable | None = None, only: Replica | None = None
    ) -> Any:
        """One call: on a connection error or 5xx it moves to another healthy replica at once, else retries
        ``retries`` times with backoff; returns the decoded JSON body. ``only`` pins it to one replica."""
        content = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        pool = self._pool
        multi = len(pool.replicas) > 1
        last: RRError | None = None
        failed: Replica | None = None
        backoffs = 0
        for _ in range((self._retries + 1) * len(pool.replicas)):
            if failed is not None:
                other = only is None and any(r.healthy and r is not failed for r in pool.replicas)
                if not other:  # nowhere else to go: retry with backoff, at most ``retries`` times
                    backoffs += 1
                    if backoffs > self._retries:
                        break
                    await asyncio.sleep(self._backoff * (2 ** (backoffs - 1)) * (0.5 + random.random()))
            async with self._sem:
                r = only or pool.pick(affinity, avoid=failed)
                what = f"{method} {r.url}{path}" if multi else f"{method} {path}"
                r.requests += 1
                r.in_flight += 1
                try:
                    resp = await r.http.request(method, path, content=content, headers=headers)
                except httpx.HTTPError as e:
                    last = map_httpx_error(e, what)
                    pool.failed(r, str(last))
                    failed = r
                    continue
                finally:
                    r.in_flight -= 1
            err = error_for_status(resp, what)
            if isinstance(err, RequestRejectedError):  # 4xx (401/403 included): the request is wrong, never retried
                raise err
            if err is not None:  # 5xx
                last = err
                pool.failed(r, str(err))
                failed = r
                continue
            try:
                return orjson.loads(resp.content)
            except orjson.JSONDecodeError as e:
                raise ProtocolError(f"{what}: body is not JSON: {e}") from e
        assert last is not None
        raise last

    async def info(self) -> RRInfo:
        """``GET /rr/info`` of every replica, fetched once and cached (or the ``info`` given to the constructor):
        every routing payload is checked against it.

        Replicas that cannot be reached are taken out (and probed); replicas that disagree on the model or
        its routing dimensions raise :class:`ReplicaMismatchError`.
        """
        async with self._info_lock:
            if self._info is None:
                replicas = self._pool.replicas
                bodies = await asyncio.gather(
                    *(self._request("GET", "/rr/info", only=r) for r in replicas), return_exceptions=True
                )
                infos: dict[Replica, RRInfo] = {}
                errors: list[BaseException] = []
                for r, body in zip(replicas, bodies):
                    if isinstance(body, (TransportError, ServerError)):
                        errors.append(body)
                        if len(replicas) > 1 and r.healthy:  # unreachable now: probed, checked when it is back
                            self._pool.failed(r, str(body))
                        continue
                    if isinstance(body, RequestRejectedError) and body.status_code == 404:
                        raise NotAnRRServerError(_no_rr_routes(r.url), status_code=404) from body
                    if isinstance(body, BaseException):
                        raise body
                    try:
                        infos[r] = RRInfo.model_validate(body)
                    except ValueError as e:
                        raise ProtocolError(f"{r.url}/rr/info is invalid: {e}") from e
                if not infos:
                    raise errors[0]
                self._info = self._pool.check_info(infos)
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
        affinity: Hashable | None = None,
        by_reference: bool = False,
        return_indexer_topk: bool = False,
        indexer_by_reference: bool | None = None,
    ) -> GenerateBatch:
        """Generate for each prompt (text or token ids); results in prompt order, ``n`` per prompt.

        ``return_indexer_topk`` (a sparse-attention model on rr-patched SGLang 0.5.23+): each result's
        ``indexer_topk`` holds the engine's checked indexer picks (:mod:`rr_client.core.indexer`), or, by reference
        (``indexer_by_reference``; None: the server's default, by reference), ``indexer_ref`` until
        :meth:`resolve_results` reads them.

        ``by_reference``: the server keeps each sample's checked routing and answers a :class:`RoutingRef`
        (``result.routing_ref``, a few hundred bytes) instead of the rows; :meth:`resolve_results` reads them
        where they are needed (a trainer rank: its own micro-batches only).

        ``return_logprob`` asks for the sampled tokens' log-probs: each result's
        ``meta["output_token_logprobs"]`` (SGLang's ``[logprob, token_id, None]`` per generated token).
        ``affinity`` (e.g. a trajectory id): every request of every call with this key goes to the same
        replica while it is healthy, so its prefix cache serves the later turns.
        """
        plist = _normalize_prompts(prompts)
        params = dict(sampling_params or {})
        n = params.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise ConfigurationError(f"sampling_params.n must be a positive int, got {n!r}")
        start = routed_experts_start or 0
        if start < 0:
            raise ConfigurationError(f"routed_experts_start must be >= 0, got {start}")
        info = await self.info()
        chunks = [range(i, min(i + self._batch_size, len(plist))) for i in range(0, len(plist), self._batch_size)]
        tasks = [
            self._generate_chunk(
                plist,
                c,
                params,
                n,
                info,
                return_routed_experts,
                routed_experts_start,
                return_logprob,
                affinity,
                by_reference,
                _indexer_body(return_indexer_topk, indexer_by_reference),
            )
            for c in chunks
        ]
        parts = await asyncio.gather(*tasks)
        results = [r for part in parts for r in part]
        if self.source_audit is not None and return_routed_experts and not by_reference:
            results = await self.source_audit.audit(self, results, info)
        return GenerateBatch(results=results, info=info)

    async def rescore(
        self, tokens: Sequence[int], info: RRInfo, salt_field: str = "cache_salt", *, indexer: bool = False
    ) -> GenerateResult:
        """The engine's rows for every token of ``tokens`` in one fresh prefill: ``max_new_tokens=1``, routing from
        token 0, greedy, the prefix cache bypassed by a fresh salt in ``salt_field``, inline (``indexer``: its
        indexer picks too): what the source audit compares served rows with. Rows ``[len(tokens), layers, topk]``."""
        (res,) = await self._generate_chunk(
            [list(tokens)],
            range(1),
            {"max_new_tokens": 1, "temperature": 0.0},
            1,
            info,
            True,
            0,
            extra={salt_field: fresh_salt(), **((_indexer_body(True, False) or {}) if indexer else {})},
        )
        return res

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
        affinity: Hashable | None = None,
        by_reference: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> list[GenerateResult]:
        """One ``/generate`` request for prompts ``idx`` (``extra``: more body fields, e.g. SGLang's P/D bootstrap
        fields); checks count and every sample."""
        sub = [prompts[i] for i in idx]
        key = "input_ids" if isinstance(sub[0], list) else "text"
        if any(isinstance(p, list) != (key == "input_ids") for p in sub):
            raise ConfigurationError("a batch must be all text prompts or all token-id prompts")
        body: dict[str, Any] = {key: sub, "sampling_params": params, "return_routed_experts": want}
        if start is not None:
            body["routed_experts_start"] = start
            body["routed_experts_start_len"] = start  # SGLang's own name: its request parser drops rr's
        if return_logprob:
            body["return_logprob"] = True
        if want and by_reference:
            body["routed_experts_format"] = "ref"
        if extra:
            body.update(extra)
        reply = await self._request("POST", self._generate_path, body, affinity=affinity)
        if not isinstance(reply, list) or len(reply) != len(sub) * n:
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise ProtocolError(
                f"{self._generate_path}: expected {len(sub) * n} samples for {len(sub)} prompts x n={n}, got {got}"
            )
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
                    by_reference=by_reference,
                    want_indexer=bool(extra and extra.get("return_indexer_topk")),
                )
            )
        return out

    # ------------------------------------------------------------------ OpenAI-compatible endpoints

    async def complete(
        self,
        prompt: Prompt,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = True,
        routed_experts_start: int | None = None,
        affinity: Hashable | None = None,
        extra_body: Mapping[str, Any] | None = None,
        by_reference: bool = False,
    ) -> GenerateBatch:
        """``POST /v1/completions`` for one prompt (text or token ids); one result per choice (``n``).

        ``sampling_params`` take ``generate``'s SGLang names (``max_new_tokens`` ...) or OpenAI's;
        ``extra_body`` is merged into the request last (e.g. ``{"logprobs": 1}``); ``by_reference`` as in
        :meth:`generate`.
        """
        plist = _normalize_prompts(prompt)
        if len(plist) != 1:
            raise ConfigurationError(
                "complete() takes one prompt; call it once per prompt (or use generate for a batch)"
            )
        p = plist[0]
        return await self._openai(
            COMPLETIONS_PATH,
            {"prompt": p},
            sampling_params,
            want=return_routed_experts,
            start=routed_experts_start,
            affinity=affinity,
            extra=extra_body,
            sent_ids=p if isinstance(p, list) else None,
            by_reference=by_reference,
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        return_routed_experts: bool = True,
        routed_experts_start: int | None = None,
        affinity: Hashable | None = None,
        extra_body: Mapping[str, Any] | None = None,
        by_reference: bool = False,
    ) -> GenerateBatch:
        """``POST /v1/chat/completions``; the engine applies the model's chat template (``by_reference``: as in
        :meth:`generate`).

        Each result carries the templated ``prompt_ids`` the engine reported, the generated ``output_ids``,
        the message in ``meta["message"]`` (tool calls included) and routing for ``prompt + output - 1 -
        start`` rows.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ConfigurationError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        payload: dict[str, Any] = {"messages": [dict(m) for m in messages]}
        if tools is not None:
            payload["tools"] = [dict(t) for t in tools]
        return await self._openai(
            CHAT_PATH,
            payload,
            sampling_params,
            want=return_routed_experts,
            start=routed_experts_start,
            affinity=affinity,
            extra=extra_body,
            sent_ids=None,
            by_reference=by_reference,
        )

    async def _openai(
        self,
        path: str,
        payload: dict[str, Any],
        params: Mapping[str, Any] | None,
        *,
        want: bool,
        start: int | None,
        affinity: Hashable | None,
        extra: Mapping[str, Any] | None,
        sent_ids: list[int] | None,
        by_reference: bool = False,
    ) -> GenerateBatch:
        """One OpenAI-endpoint call, every choice checked."""
        if start is not None and start < 0:
            raise ConfigurationError(f"routed_experts_start must be >= 0, got {start}")
        info = await self.info()
        model = (extra or {}).get("model") or info.model
        body = openai_body(params, model=model, want=want, start=start, extra=extra, by_reference=by_reference)
        body.update(payload)
        answer = await self._request("POST", path, body, affinity=affinity)
        results = parse_choices(
            answer,
            path=path,
            info=info,
            want_routing=want,
            start=start or 0,
            sent_prompt_ids=sent_ids,
            allow_extra_rows=self._allow_extra_rows,
            validate=self._validate,
            by_reference=by_reference,
        )
        return GenerateBatch(results=results, info=info)

    # ------------------------------------------------------------------ multi-turn

    def trajectory(
        self, prompt_ids: Sequence[int], *, affinity: Hashable | None = None, by_reference: bool = False
    ) -> Trajectory:
        """A multi-turn rollout by token ids that asks each turn only for the routing rows it does not hold
        (``by_reference``: each turn's new rows as a ref, resolved later)."""
        from rr_client.client.trajectory import Trajectory

        return Trajectory(self, prompt_ids, affinity=affinity, by_reference=by_reference)

    def chat_trajectory(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        affinity: Hashable | None = None,
    ) -> ChatTrajectory:
        """A multi-turn rollout over ``/v1/chat/completions``, aligned on the token ids the engine reports."""
        from rr_client.client.trajectory import ChatTrajectory

        return ChatTrajectory(self, messages, tools=tools, affinity=affinity)


def _indexer_body(asked: bool, by_reference: bool | None) -> dict[str, Any] | None:
    """The request fields asking for the indexer top-k (None: not asked)."""
    if not asked:
        return None
    body: dict[str, Any] = {"return_indexer_topk": True}
    if by_reference is not None:
        body[INDEXER_FORMAT_FIELD] = "ref" if by_reference else "npy"
    return body


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt or a list -> list of ``str`` / ``list[int]``; refuses empty or mixed input."""
    if isinstance(prompts, str):
        plist: list[Any] = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        plist = [list(prompts)]  # a single token-id prompt
    elif isinstance(prompts, Sequence):
        plist = [p if isinstance(p, str) else list(p) for p in prompts]
    else:
        raise ArgumentTypeError(
            f"prompts must be a string, a token-id list, or a list of them; got {type(prompts).__name__}"
        )
    if not plist:
        raise ConfigurationError("no prompts given")
    for i, p in enumerate(plist):
        if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ArgumentTypeError(f"prompt {i}: token-id prompts must be lists of non-negative ints")
        if len(p) == 0:
            raise ConfigurationError(f"prompt {i} is empty")
    return plist


def _no_rr_routes(url: str) -> str:
    """What a 404 on ``/rr/info`` means and the ways out."""
    return (
        f"{url}/rr/info is 404: {url} serves no rr routes (an engine started without rr's plugin, or a router that "
        "does not forward them). Start the engine with `rr-server launch vllm|sglang ...`; or keep it as it is and put "
        f"`rr-server proxy --upstream {url} --engine vllm|sglang` in front of it; behind a router that 404s /rr/info, "
        "pass info= (a replica's /rr/info or RRInfo.from_hf_config). `rr-server doctor URL --engine vllm|sglang` "
        "checks an engine without rr."
    )
