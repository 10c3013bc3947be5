"""R3 from a real rr vLLM CPU server (vLLM 0.30 in the main ``.venv``, ``rr-server launch vllm``) through verl's own
Megatron engine with rr's feeder: the same tiny Qwen3-MoE served by vLLM and loaded by mbridge into megatron-core.

The instruments are independent of rr: vLLM's rows are checked against transformers' own top-k of each unpadded
sample (real values, not zeros of the right shape), and what each Megatron router ran is read from its own
``routing_map`` and the experts' ``tokens_per_expert`` (harness.MoeSeen): every token with a rollout row ran exactly
the rollout's experts, per layer. rr's log-prob gap against vLLM's sampling log-probs (temperature 0.7) is in the
engine's step metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.vllm_process import VLLMProcess
from tests.verl import harness as vh
from tests.verl.test_vllm_rows import TEMPERATURE, MainVenvVLLM, rollout
from tests.verl_megatron.test_engine_replay import (
    EXPERTS,
    LAYERS,
    MICRO,
    per_sample,
    run_log_prob,
    workers,  # noqa: F401 - the module-scoped fixture
)


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path) -> Iterator[VLLMProcess]:
    server = MainVenvVLLM(model_dir, name="verl-mcore-qwen3", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def test_vllm_rows_run_under_their_tokens_in_verls_megatron_engine(
    vllm_server: VLLMProcess,
    workers: Any,  # noqa: F811
    tokenizer: Any,
    hf_model: Any,
) -> None:
    g = np.random.default_rng(21)
    prompts = [g.integers(5, 60, n).tolist() for n in (12, 3, 7, 5)]
    results = rollout(vllm_server.base_url, prompts)
    samples, lengths = [], []
    for r in results:
        rows = np.asarray(r.routed_experts)
        assert rows.shape == (len(r.prompt_ids) + len(r.output_ids) - 1, LAYERS, 2)
        own = vh.own_routing(hf_model, r.prompt_ids + r.output_ids)  # transformers' own top-k, the reference
        assert np.array_equal(np.sort(rows, -1), np.sort(own, -1))
        samples.append(
            dict(
                prompt_ids=r.prompt_ids,
                response_ids=r.output_ids,
                routed_experts=rows,
                response_logprobs=r.logprobs.tolist(),  # vLLM's, after temperature (rr's launcher)
            )
        )
        lengths.append(len(r.prompt_ids) + len(r.output_ids))
    cfg, w = workers["R3"]
    batch = vh.agent_loop_batch(tokenizer, samples)
    batch.meta_info["temperature"] = TEMPERATURE  # what RayPPOTrainer sets from rollout.temperature
    _, seen = run_log_prob(cfg, w, batch)
    checked = 0
    for layer in range(1, LAYERS + 1):
        maps = seen.maps[layer]
        assert len(maps) == len(samples) // MICRO
        for m, counts in zip(maps, seen.counts[layer], strict=True):  # the experts were handed what the map says
            assert torch.equal(counts.to(torch.int64), m.sum(dim=0).to(torch.int64))
        for i, got in enumerate(per_sample(maps, lengths)):
            want = torch.zeros(lengths[i] - 1, EXPERTS, dtype=torch.bool)
            want.scatter_(1, torch.as_tensor(samples[i]["routed_experts"][:, layer - 1], dtype=torch.int64), True)
            bad = (got[:-1] != want).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"sample {i} layer {layer}: tokens {bad} ran other experts than vLLM's"
            checked += want.shape[0]
    assert checked == sum(n - 1 for n in lengths) * LAYERS
    met = w.actor.engine.rr_last_metrics
    assert met["r3/provenance_unknown"] == len(samples)  # the agent-loop batch here carries no weight versions
    # rr's log-prob gap: the actor's (bf16 megatron-core) against vLLM's (fp32), over every response token
    assert met["r3/logp_tokens"] == float(sum(len(s["response_ids"]) for s in samples))
    assert 0.0 < met["r3/mean_abs_logp_diff"] < 0.05 and met["r3/agreement"] > 0.9, met
