"""The client's side of routing provenance (issue 38): ``rr_provenance`` parsed into ``GenerateResult.provenance``
(``/generate``, OpenAI answers and streams), every malformed field named, the digest held to the sample's tokens;
``RoutingRef.provenance`` round trip; ``resolve(refs, tokens=...)`` binding a ref to its sample (HTTP and Ray);
trajectory turns' provenance and row spans.

The answers here come from a stand-in rr server (:func:`stand_in_app`: rr's real routing store and codec behind a
``/generate`` that echoes a scripted provenance), since what is tested is the client's parsing and binding; the
real servers' provenance is tested against the vLLM and SGLang engines in tests/vllm and tests/sglang.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import (
    ConfigurationError,
    GenerateBatch,
    Provenance,
    RoutedExpertsClient,
    StaleRoutingError,
    check_provenance,
    parse_sample,
    tokens_digest,
)
from rr_client.client._openai import parse_choices, parse_stream
from rr_client.client.trajectory import ChatTrajectory, Trajectory
from rr_client.core.codec import expected_rows, routing_meta_fields
from rr_client.core.errors import MalformedPayloadError, ProtocolError
from rr_client.core.reference import RoutingRef, check_ref_tokens
from rr_server.serving.store import STORE_ROUTES, MemoryStore
from rr_server.serving.store import install as rs
from tests.support.routing_data import checked_routing, small_moe_info

INFO = small_moe_info()
URL = "http://rr-stand-in.test"


checked = partial(checked_routing, INFO)  # rows (seed, start) of the small MoE, checked


def prov(prompt: list[int], output: list[int], **kw: Any) -> dict[str, Any]:
    """A provenance dict as a server answers it, bound to ``prompt`` + ``output``."""
    return Provenance(
        **{
            "weight_version_admitted": 2,
            "weight_version_finished": 2,
            "preemptions": 0,
            "tokens_digest": tokens_digest(prompt, output),
            **kw,
        }
    ).to_dict()


def reply(prompt: list[int], output: list[int], *, start: int = 0, provenance: Any = None, **meta: Any) -> dict:
    """One ``/generate`` entry with checked inline routing (and ``rr_provenance`` unless None)."""
    m: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        **routing_meta_fields(checked(expected_rows(len(prompt), len(output), start), start=start)),
        **meta,
    }
    if provenance is not None:
        m["rr_provenance"] = provenance
    return {"text": "x", "output_ids": output, "meta_info": m}


def parse(item: dict, prompt: list[int] | None, start: int = 0) -> Any:
    return parse_sample(item, index=0, prompt_index=0, prompt_ids=prompt, info=INFO, want_routing=True, start=start)


P, O = [5, 6, 7, 8], [9, 10, 11]


# ------------------------------------------------------------------ /generate


def test_generate_sample_carries_its_provenance_and_old_servers_none() -> None:
    r = parse(reply(P, O, provenance=prov(P, O, cached_tokens=3, cache_tier="device")), P)
    assert r.provenance == Provenance(
        cached_tokens=3,
        cache_tier="device",
        preemptions=0,
        weight_version_admitted=2,
        weight_version_finished=2,
        tokens_digest=tokens_digest(P, O),
    )
    assert parse(reply(P, O), P).provenance is None  # a server without provenance
    assert parse(reply(P, O, provenance=prov(P, O)), None).provenance is not None  # text prompt: not echoed
    # the prompt echoed by the server is what the digest is held to when the client sent text
    with pytest.raises(ProtocolError, match="sample 0: rr_provenance.tokens_digest"):
        parse(reply(P, O, provenance=prov(P, O[:-1] + [12]), prompt_token_ids=P), None)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("schema", "rr.provenance/0", "schema"),
        ("cached_tokens", -1, "cached_tokens"),
        ("cached_tokens", "3", "cached_tokens"),
        ("cache_tier", "gpu", "cache_tier"),
        ("preemptions", True, "preemptions"),
        ("weight_version_admitted", 1.5, "weight_version_admitted"),
        ("weight_version_finished", -2, "weight_version_finished"),
        ("weight_update_during", "no", "weight_update_during"),
        ("tokens_digest", "abc", "tokens_digest"),
        ("surprise", 1, "unknown fields"),
    ],
)
def test_each_malformed_provenance_field_is_named(field: str, value: Any, named: str) -> None:
    bad = {**prov(P, O), field: value}
    with pytest.raises(MalformedPayloadError, match=f"sample 0: rr_provenance.*{named}"):
        parse(reply(P, O, provenance=bad), P)
    with pytest.raises(MalformedPayloadError, match="must be an object"):
        parse(reply(P, O, provenance=[1]), P)


def test_provenance_of_another_sample_is_refused_naming_the_sample() -> None:
    swapped = prov([5, 6, 7], [8, 9, 10, 11])  # the same ids, split differently: another sample
    items = [reply(P, O, provenance=prov(P, O)), reply(P, O, provenance=swapped)]
    parse_sample(items[0], index=0, prompt_index=0, prompt_ids=P, info=INFO, want_routing=True)
    with pytest.raises(ProtocolError, match=r"sample 1: rr_provenance\.tokens_digest .* another sample"):
        parse_sample(items[1], index=1, prompt_index=0, prompt_ids=P, info=INFO, want_routing=True)


def test_batch_provenances_feed_the_stale_policy() -> None:
    stale = prov(P, O, preemptions=1, weight_version_finished=3)  # preempted across an update: recomputed
    spans = prov(P, O, weight_update_during=True)  # spans one without a recompute: kept, flagged
    items = [
        reply(P, O, provenance=prov(P, O)),
        reply(P, O, provenance=stale),
        reply(P, O, provenance=spans),
        reply(P, O),
    ]
    batch = GenerateBatch(
        [
            parse_sample(it, index=i, prompt_index=i, prompt_ids=P, info=INFO, want_routing=True)
            for i, it in enumerate(items)
        ],
        INFO,
    )
    assert [p is None for p in batch.provenances] == [False, False, False, True]
    with pytest.raises(StaleRoutingError, match="sample 1"):
        batch.check_provenance()
    got = batch.check_provenance("mask")
    assert got == check_provenance(batch.provenances, "mask")
    assert (got.replay, got.masked, got.spans_update, got.unknown) == ((True, False, True, True), 1, 1, 1)


# ------------------------------------------------------------------ OpenAI answers, streamed or not


def choice(prompt: list[int], output: list[int], index: int, provenance: Any) -> dict[str, Any]:
    c = {
        "index": index,
        "text": "t",
        "finish_reason": "length",
        "prompt_token_ids": prompt,
        "token_ids": output,
        **routing_meta_fields(checked(expected_rows(len(prompt), len(output), 0), seed=index)),
    }
    if provenance is not None:
        c["rr_provenance"] = provenance
    return c


def test_openai_choices_carry_provenance_and_a_swapped_one_is_named() -> None:
    o2 = [3, 4]
    answer = {"id": "cmpl-1", "choices": [choice(P, O, 0, prov(P, O, cached_tokens=2)), choice(P, o2, 1, None)]}
    got = parse_choices(answer, path="/v1/completions", info=INFO, want_routing=True, start=0, sent_prompt_ids=P)
    assert got[0].provenance is not None and got[0].provenance.cached_tokens == 2
    assert got[1].provenance is None
    answer["choices"][1]["rr_provenance"] = prov(P, O)  # choice 0's provenance on choice 1
    with pytest.raises(ProtocolError, match="/v1/completions choice 1: rr_provenance.tokens_digest"):
        parse_choices(answer, path="/v1/completions", info=INFO, want_routing=True, start=0, sent_prompt_ids=P)
    answer["choices"][1]["rr_provenance"] = {**prov(P, o2), "cache_tier": "disk"}
    with pytest.raises(MalformedPayloadError, match="choice 1: rr_provenance: cache_tier"):
        parse_choices(answer, path="/v1/completions", info=INFO, want_routing=True, start=0, sent_prompt_ids=P)


def test_stream_provenance_comes_on_the_routing_event() -> None:
    """Chat chunks (deltas, no routing), then the routing event with every choice's rr fields, then [DONE]."""
    final = choice(P, O, 0, prov(P, O, cached_tokens=4, cache_tier="host"))
    del final["text"]
    events = [
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "he"}}]},
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "y"}}]},
        {"id": "c", "choices": [final]},
        "[DONE]",
    ]
    (r,) = parse_stream(
        events, path="/v1/chat/completions", info=INFO, want_routing=True, start=0, sent_prompt_ids=None
    )
    assert r.text == "hey" and r.output_ids == O and r.routed_experts is not None
    assert r.provenance is not None and (r.provenance.cached_tokens, r.provenance.cache_tier) == (4, "host")
    with pytest.raises(ProtocolError, match="no token_ids"):
        parse_stream(
            events[:2] + ["[DONE]"],
            path="/v1/chat/completions",
            info=INFO,
            want_routing=True,
            start=0,
            sent_prompt_ids=None,
        )
    events[2] = {"id": "c", "choices": [{**final, "rr_provenance": prov(P, [1])}]}
    with pytest.raises(ProtocolError, match="choice 0: rr_provenance.tokens_digest"):
        parse_stream(events, path="/v1/chat/completions", info=INFO, want_routing=True, start=0, sent_prompt_ids=None)


# ------------------------------------------------------------------ refs: round trip and the binding


def test_ref_provenance_round_trips_and_old_refs_parse() -> None:
    store = MemoryStore(1 << 20, URL)
    old = store.put(checked(6))
    d = {k: v for k, v in old.items() if k != "provenance"}
    assert RoutingRef.from_dict(d).provenance is None
    assert "provenance" not in RoutingRef.from_dict(d).to_dict()  # a ref without it stays the old shape
    ref = RoutingRef.from_dict({**d, "provenance": prov(P, O, cached_tokens=1)})
    assert ref.provenance is not None and ref.provenance.cached_tokens == 1
    assert RoutingRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    assert ref.with_url("http://elsewhere").provenance == ref.provenance
    with pytest.raises(MalformedPayloadError, match="routed_experts_ref: provenance: preemptions"):
        RoutingRef.from_dict({**d, "provenance": {**prov(P, O), "preemptions": -1}})
    check_ref_tokens(ref, P, O)
    with pytest.raises(StaleRoutingError, match=f"routing ref {ref.key}"):
        check_ref_tokens(ref, P, O[:-1])
    check_ref_tokens(RoutingRef.from_dict(d), [1], [2])  # no digest: nothing to bind to


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> tuple[MemoryStore, Any]:
    """The stand-in server over httpx's ASGI transport, counting reads."""
    store = MemoryStore(1 << 20, URL)
    monkeypatch.setattr(rs, "_STORE", store)
    app = httpx.ASGITransport(app=stand_in_app(store))
    reads: list[int] = []

    async def counting(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/rr/routing/read":
            reads.append(len(json.loads(request.content)["refs"]))
        return await app.handle_async_request(request)

    transport: Any = httpx.MockTransport(counting)
    transport.reads = reads
    transport.script = []  # the provenance extras of each /generate call, in order
    app.app.state.script = transport.script
    return store, transport


def stand_in_app(store: MemoryStore) -> Any:
    """rr's routing store routes and ``/rr/info``, and a ``/generate`` (token-id prompts, n=1) that answers checked
    routing from ``routed_experts_start`` (inline or by reference) and the next scripted provenance, bound to the
    request's tokens: outputs are ``[100 + len(prompt), ...]`` (3 tokens)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def info(_: Any) -> Any:
        return JSONResponse(INFO.model_dump())

    async def generate(request: Request) -> Any:
        body = await request.json()
        start = body.get("routed_experts_start", 0)
        answers = []
        for prompt in body["input_ids"]:
            output = [100 + len(prompt) + i for i in range(3)]
            rows = checked(expected_rows(len(prompt), len(output), start), seed=len(prompt), start=start)
            extra = request.app.state.script.pop(0) if request.app.state.script else {}
            p = prov(prompt, output, **extra)
            meta: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": len(output), "rr_provenance": p}
            if body.get("routed_experts_format") == "ref":
                meta.update(
                    routed_experts_ref={**store.put(rows), "provenance": p},
                    routed_experts_shape=list(rows.array.shape),
                    routed_experts_start=start,
                )
            else:
                meta.update(routing_meta_fields(rows))
            answers.append({"text": "", "output_ids": output, "meta_info": meta})
        return JSONResponse(answers)

    return Starlette(
        routes=[
            Route("/rr/info", info),
            Route("/generate", generate, methods=["POST"]),
            *(Route(p, h, methods=list(m)) for p, h, m in STORE_ROUTES),
        ]
    )


def client(transport: Any) -> RoutedExpertsClient:
    return RoutedExpertsClient(URL, transport=transport, info=INFO)


def test_resolve_binds_each_ref_to_its_tokens_before_any_read(served: Any) -> None:
    _, transport = served
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    async def run() -> None:
        async with client(transport) as c:
            batch = await c.generate(prompts, {"max_new_tokens": 3}, by_reference=True)
            a, b = batch.results
            assert a.provenance == a.routing_ref.provenance and a.provenance is not None
            refs = [a.routing_ref, b.routing_ref]
            got = await c.resolve(refs, tokens=[(a.prompt_ids, a.output_ids), b])  # pairs or the samples
            assert [g.shape[0] for g in got] == [5, 6]
            with pytest.raises(StaleRoutingError, match=f"routing ref {b.routing_ref.key} \\(refs\\[0\\]\\)"):
                await c.resolve(refs[::-1], tokens=[a, b])  # bookkeeping that swapped two samples' rows
            assert transport.reads == [2]  # the refused call read nothing
            swapped = [a.with_routing(None), b.with_routing(None)]  # type: ignore[arg-type]
            from dataclasses import replace

            swapped[0] = replace(swapped[0], routing_ref=b.routing_ref)
            with pytest.raises(StaleRoutingError, match=b.routing_ref.key):
                await c.resolve_results(swapped)
            resolved = await c.resolve_results(batch.results)
            assert all(r.routed_experts is not None and r.provenance is not None for r in resolved)
            with pytest.raises(ProtocolError, match="3 token entries for 2 refs"):
                await c.resolve(refs, tokens=[a, b, None])

    asyncio.run(run())


def test_ray_refs_are_bound_before_ray_is_asked() -> None:
    """A ``ray://`` ref paired with another sample's tokens is refused before any Ray call (none runs here)."""
    ref = RoutingRef(
        store="s",
        url="ray://rr/store-0",
        key="k1",
        rows=5,
        layers=3,
        topk=2,
        dtype="uint8",
        start=0,
        weight_version=0,
        checksum="blake2b-128:00",
        provenance=Provenance(tokens_digest=tokens_digest(P, O)),
    )

    async def run() -> None:
        async with RoutedExpertsClient(URL, info=INFO) as c:
            await c.resolve([ref], tokens=[(P, [1, 2])])

    with pytest.raises(StaleRoutingError, match="routing ref k1"):
        asyncio.run(run())


# ------------------------------------------------------------------ trajectories: each turn's provenance and spans


@pytest.mark.parametrize("by_reference", [False, True])
def test_trajectory_turns_carry_provenance_and_row_spans(served: Any, by_reference: bool) -> None:
    _, transport = served
    transport.script.extend([{"cached_tokens": 0}, {"cached_tokens": 8, "cache_tier": "device"}])

    async def run() -> Any:
        async with client(transport) as c:
            traj = c.trajectory([1, 2, 3, 4, 5], by_reference=by_reference)
            await traj.generate({"max_new_tokens": 3})  # 5 prompt + 3 output: rows [0, 7)
            traj.extend([50, 51])  # tool tokens: the next prompt is 10 tokens
            await traj.generate({"max_new_tokens": 3})  # rows [7, 12): 10 prompt + 3 output - 1
            if by_reference:
                traj._ref_tokens[traj.routing_refs[1].key] = (traj.turns[0].prompt_ids, traj.turns[0].output_ids)
                with pytest.raises(StaleRoutingError, match=traj.routing_refs[1].key):
                    await traj.resolve()  # a turn's ref held to another turn's tokens
                traj._ref_tokens[traj.routing_refs[1].key] = (traj.turns[1].prompt_ids, traj.turns[1].output_ids)
                await traj.resolve()
            return traj

    traj = asyncio.run(run())
    assert traj.routed_experts.shape[0] == len(traj.input_ids) - 1 == 12
    s0, s1 = traj.turn_spans
    assert [p.cached_tokens for p in traj.provenances] == [0, 8]  # type: ignore[union-attr]
    assert (s0.rows, s0.cached_prompt, s0.computed_prompt, s0.generated) == ((0, 7), (0, 0), (0, 5), (5, 7))
    # turn 1 starts at row 7 (turn 0's last token): rows 7 from the cache (8 tokens), 8-9 computed, then generated
    assert (s1.rows, s1.cached_prompt, s1.computed_prompt, s1.generated) == ((7, 12), (7, 8), (8, 10), (10, 12))
    assert s1.provenance is traj.turns[1].provenance and s1.turn == 1
    # the spans tile each turn's rows, and the turns tile the trajectory's
    assert [s.rows for s in traj.turn_spans] == [(0, 7), (7, 12)]
    for s in traj.turn_spans:
        assert s.cached_prompt[0] == s.rows[0] and s.cached_prompt[1] == s.computed_prompt[0]
        assert s.computed_prompt[1] == s.generated[0] and s.generated[1] == s.rows[1]
    assert np.array_equal(traj.routed_experts[7:12], checked(12 - 7, seed=10, start=7).array)


def test_a_ref_whose_provenance_is_another_samples_is_refused_at_parse() -> None:
    store = MemoryStore(1 << 20, URL)
    rows = checked(expected_rows(len(P), len(O), 0))
    meta = {
        "prompt_tokens": len(P),
        "completion_tokens": len(O),
        "routed_experts_format": "ref",
        "routed_experts_ref": {**store.put(rows), "provenance": prov(P, O)},
    }
    item = {"output_ids": O, "meta_info": meta}
    r = parse_sample(item, index=0, prompt_index=0, prompt_ids=P, info=INFO, want_routing=True, by_reference=True)
    assert r.provenance == r.routing_ref.provenance and r.provenance is not None  # the ref's, when meta has none
    meta["routed_experts_ref"]["provenance"] = prov(P, [1, 2, 3])
    with pytest.raises(ProtocolError, match="sample 0: routed_experts_ref.provenance.tokens_digest"):
        parse_sample(item, index=0, prompt_index=0, prompt_ids=P, info=INFO, want_routing=True, by_reference=True)


def test_a_trajectory_turn_asking_for_several_continuations_is_refused() -> None:
    """``n`` other than 1 is refused before any request (a trajectory has one continuation per turn): by token ids and
    by chat messages alike; no client is reached (None here)."""
    traj = Trajectory(None, [1, 2, 3])  # type: ignore[arg-type]
    chat = ChatTrajectory(None, [{"role": "user", "content": "hi"}])  # type: ignore[arg-type]
    for turn in (traj.generate, chat.chat):
        with pytest.raises(ConfigurationError, match=r"one continuation \(n=1\)"):
            asyncio.run(turn({"n": 2}))
