"""The soak's short version (issue 20): benchmarks/soak.py's own loop, small, against the rr-patched vLLM server
and the sidecar in front of an unpatched vLLM. Every request ends ok or disconnected by the client on purpose:
0 errors, 0 hung, 0 top-k sets that differ from transformers' router, and both keep serving after clients left
mid-request. Memory and speed are the benchmark's to report (docs/benchmarks.md), never asserted here; that they
are read, shown as progress and drawn (a whole PNG) is."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.png import png_size
from tests.support.scripts import load_script
from tests.support.vllm_process import CACHE

pytestmark = pytest.mark.vllm_server
REPO = Path(__file__).resolve().parents[2]


SOAK = load_script(REPO / "benchmarks" / "soak.py", "rr_bench_soak")


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
def test_short_soak(targets: Any, which: str, tmp_path: Path) -> None:
    url = targets.patched_url if which == "patched" else targets.sidecar_url
    pids = (
        {"patched": targets.patched.pid}
        if which == "patched"
        else {"proxy": targets.sidecar.pid, "vanilla": targets.vanilla.pid}
    )
    log = io.StringIO()  # not a terminal: plain progress lines, no bar
    progress = SOAK.Progress(which, 72, every=20, stream=log)
    report = asyncio.run(
        SOAK.soak(
            url,
            targets.model_dir,
            target=which,
            requests=64,
            concurrency=16,
            prompt_tokens=2560,
            max_new=8,
            disconnect_every=10,
            check_every=4,
            timeout=120,
            warmup=8,
            pids=pids,
            sample_every=16,
            progress=progress,
        )
    )
    progress.close()
    assert report.requests == 72
    assert dict(report.errors) == {} and report.hung == 0, report.first_error
    assert report.disconnected >= 6 and report.ok + report.disconnected == report.requests
    assert report.checked_rows > 20 * 1000 and report.mismatched_sets == 0, report.first_mismatch
    assert not report.stopped_at_limit
    # memory read at each stage and every 16 units, progress every 20 units and at the end, and drawn
    assert set(report.rss_mb) == set(pids) and all(
        st.keys() == {"start", "warm-up", "end"} for st in report.rss_mb.values()
    )
    assert [n for n, _ in report.samples] == [16, 32, 48, 64] and all(mb > 0 for _, mb in report.samples)
    lines = log.getvalue().splitlines()
    assert [int(re.match(rf"{which}: (\d+)/72 units, ", line).group(1)) for line in lines] == [20, 40, 60, 72]
    assert "RSS" in lines[-1]
    png = SOAK.plot_memory([report], tmp_path / "soak.png")
    assert png_size(png) == (800, 400) and png.stat().st_size > 10_000
