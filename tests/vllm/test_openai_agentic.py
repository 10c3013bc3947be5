"""Agentic rollouts on a real vLLM CPU server with the rr plugin: OpenAI endpoints, trajectories, formats.

Routing values are compared with transformers' router top-k over the same token ids, as sets, on every
row and MoE layer.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient, TokenMismatchError, to_tensors
from rr_client.core.hf_config import load_config, moe_layers_from_config, routing_dims_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.sse import sse_events
from tests.vllm.test_vllm_e2e import tokenize

pytestmark = pytest.mark.vllm_server

RR_CHOICE_FIELDS = ("routed_experts_shape", "routed_experts_dtype", "routed_experts_format", "routed_experts_start")


def _dims(server: Any) -> tuple[int, int, int, list[int]]:
    cfg = load_config(server.model_dir)
    layers, experts, topk = routing_dims_from_config(cfg)
    return layers, experts, topk, moe_layers_from_config(cfg)


def _assert_matches_transformers(server: Any, routing: np.ndarray, tokens: list[int], start: int = 0) -> None:
    """Routing rows ``start..`` of ``tokens`` equal transformers' top-k sets; dense layers zero."""
    layers, _, _, moe = _dims(server)
    ref = reference_routing(server.model_dir, tokens)[:-1][start:]
    assert routing.shape == ref.shape, (routing.shape, ref.shape)
    dense = [i for i in range(layers) if i not in moe]
    if dense:
        assert not routing[:, dense, :].any()
    assert_routing_sets_equal(routing, ref, layers=moe)


def _post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def _model(server: Any) -> str:
    return str(httpx.get(server.base_url + "/rr/info", timeout=30).json()["model"])


# ------------------------------------------------------------------------------------- raw HTTP


def test_completions_carry_checked_routing_and_token_ids(qwen_server: Any) -> None:
    ids = tokenize(qwen_server.model_dir, "Once upon a time there was a router.")
    start = 4
    r = _post(
        qwen_server,
        "/v1/completions",
        {
            "model": _model(qwen_server),
            "prompt": ids,
            "max_tokens": 9,
            "temperature": 0,
            "return_routed_experts": True,
            "routed_experts_start": start,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids
    out = choice["token_ids"]
    layers, _, topk, _ = _dims(qwen_server)
    rows = len(ids) + len(out) - 1 - start
    assert choice["routed_experts_shape"] == [rows, layers, topk]
    assert (choice["routed_experts_dtype"], choice["routed_experts_format"]) == ("uint8", "npy")
    assert choice["routed_experts_start"] == start
    import io

    arr = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))  # the plain numpy way reads it
    _assert_matches_transformers(qwen_server, arr, ids + out, start)
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")


def test_request_without_rr_fields_gets_vllms_own_answer(qwen_server: Any) -> None:
    """No rr field: the middleware forwards the bytes; the answer is vLLM's (no rr fields, no token ids)."""
    body = {"model": _model(qwen_server), "prompt": "1 2 3 4 5", "max_tokens": 5, "temperature": 0}
    a = _post(qwen_server, "/v1/completions", body)
    assert a.status_code == 200, a.text
    choice = a.json()["choices"][0]
    assert not any(k in choice for k in RR_CHOICE_FIELDS)
    assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
    # vLLM's own routing field (the server flag is on) stays in vLLM's format, as vLLM sent it
    assert isinstance(choice["routed_experts"], str)
    with_rr = _post(qwen_server, "/v1/completions", {**body, "return_routed_experts": True}).json()["choices"][0]
    assert with_rr["text"] == choice["text"]
    assert with_rr["routed_experts"] == choice["routed_experts"]  # vLLM's .npy is already rr's format


@pytest.mark.parametrize(
    "body,field",
    [
        ({"routed_experts_format": "int32"}, "routed_experts_format"),
        ({"routed_experts_start": -1}, "routed_experts_start"),
        ({"routed_experts_start": 500, "prompt": [5, 6, 7]}, "routed_experts_start"),
        ({"return_routed_experts": "yes"}, "return_routed_experts"),
    ],
    ids=["format", "negative-start", "start-beyond-prompt", "flag-type"],
)
def test_bad_openai_requests_get_400_naming_the_field(qwen_server: Any, body: dict[str, Any], field: str) -> None:
    base = {"model": _model(qwen_server), "prompt": "hello", "max_tokens": 3, "return_routed_experts": True}
    for path in ("/v1/completions", "/v1/chat/completions"):
        b = dict(base, **body)
        if path.endswith("chat/completions"):
            b["messages"] = [{"role": "user", "content": "hi"}]
            b.pop("prompt")
            if field == "routed_experts_start" and b["routed_experts_start"] == 500:
                continue  # the templated prompt length is known only to the engine: next test
        r = _post(qwen_server, path, b)
        assert r.status_code == 400, (path, r.text)
        assert field in r.json()["error"]["message"], r.text
    ok = _post(qwen_server, "/v1/completions", {**base, "max_tokens": 2})
    assert ok.status_code == 200 and "routed_experts_shape" in ok.json()["choices"][0]


def test_chat_start_beyond_templated_prompt_is_a_400(qwen_server: Any) -> None:
    """vLLM checks the start against the templated prompt; its 400 reaches the caller as vLLM sent it."""
    r = _post(
        qwen_server,
        "/v1/chat/completions",
        {
            "model": _model(qwen_server),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "return_routed_experts": True,
            "routed_experts_start": 900,
        },
    )
    assert r.status_code == 400, r.text
    assert "routed_experts_prompt_start" in r.text


def test_sglang_format_decodes_the_way_trainers_do(qwen_server: Any) -> None:
    """``routed_experts_format="sglang"``: headerless int32, read by frombuffer + reshape (slime/AReaL style)."""
    layers, _, topk, _ = _dims(qwen_server)
    ids = tokenize(qwen_server.model_dir, "def forward(self, x):")
    gen = _post(
        qwen_server,
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_routed_experts": True,
            "routed_experts_format": "sglang",
        },
    ).json()
    meta = gen["meta_info"]
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    arr = flat.reshape(meta["prompt_tokens"] + meta["completion_tokens"] - 1, layers, topk)
    _assert_matches_transformers(qwen_server, arr, ids + gen["output_ids"])
    comp = _post(
        qwen_server,
        "/v1/completions",
        {
            "model": _model(qwen_server),
            "prompt": ids,
            "max_tokens": 6,
            "temperature": 0,
            "return_routed_experts": True,
            "routed_experts_format": "sglang",
            "routed_experts_start": 2,
        },
    ).json()
    ch = comp["choices"][0]
    flat = np.frombuffer(base64.b64decode(ch["routed_experts"]), dtype=np.int32)
    usage = comp["usage"]
    arr = flat.reshape(usage["prompt_tokens"] + usage["completion_tokens"] - 1 - 2, layers, topk)
    _assert_matches_transformers(qwen_server, arr, ids + ch["token_ids"], 2)


# ------------------------------------------------------------------------------------- client


def test_client_complete_and_chat(qwen_server: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_server.model_dir)
    messages = [{"role": "system", "content": "You are a router."}, {"role": "user", "content": "1 2 3 4 5"}]

    async def run() -> tuple[Any, Any, Any]:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            comp = await c.complete("Hello world, this is a tiny test.", {"max_new_tokens": 7, "temperature": 0})
            chat = await c.chat(messages, {"max_new_tokens": 7, "temperature": 0})
            return comp, chat, c.info

    comp, chat, _ = asyncio.run(run())
    for batch in (comp, chat):
        res = batch[0]
        assert res.routed_experts is not None and res.prompt_ids and res.output_ids
        _assert_matches_transformers(qwen_server, res.routed_experts, res.prompt_ids + res.output_ids)
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if isinstance(templated, dict) or hasattr(templated, "keys") else templated
    assert chat[0].prompt_ids == list(templated), "the engine ran the model's own chat template"
    assert chat[0].meta["message"]["role"] == "assistant"
    tensors = to_tensors(list(comp) + list(chat), comp.info)  # results of both endpoints pad like samples
    assert tensors.routed_experts.shape[0] == 2


def _tool_tokens(server: Any, text: str) -> list[int]:
    return tokenize(server.model_dir, text)


def _tool_ids(server: Any) -> Any:
    return lambda turn: _tool_tokens(server, f" tool says {turn}: 1 2 3 4 5")


_PARAMS = {"max_new_tokens": 12, "temperature": 0.8, "seed": 7}


async def _three_turns(server: Any, transport: httpx.AsyncBaseTransport | None = None) -> Any:
    """A 3-turn token-id rollout with tool tokens in between (the demo's agentic loop)."""
    from rr_server.demo.agentic import agentic_rollout

    async with RoutedExpertsClient(server.base_url, transport=transport) as c:
        traj = await agentic_rollout(
            c,
            tokenize(server.model_dir, "Once upon a time there was a router."),
            _tool_ids(server),
            turns=3,
            params=_PARAMS,
        )
        return traj, await c.info()


async def _three_turns_resent(server: Any, transport: httpx.AsyncBaseTransport) -> list[int]:
    """The same conversation asking for every row each turn; its tokens."""
    from rr_server.demo.agentic import resent_rollout

    async with RoutedExpertsClient(server.base_url, transport=transport) as c:
        return await resent_rollout(
            c,
            tokenize(server.model_dir, "Once upon a time there was a router."),
            _tool_ids(server),
            turns=3,
            params=_PARAMS,
        )


def test_three_turn_trajectory_matches_transformers(qwen_server: Any) -> None:
    traj, info = asyncio.run(_three_turns(qwen_server))
    ids = traj.input_ids
    assert len(traj.turns) == 3
    assert traj.routed_experts.shape[0] == len(ids) - 1 == traj.num_rows
    _assert_matches_transformers(qwen_server, traj.routed_experts, ids)
    mask = np.asarray(traj.loss_mask)
    assert mask.sum() == sum(len(t.output_ids) for t in traj.turns)
    tool = _tool_tokens(qwen_server, " tool says 0: 1 2 3 4 5")
    first_out = len(traj.turns[0].prompt_ids or []) + len(traj.turns[0].output_ids)
    assert ids[first_out : first_out + len(tool)] == tool and not mask[first_out : first_out + len(tool)].any()
    t = to_tensors([traj], info, pad_side="right", pad_to=len(ids) + 4)
    assert t.response_mask[0, : len(ids)].tolist() == [0] * len(traj.prompt_ids) + [
        int(m) for m in traj.output_loss_mask
    ]
    assert t.routed_experts_mask[0].sum().item() == len(ids) - 1
    assert np.array_equal(t.routed_experts[0, : len(ids) - 1].numpy(), traj.routed_experts)
    for k, turn in enumerate(traj.turns[1:], 1):  # each later turn asked only for what it did not hold
        assert (
            turn.routed_experts_start == len(traj.turns[k - 1].prompt_ids or []) + len(traj.turns[k - 1].output_ids) - 1
        )


def test_incremental_start_sends_one_turns_rows(qwen_server: Any) -> None:
    """Bytes on the wire: incremental turns receive fewer bytes than re-sending every row each turn."""
    from rr_server.demo.agentic import CountingTransport

    inc, resend = CountingTransport(), CountingTransport()
    traj, _ = asyncio.run(_three_turns(qwen_server, inc))
    base = asyncio.run(_three_turns_resent(qwen_server, resend))
    assert traj.input_ids == base  # same seeds, same conversation
    # per turn: exactly the rows of the tokens it had not seen (new prompt tokens + output), no more
    held = 0
    for turn in traj.turns:
        new_rows = len(turn.prompt_ids or []) + len(turn.output_ids) - 1 - held
        assert turn.routed_experts.shape[0] == new_rows
        held += new_rows
    assert inc.bytes < resend.bytes, (inc.bytes, resend.bytes)
    # re-sent: turn k carries every row again; incremental: only the new ones (3 turns: well under 2/3)
    assert 0 < inc.routing_bytes < 0.7 * resend.routing_bytes, (inc.routing_bytes, resend.routing_bytes)


def test_chat_trajectory_and_retokenization_error(qwen_server: Any) -> None:
    """Chat turns align on the engine's token ids; a harness that edits an earlier turn gets TokenMismatchError."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_server.model_dir)

    async def run() -> tuple[Any, Any]:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            good = c.chat_trajectory([{"role": "user", "content": "1 2 3 4 5"}])
            await good.chat({"max_new_tokens": 6, "temperature": 0})
            first = good.turns[0]
            # precondition of the positive case: this output re-tokenizes to itself
            assert tok(first.text)["input_ids"] == first.output_ids, "pick a prompt whose output round-trips"
            good.add({"role": "tool", "content": "result: 42"})
            await good.chat({"max_new_tokens": 6, "temperature": 0})
            bad = c.chat_trajectory([{"role": "user", "content": "1 2 3 4 5"}])
            await bad.chat({"max_new_tokens": 6, "temperature": 0})
            bad.messages[-1]["content"] = " " + bad.messages[-1]["content"]  # a harness "normalizing" the text
            bad.add({"role": "tool", "content": "result: 42"})
            with pytest.raises(TokenMismatchError) as ei:
                await bad.chat({"max_new_tokens": 6, "temperature": 0})
            return good, ei.value

    good, err = asyncio.run(run())
    assert good.routed_experts.shape[0] == len(good.input_ids) - 1
    _assert_matches_transformers(qwen_server, good.routed_experts, good.input_ids)
    assert sum(good.loss_mask) == sum(len(t.output_ids) for t in good.turns)
    first_out = len(good.turns[0].prompt_ids or [])
    assert err.position == first_out, "the first differing token is the edited turn's first output token"
    assert "position" in str(err)


# ------------------------------------------------------------------------------------- sidecar


@pytest.fixture(scope="module")
def sidecar_url(qwen_server: Any) -> Any:
    from rr_server.proxy.app import ProxyConfig
    from tests.support.proxy_harness import SidecarServer

    cfg = ProxyConfig(upstream=qwen_server.base_url, engine="vllm", timeout=120, model_path=str(qwen_server.model_dir))
    with SidecarServer(cfg) as sc:
        yield sc.url


def test_sidecar_openai_routing_equals_patched(qwen_server: Any, sidecar_url: str) -> None:
    """The sidecar serves the same rr fields on the OpenAI endpoints as the patched engine, values checked."""
    ids = tokenize(qwen_server.model_dir, "SGLang and vLLM are inference engines")
    body = {
        "model": _model(qwen_server),
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0,
        "return_routed_experts": True,
        "routed_experts_start": 3,
    }
    via = httpx.post(sidecar_url + "/v1/completions", json=body, timeout=120)
    direct = _post(qwen_server, "/v1/completions", body)
    assert via.status_code == 200, via.text
    a, b = via.json()["choices"][0], direct.json()["choices"][0]
    for k in ("text", "token_ids", "prompt_token_ids", "routed_experts", *RR_CHOICE_FIELDS):
        assert a[k] == b[k], k
    import io

    arr = np.load(io.BytesIO(base64.b64decode(a["routed_experts"])))
    _assert_matches_transformers(qwen_server, arr, ids + a["token_ids"], 3)

    async def chat() -> Any:
        async with RoutedExpertsClient(sidecar_url) as c:
            traj = c.chat_trajectory([{"role": "user", "content": "1 2 3 4 5"}])
            await traj.chat({"max_new_tokens": 6, "temperature": 0})
            return traj

    traj = asyncio.run(chat())
    _assert_matches_transformers(qwen_server, traj.routed_experts, traj.input_ids)


def test_sidecar_passes_other_requests_through(qwen_server: Any, sidecar_url: str) -> None:
    """No rr field: the engine's answer, streaming included; bad rr fields: 400 naming the field."""
    body = {"model": _model(qwen_server), "prompt": "1 2 3 4 5", "max_tokens": 5, "temperature": 0}
    via = httpx.post(sidecar_url + "/v1/completions", json=body, timeout=120).json()
    direct = _post(qwen_server, "/v1/completions", body).json()
    assert via["choices"] == direct["choices"] and via["usage"] == direct["usage"]
    with httpx.stream(
        "POST",
        sidecar_url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": _model(qwen_server),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
    ) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[0][5:])["object"] == "chat.completion.chunk"
    bad = httpx.post(
        sidecar_url + "/v1/completions", json={**body, "stream": True, "return_routed_experts": True}, timeout=60
    )
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]
    missing = httpx.post(sidecar_url + "/v1/completions", json={**body, "model": "no-such-model"}, timeout=60)
    assert missing.status_code == 404, missing.text  # the engine's own error, passed through


def test_agentic_doc_example_runs(qwen_server: Any) -> None:
    """docs/agentic.md's multi-turn example, as written, against a real server (only the URL replaced)."""
    from pathlib import Path

    text = Path(__file__).resolve().parents[2].joinpath("docs", "agentic.md").read_text()
    section = text[text.index("## A multi-turn rollout") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python\n") + 10)]
    assert 'URL = "http://127.0.0.1:8000"' in code
    code = code.replace('"http://127.0.0.1:8000"', repr(qwen_server.base_url))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/agentic.md", "exec"), {"__name__": "__doc__"})  # noqa: S102
    assert "torch.Size([2," in out.getvalue(), out.getvalue()


def _npy(payload: str) -> np.ndarray:
    import io

    return np.load(io.BytesIO(base64.b64decode(payload)))


def test_streaming_completions_routing_on_the_last_event(qwen_server: Any) -> None:
    """stream=true, two prompts, n=2: vLLM's chunks pass through, and one event before ``[DONE]`` gives each of
    the 4 choices its own checked routing (equal to transformers) and the token ids its chunks streamed."""
    prompts = [
        tokenize(qwen_server.model_dir, "Streaming rollouts need routing too"),
        tokenize(qwen_server.model_dir, "A second prompt, longer than the first one"),
    ]
    start = 2
    r = _post(
        qwen_server,
        "/v1/completions",
        {
            "model": _model(qwen_server),
            "prompt": prompts,
            "n": 2,
            "max_tokens": 7,
            "temperature": 0.9,
            "seed": 3,
            "stream": True,
            "return_token_ids": True,
            "return_routed_experts": True,
            "routed_experts_start": start,
        },
    )
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, routing = events[:-1]
    streamed: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c["choices"]:
            assert "routed_experts" not in ch
            streamed.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
    assert sorted(streamed) == [0, 1, 2, 3]
    assert [c["index"] for c in routing["choices"]] == [0, 1, 2, 3]
    assert routing["id"] == chunks[0]["id"]
    for choice in routing["choices"]:
        assert "routed_experts_error" not in choice, choice
        assert choice["prompt_token_ids"] == prompts[choice["index"] // 2]
        assert choice["token_ids"] == streamed[choice["index"]] and len(choice["token_ids"]) == 7
        assert choice["routed_experts_start"] == start and choice["routed_experts_format"] == "npy"
        arr = _npy(choice["routed_experts"])
        assert list(arr.shape) == choice["routed_experts_shape"]
        _assert_matches_transformers(qwen_server, arr, choice["prompt_token_ids"] + choice["token_ids"], start)


def test_streaming_chat_routing_and_client_disconnect(qwen_server: Any) -> None:
    """Chat stream: the routing event matches transformers over the templated prompt; a stream the client leaves
    early ends without one, and the server goes on serving."""
    body = {
        "model": _model(qwen_server),
        "messages": [{"role": "user", "content": "1 2 3 4 5"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "return_routed_experts": True,
    }
    r = _post(qwen_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[0]["object"] == "chat.completion.chunk"
    (choice,) = events[-2]["choices"]
    assert "routed_experts_error" not in choice, choice
    tokens = choice["prompt_token_ids"] + choice["token_ids"]
    _assert_matches_transformers(qwen_server, _npy(choice["routed_experts"]), tokens)
    plain = _post(qwen_server, "/v1/chat/completions", {**body, "stream": False, "return_token_ids": True}).json()
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]

    with httpx.stream(
        "POST",
        qwen_server.base_url + "/v1/chat/completions",
        timeout=120,
        json={**body, "max_tokens": 400, "ignore_eos": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # the client leaves after the first chunk
    again = _post(qwen_server, "/v1/chat/completions", body)
    assert again.status_code == 200 and sse_events(again.text)[-2]["choices"][0]["routed_experts"]
