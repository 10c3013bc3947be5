"""The client's provenance against the real vLLM 0.30 CPU server (issue 38): the server's ``rr_provenance`` digest
is the client's (``rr_client.tokens_digest``, checked on every parse), a real ref paired with another sample's
tokens is refused before any read, and a trajectory's turns carry their provenance and row spans over rows equal
to transformers'. Uses the session's ``qwen_server``; the server side is tests/vllm/test_provenance.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rr_client import RoutedExpertsClient, StaleRoutingError, tokens_digest
from rr_client.core.hf_config import load_config, moe_layers_from_config
from rr_server.demo.tiny_moe import reference_routing
from tests.support.routing_asserts import assert_routing_sets_equal

pytestmark = pytest.mark.vllm_server

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


def test_real_refs_bind_to_their_samples_and_trajectory_turns_carry_spans(qwen_server: Any) -> None:
    prompts = [[11 + i for i in range(40)], [300 + i for i in range(24)]]
    moe = moe_layers_from_config(load_config(qwen_server.model_dir))

    async def run() -> Any:
        async with RoutedExpertsClient(qwen_server.base_url) as c:
            batch = await c.generate(prompts, GREEDY, by_reference=True)
            a, b = batch.results
            for r in (a, b):
                assert r.provenance is not None and r.routing_ref.provenance is not None
                assert r.provenance.tokens_digest == tokens_digest(r.prompt_ids, r.output_ids)
                assert r.routing_ref.provenance.tokens_digest == r.provenance.tokens_digest
            refs = [a.routing_ref, b.routing_ref]
            with pytest.raises(StaleRoutingError, match=a.routing_ref.key):
                await c.resolve(refs, tokens=[b, a])  # the two samples' rows swapped by the bookkeeping
            rows = await c.resolve(refs, tokens=[a, b])
            assert [x.shape[0] for x in rows] == [len(r.prompt_ids) + len(r.output_ids) - 1 for r in (a, b)]
            (choice,) = await c.complete(prompts[1], GREEDY)
            assert choice.provenance is not None and choice.output_ids == b.output_ids

            traj = c.trajectory(prompts[0], by_reference=True)
            await traj.generate(GREEDY)
            traj.extend([7, 8, 9])
            await traj.generate(GREEDY)
            await traj.resolve()  # each turn's ref bound to that turn's tokens
            return traj

    traj = asyncio.run(run())
    p0, p1 = traj.provenances
    assert p0 is not None and p1 is not None
    assert not p0.spans_update and not p1.spans_update and p1.preemptions == 0
    s0, s1 = traj.turn_spans
    for p, s in ((p0, s0), (p1, s1)):  # the cached segment is the part of the server's hit among the turn's rows
        assert s.cached_prompt == (s.rows[0], max(s.rows[0], min(p.cached_tokens, s.computed_prompt[1])))
    assert s0.rows == (0, 40 + 6 - 1) and s1.rows == (s0.rows[1], len(traj.input_ids) - 1)
    for s in (s0, s1):
        assert s.cached_prompt[0] == s.rows[0] and s.cached_prompt[1] == s.computed_prompt[0]
        assert s.computed_prompt[1] == s.generated[0] == len(traj.turns[s.turn].prompt_ids or [])
        assert s.generated[1] == s.rows[1]
    truth = reference_routing(qwen_server.model_dir, traj.input_ids)[:-1]
    assert_routing_sets_equal(traj.routed_experts, truth, layers=moe)
    assert np.array_equal(traj.routed_experts.shape, truth.shape)
