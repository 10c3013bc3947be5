"""``rr-server doctor``'s ``bounded replay`` check (issue 44) against the TEST-ONLY :class:`BoundedReplayTestServer`:
a vLLM 0.33 / SGLang 0.5.23 serving a model that says it is DeepSeek-V4.1 (or not), reporting SWA bounded replay on,
off or nothing, and answering with the stale late-layer rows bounded replay leaves (or exact ones).

FAIL when it is on for DeepSeek-V4.1, naming the flag that turns it off; FAIL when the prompt rows differ from a full
prefill though the server does not say; ok when off; not probed when the model has none. Nothing else fails.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rr_server.cli import main as cli
from tests.support.bounded_replay_server import BoundedReplayTestServer

OFF = {"vllm": "--no-swa-bounded-replay", "sglang": "--no-enable-decoder-swa-bounded-replay"}


def _doctor(server: BoundedReplayTestServer, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """The doctor's exit code and its ``bounded replay`` check; every other check must pass."""
    rc = cli(["doctor", server.url, "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    others = {n: c["detail"] for n, c in checks.items() if not c["ok"] and n != "bounded replay"}
    assert others == {}, others
    return rc, checks["bounded replay"]


@pytest.mark.parametrize(("engine", "model_folder"), [("vllm", True), ("sglang", False)])
def test_bounded_replay_on_for_deepseek_v41_fails_naming_the_way_out(
    engine: str, model_folder: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """On, as the server says, for a DeepSeek-V4.1 (its config.json, or SGLang's /model_info): FAIL with the flag
    that turns it off, and the probe's figures: stale prompt rows vs a full prefill."""
    with BoundedReplayTestServer(engine, said=True, replays=True, model_folder=model_folder) as server:
        rc, check = _doctor(server, capsys)
        assert server.full_prefills == 1  # the probe asked for one full prefill (prompt log-probs)
    detail = check["detail"]
    assert rc == 1 and not check["ok"] and check["exercised"], check
    assert detail.startswith("DeepSeek-V4.1 with SWA bounded replay on") and OFF[engine] in detail, detail
    said = "/metrics vllm:cache_config_info swa_bounded_replay=True" if engine == "vllm" else "/get_server_info"
    assert said in detail and "model_type 'deepseek_v41'" in detail, detail
    assert "prompt rows of a 300-token prompt vs its full prefill (prompt log-probs): cold 60.67%" in detail, detail
    assert "log-probs differ from a trainer's full prefill" in detail


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_bounded_replay_off_passes(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    with BoundedReplayTestServer(engine, said=False, replays=False) as server:
        rc, check = _doctor(server, capsys)
    assert rc == 0 and check["ok"] and not check["exercised"], check
    assert check["detail"].startswith("not probed: off (") and "=False" in check["detail"], check


def test_a_model_without_bounded_replay_is_not_probed(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM reports it on for every model (its default); it acts on DeepSeek-V4.1 only."""
    with BoundedReplayTestServer("vllm", said=True, replays=False, model_type="qwen3_moe") as server:
        rc, check = _doctor(server, capsys)
        assert server.full_prefills == 0
    assert rc == 0 and check["ok"] and not check["exercised"], check
    assert "not DeepSeek-V4.1" in check["detail"] and "model_type 'qwen3_moe'" in check["detail"], check


@pytest.mark.parametrize(("replays", "ok"), [(True, False), (False, True)])
def test_unsaid_bounded_replay_is_judged_by_the_rows(
    replays: bool, ok: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """No /metrics: the prompt rows against a full prefill decide; stale rows FAIL naming the flag, exact rows pass
    with the caveat that the log-probs would still differ were it on."""
    with BoundedReplayTestServer("vllm", said=None, replays=replays) as server:
        rc, check = _doctor(server, capsys)
    detail = check["detail"]
    assert rc == (0 if ok else 1) and check["ok"] is ok and check["exercised"], check
    assert "the server does not say (no /metrics vllm:cache_config_info); on by default in vllm 0.33.0" in detail
    assert OFF["vllm"] in detail, detail
    if ok:
        assert "cold 100.00%, prefix hit (288 cached tokens) 100.00%" in detail, detail
    else:
        assert "prompt rows served as usual are not a full prefill's" in detail, detail
