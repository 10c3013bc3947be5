"""Rows from a real rr vLLM CPU server (vLLM 0.30 in the main ``.venv``, launched with ``rr-server launch vllm``)
laid out by verl's agent loop and replayed by verl's FSDP engine: under every token the experts that ran are
transformers' own top-k of that token, from an unpadded forward of the sample (the independent reference). Sampled
at temperature 0.7: the server's post-temperature log-probs (the launcher's ``processed_logprobs``) match verl's
actor's, and rr refuses the gap where verl's config says they are pre-temperature.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client.core.errors import LogprobsModeError
from rr_client.integrations.verl import _logprobs
from rr_client.integrations.verl._logprobs import RolloutLogprobs
from tests.support.vllm_process import REPO, VLLMProcess
from tests.verl import harness as h
from tests.verl.test_fsdp_replay import MOE_LAYERS, assert_rows_ran, experts_seen

MAIN_VENV = Path(os.environ.get("RR_MAIN_VENV", REPO / ".venv"))
TEMPERATURE = 0.7  # most GRPO recipes sample below 1: log-probs mean the same only after temperature on both sides


class MainVenvVLLM(VLLMProcess):
    """The rr vLLM server from the main ``.venv`` (this session's interpreter has verl, not vLLM)."""

    def command(self) -> list[str]:
        return [str(MAIN_VENV / "bin" / "rr-server"), "launch", "vllm", *super().command()[3:]]


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path) -> Iterator[VLLMProcess]:
    server = MainVenvVLLM(model_dir, name="verl-qwen3", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert server.command()[1:3] == ["launch", "vllm"] and "--model" in server.command()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def rollout(base_url: str, prompts: list[list[int]]) -> list[Any]:
    from rr_client import RoutedExpertsClient

    async def run() -> list[Any]:
        async with RoutedExpertsClient(base_url) as c:
            batch = await c.generate(
                prompts,
                {"max_new_tokens": 6, "temperature": TEMPERATURE, "ignore_eos": True, "seed": 7},
                return_logprob=True,
            )
            return list(batch.results)

    return asyncio.run(run())


def test_vllm_rows_land_under_their_tokens_in_verls_layout(
    vllm_server: VLLMProcess, workers: Any, tokenizer: Any, hf_model: Any
) -> None:
    g = np.random.default_rng(11)
    prompts = [g.integers(5, 60, n).tolist() for n in (12, 3, 7, 5)]
    results = rollout(vllm_server.base_url, prompts)
    samples = []
    for r in results:
        assert r.routed_experts is not None and r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.output_ids) - 1
        assert r.logprobs_mode == "processed" and r.logprobs is not None  # rr's launcher: after temperature
        samples.append(
            dict(
                prompt_ids=r.prompt_ids,
                response_ids=r.output_ids,
                routed_experts=r.routed_experts,
                response_logprobs=r.logprobs.tolist(),
            )
        )
    batch = h.agent_loop_batch(tokenizer, samples)
    batch.meta_info["temperature"] = TEMPERATURE  # what RayPPOTrainer sets from rollout.temperature
    # verl's own layout: the engine's row t sits at the left-pad offset + t, the rest stays zero
    re = batch.batch["routed_experts"].numpy()
    for i, s in enumerate(samples):
        off = h.PROMPT_LEN - len(s["prompt_ids"])
        n = s["routed_experts"].shape[0]
        assert (
            np.array_equal(re[i, off : off + n], s["routed_experts"])
            and not re[i, :off].any()
            and not re[i, off + n :].any()
        )
    # the independent reference: transformers' top-k of each token of each unpadded sample
    ref = [h.own_routing(hf_model, s["prompt_ids"] + s["response_ids"]) for s in samples]
    for s, want in zip(samples, ref):
        for layer in MOE_LAYERS:
            assert np.array_equal(np.sort(s["routed_experts"][:, layer], -1), np.sort(want[:, layer], -1))
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    for rmpad in (True, False):
        cfg, w = workers[("R3", rmpad)]
        # the log-prob mode is per process, set by the last worker built (the session's workers are cached across
        # files): this worker's own config says which, and compute_log_prob checks it at temperature 0.7
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = _logprobs.check_rollout_logprobs(cfg.actor_rollout_ref.rollout)
        t = h.trainer(cfg, w)
        with experts_seen(w) as seen:
            old = h.compute_log_prob(t, batch)
        assert assert_rows_ran(seen, ref, lengths, rmpad) == sum(n - 1 for n in lengths) * len(MOE_LAYERS)
        met = w.actor.engine.rr_last_metrics
        assert met["r3/applied_share"] == 1.0 and met["r3/agreement"] == 1.0
    # the update logs rr's gap metrics against the engine's own log-probs (verl's rollout_log_probs), which the
    # worker's config says are vLLM's processed_logprobs (verl's default); said to be raw, rr refuses before the
    # first micro-batch's forward (nothing is stepped)
    cfg, w = workers[("R3", True)]
    # the mode is per process (the last worker built sets it; the session's workers are cached across test files):
    # read what this worker's own config says
    said = _logprobs.check_rollout_logprobs(cfg.actor_rollout_ref.rollout)
    assert said.mode == "processed"
    before, temperature = _logprobs.ROLLOUT_LOGPROBS.get("rollout"), cfg.actor_rollout_ref.rollout.temperature
    cfg.actor_rollout_ref.rollout.temperature = TEMPERATURE  # verl's _update_actor takes it from the config
    try:
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = RolloutLogprobs("raw", "rollout.name=vllm, logprobs_mode=raw_logprobs")
        with pytest.raises(LogprobsModeError, match="temperature 0.7"):
            h.update_actor(h.trainer(cfg, w), batch.union(old))
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = said
        upd = h.update_actor(h.trainer(cfg, w), batch.union(old))
    finally:
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = before if before is not None else said
        cfg.actor_rollout_ref.rollout.temperature = temperature
    assert upd["actor/r3/applied_share"] == [1.0]
    assert upd["actor/r3/logp_tokens"] == [float(sum(len(s["response_ids"]) for s in samples))]
    assert upd["actor/r3/mean_abs_logp_diff"][0] < 1e-4, upd["actor/r3/mean_abs_logp_diff"]
