"""Every entry of the doctor's known-bug table is reported, with its upstream source, for a release that has it
(and not for one that does not), by ``rr-server doctor`` against a server that says it is that release.

The server is the TEST-ONLY protocol server with its ``/rr/info`` identity set (engine, version, platform): the
table is keyed on what a real server reports there. Which releases have a bug comes from the engine's version facts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from rr_server.cli import main as cli
from rr_server.doctor.known_bugs import _BUGS, KnownBug
from rr_server.serving.engines import releases
from tests.support.protocol_server import ProtocolTestServer

VERSIONS = {"vllm": [f"0.{m}.0" for m in range(14, 34)], "sglang": [f"0.5.{p}" for p in range(7, 24)]}


def _has(bug: KnownBug, version: str) -> bool:
    facts = releases(bug.engine).facts_for(version)
    return bug.fact == "always" or bool(getattr(facts, bug.fact))


def affected(bug: KnownBug) -> str:
    return next(v for v in VERSIONS[bug.engine] if _has(bug, v))


@pytest.fixture(scope="module")
def server() -> Iterator[ProtocolTestServer]:
    with ProtocolTestServer(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as s:
        yield s


def doctor(server: ProtocolTestServer, capsys: pytest.CaptureFixture[str], **identity: Any) -> dict[str, Any]:
    server.behaviour.identity = identity
    cli(["doctor", server.url, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "bug", _BUGS, ids=[f"{b.engine}-{b.fact}-{b.platform or 'any'}-{i}" for i, b in enumerate(_BUGS)]
)
def test_the_doctor_reports_each_known_bug_for_an_affected_release(
    bug: KnownBug, server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bug.source and ("#" in bug.source or "found by rr" in bug.source or "docs/" in bug.source)
    version = affected(bug)
    rep = doctor(server, capsys, engine=bug.engine, engine_version=version, platform=bug.platform or "cuda")
    got = {b["what"]: b for b in rep["known_bugs"]}
    assert bug.what in got, (version, list(got))
    assert got[bug.what]["source"] == bug.source and got[bug.what]["coverage"] == bug.patched
    fixed = [v for v in VERSIONS[bug.engine] if not _has(bug, v)]
    if fixed:  # a release without it does not list it
        rep = doctor(server, capsys, engine=bug.engine, engine_version=fixed[-1], platform=bug.platform or "cuda")
        assert bug.what not in {b["what"] for b in rep["known_bugs"]}
    if bug.platform is not None:  # another platform does not list it; an unknown one lists it conditionally
        rep = doctor(server, capsys, engine=bug.engine, engine_version=version, platform="other")
        assert bug.what not in {b["what"] for b in rep["known_bugs"]}
        server.behaviour.identity = {"engine": bug.engine, "engine_version": version}
        cli(["doctor", server.url, "--json"])
        unknown = {b["what"]: b for b in json.loads(capsys.readouterr().out)["known_bugs"]}
        assert unknown[bug.what]["coverage"].startswith("if on ")


def test_the_published_bugs_the_doctor_must_know_are_all_listed() -> None:
    sources = " ".join(b.source for b in _BUGS)
    for ref in (
        "vllm#44116",
        "#44214",
        "vllm#48622",
        "sglang#26980",
        "sglang#29040",
        "vllm-ascend#16314",
        "vllm-ascend#13882",
        "PR #26423",
        "sglang#20964",
    ):
        assert ref in sources, ref
    whats = " ".join(b.what for b in _BUGS)
    assert "torch.compile" in whats and "{}" in whats


def test_speculative_decoding_shows_in_the_identity(
    server: ProtocolTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rep = doctor(server, capsys, engine="vllm", engine_version="0.30.0", platform="cuda", speculative="ngram")
    (ident,) = [c for c in rep["checks"] if c["name"] == "identity"]
    assert "speculative decoding ngram (ground truth below runs with it)" in ident["detail"]
    server.behaviour.identity = {}
