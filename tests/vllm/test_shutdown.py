"""Shutdown without loss (issue 20): SIGTERM to ``rr-server launch vllm`` with requests in flight.

Every request either completes with whole, checked routing (rows = prompt + completion - 1; every top-k set equal
to transformers' router's, or a near-tie there by the doctor's NEAR_TIE rule) or fails with a typed rr_client
error; none hangs past the client's timeout, none returns partial rows. (vLLM drains in-flight requests on SIGTERM,
so most or all complete.) The launcher exits and leaves no engine process.

The same for the sidecar (``rr-server proxy``'s app) when its unpatched vLLM upstream gets SIGTERM with requests in
flight: whole, checked routing or a typed error, none hung; then, with the upstream restarted on the same port,
the same sidecar (never restarted) serves correct routing again. (SIGKILL of the upstream mid-flight is
tests/vllm/test_proxy_upstream_kill.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient
from rr_client.errors import RRError
from rr_server.proxy.app import ProxyConfig
from rr_server.tiny_moe import reference_routing
from tests.support.proxy_harness import SidecarServer
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess
from tests.vllm.test_launcher_lifetime import _children, _group
from tests.vllm.test_soak import SOAK

pytestmark = pytest.mark.vllm_server

IN_FLIGHT = 16
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path]) -> Iterator[dict[str, VLLMProcess]]:
    """The rr-patched server (``rr-server launch vllm``) and an unpatched upstream for the sidecar, started together."""
    model = tiny_models["qwen3_dense"]
    started = {"patched": VLLMProcess(model, name="shutdown", extra=["--max-num-seqs", "64"]).launch(),
               "upstream": VLLMProcess(model, name="shutdown-upstream", plugin=False,
                                       extra=["--max-num-seqs", "64"]).launch()}
    try:
        for s in started.values():
            s.wait_healthy()
        yield started
    finally:
        for s in started.values():
            s.stop()


def _check_outcomes(model: Path, outcomes: list[Any]) -> tuple[list[Any], list[BaseException]]:
    """Each outcome is a whole answer whose routing equals transformers', or a typed rr_client error."""
    completed = [o for o in outcomes if not isinstance(o, BaseException)]
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    untyped = [repr(o) for o in failed if not isinstance(o, RRError)]
    assert untyped == [], untyped
    for batch in completed:
        (r,) = batch.results
        assert r.routed_experts is not None
        assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.output_ids) - 1  # whole, never partial
        _check_routing(model, [*r.prompt_ids, *r.output_ids], r.routed_experts)
    return completed, failed


def _check_routing(model: Path, tokens: list[int], routing: Any) -> None:
    """Every (row, MoE layer) top-k set equals transformers', or is a near-tie there (the soak's and the doctor's
    rule: each chosen expert within NEAR_TIE of the k-th router probability; long batched decodes meet a few)."""
    rows, bad, _ties, _gap, first = SOAK.compare_with_transformers(model, tokens, routing)
    assert rows == len(tokens) - 1 and bad == 0, first


async def _admitted(client: RoutedExpertsClient) -> None:
    """Return once requests sent before it are being served: a 1-token request sent after them has completed."""
    await asyncio.sleep(1.0)
    await client.generate([[5, 6, 7]], {"max_new_tokens": 1})


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 400 + 2 for j in range(24 + i)] for i in range(IN_FLIGHT)]


LONG = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0.0}


def test_sigterm_with_requests_in_flight(servers: dict[str, VLLMProcess]) -> None:
    server = servers["patched"]
    assert server.proc is not None
    launcher = server.proc.pid
    engine_pgids = {os.getpgid(c) for c in _children(launcher)
                    if b"rr_server.lifeline" not in Path(f"/proc/{c}/cmdline").read_bytes()}
    pending_at_sigterm: list[int] = []

    async def scenario() -> list[Any]:
        async with RoutedExpertsClient(server.base_url, max_concurrency=IN_FLIGHT + 1, retries=0,
                                       timeout=CLIENT_TIMEOUT_S) as client:
            await client.info()
            tasks = [asyncio.ensure_future(client.generate([p], LONG)) for p in _prompts()]
            await _admitted(client)
            pending_at_sigterm.append(sum(not t.done() for t in tasks))
            os.kill(launcher, signal.SIGTERM)  # what a supervisor's stop does; the launcher forwards it
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                               CLIENT_TIMEOUT_S + 30))  # a hang fails here

    outcomes = asyncio.run(scenario())
    assert server.proc.wait(timeout=60) is not None
    server.proc = None
    completed, failed = _check_outcomes(server.model_dir, outcomes)
    assert len(completed) + len(failed) == IN_FLIGHT
    # vLLM drains on SIGTERM (uvicorn's graceful shutdown): requests in flight may all complete, whole
    assert pending_at_sigterm[0] >= IN_FLIGHT // 2, f"only {pending_at_sigterm} in flight at SIGTERM"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_group(g) for g in engine_pgids):
        time.sleep(0.2)
    assert [p for g in engine_pgids for p in _group(g)] == []


def _sidecar_in_flight(url: str) -> float:
    """The sidecar's rr_proxy_in_flight gauge."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("rr_proxy_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_sidecar_upstream_sigterm_in_flight_then_back(servers: dict[str, VLLMProcess]) -> None:
    upstream = servers["upstream"]
    model = upstream.model_dir
    cfg = ProxyConfig(upstream=upstream.url, engine="vllm", timeout=120, model_path=str(model))
    with SidecarServer(cfg) as sc:
        in_flight_at_sigterm: list[float] = []

        async def scenario() -> list[Any]:
            async with RoutedExpertsClient(sc.url, max_concurrency=IN_FLIGHT + 1, retries=0,
                                           timeout=CLIENT_TIMEOUT_S) as client:
                await client.info()
                tasks = [asyncio.ensure_future(client.generate([p], LONG)) for p in _prompts()]
                await _admitted(client)
                in_flight_at_sigterm.append(await asyncio.to_thread(_sidecar_in_flight, sc.url))
                assert upstream.proc is not None
                os.kill(upstream.proc.pid, signal.SIGTERM)  # vLLM's API server (its group leader) goes away
                return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                                   CLIENT_TIMEOUT_S + 30))  # a hang fails here

        outcomes = asyncio.run(scenario())
        assert upstream.proc is not None and upstream.proc.wait(timeout=60) is not None
        upstream_pgid = upstream.proc.pid
        upstream.proc = None
        completed, failed = _check_outcomes(model, outcomes)
        assert len(completed) + len(failed) == IN_FLIGHT
        assert in_flight_at_sigterm[0] >= IN_FLIGHT // 2, f"only {in_flight_at_sigterm} in flight at SIGTERM"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _group(upstream_pgid):
            time.sleep(0.2)
        assert _group(upstream_pgid) == []

        # upstream gone: the sidecar stays up, says so, and a request fails fast with a typed error
        r = httpx.get(sc.url + "/health", timeout=10)
        assert r.status_code == 503, r.text

        async def one(prompts: list[list[int]]) -> Any:
            async with RoutedExpertsClient(sc.url, retries=0, timeout=CLIENT_TIMEOUT_S) as client:
                return await asyncio.wait_for(client.generate(prompts, {"max_new_tokens": 5}), CLIENT_TIMEOUT_S + 30)

        with pytest.raises(RRError):
            asyncio.run(one([[11, 12, 13]]))

        upstream.start()  # same port; the sidecar is never restarted
        assert httpx.get(sc.url + "/health", timeout=10).status_code == 200
        back = asyncio.run(one([[11, 12, 13], [20, 21, 22, 23]]))
        for res in back:
            assert res.routed_experts.shape[0] == len(res.prompt_ids) + len(res.output_ids) - 1
            assert_routing_sets_equal(res.routed_experts, reference_routing(model, [*res.prompt_ids,
                                                                                  *res.output_ids][:-1]),
                                      layers=[0, 2])  # short: exact
