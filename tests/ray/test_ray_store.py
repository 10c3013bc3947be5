"""The Ray routing store (``RR_ROUTING_STORE=ray``) on a local Ray cluster the test starts: the same contract as
the in-memory store (rows equal, evicted / retired / restarted / tampered refs are typed errors, never other
rows), and the real vLLM CPU server answering ``ray://`` refs that resolve to its inline rows."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient, RRInfo, RoutingChecksumError, RoutingExpiredError, RoutingRef
from rr_client.codec import check_routing
from rr_client.reference import checksum
from rr_server.serving.ray_store import RayRoutingStore
from tests.support.routing_data import make_routing

INFO = RRInfo.from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8,
                              "num_experts_per_tok": 2, "mlp_only_layers": [1]}, engine="test", engine_version="0")


def checked(rows: int, seed: int = 0) -> Any:
    ids = make_routing(rows, INFO.num_hidden_layers, INFO.topk, INFO.num_experts, moe_layers=INFO.moe_layers, seed=seed)
    return check_routing(ids, INFO, rows=rows)


def resolve(refs: list[RoutingRef]) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        async with RoutedExpertsClient("http://127.0.0.1:9", info=INFO) as c:  # ray:// refs: no HTTP at all
            return await c.resolve(refs)

    return asyncio.run(run())


def test_rows_through_rays_object_store(ray_cluster: str) -> None:
    store = RayRoutingStore(1 << 20, name="rr-test-store-a")
    want = [checked(n, seed=n) for n in (3, 9, 1)]
    refs = [RoutingRef.from_dict(store.put(c)) for c in want]
    assert all(r.url == "ray://rr/rr-test-store-a" for r in refs)
    got = resolve(refs)
    assert all(np.array_equal(g, w.array) for g, w in zip(got, want))
    st = store.stats()
    assert st["backend"] == "ray" and st["entries"] == 3 and st["read_bytes"] == sum(r.nbytes for r in refs)


def test_evicted_retired_restarted_and_tampered_refs_are_refused(ray_cluster: str) -> None:
    import ray

    one = checked(10).array.nbytes
    store = RayRoutingStore(2 * one, name="rr-test-store-b")
    refs = [RoutingRef.from_dict(store.put(checked(10, seed=i))) for i in range(3)]
    with pytest.raises(RoutingExpiredError, match="evicted"):
        resolve(refs[:1])
    assert np.array_equal(resolve(refs[2:])[0], checked(10, seed=2).array)
    lying = RoutingRef.from_dict({**refs[2].to_dict(), "checksum": checksum(checked(10, seed=7).array)})
    with pytest.raises(RoutingChecksumError):
        resolve([lying])
    assert store.retire(refs[2].weight_version)["retired"] == 2
    with pytest.raises(RoutingExpiredError, match="retired"):
        resolve(refs[2:])
    ray.kill(ray.get_actor("rr-test-store-b", namespace="rr"))  # the store actor goes away ...
    with pytest.raises(RoutingExpiredError, match="no such Ray routing store actor"):
        resolve(refs[1:2])
    again = RayRoutingStore(2 * one, name="rr-test-store-b")  # ... and a new one takes its name
    assert again.instance != store.instance
    with pytest.raises(RoutingExpiredError, match="restarted"):
        resolve(refs[1:2])


@pytest.mark.vllm_server
def test_real_vllm_server_answers_ray_refs(ray_cluster: str, tiny_models: dict[str, Any]) -> None:
    from tests.support.vllm_process import VLLMProcess

    server = VLLMProcess(tiny_models["qwen3_dense"], name="qwen3-ray-store",
                         env={"RR_ROUTING_STORE": "ray", "RR_RAY_ADDRESS": ray_cluster}).start()
    prompts = ["Hello world, this is a tiny test.", "1 2 3 4 5"]
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    try:
        async def run() -> None:
            async with RoutedExpertsClient(server.base_url) as c:
                inline = await c.generate(prompts, greedy)
                by_ref = await c.generate(prompts, greedy, by_reference=True)
                assert all(r.routing_ref.url.startswith("ray://rr/rr-routing-store-") for r in by_ref)
                resolved = await c.resolve_results(by_ref.results)
                for a, b in zip(inline, resolved):
                    assert a.output_ids == b.output_ids and np.array_equal(a.routed_experts, b.routed_experts)
                info = (await c._http_for(server.base_url).get(server.base_url + "/rr/info")).json()
                assert info["routing_store"]["backend"] == "ray" and info["routing_store"]["stored"] >= 2
                await c.retire(by_ref[0].routing_ref.weight_version)  # the server's route retires on the actor
                with pytest.raises(RoutingExpiredError, match="retired"):
                    await c.resolve_results(by_ref.results)

        asyncio.run(run())
    finally:
        server.stop()
