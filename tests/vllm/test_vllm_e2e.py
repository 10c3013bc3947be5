"""End-to-end: real vLLM CPU servers with the rr plugin; routing checked against transformers' top-k sets."""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client.core.codec import decode_meta_info, decode_routed_experts
from rr_client.core.hf_config import load_config, moe_layers_from_config, routing_dims_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.support import bad_requests
from tests.support.bad_requests import BadRequestCase
from tests.support.deadlines import STARTUP_TIMEOUT_S
from tests.support.routing_asserts import assert_routing_sets_equal

pytestmark = pytest.mark.vllm_server

ROUTING_KEYS = ("routed_experts", "routed_experts_shape", "routed_experts_dtype", "routed_experts_format")
PROMPTS = [
    "Hello world, this is a tiny test.",
    "Once upon a time there was a router.",
    "1 2 3 4 5",
    "def forward(self, x):",
]


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokenize(model_dir: Path, text: str) -> list[int]:
    """Token ids vLLM will see for a text prompt (same tokenizer files)."""
    return list(_tokenizer(str(model_dir))(text)["input_ids"])


def post(server: Any, body: Any, *, raw: bytes | None = None, timeout: float = 120) -> httpx.Response:
    """POST /generate with a JSON body (or raw bytes)."""
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        server.base_url + "/generate", content=content, timeout=timeout, headers={"content-type": "application/json"}
    )


def check_item(server: Any, item: dict[str, Any], prompt_ids: list[int], *, start: int = 0) -> np.ndarray:
    """Assert one reply entry's routing equals transformers' top-k sets on every row and MoE layer."""
    meta = item["meta_info"]
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["completion_tokens"] == len(item["output_ids"])
    cfg = load_config(server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    moe = moe_layers_from_config(cfg)
    rows = len(prompt_ids) + len(item["output_ids"]) - 1 - start
    assert "routed_experts_error" not in meta, meta.get("routed_experts_error")
    assert meta["routed_experts_shape"] == [rows, layers, topk]
    assert meta["routed_experts_dtype"] == ("uint8" if experts <= 256 else "uint16")
    assert meta["routed_experts_start"] == start
    got = decode_meta_info(meta, rows=rows, num_layers=layers, topk=topk, num_experts=experts, moe_layers=moe)
    assert got.shape == (rows, layers, topk)
    ref = reference_routing(server.model_dir, prompt_ids + list(item["output_ids"]))[:-1][start:]
    dense = [i for i in range(layers) if i not in moe]
    if dense:
        assert not got[:, dense, :].any(), "dense layers must be all-zero rows"
    assert_routing_sets_equal(got, ref, layers=moe)
    return got


def no_routing(item: dict[str, Any]) -> None:
    """Assert a reply entry carries no routing at all."""
    assert not any(k in item["meta_info"] for k in ROUTING_KEYS), item["meta_info"].keys()


# ------------------------------------------------------------------------------------------ info


def test_rr_info(any_server: Any) -> None:
    info = httpx.get(any_server.base_url + "/rr/info", timeout=30).json()
    layers, experts, topk = routing_dims_from_config(load_config(any_server.model_dir))
    assert info["engine"] == "vllm" and info["engine_version"].startswith("0.")
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"]) == (layers, experts, topk)
    assert info["moe_layers"] == moe_layers_from_config(load_config(any_server.model_dir))
    assert info["wire_dtype"] == ("uint8" if experts <= 256 else "uint16")
    assert info["wire_format"] == "npy-b64"


# ---------------------------------------------------------------------------- routing values


def test_single_text_prompt(any_server: Any) -> None:
    r = post(
        any_server,
        {
            "text": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    item = r.json()
    assert isinstance(item, dict), "a single prompt gets a single dict"
    assert isinstance(item["text"], str)
    check_item(any_server, item, tokenize(any_server.model_dir, PROMPTS[0]))


def test_batch_token_id_prompts(any_server: Any) -> None:
    prompts = [tokenize(any_server.model_dir, p) for p in PROMPTS]
    r = post(
        any_server,
        {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "seed": 1},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    items = r.json()
    assert isinstance(items, list) and len(items) == len(prompts)
    for ids, item in zip(prompts, items):
        check_item(any_server, item, ids)


def test_batch_text_per_prompt_sampling_params(qwen_server: Any) -> None:
    sps = [{"max_new_tokens": 3 + i, "ignore_eos": True} for i in range(3)]
    r = post(qwen_server, {"text": PROMPTS[:3], "sampling_params": sps, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    for i, item in enumerate(r.json()):
        assert item["meta_info"]["completion_tokens"] == 3 + i
        assert item["meta_info"]["finish_reason"]["type"] == "length"
        check_item(qwen_server, item, tokenize(qwen_server.model_dir, PROMPTS[i]))


def test_n_greater_than_one(qwen_server: Any) -> None:
    prompts = [tokenize(qwen_server.model_dir, p) for p in PROMPTS[:2]]
    r = post(
        qwen_server,
        {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    items = r.json()
    assert len(items) == 6, "prompt-major: n samples per prompt, in prompt order"
    for j, item in enumerate(items):
        check_item(qwen_server, item, prompts[j // 3])
    ids = {item["meta_info"]["id"] for item in items}
    assert len(ids) == 6


def test_stop_strings(qwen_server: Any) -> None:
    stops = list("abcdefghijklmnopqrstuvwxyz")
    r = post(
        qwen_server,
        {
            "text": PROMPTS,
            "sampling_params": {"max_new_tokens": 40, "stop": stops, "temperature": 1.0, "seed": 3},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    items = r.json()
    reasons = [it["meta_info"]["finish_reason"] for it in items]
    assert any(fr["type"] == "stop" and fr["matched"] in stops for fr in reasons), reasons
    for p, item in zip(PROMPTS, items):
        fr = item["meta_info"]["finish_reason"]
        if fr["type"] == "stop":
            assert fr["matched"] not in item["text"]  # stop string trimmed (SGLang default)
        check_item(qwen_server, item, tokenize(qwen_server.model_dir, p))


def test_stop_token_ids(qwen_server: Any) -> None:
    ids = tokenize(qwen_server.model_dir, PROMPTS[1])
    first = post(qwen_server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    stop_tok = first["output_ids"][2]
    r = post(
        qwen_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_tok]},
            "return_routed_experts": True,
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert r["output_ids"][-1] == stop_tok
    check_item(qwen_server, r, ids)


def test_max_new_tokens_one(any_server: Any) -> None:
    ids = tokenize(any_server.model_dir, PROMPTS[2])
    r = post(any_server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    item = r.json()
    assert item["meta_info"]["completion_tokens"] == 1
    got = check_item(any_server, item, ids)
    assert got.shape[0] == len(ids)


def test_prefix_cache_hit(any_server: Any) -> None:
    rng = np.random.default_rng(11)
    ids = [int(x) for x in rng.integers(2, 400, size=300)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_routed_experts": True}
    a = post(any_server, body).json()
    b = post(any_server, body).json()
    assert b["meta_info"]["cached_tokens"] > 0, "second identical prompt must hit the prefix cache"
    ra = check_item(any_server, a, ids)
    rb = check_item(any_server, b, ids)
    assert np.array_equal(ra[: len(ids) - 1], rb[: len(ids) - 1])


def test_routed_experts_start(any_server: Any) -> None:
    ids = tokenize(any_server.model_dir, PROMPTS[0])
    for start in (3, len(ids) - 1, len(ids)):
        r = post(
            any_server,
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_routed_experts": True,
                "routed_experts_start": start,
            },
        )
        assert r.status_code == 200, r.text
        check_item(any_server, r.json(), ids, start=start)
    bad = post(
        any_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 5},
            "return_routed_experts": True,
            "routed_experts_start": len(ids) + 1,
        },
    )
    assert bad.status_code == 400 and "routed_experts" in bad.text


def test_return_logprob(qwen_server: Any) -> None:
    ids = tokenize(qwen_server.model_dir, PROMPTS[3])
    item = post(
        qwen_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 5},
            "return_logprob": True,
            "return_routed_experts": True,
        },
    ).json()
    lps = item["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == item["output_ids"]
    assert all(lp <= 0.0 for lp, _, _ in lps)
    check_item(qwen_server, item, ids)


# -------------------------------------------------------------------------------- streaming


def _sse(server: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streaming /generate and return the decoded chunks (until [DONE])."""
    chunks: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done, "stream must end with data: [DONE]"
    return chunks


def test_streaming_single(any_server: Any) -> None:
    ids = tokenize(any_server.model_dir, PROMPTS[1])
    chunks = _sse(
        any_server,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
            "return_routed_experts": True,
            "stream": True,
        },
    )
    assert chunks
    for c in chunks[:-1]:
        no_routing(c)
        assert c["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == 16
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens), "output_ids are cumulative, like SGLang's default"
    check_item(any_server, last, ids)


def test_streaming_batch(qwen_server: Any) -> None:
    prompts = [tokenize(qwen_server.model_dir, p) for p in PROMPTS[:3]]
    chunks = _sse(
        qwen_server,
        {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6}, "return_routed_experts": True, "stream": True},
    )
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2]
    for i, c in finals.items():
        check_item(qwen_server, c, prompts[i])


def test_streaming_without_routing(qwen_server: Any) -> None:
    chunks = _sse(qwen_server, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}, "stream": True})
    for c in chunks:
        no_routing(c)


# ------------------------------------------------------------------------------ concurrency


def test_concurrent_mixed_routing(any_server: Any) -> None:
    """20 concurrent requests, routing on for every other one; each checked, no cross-request mixing."""
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(2, 400, size=int(rng.integers(5, 60)))] for _ in range(20)]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=any_server.base_url, timeout=300) as c:

            async def one(i: int) -> dict[str, Any]:
                body = {
                    "input_ids": prompts[i],
                    "return_routed_experts": i % 2 == 0,
                    "sampling_params": {"max_new_tokens": int(4 + i % 7), "temperature": 1.0, "seed": i},
                }
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()  # type: ignore[no-any-return]

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    items = asyncio.run(run())
    for i, item in enumerate(items):
        if i % 2 == 0:
            check_item(any_server, item, prompts[i])
        else:
            no_routing(item)


# ------------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize("case", bad_requests.params(bad_requests.VLLM))
def test_bad_request_is_4xx_and_server_keeps_serving(qwen_server: Any, case: BadRequestCase) -> None:
    """The shared bad-request corpus against the rr plugin's /generate on real vLLM."""
    r = post(qwen_server, None, raw=case.body)
    assert r.status_code == case.status, (case.name, r.status_code, r.text)
    assert case.needle in r.json()["error"]["message"], r.text
    ok = post(qwen_server, {"text": "still alive?", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_bad_request_in_stream_is_4xx(qwen_server: Any) -> None:
    r = post(qwen_server, {"input_ids": [1, 2, 99999999], "stream": True})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------- vLLM left intact


def test_v1_completions_unchanged(qwen_server: Any) -> None:
    r = httpx.post(
        qwen_server.base_url + "/v1/completions",
        timeout=60,
        json={
            "model": qwen_server.name,
            "prompt": PROMPTS[0],
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 4
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and "meta_info" not in choice
    # vLLM's own field is still vLLM's: base64 .npy of prompt + completion - 1 rows (the sidecar relies on it)
    assert isinstance(choice.get("routed_experts"), str), sorted(choice)
    import base64
    import io

    arr = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    prompt_ids, out_ids = choice["prompt_token_ids"], choice["token_ids"]
    assert prompt_ids == tokenize(qwen_server.model_dir, PROMPTS[0]) and len(out_ids) == 4
    assert arr.dtype == np.uint8 and arr.shape[0] == body["usage"]["prompt_tokens"] + 4 - 1 == len(prompt_ids) + 3
    cfg = load_config(qwen_server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    moe = moe_layers_from_config(cfg)
    got = decode_routed_experts(
        choice["routed_experts"],
        rows=len(prompt_ids) + 3,
        num_layers=layers,
        topk=topk,
        num_experts=experts,
        moe_layers=moe,
    )
    assert_routing_sets_equal(got, reference_routing(qwen_server.model_dir, prompt_ids + out_ids)[:-1], layers=moe)
    models = httpx.get(qwen_server.base_url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == qwen_server.name


# --------------------------------------------------------------------------- typed client


def test_routed_experts_client(any_server: Any) -> None:
    from rr_client import RoutedExpertsClient

    prompts = [tokenize(any_server.model_dir, p) for p in PROMPTS]

    async def run() -> Any:
        async with RoutedExpertsClient(any_server.base_url, batch_size=2) as c:
            return await c.generate(prompts, {"max_new_tokens": 8, "n": 2, "temperature": 1.0, "seed": 2})

    batch = asyncio.run(run())
    assert len(batch.results) == len(prompts) * 2
    for res in batch.results:
        # n=2 answered whole: vLLM's output carries the last child's counts, so neither sample claims them
        assert res.provenance is not None and res.provenance.preemptions is None
        ids = prompts[res.prompt_index]
        assert res.routed_experts is not None
        ref = reference_routing(any_server.model_dir, ids + res.output_ids)[:-1]
        moe = moe_layers_from_config(load_config(any_server.model_dir))
        assert_routing_sets_equal(np.asarray(res.routed_experts), ref, layers=moe)


def test_client_text_prompts_to_tensors(qwen_server: Any) -> None:
    """Text prompts: the server echoes prompt ids, so padded tensors align routing with tokens."""
    from rr_client import RoutedExpertsClient

    async def run() -> Any:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            return await c.generate(PROMPTS[:3], {"max_new_tokens": 5, "temperature": 0.0})

    batch = asyncio.run(run())
    t = batch.to_tensors()
    moe = moe_layers_from_config(load_config(qwen_server.model_dir))
    for i, res in enumerate(batch.results):
        assert res.prompt_ids == tokenize(qwen_server.model_dir, PROMPTS[i])
        mask = t.routed_experts_mask[i]
        tokens = t.input_ids[i][t.attention_mask[i].bool()].tolist()
        assert tokens == res.prompt_ids + res.output_ids
        ref = reference_routing(qwen_server.model_dir, tokens)[:-1]
        assert_routing_sets_equal(t.routed_experts[i, mask].numpy(), ref, layers=moe)


def _gauge(server: Any, name: str) -> float:
    """Sum of one vLLM Prometheus metric (all label sets) from /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    vals = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    return sum(vals)


def _running(server: Any) -> float:
    """vLLM's ``num_requests_running`` gauge from /metrics."""
    return _gauge(server, "vllm:num_requests_running")


def test_client_disconnect_aborts_engine_requests(qwen_server: Any) -> None:
    """A client that goes away mid-generation: the engine request is aborted, not run to its 1000 tokens.

    Proof of the abort is the engine's own generated-token counter: once it has settled, it grew by more than
    zero tokens (the engine ran the request) and by fewer than the request asked for (it was stopped). An
    attempt whose client left before the engine started, or after it had finished, does not count and is made
    again with another delay (a precondition, not a timing assertion): an engine that never aborts fails all
    five.
    """
    import time

    max_new = 1000
    body = {
        "text": PROMPTS[0],
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "return_routed_experts": True,
    }

    def generated_total() -> float:
        return _gauge(qwen_server, "vllm:generation_tokens_total")

    async def disconnect_while_generating(delay: float) -> bool:
        """Send the request, leave ``delay`` s later (False if it had already finished)."""
        async with httpx.AsyncClient(timeout=120) as client:
            call = asyncio.ensure_future(client.post(qwen_server.base_url + "/generate", json=body))
            await asyncio.sleep(delay)
            if call.done():
                return False
            call.cancel()  # closes the connection: the client is gone
            await asyncio.gather(call, return_exceptions=True)
            return True

    def settled_total() -> float:
        """The counter once no request is running and it has not moved for 2 s (a live request moves it)."""
        last, still_since = generated_total(), time.monotonic()
        deadline = still_since + 120
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = generated_total()
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= 2.0 and _running(qwen_server) == 0:
                return now
        raise AssertionError("the engine kept generating for 120 s after the client left")

    # When to leave: not read from /metrics, which vLLM's API server answers late while it streams outputs (an
    # idle machine generates the 1000 tokens before the reading arrives). Too early (0 tokens: the request had
    # not reached the engine) or too late (all 1000: done before the leaving reached it) proves nothing either
    # way and the next attempt leaves later or sooner.
    outcomes: list[tuple[float, bool, float]] = []
    for delay in (0.3, 0.1, 0.8, 0.05, 2.0):
        before = settled_total()
        abandoned = asyncio.run(disconnect_while_generating(delay))
        outcomes.append((delay, abandoned, settled_total() - before))
        if abandoned and 0 < outcomes[-1][2] < max_new:
            break
    print("disconnect attempts (left after s, client left, tokens generated):", outcomes)
    _, abandoned, generated = outcomes[-1]
    assert abandoned, f"in 5 attempts the 1000-token request always finished before the client could leave: {outcomes}"
    assert 0 < generated < max_new, (
        f"the engine generated {generated} tokens for an abandoned request: not "
        f"aborted (attempts: (left after s, client left, tokens generated) {outcomes})"
    )
    ok = post(qwen_server, {"text": "after", "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True})
    assert ok.status_code == 200


def test_the_protocol_docs_curl_example_runs_as_written(qwen_server: Any) -> None:
    """docs/protocol.md's curl line, verbatim but for the port, against the real server: the rows' shape printed
    twice (the answer's word and the decoded .npy), equal."""
    import re
    import subprocess
    import sys

    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    (cmd,) = re.findall(r"```bash\n(curl .*?)```", doc, re.S)
    cmd = cmd.replace("http://127.0.0.1:8000", qwen_server.base_url).replace("\npython -c", f"\n{sys.executable} -c")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(r"\[(\d+), 3, 2\] \((\d+), 3, 2\)", out.stdout.strip())  # rows, 3 layers, top-2
    assert m is not None and m[1] == m[2] and 4 <= int(m[1]) <= 7, out.stdout  # 4 prompt + up to 4 new - 1
