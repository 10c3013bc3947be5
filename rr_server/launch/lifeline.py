"""The engine lives and dies with its launcher, whatever kills the launcher (SIGKILL and the OOM killer included).

``rr-server launch vllm`` runs vLLM in a process group of its own (so Ctrl-C and SIGTERM reach every vLLM
process). A SIGKILLed launcher cannot forward anything, so :func:`start` first spawns a tiny watchdog (this
module's ``__main__``) in a session of its own, holding the read end of a pipe whose write end only the launcher
holds. The kernel closes that end when the launcher dies by any cause; the watchdog reads EOF and takes the whole
engine group down (SIGTERM, then SIGKILL after a grace period), so the port and the accelerator are free for a
supervisor's restart. A group that is already gone (a clean exit) makes the watchdog exit at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["Lifeline", "start", "take_down"]


class Lifeline:
    """The launcher's end: tell the watchdog which process group to guard; keep this object alive."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int) -> None:
        self.proc, self._fd = proc, write_fd

    def guard(self, pgid: int) -> None:
        """Name the engine's process group (sent once; the watchdog acts on it when this process dies)."""
        os.write(self._fd, f"{pgid}\n".encode())

    def release(self) -> None:
        """Close the launcher's end on a clean exit (the watchdog then finds the group gone and exits)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def start(grace_s: float = 10.0) -> Lifeline:
    """Spawn the watchdog before the engine, so no moment exists where the engine runs unguarded."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: the engine never holds the launcher's end
    proc = subprocess.Popen(
        [sys.executable, "-m", "rr_server.launch.lifeline", str(read_fd), str(grace_s)],
        pass_fds=(read_fd,),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    os.close(read_fd)
    return Lifeline(proc, write_fd)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a recycled group of another user: not ours
        return False


def take_down(pgid: int, grace_s: float) -> None:
    """SIGTERM the group (vLLM shuts its engine down on it), SIGKILL whatever is left after ``grace_s``."""
    if not _group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch(read_fd: int, grace_s: float) -> None:
    """Block until the launcher's end closes; then take down the group it named, if any."""
    for sig in (signal.SIGINT, signal.SIGHUP):  # a Ctrl-C or a closed terminal must not kill the guard first
        signal.signal(sig, signal.SIG_IGN)
    data = b""
    while True:
        chunk = os.read(read_fd, 64)
        if not chunk:
            break
        data += chunk
    line = data.split(b"\n", 1)[0].strip()
    if line.isdigit():
        take_down(int(line), grace_s)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]))
