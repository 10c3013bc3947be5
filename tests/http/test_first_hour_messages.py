"""What a newcomer reads when pointed at the wrong place: the doctor never says more than it knows (no "patched" for a
port nobody listens on, no internal host names, no raw transport text, a server without routing capture fails its
identity), URLs are refused when the client is built, and a P/D client at a non-P/D pair says what a pair needs.
Against the TEST-ONLY protocol server (its ``/rr/info`` is set per test)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from rr_client import ConfigurationError, PDClient, RoutedExpertsClient
from rr_server.cli import main as cli
from rr_server.doctor.checks import plain_error
from rr_server.launch.process import free_port
from tests.support.protocol_server import ProtocolTestServer


@pytest.fixture
def server() -> Iterator[ProtocolTestServer]:
    with ProtocolTestServer(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as s:
        yield s


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = cli(["doctor", *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_nothing_listening_is_unreachable_not_patched(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rc, out = _doctor(capsys, url)
    assert rc == 1 and out.startswith(f"FAIL  rr doctor: {url} (unreachable)"), out
    assert f"nothing answers at {url}: is an rr server running there?" in out
    assert "patched" not in out and "ConnectError" not in out and "connection attempts" not in out
    rc, out = _doctor(capsys, url, "--engine", "vllm")
    assert rc == 1 and f"nothing answers at {url}: is the vllm engine running there" in out, out
    assert "rr-doctor-sidecar" not in out and "ServerError" not in out and "503" not in out


def test_engine_mode_at_a_non_engine_names_the_url_not_the_doctors_sidecar(
    server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _doctor(capsys, server.url, "--engine", "vllm")
    assert rc == 1 and "rr-doctor-sidecar" not in out, out
    assert f"{server.url} does not answer as a vllm engine" in out
    assert "rr-server proxy --upstream" not in out  # the advice for a client at an engine, not for --engine


def test_identity_fails_without_routing_capture(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.behaviour.identity = {"routing_enabled": False}
    rc, out = _doctor(capsys, server.url, "--json")
    report = json.loads(out[out.index("{") :])
    (identity,) = [c for c in report["checks"] if c["name"] == "identity"]
    assert rc == 1 and identity["ok"] is False
    assert "runs without routing capture (/rr/info routing_enabled: false)" in identity["detail"]
    assert "--enable-return-routed-experts" in identity["detail"] and "rr-server launch" in identity["detail"]
    assert [c["name"] for c in report["checks"]] == ["identity"]  # nothing after it claims routing is fine


def test_report_errors_carry_no_httpx_links() -> None:
    req = httpx.Request("POST", "http://127.0.0.1:8000/generate")
    resp = httpx.Response(400, request=req, json={"error": {"message": "routing is off"}})
    err = httpx.HTTPStatusError("Client error '400 Bad Request' For more information check: https://x", request=req,
                                response=resp)  # fmt: skip
    assert plain_error(err) == "HTTP 400 from POST /generate: routing is off"
    assert plain_error(ValueError("bad\nsecond line For more information check: x")) == "bad"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://host:1", "http://"])
def test_a_url_without_a_scheme_or_host_is_refused_when_the_client_is_built(url: str) -> None:
    with pytest.raises(ConfigurationError, match=f"base_url '{url}' is not an http\\(s\\) URL: write http://HOST:PORT"):
        RoutedExpertsClient(url)
    with pytest.raises(ConfigurationError, match="is not an http"):
        RoutedExpertsClient(["http://127.0.0.1:1", url])


async def test_pd_client_at_a_non_pd_pair_says_what_a_pair_needs(server: ProtocolTestServer) -> None:
    server.behaviour.identity = {"engine": "vllm", "engine_version": "0.30.0"}
    async with PDClient(server.url, server.url, bootstrap_port=8998, retries=0) as pd:
        with pytest.raises(ConfigurationError) as ei:
            await pd.generate([[1, 2, 3]], {"max_new_tokens": 2})
    assert str(ei.value) == (
        "P/D needs a SGLang 0.5.22+ prefill/decode pair (--disaggregation-mode prefill and decode, through "
        f"rr-server launch): {server.url} is vllm 0.30.0"
    )
    server.behaviour.identity = {"engine": "sglang", "engine_version": "0.5.21"}
    async with PDClient(server.url, server.url, bootstrap_port=8998, retries=0) as pd:
        with pytest.raises(ConfigurationError, match="is sglang 0.5.21"):
            await pd.generate([[1, 2, 3]], {"max_new_tokens": 2})
