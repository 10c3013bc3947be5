"""Real vLLM CPU API servers as subprocesses, for the tests under tests/vllm/.

Every server gets the arguments ``rr-server launch vllm`` is documented with (model, host, port,
max-model-len, served-model-name, extras) from :func:`server_args`. With the rr plugin it is started
through the launcher itself; without it (a truly unpatched upstream for the sidecar) the command comes
from the launcher's own :func:`rr_server.launch.vllm.build_command`, so the CPU flags (eager mode,
float32, KV-cache size) are never repeated here. Ports, health polling and process-group shutdown are
:mod:`rr_server.launch.process`'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self, TypeVar

from rr_client.core.errors import ServerStartError
from rr_server.launch.process import free_port, stop_process_group, wait_healthy
from rr_server.launch.vllm import build_command, is_cpu_platform

__all__ = [
    "VLLMProcess",
    "all_launched",
    "server_args",
    "launcher_command",
    "unpatched_command",
    "STARTUP_TIMEOUT_S",
    "LOG_DIR",
]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("RR_TEST_CACHE", REPO / ".cache" / "rr-test-models"))
LOG_DIR = CACHE / "logs"
STARTUP_TIMEOUT_S = float(os.environ.get("RR_TEST_STARTUP_TIMEOUT", "420"))


def server_args(
    model_dir: Path,
    *,
    port: int,
    served_model_name: str | None = None,
    max_model_len: int = 1024,
    extra: Sequence[str] = (),
) -> list[str]:
    """The vLLM api_server arguments a test server is launched with (before rr's launcher adds its own)."""
    args = [
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
        str(max_model_len)
    ]  # fmt: skip
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    return [*args, *extra]


def launcher_command(args: Sequence[str]) -> list[str]:
    """``rr-server launch vllm ARGS``: the console script when installed, else the CLI module."""
    exe = Path(sys.executable).with_name("rr-server")
    if exe.exists():
        return [str(exe), "launch", "vllm", *args]
    return [sys.executable, "-m", "rr_server.cli", "launch", "vllm", *args]


def unpatched_command(args: Sequence[str]) -> list[str]:
    """vLLM's own API server with the flags the launcher would add (:func:`build_command`), run without rr."""
    cmd, _notes = build_command(list(args), cpu=is_cpu_platform())
    return cmd


class VLLMProcess:
    """One vLLM CPU API server in its own process group.

    ``plugin=True``: ``rr-server launch vllm`` (rr's ``/generate`` and ``/rr/info`` added). ``plugin=False``:
    vanilla vLLM (``VLLM_PLUGINS=""``, no ``RR_ENABLE``): no rr code in the engine at all.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        name: str = "tiny-moe",
        plugin: bool = True,
        port: int | None = None,
        max_model_len: int = 1024,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir, self.name, self.plugin = model_dir, name, plugin
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.extra = list(extra)
        self.env = dict(env or {})
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}-{'rr' if plugin else 'vanilla'}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """HTTP root of the server."""
        return f"http://127.0.0.1:{self.port}"

    url = base_url

    def command(self) -> list[str]:
        """The launch command for this server."""
        args = server_args(
            self.model_dir,
            port=self.port,
            served_model_name=self.name,
            max_model_len=self.max_model_len,
            extra=self.extra,
        )
        return launcher_command(args) if self.plugin else unpatched_command(args)

    def launch(self) -> Self:
        """Start the process (non-blocking); see :meth:`wait_healthy`."""
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if not self.plugin:
            env["VLLM_PLUGINS"] = ""
            env.pop("RR_ENABLE", None)
        env.update(self.env)
        with open(self.log_path, "ab") as log:  # a restart appends
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> Self:
        """Wait for ``/health``; on death or timeout stop the server and raise ServerStartError (it carries the
        log's last 60 lines)."""
        try:
            wait_healthy(self.base_url, self.proc, self.log_path, timeout, tail_lines=60)
        except ServerStartError as e:
            self.stop()
            raise ServerStartError(f"vLLM server {self.name}: {e}") from None
        return self

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> Self:
        """Launch and wait until healthy."""
        return self.launch().wait_healthy(timeout)

    def alive(self) -> bool:
        """True while the launched process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group (the launcher forwards it to vLLM's), SIGKILL after 30 s."""
        if self.proc is not None:
            stop_process_group(self.proc, grace=30.0)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole process group now (API server and EngineCore) and reap it: a crash.

        Only for ``plugin=False``: a SIGKILLed launcher could not pass the signal on to vLLM's own group.
        """
        assert not self.plugin, "kill() needs plugin=False (vLLM itself leads the process group)"
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None


P = TypeVar("P", bound=VLLMProcess)


@contextmanager
def all_launched(servers: dict[str, P], *, healthy: bool = False) -> Iterator[dict[str, P]]:
    """``servers`` launched together (their startups overlap) and, with ``healthy``, each waited for; every one
    stopped on exit, also when one of them failed to start."""
    try:
        for s in servers.values():
            s.launch()
        if healthy:
            for s in servers.values():
                s.wait_healthy()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def small_kv_dev_server(
    model_dir: Path, *, name: str, blocks: int, max_model_len: int, core: int
) -> Iterator[VLLMProcess]:
    """A dev-mode server (weights reloadable) with ``blocks`` KV blocks of 32 tokens (vLLM CPU wants multiples of
    32) and prefix caching, so a few long requests force preemption; stopped when the generator closes."""
    extra = ["--block-size", "32", "--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching"]
    server = VLLMProcess(
        model_dir,
        name=name,
        max_model_len=max_model_len,
        extra=extra,
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
    )
    try:
        yield server.launch().wait_healthy()
    finally:
        server.stop()
