"""Routing by reference on SGLang's real TokenizerManager and HTTP app under rr's patch: ``/generate`` with
``routed_experts_format: "ref"`` answers a RoutingRef, the checked rows stay in the process's store, and resolving
them through SGLang's own app (``/rr/routing/read``) gives transformers' rows, as the inline answer does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient, RoutingExpiredError, RoutingRef
from rr_client.core.codec import decode_meta_info
from rr_server.demo.tiny_moe import reference_routing
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang
PROMPT = [3, 17, 29, 41, 53, 67, 71]


def _reference(model: Path, h: Harness, rid: str, start: int) -> np.ndarray:
    r = h.sched.reqs[rid]
    return reference_routing(model, (r.prompt + r.completion)[:-1])[start:].astype(np.uint8)


@pytest.mark.parametrize("start", [0, 3])
async def test_ref_resolves_to_the_inline_rows(tiny_moe: Path, patched: None, start: int) -> None:
    h = Harness(tiny_moe)
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
        "return_routed_experts": True,
        "routed_experts_start_len": start,
    }
    status, inline = await h.post(body)
    assert status == 200
    status, answer = await h.post({**body, "routed_experts_format": "ref"})
    assert status == 200, answer
    meta = answer["meta_info"]
    start = start if h.profile.has_start_field else 0  # 0.5.7 has no routed_experts_start_len
    assert "routed_experts" not in meta and meta["routed_experts_format"] == "ref"
    ref = RoutingRef.from_dict(meta["routed_experts_ref"])
    assert ref.start == start and ref.url.startswith("http://")
    app = httpx.ASGITransport(app=h.http.app)  # SGLang's own app serves the read route
    async with RoutedExpertsClient(ref.url, transport=app) as c:
        (rows,) = await c.resolve([ref])
        np.testing.assert_array_equal(rows, _reference(tiny_moe, h, meta["id"], start))
        info = (await c._http_for(ref.url).get(ref.url + "/rr/info")).json()
        assert info["routing_store"]["read_bytes"] >= rows.nbytes
        r = await c._http_for(ref.url).post(ref.url + "/rr/routing/retire", json={"through": ref.weight_version})
        assert r.status_code == 200
        with pytest.raises(RoutingExpiredError, match="retired"):
            await c.resolve([ref])
    m = inline["meta_info"]  # the inline answer of the same request: the same tokens, the same rows
    assert m["routed_experts_format"] == "npy" and inline["output_ids"] == answer["output_ids"]
    got = decode_meta_info(m, rows=ref.rows, num_layers=ref.layers, topk=ref.topk, num_experts=8, moe_layers=[0, 2])
    np.testing.assert_array_equal(got, rows)


async def test_an_object_store_ref_is_written_off_the_event_loop(
    tiny_moe: Path, patched: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--rr-store file://...`` on the patched TokenizerManager: the answer names an object the client reads
    itself (transformers' rows), and from 0.5.11 on (SGLang's handler a coroutine) the write ran in the batch's
    worker thread, never on SGLang's event loop."""
    import threading

    from rr_server.serving.store import install as installed
    from rr_server.serving.store.objects import ObjectStore

    h = Harness(tiny_moe)
    store = ObjectStore(f"file://{tmp_path}/rollouts")
    monkeypatch.setattr(installed, "_STORE", store)
    writers: list[int] = []
    real_put = store.put
    monkeypatch.setattr(store, "put", lambda checked: writers.append(threading.get_ident()) or real_put(checked))
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
        "return_routed_experts": True,
        "routed_experts_format": "ref",
    }
    status, answer = await h.post(body)
    assert status == 200, answer
    ref = RoutingRef.from_dict(answer["meta_info"]["routed_experts_ref"])
    assert ref.url == store.url and len(writers) == 1
    on_loop = writers[0] == threading.get_ident()
    assert on_loop is not h.profile.handle_is_async
    app = httpx.ASGITransport(app=h.http.app)
    async with RoutedExpertsClient("http://sglang.test", transport=app, object_stores=[store.url]) as c:
        (rows,) = await c.resolve([ref])
    np.testing.assert_array_equal(rows, _reference(tiny_moe, h, answer["meta_info"]["id"], 0))
