"""The rr sidecar in front of vLLM 0.31-0.33's real API server (stand-in GPU model runner, see conftest): the
sidecar reads ``choices[].routed_experts`` from ``/v1/completions``, checks it and re-encodes it.
Every routing value is checked against transformers' router top-k.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient
from rr_server.proxy.app import ProxyConfig
from tests.support.proxy_harness import SidecarServer
from tests.vllm_standin.conftest import HAVE
from tests.vllm_standin.test_standin_server import (
    PROMPTS,
    check_item,
    check_rows,
    no_routing,
)


@pytest.fixture(scope="module")
def sidecar(server: Any) -> Iterator[SidecarServer]:
    with SidecarServer(ProxyConfig(upstream=server.base_url, engine="vllm", model_path=str(server.model_dir))) as sc:
        yield sc


def test_sidecar_info_names_the_vllm_version(sidecar: SidecarServer) -> None:
    info = httpx.get(sidecar.url + "/rr/info", timeout=30).json()
    assert info["engine_version"] == HAVE and info["sidecar"] is True
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"], info["moe_layers"]) == (3, 8, 2, [0, 2])


def test_sidecar_batch_start_and_no_routing(sidecar: SidecarServer, server: Any) -> None:
    r = httpx.post(
        sidecar.url + "/generate",
        json={"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    for item, prompt in zip(r.json(), PROMPTS, strict=True):
        check_item(server, item, prompt)
    r = httpx.post(
        sidecar.url + "/generate",
        json={
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 3},
            "return_routed_experts": True,
            "routed_experts_start": 4,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    check_item(server, r.json(), PROMPTS[0], start=4)
    r = httpx.post(
        sidecar.url + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2}}, timeout=120
    )
    assert r.status_code == 200, r.text
    no_routing(r.json())


def test_client_through_sidecar(sidecar: SidecarServer, server: Any) -> None:
    async def run() -> Any:
        async with RoutedExpertsClient(sidecar.url) as c:
            return await c.generate(PROMPTS, {"max_new_tokens": 5}, routed_experts_start=2)

    batch = asyncio.run(run())
    for r, prompt in zip(batch, PROMPTS, strict=True):
        assert r.routed_experts is not None
        check_rows(server, r.routed_experts, prompt, r.output_ids, start=2)
