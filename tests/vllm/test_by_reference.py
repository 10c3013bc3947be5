"""Routing by reference on the real vLLM 0.30 CPU server (``rr-server launch vllm``): the answer carries a
:class:`RoutingRef`, the rows stay in the server's store, and resolving them gives exactly the inline answer's
rows, which are transformers' own router top-k; retired and restarted refs are typed errors, never other rows."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import MissingRoutingError, RoutedExpertsClient, RoutingExpiredError, RoutingRef
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_client.core.reference import decode_frame
from rr_server.demo.tiny_moe import reference_routing
from rr_server.serving.store import MAX_REFS_PER_READ
from tests.support.routing_asserts import assert_routing_sets_equal

pytestmark = pytest.mark.vllm_server

PROMPTS = ["Hello world, this is a tiny test.", "Once upon a time there was a router.", "1 2 3 4 5"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


def store_stats(server: Any) -> dict[str, Any]:
    return httpx.get(server.base_url + "/rr/info", timeout=30).json()["routing_store"]


def test_rows_by_reference_equal_the_inline_answer_and_transformers(qwen_server: Any) -> None:
    moe = moe_layers_from_config(load_config(qwen_server.model_dir))

    async def run() -> tuple[Any, Any, list[Any], int]:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            inline = await c.generate(PROMPTS, GREEDY)
            by_ref = await c.generate(PROMPTS, GREEDY, by_reference=True)
            resolved = await c.resolve_results(by_ref.results)
            return inline, by_ref, resolved, c.routing_bytes_resolved

    before = store_stats(qwen_server)
    inline, by_ref, resolved, nbytes = asyncio.run(run())
    for a, r, b in zip(inline, by_ref, resolved):
        assert r.routed_experts is None and isinstance(r.routing_ref, RoutingRef)
        assert r.routing_ref.url == qwen_server.base_url  # the server names itself
        assert (
            len(json.dumps(r.routing_ref.to_dict())) <= 768
        )  # what the controller moves per sample (with its provenance)
        assert b.output_ids == a.output_ids and b.prompt_ids == a.prompt_ids
        assert np.array_equal(b.routed_experts, a.routed_experts) and b.routed_experts.dtype == np.uint8
        truth = reference_routing(qwen_server.model_dir, list(a.prompt_ids) + list(a.output_ids))[:-1]
        assert_routing_sets_equal(b.routed_experts, truth, layers=moe)
    # transport: exactly the rows' bytes (1 byte per uint8 entry) in the frames' data
    assert nbytes == sum(r.routing_ref.nbytes for r in by_ref) == sum(a.routed_experts.size for a in inline)
    after = store_stats(qwen_server)
    assert after["stored"] - before["stored"] == len(PROMPTS)
    assert after["read_bytes"] - before["read_bytes"] == nbytes
    # one key named 500 times in one read: its rows sent once, every entry the same checked rows
    ref = by_ref[0].routing_ref
    r = httpx.post(
        qwen_server.base_url + "/rr/routing/read",
        timeout=60,
        json={"refs": [{"store": ref.store, "key": ref.key}] * 500},
    )
    parts = decode_frame(r.content)
    assert len(parts) == 500 and len(r.content) == 8 + struct.unpack_from("<Q", r.content)[0] + ref.nbytes
    assert all(p.digest == ref.checksum and np.array_equal(p.rows, inline[0].routed_experts) for p in parts)


def test_retired_refs_are_refused_and_later_ones_read(qwen_server: Any) -> None:
    async def run() -> None:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            old = await c.generate(PROMPTS[:1], GREEDY, by_reference=True)
            version = old[0].routing_ref.weight_version
            r = httpx.post(qwen_server.base_url + "/rr/routing/retire", json={"through": version}, timeout=30)
            assert r.status_code == 200 and r.json()["weight_version"] == version + 1
            with pytest.raises(RoutingExpiredError, match="retired with weight version"):
                await c.resolve_results(old.results)
            new = await c.generate(PROMPTS[:1], GREEDY, by_reference=True)
            # a ref carries the engine's weight version at its request's admission (no weights were pushed),
            # not the store's retire counter: rows made under weights <= V go with a retire through V
            info = httpx.get(qwen_server.base_url + "/rr/info", timeout=30).json()
            assert new[0].routing_ref.weight_version == info["weight_version"] == version
            (rows,) = await c.resolve([new[0].routing_ref])
            assert rows.shape[0] == new[0].routing_ref.rows
            gone = RoutingRef.from_dict({**new[0].routing_ref.to_dict(), "store": "0" * 32})  # a restarted server
            with pytest.raises(RoutingExpiredError, match="restarted"):
                await c.resolve([gone])

    asyncio.run(run())
    assert store_stats(qwen_server)["expired_reads"] >= 2


def test_read_route_refuses_bad_requests_and_keeps_serving(qwen_server: Any) -> None:
    r = httpx.post(qwen_server.base_url + "/rr/routing/read", content=b"{}", timeout=30)
    assert r.status_code == 400 and "refs" in r.json()["error"]["message"]
    r = httpx.post(
        qwen_server.base_url + "/rr/routing/read",
        timeout=30,
        json={"refs": [{"store": "s", "key": "k"}] * (MAX_REFS_PER_READ + 1)},
    )
    assert r.status_code == 413 and f"at most {MAX_REFS_PER_READ}" in r.json()["error"]["message"]
    r = httpx.post(
        qwen_server.base_url + "/generate",
        json={"text": "hi", "return_routed_experts": True, "routed_experts_format": "base64"},
        timeout=60,
    )
    assert r.status_code == 400
    assert httpx.get(qwen_server.base_url + "/health", timeout=30).status_code == 200


def test_through_the_sidecar_in_front_of_the_engine(qwen_server: Any) -> None:
    """The sidecar checks the engine's inline routing once, keeps it and answers refs; its /metrics count them."""
    from rr_server.proxy.app import ProxyConfig
    from tests.support.proxy_harness import SidecarServer

    cfg = ProxyConfig(upstream=qwen_server.base_url, engine="vllm", timeout=120, model_path=str(qwen_server.model_dir))

    async def run(url: str) -> tuple[Any, list[Any]]:
        async with RoutedExpertsClient(url) as c:
            inline = await c.generate(PROMPTS, GREEDY)
            by_ref = await c.generate(PROMPTS, GREEDY, by_reference=True)
            assert all(r.routing_ref is not None and r.routed_experts is None for r in by_ref)
            return inline, await c.resolve_results(by_ref.results)

    with SidecarServer(cfg) as sc:
        inline, resolved = asyncio.run(run(sc.url))
        for a, b in zip(inline, resolved):
            assert b.output_ids == a.output_ids and np.array_equal(b.routed_experts, a.routed_experts)
        metrics = httpx.get(sc.url + "/metrics", timeout=30).text
        info = httpx.get(sc.url + "/rr/info", timeout=30).json()
    assert info["routing_store"]["read_bytes"] >= sum(a.routed_experts.size for a in inline)
    read = next(line for line in metrics.splitlines() if line.startswith("rr_routing_store_read_bytes_total"))
    assert float(read.split()[-1]) >= sum(a.routed_experts.size for a in inline)


def _tool_ids(server: Any, turn: int) -> list[int]:
    from tests.vllm.test_openai_agentic import _tool_tokens

    return _tool_tokens(server, f" tool says {turn}: 1 2 3 4 5")


def test_multi_turn_trajectory_by_reference_reads_each_turns_new_rows_once(qwen_server: Any) -> None:
    """Per-turn refs, each covering only that turn's new rows; resolved, the conversation's rows equal the inline
    trajectory's (same seeds) and transformers' top-k of the whole conversation."""
    from tests.vllm.test_vllm_e2e import tokenize

    params = {"max_new_tokens": 8, "temperature": 0.8, "seed": 11}
    prompt = tokenize(qwen_server.model_dir, "Once upon a time there was a router.")
    moe = moe_layers_from_config(load_config(qwen_server.model_dir))

    async def run(by_reference: bool) -> tuple[Any, int]:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            traj = c.trajectory(prompt, by_reference=by_reference)
            for turn in range(3):
                await traj.generate(params)
                if turn < 2:
                    traj.extend(_tool_ids(qwen_server, turn))
            if by_reference:
                refs = traj.routing_refs
                assert len(refs) == 3 and sum(r.rows for r in refs) == len(traj.input_ids) - 1
                with pytest.raises(MissingRoutingError, match="held by reference"):
                    traj.routed_experts  # noqa: B018 - not readable before resolve
                await traj.resolve()
                assert not traj.routing_refs
            return traj, c.routing_bytes_resolved

    inline, _ = asyncio.run(run(False))
    by_ref, nbytes = asyncio.run(run(True))
    assert by_ref.input_ids == inline.input_ids and by_ref.loss_mask == inline.loss_mask
    assert np.array_equal(by_ref.routed_experts, inline.routed_experts)
    assert nbytes == by_ref.routed_experts.size  # every row of the conversation read exactly once
    truth = reference_routing(qwen_server.model_dir, by_ref.input_ids)[:-1]
    assert_routing_sets_equal(by_ref.routed_experts, truth, layers=moe)


def test_two_replicas_each_ref_read_from_the_replica_that_made_it(qwen_server: Any) -> None:
    """Two engine replicas behind one client: each ref names its own server, resolves from it, and a ref sent to
    the other replica is refused (another store instance), never answered with that replica's rows."""
    from tests.vllm.conftest import start_server

    second = start_server("qwen3_dense", qwen_server.model_dir, core=1).wait_healthy()
    try:

        async def run() -> None:
            async with RoutedExpertsClient([qwen_server.base_url, second.base_url], batch_size=1) as c:
                inline = await c.generate(PROMPTS * 2, GREEDY)
                by_ref = await c.generate(PROMPTS * 2, GREEDY, by_reference=True)
                urls = {r.routing_ref.url for r in by_ref}
                assert urls == {qwen_server.base_url, second.base_url}, urls  # both replicas served
                resolved = await c.resolve_results(by_ref.results)
                for a, b in zip(inline, resolved):
                    assert a.output_ids == b.output_ids and np.array_equal(a.routed_experts, b.routed_experts)
                ref = by_ref[0].routing_ref
                wrong = ref.with_url(second.base_url if ref.url == qwen_server.base_url else qwen_server.base_url)
                with pytest.raises(RoutingExpiredError, match="another server"):
                    await c.resolve([wrong])

        asyncio.run(run())
    finally:
        second.stop()


def test_openai_endpoints_by_reference(qwen_server: Any) -> None:
    """``routed_experts_format: "ref"`` on vLLM's own /v1/completions and /v1/chat/completions (rr's middleware)."""

    async def run() -> None:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            for call in (
                lambda **kw: c.complete(PROMPTS[0], GREEDY, **kw),
                lambda **kw: c.chat([{"role": "user", "content": PROMPTS[1]}], GREEDY, **kw),
            ):
                inline = await call()
                by_ref = await call(by_reference=True)
                assert by_ref[0].routed_experts is None and by_ref[0].routing_ref is not None
                (b,) = await c.resolve_results(by_ref.results)
                assert b.output_ids == inline[0].output_ids
                assert np.array_equal(b.routed_experts, inline[0].routed_experts)

    asyncio.run(run())
