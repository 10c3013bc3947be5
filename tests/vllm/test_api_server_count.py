"""``rr-server launch vllm ... --api-server-count 2`` on a real vLLM CPU server: vLLM's own ``serve`` runs two API
server processes in front of one engine, and rr's routes are in both; refs made by either process resolve
through either (the processes answer for each other's routing stores).

vLLM's ``api_server`` module (the launcher's default command) serves one process and ignores the flag; the
launcher therefore runs vLLM's ``serve`` for it (``rr_server.launch.vllm_serve``). Routing values are compared with
transformers' router top-k.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client import RoutedExpertsClient, RoutingExpiredError
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.support.prom import rr_samples
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import STARTUP_TIMEOUT_S, VLLMProcess

pytestmark = pytest.mark.vllm_server


@pytest.fixture(scope="module")
def two_api_servers(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    server = VLLMProcess(
        tiny_models["qwen3_dense"],
        name="qwen3-asc2",
        extra=["--api-server-count", "2"],
        # vLLM writes each line's "(ApiServer_k pid=N) " prefix in its own write(); unbuffered (-u, as CI runs),
        # two processes' writes interleave and a line can carry the other's prefix. Buffered, the log handler's
        # flush writes prefix and line in one append, so the per-process lines below are attributable.
        env={"VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "", "VLLM_SERVER_DEV_MODE": "1"},  # dev: /pause, reload
    ).start()
    try:
        wait_for_both_processes(server)
        yield server
    finally:
        server.stop()


def wait_for_both_processes(server: VLLMProcess) -> None:
    """``/health`` answers once one API server process listens; wait (bounded) until both say they started."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    started: set[str] = set()
    while time.monotonic() < deadline:
        log = server.log_path.read_text(errors="replace")
        started = set(re.findall(r"\((ApiServer_\d) pid=\d+\) INFO:\s+Application startup complete", log))
        if started == {"ApiServer_0", "ApiServer_1"}:
            return
        assert server.proc is not None and server.proc.poll() is None, "the server exited"
        time.sleep(0.5)
    pytest.fail(f"only {sorted(started)} of two API server processes started in {STARTUP_TIMEOUT_S:.0f} s")


def test_every_api_server_process_serves_rr(two_api_servers: VLLMProcess) -> None:
    """Both API server processes load rr's endpoint plugin, list its routes and answer ``/generate``; 24 requests
    on fresh connections all get routing equal to transformers' top-k."""
    log = two_api_servers.log_path.read_text(errors="replace")
    for k in (0, 1):
        assert re.search(rf"\(ApiServer_{k} pid=\d+\).*Loaded endpoint plugin rr", log), f"ApiServer_{k}: no rr"
        assert re.search(rf"\(ApiServer_{k} pid=\d+\).*Route: /rr/info", log), f"ApiServer_{k}: no /rr/info"

    prompts = [[7 + i, 19, 23 + 2 * i, 41, 5 + i] for i in range(24)]

    async def run() -> list[object]:
        async def one(p: list[int]) -> object:
            async with RoutedExpertsClient(two_api_servers.base_url) as c:  # a fresh connection each
                return (await c.generate([p], {"max_new_tokens": 4, "temperature": 0.0})).results[0]

        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run())
    moe = moe_layers_from_config(load_config(two_api_servers.model_dir))
    for p, res in zip(prompts, results):
        ref = reference_routing(two_api_servers.model_dir, p + list(res.output_ids))[:-1]  # type: ignore[attr-defined]
        assert_routing_sets_equal(np.asarray(res.routed_experts), ref, layers=moe)  # type: ignore[attr-defined]
    info = httpx.get(two_api_servers.base_url + "/rr/info", timeout=30).json()
    assert info["engine"] == "vllm" and info["routing_enabled"] is True

    def served() -> set[str]:
        """API server processes whose access log shows a POST /generate answered 200."""
        text = two_api_servers.log_path.read_text(errors="replace")
        return set(re.findall(r"\((ApiServer_\d) pid=\d+\).*\"POST /generate HTTP/1.1\" 200", text))

    for _ in range(10):  # the kernel hands connections to either process; more requests until both answered
        if served() == {"ApiServer_0", "ApiServer_1"}:
            break
        for p in prompts[:8]:
            assert (
                httpx.post(
                    two_api_servers.base_url + "/generate",
                    timeout=60,
                    json={
                        "input_ids": p,
                        "sampling_params": {"max_new_tokens": 2},
                        "return_routed_experts": True,
                    },
                ).status_code
                == 200
            )
    assert served() == {"ApiServer_0", "ApiServer_1"}, "both API server processes answer rr's /generate"


def test_rr_counters_sum_over_both_api_server_processes(two_api_servers: VLLMProcess) -> None:
    """With two API servers vLLM serves ``/metrics`` from ``PROMETHEUS_MULTIPROC_DIR`` (the sum over processes):
    rr's counters, made in each process after vLLM set that directory, move by exactly the samples both sent."""
    url = two_api_servers.base_url

    def metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        r = httpx.get(url + "/metrics", timeout=30)
        assert r.status_code == 200 and "vllm:" in r.text
        return rr_samples(r.text)

    def answered() -> dict[str, int]:
        """POST /generate answered 200, per API server process, from the access log."""
        text = two_api_servers.log_path.read_text(errors="replace")
        found = re.findall(r"\((ApiServer_\d) pid=\d+\).*\"POST /generate HTTP/1.1\" 200", text)
        return {k: found.count(k) for k in ("ApiServer_0", "ApiServer_1")}

    def both_served(start: dict[str, int]) -> bool:
        now = answered()
        return all(now[k] > start[k] for k in start)

    def post(i: int) -> dict[str, Any]:
        r = httpx.post(
            url + "/generate",
            timeout=120,
            json={
                "input_ids": [11 + i % 7, 19, 23],
                "sampling_params": {"max_new_tokens": 2},
                "return_routed_experts": True,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]  # type: ignore[no-any-return]

    before, start = metrics(), answered()
    metas: list[dict[str, Any]] = []
    # fresh connections, 8 at a time: both processes wait on the one listening socket and the first awake accepts,
    # so a burst reaches the second even when a loaded machine keeps waking the same one first
    with ThreadPoolExecutor(8) as pool:
        for burst in range(10):
            metas += pool.map(post, range(8 * burst, 8 * burst + 8))
            if both_served(start):
                break
    assert both_served(start), "both API server processes answered"
    after = metrics()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert moved == {
        ("rr_routing_samples_total", (("format", "npy"),)): len(metas),
        ("rr_routing_rows_total", (("format", "npy"),)): sum(m["routed_experts_shape"][0] for m in metas),
        ("rr_routing_bytes_total", (("format", "npy"),)): sum(len(m["routed_experts"]) for m in metas),
    }


def test_every_ref_resolves_through_either_api_server_process(two_api_servers: VLLMProcess) -> None:
    """A 16-sample batch by reference, made by both processes: every ref resolves, twice, in one read per call
    and one read per ref (fresh connections: the kernel hands each to either process), to transformers' top-k;
    the rows retire from both processes at once."""
    url = two_api_servers.base_url
    prompts = [[3 + i, 17, 29 + i, 41] for i in range(16)]

    async def made() -> list[Any]:
        async def one(p: list[int]) -> Any:
            async with RoutedExpertsClient(url) as c:  # a fresh connection each: both processes make refs
                return (await c.generate([p], {"max_new_tokens": 3, "temperature": 0.0}, by_reference=True)).results[0]

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def resolve(results: list[Any], per_ref: bool) -> list[np.ndarray]:
        if not per_ref:
            async with RoutedExpertsClient(url) as c:
                return [r.routed_experts for r in await c.resolve_results(results)]
        out = []
        for r in results:
            async with RoutedExpertsClient(url) as c:
                out.append((await c.resolve_results([r]))[0].routed_experts)
        return out

    results = asyncio.run(made())
    for _ in range(5):  # the kernel picks the process per connection: more batches until both made refs
        if len({r.routing_ref.store for r in results}) == 2:
            break
        results = asyncio.run(made())
    assert len({r.routing_ref.store for r in results}) == 2, "both API server processes made refs"
    moe = moe_layers_from_config(load_config(two_api_servers.model_dir))
    want = [reference_routing(two_api_servers.model_dir, p + list(r.output_ids))[:-1] for p, r in zip(prompts, results)]
    for per_ref in (False, True):
        for _ in range(2):
            for got, ref in zip(asyncio.run(resolve(results, per_ref)), want):
                assert_routing_sets_equal(np.asarray(got), ref, layers=moe)
    store = httpx.get(url + "/rr/info", timeout=30).json()["routing_store"]
    assert store["processes"] == 2 and store["sibling_reads"] > 0 and store["entries"] >= 16

    async def retire() -> None:
        async with RoutedExpertsClient(url) as c:
            await c.retire(max(r.routing_ref.weight_version for r in results))
            with pytest.raises(RoutingExpiredError, match="retired"):
                await c.resolve_results(results)

    asyncio.run(retire())
    assert httpx.get(url + "/rr/info", timeout=30).json()["routing_store"]["entries"] == 0
    log = two_api_servers.log_path.read_text(errors="replace")
    assert "routing refs name http://127.0.0.1:" in log and "RR_ADVERTISE_URL" in log  # the loopback, said


def test_one_weight_epoch_over_both_api_server_processes(two_api_servers: VLLMProcess) -> None:
    """A reload sent to one API server process is counted by both: requests admitted through either before it and
    answered after it say they span it, their refs carry the version they were admitted under, and every process
    answers the new version. The requests are frozen in the engine (dev-mode ``/pause?mode=keep``, sent while
    paused) until ``/rr/info`` ``requests_in_engine`` (summed over the processes) holds them all, so each spans the
    reload by construction; rounds go on until both processes admitted some (the kernel picks the process)."""
    url = two_api_servers.base_url
    model = str(two_api_servers.model_dir.resolve())
    v0 = httpx.get(url + "/rr/info", timeout=30).json()["weight_version"]

    async def round_(k: int) -> list[Any]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200

            async def one(i: int) -> Any:
                async with RoutedExpertsClient(url) as c:  # a fresh connection each: either process admits it
                    p = [5 + i, 17, 29 + k, 41]
                    return (await c.generate([p], {"max_new_tokens": 3}, by_reference=True)).results[0]

            tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
            for _ in range(3000):
                if (await http.get("/rr/info")).json()["requests_in_engine"] == len(tasks):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the paused engine never held all 16 requests")
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": model}}  # the same weights, counted
            assert (await http.post("/collective_rpc", json=rpc)).status_code == 200
            assert (await http.post("/resume")).status_code == 200
            return list(await asyncio.gather(*tasks))

    results: list[Any] = []
    for k in range(4):
        got = asyncio.run(round_(k))
        for r in got:  # admitted under this round's version, answered under the next: through either process
            p = r.provenance
            assert (p.weight_version_admitted, p.weight_version_finished) == (v0 + k, v0 + k + 1), (k, p)
            assert p.spans_update and r.routing_ref.weight_version == v0 + k
        results += got
        if len({r.routing_ref.store for r in results}) == 2:
            break
    assert len({r.routing_ref.store for r in results}) == 2, "both API server processes admitted requests"
    seen = {httpx.get(url + "/rr/info", timeout=30).json()["weight_version"] for _ in range(16)}
    assert seen == {v0 + k + 1}, seen  # fresh connections: either process answers, both count every reload

    async def retire() -> None:  # by the versions the refs carry: every ref of both processes goes
        async with RoutedExpertsClient(url) as c:
            await c.retire(max(r.routing_ref.weight_version for r in results))
            with pytest.raises(RoutingExpiredError, match="retired"):
                await c.resolve_results(results[:1])
            for r in results:
                with pytest.raises(RoutingExpiredError):
                    await c.resolve_results([r])

    asyncio.run(retire())
