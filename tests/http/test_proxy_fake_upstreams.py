"""Sidecar against FAKE upstreams (tests/support/fake_upstreams.py): transcoding and the malformed-answer corpus.

Real engines do not send broken routing on demand, so the fault corpora run against test-only fakes
that reproduce the engines' HTTP shapes. The positive paths are proven on real engines: the sidecar in
front of real vLLM in tests/vllm/test_proxy_vllm.py, in front of SGLang's real app in
tests/sglang/test_sidecar_sglang.py.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from rr_client import RoutedExpertsClient, decode_meta_info
from rr_client.core import errors as rr_errors
from rr_server.launch.process import free_port
from rr_server.proxy.app import ProxyConfig
from tests.support import bad_requests
from tests.support.bad_requests import BadRequestCase
from tests.support.fake_upstreams import (
    CORRUPTIONS,
    EXPERTS,
    LAYERS,
    TOPK,
    FakeSGLangUpstream,
    FakeVLLMUpstream,
    fake_completion,
    write_fake_config,
)
from tests.support.protocol_server import synthetic_routing
from tests.support.proxy_harness import SidecarServer
from tests.support.routing_data import dims_info

MOE = [0, 2]


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_config(tmp_path_factory.mktemp("fake-model"))


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def stack(request: pytest.FixtureRequest, cfg_dir: Path) -> Iterator[tuple[str, object, SidecarServer]]:
    """A fake upstream of each engine kind with a real sidecar in front."""
    fake = (FakeSGLangUpstream if request.param == "sglang" else FakeVLLMUpstream)(cfg_dir)
    with fake:
        with SidecarServer(ProxyConfig(upstream=fake.url, engine=request.param, timeout=10)) as sc:
            yield request.param, fake, sc


@pytest.fixture
def http(stack: tuple[str, object, SidecarServer]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack[2].url, timeout=20) as c:
        yield c


def expected(prompt: list[int], n_new: int, start: int = 0) -> np.ndarray:
    """What the fake reports, recomputed: routing of every token but the last, from ``start``."""
    toks = prompt + fake_completion(prompt, n_new)
    return synthetic_routing(toks[:-1], LAYERS, TOPK, EXPERTS, MOE)[start:]


def test_info_and_health(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    info = http.get("/rr/info").json()
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"], info["moe_layers"]) == (3, 8, 2, MOE)
    assert info["engine"] == stack[0] and info["wire_dtype"] == "uint8" and info["sidecar"] is True
    # SGLang's log-probs are after temperature by default; what a vLLM upstream runs is not visible to the sidecar
    assert info["logprobs_mode"] == ("processed" if stack[0] == "sglang" else None)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_info_states_the_upstream_logprobs_mode_it_is_told(cfg_dir: Path, engine: str) -> None:
    """``--upstream-logprobs-mode`` reaches ``/rr/info`` (and so the client's check) for either engine."""
    from rr_server.proxy import build_parser

    told = build_parser().parse_args(["--upstream", "u", "--engine", engine, "--upstream-logprobs-mode", "raw"])
    fake = (FakeSGLangUpstream if engine == "sglang" else FakeVLLMUpstream)(cfg_dir)
    with (
        fake,
        SidecarServer(
            ProxyConfig(
                upstream=fake.url,
                engine=engine,
                timeout=10,  # type: ignore[arg-type]
                upstream_logprobs_mode=told.upstream_logprobs_mode,
            )
        ) as sc,
    ):
        assert httpx.get(f"{sc.url}/rr/info", timeout=20).json()["logprobs_mode"] == "raw"


def test_roundtrip_and_start(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    stack[1].corrupt = "none"  # type: ignore[attr-defined]
    prompt = [5, 9, 14, 20]
    for start in (0, 2):
        r = http.post(
            "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5},
                "return_routed_experts": True,
                "routed_experts_start": start,
            },
        )
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["routed_experts_format"] == "npy" and meta["routed_experts_start"] == start
        got = decode_meta_info(
            meta, rows=len(prompt) + 5 - 1 - start, num_layers=3, topk=2, num_experts=8, moe_layers=MOE
        )
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, expected(prompt, 5, start))
        assert meta["prompt_token_ids"] == prompt


def test_routing_stripped_when_not_asked(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    engine, fake, _ = stack
    fake.corrupt = "none"  # type: ignore[attr-defined]
    r = http.post("/generate", json={"text": ["ab", "cde"], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    for item in r.json():
        assert not any(k.startswith("routed_experts") or k == "output_routed_experts" for k in item["meta_info"])
    if engine == "sglang":  # the sidecar always asks SGLang for routing (mixed-batch bug, router drop)
        assert fake.bodies[-1]["return_routed_experts"] is True  # type: ignore[attr-defined]
        assert "routed_experts_start" not in fake.bodies[-1]  # type: ignore[attr-defined]


def test_client_batch_n(stack: tuple[str, object, SidecarServer]) -> None:
    """RoutedExpertsClient end to end through the sidecar: batch x n, every tensor as the fake reported."""
    stack[1].corrupt = "none"  # type: ignore[attr-defined]
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]

    async def go() -> None:
        async with RoutedExpertsClient(stack[2].url, retries=0) as c:
            batch = await c.generate(prompts, {"max_new_tokens": 4, "n": 2 if stack[0] == "vllm" else 1})
            for res in batch:
                p = prompts[res.prompt_index]
                if stack[0] == "vllm" and res.index % 2:
                    toks = p + fake_completion(p, 4, 1)
                    want = synthetic_routing(toks[:-1], LAYERS, TOPK, EXPERTS, MOE)
                else:
                    want = expected(p, 4)
                np.testing.assert_array_equal(res.routed_experts, want)
            t = batch.to_tensors()
            assert t.routed_experts.shape[0] == len(batch)

    asyncio.run(go())


def test_stream(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    stack[1].corrupt = "none"  # type: ignore[attr-defined]
    body = {
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": {"max_new_tokens": 4},
        "return_routed_experts": True,
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]
    for c in chunks:
        has = "routed_experts" in c["meta_info"]
        assert has == (c["meta_info"]["finish_reason"] is not None)
    for c in finals:
        p = [[1, 2, 3], [4, 5]][c["index"]]
        got = decode_meta_info(c["meta_info"], num_experts=8, moe_layers=MOE)
        np.testing.assert_array_equal(got, expected(p, 4))


def test_stream_without_routing(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    """Routing off: live cumulative chunks per prompt, no routing in any chunk, final ids complete."""
    stack[1].corrupt = "none"  # type: ignore[attr-defined]
    prompts = [[1, 2, 3], [4, 5]]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    for i, p in enumerate(prompts):
        mine = [c for c in chunks if c["index"] == i]
        assert [len(c["output_ids"]) for c in mine] == [1, 2, 3, 4]  # cumulative, one token each
        assert mine[-1]["output_ids"] == fake_completion(p, 4)
        assert mine[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])
    assert not any("routed_experts" in c["meta_info"] for c in chunks)


CORPUS_MESSAGES = {
    "truncated_b64": "MalformedPayloadError",
    "wrong_rows": "ShapeMismatchError",
    "duplicate_ids": "UnrecordedRoutingError",
    "out_of_range": "ExpertIdOutOfRangeError",
    "missing": "MissingRoutingError",
    "empty_dict": "MissingRoutingError",
    "dense_nonzero": "dense layer",
    "non_json": "non-JSON",
    "http_500": "HTTP 500: CUDA error",
}


# the upstream itself failed: no sample to answer, a 502 naming the problem
UPSTREAM_FAILURES = {"non_json", "http_500"}


@pytest.mark.parametrize("mode", CORRUPTIONS)
def test_malformed_upstream_corpus(mode: str, http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    """The sidecar's one policy: routing that fails the check -> that sample carries routed_experts null and the
    typed reason (the client raises it); an upstream failure -> 502 naming it; no routing ever passes unchecked;
    the sidecar keeps serving."""
    fake = stack[1]
    fake.corrupt = mode  # type: ignore[attr-defined]
    try:
        r = http.post(
            "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True},
        )
    finally:
        fake.corrupt = "none"  # type: ignore[attr-defined]
    if mode in UPSTREAM_FAILURES:
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert set(r.json()) == {"error", "message"}  # an error body, never a payload
    else:
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["routed_experts"] is None and "routed_experts_shape" not in meta
        msg = meta["routed_experts_error"]
        name = msg.split(":", 1)[0]
        with pytest.raises(getattr(rr_errors, name)):  # the client raises the typed error the sample names
            decode_meta_info(meta)
        assert len(r.json()["output_ids"]) == 4  # the rest of the sample is the engine's answer
    assert CORPUS_MESSAGES[mode] in msg, msg
    ok = http.post(
        "/generate",
        json={"input_ids": [5, 6, 7], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}},
    )
    assert ok.status_code == 200 and ok.json()["meta_info"]["routed_experts"] is not None


@pytest.mark.parametrize("case", bad_requests.params())
def test_malformed_client_requests(
    case: BadRequestCase, http: httpx.Client, stack: tuple[str, object, SidecarServer]
) -> None:
    """The shared bad-request corpus: refused with its status and message, or (fields the SGLang sidecar
    does not model, token ids only an engine can judge) passed upstream and answered there."""
    engine, fake, _ = stack
    fake.corrupt = "none"  # type: ignore[attr-defined]
    sent = len(fake.bodies)  # type: ignore[attr-defined]
    r = http.post("/generate", content=case.body, headers={"content-type": "application/json"})
    if case.rejected_at(bad_requests.SIDECAR_SGLANG if engine == "sglang" else bad_requests.SIDECAR_VLLM):
        assert r.status_code == case.status, r.text
        assert case.needle in r.json()["error"]["message"], r.text
        assert r.json()["error"]["kind"] == "bad_request"
        assert len(fake.bodies) == sent, "a refused request must never reach the upstream"  # type: ignore[attr-defined]
    else:
        assert r.status_code == 200, r.text
        assert len(fake.bodies) > sent  # type: ignore[attr-defined]
    assert http.get("/health").status_code == 200


def _metric(text: str, sample: str) -> float:
    """Value of one sample line (``name{labels}``) of a Prometheus exposition; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _deltas(before: str, after: str, *samples: str) -> dict[str, float]:
    """How much each sample line (``name{labels}``) grew from one exposition to the next."""
    return {k: _metric(after, k) - _metric(before, k) for k in samples}


def test_metrics(http: httpx.Client, stack: tuple[str, object, SidecarServer]) -> None:
    """Self-contained: causes one malformed-routing sample, one bad request and one success, then reads them back."""
    fake = stack[1]
    before = http.get("/metrics").text
    fake.corrupt = "duplicate_ids"  # type: ignore[attr-defined]
    try:
        refused = http.post("/generate", json={"input_ids": [5, 6, 7], "return_routed_experts": True})
        assert refused.status_code == 200 and refused.json()["meta_info"]["routed_experts"] is None
    finally:
        fake.corrupt = "none"  # type: ignore[attr-defined]
    assert http.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    ok = http.post(
        "/generate",
        json={"input_ids": [5, 6, 7], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 3}},
    )
    assert ok.status_code == 200
    after = http.get("/metrics").text
    for name in (
        "rr_proxy_requests_total",
        "rr_proxy_errors_total",
        "rr_proxy_routing_rows_total",
        "rr_proxy_routing_bytes_total",
        "rr_proxy_upstream_latency_seconds_bucket",
        "rr_proxy_in_flight",
    ):
        assert name in after
    delta = _deltas(
        before,
        after,
        'rr_proxy_errors_total{kind="malformed_routing"}',
        'rr_proxy_errors_total{kind="bad_request"}',
        'rr_proxy_requests_total{route="/generate",status="200"}',
        "rr_proxy_routing_rows_total",
    )
    assert delta == {
        'rr_proxy_errors_total{kind="malformed_routing"}': 1.0,
        'rr_proxy_errors_total{kind="bad_request"}': 1.0,
        'rr_proxy_requests_total{route="/generate",status="200"}': 2.0,
        "rr_proxy_routing_rows_total": 3.0 + 3 - 1,
    }, delta
    assert _metric(after, "rr_proxy_routing_bytes_total") - _metric(before, "rr_proxy_routing_bytes_total") == len(
        ok.json()["meta_info"]["routed_experts"]
    )
    # the per-sample counters a patched engine's /metrics has too (rr_server.serving.routing_metrics)
    shared = _deltas(
        before,
        after,
        'rr_routing_refused_total{error="UnrecordedRoutingError"}',
        'rr_routing_samples_total{format="npy"}',
        'rr_routing_rows_total{format="npy"}',
        'rr_routing_bytes_total{format="npy"}',
    )
    assert shared == {
        'rr_routing_refused_total{error="UnrecordedRoutingError"}': 1.0,
        'rr_routing_samples_total{format="npy"}': 1.0,
        'rr_routing_rows_total{format="npy"}': 3.0 + 3 - 1,
        'rr_routing_bytes_total{format="npy"}': len(ok.json()["meta_info"]["routed_experts"]),
    }, shared
    assert refused.json()["meta_info"]["routed_experts_error"].startswith("UnrecordedRoutingError")


def test_upstream_down_is_503(cfg_dir: Path) -> None:
    """Nothing listening upstream: /health and /generate answer 503 with a message; /rr/info too."""
    dead = f"http://127.0.0.1:{free_port()}"
    with SidecarServer(ProxyConfig(upstream=dead, engine="sglang", timeout=5, model_path=str(cfg_dir))) as sc:
        with httpx.Client(base_url=sc.url, timeout=20) as c:
            for method, path in (("GET", "/health"), ("POST", "/generate"), ("GET", "/rr/info")):
                r = c.request(method, path, json={"text": "a"} if method == "POST" else None)
                assert r.status_code == 503, (path, r.text)
                assert "unreachable" in r.json()["error"]["message"]


def test_upstream_timeout_is_504(cfg_dir: Path) -> None:
    with FakeSGLangUpstream(cfg_dir) as fake:
        with SidecarServer(ProxyConfig(upstream=fake.url, engine="sglang", timeout=0.5)) as sc:
            with httpx.Client(base_url=sc.url, timeout=20) as c:
                assert c.get("/rr/info").status_code == 200
                fake.delay = 2.0
                r = c.post("/generate", json={"text": "a"})
                assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
                fake.delay = 0.0
                assert c.post("/generate", json={"text": "a"}).status_code == 200


def test_sglang_0_5_7_field_and_dtype(cfg_dir: Path) -> None:
    """SGLang 0.5.7's ``output_routed_experts`` and an explicit ``routed_experts_dtype`` are transcoded too."""
    from rr_server.proxy.metrics import ProxyMetrics
    from rr_server.proxy.sglang_backend import SGLangBackend
    from rr_server.serving.generate_protocol import parse_generate_request

    info = dims_info(3, 8, 2, MOE, engine="sglang", engine_version="x")
    be = SGLangBackend(None, None, ProxyMetrics())  # type: ignore[arg-type]
    req = parse_generate_request({"input_ids": [1, 2, 3], "return_routed_experts": True})
    r = synthetic_routing([1, 2, 3, 4], 3, 2, 8, MOE)
    for meta in (
        {"output_routed_experts": base64.b64encode(r.astype(np.int32).tobytes()).decode()},
        {"routed_experts": base64.b64encode(r.astype(np.uint16).tobytes()).decode(), "routed_experts_dtype": "uint16"},
    ):
        item = {"output_ids": [4, 5], "meta_info": {"prompt_tokens": 3, "completion_tokens": 2, **meta}}
        out = be.transcode(item, req, info, 0)["meta_info"]
        assert "output_routed_experts" not in out and out["routed_experts_dtype"] == "uint8"
        np.testing.assert_array_equal(decode_meta_info(out), r)


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_sglang_main_compact_wire_through_the_sidecar(cfg_dir: Path, dtype: str) -> None:
    """SGLang main after 0.5.23 (SGLANG_ROUTED_EXPERTS_DTYPE): headerless base64 of uint8/uint16 with
    ``meta_info.routed_experts_dtype``. The sidecar decodes it by the stated dtype, checks it and sends rr's .npy;
    the same payload without the field (a reader assuming int32) is refused, never read as other rows."""
    ask = {"input_ids": [1, 2, 3, 4, 5], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 3}}
    with FakeSGLangUpstream(cfg_dir) as fake:
        fake.wire_dtype = dtype
        with SidecarServer(ProxyConfig(upstream=fake.url, engine="sglang", timeout=10)) as sc:
            with httpx.Client(base_url=sc.url, timeout=20) as c:
                body = c.post("/generate", json=ask).json()
            meta = body["meta_info"]
            assert meta["routed_experts_format"] == "npy" and meta["routed_experts_dtype"] == "uint8"
            np.testing.assert_array_equal(decode_meta_info(meta), expected([1, 2, 3, 4, 5], 3))

            async def gen() -> list[object]:
                async with RoutedExpertsClient(sc.url) as cl:
                    return list(await cl.generate([[1, 2, 3, 4, 5]], {"max_new_tokens": 3}))

            (res,) = asyncio.run(gen())
            np.testing.assert_array_equal(res.routed_experts, expected([1, 2, 3, 4, 5], 3))  # type: ignore[attr-defined]
            fake.state_dtype = False  # the same bytes read as int32: a different row count, refused
            with httpx.Client(base_url=sc.url, timeout=20) as c:
                bad = c.post("/generate", json=ask).json()["meta_info"]
            assert bad["routed_experts"] is None and bad["routed_experts_error"].split(":")[0] in (
                "ShapeMismatchError",
                "MalformedPayloadError",
            )
    # the client's own decode of SGLang's payload, as verl/slime/miles read it from SGLang directly
    r = expected([1, 2, 3, 4, 5], 3)
    payload = {"routed_experts": base64.b64encode(r.astype(dtype).tobytes()).decode(), "routed_experts_dtype": dtype}
    np.testing.assert_array_equal(
        decode_meta_info(payload, rows=r.shape[0], num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS, moe_layers=MOE), r
    )


def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from rr_server.cli import main

    assert main(["proxy", "--upstream", "http://x", "--engine", "vllm", "--max-concurrency", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["proxy", "--upstream", "http://x", "--engine", "tgi"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_pd_sidecar_refuses_a_prefill_server_that_returns_no_rows(cfg_dir: Path) -> None:
    """P/D in front of a SGLang release whose prefill server gathers no rows (FAKE upstreams reporting 0.5.10, what
    cannot run here): ``/rr/info`` answers 502 naming the release's rule before any sample, and the sidecar keeps
    answering. The P/D join itself is proven on SGLang's real code (tests/sglang/test_pd_sidecar.py)."""
    with FakeSGLangUpstream(cfg_dir) as prefill, FakeSGLangUpstream(cfg_dir) as decode:
        cfg = ProxyConfig(
            upstream=decode.url, engine="sglang", timeout=10, prefill_upstream=prefill.url, bootstrap_port=8998
        )
        with SidecarServer(cfg) as sc, httpx.Client(base_url=sc.url, timeout=20) as http:
            for _ in range(2):
                r = http.get("/rr/info")
                assert r.status_code == 502
                assert "SGLang 0.5.10-fake with --disaggregation-mode prefill" in r.text and "0.5.22+" in r.text
