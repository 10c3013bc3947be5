"""The checks ``rr-server doctor`` runs against a live server, and the report they make.

Every answer goes through the client's one full check (row counts, id range, distinct ids, zero dense
layers, no all-zero MoE rows). On top: rows of the same prompt must agree across requests (a batch, ``n``,
``routed_experts_start``, a prefix-cache hit, and next to a request that did not ask for routing), the
routing must match the checkpoint's own router (``--model-path``), and the cost is measured. The cache and
weight-path probes (preemption, a weight update, KV offload / hierarchical cache) are :mod:`rr_server.doctor.probes`;
DeepSeek-V4.1's SWA bounded replay, :mod:`rr_server.doctor.bounded_replay`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np

from rr_client import GenerateResult, NotAnRRServerError, RoutedExpertsClient, RRError, RRInfo
from rr_server.doctor.known_bugs import BugStatus, known_bugs_for
from rr_server.doctor.pd import PDTarget
from rr_server.doctor.samples import (
    PREFIX_CACHE_TOKENS,
    ROW_AGREEMENT_MIN,
    TRUTH_AGREEMENT_MIN,
    _agreement,
    _prompt_rows,
    _prompts,
)

__all__ = [
    "Check",
    "DoctorReport",
    "DoctorProgress",
    "run_doctor",
    "ROW_AGREEMENT_MIN",
    "TRUTH_AGREEMENT_MIN",
    "PREFIX_CACHE_TOKENS",
]


@dataclass
class Check:
    """One check: its name, whether it passed, and what it found (the cause when it failed).

    ``exercised=False``: the deployment could not be made to show what the check looks at (e.g. no prefix-cache
    hit); reported as "not exercised", neither ok nor a failure of the verdict.
    """

    name: str
    ok: bool
    detail: str
    exercised: bool = True


@dataclass
class DoctorReport:
    """Everything ``rr-server doctor`` found; ``ok`` is the verdict."""

    url: str
    deployment: str
    identity: dict[str, Any] = field(default_factory=dict)
    known_bugs: list[BugStatus] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    ground_truth: dict[str, Any] | None = None
    cost: dict[str, Any] | None = None
    seams: list[dict[str, Any]] = field(default_factory=list)  # the P/D probe's samples: where each was joined

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = "PASS" if self.ok else "FAIL"
        return d


class DoctorProgress(Protocol):
    """Told as the doctor goes: a step begins (a check, or the cost figure), a check has its result."""

    def started(self, name: str) -> None: ...

    def finished(self, check: Check) -> None: ...


class _Quiet:
    """No one listening (a caller of :func:`run_doctor` without ``progress``)."""

    def started(self, name: str) -> None:
        pass

    def finished(self, check: Check) -> None:
        pass


class _Doctor:
    """State of one doctor run: the client, the server's info, and every sample seen."""

    def __init__(
        self,
        client: RoutedExpertsClient,
        info: RRInfo,
        report: DoctorReport,
        max_new_tokens: int,
        vocab: int = 200,
        progress: DoctorProgress | None = None,
    ) -> None:
        self.client, self.info, self.report, self.vocab = client, info, report, vocab
        self.progress = progress or _Quiet()
        self.params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        self.samples: list[GenerateResult] = []

    def add(self, name: str, ok: bool, detail: str, exercised: bool = True) -> None:
        self.report.checks.append(check := Check(name, ok, detail, exercised))
        self.progress.finished(check)

    async def gen(
        self, prompts: list[list[int]], params: dict[str, Any] | None = None, **kw: Any
    ) -> list[GenerateResult]:
        batch = await self.client.generate(prompts, {**self.params, **(params or {})}, **kw)
        got = [r for r in batch if r.routed_experts is not None]
        self.samples.extend(got)
        return list(batch)

    def rows_agree(self, name: str, a: np.ndarray, b: np.ndarray, what: str) -> None:
        share = _agreement(a, b, self.info.moe_layers)
        self.add(
            name,
            share >= ROW_AGREEMENT_MIN,
            f"{what}: {100 * share:.2f}% of (token, MoE layer) top-k sets equal"
            + (
                ""
                if share >= ROW_AGREEMENT_MIN
                else " - the rows do not belong to this prompt (mixed, shifted or overwritten routing)"
            ),
        )

    async def live(self, prompts: list[list[int]]) -> None:
        p0, p1, p2, p3 = prompts[:4]
        self.progress.started("single")
        try:
            (single,) = await self.gen([p0])
            self.add(
                "single",
                True,
                f"{single.routed_experts.shape} rows x layers x top-k, "  # type: ignore[union-attr]
                f"{single.routed_experts.dtype}, full check passed",
            )  # type: ignore[union-attr]
        except RRError as e:
            self.add("single", False, f"{type(e).__name__}: {e}")
            return
        await self._guard("batch", self._batch(single, [p0, p1, p2]))
        await self._guard("n=2", self._n2(p1))
        await self._guard("routed_experts_start", self._start(single, p0))
        await self._guard(
            "prefix-cache hit", self._repeat(_prompts(1, self.vocab, seed=99, length=PREFIX_CACHE_TOKENS)[0])
        )
        await self._guard("mixed batch", self._mixed(p2, p3))

    async def _guard(self, name: str, coro: Any) -> None:
        self.progress.started(name)
        try:
            await coro
        except RRError as e:
            self.add(name, False, f"{type(e).__name__}: {e}")

    async def _batch(self, single: GenerateResult, prompts: list[list[int]]) -> None:
        batch = await self.gen(prompts)
        self.rows_agree("batch", _prompt_rows(batch[0]), _prompt_rows(single), "prompt 0 in a batch of 3 vs alone")

    async def _n2(self, prompt: list[int]) -> None:
        a, b = await self.gen([prompt], {"n": 2, "temperature": 1.0})
        self.rows_agree("n=2", _prompt_rows(a), _prompt_rows(b), "the prompt rows of 2 samples of one prompt")

    async def _start(self, single: GenerateResult, prompt: list[int]) -> None:
        s = min(4, len(prompt) - 1)
        (r,) = await self.gen([prompt], routed_experts_start=s)
        full = _prompt_rows(single)[s:]
        self.rows_agree("routed_experts_start", _prompt_rows(r), full, f"start={s} vs the same rows of a full request")

    async def _repeat(self, prompt: list[int]) -> None:
        """A long prompt twice: the second must be served (partly) from the prefix cache, with the same rows."""
        (first,) = await self.gen([prompt])
        (again,) = await self.gen([prompt])
        cached = int(again.meta.get("cached_tokens") or 0)
        if cached <= 0:
            self.add(
                "prefix-cache hit",
                True,
                f"not exercised: a repeated {len(prompt)}-token prompt reported "
                f"cached_tokens={again.meta.get('cached_tokens')} (prefix caching off, or the engine does not "
                "report it); rows served from the cache were not checked",
                exercised=False,
            )
            return
        self.rows_agree(
            "prefix-cache hit",
            _prompt_rows(again),
            _prompt_rows(first),
            f"repeated {len(prompt)}-token prompt, {cached} tokens from the prefix cache, vs first time",
        )

    async def _mixed(self, asked: list[int], unasked: list[int]) -> None:
        """Requests with and without routing in flight together: each must keep its own rows."""
        ref = _prompt_rows((await self.gen([asked]))[0])
        worst = 1.0
        for _ in range(3):
            with_r, _without = await asyncio.gather(
                self.gen([asked]), self.client.generate([unasked], self.params, return_routed_experts=False)
            )
            worst = min(worst, _agreement(_prompt_rows(with_r[0]), ref, self.info.moe_layers))
        self.add(
            "mixed batch",
            worst >= ROW_AGREEMENT_MIN,
            f"a request next to one that did not ask kept its own rows in {100 * worst:.2f}% of sets (worst of 3)"
            + (
                ""
                if worst >= ROW_AGREEMENT_MIN
                else " - it received another request's routing (SGLang <= 0.5.12 mixed-batch bug?)"
            ),
        )

    async def source_audit(self, name: str, samples: list[GenerateResult], what: str) -> None:
        """One verdict line: ``samples`` re-scored by the server in one fresh prefill each (the client's source audit,
        :mod:`rr_client.client.source_audit`), their served rows against the engine's own forward."""
        from rr_client.client.source_audit import SourceAudit
        from rr_client.core.source_audit import merge_agreements

        self.progress.started(name)
        audit = SourceAudit(1.0)
        judged = await audit.audit(self.client, samples, self.info)
        parts = [p.source_detail for r in judged if (p := r.provenance) is not None and p.source_detail is not None]
        total = merge_agreements(parts)
        if total is None or not total.cells:
            self.add(name, True, f"not exercised: no sample of {what} could be re-scored", exercised=False)
            return
        segs = ", ".join(f"{seg} {a}/{c}" for seg, (a, c) in total.by_segment.items())
        flagged = [r.index for r in judged if r.provenance is not None and r.provenance.source_flagged]
        detail = (
            f"{len(parts)} samples of {what} re-scored in a fresh prefill: {total.agreed}/{total.cells} (token, MoE "
            f"layer) sets agree ({segs})"
        )
        if flagged:
            detail += (
                f"; {len(flagged)} below {audit.threshold:.0%}: {total.describe(audit.threshold)} - the engine's own "
                "forward does not give these rows back (shifted decode rows, another request's slot, a draft "
                "node's or an older cache's rows)"
            )
        self.add(name, not flagged, detail)

    async def indexer_audit(self, prompt: list[int]) -> None:
        """The source audit of one sample's sparse-attention indexer picks (asked inline): one verdict line."""
        name = "source audit (indexer)"
        self.progress.started(name)
        try:
            batch = await self.client.generate(
                [prompt], self.params, return_indexer_topk=True, indexer_by_reference=False
            )
        except RRError as e:
            self.add(
                name, True, f"not probed: the server did not return indexer picks ({type(e).__name__}: {e})", False
            )
            return
        from rr_client.client.source_audit import SourceAudit

        audit = SourceAudit(1.0)
        (r,) = await audit.audit(self.client, list(batch), self.info)
        picks = r.provenance.source_indexer if r.provenance is not None else None
        if picks is None:
            self.add(name, True, "not exercised: the sample came back without indexer picks", exercised=False)
            return
        ok = picks.passes(audit.threshold)
        self.add(
            name,
            ok,
            f"a prompt's indexer picks re-scored in a fresh prefill: {picks.agreed}/{picks.cells} picks agree"
            + ("" if ok else f" - {picks.describe(audit.threshold)} (KV slots instead of positions? a stale cache?)"),
        )

    def truth(self, model_path: str, device: str) -> None:
        from rr_server.doctor.truth import LayerAgreement, RouterReference

        self.progress.started("ground truth")
        ref = RouterReference(model_path, device=device)
        per_layer: dict[int, LayerAgreement] = {}
        for r in self.samples:
            assert r.prompt_ids is not None and r.routed_experts is not None
            ref.compare(
                r.routed_experts, r.prompt_ids + r.output_ids, r.routed_experts_start, self.info.moe_layers, per_layer
            )
        equal = sum(a.equal for a in per_layer.values())
        total = sum(a.total for a in per_layer.values())
        differ = total - equal
        ties = sum(a.near_ties for a in per_layer.values())
        share = equal / total if total else 1.0
        self.report.ground_truth = {
            "model_path": model_path,
            "agreement": share,
            "compared": total,
            "samples": len(self.samples),
            "near_tie_share_of_differing": (ties / differ) if differ else None,
            "per_layer": {a.layer: {"agreement": a.share, "first_diff": a.first_diff} for a in per_layer.values()},
        }
        low = [a for a in per_layer.values() if a.share < TRUTH_AGREEMENT_MIN]
        detail = f"{100 * share:.2f}% of {total} (token, MoE layer) top-k sets equal the checkpoint's router" + (
            f"; {ties}/{differ} differing rows are near-ties (k-th and (k+1)-th within 1e-3)" if differ else ""
        )
        if low:
            worst = min(low, key=lambda a: a.share)
            detail += (
                f"; layer {worst.layer} agrees on only {100 * worst.share:.1f}% - shifted layers, all-zero, "
                f"physical-id or another model's routing (first difference: token {worst.first_diff[0]}, "  # type: ignore[index]
                f"got {worst.first_diff[1]}, router says {worst.first_diff[2]})"
            )  # type: ignore[index]
        self.add("ground truth", not low, detail)


async def _cost(
    http: httpx.AsyncClient, prompts: list[list[int]], params: dict[str, Any], rounds: int = 3
) -> dict[str, Any]:
    """Reply bytes per token and latency per request, with routing and without, alternating in one run."""
    stats: dict[bool, dict[str, list[float]]] = {
        True: {"bytes": [], "lat": [], "tok": []},
        False: {"bytes": [], "lat": [], "tok": []},
    }
    for _ in range(rounds):
        for want in (True, False):
            body = {"input_ids": prompts, "sampling_params": params, "return_routed_experts": want}
            t0 = time.perf_counter()
            resp = await http.post("/generate", json=body)
            stats[want]["lat"].append((time.perf_counter() - t0) / len(prompts))
            resp.raise_for_status()
            items = resp.json()
            tokens = sum(it["meta_info"]["prompt_tokens"] + it["meta_info"]["completion_tokens"] for it in items)
            stats[want]["bytes"].append(len(resp.content) / max(1, tokens))
    med = {w: {k: statistics.median(v) for k, v in s.items() if v} for w, s in stats.items()}
    return {
        "bytes_per_token_with": med[True]["bytes"],
        "bytes_per_token_without": med[False]["bytes"],
        "latency_ms_with": 1e3 * med[True]["lat"],
        "latency_ms_without": 1e3 * med[False]["lat"],
        "latency_ratio": med[True]["lat"] / med[False]["lat"] if med[False]["lat"] else None,
        "rounds": rounds,
        "requests_per_round": len(prompts),
    }


async def run_doctor(
    url: str,
    *,
    api_key: str | None = None,
    engine: str | None = None,
    model_path: str | None = None,
    prompts: int = 4,
    max_new_tokens: int = 8,
    device: str = "cpu",
    transport: httpx.AsyncBaseTransport | None = None,
    progress: DoctorProgress | None = None,
    probe_weight_update: str | None = None,
    probe_requests: int | None = None,
    pd: PDTarget | None = None,
) -> DoctorReport:
    """Run every check against ``url`` (an rr server, or with ``engine`` an unpatched engine); return the report.

    With ``engine``, the engine is wrapped in an in-process sidecar, so the same checks (and the same full
    check) apply to what that engine sends. ``progress`` hears of each step as it begins and each check as it
    ends (``rr-server doctor`` prints them as they come). Then the cache and weight-path probes
    (:mod:`rr_server.doctor.probes`): ``probe_weight_update`` (the weights the server runs now) lets the doctor
    reload them while requests are preempted; ``probe_requests`` caps the concurrent requests a probe sends.
    ``pd``: a SGLang prefill/decode pair of the same model, probed against this server (:mod:`rr_server.doctor.pd`).
    """
    progress = progress or _Quiet()

    def add(check: Check) -> None:
        report.checks.append(check)
        progress.finished(check)

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    closers: list[Any] = []
    base, tr = url, transport
    if engine is not None:
        from rr_server.proxy.app import ProxyConfig, create_app

        # force_routing=False: expose what the bare engine does to callers that talk to it directly
        app = create_app(
            ProxyConfig(
                upstream=url,
                engine=engine,
                upstream_api_key=api_key,  # type: ignore[arg-type]
                model_path=model_path,
                force_routing=False,
            ),
            transport=transport,
        )
        closers.append(app.state.sidecar.up.aclose)
        base, tr, headers = "http://rr-doctor-sidecar", httpx.ASGITransport(app=app), {}
    report = DoctorReport(url=url, deployment="unpatched" if engine else "patched")
    from rr_server.doctor.probes import MAX_PROBE_REQUESTS

    # the probes' bursts go out at once (a client-side queue would neither overfill the KV cache nor time them)
    client = RoutedExpertsClient(
        base,
        transport=tr,
        api_key=api_key if engine is None else None,
        retries=1,
        batch_size=8,
        max_concurrency=max(16, probe_requests or MAX_PROBE_REQUESTS),
    )
    http = httpx.AsyncClient(base_url=base, transport=tr, headers=headers, timeout=600)
    try:
        progress.started("identity")
        try:
            info = await client.info()
        except RRError as e:
            if isinstance(e, NotAnRRServerError):  # never "patched": it serves no rr routes
                report.deployment = "no rr routes"
            if _unreachable(e):
                report.deployment = "unreachable"
            add(Check("identity", False, identity_failure(e, url, base, engine)))
            return report
        if engine is None and info.model_extra and info.model_extra.get("sidecar"):
            report.deployment = "sidecar"
        if (info.model_extra or {}).get("routing_enabled") is False:
            from rr_server.serving.capture_paths import ROUTING_CAPTURE

            add(
                Check(
                    "identity",
                    False,
                    f"{info.engine} {info.engine_version} runs without routing capture (/rr/info routing_enabled: "
                    f"false): start it with {ROUTING_CAPTURE[0]}, or through rr-server launch {info.engine}, "
                    "which adds it",
                )
            )
            return report
        report.identity = info.model_dump()
        extra = info.model_extra or {}
        report.known_bugs = known_bugs_for(
            info.engine, info.engine_version, deployment=report.deployment, platform=extra.get("platform")
        )
        spec = extra.get("speculative")
        add(
            Check(
                "identity",
                True,
                f"{info.engine} {info.engine_version}, {info.num_hidden_layers} "
                f"layers ({len(info.moe_layers)} MoE), {info.num_experts} experts, top-{info.topk}, "
                f"wire {info.wire_dtype}"
                + (f", platform {extra['platform']}" if extra.get("platform") else "")
                + (f", speculative decoding {spec} (ground truth below runs with it)" if spec else ""),
            )
        )
        if model_path and (refused := _same_model(info, model_path)):
            add(refused)
            return report
        vocab = _vocab(model_path) if model_path else 200
        plist = _prompts(max(4, prompts), vocab)
        doc = _Doctor(client, info, report, max_new_tokens, vocab, progress)
        await doc.live(plist)
        if any(c.name == "single" and c.ok for c in report.checks):
            what = f"the checks above (speculative decoding {spec})" if spec else "the checks above"
            await doc._guard("source audit", doc.source_audit("source audit", list(doc.samples), what))
            if info.indexer is not None:  # a sparse-attention model: its indexer picks, re-scored the same way
                await doc._guard("source audit (indexer)", doc.indexer_audit(plist[0]))
            from rr_server.doctor.probes import run_probes

            await run_probes(
                doc, http, weights_path=probe_weight_update, max_requests=probe_requests or MAX_PROBE_REQUESTS
            )
            from rr_server.doctor.bounded_replay import CHECK_NAME, check_bounded_replay

            await doc._guard(CHECK_NAME, check_bounded_replay(doc, http, model_path))
            if pd is not None:
                from rr_server.doctor.pd import SEAM_CHECK, check_pd

                await doc._guard(SEAM_CHECK, check_pd(doc, pd, plist[:4], api_key))
        if model_path and doc.samples:
            doc.truth(model_path, device)
        progress.started("cost")
        try:
            report.cost = await _cost(http, plist[:2], doc.params)
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
            report.cost = {"error": plain_error(e)}
        return report
    finally:
        await client.aclose()
        await http.aclose()
        for close in closers:
            await close()


def _unreachable(e: Exception) -> bool:
    """Nothing answered: the server (or, through the doctor's sidecar, the engine) refused or dropped the connection."""
    from rr_client.core.errors import ServerError, TransportError

    return isinstance(e, TransportError) or (isinstance(e, ServerError) and "unreachable" in str(e))


def identity_failure(e: Exception, url: str, base: str, engine: str | None) -> str:
    """What the failed identity check says: where and what, without transport internals or the doctor's own sidecar
    host (``base``, when ``--engine`` put one in front of ``url``)."""
    if _unreachable(e):
        if engine:
            from rr_server.serving.capture_paths import ROUTING_CAPTURE

            return f"nothing answers at {url}: is the {engine} engine running there (with {ROUTING_CAPTURE[0]})?"
        return f"nothing answers at {url}: is an rr server running there? (start one: rr-server launch vllm|sglang)"
    if engine and isinstance(e, NotAnRRServerError):  # the doctor's own sidecar found no engine behind it
        return (
            f"{url} does not answer as a {engine} engine (the doctor's sidecar in front of it found no routing "
            f"there): is {engine} serving at that URL, started with --enable-return-routed-experts?"
        )
    return f"{type(e).__name__}: {plain_error(e)}".replace(base, url)


def plain_error(e: BaseException) -> str:
    """An error's message for a report: an HTTP status with the route and the server's own message, never httpx's
    text with its documentation link."""
    if isinstance(e, httpx.HTTPStatusError):
        from rr_client.client.http_errors import response_message

        body = " ".join(response_message(e.response).split())[:200]
        return f"HTTP {e.response.status_code} from {e.request.method} {e.request.url.path}" + (
            f": {body}" if body else ""
        )
    text = str(e).split("\n", 1)[0]
    return text.split(" For more information check:", 1)[0] or type(e).__name__


def _same_model(info: RRInfo, model_path: str) -> Check | None:
    """``--model-path`` must describe the served model's routing (layers, experts, top-k, MoE layers): the
    failed check when it does not."""
    from rr_client.core.hf_config import load_config

    local = RRInfo.from_hf_config(load_config(model_path), engine=info.engine, engine_version=info.engine_version)
    keys = ("num_hidden_layers", "num_experts", "topk", "moe_layers")
    diff = {k: (getattr(info, k), getattr(local, k)) for k in keys if getattr(info, k) != getattr(local, k)}
    if not diff:
        return None
    return Check(
        "model path",
        False,
        "--model-path is not the served model: "
        + ", ".join(f"{k} server {a} vs checkpoint {b}" for k, (a, b) in diff.items()),
    )


def _vocab(model_path: str) -> int:
    """Token ids the prompts may use: the checkpoint's vocabulary size."""
    from rr_client.core.hf_config import load_config

    cfg = load_config(model_path)
    text = cfg.get("text_config")
    inner: dict[str, Any] = text if isinstance(text, dict) else cfg
    return int(inner.get("vocab_size") or 200)
