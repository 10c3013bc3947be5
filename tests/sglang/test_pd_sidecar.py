"""rr's sidecar as the P/D load balancer in front of two unpatched SGLang 0.5.23 servers (``rr-server proxy --upstream
DECODE --prefill-upstream PREFILL --bootstrap-port N``, the real CLI in its own process): each ``/generate`` goes to
both servers with SGLang's bootstrap fields, the prompt's rows come from the prefill server, the decode server's prompt
rows (its buffer's leftovers) are dropped, and the two halves are joined at the seam. A plain ``RoutedExpertsClient``
on the sidecar gets rows equal to transformers on every (token, MoE layer) cell, inline and by reference, single-turn
and for a second turn; a zero-row prefill answer and servers at different weight versions are typed refusals; the
OpenAI endpoints and streaming are refused with 400 and the sidecar keeps serving.

Stood in (the GPU part): each server's scheduler in its P/D role (tests/sglang/standin.py) and the KV transfer.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_server.demo.tiny_moe import reference_routing
from rr_server.launch.process import free_port, wait_healthy
from tests.sglang.pd_server import REPO, PDServer
from tests.sglang.standin import completion_for

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.22", "0.5.23")]


@pytest.fixture(scope="module")
def sidecar(tiny_moe: Path) -> Iterator[tuple[str, PDServer, PDServer]]:
    bootstrap = free_port()
    servers = [PDServer(role, tiny_moe, bootstrap, patched=False) for role in ("prefill", "decode")]
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"rr-pd-sidecar-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rr_server", "proxy", "--engine", "sglang", "--port", str(port),
             "--upstream", servers[1].url, "--prefill-upstream", servers[0].url, "--bootstrap-port", str(bootstrap)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for s in servers:
            s.wait()
        wait_healthy(url, proc, log_path, 60)  # type: ignore[arg-type]  # its /health asks both servers'
        yield url, servers[0], servers[1]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for s in servers:
            s.stop()


def generate(url: str, prompts: list[list[int]], n: int, **kw: Any) -> Any:
    from rr_client import RoutedExpertsClient

    async def go() -> Any:
        async with RoutedExpertsClient(url, retries=0) as c:
            batch = await c.generate(prompts, {"max_new_tokens": n}, **kw)
            return await c.resolve_results(batch.results)

    return asyncio.run(go())


def test_the_sidecar_joins_unpatched_halves_equal_to_transformers(
    sidecar: tuple[str, PDServer, PDServer], tiny_moe: Path
) -> None:
    url, prefill, decode = sidecar
    g = np.random.default_rng(11)
    prompts = [g.integers(10, 200, k).tolist() for k in (8, 5)]
    for by_reference in (False, True):
        results = generate(url, prompts, 5, by_reference=by_reference)
        for prompt, r in zip(prompts, results, strict=True):
            assert r.output_ids == completion_for(prompt, 5)
            want = reference_routing(tiny_moe, (prompt + r.output_ids)[:-1])
            assert r.routed_experts.shape == want.shape and np.array_equal(r.routed_experts, want)
            assert r.meta["rr_seam"]["at"] == len(prompt)
            assert r.meta["rr_seam"]["prefill"]["server"] == prefill.url
            assert r.meta["rr_seam"]["decode"]["server"] == decode.url
    first = prompts[0] + results[0].output_ids
    second = first + g.integers(10, 200, 3).tolist()
    (r,) = generate(url, [second], 4, routed_experts_start=len(first))
    want = reference_routing(tiny_moe, (second + r.output_ids)[:-1])[len(first) :]
    assert r.routed_experts_start == len(first) and np.array_equal(r.routed_experts, want)


def test_zero_prefill_rows_and_servers_at_different_weights_are_refused(
    sidecar: tuple[str, PDServer, PDServer],
) -> None:
    """The prefill server lost its rows (SGLang #23885): the one check refuses that half. A weight update that
    reached only the decode server: the halves are refused. Sent through the sidecar, an update reaches both
    servers and the pair joins again."""
    from rr_client import StaleRoutingError, UnrecordedRoutingError

    url, prefill, decode = sidecar
    httpx.post(f"{prefill.url}/test/lose_rows", json={"start": 1}, timeout=10).raise_for_status()
    try:
        with pytest.raises(UnrecordedRoutingError, match="all-zero"):
            generate(url, [[41, 42, 43, 44, 45]], 3)
    finally:
        httpx.post(f"{prefill.url}/test/lose_rows", json={"start": None}, timeout=10).raise_for_status()
    httpx.post(f"{decode.url}/update_weight_version", json={"new_version": "v7"}, timeout=10).raise_for_status()
    with pytest.raises(StaleRoutingError, match=r"prefill server .* weight version '.*', the decode server .* 'v7'"):
        generate(url, [[41, 42, 43, 44, 45]], 3)
    httpx.post(f"{url}/update_weight_version", json={"new_version": "v8"}, timeout=10).raise_for_status()
    (r,) = generate(url, [[41, 42, 43, 44, 45]], 3)
    assert r.routed_experts.shape[0] == 5 + 3 - 1


def test_openai_endpoints_and_streams_are_refused_and_it_keeps_serving(sidecar: tuple[str, PDServer, PDServer]) -> None:
    url = sidecar[0]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)
    assert r.status_code == 400 and "serves /generate only" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "stream": True}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "stream=false" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "n must be 1" in r.text
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_indexer_topk": True}
    r = httpx.post(f"{url}/generate", json=body, timeout=10)
    assert r.status_code == 400 and "indexer" in r.text
    (ok,) = generate(url, [[5, 6, 7]], 2)
    assert ok.routed_experts.shape[0] == 3 + 2 - 1
