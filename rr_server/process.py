"""Stopping a server started in its own process group (launcher children included)."""

from __future__ import annotations

import os
import signal
import subprocess


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
