"""SGLang 0.5.23's weight-update answer "Weights were updated, but the cache was not flushed" (HTTP 400) as rr counts
it (issue 55, item 4).

SGLang's real HTTP app and TokenizerManager, its scheduler-side weight code (``SchedulerWeightUpdaterManager``,
``scheduler_components/weight_updater.py``) and its flush wrapper answer every weight route; only the GPU model
runner and the radix cache's flush are stood in (:mod:`tests.sglang.standin_weights`). The stand-in's flush is
refused the way the scheduler's is while requests run, so the 400 "Weights were updated, but the cache was not
flushed" comes from the release's own ``flush_cache_after_weight_update`` and ``http_server.update_weights_from_disk``.

That 400 is an update: the version steps, the cache is stale until a flush. (The begin/end window and the sidecar's
counting are pinned by tests/unit/test_weight_epoch.py on rr's own middleware and by
tests/sglang/test_sidecar_provenance.py: SGLang's begin/end
session waits on a tensor-parallel barrier and its disk update on the TokenizerManager's writer lock, neither of
which this in-process harness can hold open across a running request.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client.core.provenance import PROVENANCE_FIELD, Provenance
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.harness import Harness
from tests.sglang.standin_weights import StandInWeights
from tests.sglang.test_sidecar_sglang import client_of

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]  # the stand-in follows 0.5.23's scheduler
PROMPT = [3, 17, 29, 41, 53, 67, 71]  # the stand-in scheduler serves 4 of its tokens from the cache


def _engine(model: Path) -> tuple[Harness, StandInWeights]:
    """One SGLang server: its real app and TokenizerManager, SGLang's weight code behind the stand-in scheduler."""
    _BODIES.update(
        {"/update_weights_from_disk": {"model_path": str(model)}, "/update_weight_version": {"new_version": "v2"}}
    )
    h = Harness(model)
    w = StandInWeights(model)
    h.sched.weights = w
    h.sched.reports = lambda r: {"cached_tokens": 4 if r.prompt == PROMPT else 0}
    h.tm.event_loop = asyncio.get_running_loop()
    h.sched.arrivals.clear()
    return h, w


_BODIES: dict[str, Any] = {}  # a weight route's body by path (the reload's model_path, set by each test)


def _body(ids: list[int]) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}}


def _prov(item: dict[str, Any]) -> Provenance:
    return Provenance.from_dict(item["meta_info"][PROVENANCE_FIELD])


async def _cache_hit(h: Harness, sidecar: Any = None) -> Provenance:
    """A request served 4 cached prompt tokens, admitted now (through ``sidecar``'s app, if given)."""
    status, body = await h.post(_body(PROMPT), via=None if sidecar is None else client_of(sidecar))
    assert status == 200, body
    return _prov(body)


def _unflushed(answer: httpx.Response) -> None:
    """SGLang's own answer: the weights loaded, the flush refused, HTTP 400 (the release's fact says so)."""
    said = profile_for().unflushed_update_answer
    assert said is not None
    assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
    assert answer.json()["message"].startswith(said), answer.text


async def test_an_update_whose_flush_was_refused_is_an_update_with_a_stale_cache(tiny_moe: Path, patched: None) -> None:
    """``/update_weights_from_disk``: SGLang loads the weights, its flush is refused (the scheduler's answer while
    requests are queued), it answers 400. rr counts an update: ``/rr/info`` says version 1 and a stale cache, a
    cache hit after it is refused by the policy; ``/flush_cache`` makes the cache fresh again. (SGLang's
    TokenizerManager takes its writer lock for a disk update, which waits for running requests unless paused: no
    request can run across it here.)"""
    h, w = _engine(tiny_moe)
    w.flush_ok = False
    async with h.client() as c:
        upd = await c.post("/update_weights_from_disk", json=_BODIES["/update_weights_from_disk"])
        info = (await c.get("/rr/info")).json()
    _unflushed(upd)
    assert w.versions == [None]  # SGLang's manager recorded the load before its flush was refused
    assert (info["weight_version"], info["prefix_cache_stale"], info["weight_update_in_progress"]) == (1, True, False)
    hit = await _cache_hit(h)
    assert (hit.weight_version_admitted, hit.cached_under_older_weights, hit.stale) == (1, True, True)
    w.flush_ok = True
    async with h.client() as c:
        assert (await c.post("/flush_cache")).status_code == 200
        assert (await c.get("/rr/info")).json()["prefix_cache_stale"] is False
    assert (await _cache_hit(h)).cached_under_older_weights is False
