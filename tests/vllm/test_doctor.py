"""``rr-server doctor`` on the real vLLM CPU server: PASS with 100% agreement against the served checkpoint,
the same through its in-process sidecar (``--engine vllm``), and FAIL when ``--model-path`` is another model.
On a dev-mode server with a small KV cache the cache and weight-path probes run for real: preemption, a reload of
the served weights while requests are preempted, and KV offload (which vLLM 0.30 refuses with routing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rr_server.cli import main as cli
from rr_server.demo.tiny_moe import build_tiny_moe
from tests.support.vllm_process import CACHE, VLLMProcess, small_kv_dev_server
from tests.vllm.conftest import MODEL_SPECS

pytestmark = pytest.mark.vllm_server


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = cli(["doctor", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", [None, "vllm"], ids=["patched", "unpatched-via-sidecar"])
def test_doctor_passes_with_full_agreement(
    qwen_server: Any, engine: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--engine", engine] if engine else []
    rc, rep = _report(capsys, qwen_server.base_url, "--model-path", str(qwen_server.model_dir), *extra)
    assert rc == 0 and rep["verdict"] == "PASS", [c for c in rep["checks"] if not c["ok"]]
    assert rep["deployment"] == ("unpatched" if engine else "patched")
    assert rep["ground_truth"]["agreement"] == 1.0 and rep["ground_truth"]["compared"] > 100
    assert {c["name"] for c in rep["checks"]} >= {
        "identity",
        "single",
        "batch",
        "n=2",
        "routed_experts_start",
        "prefix-cache hit",
        "mixed batch",
        "ground truth",
    }
    (pc,) = [c for c in rep["checks"] if c["name"] == "prefix-cache hit"]
    if engine is None:  # a real hit: vLLM CPU caches 128-token blocks, rr's /generate reports them
        assert pc["ok"] and pc["exercised"] and "256 tokens from the prefix cache" in pc["detail"], pc
    else:  # vLLM's OpenAI usage carries cached tokens only with --enable-prompt-tokens-details: said, not claimed ok
        assert not pc["exercised"] and pc["detail"].startswith("not exercised: a repeated 300-token prompt"), pc
    cost = rep["cost"]
    assert cost["bytes_per_token_with"] > cost["bytes_per_token_without"] > 0
    assert any("torch.compile" in b["what"] for b in rep["known_bugs"])


def test_doctor_fails_against_another_checkpoint(qwen_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Same shapes, other weights: the routing is not this model's, and ground truth says so."""
    other = build_tiny_moe(CACHE / "qwen3_dense_other_seed", **{**MODEL_SPECS["qwen3_dense"], "seed": 7})
    rc, rep = _report(capsys, qwen_server.base_url, "--model-path", str(other))
    assert rc == 1 and rep["verdict"] == "FAIL"
    (gt,) = [c for c in rep["checks"] if c["name"] == "ground truth"]
    assert not gt["ok"] and "agrees on only" in gt["detail"]
    assert rep["ground_truth"]["agreement"] < 0.9


def test_doctor_refuses_a_model_path_of_other_dims(
    qwen_server: Any, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, rep = _report(capsys, qwen_server.base_url, "--model-path", str(tiny_models["mixtral_300"]))
    assert rc == 1
    (mp,) = [c for c in rep["checks"] if c["name"] == "model path"]
    assert "is not the served model" in mp["detail"] and "num_experts server 8 vs checkpoint 300" in mp["detail"]


# 16 blocks of 32 tokens (vLLM CPU wants multiples of 32; it serves a max-model-len up to 480, room for the 300-token
# prefix check):
# vLLM reports 15 of them usable (/metrics num_gpu_blocks): seven concurrent requests of 88 + 48 tokens overflow it.
SMALL_KV_BLOCKS = 16


@pytest.fixture(scope="module")
def small_kv_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """The tiny Qwen3-MoE in dev mode (the doctor may reload its weights) with a small KV cache."""
    yield from small_kv_dev_server(
        tiny_models["qwen3_dense"], name="doctor-small-kv", blocks=SMALL_KV_BLOCKS, max_model_len=448, core=1
    )


def test_doctor_probes_preemption_and_a_weight_update(
    small_kv_server: VLLMProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Preempted samples keep a non-preempted run's rows and say so; reloading the served weights mid-burst bumps
    weight_version and flags the preempted ones; KV offload is reported as refused by vLLM 0.30 itself."""
    model = str(small_kv_server.model_dir.resolve())  # no --model-path: the burst rows are checked against each other
    # one run, no retry: the burst is held behind vLLM's dev-mode /pause until all of it is in the engine, and the
    # reload lands while generation is frozen again, so a loaded machine cannot stagger either out of preemption
    rc, rep = _report(capsys, small_kv_server.base_url, "--probe-weight-update", model)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rc == 0 and rep["verdict"] == "PASS", [c for c in rep["checks"] if not c["ok"]]
    pre, upd, off = checks["preemption"], checks["weight update"], checks["kv offload"]
    assert pre["ok"] and pre["exercised"] and "7 concurrent requests of 88+48 tokens" in pre["detail"], pre
    assert "held until all 7 were in the engine" in pre["detail"], pre
    assert upd["ok"] and upd["exercised"], upd
    before, after = map(int, re.search(r"weight_version (\d+) -> (\d+)", upd["detail"]).groups())  # type: ignore[union-attr]
    assert after == before + 1, upd  # one reload, counted once
    assert not off["exercised"] and "refuses any KV connector" in off["detail"], off
    assert "rows after the reload equal those before" in upd["detail"], upd
