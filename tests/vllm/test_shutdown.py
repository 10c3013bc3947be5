"""Shutdown without loss (issue 20): SIGTERM to ``rr-server launch vllm`` with requests in flight.

Every request either completes with whole, checked routing (vLLM drains the requests it is running on SIGTERM;
queued ones are aborted) (rows = prompt + completion - 1; every top-k set equal to transformers' router's, or a near-tie
there by the doctor's NEAR_TIE rule) or fails with a typed rr_client error; none hangs past the client's timeout, none
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

import pytest

from rr_client import RoutedExpertsClient
from rr_client.core.errors import RRError
from tests.support.vllm_process import STARTUP_TIMEOUT_S, VLLMProcess
from tests.vllm.test_launcher_lifetime import _children, _group
from tests.vllm.test_soak import SOAK

pytestmark = pytest.mark.vllm_server

IN_FLIGHT = 16
CLIENT_TIMEOUT_S = 60.0
MAX_MODEL_LEN = 2048  # the tiny model's positions
MAX_NEW_TOKENS = MAX_MODEL_LEN - 64
# The engine runs RUNNING at a time and queues the rest: 16 requests of ~2000 tokens take several waves, so most
# are still in flight at SIGTERM even on an idle machine, where one wave of this tiny model takes a few seconds.
RUNNING = 4
ADMIT_S = 1.0


def test_sigterm_with_requests_in_flight(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["qwen3_dense"]
    server = VLLMProcess(
        model, name="shutdown", max_model_len=MAX_MODEL_LEN, extra=["--max-num-seqs", str(RUNNING)]
    ).start()
    assert server.proc is not None
    launcher = server.proc.pid
    engine_pgids = {
        os.getpgid(c)
        for c in _children(launcher)
        if b"rr_server.launch.lifeline" not in Path(f"/proc/{c}/cmdline").read_bytes()
    }
    prompts = [[(7 * i + 3 * j) % 400 + 2 for j in range(24 + i)] for i in range(IN_FLIGHT)]
    try:
        pending_at_sigterm: list[int] = []

        async def scenario() -> list[Any]:
            async with RoutedExpertsClient(
                server.base_url, max_concurrency=IN_FLIGHT, retries=0, timeout=CLIENT_TIMEOUT_S
            ) as client:
                await client.info()
                tasks = [
                    asyncio.ensure_future(
                        client.generate([p], {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "temperature": 0.0})
                    )
                    for p in prompts
                ]
                # SIGTERM once they have reached the engine (loopback: well under ADMIT_S). Not read from /metrics:
                # vLLM's API server answers it only between output batches, seconds late under this load.
                await asyncio.sleep(ADMIT_S)
                pending_at_sigterm.append(sum(not t.done() for t in tasks))
                os.kill(launcher, signal.SIGTERM)  # what a supervisor's stop does; the launcher forwards it
                return list(
                    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), CLIENT_TIMEOUT_S + 30)
                )  # a hang fails here

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
        # every top-k set equals transformers' or is a near-tie there (the doctor's NEAR_TIE rule, as the soak):
        # long batched decodes meet a few sets that fp32 batched and single forwards break differently
        rows, bad, _ties, _gap, first = SOAK.compare_with_transformers(
            model, [*r.prompt_ids, *r.output_ids], r.routed_experts
        )
        assert rows == len(r.prompt_ids) + len(r.output_ids) - 1 and bad == 0, first
    assert len(completed) + len(failed) == IN_FLIGHT
    print(
        f"shutdown: {pending_at_sigterm[0]} in flight at SIGTERM, {len(completed)} completed, "
        f"{[type(e).__name__ for e in failed]} failed"
    )
    # vLLM drains on SIGTERM (uvicorn's graceful shutdown): requests in flight may all complete, whole
    assert pending_at_sigterm[0] >= IN_FLIGHT // 2, (
        f"only {pending_at_sigterm} in flight at SIGTERM; {len(completed)} completed, failed: {failed[:2]}"
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S  # the suite's deadline (RR_TEST_STARTUP_TIMEOUT)
    while time.monotonic() < deadline and any(_group(g) for g in engine_pgids):
        time.sleep(0.2)
    assert [p for g in engine_pgids for p in _group(g)] == []
