"""rr's vLLM launcher and prefill/decode KV connectors, per release (rr_server/serving/disaggregation.py): where the
release cannot return routed experts with the connector, rr refuses before vLLM starts, naming the connector, the
release's rule and where P/D with routing runs; connectors the release accepts reach vLLM untouched."""

from __future__ import annotations

import json
import subprocess

import pytest

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
MULTI = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "OffloadingConnector"}, {"kv_connector": "MooncakeConnector"}]
    },
}
OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}


def launch(monkeypatch: pytest.MonkeyPatch, version: str, extra: list[str]) -> tuple[int | None, list[list[str]]]:
    from rr_server.launch import vllm as launch_vllm

    launched: list[list[str]] = []

    class Started(Exception):
        pass

    def popen(cmd: list[str], **_: object) -> None:
        launched.append(cmd)
        raise Started

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: version)
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("nothing may start"))
    monkeypatch.setattr(launch_vllm.lifeline, "start", lambda: pytest.fail("lifeline after the vLLM command"))
    monkeypatch.setattr(launch_vllm, "build_command", lambda argv, **kw: popen(argv))
    try:
        return launch_vllm.main(["--model", "m", *extra]), launched
    except Started:
        return None, launched


@pytest.mark.parametrize("version", ["0.31.0", "0.32.1", "0.33.0"])
@pytest.mark.parametrize(
    ("cfg", "named"), [(NIXL, "NixlConnector"), (MULTI, "MooncakeConnector")], ids=["nixl", "multi-mooncake"]
)
def test_p_d_connectors_are_refused_on_031_to_033(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], version: str, cfg: dict, named: str
) -> None:
    rc, launched = launch(monkeypatch, version, ["--kv-transfer-config", json.dumps(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and not launched
    assert f"vLLM {version}" in err and named in err and "PD auxiliary output is not supported" in err
    assert "SGLang" in err and "docs/scale-out.md" in err


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_an_offload_connector_reaches_vllm_on_031_plus(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    rc, launched = launch(monkeypatch, version, [f"--kv-transfer-config={json.dumps(OFFLOAD)}"])
    assert rc is None and launched and f"--kv-transfer-config={json.dumps(OFFLOAD)}" in launched[0]


@pytest.mark.parametrize("cfg", [NIXL, OFFLOAD], ids=["nixl", "offload"])
def test_vllm_030_refuses_every_kv_connector(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cfg: dict
) -> None:
    rc, launched = launch(monkeypatch, "0.30.0", ["--kv_transfer_config", json.dumps(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and not launched
    assert "vLLM 0.30.0" in err and cfg["kv_connector"] in err and "incompatible with KV connectors" in err


def test_without_a_kv_connector_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_server.serving.disaggregation import kv_connectors, kv_transfer_config, pd_refusal

    assert pd_refusal("0.33.0", ["--model", "m"]) is None
    assert pd_refusal("0.33.0", ["--kv-transfer-config", "not json"]) is None  # vLLM answers for its own flag
    assert kv_connectors(MULTI) == ["MultiConnector", "OffloadingConnector", "MooncakeConnector"]
    assert kv_transfer_config(["--kv-transfer-config=" + json.dumps(NIXL)]) == NIXL


def test_the_refused_connectors_are_the_engines_own_list() -> None:
    """The facts: 0.30 refuses every connector, 0.31+ the five P/D connectors of its own config check
    (``VllmConfig._verify_aux_output_compatibility``, read in 0.31-0.33's source)."""
    from rr_server.serving.engines.vllm import PD_CONNECTORS, facts_for

    assert facts_for("0.31.0").pd_connectors_refused == PD_CONNECTORS
    assert facts_for("0.30.0").pd_connectors_refused == () and facts_for("0.30.0").kv_connector_refused
    assert not facts_for("0.33.0").kv_connector_refused


@pytest.mark.parametrize("version", ["0.5.7", "0.5.9", "0.5.12", "0.5.21", "0.5.22", "0.5.23"])
@pytest.mark.parametrize("mode", ["prefill", "decode", "null"])
def test_sglang_disaggregation_is_refused_where_the_prefill_server_returns_no_rows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], version: str, mode: str
) -> None:
    """SGLang's prefill server gathers the prompt's rows from 0.5.22 on; before, neither role of a pair can give a
    whole sample, so ``rr-server launch sglang --disaggregation-mode prefill|decode`` stops before SGLang is patched
    or started, naming the release's rule; 0.5.22+ and ``null`` go on."""
    from rr_server.launch import sglang as launch_sglang
    from rr_server.serving.engines import sglang as engine

    class Patched(Exception):
        pass

    def install_patch() -> str:
        raise Patched

    monkeypatch.setattr(engine, "installed_version", lambda: version)
    monkeypatch.setattr(launch_sglang, "install_patch", install_patch)
    argv = ["--model-path", "m", "--enable-return-routed-experts", f"--disaggregation-mode={mode}"]
    refused = mode != "null" and version not in ("0.5.22", "0.5.23")
    if refused:
        assert launch_sglang.main(argv) == 2
        err = capsys.readouterr().err
        assert f"SGLang {version} with --disaggregation-mode {mode}" in err and "0.5.22+" in err
    else:
        with pytest.raises(Patched):
            launch_sglang.main(argv)


def test_the_pd_sidecar_judges_a_prefill_server_by_its_release_and_lets_an_unknown_one_through() -> None:
    """Before 0.5.22 the reason names the rule; 0.5.22+ passes; an unparsable version ("unknown", a dev build) passes
    too, since each sample's own check still refuses a prefill answer without rows."""
    from rr_server.proxy.app import _pd_release_refusal

    assert "0.5.22+" in (_pd_release_refusal("0.5.21") or "")
    assert _pd_release_refusal("0.5.22") is None and _pd_release_refusal("unknown") is None
