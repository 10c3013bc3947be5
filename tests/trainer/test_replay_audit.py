"""The replay audit: replay_routing(..., audit=True) proves per layer that the replayed ids reached the experts,
and names orphan routers, shifted layers and MoE blocks that bypass their router."""

from __future__ import annotations

import copy
import math
import types
from typing import Any

import pytest
import torch

from rr_client.core.errors import ShapeMismatchError
from rr_client.trainer.replay import ReplayError, replay_routing

from .helpers import random_routing, recorded, token_ids
from .tiny_models import LAYERS, TOPK, VOCAB, tiny_model

B, T = 2, 7


@pytest.fixture(scope="module")
def qwen() -> Any:
    return tiny_model("qwen3_moe")  # MoE layers 0 and 2, layer 1 dense


def ids() -> torch.Tensor:
    return token_ids(VOCAB, B, T)


own = recorded


def other_ids(seed: int) -> torch.Tensor:
    return random_routing(seed, B, T, dense=(1,))  # rr layout: the dense layer's rows are zero


def test_correct_replay_reports_100_percent(qwen: Any) -> None:
    x = ids()
    routing = own(qwen, x)
    with torch.no_grad(), replay_routing(qwen, routing, audit=True) as rep:
        qwen(x)
    assert rep["r3/forwards"] == 1
    assert rep["r3/moe_layers"] == 2
    assert rep["r3/replayed_rows"] == 2 * B * T
    assert rep["r3/left_rows"] == 0
    assert rep["r3/applied_share"] == 1.0
    assert rep["r3/agreement"] == 1.0  # the model's own choice replayed: its router agrees everywhere
    assert rep["r3/orphan_routers"] == 0 and rep["r3/unconsumed_layers"] == 0
    for layer in (0, 2):
        assert rep[f"r3/layer{layer}/replayed_rows"] == B * T
        assert rep[f"r3/layer{layer}/applied_share"] == 1.0
    assert "r3/layer1/replayed_rows" not in rep  # dense layer
    assert all(isinstance(v, float) for v in rep.values())  # a plain dict of numbers a trainer logs as is


def test_pad_tokens_count_neither_replayed_nor_left(qwen: Any) -> None:
    """With ``tokens`` (a RoutingTensors' attention_mask by default), the rows of pad tokens are in no count, so a
    padded layout (TRL) and a packed one (verl) of the same samples report the same rows."""
    x = ids()
    forced = other_ids(6)
    tokens = torch.ones(B, T, dtype=torch.bool)
    tokens[0, :3] = False  # left padding
    tokens[1, -2:] = False  # right padding
    mask = tokens.clone()
    mask[1, -3] = False  # a real token without a recorded row (the last sampled token)
    with torch.no_grad(), replay_routing(qwen, forced, mask, tokens=tokens, audit=True) as rep:
        qwen(x)
    assert rep["r3/replayed_rows"] == 2 * int(mask.sum())
    assert rep["r3/left_rows"] == 2 * 1
    with torch.no_grad(), replay_routing(qwen, forced, mask, audit=True) as rep:  # without tokens: pads are left
        qwen(x)
    assert rep["r3/left_rows"] == 2 * (B * T - int(mask.sum()))
    with pytest.raises(ShapeMismatchError, match="tokens shape"):
        with replay_routing(qwen, forced, mask, tokens=tokens[:, :-1], audit=True):
            pass


def test_forced_ids_mask_and_pads_are_counted(qwen: Any) -> None:
    x = ids()
    forced = other_ids(5)
    forced[1, 3] = -1  # a pad row: left to the model in every layer
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False
    with torch.no_grad(), replay_routing(qwen, forced, mask, audit=True) as rep:
        qwen(x)
    left_per_layer = 2 + 1
    assert rep["r3/left_rows"] == 2 * left_per_layer
    assert rep["r3/replayed_rows"] == 2 * (B * T - left_per_layer)
    assert rep["r3/applied_share"] == 1.0
    assert 0.0 <= rep["r3/agreement"] < 0.5  # random ids: the model's router rarely agrees
    own_ids = own(qwen, x)
    flat_f, flat_o = forced.reshape(-1, LAYERS, TOPK), own_ids.reshape(-1, LAYERS, TOPK)
    use = mask.reshape(-1) & (flat_f >= 0).all(-1).all(-1)
    for layer in (0, 2):
        same = (flat_f[:, layer].sort(-1).values == flat_o[:, layer].sort(-1).values).all(-1)
        assert rep[f"r3/layer{layer}/agreement"] == pytest.approx(int((same & use).sum()) / int(use.sum()))


def test_audit_under_gradient_checkpointing(qwen: Any) -> None:
    x = ids()
    qwen.train()
    qwen.gradient_checkpointing_enable()
    try:
        with replay_routing(qwen, other_ids(7), audit=True) as rep:
            qwen(x).logits.sum().backward()
    finally:
        qwen.gradient_checkpointing_disable()
        qwen.eval()
        qwen.zero_grad(set_to_none=True)
    assert rep["r3/forwards"] == 1  # the recompute in backward is not a second forward
    assert rep["r3/replayed_rows"] == 2 * B * T
    assert rep["r3/applied_share"] == 1.0  # checked in the forward and in the recompute


def test_orphan_router_is_an_error() -> None:
    model = tiny_model("qwen3_moe")
    x = ids()
    routing = own(model, x)
    # a rebuilt decoder layer (verl #7340): the forward runs a copy; the registered router never runs
    rebuilt = copy.deepcopy(model.model.layers[2])
    model.model.layers[2].forward = rebuilt.forward
    with pytest.raises(ReplayError, match=r"orphan routers.*layer 2 model\.layers\.2\.mlp\.gate") as e:
        with torch.no_grad(), replay_routing(model, routing, audit=True):
            model(x)
    assert e.value.report["r3/orphan_routers"] == 1
    assert math.isnan(e.value.report["r3/layer2/applied_share"])
    with torch.no_grad(), replay_routing(model, routing):  # without the audit: silently not replayed
        model(x)


def test_layer_shift_by_one_is_caught(qwen: Any) -> None:
    x = ids()
    routing = own(qwen, x)
    engine = routing.clone()
    engine[:, :, 1] = -1  # the engine marks the dense layer with -1 pads
    shifted = torch.full_like(engine, -1)
    shifted[:, :, 1:] = engine[:, :, :-1]  # every layer one too far: MoE layer 0's rows land on dense layer 1
    with torch.no_grad(), replay_routing(qwen, shifted):  # without the audit nothing complains
        qwen(x)
    with pytest.raises(ReplayError, match=r"layers \[1\] were consumed by no router") as e:
        with torch.no_grad(), replay_routing(qwen, shifted, audit=True):
            qwen(x)
    assert e.value.report["r3/unconsumed_layers"] == 1
    assert e.value.report["r3/replayed_rows"] == 0


def test_block_bypassing_its_router_is_caught() -> None:
    model = tiny_model("qwen3_moe")
    x = ids()
    block = model.model.layers[0].mlp

    def own_topk_forward(self: Any, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        flat = h.view(-1, d)
        logits, _, _ = self.gate(flat)  # calls the (replaying) router but chooses for itself
        w, i = torch.topk(torch.softmax(logits, -1, dtype=torch.float), TOPK, dim=-1)
        return self.experts(flat, i, (w / w.sum(-1, keepdim=True)).to(flat.dtype)).reshape(b, t, d)

    block.forward = types.MethodType(own_topk_forward, block)
    with pytest.raises(
        ReplayError,
        match=r"layer 0: only \d+/14 replayed rows reached the experts .*"
        "Qwen3MoeSparseMoeBlock",
    ) as e:
        with torch.no_grad(), replay_routing(model, other_ids(5), audit=True):
            model(x)
    assert e.value.report["r3/layer0/applied_share"] < 1.0
    assert e.value.report["r3/layer2/applied_share"] == 1.0


def test_no_forward_inside_an_audited_block_is_an_error(qwen: Any) -> None:
    with pytest.raises(ReplayError, match="no forward"):
        with replay_routing(qwen, own(qwen, ids()), audit=True):
            pass
