"""Cache epochs on the real vLLM 0.30 CPU server (issue 44): prefix-cache hits on KV from older weights are named.

An update inside ``/pause?mode=keep&clear_cache=false`` (as docs/engines.md describes RL loops doing) leaves the
prefix cache holding blocks of the older weights: the server says so (``/rr/info`` ``prefix_cache_stale``), and a
request admitted after the update that hits those blocks says so too (``cached_under_older_weights``): its cached
rows are the old weights' (checked against transformers with both checkpoints), and the stale-rows policy refuses
it, or masks it with ``mask``. rr's own weight push (``DiskWeightSync``: reload, then ``/reset_prefix_cache``,
whose real ``{"success": true}`` answer the server reads) leaves the cache clean: the same prompt is computed afresh,
its rows exactly the pushed weights'. (A reset vLLM refuses, 200 ``{"success": false}`` while requests hold blocks,
fails the push: tests/unit/test_weight_sync_unit.py; holding blocks on purpose needs a request frozen mid-decode,
which only timing can arrange here.) The server is this module's own (its weights change).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers

from rr_client.core.codec import decode_meta_info
from rr_client.core.errors import StaleRoutingError
from rr_client.core.provenance import check_provenance
from rr_client.integrations.weight_sync import DiskWeightSync
from tests.support.routing_asserts import assert_routing_sets_equal
from tests.support.vllm_process import VLLMProcess, small_kv_dev_server
from tests.vllm.test_provenance import (
    GREEDY,
    MOE_LAYERS,
    SMALL_KV_BLOCKS,
    generate,
    negated_routers,
    pause,
    provenance,
    reference,
    reload_and_resume,
)

pytestmark = pytest.mark.vllm_server

# two full blocks of 32: a second run of this prompt is served 64 tokens from the prefix cache
CACHED_PROMPT = [int(t) for t in np.random.default_rng(44).integers(2, 440, size=70)]


@pytest.fixture(scope="module")
def cache_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    """The tiny Qwen3-MoE in dev mode with a small KV cache (this module's own: its weights change)."""
    yield from small_kv_dev_server(
        tiny_models["qwen3_dense"], name="cache-epoch", blocks=SMALL_KV_BLOCKS, max_model_len=256, core=0
    )


def info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/rr/info", timeout=30).json()  # type: ignore[no-any-return]


def test_old_weight_prefix_hits_are_named_refused_and_gone_after_a_reset(
    cache_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    url, model_dir = cache_server.base_url, tiny_models["qwen3_dense"]
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pushed = negated_routers(model_dir, tmp_path / "negated")
    v0 = info(url)["weight_version"]
    sync = DiskWeightSync(url, tmp_path / "pushes")

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            cold = await generate(c, CACHED_PROMPT, GREEDY)  # its blocks are cached under the served weights
            await pause(c, clear_cache=False)
            await reload_and_resume(c, tmp_path / "negated")  # no reset: the cache keeps the old weights' blocks
            return cold, await generate(c, CACHED_PROMPT, GREEDY)

    cold, hit = asyncio.run(run())
    after_update = info(url)
    assert after_update["weight_version"] == v0 + 1 and after_update["prefix_cache_stale"] is True

    # admitted after the update, served 64 tokens from blocks computed before it: said, and its cached rows are
    # the old weights' (what a replay would force on the new ones)
    p_cold = provenance(cold["meta_info"], CACHED_PROMPT, cold["output_ids"])
    p_hit = provenance(hit["meta_info"], CACHED_PROMPT, hit["output_ids"])
    assert p_cold.cached_under_older_weights is False and not p_cold.stale
    assert p_hit.cached_tokens == 64 and p_hit.cached_under_older_weights is True and p_hit.stale
    assert (p_hit.weight_version_admitted, p_hit.weight_version_finished, p_hit.spans_update) == (v0 + 1, v0 + 1, False)
    rows = decode_meta_info(hit["meta_info"])
    old = reference(base, CACHED_PROMPT, hit["output_ids"])
    new = reference(pushed, CACHED_PROMPT, hit["output_ids"])
    assert_routing_sets_equal(rows[:64], old[:64], layers=MOE_LAYERS)
    assert not np.array_equal(np.sort(rows[:64, MOE_LAYERS], -1), np.sort(new[:64, MOE_LAYERS], -1))
    with pytest.raises(StaleRoutingError, match="sample 1: its 64 cached tokens may come from KV computed under older"):
        check_provenance([p_cold, p_hit], "refuse")
    masked = check_provenance([p_cold, p_hit], "mask")
    assert masked.replay == (True, False) and masked.masked == 1

    # the source audit finds it from the rows alone (issue 57): the engine's fresh re-score of the same tokens runs the
    # new weights, so the cached segment (the old weights' rows) falls while nothing else says why
    async def audited() -> Any:
        from rr_client import RoutedExpertsClient
        from rr_client.client import SourceAudit, parse_sample

        async with RoutedExpertsClient(url) as c:
            served = parse_sample(hit, index=0, prompt_index=0, prompt_ids=CACHED_PROMPT, info=await c.info(),
                                  want_routing=True)  # fmt: skip
            (judged,) = await SourceAudit(1.0).audit(c, [served], await c.info())
            return judged.provenance

    p_audit = asyncio.run(audited())
    detail = p_audit.source_detail
    assert p_audit.source_flagged and detail is not None and "cached_prompt" in detail.failing()
    cached_agree, cached_cells = detail.by_segment["cached_prompt"]
    assert cached_cells == 64 * len(MOE_LAYERS) and cached_agree / cached_cells < 0.5

    # rr's push on the idle server: reload, and a reset vLLM says worked: the cache is clean
    epochs = info(url)["cache_epoch"]
    sync.push(pushed, 1)
    pushed_info = info(url)
    assert pushed_info["weight_version"] == v0 + 2 and pushed_info["prefix_cache_stale"] is False
    assert pushed_info["cache_epoch"] == epochs + 1

    async def again() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            return await generate(c, CACHED_PROMPT, GREEDY)

    fresh = asyncio.run(again())
    p_fresh = provenance(fresh["meta_info"], CACHED_PROMPT, fresh["output_ids"])
    assert p_fresh.cached_tokens == 0 and p_fresh.cached_under_older_weights is False and not p_fresh.stale
    assert_routing_sets_equal(
        decode_meta_info(fresh["meta_info"]), reference(pushed, CACHED_PROMPT, fresh["output_ids"]), layers=MOE_LAYERS
    )
