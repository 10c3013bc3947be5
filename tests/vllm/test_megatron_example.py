"""examples/megatron_r3.py against the real vLLM CPU server, on two gloo ranks of real megatron-core: no pipelining
(PP=1) and 1F1B (PP=2, full recompute), one spawn for both (tests/megatron/launcher.py, CPU test-side patches in
tests/megatron/harness.py, applied before the example runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rr_client.trainer import keys as K
from tests.support.scripts import load_script
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_r3.py"


def _run(rank: int, pp: int) -> list[dict[str, float]]:
    """One rank: Megatron's parallel state for ``pp`` stages, then the example's loop."""
    from tests.megatron import harness as H

    H.init_parallel(rank=rank, world_size=2, pp=pp)
    H.new_model_state()
    example = load_script(EXAMPLE, "megatron_r3")
    return example.main(
        [
            "--url",
            os.environ["MEGATRON_EXAMPLE_URL"],
            "--model-path",
            os.environ["MEGATRON_EXAMPLE_MODEL"],
            "--pp",
            str(pp),
            "--steps",
            "2",
        ]
    )


def no_pipelining(rank: int) -> list[dict[str, float]]:
    """PP=1 (two data-parallel ranks): forward_backward_no_pipelining."""
    return _run(rank, 1)


def one_f_one_b(rank: int) -> list[dict[str, float]]:
    """PP=2: forward_backward_pipelining_without_interleaving, each stage replaying its own layers."""
    return _run(rank, 2)


def test_megatron_example_replays_every_router(
    qwen_server: VLLMProcess, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.megatron.launcher import results_of, run_cases

    monkeypatch.setenv("MEGATRON_EXAMPLE_URL", qwen_server.base_url)
    monkeypatch.setenv("MEGATRON_EXAMPLE_MODEL", str(tiny_models["qwen3_dense"]))
    outcomes = run_cases([no_pipelining, one_f_one_b])
    flat = results_of(outcomes, no_pipelining)
    piped = results_of(outcomes, one_f_one_b)
    for rank_history in flat:  # layers 1 and 3 are MoE (layer 2 dense): both routers on every rank
        assert [h["step"] for h in rank_history] == [0, 1]
        for h in rank_history:
            assert h[K.AUDITED] == 1.0 and h[K.APPLIED_SHARE] == 1.0 and h[K.MOE_LAYERS] == 2
            assert h[K.REPLAYED_ROWS] > 0 and h[K.AGREEMENT] < 1.0  # a fresh model: its own choice differs
    first, last = piped  # stage 0: layers 1-2 (one router); stage 1: layer 3 (one router) and the loss
    for h in first + last:
        assert h[K.APPLIED_SHARE] == 1.0 and h[K.MOE_LAYERS] == 1 and h[K.REPLAYED_ROWS] > 0
    assert all(h["nll"] > 0 for h in last)


def test_megatron_example_runs_as_its_docstring_says(qwen_server: VLLMProcess, tiny_models: dict[str, Path]) -> None:
    """The docstring's own command (``torchrun --nproc-per-node 2 examples/megatron_r3.py ... --pp 2``), in a fresh
    process with no test-side patch: the example's own CPU stand-ins carry it. Each rank prints its step; the loss
    is named only where it exists (the last pipeline stage)."""
    from rr_server.launch.process import free_port

    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())),
        *(str(EXAMPLE), "--url", qwen_server.base_url, "--model-path", str(tiny_models["qwen3_dense"])),
        *("--pp", "2", "--steps", "1"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=EXAMPLE.parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d step \d+: .*?stale masked \d+", proc.stdout))  # each rank's line whole
    assert len(lines) == 2 and all("step 0: applied 1.000" in line for line in lines), lines
    assert "(no loss on this pipeline stage)" in lines[0] and "nll " in lines[1] and "nan" not in lines[1], lines
