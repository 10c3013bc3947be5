"""The vLLM plugin refuses all-zero routing on the real server: vLLM 0.30 on CPU with torch.compile on.

``rr-server launch vllm`` forces ``--enforce-eager`` on CPU because compiled CPU graphs return routing with
the right shape and all zeros. Here the plugin runs without the launcher's CPU fix (the command is the
launcher's own ``build_command(cpu=False)`` plus float32 and a KV size, so no eager mode) and the one full
check must turn every such sample into ``routed_experts_error`` instead of sending zeros.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rr_client import RoutedExpertsClient, UnrecordedRoutingError
from rr_server.launch.vllm import CPU_KV_CACHE_BYTES, build_command
from tests.support.prom import rr_samples
from tests.support.vllm_process import VLLMProcess, server_args

pytestmark = pytest.mark.vllm_server


class CompiledCPUServer(VLLMProcess):
    """The rr plugin on vLLM with torch.compile on CPU (the launcher would force eager mode)."""

    def command(self) -> list[str]:
        args = server_args(self.model_dir, port=self.port, served_model_name=self.name, max_model_len=512)
        cmd, _ = build_command(args, cpu=False)
        assert "--enforce-eager" not in cmd
        return [*cmd, "--dtype", "float32", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]


@pytest.fixture(scope="module")
def compiled_server(tiny_models: dict[str, Path]) -> Iterator[CompiledCPUServer]:
    server = CompiledCPUServer(
        tiny_models["qwen3_dense"], name="qwen3-compiled", env={"RR_ENABLE": "1", "VLLM_PLUGINS": "rr"}
    )
    try:
        yield server.start()
    finally:
        server.stop()


def test_all_zero_routing_is_refused_not_sent(compiled_server: CompiledCPUServer) -> None:
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_routed_experts": True,
    }
    r = httpx.post(compiled_server.base_url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["routed_experts"] is None
    assert meta["routed_experts_error"].startswith("UnrecordedRoutingError: row 0 layer 0 has all-zero")
    assert "routed_experts_shape" not in meta


def test_client_raises_on_the_refused_sample(compiled_server: CompiledCPUServer) -> None:
    async def run() -> None:
        async with RoutedExpertsClient(compiled_server.base_url) as c:
            await c.generate([[5, 6, 7, 8]], {"max_new_tokens": 3, "ignore_eos": True})

    with pytest.raises(UnrecordedRoutingError, match="withheld routed_experts: UnrecordedRoutingError"):
        asyncio.run(run())


def test_doctor_fails_naming_the_all_zero_rows(
    compiled_server: CompiledCPUServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rr-server doctor`` on the same broken deployment: FAIL first, with the cause."""
    from rr_server.cli import main as cli

    rc = cli(["doctor", compiled_server.base_url, "--model-path", str(compiled_server.model_dir)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1 and out[0].startswith("FAIL")
    assert out[1].startswith("  FAIL single: UnrecordedRoutingError") and "all-zero" in out[1]
    assert "all-zero" in out[1]


def test_refusals_are_counted_on_vllms_metrics(compiled_server: CompiledCPUServer) -> None:
    """Each refused sample moves ``rr_routing_refused_total{error="UnrecordedRoutingError"}`` on vLLM's own
    ``/metrics`` by one, on ``/generate`` and ``/v1/completions`` alike; nothing is counted as sent."""

    def metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        r = httpx.get(compiled_server.base_url + "/metrics", timeout=30)
        assert r.status_code == 200 and "vllm:" in r.text
        return rr_samples(r.text)

    before = metrics()
    body = {
        "input_ids": [[5, 6, 7, 8], [9, 10, 11]],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_routed_experts": True,
    }
    r = httpx.post(compiled_server.base_url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert all(item["meta_info"]["routed_experts_error"].startswith("UnrecordedRoutingError") for item in r.json())
    c = httpx.post(
        compiled_server.base_url + "/v1/completions",
        json={
            "model": compiled_server.name,
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "temperature": 0,
            "return_routed_experts": True,
        },
        timeout=300,
    )
    assert c.status_code == 200, c.text
    assert c.json()["choices"][0]["routed_experts_error"].startswith("UnrecordedRoutingError")
    after = metrics()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert moved == {("rr_routing_refused_total", (("error", "UnrecordedRoutingError"),)): 3}
