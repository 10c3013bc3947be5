"""Log-probs with one meaning on the real vLLM CPU server: at temperature 0.7 the engine's sampled log-probs (rr's
launcher serves ``--logprobs-mode processed_logprobs``) equal the trainer's ``log_softmax(logits / 0.7)`` on
identical fp32 weights with replay, and log-probs the server states as pre-temperature are refused."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from rr_client import GenerateBatch, LogprobsModeError, RoutedExpertsClient
from rr_client.core.logprobs import check_comparable_logprobs
from rr_client.trainer import ReplaySession
from rr_client.trainer import keys as K
from rr_client.trainer.metrics import token_logprobs
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server
T = 0.7
PROMPTS = [[1, 17, 42, 7, 99], [5, 6, 7, 8]]
# top_k / top_p off: vLLM's processed log-probs are after them too (renormalised over the kept tokens)
PARAMS = {"n": 4, "max_new_tokens": 8, "temperature": T, "top_p": 1.0, "top_k": -1, "sampling_seed": 3}


async def _sample(url: str) -> tuple[GenerateBatch, GenerateBatch]:
    async with RoutedExpertsClient(url) as client:
        gen = await client.generate(PROMPTS, PARAMS, return_logprob=True)
        comp = await client.complete(PROMPTS[0], {**PARAMS, "n": 2}, extra_body={"logprobs": 0})
        return gen, comp


def test_logprobs_at_temperature_07_match_the_trainers(qwen_server: VLLMProcess, tiny_models: dict[str, Path]) -> None:
    gen, comp = asyncio.run(_sample(qwen_server.base_url))
    assert gen.info.logprobs_mode == "processed"  # rr's launcher: --logprobs-mode processed_logprobs
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_dense"], dtype=torch.float32)
    model.eval()
    session = ReplaySession(model, audit_every=1)
    for batch in (gen, comp):  # /generate and /v1/completions: the same checked field
        for r in batch:
            assert (
                r.logprobs is not None and r.logprobs.shape == (len(r.output_ids),) and r.logprobs_mode == "processed"
            )
        rt = batch.to_tensors(pad_side="right")
        assert rt.logprobs is not None and rt.logprobs_mode == "processed"
        resp = rt.response_mask.bool()
        with torch.no_grad(), session.forward(rt):  # the engine's routing, replayed (and audited)
            logits = model(rt.input_ids, attention_mask=rt.attention_mask).logits
        mine = token_logprobs(logits / T, rt.input_ids)
        gap = (mine - rt.logprobs)[resp].abs().max().item()
        print(f"T={T}: max |trainer - engine| over {int(resp.sum())} tokens: {gap:.2e}")
        assert gap < 1e-5, gap  # fp32, identical weights: the same number on both sides
        # what the gap was before rr served processed log-probs: the trainer's at T=0.7 vs the pre-temperature ones
        raw = token_logprobs(logits, rt.input_ids)
        print(f"T={T}: mean |pre-temperature - processed|: {(raw - mine)[resp].abs().mean().item():.2e}")
        assert (raw - mine)[resp].abs().max().item() > 1e-2
        session.add_gap(mine, rt, rt.response_mask, temperature=T)
    out = session.flush()
    assert out[K.APPLIED_SHARE] == 1.0 and out[K.MEAN_ABS_LOGP_DIFF] < 1e-6, out

    # The same samples from a server that states its log-probs are pre-temperature (vLLM's default raw_logprobs):
    # the gap, the layouts' consumers and the trainers refuse at T != 1, naming the flag.
    raw_info = gen.info.model_copy(update={"logprobs_mode": "raw"})
    with pytest.raises(LogprobsModeError, match="--logprobs-mode processed_logprobs"):
        check_comparable_logprobs(raw_info.logprobs_mode, T, consumer="test")
    as_raw = GenerateBatch([dataclasses.replace(r, logprobs_mode="raw") for r in gen], raw_info)
    rt = as_raw.to_tensors(pad_side="right")
    with pytest.raises(LogprobsModeError, match="ReplaySession.add_gap"):
        session.add_gap(torch.zeros_like(rt.logprobs), rt, rt.response_mask, temperature=T)
