"""MegatronReplay's lifecycle on a real one-process GPTModel: dense + MoE layers, batch 2, full recompute, one MTP layer,
two micro-batches in flight (forward 1, forward 2, backward 1, backward 2, as 1F1B's warm-up runs them).

What every router chose is read from the harness's hooks (tests/megatron/harness.py), independent of rr's feeder and
of Megatron's RouterReplay bookkeeping: on every forward and every recompute, each router chose exactly the rows of
its own micro-batch. Leaving REPLAY_FORWARD on (the lifecycle's hook removed) makes micro-batch 1's recompute use
micro-batch 2's rows, which the same assertion catches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.core.errors import MissingRoutingError, ReplayError
from rr_client.trainer import keys as K
from tests.megatron import harness as H

B, S, E, TOPK = 2, 6, 8, 2
PATTERN = (0, 1, 1)  # decoder layer 1 dense, layers 2 and 3 MoE; the MTP layer's router reads row layer 3
LAYERS = [0, 1, 2, 3]  # the rollout's layer axis: the 3 decoder layers and the MTP layer


@pytest.fixture()
def gpt(megatron_process: None) -> Any:
    """A fresh GPTModel with recompute and one MTP layer (its router registers last)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, mtp_layers=1, recompute=True))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: tokens ``[b, s]`` and rollout-like rows ``[b, s, 4, k]`` (distinct ids per token)."""
    tokens = torch.randint(0, H.VOCAB, (B, S), generator=torch.Generator().manual_seed(100 + seed))
    return tokens, H.random_rows(B, S, len(LAYERS), E, TOPK, seed=seed)


def _forward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """GPTModel's forward with labels (the MTP layer runs only with them): the summed loss."""
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    return model(tokens, position_ids, H.causal_mask(S), labels=tokens).sum()


def _want(router: Any, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``router`` must replay, in its token order (MTP: the row layer after the decoder's)."""
    layer = int(router.layer_number) - 1
    return H.sequence_first(rows[:, :, layer])


def _two_in_flight(model: Any, replay: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> H.RouterChoices:
    """Forward micro-batch 1 and 2 (rows set inside each 'forward_step_func'), then their backwards in order."""
    with H.hooked([model]) as choices:
        losses = []
        for tokens, rows in batches:
            replay.set_micro_batch(rows, layers=LAYERS)  # what forward_step_func does first
            losses.append(_forward(model, tokens))
        for loss in losses:
            loss.backward()
    return choices


def test_each_recompute_replays_its_own_micro_batch(gpt: Any) -> None:
    """Every router call (2 forwards, 2 recomputes) chose its own micro-batch's rows; the report says so."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt, mtp="rows", log_layers=True)
    batches = [_batch(1), _batch(2)]
    choices = _two_in_flight(gpt, replay, batches)
    report = replay.step_done()
    assert sorted(choices.layer_numbers().values()) == [2, 3, 4]
    for router in choices.routers:
        calls = choices.calls[router]
        assert [c.grad_enabled for c in calls] == [False, False, True, True]  # checkpointed forward 1, 2; recomputes
        for i, call in enumerate(calls):
            rows = batches[i % 2][1]
            H.assert_chose(call, _want(router, rows), f"layer {router.layer_number} call {i}")
    assert report[K.AUDITED] == 1.0 and report[K.APPLIED_SHARE] == 1.0 and report[K.MOE_LAYERS] == 3
    assert report[K.REPLAYED_ROWS] == 2 * 3 * B * S and report[K.FORWARDS] == 4
    assert 0.0 <= report[K.AGREEMENT] < 1.0  # random rows: the routers' own choice differs somewhere
    assert report[K.layer(3, "applied_share")] == 1.0  # the MTP router: row layer 3
    for router in H.routers(gpt):  # everything cleared after the step
        rep = router.router_replay
        assert rep.router_replay_action is None and rep.target_topk_idx is None and rep.replay_backward_list == []
    replay.close()


def test_without_the_lifecycle_recompute_takes_the_next_micro_batchs_rows(gpt: Any) -> None:
    """The failure the lifecycle fixes, shown by the same hooks: rr's targets, REPLAY_FORWARD left on (Megatron alone)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt, mtp="rows")
    replay.close()  # the feeder's layout only: no lifecycle hooks
    batches = [_batch(1), _batch(2)]
    with H.hooked([gpt]) as choices:
        losses = []
        for tokens, rows in batches:
            for module, target in replay.targets_for(rows, layers=LAYERS).targets.items():
                module.router_replay.set_target_indices(target)
                module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            losses.append(_forward(gpt, tokens))
        for loss in losses:
            loss.backward()
    for router in choices.routers:
        recompute_1 = choices.calls[router][2]
        H.assert_chose(recompute_1, _want(router, batches[1][1]))  # micro-batch 2's rows, silently
        with pytest.raises(AssertionError, match="tokens differ"):
            H.assert_chose(recompute_1, _want(router, batches[0][1]))
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


def test_a_forward_without_new_rows_is_refused(gpt: Any) -> None:
    """A second forward without set_micro_batch would replay the previous micro-batch's rows: refused."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt, mtp="rows")
    tokens, rows = _batch(1)
    replay.set_micro_batch(rows, layers=LAYERS)
    with torch.no_grad():
        _forward(gpt, tokens)
        with pytest.raises(ReplayError, match="without new rows"):
            _forward(gpt, tokens)
    replay.step_done(check=False)
    replay.close()


def test_audit_catches_what_undoes_replay(gpt: Any) -> None:
    """A capacity factor switched on after the checks drops replayed tokens: the audit raises at step_done."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt, mtp="rows")
    for router in H.routers(gpt):
        router.config.moe_expert_capacity_factor = 0.5  # bypasses the constructor's refusal on purpose
    try:
        tokens, rows = _batch(1)
        replay.set_micro_batch(rows, layers=LAYERS)
        with torch.no_grad():
            _forward(gpt, tokens)
        with pytest.raises(ReplayError, match="chose the given experts on"):
            replay.step_done()
    finally:
        for router in H.routers(gpt):
            router.config.moe_expert_capacity_factor = None
        replay.close()


def test_r2_records_in_the_log_prob_pass_and_replays_in_the_update(gpt: Any) -> None:
    """R2: a no-grad pass records each micro-batch under its key; after the weights move, the update (with
    recompute, both micro-batches in flight) chooses exactly the recorded experts on every call."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt, mode="R2", audit_every=1)
    batches = [_batch(1)[0], _batch(2)[0]]
    with H.hooked([gpt]) as own, torch.no_grad():
        for key, tokens in enumerate(batches):
            replay.record(key, tokens=tokens)
            _forward(gpt, tokens)
    replay.step_done()
    with torch.no_grad():  # the update's weights differ from the recording pass's
        for router in H.routers(gpt):
            router.weight.add_(torch.randn_like(router.weight))
    with H.hooked([gpt]) as choices:
        losses = []
        for key, tokens in enumerate(batches):
            replay.set_micro_batch(key=key, tokens=tokens)
            losses.append(_forward(gpt, tokens))
        for loss in losses:
            loss.backward()
    report = replay.step_done()
    for router in choices.routers:
        recorded = own.calls[router]
        for i, call in enumerate(choices.calls[router]):
            assert torch.equal(call.routing_map, recorded[i % 2].routing_map), f"layer {router.layer_number} call {i}"
    assert report[K.APPLIED_SHARE] == 1.0 and report[K.AGREEMENT] < 1.0  # the moved routers would choose otherwise
    with pytest.raises(MissingRoutingError, match="recorded in no micro-batch"):
        replay.set_micro_batch(key=7, tokens=_batch(3)[0])
    replay.close()
