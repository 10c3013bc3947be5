"""Megatron's feeder on :class:`rr_client.trainer.ReplayRows` (issue 43), on megatron-core's real ``GPTModel``: the
layer axis, integer ids and layers served dense are refused by type; a partly padded row is refused; pad tokens
spread over every expert (counted from what the routers chose, or from the targets where no forward runs).
"""

from __future__ import annotations

import pytest
import torch

from rr_client.core.errors import ArgumentTypeError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.trainer.rows import last_tokens
from tests.megatron import harness as H
from tests.megatron.test_feeder import PATTERN, B, E, S, _packed, forward, gpt, rollout


def per_expert(ids: torch.Tensor) -> torch.Tensor:
    """How many of ``ids`` (``[tokens, K]``) name each expert."""
    return torch.bincount(ids.long().flatten(), minlength=E)


def assert_even(counts: torch.Tensor, what: str) -> None:
    """Pad tokens per expert within one of even (``arange(K)`` pads put every one on experts 0..K-1)."""
    assert int(counts.sum()) > E * 1, f"{what}: too few pads to tell"
    assert int(counts.max() - counts.min()) <= 1, f"{what}: pad tokens per expert {counts.tolist()}"


def test_a_layer_axis_that_disagrees_with_layers_is_refused(megatron_process: None) -> None:
    """A raw tensor with 4 layer positions while ``layers=`` names 3 (before: rows taken by position, silently)
    or 2 positions (before: an untyped IndexError): ShapeMismatchError naming both counts."""
    from rr_client.integrations.megatron import MegatronReplay, router_targets

    model = gpt()
    batch = rollout(seed=11)
    four = torch.cat([batch.routed_experts, batch.routed_experts[:, :, :1]], dim=2)  # [b, s, 4, K]
    with pytest.raises(ShapeMismatchError, match="layers= names 3 layers .* layer axis has 4 positions"):
        router_targets(model, four, layers=[0, 1, 2], mask=batch.routed_experts_mask)
    with pytest.raises(ShapeMismatchError, match="layers= names 3 layers .* layer axis has 2 positions"):
        router_targets(model, batch.routed_experts[:, :, 1:], layers=[0, 1, 2], mask=batch.routed_experts_mask)
    replay = MegatronReplay(model)
    with pytest.raises(ShapeMismatchError, match="has 4 positions"):
        replay.set_micro_batch(four, layers=[0, 1, 2], mask=batch.routed_experts_mask)
    assert all(r.router_replay.target_topk_idx is None for r in H.routers(model))  # nothing was fed
    replay.close()


def test_float_ids_are_refused(megatron_process: None) -> None:
    """Float ids (before: truncated to other experts) and any non-integer dtype: refused, naming the dtype."""
    from dataclasses import replace

    from rr_client.integrations.megatron import router_targets

    model = gpt()
    batch = rollout(seed=12)
    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        ids = batch.routed_experts.to(dtype)
        if dtype.is_floating_point:
            ids = ids + 0.25  # truncated, these would be the rows' ids: they are refused all the same
        with pytest.raises(ArgumentTypeError, match=f"dtype {dtype}: expert ids must be an integer tensor"):
            router_targets(model, ids, layers=[0, 1, 2])
        with pytest.raises(ArgumentTypeError, match="integer"):
            router_targets(model, replace(batch, routed_experts=batch.routed_experts.to(dtype)))


@pytest.mark.parametrize("marker", ["zero", "minus_one"])
def test_a_layer_megatron_builds_as_moe_but_the_engine_served_dense_is_refused(
    megatron_process: None, marker: str
) -> None:
    """Top-1: the engine served decoder layer 2 dense (zero rows, or no rows), Megatron routes it (before: every
    token replayed to expert 0 at top-1, silently): refused, naming the router."""
    from dataclasses import replace

    from rr_client.integrations.megatron import router_targets

    model = gpt(topk=1, config_overrides={"moe_router_pre_softmax": True})
    attn = torch.ones(B, S, dtype=torch.long)
    mask = attn.bool() & ~last_tokens(attn)
    rows = H.random_rows(B, S, len(PATTERN), E, 1, seed=13)
    rows[:, :, 1] = 0 if marker == "zero" else -1  # layer index 1 = decoder layer 2: dense for the engine
    rows[~mask] = 0
    batch = replace(rollout(seed=13), routed_experts=rows, routed_experts_mask=mask)
    what = "all 14 rows are zero" if marker == "zero" else "no token has a row at layer 1"
    with pytest.raises(
        ShapeMismatchError,
        match=rf"decoder layer 2 \(chunk 0, .*\): {what}.*served this layer "
        "dense",
    ):
        router_targets(model, batch)


def test_a_partly_padded_row_is_refused(megatron_process: None) -> None:
    """A row with a -1 beside expert ids (miles #2770): UnrecordedRoutingError naming token and router; a whole -1
    token is a pad, fed pad experts."""
    from dataclasses import replace

    from rr_client.integrations.megatron import router_targets

    model = gpt()
    attn = torch.ones(B, S, dtype=torch.long)
    attn[0, :3] = 0  # left padding
    batch = rollout(seed=14, attention=attn)
    rows = batch.routed_experts.clone().to(torch.int16)
    rows[0, 1] = -1  # a whole -1 pad token: its mask says True, its ids say no row
    mask = batch.routed_experts_mask.clone()
    mask[0, 1] = True
    router_targets(model, replace(batch, routed_experts=rows, routed_experts_mask=mask))
    rows[1, 4, 1, 1] = -1
    with pytest.raises(UnrecordedRoutingError, match=r"decoder layer 2 .*sample 1, position 4 is partly padded"):
        router_targets(model, replace(batch, routed_experts=rows))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_pads_spread_over_every_expert(megatron_process: None, side: str) -> None:
    """Heavily padded ``[b, s]`` batch: per router, the pad tokens' experts, as the routers chose them in the
    forward, are within one of even; the real tokens chose their rows."""
    from rr_client.integrations.megatron import MegatronReplay

    model = gpt()
    attn = torch.ones(B, S, dtype=torch.long)
    if side == "left":
        attn[0, :5], attn[1, :3] = 0, 0
    else:
        attn[0, 3:], attn[1, 5:] = 0, 0
    batch = rollout(seed=15, attention=attn)
    replay = MegatronReplay(model)
    fed = replay.set_micro_batch(batch)
    with H.hooked([model]) as choices:
        forward(model, batch.input_ids)
    replay.step_done()
    have = fed.have
    assert have is not None
    for router in choices.routers:
        (call,) = choices.calls[router]
        pads = torch.tensor(H.RouterCall(call.routing_map[~have], False).chosen())
        assert_even(per_expert(pads), f"{side} padding, layer {router.layer_number}")
        want = H.sequence_first(batch.routed_experts[:, :, router.layer_number - 1])
        H.assert_chose(H.RouterCall(call.routing_map[have], False), want[have], f"layer {router.layer_number}")


def test_packed_and_context_parallel_pads_spread_over_every_expert(megatron_process: None) -> None:
    """Packed THD on Megatron's padded per-sample axis, and a padded batch under CP=2 (each rank's tokens): every
    router's pad targets are within one of even on each rank."""
    from rr_client.integrations.megatron import MegatronReplay, Parallel

    model = gpt()
    replay = MegatronReplay(model)
    packed = _packed([3, 6])
    fed = replay.targets_for(packed, cu_seqlens_padded=[0, 8, 16])
    assert fed.have is not None and int((~fed.have).sum()) == 16 - 7
    for module, targets in fed.targets.items():
        assert_even(per_expert(targets[~fed.have]), f"packed, layer {module.layer_number}")
    attn = torch.ones(B, S, dtype=torch.long)
    attn[0, :4] = 0
    batch = rollout(seed=16, attention=attn)
    for rank in (0, 1):
        fed = replay.targets_for(batch, parallel=Parallel(cp_size=2, cp_rank=rank))
        assert fed.have is not None
        for module, targets in fed.targets.items():
            counts = per_expert(targets[~fed.have])
            assert int(counts.max() - counts.min()) <= 1, f"CP rank {rank}, layer {module.layer_number}: {counts}"
    replay.close()
