"""vLLM 0.30 real server: rr's routes arrive through vLLM's ``vllm.endpoint_plugins`` hook (issue 12).

``rr-server launch vllm`` sets ``VLLM_PLUGINS=rr`` (naming both of rr's plugins); vLLM's own loader logs
"Loaded endpoint plugin rr" and rr's general plugin logs that it did *not* wrap ``build_app``. The routes
then serve routing as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server


@pytest.fixture(scope="module")
def info_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """A launcher-started server logging at INFO, so vLLM's plugin loader lines are in its log."""
    server = VLLMProcess(
        tiny_models["qwen3_dense"], name="qwen3-endpoint-plugin", env={"VLLM_LOGGING_LEVEL": "INFO"}
    ).start()
    try:
        yield server
    finally:
        server.stop()


def test_routes_come_from_the_endpoint_plugin(info_server: VLLMProcess) -> None:
    log = info_server.log_path.read_text(errors="replace")
    assert "Loaded endpoint plugin rr" in log, "vLLM's own loader did not load rr from vllm.endpoint_plugins"
    assert "hooked via" not in log, "0.30+: the build_app wrap must not be used"
    info = httpx.get(info_server.base_url + "/rr/info", timeout=60).json()
    assert info["routing_enabled"] is True and info["engine"] == "vllm"
    r = httpx.post(
        info_server.base_url + "/generate",
        timeout=120,
        json={
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0},
            "return_routed_experts": True,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["routed_experts"]


def test_start_beyond_the_prompt_is_rrs_own_400(info_server: VLLMProcess) -> None:
    r = httpx.post(
        info_server.base_url + "/generate",
        timeout=120,
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 2},
            "return_routed_experts": True,
            "routed_experts_start": 4,
        },
    )
    assert r.status_code == 400, r.text
    assert "routed_experts_start 4 is beyond prompt 0 (3 tokens)" in r.text
