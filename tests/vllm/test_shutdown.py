"""Shutdown without loss (issue 20): SIGTERM to ``rr-server launch vllm`` with requests in flight.

Every request either completes with whole, checked routing (vLLM drains in-flight requests on SIGTERM, so most
or all complete) (rows = prompt + completion - 1, values equal to
transformers' router top-k) or fails with a typed rr_client error; none hangs past the client's timeout, none
returns partial rows. The launcher exits and leaves no engine process. (The sidecar's upstream going away and
coming back is tests/vllm/test_proxy_upstream_kill.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient
from rr_client.errors import RRError
from rr_server.tiny_moe import reference_routing
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess
from tests.vllm.test_launcher_lifetime import _children, _group

pytestmark = pytest.mark.vllm_server

IN_FLIGHT = 16
CLIENT_TIMEOUT_S = 60.0


def _generating(url: str) -> float:
    """vLLM's running-request gauge (0 when unreadable)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_sigterm_with_requests_in_flight(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["qwen3_dense"]
    server = VLLMProcess(model, name="shutdown", extra=["--max-num-seqs", "64"]).start()
    assert server.proc is not None
    launcher = server.proc.pid
    engine_pgids = {os.getpgid(c) for c in _children(launcher)
                    if b"rr_server.lifeline" not in Path(f"/proc/{c}/cmdline").read_bytes()}
    prompts = [[(7 * i + 3 * j) % 400 + 2 for j in range(24 + i)] for i in range(IN_FLIGHT)]
    try:
        pending_at_sigterm: list[int] = []

        async def scenario() -> list[Any]:
            async with RoutedExpertsClient(server.base_url, max_concurrency=IN_FLIGHT, retries=0,
                                           timeout=CLIENT_TIMEOUT_S) as client:
                await client.info()
                tasks = [asyncio.ensure_future(client.generate(
                    [p], {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0})) for p in prompts]
                t0 = time.monotonic()
                while _generating(server.base_url) < 1 and time.monotonic() - t0 < 60:
                    await asyncio.sleep(0.1)
                pending_at_sigterm.append(sum(not t.done() for t in tasks))
                os.kill(launcher, signal.SIGTERM)  # what a supervisor's stop does; the launcher forwards it
                return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                                   CLIENT_TIMEOUT_S + 30))  # a hang fails here

        outcomes = asyncio.run(scenario())
        assert server.proc.wait(timeout=60) is not None
    finally:
        if server.proc.poll() is None:
            server.stop()
        server.proc = None
    completed = [o for o in outcomes if not isinstance(o, BaseException)]
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    untyped = [repr(o) for o in failed if not isinstance(o, RRError)]
    assert untyped == [], untyped
    for batch in completed:
        (r,) = batch.results
        assert r.routed_experts is not None
        assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.output_ids) - 1  # whole, never partial
        assert_routing_sets_equal(r.routed_experts, reference_routing(model, [*r.prompt_ids, *r.output_ids][:-1]),
                                  layers=[0, 2])
    assert len(completed) + len(failed) == IN_FLIGHT
    # vLLM drains on SIGTERM (uvicorn's graceful shutdown): requests in flight may all complete, whole
    assert pending_at_sigterm[0] >= IN_FLIGHT // 2, f"only {pending_at_sigterm} in flight at SIGTERM"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_group(g) for g in engine_pgids):
        time.sleep(0.2)
    assert [p for g in engine_pgids for p in _group(g)] == []
