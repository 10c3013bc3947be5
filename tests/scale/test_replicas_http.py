"""RoutedExpertsClient over several replicas, against TEST-ONLY protocol servers on loopback (no engine).

Least-in-flight choice, affinity, the /rr/info check, 5xx and crashed replicas taken out and back, no
result lost or duplicated, the generate path option; the sidecar's /rr/generate alias.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from rr_client import ReplicaMismatchError, RoutedExpertsClient
from tests.scale.replica_server import ReplicaServer
from tests.support.protocol_server import synthetic_routing

MAX_NEW = 4


@pytest.fixture
def pair() -> Iterator[tuple[ReplicaServer, ReplicaServer]]:
    a, b = ReplicaServer().start(), ReplicaServer().start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def expected_output(prompt: list[int], j: int = 0, n_new: int = MAX_NEW) -> list[int]:
    return [(sum(prompt) + 13 * j + 7 * i) % 250 + 1 for i in range(n_new)]


def check_results(batch: object, prompts: list[list[int]], n: int = 1) -> None:
    """Every prompt's n samples present once, in order, with its own tokens and routing."""
    results = batch.results  # type: ignore[attr-defined]
    assert len(results) == len(prompts) * n
    assert [r.index for r in results] == list(range(len(prompts) * n))
    for r in results:
        p = prompts[r.prompt_index]
        assert r.prompt_index == r.index // n
        assert r.output_ids == expected_output(p, r.index % n)
        ref = synthetic_routing((p + r.output_ids)[:-1], 3, 2, 8, [0, 1, 2])
        assert np.array_equal(r.routed_experts, ref)


def prompts_for(k: int) -> list[list[int]]:
    return [[1 + i % 200, 2 + i // 200, 3] for i in range(k)]


def stats_by_url(c: RoutedExpertsClient) -> dict[str, object]:
    return {s.url: s for s in c.replica_stats()}


async def test_one_url_and_a_list_of_one(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, _ = pair
    for base in (a.url, [a.url]):
        async with RoutedExpertsClient(base) as c:
            check_results(await c.generate(prompts_for(3), {"max_new_tokens": MAX_NEW}), prompts_for(3))
            assert c.urls == [a.url] and c.replica_stats()[0].requests >= 2


async def test_info_checked_on_every_replica() -> None:
    with ReplicaServer() as a, ReplicaServer(num_experts=16) as b:
        async with RoutedExpertsClient([a.url, b.url]) as c:
            with pytest.raises(ReplicaMismatchError, match=f"{b.url} serves num_experts=16"):
                await c.generate([[1, 2, 3]])
        assert a.behaviour.calls == b.behaviour.calls == 0  # nothing generated on a mixed pool


async def test_unreachable_replica_at_start_is_taken_out(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    b.crash()
    async with RoutedExpertsClient([a.url, b.url], retries=1, backoff=0.01, probe_interval=0.05) as c:
        check_results(await c.generate(prompts_for(6), {"max_new_tokens": MAX_NEW}), prompts_for(6))
        st = stats_by_url(c)
        assert st[b.url].healthy is False and st[a.url].healthy is True  # type: ignore[attr-defined]


async def test_least_in_flight_and_slow_replica_does_not_stall(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    a.behaviour.delay = 0.5  # a slow replica
    prompts = prompts_for(60)
    async with RoutedExpertsClient([a.url, b.url], batch_size=1, max_concurrency=4) as c:
        t0 = time.perf_counter()
        batch = await c.generate(prompts, {"max_new_tokens": MAX_NEW})
        wall = time.perf_counter() - t0
    check_results(batch, prompts)
    # The slow replica holds at most its share of the in-flight slots; the fast one serves the rest.
    assert a.behaviour.calls + b.behaviour.calls == 60
    assert b.behaviour.calls >= 50, (a.behaviour.calls, b.behaviour.calls)
    assert wall < 0.5 * 60 / 4 / 2, wall  # far below what a fair split (30 x 0.5 s / slots) would take


async def test_n_samples_and_affinity_stay_on_one_replica(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    async with RoutedExpertsClient([a.url, b.url], batch_size=1) as c:
        batch = await c.generate([[5, 6, 7]], {"max_new_tokens": MAX_NEW, "n": 4})
        check_results(batch, [[5, 6, 7]], n=4)
        assert sorted((a.behaviour.calls, b.behaviour.calls)) == [0, 1]  # the 4 samples: one request
        before = {s.url: s.requests for s in c.replica_stats()}
        turns = [[5, 6, 7]]
        for t in range(6):  # one trajectory's turns, with unrelated traffic between them
            await asyncio.gather(
                c.generate(turns[-1] + [8 + t], {"max_new_tokens": MAX_NEW}, affinity="traj-1"),
                c.generate(prompts_for(4), {"max_new_tokens": MAX_NEW}),
            )
            turns.append(turns[-1] + [8 + t])
        pinned = c.replica_for("traj-1")
        assert pinned in (a.url, b.url)
        other = b.url if pinned == a.url else a.url
        bodies = (a if pinned == a.url else b).behaviour.bodies
        assert sum(1 for body in bodies if len(body["input_ids"][0]) > 3) == 6  # every turn on the pinned one
        after = {s.url: s.requests for s in c.replica_stats()}
        assert after[other] > before[other]  # the other traffic was still spread


async def test_5xx_replica_taken_out_probed_and_taken_back(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    a.behaviour.fail_5xx = 10**6
    prompts = prompts_for(40)
    async with RoutedExpertsClient([a.url, b.url], batch_size=1, probe_interval=0.05, backoff=0.01) as c:
        check_results(await c.generate(prompts, {"max_new_tokens": MAX_NEW}), prompts)
        st = stats_by_url(c)[a.url]
        assert st.healthy is False and st.taken_out == 1 and st.errors >= 1  # type: ignore[attr-defined]
        assert a.health_calls >= 0
        a.behaviour.fail_5xx = 0
        for _ in range(100):
            if stats_by_url(c)[a.url].healthy:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.02)
        st = stats_by_url(c)[a.url]
        assert st.healthy and st.taken_back == 1 and a.health_calls >= 1  # type: ignore[attr-defined]
        served_before = a.behaviour.calls
        check_results(await c.generate(prompts, {"max_new_tokens": MAX_NEW}), prompts)
        assert a.behaviour.calls - served_before >= 10  # it takes load again


async def test_crash_mid_run_no_loss_no_duplicate_and_restart(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    a.behaviour.delay = b.behaviour.delay = 0.02
    prompts = prompts_for(240)
    async with RoutedExpertsClient(
        [a.url, b.url], batch_size=1, max_concurrency=32, probe_interval=0.05, backoff=0.01
    ) as c:
        run = asyncio.ensure_future(c.generate(prompts, {"max_new_tokens": MAX_NEW}))
        while a.behaviour.calls < 40:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(a.crash)  # requests in flight on a break; the rest must go to b
        a_served = a.behaviour.calls
        batch = await run
        check_results(batch, prompts)  # 0 lost, 0 duplicated, 0 mismatched
        st = stats_by_url(c)
        assert st[a.url].healthy is False and st[a.url].taken_out == 1  # type: ignore[attr-defined]
        assert b.behaviour.calls >= 240 - a_served  # the survivor took the rest

        restarted = ReplicaServer(port=a.port).start()  # the same URL comes back
        try:
            for _ in range(200):
                if stats_by_url(c)[a.url].healthy:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.02)
            assert stats_by_url(c)[a.url].taken_back == 1  # type: ignore[attr-defined]
            check_results(await c.generate(prompts[:40], {"max_new_tokens": MAX_NEW}), prompts[:40])
            assert restarted.behaviour.calls >= 10
        finally:
            restarted.stop()


async def test_all_replicas_down_raises_transport_error(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    from rr_client import TransportError

    a, b = pair
    async with RoutedExpertsClient([a.url, b.url], retries=1, backoff=0.01, probe_interval=0.05) as c:
        await c.info()
        a.crash()
        b.crash()
        with pytest.raises(TransportError):
            await c.generate([[1, 2, 3]])
        assert all(s.errors >= 1 for s in c.replica_stats())


async def test_4xx_is_not_failed_over(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    from rr_client import RequestRejectedError

    a, b = pair
    async with RoutedExpertsClient([a.url, b.url]) as c:
        with pytest.raises(RequestRejectedError):
            await c.generate([[1, 2, 3]], {"max_new_tokens": -1})
        assert a.behaviour.calls + b.behaviour.calls == 1
        assert all(s.healthy and s.errors == 0 for s in c.replica_stats())


async def test_generate_path_option(pair: tuple[ReplicaServer, ReplicaServer]) -> None:
    a, b = pair
    async with RoutedExpertsClient([a.url, b.url], generate_path="/rr/generate", batch_size=1) as c:
        check_results(await c.generate(prompts_for(4), {"max_new_tokens": MAX_NEW}), prompts_for(4))
    assert a.alias_calls + b.alias_calls == 4
    with pytest.raises(ValueError):
        RoutedExpertsClient(a.url, generate_path="rr/generate")


def test_sidecar_serves_rr_generate_behind_its_keys(tmp_path: object) -> None:
    """The sidecar's /rr/generate is /generate: same answer, same API-key rule."""
    from rr_server.proxy.app import ProxyConfig
    from tests.support.fake_upstreams import FakeVLLMUpstream, write_fake_config
    from tests.support.proxy_harness import SidecarServer

    cfg_dir = write_fake_config(tmp_path)  # type: ignore[arg-type]
    with (
        FakeVLLMUpstream(cfg_dir) as fake,
        SidecarServer(ProxyConfig(upstream=fake.url, engine="vllm", timeout=10, api_keys=("k1",))) as sc,
    ):
        body = {"input_ids": [5, 9, 14], "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
        auth = {"authorization": "Bearer k1"}
        plain = httpx.post(sc.url + "/generate", json=body, headers=auth, timeout=10)
        alias = httpx.post(sc.url + "/rr/generate", json=body, headers=auth, timeout=10)
        assert plain.status_code == alias.status_code == 200

        def strip(j: dict) -> dict:
            return {**j, "meta_info": {k: v for k, v in j["meta_info"].items() if k not in ("id", "e2e_latency")}}

        assert strip(plain.json()) == strip(alias.json())
        assert httpx.post(sc.url + "/rr/generate", json=body, timeout=10).status_code == 401
