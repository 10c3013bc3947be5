"""One rank of a 2-process TRL run by reference (``torchrun --nproc-per-node 2``, CPU, gloo), for
tests/vllm/test_trl_grpo.py::test_two_ranks_by_reference: R3GRPOTrainer with RRRollout(by_reference=True) and weight
sync against a real server; writes what this rank trained to ``OUT/rank<N>.json`` (both ranks share stdout, where
Trainer's own prints interleave with a line of ours)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from trl import GRPOConfig

from rr_client.integrations.trl import R3GRPOTrainer, RRRollout

PROMPTS = ["the quick brown fox", "hello world and", "one two three four five six", "a b"]


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def main(url: str, model_dir: str, out: str, steps: int) -> None:
    """Train ``steps`` GRPO steps on this rank and write its record."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        learning_rate=2e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        beta=0.0,
        ddp_find_unused_parameters=True,
    )
    trainer = R3GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        rollout_func=RRRollout(url, by_reference=True),
        audit_every=1,
    )
    trainer.train()
    steps_log = [h for h in trainer.state.log_history if "r3/applied_share" in h]
    rank = int(os.environ["RANK"])
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "pushes": len(trainer.sync_log),
        "applied_share": [h["r3/applied_share"] for h in steps_log],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
