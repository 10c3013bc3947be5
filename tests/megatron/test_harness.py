"""The harness's router hooks see what Megatron's routers really chose, including what Megatron lets through silently."""

from __future__ import annotations

import pytest
import torch

from tests.megatron import harness as H

B, S = 2, 6


@pytest.fixture()
def gpt(megatron_process: None) -> object:
    """A fresh GPTModel: dense layer 1, MoE layers 2 and 3, one MTP layer (its router registers last)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=(0, 1, 1), mtp_layers=1))


def _forward(model: object) -> None:
    """One forward with loss (the MTP layer runs only with labels)."""
    tokens = torch.randint(0, H.VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    model(tokens, position_ids, H.causal_mask(S), labels=tokens)  # type: ignore[operator]


def _hooked_forward(gpt: object, action: object, replay: list[torch.Tensor] | None = None) -> H.RouterChoices:
    """One forward seen by the harness's hooks, Megatron's routers under ``action`` (with ``replay``: those rows
    handed to Megatron first); the action, and the rows with them, cleared after."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if replay is not None:
        RouterReplay.set_replay_data(replay)
    RouterReplay.set_global_router_replay_action(action)
    try:
        with H.hooked([gpt]) as choices:
            _forward(gpt)
    finally:
        RouterReplay.clear_global_router_replay_action()
        if replay is not None:
            RouterReplay.clear_global_indices()
    return choices


def test_hooks_agree_with_megatrons_own_record(gpt: object) -> None:
    """With RECORD, each hooked router's per-token choice equals the top-k Megatron itself recorded for it."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    choices = _hooked_forward(gpt, RouterReplayAction.RECORD)
    assert sorted(choices.layer_numbers().values()) == [2, 3, 4]  # MoE layers 2, 3; the MTP layer's router: 4
    for router in choices.routers:
        (call,) = choices.calls[router]
        recorded = router.router_replay.recorded_topk_idx
        assert call.routing_map.shape == (S * B, 8)
        H.assert_chose(call, recorded, f"layer {router.layer_number}")


def test_hooks_catch_short_rows_megatron_accepts(gpt: object) -> None:
    """Megatron replays one row fewer than tokens without a word; the hooks show the last token routed nowhere."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rows = H.random_rows(B, S, 3, 8, 2, seed=5)
    targets = [H.sequence_first(rows[:, :, i]).long() for i in (1, 2, 2)]  # MTP: layer 3's rows, any valid ids
    choices = _hooked_forward(gpt, RouterReplayAction.REPLAY_FORWARD, replay=[t[:-1] for t in targets])
    for router, want in zip(choices.routers, targets):
        (call,) = choices.calls[router]
        H.assert_chose(type(call)(call.routing_map[:-1], call.grad_enabled), want[:-1])  # the rows given: replayed
        assert call.chosen()[-1] == []  # the token without a row: zero experts, silently
        with pytest.raises(AssertionError, match="1 of 12 tokens differ"):
            H.assert_chose(call, want)


def test_patches_are_undone_for_the_rest_of_the_session(megatron_process: None) -> None:
    """unpatch_cpu (the package fixture's teardown) gives torch and Megatron back as shipped; patch_cpu redoes it."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import moe_utils

    H.unpatch_cpu()
    try:
        assert torch.cuda.current_device.__module__ == "torch.cuda"
        assert schedules.torch is torch and not hasattr(moe_utils, "te_general_gemm")
    finally:
        H.patch_cpu()
    assert torch.cuda.current_device() == "cpu" and moe_utils.te_general_gemm is None
