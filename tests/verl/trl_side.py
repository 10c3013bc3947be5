"""TRL's half of tests/verl/test_adapters_agree.py, run with the main ``.venv`` (TRL 1.16; verl 0.9.1 cannot share an
environment with it: verl's model build imports ``trl.experimental.ppo``, which TRL 1.16 no longer has).

``python -m tests.verl.trl_side SAMPLES.json MODEL_DIR OUT.json``: one optimizer step of TRL 1.16's real
``GRPOTrainer.train`` through :class:`R3GRPOTrainer`, two micro-batches of two samples; writes the step's logged
``r3/`` metrics and which samples each micro-batch held. The engine is stood in (``ScriptedRollout``, named): the
samples' completions, routing and sampling log-probs instead of a server's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.grpo import cpu_grpo_config

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main(samples_path: str, model_dir: str, out_path: str) -> None:
    import transformers
    from datasets import Dataset

    from rr_client import GenerateBatch, GenerateResult, RRInfo
    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout

    spec = json.loads(Path(samples_path).read_text())
    samples, prompts = spec["samples"], spec["prompts"]
    info = RRInfo.from_hf_config(
        transformers.AutoConfig.from_pretrained(model_dir).to_dict(), engine="vllm", engine_version="0.30.0"
    )

    class ScriptedRollout(RRRollout):
        """Stand-in for the engine (named): the scripted samples, two per prompt in TRL's order. Nothing listens
        at the URL; the client is never used."""

        def info(self) -> RRInfo:
            """The scripted server's facts (what R3GRPOTrainer reads before TRL's __init__)."""
            return info

        def generate(self, prompt_ids: list[list[int]], sampling_params: Any) -> GenerateBatch:
            want = [samples[i]["prompt_ids"] for i in range(0, len(samples), 2)]
            if prompt_ids != want or sampling_params["n"] != 2:
                raise AssertionError(f"TRL asked for {prompt_ids} x {sampling_params['n']}, scripted {want} x 2")
            return GenerateBatch(
                [
                    GenerateResult(
                        index=i,
                        prompt_index=i // 2,
                        prompt_ids=s["prompt_ids"],
                        output_ids=s["response_ids"],
                        text=None,
                        finish_reason="length",
                        routed_experts=np.asarray(s["routed_experts"], dtype=np.uint8),
                        routed_experts_start=0,
                        logprobs=np.asarray(s["response_logprobs"], dtype=np.float64),
                        meta={
                            "output_token_logprobs": [
                                [lp, t, None] for lp, t in zip(s["response_logprobs"], s["response_ids"])
                            ]
                        },
                    )
                    for i, s in enumerate(samples)
                ],
                info,
            )

    micro_batches: list[list[int]] = []

    class Watched(R3GRPOTrainer):
        """Records which samples each micro-batch held (TRL shuffles them before splitting)."""

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            micro_batches.append(inputs["rr_sample"].tolist())
            return super()._compute_loss(model, inputs)

    # one optimizer step of two micro-batches; TRL's IS correction off: with it on, its old-policy forward (which
    # verl runs as a step of its own, compute_log_prob) would join this step's metrics
    cfg = cpu_grpo_config(
        str(Path(out_path).parent / "trl-out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        temperature=1.0,
        vllm_importance_sampling_correction=False,
        gradient_checkpointing=True,
    )
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    trainer = Watched(
        model=model,
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        rollout_func=ScriptedRollout("http://127.0.0.1:9"),
        sync_weights=False,
        audit_every=1,
    )
    trainer.train()
    logged = [{k: v for k, v in r.items() if k.startswith("r3/")} for r in trainer.state.log_history]
    Path(out_path).write_text(json.dumps({"logged": [r for r in logged if r], "micro_batches": micro_batches}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
