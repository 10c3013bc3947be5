"""Scale out on real servers: two rr-patched vLLM CPU replicas, vllm-router 0.1.17 in front, and the multi-replica
client (200+ requests at 32 concurrent, one replica crashed mid-run and restarted). Routing is checked
against transformers' router top-k on every token."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.scale.conftest import Router, crash
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess
from tests.vllm.test_vllm_e2e import check_item

pytestmark = pytest.mark.vllm_server


def token_prompts(k: int, length: int = 8, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(2, 400, size=length)] for _ in range(k)]


def check_result(model_dir: Any, res: Any, prompt: list[int]) -> None:
    """One client result's routing equals transformers' top-k sets on every token and MoE layer."""
    assert res.routed_experts is not None
    ref = reference_routing(model_dir, prompt + res.output_ids)[:-1][res.routed_experts_start :]
    assert_routing_sets_equal(
        np.asarray(res.routed_experts), ref, layers=moe_layers_from_config(load_config(model_dir))
    )


# ------------------------------------------------------------------------------------ vllm-router


def test_router_rr_generate_routing_equals_transformers(router: Router, replicas: list[VLLMProcess]) -> None:
    """The recommended route: /rr/generate through vllm-router (forwarded intact), consistent_hash + a session header."""
    server = replicas[0]
    prompts = token_prompts(4, length=12, seed=1)
    for i, ids in enumerate(prompts):
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "seed": i},
            "return_routed_experts": True,
            "routed_experts_start": 3,
        }
        r = httpx.post(router.url + "/rr/generate", json=body, headers={"X-Session-ID": f"traj-{i}"}, timeout=120)
        assert r.status_code == 200, r.text
        items = r.json()
        assert len(items) == 2
        for item in items:
            check_item(server, item, ids, start=3)  # the start offset survived the router

    async def run() -> Any:
        async with RoutedExpertsClient(
            router.url, generate_path="/rr/generate", batch_size=2, headers={"X-Session-ID": "client"}
        ) as c:
            return await c.generate(prompts, {"max_new_tokens": 6, "temperature": 1.0, "n": 2})

    batch = asyncio.run(run())
    assert len(batch) == 8
    for res in batch:
        check_result(server.model_dir, res, prompts[res.prompt_index])


def test_router_generate_drops_the_flag_and_the_env_switch_covers_it(
    router: Router, replicas: list[VLLMProcess]
) -> None:
    """vllm-router's typed /generate drops return_routed_experts and the start offset; with
    RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS=1 on the replicas the answers still carry full routing."""
    ids = token_prompts(1, length=10, seed=2)[0]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_routed_experts": True,
        "routed_experts_start": 3,
    }
    r = httpx.post(router.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    item = r.json()
    item = item[0] if isinstance(item, list) else item
    assert item["meta_info"]["routed_experts_start"] == 0  # the router dropped the offset
    check_item(replicas[0], item, ids, start=0)


def test_router_keeps_openai_completions(router: Router) -> None:
    """/v1/completions with a token-id prompt goes through vllm-router (unknown fields kept)."""
    r = httpx.post(
        router.url + "/v1/completions",
        timeout=120,
        json={"model": "tiny-moe", "prompt": token_prompts(1, seed=3)[0], "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


# --------------------------------------------------------------------------- multi-replica client


def test_affinity_n_samples_and_trajectory_turns(replicas: list[VLLMProcess]) -> None:
    """All n samples of a prompt are one request to one replica; a trajectory's turns hit its prefix cache."""
    urls = [s.base_url for s in replicas]
    long_prompt = token_prompts(1, length=300, seed=4)[0]

    async def run() -> tuple[list[Any], list[Any], list[Any], str | None]:
        async with RoutedExpertsClient(urls, batch_size=1) as c:
            await c.info()
            before = [s.requests for s in c.replica_stats()]
            batch = await c.generate([long_prompt[:20]], {"max_new_tokens": 4, "n": 4, "temperature": 1.0})
            mid = [s.requests for s in c.replica_stats()]
            turns, ctx = [], list(long_prompt)
            for _ in range(3):
                b = await c.generate([ctx], {"max_new_tokens": 4, "temperature": 0}, affinity="traj-A")
                turns.append(b[0])
                ctx = ctx + b[0].output_ids + [7, 8]
            return [before, mid], list(batch), turns, c.replica_for("traj-A")

    (before, mid), samples, turns, pinned = asyncio.run(run())
    assert sorted(m - b for m, b in zip(mid, before)) == [0, 1]  # 4 samples, one request, one replica
    assert len(samples) == 4
    for res in samples:
        check_result(replicas[0].model_dir, res, long_prompt[:20])
    assert pinned in urls
    assert all(t.meta["cached_tokens"] > 0 for t in turns[1:]), [t.meta["cached_tokens"] for t in turns]


def test_multi_replica_crash_mid_run_no_loss_and_restart(replicas: list[VLLMProcess]) -> None:
    """240 requests at 32 concurrent over two replicas; one is SIGKILLed mid-run: 0 lost, 0 duplicated,
    0 mismatched, the survivor takes the load, and the restarted replica is taken back."""
    urls = [s.base_url for s in replicas]
    prompts = token_prompts(240, length=8, seed=5)
    victim = replicas[0]

    async def run() -> tuple[Any, Any, list[Any], list[Any], list[Any], Any]:
        async with RoutedExpertsClient(urls, batch_size=1, max_concurrency=32, probe_interval=0.5, timeout=120) as c:
            await c.info()
            job = asyncio.ensure_future(c.generate(prompts, {"max_new_tokens": 4, "temperature": 1.0}))
            # crash while the victim has requests in flight and most of the batch is still to come
            while (c.replica_stats()[0].in_flight < 4 or c.replica_stats()[0].requests < 20) and not job.done():
                await asyncio.sleep(0.005)
            assert not job.done(), "the batch finished before the crash: nothing was tested"
            before = c.replica_stats()  # the victim has requests in flight now
            await asyncio.to_thread(crash, victim)
            batch = await job
            after = c.replica_stats()
            await asyncio.to_thread(lambda: victim.launch().wait_healthy())  # same port: the same URL
            for _ in range(120):
                if c.replica_stats()[0].healthy:
                    break
                await asyncio.sleep(0.5)
            back = c.replica_stats()
            again = await c.generate(prompts[:40], {"max_new_tokens": 4, "temperature": 1.0})
            return batch, again, before, after, back, c.replica_stats()

    batch, again, before, after, back, final = asyncio.run(run())
    # 0 lost, 0 duplicated: one result per prompt, in order; 0 mismatched: every token's routing is right.
    assert [r.index for r in batch] == list(range(240)) and [r.prompt_index for r in batch] == list(range(240))
    for res in batch:
        check_result(victim.model_dir, res, prompts[res.prompt_index])
    assert after[0].healthy is False and after[0].taken_out == 1
    # the survivor took the load: at least the victim's requests in flight at the crash went to it
    assert after[1].requests - before[1].requests >= 1 and after[1].errors == 0
    assert back[0].healthy and back[0].taken_back == 1  # probed on /health and taken back
    assert final[0].requests > after[0].requests  # it serves again
    assert len(again) == 40
    for res in again:
        check_result(victim.model_dir, res, prompts[res.prompt_index])
