"""The recompute pool on the hot path, on a real one-process GPTModel (megatron-core 0.16.1) and on its own.

- Identical GRPO samples (one-sample micro-batches, one prompt and one completion, other rows): every schedule that
  keeps them apart (F1 B1 F2 B2) passes ``step_done`` with each recompute on its own rows; a schedule that has both
  live when a recompute picks (F1 F2 B1 B2, F1 F2 B2 B1) is refused, since nothing tells the two recomputes apart;
  identical rows in flight together pass (a swap changes nothing).
- Pools only for the layers Megatron checkpoints (``recompute_method="block"``, ``recompute_num_layers=1``).
- At steady state with micro-batches in flight the pool reads nothing from the device and keeps one slot per
  outstanding forward.

What each router chose is read by the harness's own hooks (tests/megatron/harness.py), independent of rr.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.core.errors import ReplayError
from rr_client.trainer import keys as K
from tests.megatron import harness as H

S, E, TOPK = 6, 8, 2
PATTERN = (0, 1, 1)
LAYERS = [0, 1, 2]


@pytest.fixture()
def gpt(megatron_process: None) -> Any:
    """A fresh GPTModel with full recompute (every router re-runs in the backward)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True))


def _sample(rows_seed: int, tokens_seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-sample micro-batch: the group's prompt + completion (``tokens_seed``) with its own rollout rows."""
    tokens = torch.randint(0, H.VOCAB, (1, S), generator=torch.Generator().manual_seed(tokens_seed))
    return tokens, H.random_rows(1, S, len(LAYERS), E, TOPK, seed=rows_seed)


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    return model(tokens, torch.arange(s).unsqueeze(0).expand(b, s), H.causal_mask(s), labels=tokens).sum()


def _run(model: Any, replay: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], schedule: str) -> list[int]:
    """Run ``schedule`` ("F1 B1 F2 B2" ...); the micro-batch of each router call, in call order."""
    losses: dict[int, torch.Tensor] = {}
    order = []
    for step in schedule.split():
        i = int(step[1]) - 1
        if step[0] == "F":
            tokens, rows = batches[i]
            replay.set_micro_batch(rows, layers=LAYERS)
            losses[i] = _loss(model, tokens)
        else:
            losses.pop(i).backward()
        order.append(i)
    return order


def _assert_own_rows(choices: H.RouterChoices, order: list[int], batches: list[Any]) -> None:
    """Each router's calls (one per schedule step: a forward, or its recompute) chose their micro-batch's rows."""
    for router in choices.routers:
        calls = choices.calls[router]
        assert len(calls) == len(order), f"layer {router.layer_number}: {len(calls)} calls, {len(order)} steps"
        for call, mb in zip(calls, order):
            rows = H.sequence_first(batches[mb][1][:, :, int(router.layer_number) - 1])
            H.assert_chose(call, rows, f"layer {router.layer_number} (mb {mb})")


def test_identical_samples_kept_apart_pass_step_done(gpt: Any) -> None:
    """F1 B1 F2 B2 on one prompt + completion with other rows: each recompute had one live forward to pick, so it
    took its own rows, and step_done passes (it raised 'one input but other rows' before)."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt)
    batches = [_sample(1), _sample(2)]
    assert torch.equal(batches[0][0], batches[1][0]) and not torch.equal(batches[0][1], batches[1][1])
    with H.hooked([gpt]) as choices:
        order = _run(gpt, replay, batches, "F1 B1 F2 B2")
    _assert_own_rows(choices, order, batches)
    report = replay.step_done()
    assert report[K.APPLIED_SHARE] == 1.0 and report[K.FORWARDS] == 4
    replay.close()


@pytest.mark.parametrize("schedule", ["F1 F2 B1 B2", "F1 F2 B2 B1"])
def test_identical_samples_live_together_are_refused(gpt: Any, schedule: str) -> None:
    """Both identical samples live when the first recompute picks: the recomputes could swap their rows, so
    step_done refuses, naming the forwards live at the pick."""
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt)
    _run(gpt, replay, [_sample(1), _sample(2)], schedule)
    with pytest.raises(ReplayError, match="live at a recompute's pick with its input but other rows"):
        replay.step_done()
    replay.close()


@pytest.mark.parametrize(
    ("schedule", "rows_seeds", "tokens_seeds"),
    [
        ("F1 F2 B2 B1", (1, 1), (7, 7)),  # identical samples, identical rows: a swap changes nothing
        ("F1 F2 B1 B2", (1, 2), (7, 8)),  # other samples in flight together: told apart by their input
    ],
)
def test_in_flight_together_passes_when_no_swap_is_possible(
    gpt: Any, schedule: str, rows_seeds: tuple[int, int], tokens_seeds: tuple[int, int]
) -> None:
    from rr_client.integrations.megatron import MegatronReplay

    replay = MegatronReplay(gpt)
    batches = [_sample(r, t) for r, t in zip(rows_seeds, tokens_seeds)]
    with H.hooked([gpt]) as choices:
        order = _run(gpt, replay, batches, schedule)
    _assert_own_rows(choices, order, batches)
    assert replay.step_done()[K.APPLIED_SHARE] == 1.0
    replay.close()


def test_block_recompute_keeps_rows_only_for_checkpointed_layers(megatron_process: None) -> None:
    """``recompute_method="block"`` with ``recompute_num_layers=1``: Megatron checkpoints only the block's first
    layer, so only its router has a pool; the others' forwards keep nothing, and every call replays its own rows
    with the backwards reversed."""
    from rr_client.integrations.megatron import MegatronReplay

    H.new_model_state()
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    model = H.build_gpt(H.ModelSpec(moe_pattern=(1, 1, 1), config_overrides=block))
    replay = MegatronReplay(model)
    pools = {st.router.layer_number: st.pool is not None for st in replay.lifecycle.states.values()}
    assert pools == {1: True, 2: False, 3: False}
    batches = [_sample(1, 7), _sample(2, 8)]
    with H.hooked([model]) as choices:
        order = _run(model, replay, batches, "F1 F2 B2 B1")
    first = [r for r in choices.routers if int(r.layer_number) == 1]
    for router in choices.routers:
        want = order if router in first else order[:2]  # layers 2 and 3 are not re-run in the backward
        calls = choices.calls[router]
        assert len(calls) == len(want), f"layer {router.layer_number}: {len(calls)} calls"
        for call, mb in zip(calls, want):
            H.assert_chose(call, H.sequence_first(batches[mb][1][:, :, int(router.layer_number) - 1]))
    assert replay.step_done()[K.APPLIED_SHARE] == 1.0
    replay.close()


@pytest.mark.parametrize(
    ("config", "layer_pools"),
    [
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), [True] * 3),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), [True, True, False]),
        (dict(recompute_granularity="selective", recompute_modules=["moe"]), [True] * 3),
        (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), [False] * 3),
        (dict(), [False] * 3),
    ],
)
def test_pools_follow_megatrons_recompute_settings(megatron_process: None, config: dict, layer_pools: list) -> None:
    """Which routers get a pool, per Megatron-core 0.16.1's recompute settings (TransformerBlock's
    ``_checkpointed_forward``, MoELayer's ``moe_layer_recompute``)."""
    from rr_client.integrations.megatron import MegatronReplay

    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=(1, 1, 1), config_overrides=config))
    replay = MegatronReplay(model)
    got = {st.router.layer_number: st.pool is not None for st in replay.lifecycle.states.values()}
    assert [got[n] for n in (1, 2, 3)] == layer_pools
    replay.close()


def test_the_pool_reads_nothing_at_steady_state_with_micro_batches_in_flight() -> None:
    """Three micro-batches in flight for 60 micro-batches (1F1B's steady state): every recompute takes its own
    rows, the pool reads nothing from the device (it read the host once per router call past 32 live forwards)
    and keeps one slot per outstanding forward."""
    from rr_client.integrations.megatron._recompute import RecomputePool
    from rr_client.trainer.replay.cost import count_ops
    from rr_client.trainer.replay.phase import DeviceTally

    pool = RecomputePool("router")
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(S, 1, 16, generator=g) for _ in range(60)]
    rows = [torch.randint(0, E, (S, TOPK), generator=g) for _ in range(60)]
    depth, got = 3, []
    with count_ops() as counted:
        for i in range(60 + depth):
            if i < 60:
                pool.add(rows[i], torch.ones(S, dtype=torch.bool), hidden[i])
            if i >= depth - 1 and i - depth + 1 < 60:
                got.append(pool.take(hidden[i - depth + 1], S)[0])
    assert counted.syncs == 0, counted.sync_names
    assert all(torch.equal(t, rows[i]) for i, t in enumerate(got))
    assert pool.groups[S].fps.n == depth and len(pool) == 0
    tally = DeviceTally()
    pool.verdicts(tally, "r")
    assert tally.read() == {"r/miss": 0, "r/reused": 0, "r/ambiguous": 0}
