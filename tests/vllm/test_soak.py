"""The soak's short version (issue 20): benchmarks/soak.py's own loop, small, against the rr-patched vLLM server
and the sidecar in front of an unpatched vLLM. Every request ends ok or disconnected by the client on purpose:
0 errors, 0 hung, 0 top-k sets that differ from transformers' router, and both keep serving after clients left
mid-request. Memory and speed are the benchmark's to report (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_process import CACHE

pytestmark = pytest.mark.vllm_server
REPO = Path(__file__).resolve().parents[2]


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("rr_bench_soak", REPO / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the module runs
    spec.loader.exec_module(mod)
    return mod


SOAK = _soak_module()


@pytest.fixture(scope="module")
def targets() -> Iterator[Any]:
    model = SOAK.soak_model(CACHE / "soak-qwen3", 4096)  # positions raised: prompts past the stock 2048
    t = SOAK.Targets(model, 4096, CACHE / "logs" / "soak")
    try:
        t.wait()
        yield t
    finally:
        t.stop()


@pytest.mark.parametrize("which", ["patched", "sidecar"])
def test_short_soak(targets: Any, which: str) -> None:
    url = targets.patched_url if which == "patched" else targets.sidecar_url
    report = asyncio.run(SOAK.soak(url, targets.model_dir, target=which, requests=160, concurrency=16,
                                   prompt_tokens=2560, max_new=8, disconnect_every=10, check_every=4, timeout=120,
                                   warmup=16))
    assert report.requests == 176
    assert dict(report.errors) == {} and report.hung == 0, report.first_error
    assert report.disconnected >= 10 and report.ok + report.disconnected == report.requests
    assert report.checked_rows > 20 * 1000 and report.mismatched_sets == 0, report.first_mismatch
    assert not report.stopped_at_limit
