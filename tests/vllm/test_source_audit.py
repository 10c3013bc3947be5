"""The source audit against the real vLLM 0.30 CPU server (issue 57): a healthy server's re-score gives every served
row back (prompt, cached prompt and generated tokens; also while n-gram speculative decoding drafts), and each engine
fault rr's test hook makes in the server's rows (``rr_server.serving.test_faults``, on with ``RR_TEST_FAULTS=1`` in
the pool's servers) is flagged in the segment it hits, then refused by the stale-rows policy. The re-score bypasses
the prefix cache (a fresh ``cache_salt``), or the cached rows would come back as the served ones."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from rr_client import RoutedExpertsClient, StaleRoutingError
from rr_client.client import SourceAudit, parse_sample
from rr_client.client.source_audit import salt_field
from rr_client.core.provenance import check_provenance

pytestmark = pytest.mark.vllm_server

SAMPLED = {"max_new_tokens": 12, "temperature": 1.0}


def prompts(n: int, length: int = 300, base: int = 17) -> list[list[int]]:
    return [[(base + 7 * i + 13 * j) % 400 + 5 for j in range(length)] for i in range(n)]


def test_a_healthy_server_gives_every_row_back(qwen_server: Any, ngram_server: Any) -> None:
    """Every sample re-scored: all cells agree in every segment (a second turn hits the prefix cache, so the cached
    segment is audited too) on the plain server and on the one drafting with n-grams; nothing is flagged."""

    async def run(url: str, sampling: dict[str, Any]) -> list[Any]:
        audit = SourceAudit(1.0)
        async with RoutedExpertsClient(url, source_audit=audit) as c:
            first = await c.generate(prompts(6), sampling)
            again = await c.generate([r.prompt_ids + r.output_ids + [5, 6] for r in first.results[:3]], sampling)
        assert audit.stats.checked == 9 and audit.stats.flagged == 0 == audit.stats.failed
        return first.results + again.results

    greedy = {**SAMPLED, "temperature": 0.0}  # vLLM's CPU rejection sampler is greedy-only (test_speculative.py)
    for server, sampling in ((qwen_server, SAMPLED), (ngram_server, greedy)):
        results = asyncio.run(run(server.base_url, sampling))
        cached = 0
        for r in results:
            p = r.provenance
            assert p is not None and p.source_checked and not p.source_flagged and p.source_agreement == 1.0
            assert p.source_detail is not None and p.source_detail.tokens_agreed == p.source_detail.tokens
            cached += p.source_detail.by_segment.get("cached_prompt", (0, 0))[1]
        assert cached > 0, "the second turns should have hit the prefix cache"
        check = check_provenance([r.provenance for r in results])
        assert check.source_checked == 9 and check.source_flagged == 0 and all(check.replay)


async def _faulted(c: RoutedExpertsClient, url: str, fault: str, ids: list[int]) -> Any:
    """One request through the server's fault hook (its ``rid``), parsed as the client parses any sample."""
    info = await c.info()
    async with httpx.AsyncClient(base_url=url, timeout=600) as h:
        body = {
            "input_ids": ids,
            "sampling_params": SAMPLED,
            "return_routed_experts": True,
            "rid": f"rr-fault-{fault}-{uuid.uuid4().hex}",
        }
        reply = (await h.post("/generate", json=body)).json()
    return parse_sample(reply, index=0, prompt_index=0, prompt_ids=ids, info=info, want_routing=True)


@pytest.mark.parametrize(
    "fault,part",
    [
        ("shift_decode", "generated"),  # decode rows one token late
        ("draft_node", "generated"),  # a tree node other than the accepted one
        ("other_request", "sample"),  # rows left in the slot by the request before
        ("stale_cache", "cached_prompt"),  # the cached prefix's rows routed by older weights
    ],
)
def test_each_fault_is_flagged_where_it_is(qwen_server: Any, fault: str, part: str) -> None:
    ids = prompts(1, length=300, base=101 + len(fault))[0]

    async def run() -> tuple[Any, Any]:
        audit = SourceAudit(1.0)
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            info = await c.info()
            await c.generate([prompts(1, length=30, base=7)[0]], SAMPLED)  # another request first (other_request)
            if fault == "stale_cache":
                await c.generate([ids], {"max_new_tokens": 1})  # fills the prefix cache with the prompt
            r = await _faulted(c, qwen_server.base_url, fault, ids)
            healthy = await c.generate([ids], SAMPLED)
            judged = await audit.audit(c, [r, *healthy.results], info)
        assert audit.stats.checked == 2 and audit.stats.flagged == 1
        return judged[0], judged[1]

    bad, good = asyncio.run(run())
    assert good.provenance.source_agreement == 1.0 and not good.provenance.source_flagged
    detail = bad.provenance.source_detail
    assert bad.provenance.source_flagged and detail is not None and part in detail.failing()
    untouched = {"generated": ["computed_prompt"], "cached_prompt": ["computed_prompt", "generated"]}.get(part, [])
    for seg in untouched:  # the other segments still agree on every cell: the verdict says where the fault is
        assert detail.by_segment[seg][0] == detail.by_segment[seg][1], (seg, detail)
    if fault == "stale_cache":
        assert bad.provenance.cached_tokens > 0
    with pytest.raises(StaleRoutingError, match="source audit"):
        check_provenance([good.provenance, bad.provenance])


def test_the_rescore_needs_its_fresh_salt(qwen_server: Any) -> None:
    """Without the salt the re-score of a just-served sample is served from the prefix cache: its rows come back
    from the cache, so a fault in them would too. With it, nothing is cached; rr's /generate refuses a bad salt."""

    async def run() -> tuple[int, int]:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            info = await c.info()
            assert salt_field(info) == "cache_salt"
            (r,) = (await c.generate(prompts(1, base=501), SAMPLED)).results
            tokens = r.prompt_ids + r.output_ids
            plain = await c.generate([tokens], {"max_new_tokens": 1})
            salted = await c._generate_chunk(
                [tokens], range(1), {"max_new_tokens": 1}, 1, info, True, 0, extra={"cache_salt": uuid.uuid4().hex}
            )
            async with httpx.AsyncClient(base_url=qwen_server.base_url) as h:
                bad = await h.post("/generate", json={"input_ids": tokens, "cache_salt": ["a", "b"]})
                assert bad.status_code == 400 and "cache_salt" in bad.text
            return plain.results[0].provenance.cached_tokens, salted[0].provenance.cached_tokens

    plain_cached, salted_cached = asyncio.run(run())
    assert plain_cached > 0 and salted_cached == 0
