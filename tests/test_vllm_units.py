"""Fast unit tests (no server): /generate parsing, sampling translation, launcher flags, plugin gating."""

from __future__ import annotations

import numpy as np
import pytest

from rr_server.launch_vllm import build_command
from rr_server.protocol import (
    BadRequest,
    RoutingDims,
    build_item,
    parse_generate_request,
    to_vllm_sampling_kwargs,
)


def test_parse_single_and_batch() -> None:
    r = parse_generate_request(b'{"text": "hi", "return_routed_experts": true, "routed_experts_start": 2}')
    assert r.prompts == ["hi"] and not r.is_batch and r.return_routed_experts and r.routed_experts_start == 2
    r = parse_generate_request({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {}]})
    assert r.is_batch and r.prompts == [[1, 2], [3]] and [s.n for s in r.sampling] == [2, 1]
    r = parse_generate_request({"text": "a", "routed_experts_start_len": 4})  # SGLang's older name
    assert r.routed_experts_start == 4


@pytest.mark.parametrize("body", [
    b"{", b"[]", b'{"text": ""}', b'{"input_ids": []}', b'{"text": 1}', b'{"text": "a", "stream": "no"}',
    b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', b'{"text": "a", "foo": 1}',
    b'{"text": "a", "sampling_params": {"top_k": -3}}',
])
def test_parse_rejects(body: bytes) -> None:
    with pytest.raises(BadRequest) as e:
        req = parse_generate_request(body)
        to_vllm_sampling_kwargs(req.sampling[0], routed_experts_start=0, return_logprob=False)
    assert e.value.status == 400 and str(e.value)


def test_sampling_translation() -> None:
    req = parse_generate_request({"text": "a", "sampling_params": {
        "max_new_tokens": 7, "stop": ["x"], "top_k": -1, "sampling_seed": 3, "no_stop_trim": True}})
    kw = to_vllm_sampling_kwargs(req.sampling[0], routed_experts_start=5, return_logprob=True)
    assert kw["max_tokens"] == 7 and kw["stop"] == ["x"] and kw["top_k"] == 0 and kw["seed"] == 3
    assert kw["include_stop_str_in_output"] and kw["routed_experts_prompt_start"] == 5 and kw["logprobs"] == 0


def test_build_item_validates_routing() -> None:
    dims = RoutingDims(num_hidden_layers=2, num_experts=300, topk=2)
    good = np.array([[[1, 299], [3, 4]]] * 4)
    item = build_item(rid="r", text="t", output_ids=[1, 2], prompt_tokens=3, cached_tokens=0, finish_reason=None,
                      e2e_latency=0.0, routing=good, dims=dims, want_routing=True)
    assert item["meta_info"]["routed_experts_shape"] == [4, 2, 2]
    assert item["meta_info"]["routed_experts_dtype"] == "uint16"
    bad = build_item(rid="r", text="t", output_ids=[1, 2, 3], prompt_tokens=3, cached_tokens=0, finish_reason=None,
                     e2e_latency=0.0, routing=good, dims=dims, want_routing=True)
    assert "routed_experts" not in bad["meta_info"] and "routed_experts_error" in bad["meta_info"]
    none = build_item(rid="r", text=None, output_ids=[1], prompt_tokens=3, cached_tokens=0, finish_reason=None,
                      e2e_latency=0.0, routing=good, dims=dims, want_routing=False)
    assert "routed_experts" not in none["meta_info"] and "text" not in none


def test_launcher_cpu_flags() -> None:
    cmd, notes = build_command(["--model", "m", "--dtype", "bfloat16", "-O3"], cpu=True)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-return-routed-experts" in cmd and "--enforce-eager" in cmd and "-O3" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "bfloat16" not in cmd
    assert "--kv-cache-memory-bytes" in cmd and len(notes) == 1
    cmd, notes = build_command(["--model", "m", "--kv-cache-memory-bytes", "1"], cpu=True)
    assert cmd.count("--kv-cache-memory-bytes") == 1
    cmd, notes = build_command(["--model", "m"], cpu=False)
    assert "--enforce-eager" not in cmd and not notes


def test_version_gate() -> None:
    from rr_patches.vllm.plugin import UnsupportedVLLMVersion, check_vllm_version

    assert check_vllm_version("0.30.0") == "0.30.0"
    assert check_vllm_version("0.22.1+cpu") == "0.22.1+cpu"
    for v in ("0.21.0", "0.31.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMVersion):
            check_vllm_version(v)
    assert check_vllm_version("0.31.0", allow_unsupported=True) == "0.31.0"


def test_plugin_noop_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_patches.vllm import plugin

    monkeypatch.delenv("RR_ENABLE", raising=False)
    plugin.register()
    assert not plugin._state["registered"]


def test_plugin_hooks_build_app_idempotently(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_patches.vllm import plugin

    monkeypatch.setenv("RR_ENABLE", "1")
    monkeypatch.setitem(plugin._state, "registered", False)
    plugin.register()
    plugin.register()  # re-entrant
    from vllm.entrypoints.launchers.api_server import entry

    assert getattr(entry.build_app, "__rr_patched__", False)
    assert not getattr(entry.build_app.__wrapped__, "__rr_patched__", False), "wrapped exactly once"
    monkeypatch.setitem(plugin._state, "registered", False)
    plugin.register()  # a second registration pass must not wrap twice
    assert not getattr(entry.build_app.__wrapped__, "__rr_patched__", False)


@pytest.mark.parametrize("version,cpu", [("0.29.0", True), ("0.21.0", False), ("0.31.0", False)])
def test_launcher_refuses(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                          version: str, cpu: bool) -> None:
    import subprocess

    from rr_server import launch_vllm

    monkeypatch.setattr(launch_vllm, "_installed_vllm_version", lambda: version)
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: cpu)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("must not launch"))
    assert launch_vllm.main(["--model", "m"]) == 2
    assert version in capsys.readouterr().err
