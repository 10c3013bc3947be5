"""Kill a real, plugin-free vLLM upstream mid-flight: typed client errors fast, sidecar up, serves after restart.

Uses its own vanilla vLLM server (``VLLM_PLUGINS=""``: no rr code in the engine), so this also proves
the sidecar against a truly unpatched engine. The long requests are sent while the engine's generation is frozen
(vLLM's dev-mode ``/pause?mode=keep``): none can finish before the kill, however loaded the machine, so every one
of them is cut by it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient, ServerError, TransportError
from rr_server.demo.tiny_moe import reference_routing
from rr_server.proxy.app import ProxyConfig
from tests.support.proxy_harness import SidecarServer
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import STARTUP_TIMEOUT_S, VLLMProcess

pytestmark = pytest.mark.vllm_server

IN_FLIGHT = 16
DEADLINE_S = 30.0  # in-flight requests must all fail within this after the kill
TASK_DEADLINE_S = STARTUP_TIMEOUT_S  # a hang guard for each request (RR_TEST_STARTUP_TIMEOUT: a loaded box)


@pytest.fixture(scope="module")
def upstream(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    proc = VLLMProcess(
        tiny_models["qwen3_dense"],
        name="qwen3_dense",
        plugin=False,
        extra=["--max-num-seqs", "64"],
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /pause: the long requests wait frozen for the kill
    ).start()
    try:
        yield proc
    finally:
        proc.kill()


def in_flight(metrics: str) -> float:
    """The sidecar's rr_proxy_in_flight gauge."""
    for line in metrics.splitlines():
        if line.startswith("rr_proxy_in_flight "):
            return float(line.split()[1])
    return 0.0


def check(model_dir: Path, res: Any) -> None:
    """Routing of one result equals transformers' top-k sets on the MoE layers."""
    ref = reference_routing(model_dir, res.prompt_ids + res.output_ids)[:-1]
    assert_routing_sets_equal(res.routed_experts, ref, layers=[0, 2])


def test_kill_upstream_mid_flight_then_restart(upstream: VLLMProcess) -> None:
    cfg = ProxyConfig(upstream=upstream.url, engine="vllm", timeout=120, model_path=str(upstream.model_dir))
    with SidecarServer(cfg) as sc:
        http = httpx.Client(base_url=sc.url, timeout=30)
        assert http.get("/health").status_code == 200
        assert httpx.post(upstream.url + "/generate", json={"text": "x"}, timeout=10).status_code == 404  # no plugin

        async def scenario() -> tuple[list[Any], list[bool], float, list[Any]]:
            async with RoutedExpertsClient(sc.url, retries=1, backoff=0.1, batch_size=1, timeout=120) as c:
                ok = await c.generate([[5, 6, 7, 8]], {"max_new_tokens": 4})  # warm: info fetched, path works
                long = {"max_new_tokens": 900, "ignore_eos": True}
                frozen = await asyncio.to_thread(
                    httpx.post, upstream.url + "/pause", params={"mode": "keep"}, timeout=60
                )
                assert frozen.status_code == 200, frozen.text
                tasks = [
                    asyncio.ensure_future(asyncio.wait_for(c.generate([[i + 2, 9, 10]], long), TASK_DEADLINE_S))
                    for i in range(IN_FLIGHT)
                ]
                t_end = time.monotonic() + STARTUP_TIMEOUT_S  # the suite's deadline (RR_TEST_STARTUP_TIMEOUT)
                while (seen := in_flight((await asyncio.to_thread(http.get, "/metrics")).text)) < IN_FLIGHT:
                    assert time.monotonic() < t_end, f"only {seen} requests reached the sidecar"
                    await asyncio.sleep(0.1)
                t_kill = time.monotonic()
                await asyncio.to_thread(upstream.kill)
                ended_before_kill = [t.done() for t in tasks]  # none: generation was frozen
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                return outcomes, ended_before_kill, time.monotonic() - t_kill, list(ok)

        outcomes, ended_before_kill, elapsed, warm = asyncio.run(scenario())
        check(upstream.model_dir, warm[0])
        failed = [o for o in outcomes if isinstance(o, (ServerError, TransportError))]
        kinds = sorted({type(o).__name__ for o in outcomes})
        assert not any(ended_before_kill), "a request finished while the engine was paused"
        assert len(failed) == IN_FLIGHT, f"only {len(failed)} of {IN_FLIGHT} requests were cut by the kill: {kinds}"
        print(f"\nkill mid-flight: {len(failed)} in-flight requests failed with {kinds} within {elapsed:.2f}s")
        assert elapsed < DEADLINE_S
        r = http.get("/health")
        assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
        r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True})
        assert r.status_code == 503

        upstream.start()

        async def after() -> Any:
            async with RoutedExpertsClient(sc.url, retries=0) as c:
                return await c.generate([[11, 12, 13], [20, 21]], {"max_new_tokens": 5})

        assert http.get("/health").status_code == 200
        for res in asyncio.run(after()):
            check(upstream.model_dir, res)
        metrics = http.get("/metrics").text
        assert 'kind="upstream_disconnected"' in metrics or 'kind="upstream_unavailable"' in metrics
        http.close()
