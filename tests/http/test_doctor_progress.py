"""``rr-server doctor`` prints each check's line (stderr) as the check finishes, before the next one runs; the
report follows on stdout, and ``--json`` keeps stdout one JSON document (against the TEST-ONLY protocol server)."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from rr_server.cli import main as cli
from rr_server.doctor import CheckPrinter
from rr_server.doctor import checks as doctor_checks
from rr_server.doctor.checks import run_doctor
from rr_server.progress import Steps
from tests.support.protocol_server import ProtocolTestServer

REPORT_KEYS = {"url", "deployment", "identity", "known_bugs", "checks", "ground_truth", "cost", "seams", "verdict"}


@pytest.fixture
def server() -> Iterator[ProtocolTestServer]:
    with ProtocolTestServer(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as s:
        yield s


def test_each_check_is_printed_before_the_next_runs(
    server: ProtocolTestServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the user has seen when the n=2 check starts: the earlier checks' lines, and nothing on stdout yet."""
    seen: list[tuple[str, str]] = []
    n2 = doctor_checks._Doctor._n2

    async def spy(self: Any, prompt: list[int]) -> None:
        seen.append(capsys.readouterr())
        await n2(self, prompt)

    monkeypatch.setattr(doctor_checks._Doctor, "_n2", spy)
    assert cli(["doctor", server.url]) == 0
    (before_out, before_err), (out, err) = seen[0], capsys.readouterr()
    assert before_out == ""  # the report comes at the end
    assert before_err.startswith(f"rr doctor: checking {server.url}")
    for name in ("identity", "single", "batch"):
        assert re.search(rf"^  ok   {name} +\d+\.\d+s  \S", before_err, re.M), before_err
    assert "n=2" not in before_err and "mixed batch" not in before_err
    assert re.search(r"^  ok   n=2 +\d+\.\d+s  the prompt rows of 2 samples", err, re.M)
    assert re.search(r"^  ok   mixed batch +\d+\.\d+s", err, re.M)
    assert "\x1b" not in before_err + err  # not a terminal: plain lines
    assert out.startswith("PASS  rr doctor:") and "\nchecks:\n" in out  # the report, unchanged, on stdout


def test_a_failed_check_streams_as_fail(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.behaviour.corrupt = "zero"
    assert cli(["doctor", server.url]) == 1
    out, err = capsys.readouterr()
    assert re.search(r"^  FAIL single +\d+\.\d+s  UnrecordedRoutingError", err, re.M)
    assert out.splitlines()[1].startswith("  FAIL single: UnrecordedRoutingError")


def test_json_stays_one_document_and_stderr_quiet_off_a_terminal(
    server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["doctor", server.url, "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)  # the whole of stdout is one JSON document
    assert out.startswith("{") and out.rstrip().endswith("}") and set(report) == REPORT_KEYS
    assert [c["name"] for c in report["checks"]] == [
        "identity",
        "single",
        "batch",
        "n=2",
        "routed_experts_start",
        "prefix-cache hit",
        "mixed batch",
        "source audit",
        "preemption",
        "weight update",
        "kv offload",
        "bounded replay",
    ]
    assert err == ""


async def test_on_a_terminal_the_running_check_has_a_spinner(server: ProtocolTestServer) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200, highlight=False, markup=False)
    with Steps(console) as steps:
        report = await run_doctor(server.url, progress=CheckPrinter(steps))
    drawn = buf.getvalue()
    assert report.ok and "mixed batch ..." in drawn and "\r" in drawn  # the live line, redrawn
    assert re.search(r"  ok   mixed batch +\d+\.\d+s", drawn)
