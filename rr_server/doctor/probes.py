"""The doctor's probes of the cache and weight paths a deployment has on (issue 38).

- **preemption**: more concurrent requests than the KV cache holds (sized from the cache the server reports), so
  the engine preempts some; every sample's rows must equal a non-preempted run of its prompt (greedy), and
  ``rr_provenance`` must report the preemptions the engine counted (vLLM's ``vllm:num_preemptions``).
- **weight update** (``--probe-weight-update PATH``, the server's own current weights): the same load, and a
  reload through the engine's weight route while its requests are in flight (vLLM dev mode: frozen in the engine
  by ``/pause?mode=keep``, then preempted under the new weights; elsewhere once the engine has preempted);
  ``/rr/info`` ``weight_version`` must rise, every request in flight across the reload must be flagged (``spans_update``), a preempted one
  ``may_be_recomputed_across_update``; rows after the reload must equal those before (same weights).
- **kv offload** (vLLM) / **hierarchical cache** (SGLang): whether the deployment can serve prefix hits from
  outside the device cache with routing on; where it can, a prefix evicted from the device and served again must
  keep the cold run's rows.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from rr_client import GenerateResult, RRError, RRInfo
from rr_client.core.engines import ENGINES, offload_name
from rr_server.doctor.engine_state import (
    EngineCache,
    engine_cache,
    hold_generation,
    preemption_count,
    provenance_of,
    release_generation,
    reload_weights,
    requests_in_engine,
    weight_version,
)
from rr_server.doctor.samples import PREFIX_CACHE_TOKENS, ROW_AGREEMENT_MIN, _agreement, _prompt_rows, _prompts


class DoctorRun(Protocol):
    """What a probe needs of the doctor run that calls it (``checks._Doctor`` is one): the server's info, the
    prompt vocabulary, a way to generate and to record a check. Named here, so probes never import the checks."""

    info: RRInfo
    vocab: int

    def add(self, name: str, ok: bool, detail: str, exercised: bool = True) -> None: ...

    async def gen(
        self, prompts: list[list[int]], params: dict[str, Any] | None = None, **kw: Any
    ) -> list[GenerateResult]: ...

    def rows_agree(self, name: str, a: Any, b: Any, what: str) -> None: ...

    async def _guard(self, name: str, probe: Awaitable[None]) -> None: ...

    async def source_audit(self, name: str, samples: list[GenerateResult], what: str) -> None: ...


__all__ = ["Load", "plan_load", "comparable_rows", "offload_state", "run_probes", "MAX_PROBE_REQUESTS", "OFFLOAD_TIERS"]

# The most concurrent requests a probe sends to force preemption (a larger KV cache is reported, not flooded).
MAX_PROBE_REQUESTS = 48
# Bursts with a reload the weight-update probe tries before it says the reload never met a preempted request.
WEIGHT_UPDATE_ATTEMPTS = 2
# How long a held burst waits for all its requests to reach the engine before it is let go as it stands.
HOLD_DEADLINE_S = 30.0
# Tiers a prefix hit can come from outside the device cache (rr_client.core.provenance.CacheTier).
OFFLOAD_TIERS = ("host", "storage", "external")
_NOT_SAID = (
    "the server does not say its KV cache size (vLLM: /metrics vllm:cache_config_info; SGLang: "
    "/get_server_info), so the load that forces preemption is unknown"
)


@dataclass(frozen=True)
class Load:
    """Concurrent requests that overfill the KV cache: each starts within ``prompt_len`` and grows by one block."""

    requests: int
    prompt_len: int
    new_tokens: int


def plan_load(cache: EngineCache, max_requests: int = MAX_PROBE_REQUESTS) -> Load | str:
    """The load that forces preemption on ``cache``, or why there is none: every request's prompt fills whole
    blocks but the last quarter of one, its answer crosses into more blocks, and two more requests than the
    prompts fit run at once, so decoding runs out of blocks."""
    if not cache.num_blocks or not cache.block_size:
        return _NOT_SAID
    block = cache.block_size
    per = max(1, math.ceil(96 / block))  # blocks a prompt starts in (~96 tokens)
    prompt = per * block - max(1, block // 4)
    new = max(48, block // 2)  # decode steps enough for a preempted request to be re-admitted (and a reload to land)
    requests = cache.num_blocks // per + 2
    if requests > max_requests:
        return (
            f"the KV cache holds {cache.num_blocks} blocks of {block} tokens ({cache.capacity_tokens} tokens); "
            f"forcing preemption would take {requests} concurrent requests (> {max_requests}): run the doctor "
            "against a replica with a small KV cache (vLLM --num-gpu-blocks-override / --kv-cache-memory-bytes, "
            "SGLang --max-total-tokens) to probe it"
        )
    return Load(requests, prompt, new)


def comparable_rows(a: GenerateResult, b: GenerateResult) -> int:
    """How many leading rows two greedy samples of one prompt share inputs for: the prompt's and those of the
    output tokens both generated alike (row t routes token t, which depends on tokens 0..t)."""
    same = 0
    for x, y in zip(a.output_ids, b.output_ids):
        if x != y:
            break
        same += 1
    assert a.prompt_ids is not None
    prompt, rows = len(a.prompt_ids), len(a.prompt_ids) + len(a.output_ids) - 1
    return max(0, min(prompt + same, rows) - a.routed_experts_start)


class _Probes:
    """The probes of one doctor run, sharing the references (non-preempted runs) of their prompts."""

    def __init__(self, doc: DoctorRun, http: httpx.AsyncClient, weights_path: str | None, max_requests: int) -> None:
        self.doc, self.http, self.weights_path, self.max_requests = doc, http, weights_path, max_requests
        self.engine = doc.info.engine
        self.cache = EngineCache("")
        self.refs: dict[tuple[int, ...], GenerateResult] = {}
        self.held = ""  # how the last burst went out (held until all were in the engine, or why not)

    def agreement(self, got: GenerateResult, ref: GenerateResult) -> float:
        """Share of equal (row, MoE layer) sets over the rows both samples share inputs for."""

        n = comparable_rows(got, ref)
        assert got.routed_experts is not None and ref.routed_experts is not None
        return _agreement(got.routed_experts[:n], ref.routed_experts[:n], self.doc.info.moe_layers)

    async def references(self, prompts: list[list[int]], load: Load) -> str | None:
        """Each prompt run where it cannot be preempted (few at a time); why not, if one was preempted anyway."""
        need = math.ceil((load.prompt_len + load.new_tokens) / (self.cache.block_size or 1))
        group = max(1, (self.cache.num_blocks or need) // need)
        params = {"max_new_tokens": load.new_tokens}
        for i in range(0, len(prompts), group):
            got = await asyncio.gather(*(self.doc.gen([p], params) for p in prompts[i : i + group]))
            for (r,) in got:
                prov = provenance_of(r)
                if prov is not None and prov.preemptions:
                    return (
                        f"the reference run of a prompt was itself preempted ({prov.preemptions} times, "
                        f"{group} requests at once): the cache is too small to give a non-preempted run"
                    )
                assert r.prompt_ids is not None
                self.refs[tuple(r.prompt_ids)] = r
        return None

    async def burst(
        self, prompts: list[list[int]], load: Load, during: Any = None, while_held: Any = None
    ) -> tuple[list[tuple[float, float, GenerateResult]], float | None, Any]:
        """All prompts at once; each sample with when it was sent and answered, the engine's preemption count
        during the burst (None: not reported), and what ``during`` (run alongside) returned. ``while_held`` runs
        once every request is in the held engine, before it is let go (not at all when the burst is unheld).

        Where the server can freeze generation with requests kept (vLLM dev mode), the burst is held until every
        request is in the engine and then let go together: the engine admits as many as the cache holds in one
        step and must preempt, however the requests' arrival was staggered. Elsewhere they go out unheld (on a
        loaded machine the first may finish before the last arrive: then the probe says "not exercised")."""
        before = await preemption_count(self.http)
        params = {"max_new_tokens": load.new_tokens}

        async def one(p: list[int]) -> tuple[float, float, GenerateResult]:
            t0 = time.monotonic()
            (r,) = await self.doc.gen([p], params)
            return t0, time.monotonic(), r

        base = await requests_in_engine(self.http)
        why_not = "the server does not say how many requests it has in the engine" if base is None else None
        why_not = why_not or await hold_generation(self.http, self.engine)
        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        if why_not is None:
            try:
                self.held = await self._until_in_engine(tasks, base or 0)
                if while_held is not None:
                    await while_held()
            finally:
                if (failed := await release_generation(self.http, self.engine)) is not None:
                    self.held += f"; letting it go failed: {failed}"
        else:
            self.held = f"sent unheld ({why_not})"
        side = await during(tasks, before) if during is not None else None
        done = await asyncio.gather(*tasks)
        after = await preemption_count(self.http)
        delta = None if before is None or after is None else after - before
        return list(done), delta, side

    async def _until_in_engine(self, tasks: list[asyncio.Future[Any]], base: int) -> str:
        """Wait (bounded) until every request of a held burst is in the engine or answered; how the hold went."""
        deadline, seen = time.monotonic() + HOLD_DEADLINE_S, 0
        while time.monotonic() < deadline:
            now = await requests_in_engine(self.http)
            seen = (now or 0) - base
            if seen + sum(t.done() for t in tasks) >= len(tasks):
                return f"held until all {len(tasks)} were in the engine, then let go at once"
            await asyncio.sleep(0.02)
        return (
            f"held {HOLD_DEADLINE_S:.0f} s, but the answering API process saw only {seen} of {len(tasks)} in the "
            "engine (with several API processes each counts its own), then let go"
        )

    async def preemption(self, load: Load | str) -> None:
        name = "preemption"
        if isinstance(load, str):
            self.doc.add(name, True, f"not probed: {load}", exercised=False)
            return
        prompts = self.prompts(load, seed=38)
        if (why := await self.references(prompts, load)) is not None:
            self.doc.add(name, True, f"not probed: {why}", exercised=False)
            return
        samples, engine_count, _ = await self.burst(prompts, load)
        provs = [provenance_of(r) for _, _, r in samples]
        if all(p is None for p in provs):
            self.doc.add(
                name,
                True,
                "not probed: the server sends no rr_provenance (an rr server older than "
                "provenance, or an engine behind it that does not say)",
                exercised=False,
            )
            return
        reported = [p.preemptions for p in provs if p is not None and p.preemptions is not None]
        preempted = [i for i, p in enumerate(provs) if p is not None and p.preemptions]
        what = f"{load.requests} concurrent requests of {load.prompt_len}+{load.new_tokens} tokens"
        if engine_count and not preempted:
            self.doc.add(
                name,
                False,
                f"{what}: the engine counted {engine_count:.0f} preemptions (vLLM "
                "vllm:num_preemptions) but no sample's rr_provenance reports one - provenance drops "
                "preemptions, so a sample preempted across a weight update would pass unflagged",
            )
            return
        if not preempted:
            why = (
                "rr_provenance.preemptions is null (the server runs without stats, e.g. --disable-log-stats): "
                "preempted samples cannot be told apart"
                if not reported
                else "no request was preempted (the engine counted "
                + ("none" if engine_count == 0 else "not reported")
                + ")"
            )
            self.doc.add(name, True, f"not exercised: {what}; {why}; {self.held}", exercised=False)
            return
        await self.rows_vs_refs(
            name,
            samples,
            preempted,
            f"{what}: {len(preempted)} preempted (rr_provenance: {sum(reported)} preemptions, "
            f"engine: {'not reported' if engine_count is None else f'{engine_count:.0f}'}; {self.held})",
        )

    async def rows_vs_refs(
        self, name: str, samples: list[tuple[float, float, GenerateResult]], preempted: list[int], what: str
    ) -> None:
        """Every sample's rows against its prompt's non-preempted run; the preempted ones named when they differ."""

        worst_pre, worst_other, bad = 1.0, 1.0, []
        for i, (_, _, r) in enumerate(samples):
            assert r.prompt_ids is not None
            share = self.agreement(r, self.refs[tuple(r.prompt_ids)])
            if i in preempted:
                worst_pre = min(worst_pre, share)
            else:
                worst_other = min(worst_other, share)
            if share < ROW_AGREEMENT_MIN:
                bad.append(f"request {i}{' (preempted)' if i in preempted else ''} {100 * share:.1f}%")
        detail = (
            f"{what}; rows vs a non-preempted run of the same prompt: preempted {100 * worst_pre:.2f}%, "
            f"others {100 * worst_other:.2f}% of (token, MoE layer) sets equal (worst)"
        )
        if bad:
            detail += f" - rows that do not belong to their tokens after a preemption: {', '.join(bad[:4])}"
        self.doc.add(name, not bad, detail)

    def prompts(self, load: Load, seed: int) -> list[list[int]]:

        return _prompts(load.requests, self.doc.vocab, seed=seed, length=load.prompt_len)

    async def weight_update(self, load: Load | str) -> None:
        name = "weight update"
        if self.weights_path is None:
            self.doc.add(
                name,
                True,
                "not probed: pass --probe-weight-update PATH (the weights the server runs now) "
                "to let the doctor reload them while requests are preempted",
                exercised=False,
            )
            return
        if isinstance(load, str):
            self.doc.add(name, True, f"not probed: {load}", exercised=False)
            return
        v0 = await weight_version(self.http)
        if v0 is None:
            self.doc.add(
                name,
                False,
                "/rr/info has no weight_version: the server does not count weight updates, so "
                "no sample can be flagged as spanning one",
            )
            return
        # longer answers than the preemption probe's: the reload must land while preempted requests still run
        load = Load(load.requests, load.prompt_len, 3 * load.new_tokens)
        prompts = self.prompts(load, seed=39)
        (before,) = await self.doc.gen([prompts[0]], {"max_new_tokens": load.new_tokens})
        for attempt in range(WEIGHT_UPDATE_ATTEMPTS):
            v0 = await weight_version(self.http) if attempt else v0
            outcome = await self._reload_round(prompts, load, v0)  # type: ignore[arg-type]
            if isinstance(outcome, str):
                self.doc.add(name, True, f"not probed: the reload failed: {outcome}", exercised=False)
                return
            what, problems, flagged = outcome
            if problems or flagged:
                break
        (after,) = await self.doc.gen([prompts[0]], {"max_new_tokens": load.new_tokens})
        share = self.agreement(after, before)
        await self.doc._guard(
            "source audit after weight update",
            self.doc.source_audit(
                "source audit after weight update",
                [after],
                "a prompt served before the reload, again after it (its prefix from the cache, if not cleared)",
            ),
        )

        if share < ROW_AGREEMENT_MIN:
            problems.append(
                f"after reloading the same weights a prompt's rows equal its rows before in only "
                f"{100 * share:.1f}% of sets (the reload changed the model: wrong path, or weights not "
                "loaded completely)"
            )
        if problems:
            self.doc.add(name, False, f"{what} - {'; '.join(problems[:3])}")
        elif not flagged:
            self.doc.add(
                name,
                True,
                f"not exercised: {what} (in {WEIGHT_UPDATE_ATTEMPTS} tries): no request was "
                "preempted across the reload (the spanning ones were flagged)",
                exercised=False,
            )
        else:
            self.doc.add(name, True, f"{what}; rows after the reload equal those before")

    async def _reload_round(self, prompts: list[list[int]], load: Load, v0: int) -> str | tuple[str, list[str], int]:
        """One burst with a reload once the engine preempts: (what happened, problems, requests preempted and
        flagged across it), or why the reload failed."""
        window: dict[str, Any] = {}

        async def reload() -> None:
            window["t0"] = time.monotonic()
            window["error"] = await reload_weights(self.http, self.engine, self.weights_path)  # type: ignore[arg-type]
            window["t1"] = time.monotonic()

        async def reload_mid_burst(tasks: list[asyncio.Future[Any]], before: float | None) -> None:
            """Unheld (the engine cannot freeze generation): reload once the engine has preempted (or half the
            requests are done, if it does not count preemptions)."""
            if "t0" in window:
                return  # reloaded while the burst was held
            while not all(t.done() for t in tasks):
                now = await preemption_count(self.http)
                if (before is not None and now is not None and now > before) or (
                    now is None and sum(t.done() for t in tasks) * 2 >= len(tasks)
                ):
                    break
                await asyncio.sleep(0.01)
            await reload()

        # held (vLLM dev mode): the reload lands while every request of the burst is admitted and frozen in the
        # engine, as an RL loop's pause-update-resume does; let go, they overfill the cache under the new weights and
        # are preempted. Aimed mid-decode instead, it missed on a loaded machine: while the engine decodes, the API
        # process answered the doctor only once the burst's outputs drained (seen: /resume took the whole burst).
        samples, _count, _ = await self.burst(prompts, load, during=reload_mid_burst, while_held=reload)
        if window.get("error"):
            return str(window["error"])
        v1 = await weight_version(self.http)
        problems: list[str] = []
        if v1 is None or v1 <= v0:
            problems.append(
                f"/rr/info weight_version {v0} before the reload and {v1} after: the update was not counted"
            )
        t0, t1 = window["t0"], window["t1"]
        across = flagged = 0
        for i, (sent, answered, r) in enumerate(samples):
            p = provenance_of(r)
            if p is None:
                problems.append(f"request {i} has no rr_provenance")
                continue
            if sent < t0 and answered > t1 and p.weight_version_admitted in (v0, None):
                across += 1  # admitted under the old weights (the server's word), finished under the new
                if not p.spans_update:
                    problems.append(
                        f"request {i} ran across the reload but rr_provenance says weight version "
                        f"{p.weight_version_admitted} -> {p.weight_version_finished}, no update during"
                    )
                elif p.preemptions:
                    flagged += p.may_be_recomputed_across_update
            elif answered < t0 and p.spans_update:
                problems.append(f"request {i} finished before the reload began but is flagged as spanning it")
        what = (
            f"reload of {self.weights_path}: weight_version {v0} -> {v1}; {across} of {load.requests} requests "
            f"of {load.prompt_len}+{load.new_tokens} tokens ran across it, {flagged} of them preempted and "
            f"flagged may_be_recomputed_across_update ({self.held})"
        )
        return what, problems, flagged

    async def tiered_cache(self, load: Load | str) -> None:
        """vLLM's KV offload connector or SGLang's hierarchical cache: refused, off, or probed."""
        name = offload_name(self.engine)
        tiers = offload_state(self.doc.info, self.cache)
        if isinstance(tiers, tuple):
            ok, detail = tiers
            self.doc.add(name, ok, detail, exercised=False)
            return
        if isinstance(load, str):
            self.doc.add(name, True, f"not probed: {tiers} is on, but {load}", exercised=False)
            return

        prompt = _prompts(1, self.doc.vocab, seed=40, length=PREFIX_CACHE_TOKENS)[0]
        (cold,) = await self.doc.gen([prompt])
        flood = self.prompts(Load(load.requests, load.prompt_len, load.new_tokens), seed=41)
        await asyncio.gather(*(self.doc.gen([p], {"max_new_tokens": load.new_tokens}) for p in flood))
        (again,) = await self.doc.gen([prompt])
        p = provenance_of(again)
        tier = p.cache_tier if p is not None else None
        if p is None or not p.cached_tokens or tier not in OFFLOAD_TIERS:
            self.doc.add(
                name,
                True,
                f"not exercised: {tiers} is on; a {len(prompt)}-token prompt evicted from the "
                f"device cache came back with {p.cached_tokens if p else 'no'} cached tokens from tier "
                f"{tier!r} (not an offload tier)",
                exercised=False,
            )
            return
        self.doc.rows_agree(
            name,
            _prompt_rows(again),
            _prompt_rows(cold),
            f"{tiers}: {p.cached_tokens} prompt tokens restored from the {tier} tier vs the cold run",
        )


def offload_state(info: RRInfo, c: EngineCache) -> str | tuple[bool, str]:
    """What offload tier is on, in words (then it is probed), or (ok, why it is not probed)."""
    extra = info.model_extra or {}
    eng = ENGINES.get(info.engine)
    if eng is not None and eng.kv_offload_connector:
        from rr_server.serving.engines import releases

        try:
            refused = releases(eng).facts_for(info.engine_version).kv_connector_refused
        except RRError:
            refused = False
        if refused:
            return True, (
                f"not probed: vLLM {info.engine_version} refuses any KV connector (offload included) "
                "together with --enable-return-routed-experts at startup ('incompatible with KV "
                "connectors'), so this server serves prefix hits from its device cache only"
            )
        connector = extra.get("kv_connector") or c.offload
        if connector:
            return f"KV connector {connector}"
        return True, (
            "not probed: no KV offload connector reported ("
            + (f"{c.source}: none" if c.source else "the server does not say")
            + ")"
        )
    if eng is not None and eng.hierarchical_cache:
        from rr_server.launch.sglang import HICACHE_REFUSED_BY_SGLANG

        who = (
            f"SGLang {info.engine_version} refuses it with routed experts itself"
            if info.engine_version in HICACHE_REFUSED_BY_SGLANG
            else f"SGLang {info.engine_version} allows it; rr-server launch sglang refuses it (sglang#26975: host-tier "
            "restores return other prompts' rows; the fix #39027 is not released)"
        )
        if c.hierarchical:
            return (
                "hierarchical cache"
                + (f" (storage {c.hierarchical_storage})" if c.hierarchical_storage else "")
                + f" [{who}]"
            )
        if c.hierarchical is False:
            return True, f"not probed: off ({c.source}: enable_hierarchical_cache false); {who}"
        return True, f"not probed: the server does not say whether the hierarchical cache is on ({who})"
    return True, f"not probed: {info.engine} has no offload tier rr knows"


async def run_probes(
    doc: DoctorRun, http: httpx.AsyncClient, *, weights_path: str | None = None, max_requests: int = MAX_PROBE_REQUESTS
) -> None:
    """The cache and weight-path probes, each a check on ``doc``'s report (a typed error fails that probe only)."""
    probes = _Probes(doc, http, weights_path, max_requests)
    probes.cache = await engine_cache(http, doc.info.engine)
    load = plan_load(probes.cache, max_requests)
    await doc._guard("preemption", probes.preemption(load))
    await doc._guard("weight update", probes.weight_update(load))
    await doc._guard(offload_name(doc.info.engine), probes.tiered_cache(load))
