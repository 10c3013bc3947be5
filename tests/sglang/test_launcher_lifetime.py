"""``rr-server launch sglang`` runs SGLang in its own process; when that process is SIGKILLed, SGLang's own
subprocesses must not outlive it (issue 20). SGLang's detokenizer process, started by SGLang's real
``run_detokenizer_process`` the way its launcher starts it (a multiprocessing child of the launcher process),
is killed by the kernel when the launcher dies (SGLang sets PR_SET_PDEATHSIG in it): nothing is left holding
the ports. The scheduler cannot start on CPU; it runs the same ``kill_itself_when_parent_died`` first thing
(checked in its source below, every release)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.vllm_process import STARTUP_TIMEOUT_S

pytestmark = pytest.mark.sglang

LAUNCHER = """
import multiprocessing as mp, sys, time
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)  # as SGLang's launcher does
    server_args = ServerArgs(model_path=sys.argv[1], enable_return_routed_experts=True, device="cpu")
    port_args = PortArgs.init_new(server_args)
    try:
        from sglang.srt.runtime_context import publish
        publish(server_args, role="tokenizer")
    except ImportError:
        pass
    p = mp.Process(target=run_detokenizer_process, args=(server_args, port_args))
    p.start()
    print(p.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# run_detokenizer_process begins with kill_itself_when_parent_died() in every release 0.5.7 - 0.5.23 (checked in
# each); the real run costs ~1-2 min, so it runs on the oldest and the newest
@pytest.mark.sglang_releases("0.5.7", "0.5.23")
def test_sglang_subprocesses_die_with_a_sigkilled_launcher(tiny_moe: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny_moe)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        start_new_session=True,
    )
    assert launcher.stdout is not None
    detok = int(launcher.stdout.readline())
    try:
        # SGLang's own process entry ran (it sets this title after PR_SET_PDEATHSIG): on a loaded machine its imports
        # take as long as a server's start, so the wait is RR_TEST_STARTUP_TIMEOUT's, and ends early if it died
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (
            time.monotonic() < deadline
            and _alive(detok)
            and b"sglang::detokenizer" not in Path(f"/proc/{detok}/cmdline").read_bytes()
        ):
            time.sleep(0.1)
        assert b"sglang::detokenizer" in Path(f"/proc/{detok}/cmdline").read_bytes(), (
            f"SGLang's detokenizer did not set its title in {STARTUP_TIMEOUT_S:.0f} s (RR_TEST_STARTUP_TIMEOUT)"
        )
        time.sleep(2)
        assert _alive(detok), "the detokenizer must be running before the launcher dies"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=STARTUP_TIMEOUT_S)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and _alive(detok):
            time.sleep(0.05)
        assert not _alive(detok), "SGLang's detokenizer outlived the SIGKILLed launcher"
    finally:
        for pid in (detok, launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sglang_scheduler_dies_with_its_parent_too() -> None:
    """The scheduler's process setup asks the kernel for SIGKILL on its parent's death (code reading: the scheduler
    cannot start on CPU). In run_scheduler_process up to 0.5.22, in configure_scheduler_process from 0.5.23."""
    from sglang.srt.managers import scheduler

    entry = inspect.getsource(scheduler.run_scheduler_process)
    setup = getattr(scheduler, "configure_scheduler_process", None)
    calls = entry + (inspect.getsource(setup) if setup is not None and "configure_scheduler_process(" in entry else "")
    assert "kill_itself_when_parent_died()" in calls
