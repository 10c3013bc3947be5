"""The Ray routing store (``RR_ROUTING_STORE=ray``) on a local Ray cluster the test starts: the same contract as
the in-memory store (rows equal, evicted / retired / restarted / tampered refs are typed errors, never other
rows), one store per engine (its own cap and weight version, one ``ray.put`` per sample, gone when its engine
process stops), ``rr-server ray-stores``, and the real vLLM CPU server answering ``ray://`` refs that resolve to
its inline rows."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from typing import Any

import numpy as np
import pytest

from rr_client import RoutedExpertsClient, RoutingChecksumError, RoutingExpiredError, RoutingRef
from rr_client.core.reference import checksum
from rr_server.ray_stores import main as ray_stores
from rr_server.serving.store.ray import PREFIX, RayStore
from tests.support.routing_data import checked_routing, small_moe_info

INFO = small_moe_info()


checked = partial(checked_routing, INFO)  # rows (seed) of the small MoE, checked


def resolve(refs: list[RoutingRef]) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        async with RoutedExpertsClient("http://127.0.0.1:9", info=INFO) as c:  # ray:// refs: no HTTP at all
            return await c.resolve(refs)

    return asyncio.run(run())


def test_rows_through_rays_object_store(ray_cluster: str) -> None:
    store = RayStore(1 << 20, name="rr-test-store-a")
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
    store = RayStore(2 * one, name="rr-test-store-b")
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
    assert _gone("rr-test-store-b")
    again = RayStore(2 * one, name="rr-test-store-b")  # ... and a new one takes its name
    assert again.instance != store.instance
    with pytest.raises(RoutingExpiredError, match="restarted"):
        resolve(refs[1:2])


@pytest.mark.vllm_server
def test_real_vllm_server_answers_ray_refs(ray_cluster: str, tiny_models: dict[str, Any]) -> None:
    from tests.support.vllm_process import VLLMProcess

    server = VLLMProcess(
        tiny_models["qwen3_dense"],
        name="qwen3-ray-store",
        env={"RR_ROUTING_STORE": "ray", "RR_RAY_ADDRESS": ray_cluster},
    ).start()
    prompts = ["Hello world, this is a tiny test.", "1 2 3 4 5"]
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    try:

        async def run() -> str:
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
                return by_ref[0].routing_ref.url.rsplit("/", 1)[1]

        name = asyncio.run(run())
        assert name in _store_names()
    finally:
        server.stop()
    assert _gone(name), "the engine's store actor outlived the engine"


def test_one_ray_put_per_sample_and_the_actor_keeps_that_object(
    ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own ``ray.put`` is the only copy: the object the store actor hands readers is that one."""
    import ray

    store = RayStore(1 << 20, name="rr-test-store-put")
    made: list[Any] = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: made.append(real_put(value, **kw)) or made[-1])
    refs = [RoutingRef.from_dict(store.put(checked(5, seed=i))) for i in range(3)]
    assert len(made) == 3
    located = ray.get(
        ray.get_actor("rr-test-store-put", namespace="rr").locate.remote([(r.store, r.key) for r in refs])
    )
    assert [obj.hex() for obj, _ in located] == [m.hex() for m in made]
    assert [digest for _, digest in located] == [r.checksum for r in refs]
    store.close()


def test_each_engine_has_its_own_store_cap_and_weight_version(ray_cluster: str) -> None:
    one = checked(10).array.nbytes
    a, b = RayStore(2 * one), RayStore(8 * one)
    try:
        assert a.name != b.name and a.name.startswith(PREFIX) and a.instance != b.instance
        ra = [RoutingRef.from_dict(a.put(checked(10, seed=i))) for i in range(3)]
        rb = [RoutingRef.from_dict(b.put(checked(10, seed=i))) for i in range(3)]
        assert (a.stats()["max_bytes"], b.stats()["max_bytes"]) == (2 * one, 8 * one)
        assert (a.stats()["evicted"], b.stats()["evicted"]) == (1, 0)  # a's cap evicts only a's rows
        a.retire(ra[-1].weight_version)
        assert a.stats()["weight_version"] == 1 and b.stats()["weight_version"] == 0
        assert RoutingRef.from_dict(b.put(checked(4))).weight_version == 0
        assert len(resolve(rb)) == 3  # b's rows untouched by a's retire
    finally:
        a.close()
        b.close()


def _store_names() -> set[str]:
    import ray

    return {x["name"] for x in ray.util.list_named_actors(all_namespaces=True) if x["name"].startswith(PREFIX)}


def _gone(name: str, deadline_s: float = 60.0) -> bool:
    """Wait (up to a generous deadline, never asserted on) until Ray no longer lists the actor."""
    end = time.monotonic() + deadline_s
    while name in _store_names() and time.monotonic() < end:
        time.sleep(0.5)
    return name not in _store_names()


def _listed(name: str, deadline_s: float = 60.0) -> bool:
    """Wait (up to a generous deadline) until Ray lists the actor: a named actor registers asynchronously."""
    end = time.monotonic() + deadline_s
    while name not in _store_names() and time.monotonic() < end:
        time.sleep(0.2)
    return name in _store_names()


ENGINE = """
import sys, time
from rr_server.serving.store.ray import RayStore
s = RayStore(1 << 20)
print(s.name, flush=True)
if sys.argv[1] == "exit":
    sys.stdin.readline()  # exit once the test has seen the live store (exiting at once raced its check)
else:
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_the_store_goes_away_with_its_engine_process(ray_cluster: str, how: str) -> None:
    """A clean exit removes the store; a SIGKILLed engine's store is reclaimed by Ray (not detached)."""
    env = {**os.environ, "RR_RAY_ADDRESS": ray_cluster}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        name = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert name.startswith(PREFIX) and _listed(name)
        if how == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=120)
        assert _gone(name), f"{name} outlived its engine ({how})"
    finally:
        proc.kill()


class LegacyNodeStore:
    """Stand-in for rr's pre-0.1 store actor (that code is gone): detached, one per node, no ``describe``."""

    def locate(self, asks: list[Any]) -> list[Any]:
        return [[None, "legacy"] for _ in asks]


def test_ray_stores_command_lists_and_removes_leftovers(ray_cluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    legacy = f"{PREFIX}0123456789abcdef"
    ray.remote(LegacyNodeStore).options(name=legacy, namespace="rr", lifetime="detached", num_cpus=0).remote()
    live = RayStore(1 << 20)
    try:
        live.put(checked(3))
        assert ray_stores(["--address", ray_cluster, "--json"]) == 0
        listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)["stores"]}
        assert listed[legacy]["state"] == "legacy"
        assert listed[live.name]["state"] == "live" and listed[live.name]["entries"] == 1
        assert listed[live.name]["engine"]["pid"] == os.getpid()
        assert ray_stores(["--address", ray_cluster, "--remove-leftovers"]) == 0
        out = capsys.readouterr().out
        assert f"{legacy}  legacy  REMOVED" in out and f"{live.name}  live" in out
        assert _gone(legacy) and live.name in _store_names()
        assert ray_stores(["--address", ray_cluster, "--remove", "rr-routing-store-nope"]) == 1
        assert ray_stores(["--address", ray_cluster, "--remove", "my-actor"]) == 2  # never another actor
    finally:
        live.close()


def test_the_indexer_store_is_its_own_ray_actor_with_its_own_cap(
    ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``RR_ROUTING_STORE=ray`` the indexer store is a second store actor of the engine, capped by
    ``RR_INDEXER_STORE_BYTES``: indexer rows evict only indexer rows, routing rows stay readable."""
    from rr_client.core.indexer import IndexerDims, check_indexer
    from rr_server.serving.store import install as rs

    dims = IndexerDims((0, 1), 4)
    picks = np.tile(np.arange(4, dtype=np.int32), (12, 2, 1))  # tokens 4..15 each read positions 0..3
    one = check_indexer(picks, dims, rows=12, start=4).array.nbytes
    monkeypatch.setenv("RR_ROUTING_STORE", "ray")
    monkeypatch.setenv("RR_INDEXER_STORE_BYTES", str(2 * one))
    for name, value in (("_STORE", None), ("_INDEXER", None), ("_NAMED", False)):
        monkeypatch.setattr(rs, name, value)
    routing = rs.install_store(max_bytes=checked(10).array.nbytes + one // 2)
    idx = rs.indexer_store()
    try:
        assert isinstance(routing, RayStore) and isinstance(idx, RayStore) and idx.name != routing.name
        assert idx.stats()["max_bytes"] == 2 * one and idx.url.startswith("ray://")
        kept = RoutingRef.from_dict(routing.put(checked(10)))
        refs = [RoutingRef.from_dict(idx.put(check_indexer(picks, dims, rows=12, start=4))) for _ in range(3)]
        assert all(r.kind == "indexer" and r.store == idx.instance for r in refs)
        assert (idx.stats()["evicted"], routing.stats()["evicted"]) == (1, 0)
        assert np.array_equal(resolve([kept])[0], checked(10).array)
    finally:
        idx.close()  # type: ignore[union-attr]
        routing.close()  # type: ignore[attr-defined]
