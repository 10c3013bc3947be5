"""Session fixtures for tests/scale: two real rr-patched vLLM CPU replicas of one tiny MoE, and vllm-router.

Both replicas start together (their ~30-60 s startups overlap), each bound to its own core, with
``RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS=1`` so that answers through vllm-router's own ``/generate`` (which
drops the flag) still carry routing. Only tests that ask for these fixtures start anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from rr_server.launch.process import free_port, stop_process_group
from tests.support.vllm_process import CACHE, LOG_DIR, VLLMProcess

# The same checkpoint as tests/vllm's qwen3_dense (shared cache dir): 3 layers, layer 1 dense, 8 experts, top-2.
QWEN_SPEC = dict(arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,))
MAX_MODEL_LEN = 512
REPLICA_ENV = {"RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS": "1"}


def replica(model_dir: Path, i: int, port: int | None = None) -> VLLMProcess:
    """Launch replica ``i`` (non-blocking) on its own core; ``port`` reuses a URL (a restart)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, os.cpu_count() or 1)), **REPLICA_ENV}
    return VLLMProcess(
        model_dir, name="tiny-moe", plugin=True, port=port, max_model_len=MAX_MODEL_LEN, env=env
    ).launch()


def crash(server: VLLMProcess) -> None:
    """SIGKILL the launcher and every process under it (API server, EngineCore): a crashed replica."""
    import psutil

    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    server.proc.wait(timeout=30)
    server.proc = None


@pytest.fixture(scope="session")
def qwen_model() -> Path:
    from rr_server.demo.tiny_moe import build_tiny_moe

    return build_tiny_moe(CACHE / "qwen3_dense", **QWEN_SPEC)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def replicas(qwen_model: Path) -> Iterator[list[VLLMProcess]]:
    """Two healthy rr-patched vLLM CPU servers of the same model, started concurrently."""
    servers = [replica(qwen_model, i) for i in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.stop()


def router_binary() -> str:
    exe = Path(sys.executable).with_name("vllm-router")
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    if not found:
        pytest.fail("vllm-router is not installed: it is in the test extra (pip install -e '.[test]')")
    return found


class RouterProcess:
    """A router binary started with ``cmd`` (its own process group), logging to ``name``-<port>.log."""

    def __init__(self, name: str, port: int, cmd: list[str]) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}-{port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> Self:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready in {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        stop_process_group(self.proc, grace=10.0)  # type: ignore[arg-type]

    def serving(self) -> Iterator[Self]:
        """This router once ready, for a fixture to yield from; stopped after (also when it never got ready)."""
        try:
            yield self.wait_ready()
        finally:
            self.stop()


class Router(RouterProcess):
    """vllm-router 0.1.17 in front of ``workers``, on a free loopback port."""

    def __init__(self, workers: list[str], policy: str = "consistent_hash") -> None:
        port = free_port()
        super().__init__(
            "vllm-router",
            port,
            [
                router_binary(),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *workers,
                "--policy",
                policy,
                "--log-level",
                "warning",
                "--prometheus-port",
                str(free_port()),
            ],
        )


class SGLangRouter(RouterProcess):
    """sglang-router 0.3.2 (``python -m sglang_router.launch_router``) in front of ``workers``, on free ports."""

    def __init__(self, workers: list[str]) -> None:
        port = free_port()
        super().__init__(
            "sglang-router",
            port,
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *workers,
                "--policy",
                "cache_aware",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
        )


@pytest.fixture(scope="session")
def router(replicas: list[VLLMProcess]) -> Iterator[Router]:
    yield from Router([s.base_url for s in replicas]).serving()
