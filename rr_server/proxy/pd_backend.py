"""The sidecar in front of a SGLang prefill/decode pair: a P/D load balancer whose answers carry each sample's whole
routing, joined at the seam and checked.

Unpatched SGLang servers started with ``--disaggregation-mode prefill|decode`` (and ``--enable-return-routed-experts``)
get each ``/generate`` together, with SGLang's bootstrap fields (the prefill server's host and bootstrap port, one
room per sample). The prefill server answers every prompt row and the first sampled token; the decode server answers
rows for the whole sample, but those for the prompt are its capture buffer's leftovers (it never ran them), so they
are dropped. Each half goes through the one check (:func:`rr_client.core.codec.check_payload`), then
:func:`rr_client.core.seam.merge_halves` joins them where the decode server took over (the prompt's end). A sample
whose halves cannot be joined (the servers at different ``weight_version`` s, or at different counts of the weight
updates each took through this sidecar (:mod:`rr_server.proxy.pd_weights`; SGLang's labels stay ``"default"`` under
``DiskWeightSync``), a decode answer that does not continue from the prefill server's token, model or shape
differences, all-zero rows) is answered with ``routed_experts: null`` and the typed error, the sidecar's one policy
for refused routing; the others keep theirs. Each sample's ``rr_provenance`` is built from both halves
(:func:`rr_client.core.seam.joined_provenance`: the prompt's cache is the prefill server's). Non-streaming
``/generate`` only: streaming and ``n > 1`` are refused with 400 naming why.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from rr_client.core.codec import CheckedRouting, check_payload
from rr_client.core.errors import RoutedExpertsError, SeamMismatchError, StaleRoutingError
from rr_client.core.indexer import INDEXER_FIELD
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.core.seam import SEAM_FIELD, Half, joined_provenance, merge_halves
from rr_server.proxy.errors import ProxyError
from rr_server.proxy.metrics import ProxyMetrics
from rr_server.proxy.pd_weights import Counts, UpdateLedger
from rr_server.proxy.provenance import attach, sglang_provenance
from rr_server.proxy.routing import ROUTING_KEYS, refused_fields, sent_fields
from rr_server.proxy.sglang_backend import upstream_body
from rr_server.proxy.upstream import Upstream
from rr_server.serving.generate_protocol import NormalizedGenerate
from rr_server.serving.store import refs_made_under
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["PDBackend"]


def _items(reply: Any, want: int, who: str) -> list[Mapping[str, Any]]:
    """An upstream's reply as ``want`` items with ``meta_info`` (502 otherwise)."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != want or not all(isinstance(i, Mapping) and isinstance(i.get("meta_info"), Mapping) for i in items):
        raise ProxyError(502, "upstream_protocol", f"the {who} server's /generate answered {len(items)} items "
                         f"(expected {want}, each with meta_info)")  # fmt: skip
    return items


class PDBackend:
    """Serves ``/generate`` from a SGLang P/D pair (``prefill`` and ``decode`` upstreams) as one server."""

    def __init__(
        self,
        prefill: Upstream,
        decode: Upstream,
        info: Callable[[], Awaitable[tuple[RRInfo, str]]],
        metrics: ProxyMetrics,
        *,
        bootstrap_host: str,
        bootstrap_port: int,
        epoch: WeightEpoch | None = None,
        updates: UpdateLedger | None = None,
    ) -> None:
        self._prefill, self._decode, self._info, self._metrics = prefill, decode, info, metrics
        self._boot = {"bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port}
        self._epoch = epoch or WeightEpoch()
        self._updates = updates or UpdateLedger([prefill.url, decode.url])

    async def generate(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> Any:
        """Both servers at once, one room per sample; each decode item with the sample's joined rows."""
        if req.return_indexer_topk:
            raise ProxyError(
                400,
                "bad_request",
                "return_indexer_topk: the P/D sidecar does not join the indexer's rows at the seam (yet); ask the "
                "servers of a non-disaggregated deployment",
            )
        if any(s.n != 1 for s in req.sampling):
            raise ProxyError(
                400, "bad_request", "P/D generates one sample per prompt (one bootstrap room each): n must be 1"
            )
        info, _ = await self._info()
        mark, counts = self._epoch.mark(), self._updates.counts()
        rooms = [secrets.randbits(63) for _ in req.prompts]
        up = {**upstream_body(body), **self._boot, "bootstrap_room": rooms if req.is_batch else rooms[0]}
        p_reply, d_reply = await asyncio.gather(
            self._prefill.call("POST", "/generate", up), self._decode.call("POST", "/generate", up)
        )
        p_items = _items(p_reply, len(rooms), "prefill")
        d_items = _items(d_reply, len(rooms), "decode")
        out = [self._join(p, d, req, info, j, mark, counts) for j, (p, d) in enumerate(zip(p_items, d_items))]
        return out if req.is_batch else out[0]

    def _join(
        self,
        p: Mapping[str, Any],
        d: Mapping[str, Any],
        req: NormalizedGenerate,
        info: RRInfo,
        j: int,
        mark: WeightMark,
        counts: Counts,
    ) -> dict[str, Any]:
        """One sample: the decode server's item, its routing replaced by the checked join (or the refusal)."""
        out = dict(d)
        meta = {k: v for k, v in d["meta_info"].items() if k not in ROUTING_KEYS and k != INDEXER_FIELD}  # raw stays
        out["meta_info"] = meta
        prompt = req.prompts[j] if isinstance(req.prompts[j], list) else None
        halves = (  # each half's own; the prefill half's covers the prompt and the first token it sampled
            sglang_provenance(h["meta_info"], self._epoch, mark, prompt, h.get("output_ids")) for h in (p, d)
        )
        joined = joined_provenance(*(Provenance.from_dict(h) for h in halves))  # the prompt's cache: the prefill's
        prov = joined.to_dict() if joined is not None else {}  # both halves said: never None
        attach(meta, prov)
        if not req.return_routed_experts:
            return out
        try:
            if why := self._updates.refusal(counts, self._updates.counts()):
                raise StaleRoutingError(why)
            merged, seam = self._merged(p, d, info, req, j)
        except RoutedExpertsError as e:
            meta.update(refused_fields(type(e)(f"P/D sample {j}: {e}"), self._metrics))
        else:
            with refs_made_under(mark.version):
                meta.update(sent_fields(merged, req.routed_experts_format, self._metrics, f"P/D sample {j}"))
            if meta.get("routed_experts_error") is None:
                meta[SEAM_FIELD] = seam
        self._metrics.routing.count_sample(meta)
        attach(meta, prov)  # a ref made just now carries it too
        return out

    def _merged(
        self, p: Mapping[str, Any], d: Mapping[str, Any], info: RRInfo, req: NormalizedGenerate, j: int
    ) -> tuple[CheckedRouting, dict[str, Any]]:
        """Both halves checked and joined at the prompt's end: (the sample's rows, the seam as recorded)."""
        pm, dm, p_out, d_out = p["meta_info"], d["meta_info"], p.get("output_ids"), d.get("output_ids")
        pt, ct, start = dm.get("prompt_tokens"), dm.get("completion_tokens"), req.routed_experts_start
        if not isinstance(pt, int) or not isinstance(ct, int) or pm.get("prompt_tokens") != pt:
            raise SeamMismatchError(
                f"the servers' prompt_tokens differ or are missing (prefill {pm.get('prompt_tokens')!r}, decode {pt!r})"
            )
        if not isinstance(p_out, list) or not isinstance(d_out, list) or not p_out or d_out[:1] != p_out[:1]:
            raise SeamMismatchError(
                f"the decode server's tokens {str(d_out)[:40]} do not continue from the prefill server's first token "
                f"({str(p_out)[:40]}): they did not share this request's KV"
            )
        pv, dv = pm.get("weight_version"), dm.get("weight_version")
        if pv != dv:
            raise StaleRoutingError(
                f"the prefill server ({self._prefill.url}) is at weight version {pv!r}, the decode server "
                f"({self._decode.url}) at {dv!r}: the decode tokens attended to KV computed under other weights"
            )
        if not 0 <= start < pt:
            raise SeamMismatchError(f"routed_experts_start={start} must lie inside the {pt}-token prompt under P/D")
        halves = []
        for who, m, first, rows in (("prefill", pm, start, pt - start), ("decode", dm, pt, ct - 1)):
            checked = check_payload(
                m.get("routed_experts"),
                info,
                rows=rows,
                start=first,
                drop_rows=first,  # the decode server's prompt rows are its buffer's, not routing
                dtype=m.get("routed_experts_dtype"),
                stated_shape=m.get("routed_experts_shape"),
            )
            url = self._prefill.url if who == "prefill" else self._decode.url
            halves.append(Half(checked.array, first, info, url))
        merged, seam = merge_halves(
            halves[0], halves[1], received=pt, total_rows=pt + ct - 1 - start, first=start, where=f"sample {j}",
            checked=True,
        )  # fmt: skip
        return CheckedRouting(merged, start), seam.to_dict()

    async def stream(self, req: NormalizedGenerate, body: Mapping[str, Any]) -> AsyncIterator[str]:
        """Streaming is not joined: refused before any event."""
        raise ProxyError(
            400,
            "bad_request",
            "the P/D sidecar joins whole answers only: send stream=false (the seam needs both halves)",
        )
        yield ""  # pragma: no cover - an async generator
