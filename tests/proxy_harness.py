"""Test harness for the sidecar: run it in a thread, and start/kill real vLLM CPU servers as subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from rr_server.proxy import KEEP_ALIVE_S, ProxyConfig, create_app

__all__ = ["free_port", "SidecarServer", "VLLMProcess"]

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SidecarServer:
    """The real sidecar app under uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.app = create_app(cfg)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     timeout_keep_alive=KEEP_ALIVE_S))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "SidecarServer":
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("sidecar did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


class VLLMProcess:
    """A real vLLM CPU API server (``--enable-return-routed-experts``) in its own process group.

    ``plugin=False`` starts vanilla vLLM with ``VLLM_PLUGINS=""`` (no rr code in the engine);
    ``plugin=True`` starts it through ``rr-server launch vllm`` (adds rr's ``/generate``).
    """

    def __init__(self, model_dir: Path, *, plugin: bool, port: int | None = None, log: Path | None = None) -> None:
        self.model_dir, self.plugin = model_dir, plugin
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or Path(f"/tmp/rr-proxy-vllm-{self.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The launch command (CPU flags from engines.md)."""
        common = ["--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                  "--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", "268435456",
                  "--max-num-seqs", "64"]
        if self.plugin:
            return [sys.executable, "-m", "rr_server.cli", "launch", "vllm", *common]
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common, "--enable-return-routed-experts"]

    def start(self, wait: float = 300.0) -> "VLLMProcess":
        """Launch and wait for ``/health``; raise with the log tail if it dies or times out."""
        env = dict(os.environ)
        if not self.plugin:
            env["VLLM_PLUGINS"] = ""
            env.pop("RR_ENABLE", None)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vLLM did not become healthy in {wait}s:\n{self.log.read_text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the whole process group (API server, EngineCore) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
