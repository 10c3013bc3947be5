"""TRL 1.16's real ``GRPOTrainer.train`` with its own evaluation loop and ``num_iterations=2`` (issue 44): an eval
rollout between the two iterations of a training batch must not take the place of the rows rr keeps for that
batch, and the eval forwards replay the eval rollout's own rows.

The trainer is :class:`R3GRPOTrainer` over :class:`RRRollout` and rr's real client, against the TEST-ONLY protocol
server (tests/support/protocol_server.py: synthetic routing, no engine) given sampling log-probs (named below);
the model is rr's tiny Qwen3-MoE checkpoint (3 layers, layer 1 dense, 8 experts, top-2) on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rr_client.integrations.trl import R3GRPOTrainer, RRRollout
from rr_client.trainer import keys as K
from tests.support.grpo import cpu_grpo_config
from tests.support.protocol_server import LogprobTestServer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
MOE_LAYERS = [0, 2]
TRAIN_PROMPTS = ["the quick brown fox", "hello world and"]
EVAL_PROMPTS = ["one two three", "a b"]


class Watched(R3GRPOTrainer):
    """Keeps, per ``_compute_loss``: the mode, the samples' token ids and the rows rr placed under them."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.seen: list[dict[str, Any]] = []

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        self.seen.append(
            {
                "mode": "train" if self.model.training else "eval",
                "tokens": [ids[b][mask[b].bool()].tolist() for b in range(ids.size(0))],
            }
        )
        return super()._compute_loss(model, inputs)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE

    return build_tiny_moe(
        CACHE / "qwen3_dense", arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,)
    )


def test_eval_between_iterations_replays_each_batch_with_its_own_rows(model_dir: Path, tmp_path: Path) -> None:
    """Two generations of 4 training samples, each trained twice (``num_iterations=2``), an evaluation of 2 prompts
    x 2 samples after every step, so one comes between the two iterations of each training batch. Before issue 44's
    fix the step after the first eval indexed the eval rollout (4 training indices into 2 eval samples). Now every
    step and every eval replays every MoE layer with the rows of its own batch: as many replayed rows as its own
    samples' routed tokens (the tokens checked against the rows' by rr), and the eval's log-prob gap in the eval
    log, not in the next training step's."""
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = cpu_grpo_config(
        str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        per_device_eval_batch_size=2,
        num_generations_eval=2,
        num_iterations=2,
        max_completion_length=4,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        learning_rate=1e-3,
        vllm_importance_sampling_correction=False,  # the server's log-probs are made up
    )
    with LogprobTestServer(layers=3, topk=2, num_experts=8, moe_layers=MOE_LAYERS) as server:
        rollout = RRRollout(server.url)
        try:
            trainer = Watched(
                model=model,
                reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                args=cfg,
                processing_class=tok,
                train_dataset=Dataset.from_dict({"prompt": TRAIN_PROMPTS * 4}),
                eval_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS[:1]}),
                rollout_func=rollout,
                sync_weights=False,
                audit_every=1,
            )
            trainer.train()
        finally:
            rollout.close()
        generate_calls = server.behaviour.calls

    assert trainer.state.global_step == 4
    assert generate_calls == 2 + 4  # two training generations (each trained twice), four evaluations
    modes = [s["mode"] for s in trainer.seen]
    assert modes == ["train", "eval"] * 4, modes  # an eval between the two iterations of each training batch
    history = trainer.state.log_history
    train_logs = [h for h in history if "loss" in h and K.APPLIED_SHARE in h]
    eval_logs = [h for h in history if "eval_loss" in h]
    assert len(train_logs) == 4 and len(eval_logs) == 4, history
    for log, seen in zip(train_logs + eval_logs, trainer.seen[0::2] + trainer.seen[1::2]):
        p = "eval_" if seen["mode"] == "eval" else ""
        routed = sum(len(t) - 1 for t in seen["tokens"])  # the engine routes every token but the last
        assert log[p + K.APPLIED_SHARE] == 1.0 and log[p + K.APPLIED_SHARE_MIN_LAYER] == 1.0, log
        # each forward (TRL's old-policy one at generation, the loss one) replayed its own samples' rows, all of them
        assert log[p + K.REPLAYED_ROWS] == routed * len(MOE_LAYERS) * log[p + K.FORWARDS], (seen["mode"], log)
        assert log[p + K.LOGP_TOKENS] == 4 * len(seen["tokens"]), (seen["mode"], log)  # its own completions' gap
    assert [h[K.FORWARDS] for h in train_logs] == [2, 1, 2, 1]  # old-policy forward only where TRL generated


def test_a_batch_of_a_rollout_rr_no_longer_holds_is_refused() -> None:
    """A batch whose samples carry the serial of a rollout rr dropped (or of two rollouts) is refused by name, never
    replayed with the rows of whichever rollout came last."""
    from types import SimpleNamespace

    from rr_client import ReplayError
    from rr_client.integrations.trl._trainer import Generation

    def gen(serial: int, mode: str) -> Generation:
        return Generation(serial, mode, None)  # type: ignore[arg-type]  # the samples are not read here

    held = SimpleNamespace(_rr_held={"train": gen(3, "train"), "eval": gen(4, "eval")})
    pick = R3GRPOTrainer._generation
    assert pick(held, {"rr_generation": torch.tensor([3, 3])}).mode == "train"
    assert pick(held, {"rr_generation": torch.tensor([4])}).mode == "eval"
    for tags in ([1, 1], [3, 4]):
        with pytest.raises(ReplayError, match=r"rr holds the rows of train rollout 3, eval rollout 4 only"):
            pick(held, {"rr_generation": torch.tensor(tags)})
    with pytest.raises(ReplayError, match="no 'rr_generation'"):
        pick(held, {})
