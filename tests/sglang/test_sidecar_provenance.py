"""The rr sidecar in front of SGLang's REAL, unpatched app: it forwards SGLang's weight routes and counts them
(``/rr/info`` ``weight_version``), and answers each sample's ``rr_provenance`` from SGLang's meta_info (cached
tokens, tier, retractions) and its own count."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rr_client.core.provenance import PROVENANCE_FIELD, Provenance, tokens_digest
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.harness import Harness
from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.7", "0.5.23")]
PROMPT = [3, 17, 29, 41, 53, 67, 71]
OTHER = [5, 11, 13, 19, 23, 31]


def _body(ids: Any, **kw: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}, **kw}


async def test_sidecar_counts_weight_routes_and_answers_provenance(tiny_moe: Path) -> None:
    """A weight update forwarded to SGLang's real /update_weight_version while two requests run: both samples
    carry admitted 0 / finished 1 / an overlap; the one SGLang says it retracted may be recomputed across it,
    the other is only flagged. Cached tokens (and 0.5.9+'s tier) come from SGLang's meta_info. The operator said
    every update goes through the sidecar (``weight_updates_via_sidecar``), so its count is the server's."""
    h = Harness(tiny_moe)
    h.sched.reports = lambda r: {
        "cached_tokens": 2,
        "cached_tokens_details": {"device": 2, "host": 0},
        "retraction_counts": 1 if r.prompt == OTHER else 0,
    }
    h.tm.event_loop = asyncio.get_running_loop()
    h.sched.arrivals.clear()
    async with sidecar_app(h, model_path=str(tiny_moe), weight_updates_via_sidecar=True) as app, client_of(app) as c:
        assert (await c.get("/rr/info")).json()["weight_version"] == 0
        call = asyncio.ensure_future(
            c.post("/generate", json=_body([PROMPT, OTHER], return_routed_experts=True), timeout=60)
        )
        rids = await h._wait_for(2, call)
        await h.wait_listening(rids)
        upd = await c.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
        assert upd.status_code == 200 and upd.json()["success"], upd.text
        await h.deliver(h.sched.step(rids))
        resp = await call
        info = (await c.get("/rr/info")).json()
        bad = await c.post("/update_weights_from_disk", json={})  # SGLang refuses it: not a completed update
        assert 400 <= bad.status_code < 500, bad.text
        assert (await c.get("/rr/info")).json()["weight_version"] == 1
    assert resp.status_code == 200, resp.text
    assert info["weight_version"] == 1 and info["weight_update_in_progress"] is False
    kept, retracted = (Provenance.from_dict(item["meta_info"][PROVENANCE_FIELD]) for item in resp.json())
    for p, item, ids in zip((kept, retracted), resp.json(), (PROMPT, OTHER)):
        assert (p.weight_version_admitted, p.weight_version_finished, p.weight_update_during) == (0, 1, True)
        assert p.cached_tokens == 2 and p.cache_tier == ("device" if profile_for().release >= (0, 5, 9) else None)
        assert p.tokens_digest == tokens_digest(ids, item["output_ids"])
    assert kept.preemptions == 0 and not kept.may_be_recomputed_across_update
    assert retracted.preemptions == 1 and retracted.may_be_recomputed_across_update
