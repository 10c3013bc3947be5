"""replay_routing / record_routing on a tiny random model of every supported architecture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client import ExpertIdOutOfRangeError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.trainer.replay import ReplayError, UnsupportedModelError, find_routers, record_routing, replay_routing

from .helpers import ExpertsSpy, ModelCache, grads, random_routing, spied_forward, token_ids
from .tiny_models import ARCHS, EXPERTS, LAYERS, TOPK, VOCAB, moe_layers, tiny_model

B, T = 2, 7
_MODELS = ModelCache(tiny_model)


def model_for(arch: str) -> Any:
    return _MODELS.get(arch)


def ids() -> torch.Tensor:
    return token_ids(VOCAB, B, T)


def forward_logits(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


def own_choice(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and [B, T, L, K] routing (absolute layers, dense zero) from a plain forward, via the spy."""
    out, spy = spied_forward(model, x, forward_logits)
    return out, spy.routing(B, T, LAYERS, TOPK)


def other_ids(seed: int) -> torch.Tensor:
    return random_routing(seed, B, T)


@pytest.mark.parametrize("arch", ARCHS)
def test_own_choice_replayed_reproduces_logits(arch: str) -> None:
    model = model_for(arch)
    x = ids()
    logits, routing = own_choice(model, x)
    with torch.no_grad(), replay_routing(model, routing.to(torch.uint8)):
        again = model(x).logits
    assert torch.equal(again, logits)
    # MoE-ordinal layer axis gives the same
    moe = moe_layers(arch)
    with torch.no_grad(), replay_routing(model, routing[:, :, moe]):
        assert torch.equal(model(x).logits, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_other_ids_run_exactly_those_experts(arch: str) -> None:
    model = model_for(arch)
    x = ids()
    logits, own = own_choice(model, x)
    forced = other_ids(5)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(9)) > 0.3
    with ExpertsSpy(model) as spy, torch.no_grad(), replay_routing(model, forced, mask):
        changed = model(x).logits
    assert not torch.equal(changed, logits)
    flat_mask = mask.reshape(-1)
    for layer in moe_layers(arch):
        ran = spy.experts[layer]
        want_forced = forced.reshape(-1, LAYERS, TOPK)[:, layer]
        assert torch.equal(ran[flat_mask], want_forced[flat_mask])
        # unmasked rows keep the model's own choice (the router's own top-k at this layer's input)
        assert torch.equal(ran[~flat_mask], spy.router[layer][~flat_mask])
    assert set(spy.experts) == set(moe_layers(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_router_grad_and_checkpointing(arch: str) -> None:
    model = model_for(arch)
    x = ids()
    routing = other_ids(11)
    model.train()
    plain = grads(model, x, routing, forward_logits)
    routers = [n for n in plain if n.endswith(("gate.weight", "router.weight")) and plain[n].shape[0] == EXPERTS]
    assert len(routers) == len(moe_layers(arch))
    for n in routers:
        assert plain[n].abs().sum() > 0, n
    model.gradient_checkpointing_enable()
    try:
        ckpt = grads(model, x, routing, forward_logits)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert plain.keys() == ckpt.keys()
    if arch == "qwen3_moe":  # backward after leaving the block would recompute with the model's own routing
        model.train()
        model.gradient_checkpointing_enable()
        try:
            with pytest.raises(ReplayError, match="backward"):
                with replay_routing(model, routing):
                    loss = model(x).logits.sum()  # forward only, graph kept: no backward inside the block
            del loss
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n


@pytest.mark.parametrize("arch", ARCHS)
def test_record_then_replay_round_trips(arch: str) -> None:
    model = model_for(arch)
    x = ids()
    logits, own = own_choice(model, x)
    with torch.no_grad(), record_routing(model) as rec:
        recorded_logits = model(x).logits
    got = rec.routed_experts
    assert got.shape == (B, T, LAYERS, TOPK)
    assert torch.equal(got, own)  # rr layout: absolute layers, dense layers zero
    dense = [i for i in range(LAYERS) if i not in moe_layers(arch)]
    assert not got[:, :, dense].any()
    assert torch.equal(recorded_logits, logits)
    # R2: record in the log-prob pass, replay in an update pass of a *changed* model -> same experts run
    with torch.no_grad(), replay_routing(model, got):
        assert torch.equal(model(x).logits, logits)


def test_record_under_checkpointing_and_packed_rows() -> None:
    model = model_for("qwen3_moe")
    x = ids()
    _, own = own_choice(model, x)
    model.train()
    model.gradient_checkpointing_enable()
    try:
        with record_routing(model) as rec:
            model(x).logits.sum().backward()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert torch.equal(rec.routed_experts, own)
    # packed [N, L, K] rows replay the same as [B, T, L, K]
    with torch.no_grad():
        ref = model(x).logits
        with replay_routing(model, own.reshape(B * T, LAYERS, TOPK)):
            assert torch.equal(model(x).logits, ref)


def test_refusals() -> None:
    model = model_for("qwen3_moe")
    x = ids()
    _, own = own_choice(model, x)
    with pytest.raises(ShapeMismatchError, match="tokens"), torch.no_grad():
        with replay_routing(model, own[:, :-1]):
            model(x)
    with pytest.raises(ShapeMismatchError, match="layers"):
        with replay_routing(model, own[:, :, :1]):
            pass
    with pytest.raises(ShapeMismatchError, match="top-"):
        with replay_routing(model, own[..., :1]):
            pass
    bad = own.clone()
    bad[0, 0, 0, 0] = EXPERTS
    with pytest.raises(ExpertIdOutOfRangeError):
        with replay_routing(model, bad):
            pass
    zero = own.clone()
    zero[0, 0] = 0
    with pytest.raises(UnrecordedRoutingError):
        with replay_routing(model, zero):
            pass
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 0] = False
    with torch.no_grad(), replay_routing(model, zero, mask):  # masked zero row: fine
        model(x)
    minus = own.clone()
    minus[0, 0] = -1  # -1 pad rows keep the model's own choice
    with torch.no_grad(), replay_routing(model, minus):
        model(x)


def test_unknown_router_and_replaced_block_are_refused() -> None:
    model = tiny_model("qwen3_moe")

    class MyTopKRouter(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h

    model.model.layers[0].mlp.gate2 = MyTopKRouter()
    with pytest.raises(UnsupportedModelError, match="MyTopKRouter"):
        find_routers(model)
    del model.model.layers[0].mlp.gate2

    block = model.model.layers[0].mlp
    block.forward = lambda h: torch.zeros_like(h)  # a "kernel" that never calls the router
    _, own = own_choice(tiny_model("qwen3_moe"), ids())
    with pytest.raises(UnsupportedModelError, match="without calling its router"), torch.no_grad():
        with replay_routing(model, own):
            model(ids())
    dense_only = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UnsupportedModelError, match="no supported MoE router"):
        find_routers(dense_only)
