"""Running a local server for the demo and benchmarks: a free port, waiting for health, stopping its process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes] | None, log_path: Path | None, timeout: float) -> None:
    """Poll ``/health`` until 200; raise with the log tail if the process dies or never comes up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path else ""
            raise RuntimeError(f"server at {base_url} exited with rc={proc.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {base_url} not healthy after {timeout:.0f}s (log: {log_path})")


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the process group of ``proc``; SIGKILL it if it is still alive after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
