"""Session fixtures: tiny MoE checkpoints and real vLLM CPU servers started with ``rr-server launch vllm``.

Servers are started lazily (only when a test asks for one), both at once to overlap their
~30-80 s startups, on free 127.0.0.1 ports, and stopped by process group at session end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RR_TEST_CACHE", REPO / ".cache" / "rr-test-models"))
STARTUP_TIMEOUT_S = float(os.environ.get("RR_TEST_STARTUP_TIMEOUT", "420"))

# Two architectures: Qwen3-MoE with a dense middle layer (uint8 path) and a >256-expert
# Mixtral (uint16 path).
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "qwen3_dense": dict(arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,)),
    "mixtral_300": dict(arch="mixtral", num_layers=2, num_experts=300, topk=4),
}


@dataclass
class VLLMServer:
    """A running ``rr-server launch vllm`` process group."""

    name: str
    model_dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """HTTP root of the server."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 60) -> str:
        """Last lines of the server log, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def alive(self) -> bool:
        """True while the launcher process runs."""
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_cmd() -> list[str]:
    """``rr-server launch vllm`` when the console script exists, else the module it dispatches to."""
    exe = Path(sys.executable).with_name("rr-server")
    if exe.exists() and (REPO / "rr_server" / "cli.py").exists():
        return [str(exe), "launch", "vllm"]
    return [sys.executable, "-m", "rr_server.launch_vllm"]


# The 300-expert server builds every routed reply in a worker thread (the path large payloads take).
SERVER_ENV: dict[str, dict[str, str]] = {"mixtral_300": {"RR_ENCODE_THREAD_MIN_ELEMS": "0"}}


def start_server(name: str, model_dir: Path, *, core: int, extra: list[str] | None = None) -> VLLMServer:
    """Start one server (non-blocking); wait with :func:`wait_healthy`."""
    port = free_port()
    log_dir = CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core % max(1, os.cpu_count() or 1)))
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(SERVER_ENV.get(name, {}))
    cmd = [*launcher_cmd(), "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--served-model-name", name, *(extra or [])]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    return VLLMServer(name, model_dir, port, proc, log_path, MODEL_SPECS.get(name, {}))


def wait_healthy(server: VLLMServer, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll /health until 200; fail with the log tail on exit or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"vLLM server {server.name} exited rc={server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"vLLM server {server.name} not healthy after {timeout:.0f}s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Build (or reuse from .cache/) the tiny checkpoints used by the e2e tests."""
    from rr_server.tiny_moe import build_tiny_moe

    return {name: build_tiny_moe(CACHE / name, **spec) for name, spec in MODEL_SPECS.items()}


class ServerPool:
    """Starts tiny-model servers on first use; every server this session will need starts together."""

    def __init__(self, models: dict[str, Path], needed: set[str]) -> None:
        self.models = models
        self.needed = needed
        self.servers: dict[str, VLLMServer] = {}
        self.healthy: set[str] = set()

    def get(self, name: str) -> VLLMServer:
        """The healthy server for ``name``, starting it (and its session peers) if needed."""
        if name not in self.servers:
            for i, other in enumerate(sorted(self.needed | {name})):
                if other not in self.servers:
                    self.servers[other] = start_server(other, self.models[other], core=i)
        server = self.servers[name]
        if name not in self.healthy:
            wait_healthy(server)
            self.healthy.add(name)
        return server

    def stop_all(self) -> None:
        """Stop every server this pool started."""
        for s in self.servers.values():
            s.stop()


def _needed_models(session: pytest.Session) -> set[str]:
    """Which tiny-model servers the collected tests will use."""
    names: set[str] = set()
    for item in session.items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"any_server", "vllm_servers"}:
            names |= set(MODEL_SPECS)
        if "qwen_server" in fixtures:
            names.add("qwen3_dense")
        if "mixtral_server" in fixtures:
            names.add("mixtral_300")
    return names


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Iterator[ServerPool]:
    """Lazily started vLLM servers (at most one per tiny model); stopped at session end."""
    pool = ServerPool(tiny_models, _needed_models(request.session))
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def vllm_servers(server_pool: ServerPool) -> dict[str, VLLMServer]:
    """Every tiny-model server, healthy."""
    return {name: server_pool.get(name) for name in MODEL_SPECS}


@pytest.fixture(scope="session")
def qwen_server(server_pool: ServerPool) -> VLLMServer:
    """Qwen3-MoE server (8 experts, top-2, layer 1 dense)."""
    return server_pool.get("qwen3_dense")


@pytest.fixture(scope="session")
def mixtral_server(server_pool: ServerPool) -> VLLMServer:
    """Mixtral server with 300 experts, top-4 (uint16 wire dtype)."""
    return server_pool.get("mixtral_300")


@pytest.fixture(scope="session", params=list(MODEL_SPECS))
def any_server(request: pytest.FixtureRequest, server_pool: ServerPool) -> VLLMServer:
    """Each architecture's server in turn."""
    return server_pool.get(request.param)
