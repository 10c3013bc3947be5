"""verl's ``ToolAgentLoop`` keeps each turn's rows (rr's Trajectory rule), instead of overwriting them (verl #5825).

The loop is verl's own (built by its constructor from verl's config, run through ``_handle_generating_state``, the
step that stores the engine's routing). Only the inference server is stood in (:class:`ScriptedServer`, named):
it answers each turn with given tokens and rows, where turn 2's re-prefill of turn 1's tokens routed differently,
the batch-variance case R3 exists for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rr_client.core.errors import ShapeMismatchError


class ScriptedServer:
    """Stand-in for verl's LLM server client: each ``generate`` returns the next scripted (tokens, rows)."""

    def __init__(self, turns: list[tuple[list[int], np.ndarray]]) -> None:
        self.turns = list(turns)
        self.prompts: list[list[int]] = []

    async def generate(self, *, prompt_ids: list[int], **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        tokens, rows = self.turns.pop(0)
        assert rows.shape[0] == len(prompt_ids) + len(tokens) - 1  # what an engine returns for this turn
        self.prompts.append(list(prompt_ids))
        return TokenOutput(token_ids=tokens, routed_experts=rows, log_probs=[-1.0] * len(tokens))


def tool_loop(model_dir: Any, tokenizer: Any, server: ScriptedServer) -> Any:
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from tests.verl import harness as h

    cfg = h.ppo_config(model_dir)
    cfg.actor_rollout_ref.rollout.response_length = 64
    return ToolAgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
    )


def agent_data(prompt: list[int]) -> Any:
    from verl.experimental.agent_loop.tool_agent_loop import AgentData

    d = AgentData(
        messages=[],
        image_data=[],
        video_data=[],
        audio_data=None,
        mm_processor_kwargs=None,
        metrics={},
        request_id="t0",
        tools_kwargs={},
    )
    d.prompt_ids = list(prompt)
    return d


def rows(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    r = np.zeros((n, 3, 2), dtype=np.int64)
    for layer in (0, 2):
        r[:, layer] = np.stack([g.choice(8, 2, replace=False) for _ in range(n)])
    return r


def run_turns(make_loop: Any, data: Any, tool_tokens: list[int], turns: int, step: Any = None) -> None:
    """Build the loop inside the event loop (verl binds it at construction), then run ``turns`` generating steps."""

    async def go() -> None:
        loop = make_loop()
        for t in range(turns):
            if step is None:
                await loop._handle_generating_state(data, {"temperature": 1.0}, ignore_termination=True)
            else:
                await step(loop, data, {"temperature": 1.0}, ignore_termination=True)
            if t < turns - 1:
                data.prompt_ids = data.prompt_ids + tool_tokens  # what the tool state appends
                data.response_mask = data.response_mask + [0] * len(tool_tokens)

    asyncio.run(go())


def test_each_turn_adds_only_rows_the_trajectory_did_not_hold(
    verl_process: None, model_dir: Any, tokenizer: Any
) -> None:
    prompt, out1, tool, out2, out3 = [11, 12, 13, 14], [21, 22, 23], [31, 32], [41, 42], [51]
    n1 = len(prompt) + len(out1) - 1
    n2 = len(prompt + out1 + tool + out2) - 1
    n3 = len(prompt + out1 + tool + out2 + tool + out3) - 1
    a, b, c = rows(n1, 1), rows(n2, 2), rows(n3, 3)  # every turn's re-prefill routed the earlier tokens differently
    server = ScriptedServer([(out1, a), (out2, b), (out3, c)])
    data = agent_data(prompt)
    run_turns(lambda: tool_loop(model_dir, tokenizer, server), data, tool, 3)
    assert server.prompts[1] == prompt + out1 + tool and server.prompts[2] == server.prompts[1] + out2 + tool
    got = np.asarray(data.routed_experts)
    want = np.concatenate([a, b[n1:], c[n2:]])
    assert got.shape == (n3, 3, 2) and np.array_equal(got, want)
    # verl's own step (rr's wrapper removed) keeps only the last turn's rows
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    plain = ToolAgentLoop._handle_generating_state.__wrapped__
    server2 = ScriptedServer([(out1, a), (out2, b)])
    data2 = agent_data(prompt)
    run_turns(lambda: tool_loop(model_dir, tokenizer, server2), data2, tool, 2, step=plain)
    assert np.array_equal(np.asarray(data2.routed_experts), b)  # turn 1's generation-time rows are gone


def test_a_turn_with_fewer_rows_than_held_is_refused(verl_process: None, model_dir: Any, tokenizer: Any) -> None:
    prompt, out1 = [11, 12, 13, 14], [21, 22, 23]
    a = rows(len(prompt) + len(out1) - 1, 1)

    class Short(ScriptedServer):
        async def generate(self, *, prompt_ids: list[int], **_: Any) -> Any:
            from verl.workers.rollout.replica import TokenOutput

            if not self.prompts:
                self.prompts.append(prompt_ids)
                return TokenOutput(token_ids=out1, routed_experts=a)
            return TokenOutput(token_ids=[7], routed_experts=rows(3, 9))  # an engine that dropped the prefix rows

    data = agent_data(prompt)
    with pytest.raises(ShapeMismatchError, match="fewer than the 6 already held"):
        run_turns(lambda: tool_loop(model_dir, tokenizer, Short([])), data, [31], 2)
