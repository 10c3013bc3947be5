"""Per-sample provenance (``rr_provenance``) on SGLang's real TokenizerManager / HTTP app, fed by the stand-in
scheduler: what the scheduler reports per request (cached tokens and their tier, retractions, SGLang's own weight
spans) and rr's count of SGLang's weight routes, on ``/generate``, the OpenAI choices and ``/rr/info``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rr_client.core.errors import StaleRoutingError
from rr_client.core.provenance import PROVENANCE_FIELD, Provenance, check_provenance, tokens_digest
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.harness import Harness
from tests.sglang.standin import StandInReq

pytestmark = pytest.mark.sglang
PROMPT = [3, 17, 29, 41, 53, 67, 71]
OTHER = [5, 11, 13, 19, 23, 31]


def _has_details() -> bool:
    """cached_tokens_details in the output batch (0.5.9+); read when a test runs (the core run has no SGLang)."""
    return profile_for().release >= (0, 5, 9)


def _body(ids: Any = PROMPT) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}}


def _prov(meta: dict[str, Any]) -> Provenance:
    """The answer's rr_provenance, parsed strictly by the client's own parser."""
    return Provenance.from_dict(meta[PROVENANCE_FIELD])


def _digest(h: Harness, rid: str) -> str:
    r = h.sched.reqs[rid]
    return tokens_digest(r.prompt, r.completion)


@pytest.mark.sglang_releases("0.5.7", "0.5.9", "0.5.12", "0.5.20", "0.5.23")  # where the batch's fields or wire change
async def test_cache_and_retractions_as_the_scheduler_reports_them(tiny_moe: Path, patched: None) -> None:
    """cached_tokens, the deepest tier that served them (0.5.9+ details; None before), retractions and the tokens'
    digest on the final answer; no weight update: both versions 0, no overlap; /rr/info weight_version 0."""
    h = Harness(tiny_moe)
    h.sched.reports = lambda r: {
        "cached_tokens": 4,
        "cached_tokens_details": {"device": 1, "host": 3},
        "retraction_counts": 2,
    }
    status, body = await h.post(_body())
    assert status == 200, body
    p = _prov(body["meta_info"])
    assert p == Provenance(
        cached_tokens=4,
        cache_tier="host" if _has_details() else None,
        preemptions=2,
        weight_version_admitted=0,
        weight_version_finished=0,
        weight_update_during=False,
        tokens_digest=_digest(h, h.sched.arrivals[0]),
        cached_under_older_weights=False,  # no update since the server started: the cache holds these weights' KV
    )
    assert p.tokens_digest == tokens_digest(PROMPT, body["output_ids"])
    async with h.client() as c:
        info = (await c.get("/rr/info")).json()
    assert info["weight_version"] == 0


@pytest.mark.sglang_releases("0.5.7", "0.5.18", "0.5.19", "0.5.23")  # 0.5.19+: the route asks the scheduler
async def test_weight_update_between_admission_and_finish(tiny_moe: Path, patched: None) -> None:
    """A weight route answered while two requests ran: both carry admitted 0, finished 1, an overlap; the one the
    scheduler retracted is refused by the stale-rows policy (or masked), the other is kept and flagged."""
    h = Harness(tiny_moe)
    h.sched.reports = lambda r: {"retraction_counts": 1 if r.prompt == OTHER else 0}
    h.tm.event_loop = asyncio.get_running_loop()
    h.sched.arrivals.clear()
    async with h.client() as c:
        call = asyncio.ensure_future(c.post("/generate", json=_body([PROMPT, OTHER]), timeout=60))
        rids = await h._wait_for(2, call)
        await h.wait_listening(rids)
        upd = await c.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
        assert upd.status_code == 200, upd.text
        await h.deliver(h.sched.step(rids))
        resp = await call
        info = (await c.get("/rr/info")).json()
    assert resp.status_code == 200, resp.text
    kept, retracted = (_prov(item["meta_info"]) for item in resp.json())
    assert info["weight_version"] == 1
    for p in (kept, retracted):
        assert (p.weight_version_admitted, p.weight_version_finished, p.weight_update_during) == (0, 1, True)
    assert kept.preemptions == 0 and kept.spans_update and not kept.may_be_recomputed_across_update
    assert retracted.preemptions == 1 and retracted.may_be_recomputed_across_update
    with pytest.raises(StaleRoutingError, match="sample 1"):
        check_provenance([kept, retracted], "refuse")
    check = check_provenance([kept, retracted], "mask")
    assert (check.replay, check.masked, check.spans_update) == ((True, False), 1, 1)


@pytest.mark.sglang_releases("0.5.7", "0.5.23")
async def test_a_cache_hit_after_an_update_without_a_flush_is_refused(tiny_moe: Path, patched: None) -> None:
    """``/update_weight_version`` flushes nothing: a request admitted after it whose prompt the scheduler serves from
    the radix cache says its cached tokens may be older weights' KV, and the policy refuses it; one without a hit
    is clean."""
    h = Harness(tiny_moe)
    h.sched.reports = lambda r: {"cached_tokens": 4 if r.prompt == PROMPT else 0}
    async with h.client() as c:
        upd = await c.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
        assert upd.status_code == 200, upd.text
        info = (await c.get("/rr/info")).json()
    assert info["weight_version"] == 1 and info["prefix_cache_stale"] is True
    status, body = await h.post(_body([PROMPT, OTHER]), n_requests=2)
    assert status == 200, body
    hit, miss = (_prov(item["meta_info"]) for item in body)
    assert hit.cached_under_older_weights is True and hit.stale and not hit.spans_update
    assert miss.cached_under_older_weights is False and not miss.stale
    with pytest.raises(StaleRoutingError, match="sample 0: its 4 cached tokens may come from KV computed under older"):
        check_provenance([hit, miss], "refuse")


@pytest.mark.sglang_releases("0.5.20", "0.5.23")
async def test_sglang_own_weight_spans_mark_an_overlap(tiny_moe: Path, patched: None) -> None:
    """0.5.20+: SGLang's weight_versions spans name two versions (an update rr's routes did not see, e.g. through
    the Engine API): the sample is marked as overlapping an update though rr's count did not move."""
    from sglang.srt.utils.weight_versions import WeightVersionSpan

    def spans(r: StandInReq) -> dict[str, Any]:
        two = [WeightVersionSpan(version="v1", start=0, end=2), WeightVersionSpan(version="v2", start=2, end=5)]
        return {"weight_versions": two if r.prompt == OTHER else [WeightVersionSpan(version="v1", start=0, end=5)]}

    h = Harness(tiny_moe)
    h.sched.reports = spans
    status, body = await h.post(_body([PROMPT, OTHER]), n_requests=2)
    assert status == 200, body
    same, spanned = (_prov(item["meta_info"]) for item in body)
    assert not same.weight_update_during and spanned.weight_update_during
    assert (spanned.weight_version_admitted, spanned.weight_version_finished) == (0, 0)


@pytest.mark.sglang_releases("0.5.7", "0.5.23")
async def test_openai_choice_and_ref_carry_provenance(tiny_moe: Path, patched: None) -> None:
    """The OpenAI choice carries the same rr_provenance as its sample; a by-reference answer's ref carries it too."""
    h = Harness(tiny_moe)
    h.enable_openai()
    h.sched.reports = lambda r: {"cached_tokens": 3}
    model = h.server_args.served_model_name or h.server_args.model_path
    resp = await h.serve(
        "/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "return_routed_experts": True},
    )
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    p = Provenance.from_dict(choice[PROVENANCE_FIELD])
    assert p.cached_tokens == 3 and p.tokens_digest == tokens_digest(PROMPT, choice["token_ids"])
    status, body = await h.post({**_body(), "return_routed_experts": True, "routed_experts_format": "ref"})
    assert status == 200, body
    meta = body["meta_info"]
    assert meta["routed_experts_ref"]["provenance"] == meta[PROVENANCE_FIELD]
