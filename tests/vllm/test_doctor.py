"""``rr-server doctor`` on the real vLLM CPU server: PASS with 100% agreement against the served checkpoint,
the same through its in-process sidecar (``--engine vllm``), and FAIL when ``--model-path`` is another model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rr_server.cli import main as cli
from rr_server.tiny_moe import build_tiny_moe
from tests.support.vllm_process import CACHE
from tests.vllm.conftest import MODEL_SPECS

pytestmark = pytest.mark.vllm_server


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = cli(["doctor", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", [None, "vllm"], ids=["patched", "unpatched-via-sidecar"])
def test_doctor_passes_with_full_agreement(qwen_server: Any, engine: str | None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--engine", engine] if engine else []
    rc, rep = _report(capsys, qwen_server.base_url, "--model-path", str(qwen_server.model_dir), *extra)
    assert rc == 0 and rep["verdict"] == "PASS", [c for c in rep["checks"] if not c["ok"]]
    assert rep["deployment"] == ("unpatched" if engine else "patched")
    assert rep["ground_truth"]["agreement"] == 1.0 and rep["ground_truth"]["compared"] > 100
    assert {c["name"] for c in rep["checks"]} >= {"identity", "single", "batch", "n=2", "routed_experts_start",
                                                   "prefix-cache hit", "mixed batch", "ground truth"}
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


def test_doctor_refuses_a_model_path_of_other_dims(qwen_server: Any, tiny_models: dict[str, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = _report(capsys, qwen_server.base_url, "--model-path", str(tiny_models["mixtral_300"]))
    assert rc == 1
    (mp,) = [c for c in rep["checks"] if c["name"] == "model path"]
    assert "is not the served model" in mp["detail"] and "num_experts server 8 vs checkpoint 300" in mp["detail"]
