"""rr's counters on the real vLLM CPU server's own ``/metrics`` (vLLM's prometheus registry, API server process).

Every answer that carries routing (``/generate`` batch and stream, ``/v1/completions`` with ``n=2`` and streamed)
moves ``rr_routing_samples_total``, ``rr_routing_rows_total`` and ``rr_routing_bytes_total`` by exactly what it
sent (the base64 ``routed_experts`` length, the stated rows); a ref sends no bytes; a request that did not ask
moves nothing. Refusals on a real server: the compiled-CPU
test (``test_compiled_cpu_routing_refused.py``).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.support.prom import rr_samples
from tests.support.sse import sse_events

pytestmark = pytest.mark.vllm_server

SAMPLING = {"max_new_tokens": 4, "ignore_eos": True}


def _metrics(server: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert "vllm:" in r.text  # vLLM's own endpoint, not rr's
    return rr_samples(r.text)


def _delta(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_counters_move_by_what_was_sent(qwen_server: Any) -> None:
    url = qwen_server.base_url
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("rr_routing_refused", "rr_routing_samples", "rr_routing_rows", "rr_routing_bytes"):
        assert re.search(rf"^# TYPE {name}(_total)? counter$", text, re.M), name  # declared at startup, before use
    before = _metrics(qwen_server)

    gen = httpx.post(
        url + "/generate",
        json={"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "sampling_params": SAMPLING, "return_routed_experts": True},
        timeout=300,
    )
    assert gen.status_code == 200, gen.text
    metas = [item["meta_info"] for item in gen.json()]
    plain = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": SAMPLING}, timeout=300)
    assert plain.status_code == 200 and "routed_experts" not in plain.json()["meta_info"]
    ref = httpx.post(
        url + "/generate",
        json={
            "input_ids": [5, 6, 7, 8, 9],
            "sampling_params": SAMPLING,
            "return_routed_experts": True,
            "routed_experts_format": "ref",
        },
        timeout=300,
    )
    assert ref.status_code == 200, ref.text
    ref_meta = ref.json()["meta_info"]
    comp = httpx.post(
        url + "/v1/completions",
        json={
            "model": qwen_server.name,
            "prompt": [3, 4, 5, 6],
            "max_tokens": 3,
            "temperature": 0.8,
            "seed": 0,
            "n": 2,
            "return_routed_experts": True,
        },
        timeout=300,
    )
    assert comp.status_code == 200, comp.text
    choices = comp.json()["choices"]
    stream = httpx.post(
        url + "/generate",
        json={"input_ids": [7, 8, 9], "sampling_params": SAMPLING, "stream": True, "return_routed_experts": True},
        timeout=300,
    )
    assert stream.status_code == 200, stream.text
    streamed = [
        e["meta_info"]
        for e in sse_events(stream.text)
        if e != "[DONE]" and e["meta_info"].get("routed_experts") is not None
    ]
    assert len(streamed) == 1  # routing on the final chunk only: one sample, counted once
    sse = httpx.post(
        url + "/v1/completions",
        json={
            "model": qwen_server.name,
            "prompt": [4, 5, 6],
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "return_routed_experts": True,
        },
        timeout=300,
    )
    assert sse.status_code == 200, sse.text
    sse_choices = [
        c for e in sse_events(sse.text) if e != "[DONE]" for c in e["choices"] if c.get("routed_experts") is not None
    ]
    assert len(sse_choices) == 1  # rr's routing event
    after = _metrics(qwen_server)

    inline = metas + choices + streamed + sse_choices
    assert all(isinstance(x["routed_experts"], str) for x in inline)
    assert ref_meta["routed_experts_ref"] and "routed_experts" not in ref_meta
    assert _delta(before, after) == {
        _key("rr_routing_samples_total", format="npy"): len(inline),
        _key("rr_routing_rows_total", format="npy"): sum(x["routed_experts_shape"][0] for x in inline),
        _key("rr_routing_bytes_total", format="npy"): sum(len(x["routed_experts"]) for x in inline),
        _key("rr_routing_samples_total", format="ref"): 1,
        _key("rr_routing_rows_total", format="ref"): ref_meta["routed_experts_shape"][0],
    }
