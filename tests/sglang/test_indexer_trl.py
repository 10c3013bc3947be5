"""TRL 1.16's real GRPOTrainer (R3GRPOTrainer) replays both the experts and the sparse-attention indexer of a tiny
DeepSeek-V3.2, from rr-patched SGLang 0.5.23's real TokenizerManager and HTTP app served over real HTTP in its own
process (tests/sglang/pd_server.py, role ``null``; the stand-in scheduler's capturers and sampler report a
transformers forward of the same checkpoint). ``RRRollout(indexer=True)`` asks for the picks, which travel by
reference (the server's default) and are read per micro-batch; the trainer's step logs both audits under their own
keys."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.sglang.conftest import CACHE
from tests.sglang.deepseek_v32 import INDEX_TOPK, build_tiny_deepseek_v32
from tests.sglang.pd_server import PDServer
from tests.support.grpo import cpu_grpo_config
from tests.support.scripts import load_script

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
PROMPTS = ["the quick brown fox", "hello world and", "one two three four five six", "a b"]
INDEXER_LAYERS = 3


@pytest.fixture(scope="module")
def dsv32(tiny_moe: Path) -> Path:
    return build_tiny_deepseek_v32(CACHE / "sglang-deepseek-v32", tokenizer_from=tiny_moe)


@pytest.fixture(scope="module")
def server(dsv32: Path) -> Iterator[PDServer]:
    s = PDServer("null", dsv32, 0)
    try:
        s.wait()
        yield s
    finally:
        s.stop()


def length_reward(completions: list[str], **_: Any) -> list[float]:
    return [len(c) / 10.0 for c in completions]


def grpo_step(server: PDServer, dsv32: Path, out: Path, *, indexer: bool) -> tuple[dict[str, float], list[Any]]:
    """One R3GRPOTrainer step on a fresh copy of the checkpoint: its logged metrics and the rollout's samples."""
    import transformers
    from datasets import Dataset

    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout

    rollout = RRRollout(server.url, indexer=indexer)
    seen: list[list[Any]] = []
    generate = rollout.generate
    rollout.generate = lambda *a, **kw: seen.append(list(b := generate(*a, **kw))) or b  # type: ignore[method-assign]
    model = transformers.AutoModelForCausalLM.from_pretrained(dsv32, dtype=torch.float32, attn_implementation="eager")
    cfg = cpu_grpo_config(
        str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        learning_rate=2e-2,
    )
    trainer = R3GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=cfg,
        processing_class=transformers.AutoTokenizer.from_pretrained(dsv32),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        rollout_func=rollout,
        sync_weights=False,
        audit_every=1,
    )
    try:
        trainer.train()
    finally:
        rollout.close()
    (batch,) = seen
    (h,) = [x for x in trainer.state.log_history if "loss" in x]
    return h, batch


def test_a_grpo_step_replays_experts_and_indexer_by_reference(server: PDServer, dsv32: Path, tmp_path: Path) -> None:
    from rr_client.trainer import keys as K

    def store() -> dict[str, Any]:  # the indexer's own store (/rr/info shows it once its first ref was made)
        return httpx.get(server.url + "/rr/info", timeout=30).json().get("indexer_store") or {"read_bytes": 0}  # type: ignore[no-any-return]

    before = store()
    h, batch = grpo_step(server, dsv32, tmp_path / "both", indexer=True)
    assert all(r.indexer_ref is not None and r.indexer_ref.kind == "indexer" for r in batch)  # by reference
    assert store()["read_bytes"] > before["read_bytes"]  # ... read from the server's indexer store per micro-batch
    per_pass = sum(len(r.prompt_ids) + len(r.output_ids) - 1 - INDEX_TOPK for r in batch) * INDEXER_LAYERS
    # both replays ran in the step's forwards, every replayed row reached its router / attention
    assert h[K.APPLIED_SHARE] == 1.0 and h[K.REPLAYED_ROWS] > 0
    assert h[K.INDEXER_APPLIED_SHARE] == 1.0 and h[K.INDEXER_LAYERS] == INDEXER_LAYERS
    assert h[K.INDEXER_REPLAYED_ROWS] > 0 and h[K.INDEXER_REPLAYED_ROWS] % per_pass == 0
    # the trainer's own indexer picks otherwise on its padded batch (the control: agreement < 1; ties among zero
    # scores break by the key count); replayed, the routers all agree with the engine's and the log-probs equal its
    assert h[K.INDEXER_AGREEMENT] < 1.0
    assert h[K.AGREEMENT] == 1.0 and h[K.MEAN_ABS_LOGP_DIFF] < 1e-6
    # the same step with the experts replayed alone: those picks move the routers and the log-probs
    plain, _ = grpo_step(server, dsv32, tmp_path / "experts", indexer=False)
    assert [k for k in plain if k.startswith(K.INDEXER_PREFIX)] == [K.INDEXER_LEFT_LAYERS]
    assert plain[K.INDEXER_LEFT_LAYERS] == INDEXER_LAYERS and plain[K.APPLIED_SHARE] == 1.0
    assert plain[K.AGREEMENT] < 1.0 and plain[K.MEAN_ABS_LOGP_DIFF] > 1e-5


def test_the_plain_loop_example_replays_the_indexer_by_reference(server: PDServer, dsv32: Path) -> None:
    """examples/plain_loop_r3.py ``--indexer`` against the same server: a plain PyTorch loop over ReplaySession
    replays both, audited every step."""

    from rr_client.trainer import keys as K

    path = Path(__file__).resolve().parents[2] / "examples" / "plain_loop_r3.py"
    example = load_script(path, "plain_loop_r3")
    history = example.main(["--url", server.url, "--model-path", str(dsv32), "--steps", "2", "--indexer"])
    assert len(history) == 2
    for h in history:
        assert h[K.APPLIED_SHARE] == 1.0 and h[K.INDEXER_APPLIED_SHARE] == 1.0 and h[K.INDEXER_REPLAYED_ROWS] > 0
    assert history[0][K.MEAN_ABS_LOGP_DIFF] < 1e-6  # step 0: the engine's weights, its picks: its log-probs
    assert history[1][K.MEAN_ABS_LOGP_DIFF] > 1e-3  # step 1: the weights moved (no sync here), the gap shows it
