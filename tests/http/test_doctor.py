"""``rr-server doctor`` against the TEST-ONLY protocol server: each injected fault turns into a FAIL naming it.

The positive case and ground truth run on the real vLLM server (tests/vllm/test_doctor.py); here the
faults a real engine cannot be made to produce on demand: all-zero rows, another request's rows, a bad key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rr_server.cli import main as cli
from tests.support.fake_upstreams import FakeVLLMUpstream, write_fake_config
from tests.support.protocol_server import ProtocolTestServer


@pytest.fixture
def server() -> Iterator[ProtocolTestServer]:
    with ProtocolTestServer(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as s:
        yield s


def _doctor(url: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = cli(["doctor", url, *extra])
    return rc, capsys.readouterr().out


def test_healthy_synthetic_server_passes(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _doctor(server.url, capsys)
    assert rc == 0 and out.startswith("PASS"), out
    for name in ("single", "batch", "n=2", "routed_experts_start", "prefix-cache hit", "mixed batch", "source audit"):
        assert f"ok   {name}" in out
    assert "B/token with routing" in out
    assert "samples of the checks above re-scored in a fresh prefill" in out
    assert "repeated 300-token prompt, 288 tokens from the prefix cache" in out


def test_a_prefix_cache_that_never_hits_is_not_exercised(
    server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """cached_tokens=0 on a repeat is reported as "not exercised", never as ok (the rows from the cache were not seen)."""
    server.behaviour.prefix_cache = False
    rc, out = _doctor(server.url, capsys, "--json")
    report = json.loads(out)
    (pc,) = [c for c in report["checks"] if c["name"] == "prefix-cache hit"]
    assert pc["exercised"] is False and pc["detail"].startswith("not exercised: a repeated 300-token prompt")
    assert rc == 0 and report["verdict"] == "PASS"  # the other checks passed; nothing was shown wrong
    rc, text = _doctor(server.url, capsys)
    assert "  n/a  prefix-cache hit" in text and "ok   prefix-cache hit" not in text


def test_all_zero_rows_fail_with_their_cause(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.behaviour.corrupt = "zero"
    rc, out = _doctor(server.url, capsys)
    first = out.splitlines()
    assert rc == 1 and first[0].startswith("FAIL")
    assert "FAIL single: UnrecordedRoutingError" in first[1] and "all-zero" in first[1]


def test_rows_of_another_request_fail(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.behaviour.corrupt = "mixed"
    rc, out = _doctor(server.url, capsys, "--json")
    report = json.loads(out)
    assert rc == 1 and report["verdict"] == "FAIL"
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert {"batch", "prefix-cache hit", "mixed batch"} <= set(failed)
    assert "do not belong to this prompt" in failed["batch"]
    assert "another request's routing" in failed["mixed batch"]


def test_decode_rows_of_other_tokens_fail_the_source_audit_only(
    server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Generated rows that are other tokens' (``late_decode``) pass every check that compares prompt rows; the
    source audit's re-score catches them and says in which segment (issue 57)."""
    server.behaviour.corrupt = "late_decode"
    rc, out = _doctor(server.url, capsys, "--json")
    report = json.loads(out)
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert rc == 1 and set(failed) == {"source audit"}, failed
    assert "FLAGGED" in failed["source audit"] and "generated 0." in failed["source audit"]
    assert any(b.get("cache_salt") for b in server.behaviour.bodies)


def test_rejected_key_is_an_identity_failure(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.behaviour.reject_status = 401
    rc, out = _doctor(server.url, capsys)
    assert rc == 1  # /rr/info still answers; the first /generate is refused with a typed AuthenticationError
    assert "FAIL single: AuthenticationError" in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["doctor", "http://127.0.0.1:9", "--prompts", "2"]) == 2


@pytest.mark.parametrize(
    "mode,check,cause",
    [
        ("shift_layers", "single", "ShapeMismatchError"),  # caught by the full check: MoE ids on the dense layer
        ("swap_rows", "mixed batch", "another request's routing"),  # passes the full check; cross-request rows do not
    ],
)
def test_unpatched_engine_broken_behind_the_doctors_sidecar(
    tmp_path: Path, mode: str, check: str, cause: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--engine vllm`` against a FAKE recording vLLM that shifts layers or swaps requests' rows."""
    with FakeVLLMUpstream(write_fake_config(tmp_path)) as fake:
        fake.corrupt = mode
        rc, out = _doctor(fake.url, capsys, "--engine", "vllm", "--json")
    report = json.loads(out)
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert rc == 1 and report["verdict"] == "FAIL" and report["deployment"] == "unpatched"
    assert check in failed and cause in failed[check], failed


def test_unpatched_engine_healthy_behind_the_doctors_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeVLLMUpstream(write_fake_config(tmp_path)) as fake:
        rc, out = _doctor(fake.url, capsys, "--engine", "vllm")
    assert rc == 0 and out.startswith("PASS") and "(unpatched)" in out.splitlines()[0], out


def test_an_engine_without_rr_is_named_so_with_the_ways_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--engine``, a vLLM without rr's plugin (the FAKE recording upstream: it 404s ``/rr/info``) is never
    called patched: the identity check says it serves no rr routes and names the launcher, the sidecar and
    ``--engine``."""
    with FakeVLLMUpstream(write_fake_config(tmp_path)) as fake:
        rc, out = _doctor(fake.url, capsys)
    first = out.splitlines()[0]
    assert rc == 1 and first.startswith("FAIL") and "(no rr routes)" in first and "patched" not in first, out
    assert "NotAnRRServerError" in out and "rr-server launch vllm|sglang" in out and "rr-server proxy" in out
    assert "--engine vllm|sglang" in out
