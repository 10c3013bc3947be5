"""examples/plain_loop_r3.py, run against the real vLLM CPU server: a plain PyTorch loop over ReplaySession.

Here without ``--weight-sync`` (the pool's shared server must keep its weights); with it, a weight push before every
rollout, it runs in tests/vllm/test_trl_grpo.py against that module's dev-mode server (its weights change anyway:
one server start fewer).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rr_client import ConfigurationError, RRInfo
from rr_client.trainer import keys as K
from tests.support.scripts import load_script
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "plain_loop_r3.py"
# the deterministic run: seeded sampling (step s samples with seed s) and lr 5e-3 (at 5e-2 TRL's sequence mask zeroed
# every sample by step 2 on some draws, CI stop 63)
SEEDED = ["--steps", "3", "--lr", "5e-3", "--seed", "0"]


def load_example() -> ModuleType:
    """examples/plain_loop_r3.py as a module (its main() returns the per-step history)."""
    return load_script(EXAMPLE, "plain_loop_r3")


def test_the_loop_is_under_60_lines() -> None:
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "the loop" in line and line.strip().startswith("#"))
    end = next(i for i, line in enumerate(lines) if "end of the loop" in line)
    assert 5 < end - start - 1 < 60


# by reference at temperature 0.7: the trainer's log_softmax(logits / 0.7) against the engine's processed log-probs
@pytest.mark.parametrize("how", [[], ["--by-reference", "--temperature", "0.7"]], ids=["inline", "by_reference_t07"])
def test_plain_loop_replays_every_step(
    qwen_server: VLLMProcess, tiny_models: dict[str, Path], how: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example()
    model = str(tiny_models["qwen3_dense"])
    history = example.main(["--url", qwen_server.base_url, "--model-path", model, *SEEDED, *how])
    out = capsys.readouterr().out
    assert [h["step"] for h in history] == [0, 1, 2]
    # the toy reward varies between samples, so the policy loss is not stuck at 0 (it was: every completion hit the
    # token limit under a length reward)
    assert all(h["reward_std"] > 0 and abs(h["loss"]) > 1e-6 for h in history), history
    for h in history:
        assert h[K.AUDITED] == 1.0 and h[K.APPLIED_SHARE] == 1.0 and h[K.APPLIED_SHARE_MIN_LAYER] == 1.0
        assert h[K.REPLAYED_ROWS] > 0 and h[K.MOE_LAYERS] == 2 and h[K.LOGP_TOKENS] > 0
    # step 0: the trainer holds the engine's weights (fp32): its log-probs under the engine's routing match
    assert history[0][K.MEAN_ABS_LOGP_DIFF] < 1e-4 and history[0][K.AGREEMENT] == 1.0
    # later steps: the trainer moved on and the engine did not; the gap shows it, replay still applies, and the run
    # says why, once, before its first step
    assert history[2][K.MEAN_ABS_LOGP_DIFF] > history[0][K.MEAN_ABS_LOGP_DIFF]
    lines = out.splitlines()
    assert lines.count(example.NO_SYNC_NOTE) == 1 and lines.index(example.NO_SYNC_NOTE) < lines.index(
        next(line for line in lines if line.startswith("step 0:"))
    )
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith("weights not pushed") for line in steps), steps


def test_indexer_against_vllm_is_refused_in_one_line(qwen_server: VLLMProcess, tmp_path: Path) -> None:
    """``--indexer`` against vLLM: exit 1 with one line naming what indexer replay needs, read from the server's
    /rr/info before the model is loaded (the model path does not exist: loading it would fail otherwise)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", qwen_server.base_url, "--model-path", str(tmp_path / "absent"),
         "--indexer"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("plain_loop_r3.py: --indexer: indexer picks need an rr-patched SGLang 0.5.23+ launched with")
    assert "--enable-return-indexer-topk" in line and f"{qwen_server.base_url} is vllm " in line


def _info(engine: str, **extra: object) -> RRInfo:
    """A tiny model's /rr/info on ``engine``; ``extra``: indexer dims, capture refusals."""
    return RRInfo(
        engine=engine, engine_version="0.5.23", rr_version="0", num_hidden_layers=3, num_experts=8, topk=2,
        moe_layers=[0, 2], wire_dtype="uint8", **extra,
    )  # fmt: skip


def test_indexer_check_reads_the_servers_info() -> None:
    example = load_example()
    dsa = {"indexer_layers": [0, 1, 2], "index_topk": 4}
    example.check_indexer_capture(_info("sglang", **dsa), "http://x")  # rr-patched SGLang, a DSA model: passes
    with pytest.raises(ConfigurationError, match=r"the model http://x serves has no indexer"):
        example.check_indexer_capture(_info("sglang"), "http://x")  # no indexer in the model
    with pytest.raises(ConfigurationError, match=r"http://x refuses its indexer picks: fused top-k"):
        example.check_indexer_capture(
            _info("sglang", **dsa, capture_refused={"indexer_topk": "fused top-k"}), "http://x"
        )
    with pytest.raises(ConfigurationError, match=r"is vllm 0\.5\.23, which captures no indexer top-k"):
        example.check_indexer_capture(_info("vllm", **dsa), "http://x")
