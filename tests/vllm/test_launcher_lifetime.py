"""The engine lives and dies with ``rr-server launch vllm`` (issue 20): SIGKILL the launcher and, within seconds,
no process of that server is left, the port is free, and a restart on the same port serves again.

Real vLLM CPU server started by the launcher; nothing here kills vLLM's process tree itself: only the launcher's
own pid gets the SIGKILL (what a supervisor, an OOM killer or ``kill -9`` does).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support.vllm_process import STARTUP_TIMEOUT_S, VLLMProcess

pytestmark = pytest.mark.vllm_server


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(t) for t in text]
    return out


def _group(pgid: int) -> list[int]:
    """Every live (non-zombie) process whose process group is ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _generate(url: str) -> dict:
    r = httpx.post(
        url + "/generate",
        json={
            "input_ids": [5, 6, 7, 8],
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sigkilled_launcher_takes_the_engine_down(tiny_models: dict[str, Path]) -> None:
    server = VLLMProcess(tiny_models["qwen3_dense"], name="lifetime").start()
    restarted: VLLMProcess | None = None
    try:
        assert server.proc is not None
        launcher = server.proc.pid
        kids = {c: Path(f"/proc/{c}/cmdline").read_bytes() for c in _children(launcher)}
        watchdogs = [c for c, cmd in kids.items() if b"rr_server.launch.lifeline" in cmd]
        assert len(watchdogs) == 1, kids
        engine_groups = {os.getpgid(c) for c in kids if c not in watchdogs}
        (engine_pgid,) = engine_groups  # vLLM runs in a process group of its own
        engine = _group(engine_pgid)
        assert len(engine) >= 2, f"expected vLLM's API server and EngineCore, found {engine}"
        assert _generate(server.base_url)["meta_info"]["routed_experts"]

        os.kill(launcher, signal.SIGKILL)
        server.proc.wait(timeout=10)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S  # the watchdog's SIGTERM, then SIGKILL after a 10 s grace
        while time.monotonic() < deadline and (_group(engine_pgid) or not _port_free(server.port)):
            time.sleep(0.2)
        assert _group(engine_pgid) == [], f"orphaned engine processes: {_group(engine_pgid)}"
        assert _port_free(server.port)

        restarted = VLLMProcess(tiny_models["qwen3_dense"], name="lifetime-restart", port=server.port).start()
        assert _generate(restarted.base_url)["meta_info"]["routed_experts"]
    finally:
        server.proc = None
        if restarted is not None:
            restarted.stop()


def test_watchdog_takes_down_a_group_when_its_owner_dies() -> None:
    """rr_server.launch.lifeline on its own: a process group guarded by a short-lived owner is gone after the owner's
    SIGKILL, and a clean release leaves nothing running (no vLLM needed)."""
    import subprocess
    import sys

    owner_code = (
        "import subprocess, sys, time\n"
        "from rr_server.launch import lifeline\n"
        "g = lifeline.start(grace_s=1.0)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "g.guard(p.pid)\n"
        "print(p.pid, g.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    child, watchdog = map(int, owner.stdout.readline().split())
    try:
        assert _group(child) == [child]
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S  # a loaded machine reaps late: the suite's deadline
        while time.monotonic() < deadline and _group(child):
            time.sleep(0.05)
        assert _group(child) == []
    finally:
        try:
            os.killpg(child, signal.SIGKILL)  # only if the check above failed
        except ProcessLookupError:
            pass
    # the watchdog exits once its job is done
    while (
        time.monotonic() < deadline
        and Path(f"/proc/{watchdog}").exists()
        and Path(f"/proc/{watchdog}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ):
        time.sleep(0.05)
    assert (
        not Path(f"/proc/{watchdog}").exists()
        or Path(f"/proc/{watchdog}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    )
