"""sglang-router 0.3.2 (the SGLang model gateway, a Rust binary from PyPI) in front of the two rr-patched vLLM CPU
replicas on loopback: what reaches rr through it, with routing checked against transformers' router top-k.

The replicas run with ``RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS=1`` (the router drops the flag on ``/generate``,
sgl-project/sglang#20696), and the client is given the routing dimensions (``info=``) because the router
answers 404 for ``/rr/info``. The router's limits are asserted too, so the docs stay true for the pinned
version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient, RRInfo
from rr_client.core.codec import decode_meta_info
from tests.scale.conftest import SGLangRouter
from tests.scale.test_scale_vllm import check_result, token_prompts
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server


@pytest.fixture(scope="module")
def sglang_router(replicas: list[VLLMProcess]) -> Iterator[SGLangRouter]:
    yield from SGLangRouter([s.base_url for s in replicas]).serving()


def test_client_through_sglang_router_with_given_info(sglang_router: SGLangRouter, replicas: list[VLLMProcess]) -> None:
    """RoutedExpertsClient on sglang-router's ``/generate`` (batches of 3 prompts), dims from a replica's
    ``/rr/info``: every sample of 6 prompts x n=2 carries routing equal to transformers' top-k."""
    info = RRInfo.model_validate(httpx.get(replicas[0].base_url + "/rr/info", timeout=30).json())
    prompts = token_prompts(6, length=10, seed=11)

    async def run() -> Any:
        async with RoutedExpertsClient(sglang_router.url, info=info, batch_size=3) as c:
            return await c.generate(prompts, {"max_new_tokens": 5, "temperature": 1.0, "n": 2})

    batch = asyncio.run(run())
    assert len(batch) == 12
    for res in batch:
        check_result(replicas[0].model_dir, res, prompts[res.prompt_index])


def test_openai_completions_keep_rr_fields_for_text_prompts(
    sglang_router: SGLangRouter, replicas: list[VLLMProcess]
) -> None:
    """``/v1/completions`` with a text prompt keeps rr's fields through the router: the choice carries rr's
    checked routing and token ids, equal to transformers' top-k."""
    r = httpx.post(
        sglang_router.url + "/v1/completions",
        timeout=120,
        json={
            "model": "tiny-moe",
            "prompt": "routers forward this",
            "max_tokens": 6,
            "temperature": 0,
            "return_routed_experts": True,
            "routed_experts_start": 2,
        },
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert "routed_experts_error" not in choice, choice
    info = RRInfo.model_validate(httpx.get(replicas[0].base_url + "/rr/info", timeout=30).json())
    tokens = choice["prompt_token_ids"] + choice["token_ids"]
    rows = len(tokens) - 1 - 2
    got = decode_meta_info(
        choice,
        rows=rows,
        num_layers=info.num_hidden_layers,
        topk=info.topk,
        num_experts=info.num_experts,
        moe_layers=info.moe_layers,
    )

    class _Res:  # check_result's view of a sample
        routed_experts, output_ids, routed_experts_start = got, choice["token_ids"], 2

    check_result(replicas[0].model_dir, _Res, choice["prompt_token_ids"])


def test_sglang_router_limits_as_documented(sglang_router: SGLangRouter) -> None:
    """What docs/scale-out.md says does not work through sglang-router 0.3.2: ``/rr/*`` is 404, token-id prompts
    on ``/v1/completions`` are refused (422), and chat drops rr's unknown field."""
    assert httpx.get(sglang_router.url + "/rr/info", timeout=30).status_code == 404
    ids = token_prompts(1, seed=12)[0]
    r = httpx.post(
        sglang_router.url + "/v1/completions",
        timeout=120,
        json={"model": "tiny-moe", "prompt": ids, "max_tokens": 2, "return_routed_experts": True},
    )
    assert r.status_code == 422, r.text
    chat = httpx.post(
        sglang_router.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "tiny-moe",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "return_routed_experts": True,
        },
    )
    assert chat.status_code == 200, chat.text
    assert "routed_experts_shape" not in chat.json()["choices"][0]  # the field never reached rr
