"""One replay lifecycle behind both trainers: TRL's ``R3GRPOTrainer`` and verl's FSDP2 actor, each driven by its own
trainer class over the same four samples in the same two micro-batches of one optimizer step, log the same R3
metrics (the worst applied share, row-weighted agreement, token-weighted log-prob gaps, the same row counts).

TRL's half runs TRL 1.16's real ``GRPOTrainer.train`` in the main ``.venv`` (tests/verl/trl_side.py: verl 0.9.1 and
TRL 1.16 cannot share an environment), with the engine stood in there (named: the scripted samples' routing and
sampling log-probs). verl's real worker then trains the same samples, laid out by verl's agent loop, in the
micro-batches TRL formed (TRL shuffles before splitting). Both start from the same checkpoint, in fp32.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client.trainer import keys as K
from tests.verl import harness as h
from tests.verl.test_fsdp_replay import other_rows
from tests.verl.test_vllm_rows import MAIN_VENV, REPO

PROMPTS = ["the fox", "hello"]
COMPLETIONS = [[11, 12, 13, 14, 15, 16], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38], [41, 42, 43, 44, 45]]
# every key the session's merge rules produce (TRL's IS-ratio keys are off here: see trl_side.py)
COMPARED = [
    K.FORWARDS,
    K.MOE_LAYERS,
    K.REPLAYED_ROWS,
    K.LEFT_ROWS,
    K.APPLIED_SHARE,
    K.APPLIED_SHARE_MIN_LAYER,
    K.AGREEMENT,
    K.AUDITED,
    K.MEAN_ABS_LOGP_DIFF,
    K.K3_KL,
    K.FRAC_ABS_DIFF_GT_LN2,
    K.LOGP_TOKENS,
    K.depth("0-8k", "logp_tokens"),  # the gap by context depth (issue 57): every token here is in the first bucket
    K.depth("0-8k", "mean_abs_logp_diff"),
    K.depth("0-8k", "k3_kl"),
]


def scripted_samples(tokenizer: Any) -> list[dict[str, Any]]:
    """Two prompts x two completions, routing other than the model's own choice, made-up sampling log-probs."""
    g = np.random.default_rng(7)
    out = []
    for i, completion in enumerate(COMPLETIONS):
        prompt = tokenizer(PROMPTS[i // 2])["input_ids"]
        assert len(prompt) <= h.PROMPT_LEN and len(completion) <= h.RESPONSE_LEN
        assert tokenizer.eos_token_id not in completion and tokenizer.pad_token_id not in completion
        rows = other_rows(len(prompt) + len(completion) - 1, seed=20 + i).astype(np.uint8)
        out.append(
            dict(
                prompt_ids=list(prompt),
                response_ids=completion,
                routed_experts=rows,
                response_logprobs=g.uniform(-4.0, -0.05, len(completion)).tolist(),
            )
        )
    return out


def trl_step(samples: list[dict[str, Any]], model_dir: Path, tmp: Path) -> dict[str, Any]:
    """TRL's half in the main .venv: its logged r3/ metrics and its micro-batches."""
    spec = tmp / "samples.json"
    spec.write_text(
        json.dumps(
            {"prompts": PROMPTS, "samples": [{**s, "routed_experts": s["routed_experts"].tolist()} for s in samples]}
        )
    )
    out = tmp / "trl.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    proc = subprocess.run(
        [str(MAIN_VENV / "bin" / "python"), "-m", "tests.verl.trl_side", str(spec), str(model_dir), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_trl_and_verl_log_the_same_r3_metrics(
    model_dir: Path, tokenizer: Any, verl_process: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = scripted_samples(tokenizer)
    got = trl_step(samples, model_dir, tmp_path)
    assert len(got["logged"]) == 1, got  # one optimizer step, one flush: the session's merge, not TRL's mean
    trl = {k: float(got["logged"][0][k]) for k in COMPARED}
    order = [i for mb in got["micro_batches"] for i in mb]
    assert len(got["micro_batches"]) == 2 and sorted(order) == [0, 1, 2, 3]

    monkeypatch.setenv("RR_AUDIT_EVERY", "1")  # TRL's side: audit_every=1
    cfg = h.ppo_config(model_dir, mode="R3", micro_batch=2, mini_batch=4)
    worker = h.actor_worker(cfg)
    t = h.trainer(cfg, worker)
    batch = h.agent_loop_batch(tokenizer, [samples[i] for i in order])
    batch = batch.union(h.compute_log_prob(t, batch))
    met = h.update_actor(t, batch)
    verl = {k: float(np.mean(met[f"actor/{k}"])) for k in COMPARED}

    rows = sum(len(s["prompt_ids"]) + len(s["response_ids"]) - 1 for s in samples) * 2  # x 2 MoE layers
    assert trl[K.REPLAYED_ROWS] == verl[K.REPLAYED_ROWS] == rows
    assert trl[K.LOGP_TOKENS] == verl[K.LOGP_TOKENS] == sum(len(c) for c in COMPLETIONS)
    assert trl[K.APPLIED_SHARE] == verl[K.APPLIED_SHARE] == 1.0
    assert 0.0 < verl[K.AGREEMENT] < 1.0  # other rows than the model's own: the weighting is exercised
    for k in COMPARED:
        assert math.isclose(trl[k], verl[k], rel_tol=1e-5, abs_tol=1e-6), (k, trl, verl)
