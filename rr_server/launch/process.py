"""Running a local server for the demo and benchmarks: a free port, waiting for health, stopping its process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from rr_client.core.errors import ServerStartError
from rr_server.progress import Steps, last_log_line, log_tail

__all__ = ["ServerStartError", "free_port", "wait_healthy", "stop_process_group"]


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, never one this process handed out before: the kernel can give the same free
    port to two calls in a row, and vLLM binds with SO_REUSEPORT, so two servers given one port would both start
    and share its connections (a test then talks to the wrong server at random)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("free_port: the kernel kept offering ports this process already handed out")


def wait_healthy(
    base_url: str,
    proc: subprocess.Popen[bytes] | None,
    log_path: Path | None,
    timeout: float,
    *,
    steps: Steps | None = None,
    tail_lines: int = 30,
) -> None:
    """Poll ``/health`` until 200, showing the start on stderr as it happens; :class:`ServerStartError` otherwise.

    On a terminal one line shows the elapsed time and the log's last line, updated in place; elsewhere a plain
    line every ~10 s. If the process exits or ``timeout`` passes, the error carries the log's last ``tail_lines``.
    """
    steps = steps if steps is not None else Steps()
    t0 = time.monotonic()
    label = f"waiting for {base_url}/health"
    with steps:
        steps.start(label)
        while (waited := time.monotonic() - t0) < timeout:
            if proc is not None and proc.poll() is not None:
                raise ServerStartError(
                    _failure(
                        f"server at {base_url} exited with rc={proc.returncode} after {waited:.0f}s",
                        log_path,
                        tail_lines,
                    )
                )
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            steps.update(last_log_line(log_path))
            time.sleep(0.5)
    raise ServerStartError(
        _failure(
            f"server at {base_url} not healthy after {timeout:.0f}s"
            + (" (still running)" if proc is not None and proc.poll() is None else ""),
            log_path,
            tail_lines,
        )
    )


def _failure(what: str, log_path: Path | None, lines: int) -> str:
    """``what``, then the log's last lines (or that there is no log)."""
    if log_path is None:
        return what
    tail = log_tail(log_path, lines)
    return f"{what}; last {lines} lines of {log_path}:\n{tail}" if tail else f"{what}; {log_path} is empty"


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
