"""Waiting for a server shows its start as it happens and, when it fails, says why with the log's last lines.

The "server" is a tiny ``python -c`` child writing a log (no engine): it exits non-zero, never answers, or
answers ``/health`` after a moment.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from rr_client.core.errors import RRError, ServerStartError, TransportError
from rr_server.launch.process import free_port, stop_process_group, wait_healthy
from rr_server.progress import Steps, last_log_line, log_tail

PRINTS_THEN_EXITS = """import sys, time
for i in range(40):
    print('line', i, flush=True)
    time.sleep(0.02)
time.sleep(0.6)
sys.exit(3)
"""
PRINTS_FOREVER = """import time
i = 0
while True:
    print('loading shard', i, flush=True)
    i += 1
    time.sleep(0.05)
"""
SERVES_HEALTH = """import http.server, sys, time
print('starting', flush=True)
time.sleep(1.5)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
print('ready', flush=True)
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[object]:
    """``start(code, *args)`` -> (process, log path); every process started is stopped at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"server-{len(procs)}.log"
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, *args], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        return procs[-1], log

    yield start
    for p in procs:
        stop_process_group(p, grace=5)


def test_a_server_that_exits_fails_with_its_log_tail_and_progress_lines(
    child: object, capsys: pytest.CaptureFixture[str]
) -> None:
    proc, log = child(PRINTS_THEN_EXITS)  # type: ignore[operator]
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerStartError) as e:
        wait_healthy(url, proc, log, timeout=60, steps=Steps(every=0.2))
    msg = str(e.value)
    assert msg.startswith(f"server at {url} exited with rc=3 after ")
    assert f"last 30 lines of {log}:\nline 10\n" in msg and msg.endswith("line 39")  # the tail, the last 30 only
    assert "line 9\n" not in msg
    assert isinstance(e.value, TransportError) and isinstance(e.value, RRError) and isinstance(e.value, RuntimeError)
    err = capsys.readouterr().err  # stderr is no terminal here: plain heartbeat lines, no escape codes
    beats = re.findall(rf"^waiting for {re.escape(url)}/health: (\d+)s \| line \d+$", err, re.M)
    assert len(beats) >= 2 and "\x1b" not in err and "\r" not in err, err


def test_a_server_that_never_answers_times_out_with_its_log_tail(child: object) -> None:
    proc, log = child(PRINTS_FOREVER)  # type: ignore[operator]
    # a loaded machine may start the child slowly: wait (on its progress) until its log holds more than 30 lines
    deadline = time.monotonic() + float(os.environ.get("RR_TEST_STARTUP_TIMEOUT", "420"))
    while log.read_bytes().count(b"\n") <= 30:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    with pytest.raises(ServerStartError, match=r"not healthy after 2s \(still running\); last 30 lines of") as e:
        wait_healthy(f"http://127.0.0.1:{free_port()}", proc, log, timeout=1.5)
    tail = str(e.value).split(":\n", 1)[1].splitlines()
    assert len(tail) == 30 and all(line.startswith("loading shard ") for line in tail)


def test_on_a_terminal_the_line_is_redrawn_in_place(child: object) -> None:
    port = free_port()
    proc, log = child(SERVES_HEALTH, str(port))  # type: ignore[operator]
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, highlight=False, markup=False)
    wait_healthy(f"http://127.0.0.1:{port}", proc, log, timeout=60, steps=Steps(console, every=0.1))
    drawn = out.getvalue()
    assert "\r" in drawn and f"waiting for http://127.0.0.1:{port}/health" in drawn and "| starting" in drawn
    assert not re.search(r"/health: \d+s", drawn)  # no heartbeat lines: the one line is redrawn


def test_log_lines_are_shown_clean(tmp_path: Path) -> None:
    log = tmp_path / "log"
    assert last_log_line(log) == "" and log_tail(log) == ""  # no log yet
    log.write_bytes(b"first\n\x1b[32mINFO\x1b[0m loaded\nweights 10%\rweights 50%\rweights 100%\n\n")
    assert last_log_line(log) == "weights 100%"
    assert log_tail(log, 2) == "INFO loaded\nweights 100%"


def test_steps_can_be_entered_again_after_they_stopped() -> None:
    out = io.StringIO()
    steps = Steps(Console(file=out, force_terminal=True, width=80), every=0.1)
    for label in ("first", "second"):
        with steps:
            steps.start(label)
            steps.update("detail")
            steps.line(f"{label} done")
    assert "first done" in out.getvalue() and "second done" in out.getvalue()


def test_free_port_never_hands_out_one_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel offered one port to two calls in a row (CI, two vLLM stand-in servers on port 60291, both bound
    with SO_REUSEPORT): free_port asks again rather than hand it out twice."""
    from rr_server.launch import process

    offers = iter([61001, 61001, 61001, 61002])

    class _Socket:
        def __enter__(self) -> _Socket:
            return self

        def __exit__(self, *a: object) -> None:
            return None

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(offers)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(process, "_handed_out", set())
    monkeypatch.setattr(process.socket, "socket", _Socket)
    assert [process.free_port(), process.free_port()] == [61001, 61002]
