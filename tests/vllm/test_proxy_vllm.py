"""Sidecar in front of a real vLLM CPU server: load with routing on/off vs transformers, and patched == sidecar.

Upstream = tests/vllm/conftest.py's ``qwen_server`` (``rr-server launch vllm``). The rr plugin only adds ``/generate`` and
``/rr/info``; the sidecar talks to vLLM's own ``/v1/models``, ``/version`` and ``/v1/completions``
(``test_v1_completions_unchanged`` in test_vllm_e2e.py checks the plugin leaves those alone), so one server
gives both sides of the comparison. A plugin-free upstream is exercised in test_proxy_upstream_kill.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import GenerateResult, RoutedExpertsClient
from rr_client.core.agreement import count_matches
from rr_client.core.provenance import PROVENANCE_FIELD, Provenance, tokens_digest
from rr_server.demo.tiny_moe import reference_routing
from rr_server.proxy.app import ProxyConfig
from tests.support.proxy_harness import SidecarServer

pytestmark = pytest.mark.vllm_server

N_REQUESTS, CONCURRENCY = 216, 32
WORDS = "the quick brown fox jumps over a lazy dog while experts route every token to a few layers".split()


@pytest.fixture(scope="module")
def sidecar(qwen_server: Any) -> Iterator[SidecarServer]:
    cfg = ProxyConfig(
        upstream=qwen_server.base_url,
        engine="vllm",
        max_concurrency=CONCURRENCY,
        timeout=120,
        model_path=str(qwen_server.model_dir),
        weight_updates_via_sidecar=True,  # its weight routes are counted as the server's (test_sidecar_provenance...)
    )
    with SidecarServer(cfg) as sc:
        yield sc


def check_against_reference(model_dir: Any, res: GenerateResult, moe: list[int], layers: int) -> int:
    """Mismatching (row, layer) top-k sets vs transformers; dense layers must be zero."""
    assert res.prompt_ids is not None and res.routed_experts is not None
    start = res.routed_experts_start
    ref = reference_routing(model_dir, res.prompt_ids + res.output_ids)[:-1][start:]
    got = res.routed_experts
    dense = [i for i in range(layers) if i not in moe]
    assert not got[:, dense, :].any(), "dense layers must carry zero rows"
    same, total = count_matches(got, ref, layers=moe)
    return total - same


def test_info_matches_patched(sidecar: SidecarServer, qwen_server: Any) -> None:
    mine = httpx.get(sidecar.url + "/rr/info", timeout=30).json()
    patched = httpx.get(qwen_server.base_url + "/rr/info", timeout=30).json()
    keys = ("num_hidden_layers", "num_experts", "topk", "moe_layers", "wire_dtype", "wire_format", "model")
    assert {k: mine[k] for k in keys} == {k: patched[k] for k in keys}
    assert mine["engine"] == "vllm" and mine["sidecar"] is True
    assert httpx.get(sidecar.url + "/health", timeout=30).status_code == 200


def test_load_mixed_routing_vs_transformers(sidecar: SidecarServer, qwen_server: Any) -> None:
    """216 requests, 32 in flight, routing on for 2/3; text and id prompts, n=1/2, starts: zero mismatches, zero lost."""
    rng = np.random.default_rng(7)
    jobs = []
    for i in range(N_REQUESTS):
        length = int(rng.integers(3, 40))
        prompt: Any = (
            " ".join(rng.choice(WORDS, size=length)) if i % 2 else [int(t) for t in rng.integers(2, 440, size=length)]
        )
        params = {"max_new_tokens": int(rng.integers(1, 12)), "n": 2 if i % 7 == 0 else 1, "ignore_eos": True}
        start = int(rng.integers(0, length)) if i % 5 == 0 else None
        jobs.append((prompt, params, i % 3 != 0, start))

    async def run() -> tuple[list[Any], float]:
        async with RoutedExpertsClient(
            sidecar.url, max_concurrency=CONCURRENCY, retries=0, batch_size=1, timeout=300
        ) as c:
            t0 = time.perf_counter()
            out = await asyncio.gather(
                *(c.generate(p, sp, return_routed_experts=w, routed_experts_start=s) for p, sp, w, s in jobs),
                return_exceptions=True,
            )
            return out, time.perf_counter() - t0

    results, wall = asyncio.run(run())
    lost = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not lost, f"{len(lost)} requests failed, first: {lost[0]}"
    info = httpx.get(sidecar.url + "/rr/info", timeout=30).json()
    mismatches = samples = routed = rows = 0
    for (_prompt, params, want, start), batch in zip(jobs, results):
        assert len(batch) == params["n"]
        for res in batch:
            samples += 1
            assert len(res.output_ids) == params["max_new_tokens"]
            if not want:
                assert res.routed_experts is None and "routed_experts" not in res.meta
                continue
            assert res.routed_experts_start == (start or 0)
            mismatches += check_against_reference(
                qwen_server.model_dir, res, info["moe_layers"], info["num_hidden_layers"]
            )
            routed += 1
            rows += res.routed_experts.shape[0]
    print(
        f"\nsidecar load: {N_REQUESTS} requests ({samples} samples, {routed} with routing, {rows} rows), "
        f"{CONCURRENCY} concurrent, {wall:.1f}s wall, {N_REQUESTS / wall:.1f} req/s, mismatches={mismatches}"
    )
    assert mismatches == 0
    metrics = httpx.get(sidecar.url + "/metrics", timeout=30).text
    assert f"rr_proxy_routing_rows_total {float(rows)}" in metrics


def test_patched_and_sidecar_give_identical_tensors(sidecar: SidecarServer, qwen_server: Any) -> None:
    """Same greedy prompts through the plugin's /generate and through the sidecar: equal to_tensors() output."""
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [17] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def gen(url: str, start: int | None) -> Any:
        async with RoutedExpertsClient(url, retries=0, batch_size=2) as c:
            return await c.generate(prompts, params, routed_experts_start=start)

    for start in (None, 2):
        a, b = asyncio.run(gen(qwen_server.base_url, start)), asyncio.run(gen(sidecar.url, start))
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            np.testing.assert_array_equal(x.routed_experts, y.routed_experts)
        for layout in ("token_major", "layer_major"):
            ta, tb = a.to_tensors(layout=layout), b.to_tensors(layout=layout)  # type: ignore[arg-type]
            for k in ("input_ids", "attention_mask", "response_mask", "routed_experts", "routed_experts_mask"):
                va, vb = getattr(ta, k), getattr(tb, k)
                assert va.dtype == vb.dtype and va.shape == vb.shape and bool((va == vb).all()), k


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streaming /generate; return the decoded chunks (after checking the [DONE] terminator)."""
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stream_matches_patched(sidecar: SidecarServer, qwen_server: Any) -> None:
    """Streaming through the sidecar ends where the patched server's stream ends; routing only when asked."""
    for want in (False, True):
        body = {
            "input_ids": [[5, 6, 7], [8, 9]],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": want,
            "stream": True,
        }
        finals = []
        for url in (sidecar.url, qwen_server.base_url):
            chunks = _sse(url, body)
            last = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
            assert sorted(last) == [0, 1]
            if not want:
                assert len(chunks) > 2 and not any("routed_experts" in c["meta_info"] for c in chunks)
            finals.append({i: (c["output_ids"], c["meta_info"].get("routed_experts")) for i, c in last.items()})
        assert finals[0] == finals[1]


def test_upstream_rejection_is_4xx(sidecar: SidecarServer) -> None:
    bad = httpx.post(
        sidecar.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, timeout=60
    )
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_sidecar_provenance_and_weight_routes(sidecar: SidecarServer, qwen_server: Any) -> None:
    """Each sample's rr_provenance from the sidecar: vLLM's cached tokens (usage), preemptions unknown (null), the
    sidecar's own weight count; a weight route the engine refuses is passed back as it is and not counted."""
    ids = [10 + (7 * i) % 200 for i in range(40)]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_routed_experts": True,
    }
    for _ in range(2):  # the second one may hit vLLM's prefix cache
        item = httpx.post(sidecar.url + "/generate", json=body, timeout=120).json()
        p = Provenance.from_dict(item["meta_info"][PROVENANCE_FIELD])
        assert p.cached_tokens == item["meta_info"]["cached_tokens"] and p.preemptions is None
        assert (p.weight_version_admitted, p.weight_version_finished, p.weight_update_during) == (0, 0, False)
        assert p.tokens_digest == tokens_digest(ids, item["output_ids"])
        assert item["meta_info"]["routed_experts_shape"][0] == len(ids) + len(item["output_ids"]) - 1
    direct = httpx.post(qwen_server.base_url + "/update_weight_version", json={"new_version": "x"}, timeout=30)
    via = httpx.post(sidecar.url + "/update_weight_version", json={"new_version": "x"}, timeout=30)
    assert via.status_code == direct.status_code
    info = httpx.get(sidecar.url + "/rr/info", timeout=30).json()
    assert info["weight_version"] == (1 if 200 <= via.status_code < 300 else 0)
