"""verl's SGLang routing read (``SGLangHttpServer.generate``) on what SGLang 0.5.11+ really sends: a base64 string.

verl's server method is verl's own; its ``tokenizer_manager`` is SGLang's real ``TokenizerManager`` (0.5.13 via the
overlay of scripts/setup_sglang.sh, run by scripts/test_verl.sh), fed by tests/sglang's stand-in scheduler with
rows from a transformers forward. Stock verl crashes on the string (its ``.numpy()``); with rr's plugin the read
goes through rr's decode and full check and returns the reference rows, on both of verl's branches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

PROMPT = [3, 17, 29, 41, 53, 67, 71]


def verl_server(tm: Any, model_dir: Path, *, skip_tokenizer_init: bool) -> Any:
    """verl's ``SGLangHttpServer`` with the fields ``generate`` reads (its constructor starts SGLang in Ray)."""
    import transformers
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    s = object.__new__(SGLangHttpServer)
    s.config = SimpleNamespace(
        enable_rollout_routing_replay=True,
        skip_tokenizer_init=skip_tokenizer_init,
        mtp=None,
        max_model_len=1024,
        prompt_length=64,
        response_length=16,
    )
    s.model_config = SimpleNamespace(
        hf_config=transformers.AutoConfig.from_pretrained(str(model_dir)), lora_rank=0, lora={}
    )
    s.tokenizer_manager = tm
    s._disaggregation_role, s._pd_decode_peers = None, []
    s.replica_rank, s.global_steps = 0, 0
    return s


async def generate(harness: Any, server: Any, call: Any) -> Any:
    """Run ``call`` (verl's generate) while the stand-in scheduler answers what reaches it."""
    harness.tm.event_loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(
        call(
            server,
            prompt_ids=list(PROMPT),
            sampling_params={"max_new_tokens": 5, "temperature": 0.0},
            request_id="verl-0",
        )
    )
    for _ in range(3000):
        if task.done():
            break
        await asyncio.sleep(0.01)
        if harness.sched.arrivals:
            rids = list(harness.sched.arrivals)
            harness.sched.arrivals.clear()
            await harness.deliver(harness.sched.step(rids))
    return await task


def expected(harness: Any, model_dir: Path) -> np.ndarray:
    from rr_server.demo.tiny_moe import reference_routing

    r = harness.sched.reqs["verl-0"]
    return reference_routing(model_dir, (r.prompt + r.completion)[:-1])


@pytest.fixture
def sglang_model(model_dir: Path) -> Path:
    return model_dir


def test_stock_verl_crashes_on_sglangs_base64_routing(sglang_model: Path) -> None:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    from tests.sglang.harness import Harness

    h = Harness(sglang_model, skip_tokenizer_init=True)
    try:
        with pytest.raises(AttributeError, match="'str' object has no attribute 'numpy'"):
            asyncio.run(
                generate(
                    h, verl_server(h.tm, sglang_model, skip_tokenizer_init=True), SGLangHttpServer.generate.__wrapped__
                )
            )
    finally:
        h.close()


@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
def test_rr_reads_verls_sglang_routing_checked(sglang_model: Path, skip: bool) -> None:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    from tests.sglang.harness import Harness

    h = Harness(sglang_model, skip_tokenizer_init=skip)
    try:
        out = asyncio.run(
            generate(h, verl_server(h.tm, sglang_model, skip_tokenizer_init=skip), SGLangHttpServer.generate)
        )
        want = expected(h, sglang_model)
        got = np.asarray(out.routed_experts)
        assert out.token_ids == h.sched.reqs["verl-0"].completion
        assert got.shape == want.shape == (len(PROMPT) + len(out.token_ids) - 1, 3, 2)
        assert np.array_equal(got, want)
    finally:
        h.close()
