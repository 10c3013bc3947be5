"""The rr sidecar in front of SGLang's REAL, unpatched HTTP app: the positive path, on every SGLang version.

SGLang's own FastAPI app (TokenizerManager, DetokenizerManager, ``/generate``, ``/get_model_info``,
``/get_server_info``) runs in process, fed by the stand-in scheduler (tests/sglang/standin.py: routing =
transformers' router top-k). The sidecar's app reaches it through ``httpx.ASGITransport`` and the test
drives the sidecar's app the same way, so no socket is involved. No rr patch is installed: the sidecar
alone turns SGLang's int32 routing into rr's checked wire format. Malformed upstream answers stay on
the FAKE upstreams (tests/http/test_proxy_fake_upstreams.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client.core.codec import decode_meta_info
from rr_server.demo.tiny_moe import reference_routing
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.conftest import MODEL_SPEC
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang
L, E, K = MODEL_SPEC["num_layers"], MODEL_SPEC["num_experts"], MODEL_SPEC["topk"]
MOE_LAYERS = [i for i in range(L) if i not in MODEL_SPEC["mlp_only_layers"]]
PROMPT = [3, 17, 29, 41, 53, 67, 71]
ROUTING_KEYS = (
    "routed_experts",
    "output_routed_experts",
    "routed_experts_shape",
    "routed_experts_dtype",
    "routed_experts_format",
    "routed_experts_start",
    "routed_experts_error",
)


@asynccontextmanager
async def sidecar_app(h: Harness, model_path: str | None = None, **options: Any) -> AsyncIterator[Any]:
    """The sidecar's app with SGLang's real app as its upstream (``model_path``: its ``--model-path``; ``options``:
    other :class:`ProxyConfig` fields)."""
    from rr_server.proxy.app import ProxyConfig, create_app

    cfg = ProxyConfig(upstream="http://sglang", engine="sglang", timeout=60, model_path=model_path, **options)
    app = create_app(cfg, transport=httpx.ASGITransport(app=h.http.app))
    try:
        yield app
    finally:
        await app.state.sidecar.up.aclose()


def client_of(app: Any) -> httpx.AsyncClient:
    """A client on the sidecar's own app."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sidecar")


def _body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}}
    body.update(kw)
    return body


def _expected(model: Path, h: Harness, rid: str, start: int = 0) -> np.ndarray:
    """transformers' routing of the tokens SGLang ran a forward on (prompt + completion - 1), from ``start``."""
    r = h.sched.reqs[rid]
    return reference_routing(model, (r.prompt + r.completion)[:-1])[start:]


def _assert_rr(meta: dict[str, Any], expected: np.ndarray, start: int = 0) -> None:
    """rr's wire format, decoded strictly, equal to the reference rows."""
    assert "output_routed_experts" not in meta and "routed_experts_error" not in meta
    assert (meta["routed_experts_format"], meta["routed_experts_dtype"]) == ("npy", "uint8")
    assert meta["routed_experts_shape"] == list(expected.shape)
    assert meta["routed_experts_start"] == start
    assert meta["routed_experts_shape"][0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start
    got = decode_meta_info(meta, rows=expected.shape[0], num_layers=L, topk=K, num_experts=E, moe_layers=MOE_LAYERS)
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(autouse=True)
def _unpatched() -> None:
    """The sidecar is for unpatched engines: make sure no rr hook is on SGLang's TokenizerManager."""
    from rr_patches.sglang.apply import is_applied

    assert not is_applied()


@pytest.mark.parametrize("model_path", [False, True], ids=["discovered", "model_path"])
async def test_rr_info_from_sglang_app(tiny_moe: Path, model_path: bool) -> None:
    """/rr/info from SGLang's /get_model_info (config path) and /get_server_info (version), or --model-path."""
    h = Harness(tiny_moe)
    h.tm.event_loop = asyncio.get_running_loop()  # the stand-in answers the control queries
    async with sidecar_app(h, str(tiny_moe) if model_path else None) as app, client_of(app) as c:
        r = await c.get("/rr/info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["engine"] == "sglang" and info["sidecar"] is True and info["upstream"] == "http://sglang"
    assert info["engine_version"] == profile_for().version  # SGLang's own __version__, via /get_server_info
    assert info["model"] == str(tiny_moe)  # SGLang's model_path, via /get_model_info
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"]) == (L, E, K)
    assert info["moe_layers"] == MOE_LAYERS and info["wire_dtype"] == "uint8"


async def test_generate_with_routing(tiny_moe: Path) -> None:
    """return_routed_experts: SGLang's int32 routing comes out in rr's format, equal to transformers' top-k."""
    h = Harness(tiny_moe)
    async with sidecar_app(h) as app:
        status, body = await h.post(_body(return_routed_experts=True), via=client_of(app))
    assert status == 200, body
    meta = body["meta_info"]
    _assert_rr(meta, _expected(tiny_moe, h, meta["id"]))
    assert meta["prompt_token_ids"] == PROMPT
    assert body["output_ids"] == h.sched.reqs[meta["id"]].completion


async def test_generate_batch_with_routing(tiny_moe: Path) -> None:
    """A batch answers a list in prompt order, each item with its own rows."""
    h = Harness(tiny_moe)
    prompts = [PROMPT[:4], PROMPT, PROMPT[2:]]
    async with sidecar_app(h) as app:
        status, body = await h.post(
            _body(input_ids=prompts, return_routed_experts=True), via=client_of(app), n_requests=3
        )
    assert status == 200 and isinstance(body, list) and len(body) == 3, body
    for prompt, item in zip(prompts, body):
        meta = item["meta_info"]
        assert h.sched.reqs[meta["id"]].prompt == prompt and meta["prompt_token_ids"] == prompt
        _assert_rr(meta, _expected(tiny_moe, h, meta["id"]))


async def test_routing_not_requested(tiny_moe: Path) -> None:
    """No flag: no routing in the answer, though the sidecar had SGLang compute it (its mixed-batch bug)."""
    h = Harness(tiny_moe)
    async with sidecar_app(h) as app:
        status, body = await h.post(_body(), via=client_of(app))
    assert status == 200, body
    meta = body["meta_info"]
    assert not any(k in meta for k in ROUTING_KEYS), sorted(meta)
    assert h.sched.reqs[meta["id"]].asked is True
    assert meta["completion_tokens"] == 5


async def test_routed_experts_start(tiny_moe: Path) -> None:
    """routed_experts_start=3: rows [3, P+R-1) on every version; SGLang itself is asked for all rows."""
    h = Harness(tiny_moe)
    async with sidecar_app(h) as app:
        status, body = await h.post(_body(return_routed_experts=True, routed_experts_start=3), via=client_of(app))
    assert status == 200, body
    meta = body["meta_info"]
    _assert_rr(meta, _expected(tiny_moe, h, meta["id"], 3), start=3)
    assert h.sched.reqs[meta["id"]].start == 0  # the sidecar slices; SGLang returned every row


async def test_streaming_final_chunk(tiny_moe: Path) -> None:
    """Streaming: chunks pass through without routing; the final one carries rr's routing."""
    h = Harness(tiny_moe)
    async with sidecar_app(h) as app:
        status, events = await h.post(_body(stream=True, return_routed_experts=True), via=client_of(app), chunks=3)
    assert status == 200 and len(events) >= 2, events
    *middle, last = events
    for ev in middle:
        assert ev["meta_info"]["finish_reason"] is None
        assert not any(k in ev["meta_info"] for k in ROUTING_KEYS)
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    _assert_rr(last["meta_info"], _expected(tiny_moe, h, last["meta_info"]["id"]))


# ------------------------------------------------------------------------------- OpenAI endpoints


def _openai_harness(model: Path) -> Harness:
    h = Harness(model)
    h.enable_openai()  # what SGLang's lifespan sets up for /v1/*
    return h


def _completion(h: Harness, **kw: Any) -> dict[str, Any]:
    return {"model": h.server_args.model_path, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, **kw}


@pytest.mark.parametrize("start", [0, 3])
async def test_openai_completions_with_routing(tiny_moe: Path, start: int) -> None:
    """rr fields through the sidecar from SGLang's own int32 ``sglext``: values equal transformers' top-k.

    The sidecar asks SGLang for every row and drops ``start`` itself (SGLang's OpenAI serving before 0.5.12
    ignores ``routed_experts_start_len``); SGLang 0.5.7/0.5.8 have no routing on these endpoints at all.
    """
    h = _openai_harness(tiny_moe)
    async with sidecar_app(h) as app:
        r = await h.serve(
            "/v1/completions",
            _completion(h, return_routed_experts=True, routed_experts_start=start),
            via=client_of(app),
        )
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    assert "sglext" not in answer or "routed_experts" not in (answer["sglext"] or {})  # moved to rr's fields
    if profile_for().version in ("0.5.7", "0.5.8"):
        assert choice["routed_experts"] is None and "MissingRoutingError" in choice["routed_experts_error"]
        return  # loud, never silent: this SGLang returns no routing on its OpenAI endpoints
    rid = h.sched.arrivals[-1]
    assert h.sched.reqs[rid].start == 0
    _assert_rr(
        {
            **choice,
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "completion_tokens": answer["usage"]["completion_tokens"],
        },
        _expected(tiny_moe, h, rid, start),
        start,
    )


async def test_openai_without_rr_fields_reads_as_sglang_sends_it(tiny_moe: Path) -> None:
    """No rr field: routing is still forced on (mixed-batch bug) and removed, so the answer is SGLang's own."""
    h = _openai_harness(tiny_moe)
    direct = await h.serve("/v1/completions", _completion(h))
    async with sidecar_app(h) as app:
        via = await h.serve("/v1/completions", _completion(h), via=client_of(app))
    assert via.status_code == direct.status_code == 200, via.text
    # 0.5.7/0.5.8's OpenAI serving never passes return_routed_experts on: forcing cannot reach the scheduler there
    # (docs/agentic.md: their OpenAI requests can still sit in a mixed batch next to a /generate that asked)
    forced_reaches_engine = profile_for().version not in ("0.5.7", "0.5.8")
    assert h.sched.reqs[h.sched.arrivals[-1]].asked is forced_reaches_engine
    a, b = via.json(), direct.json()
    for d in (a, b):
        d.pop("id"), d.pop("created")
    assert a == b


async def test_openai_bad_rr_field_is_a_400(tiny_moe: Path) -> None:
    h = _openai_harness(tiny_moe)
    async with sidecar_app(h) as app:
        r = await h.serve(
            "/v1/completions",
            _completion(h, return_routed_experts=True, routed_experts_format="i32"),
            via=client_of(app),
        )
        assert r.status_code == 400 and "routed_experts_format" in r.json()["error"]["message"]
        ok = await h.serve("/v1/completions", _completion(h), via=client_of(app))
    assert ok.status_code == 200


async def test_refs_in_an_object_store_are_written_off_the_loop_streamed_or_not(
    tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar with ``--rr-store file://...`` in front of SGLang's real app: a plain and a streamed answer by
    reference each name an object the client reads itself (transformers' rows), written in a worker thread."""
    import threading

    from rr_client import RoutedExpertsClient, RoutingRef
    from rr_server.serving.store import install as installed
    from rr_server.serving.store.objects import ObjectStore

    store = ObjectStore(f"file://{tmp_path}/rollouts")
    monkeypatch.setattr(installed, "_STORE", store)
    writers: list[int] = []
    real_put = store.put
    monkeypatch.setattr(store, "put", lambda checked: writers.append(threading.get_ident()) or real_put(checked))
    h = Harness(tiny_moe)
    by_ref = {"return_routed_experts": True, "routed_experts_format": "ref"}
    async with sidecar_app(h) as app:
        status, plain = await h.post(_body(**by_ref), via=client_of(app))
        assert status == 200, plain
        status, events = await h.post(_body(stream=True, **by_ref), via=client_of(app), chunks=3)
        assert status == 200, events
        refs = [RoutingRef.from_dict(m["meta_info"]["routed_experts_ref"]) for m in (plain, events[-1])]
        assert all(r.url == store.url for r in refs)
        assert len(writers) == 2 and threading.get_ident() not in writers
        async with RoutedExpertsClient("http://sidecar", transport=httpx.ASGITransport(app=app),
                                       object_stores=[store.url]) as c:  # fmt: skip
            rows = await c.resolve(refs)
    for got, answer in zip(rows, (plain, events[-1])):
        np.testing.assert_array_equal(got, _expected(tiny_moe, h, answer["meta_info"]["id"]))
