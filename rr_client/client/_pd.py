"""``PDClient``: prefill/decode disaggregation on SGLang, each sample's rows from the two servers joined at the seam.

SGLang's P/D (``--disaggregation-mode prefill|decode``) runs a request on both servers at once: the prefill server runs
the prompt, samples the first token and hands the KV over (SGLang's bootstrap handshake: the prefill server's
bootstrap host and port and a room shared by the two requests); the decode server generates from there. Its routers
(sglang-router's mini load balancer among them) return the decode server's answer, whose rows for the prompt are not
routing: the decode server never ran those tokens. ``PDClient`` sends the pair itself, asks the prefill server for
the prompt's rows and the decode server for the rest (from the first generated token), checks each answer with the
one full check, and joins them with :func:`rr_client.core.seam.merge_halves` (every refusal is there, typed). The
seam goes into each result's ``meta["rr_seam"]``. By reference, each result holds a :class:`SeamRef` (both servers'
refs, checked against each other when it is made); the trainer rank's ``resolve_results`` reads both and merges.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from rr_client.client._client import RoutedExpertsClient
from rr_client.client._results import GenerateBatch, GenerateResult
from rr_client.client.source_audit import SourceAudit, fresh_salt
from rr_client.core.errors import ArgumentTypeError, ConfigurationError, ProtocolError, SeamMismatchError
from rr_client.core.provenance import PROVENANCE_FIELD
from rr_client.core.seam import SEAM_FIELD, Half, SeamRef, joined_provenance, merge_halves, plan_seam

__all__ = ["PDClient"]


class PDClient:
    """A prefill server and a decode server of one SGLang P/D deployment, used as one: :meth:`generate` returns
    results whose rows cover the whole sample, the prompt's from the prefill server and the rest from the decode
    server. ``bootstrap_port``: the prefill server's ``--disaggregation-bootstrap-port``; ``bootstrap_host``: its host
    (default: the prefill URL's). ``source_audit`` (a fraction or a :class:`rr_client.SourceAudit`): that share of
    samples is re-scored through the pair (one prefill of every token on the prefill server, a fresh cache salt on
    both) and flagged as :class:`RoutedExpertsClient` does. Other keywords go to both :class:`RoutedExpertsClient`."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        *,
        bootstrap_port: int,
        bootstrap_host: str | None = None,
        source_audit: float | SourceAudit | None = None,
        **client_kwargs: Any,
    ) -> None:
        if not isinstance(bootstrap_port, int) or isinstance(bootstrap_port, bool) or bootstrap_port <= 0:
            raise ArgumentTypeError(f"bootstrap_port must be the prefill server's port (int), got {bootstrap_port!r}")
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.bootstrap_port = bootstrap_port
        self.bootstrap_host = bootstrap_host or urlsplit(prefill_url).hostname or "127.0.0.1"
        self.prefill = RoutedExpertsClient(prefill_url, **client_kwargs)
        self.decode = RoutedExpertsClient(decode_url, **client_kwargs)
        if source_audit is not None and not isinstance(source_audit, SourceAudit):
            source_audit = SourceAudit(source_audit) if source_audit else None
        self.source_audit: SourceAudit | None = source_audit

    async def __aenter__(self) -> PDClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close both clients."""
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        routed_experts_start: int = 0,
        by_reference: bool = False,
    ) -> GenerateBatch:
        """Generate for each prompt (token ids) through the pair; one result per prompt, rows from
        ``routed_experts_start`` to the last generated token but one, joined at the seam and checked
        (``by_reference``: a :class:`SeamRef` in ``routing_ref`` instead, resolved by :meth:`resolve_results`)."""
        params = dict(sampling_params or {})
        if params.get("n", 1) != 1:
            raise ConfigurationError("P/D generates one sample per prompt (one bootstrap room each): n must be 1")
        plist: list[str | list[int]] = [list(p) for p in prompts]
        if not plist or not all(p and all(isinstance(t, int) for t in p) for p in plist):
            raise ArgumentTypeError("PDClient.generate takes token-id prompts (the seam is at the prompt's length)")
        for p in plist:
            if not 0 <= routed_experts_start < len(p):
                raise ConfigurationError(
                    f"routed_experts_start={routed_experts_start} must lie inside the {len(p)}-token prompt under P/D"
                )
        info_p, info_d = await asyncio.gather(self.prefill.info(), self.decode.info())
        self._check_pair(info_p, info_d)
        results = await asyncio.gather(
            *(
                self._one(plist, i, params, routed_experts_start, info_p, info_d, by_reference)
                for i in range(len(plist))
            )
        )
        out = list(results)
        if self.source_audit is not None and not by_reference:
            out = await self.source_audit.audit(self, out, info_d)
        return GenerateBatch(results=out, info=info_d)

    def _check_pair(self, *infos: Any) -> None:
        """Both servers must be of an engine release whose P/D pair rr joins: else ConfigurationError naming what the
        pair needs and what each URL is (a vLLM would refuse the bootstrap fields, request by request)."""
        from rr_client.core.engines import ENGINES
        from rr_client.core.versions import parse_release

        needs = " or ".join(f"{e.label} {e.pd_pair_since}+" for e in ENGINES.values() if e.pd_pair_since)
        for url, info in zip((self.prefill_url, self.decode_url), infos, strict=True):
            since = ENGINES[info.engine].pd_pair_since if info.engine in ENGINES else None
            try:
                ok = since is not None and parse_release(info.engine_version) >= parse_release(since)
            except ValueError:
                ok = False
            if not ok:
                raise ConfigurationError(
                    f"P/D needs a {needs} prefill/decode pair (--disaggregation-mode prefill and decode, through "
                    f"rr-server launch): {url} is {info.engine} {info.engine_version}"
                )

    async def rescore(
        self, tokens: Sequence[int], info: Any, salt_field: str = "extra_key", *, indexer: bool = False
    ) -> GenerateResult:
        """The source audit's re-score through the pair: ``tokens`` as one prompt (every row from the prefill
        server's one prefill), ``max_new_tokens=1``, a fresh salt on both servers (``indexer``: not served by P/D)."""
        if indexer:
            raise ConfigurationError("P/D re-scores routing only: a decode server refuses the prompt's indexer picks")
        info_p, info_d = await asyncio.gather(self.prefill.info(), self.decode.info())
        self._check_pair(info_p, info_d)
        greedy = {"max_new_tokens": 1, "temperature": 0.0}
        salt = {salt_field: fresh_salt()}
        return await self._one([list(tokens)], 0, greedy, 0, info_p, info_d, False, salt=salt)

    async def _one(
        self,
        plist: list[str | list[int]],
        i: int,
        params: dict[str, Any],
        start: int,
        info_p: Any,
        info_d: Any,
        by_ref: bool,
        salt: Mapping[str, str] | None = None,
    ) -> GenerateResult:
        """Prompt ``i`` through the pair: both requests at once (same room), each answer checked, then joined
        (``salt``: a prefix-cache namespace field for both requests)."""
        prompt = len(plist[i])
        boot = {
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": secrets.randbits(63),  # SGLang's room: one per request pair
            **(salt or {}),
        }
        one = range(i, i + 1)
        (p,), (d,) = await asyncio.gather(
            self.prefill._generate_chunk(plist, one, params, 1, info_p, True, start, by_reference=by_ref, extra=boot),
            self.decode._generate_chunk(plist, one, params, 1, info_d, True, prompt, by_reference=by_ref, extra=boot),
        )
        where = f"sample {i}"
        if len(p.output_ids) != 1:
            raise ProtocolError(
                f"{where}: the prefill server ({self.prefill_url}) generated {len(p.output_ids)} tokens; a P/D "
                "prefill server samples the first token only (is it started with --disaggregation-mode prefill?)"
            )
        if not d.output_ids or d.output_ids[0] != p.output_ids[0]:
            raise SeamMismatchError(
                f"{where}: the decode server ({self.decode_url}) did not continue from the prefill server's first "
                f"token ({p.output_ids[0]}, decode's: {d.output_ids[:1]}): they did not share this request's KV"
            )
        held = (p.routing_ref, d.routing_ref) if by_ref else (p.routed_experts, d.routed_experts)
        halves = (
            Half(held[0], start, info_p, self.prefill_url, p.provenance),
            Half(held[1], prompt, info_d, self.decode_url, d.provenance),
        )
        plan = {
            "received": prompt,
            "total_rows": prompt + len(d.output_ids) - 1 - start,
            "first": start,
            "where": where,
        }
        prov = joined_provenance(p.provenance, d.provenance)  # the prompt's cache is the prefill server's
        meta = {**d.meta, **({PROVENANCE_FIELD: prov.to_dict()} if prov is not None else {})}
        if by_ref:
            if p.routing_ref is None or d.routing_ref is None:
                raise ProtocolError(f"{where}: asked by reference, a server answered no routing_ref")
            seam = plan_seam(*halves, **plan)  # type: ignore[arg-type]
            ref = SeamRef(p.routing_ref, d.routing_ref, seam)  # type: ignore[arg-type]
            return replace(
                d,
                routing_ref=ref,
                routed_experts_start=start,
                provenance=prov,
                meta={**meta, SEAM_FIELD: seam.to_dict()},
            )
        merged, seam = merge_halves(*halves, **plan, checked=True)  # type: ignore[arg-type]
        return replace(
            d,
            routed_experts=merged,
            routed_experts_start=start,
            provenance=prov,
            meta={**meta, SEAM_FIELD: seam.to_dict()},
        )

    async def resolve_results(self, results: list[GenerateResult]) -> list[GenerateResult]:
        """``results`` with their refs (a :class:`SeamRef` each) read from both servers and merged."""
        return await self.decode.resolve_results(results)
