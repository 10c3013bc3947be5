"""The indexer's own store (:func:`rr_server.serving.store.indexer_store`): sparse-attention indexer rows are held apart
from the routing store, under their own cap (``RR_INDEXER_STORE_BYTES``), so indexer rows never evict routing rows
and routing rows never evict them; the one read route answers both kinds in one call (each ask goes to the store its
ref names) and the one retire frees both."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RRInfo
from rr_client.core.reference import RoutingRef, decode_frame
from rr_server.serving.indexer_fields import indexer_fields
from rr_server.serving.store import STORE_ROUTES, MemoryStore, indexer_store
from rr_server.serving.store import install as rs
from tests.unit.test_routing_ref import URL, checked

#: a tiny DeepSeek-V3.2-style model served by SGLang 0.5.23: 2 decoder layers, each with an indexer of top-4
SGLANG_INFO = RRInfo.from_hf_config(
    {"num_hidden_layers": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "index_topk": 4},
    engine="sglang",
    engine_version="0.5.23",
)
PROMPT, COMPLETION = 60, 4


def sglang_payload(seed: int) -> str:
    """SGLang's base64 int32 indexer rows (tokens 0 .. P + C - 2, a slot per decoder layer): distinct causal picks."""
    g = np.random.default_rng(seed)
    rows = np.full((PROMPT + COMPLETION - 1, 2, 4), -1, dtype=np.int32)
    for t in range(4, rows.shape[0]):
        rows[t] = [g.choice(t + 1, 4, replace=False) for _ in range(2)]
    return base64.b64encode(rows.tobytes()).decode()


def indexer_ref(seed: int) -> RoutingRef:
    """One sample's indexer rows through rr's server path (:func:`indexer_fields`, by reference)."""
    fields = indexer_fields(
        SGLANG_INFO, sglang_payload(seed), prompt_tokens=PROMPT, completion_tokens=COMPLETION, start=0, fmt="ref"
    )
    assert "indexer_topk_error" not in fields, fields
    return RoutingRef.from_dict(fields["indexer_topk_ref"])


@pytest.fixture()
def stores(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    """A server's routing store with room for one indexer sample, not beside a routing one (one store for both
    kinds would evict the routing rows); the indexer store not made yet, its cap two indexer samples."""
    monkeypatch.setattr(rs, "_INDEXER", None)
    one = (PROMPT + COMPLETION - 1 - 4) * 2 * 4 * 2  # rows x layers x index_topk x uint16
    routing = MemoryStore(one + 10, URL)
    monkeypatch.setattr(rs, "_STORE", routing)
    monkeypatch.setenv("RR_INDEXER_STORE_BYTES", str(2 * one))
    return routing


def app() -> httpx.ASGITransport:
    from starlette.applications import Starlette
    from starlette.routing import Route

    return httpx.ASGITransport(app=Starlette(routes=[Route(p, h, methods=list(m)) for p, h, m in STORE_ROUTES]))


async def post(path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=app(), base_url=URL) as c:
        return await c.post(path, json=body)


def ask(ref: RoutingRef) -> dict[str, str]:
    return {"store": ref.store, "key": ref.key}


def test_indexer_rows_have_their_own_capped_store_and_never_evict_routing_rows(stores: MemoryStore) -> None:
    routing = RoutingRef.from_dict(stores.put(checked(8)))
    refs = [indexer_ref(seed) for seed in range(3)]  # three samples: the first evicted by the third, in its store
    idx = indexer_store()
    assert idx is not None and idx is not stores and idx.instance != stores.instance
    assert {r.store for r in refs} == {idx.instance} and all(r.kind == "indexer" and r.url == URL for r in refs)
    assert idx.stats()["evicted"] == 1 and stores.stats()["evicted"] == 0 and stores.stats()["entries"] == 1
    # one read names both kinds: each ask reaches the store its ref names
    resp = asyncio.run(post("/rr/routing/read", {"refs": [ask(routing), ask(refs[1]), ask(refs[2])]}))
    assert resp.status_code == 200, resp.text
    parts = decode_frame(resp.content)
    assert [p.key for p in parts] == [routing.key, refs[1].key, refs[2].key]
    assert np.array_equal(parts[0].rows, checked(8).array) and parts[1].rows.shape == refs[1].shape
    gone = asyncio.run(post("/rr/routing/read", {"refs": [ask(refs[0])]}))
    assert gone.status_code == 410 and "indexer store's byte cap" in gone.text
    # routing rows that fill their own store leave the indexer's alone
    stores.put(checked(8, seed=1))
    assert asyncio.run(post("/rr/routing/read", {"refs": [ask(refs[2])]})).status_code == 200
    # one retire frees both kinds
    retired = asyncio.run(post("/rr/routing/retire", {"through": refs[2].weight_version})).json()
    assert retired["retired"] == 2 and retired["indexer_store"]["retired"] == 2
    assert asyncio.run(post("/rr/routing/read", {"refs": [ask(refs[2])]})).status_code == 410


def test_the_indexer_store_cap_is_its_own_setting(stores: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows larger than the indexer store's whole cap are refused naming RR_INDEXER_STORE_BYTES, as a sample's
    refusal (its routing untouched)."""
    monkeypatch.setenv("RR_INDEXER_STORE_BYTES", "64")
    fields = indexer_fields(
        SGLANG_INFO, sglang_payload(0), prompt_tokens=PROMPT, completion_tokens=COMPLETION, start=0, fmt="ref"
    )
    assert fields["indexer_topk"] is None
    assert (
        "RoutingExpiredError" in fields["indexer_topk_error"]
        and "RR_INDEXER_STORE_BYTES" in fields["indexer_topk_error"]
    )
    assert json.loads(json.dumps(stores.stats()))["refused"] == 0
