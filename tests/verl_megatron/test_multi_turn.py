"""verl's ``ToolAgentLoop`` keeps each turn's rows under verl Megatron R3 too (issue 56 item 5), as on FSDP2.

verl overwrites a trajectory's rows with each turn's (verl #5825): the last turn's re-prefill rows would be replayed
over earlier turns' tokens. The loop is verl's own, built from verl's generated Megatron PPO config
(``actor.strategy=megatron``, ``megatron.router_replay.mode=R3``); only the inference server is stood in
(tests/verl/test_multi_turn.py's :class:`ScriptedServer`, named there), answering each turn with rows whose
re-prefill of earlier tokens routed differently.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.verl.test_multi_turn import ScriptedServer, agent_data, rows, run_turns


def megatron_tool_loop(model_dir: Any, tokenizer: Any, server: ScriptedServer, mode: str) -> Any:
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from tests.verl_megatron import harness as h

    cfg = h.ppo_config(model_dir, mode=mode)
    cfg.actor_rollout_ref.rollout.response_length = 64
    return ToolAgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
    )


@pytest.mark.parametrize("mode", ["R3", "disabled"])
def test_megatron_r3_keeps_each_turns_generation_rows(
    megatron_verl_process: None, model_dir: Any, tokenizer: Any, mode: str
) -> None:
    """R3: the trajectory's rows are turn 1's generation rows, then each later turn's new ones (the rows its
    engine routed when it generated them); without replay verl's own step runs (the last turn's rows)."""
    prompt, out1, tool, out2, out3 = [11, 12, 13, 14], [21, 22, 23], [31, 32], [41, 42], [51]
    n1 = len(prompt) + len(out1) - 1
    n2 = len(prompt + out1 + tool + out2) - 1
    n3 = len(prompt + out1 + tool + out2 + tool + out3) - 1
    a, b, c = rows(n1, 1), rows(n2, 2), rows(n3, 3)  # each turn's re-prefill routed the earlier tokens differently
    server = ScriptedServer([(out1, a), (out2, b), (out3, c)])
    data = agent_data(prompt)
    run_turns(lambda: megatron_tool_loop(model_dir, tokenizer, server, mode), data, tool, 3)
    got = np.asarray(data.routed_experts)
    want = np.concatenate([a, b[n1:], c[n2:]]) if mode == "R3" else c
    assert got.shape == (n3, 3, 2) and np.array_equal(got, want)
    if mode == "R3":
        assert not np.array_equal(got, c)  # the last turn's re-prefill rows are not what replays
