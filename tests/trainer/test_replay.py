"""replay_routing / record_routing on a tiny random model of every supported architecture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client import ExpertIdOutOfRangeError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.trainer.replay import ReplayError, UnsupportedModelError, find_routers, record_routing, replay_routing

from .tiny_models import ARCHS, EXPERTS, LAYERS, TOPK, VOCAB, moe_layers, tiny_model

B, T = 2, 7
_MODELS: dict[str, Any] = {}


def model_for(arch: str) -> Any:
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch)
    m = _MODELS[arch]
    m.eval()
    m.zero_grad(set_to_none=True)
    m.gradient_checkpointing_disable()
    return m


def ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))


class ExpertsSpy:
    """Independent of rr: what each MoE layer's router returned and what its experts module received."""

    def __init__(self, model: Any) -> None:
        self.router_out: dict[int, torch.Tensor] = {}
        self.experts_in: dict[int, torch.Tensor] = {}
        self.handles = []
        for r in find_routers(model):
            self.handles.append(r.module.register_forward_hook(self._router(r.layer)))
            self.handles.append(r.block.experts.register_forward_pre_hook(self._experts(r.layer)))

    def _router(self, layer: int) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> None:
            self.router_out[layer] = out[2].detach().clone()
        return hook

    def _experts(self, layer: int) -> Any:
        def hook(_m: Any, args: Any) -> None:
            self.experts_in[layer] = args[1].detach().clone()
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def own_choice(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and [B, T, L, K] routing (absolute layers, dense zero) from a plain forward, via the spy."""
    spy = ExpertsSpy(model)
    try:
        with torch.no_grad():
            logits = model(x).logits
    finally:
        spy.close()
    routing = torch.zeros(B * T, LAYERS, TOPK, dtype=torch.long)
    for layer, got in spy.router_out.items():
        routing[:, layer] = got
    return logits, routing.reshape(B, T, LAYERS, TOPK)


def other_ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(B * T * LAYERS)]).reshape(
        B, T, LAYERS, TOPK)


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
    spy = ExpertsSpy(model)
    try:
        with torch.no_grad(), replay_routing(model, forced, mask):
            changed = model(x).logits
    finally:
        spy.close()
    assert not torch.equal(changed, logits)
    flat_mask = mask.reshape(-1)
    for layer in moe_layers(arch):
        ran = spy.experts_in[layer]
        want_forced = forced.reshape(-1, LAYERS, TOPK)[:, layer]
        assert torch.equal(ran[flat_mask], want_forced[flat_mask])
        # unmasked rows keep the model's own choice (the router's own top-k at this layer's input)
        assert torch.equal(ran[~flat_mask], spy.router_out[layer][~flat_mask])
    assert set(spy.experts_in) == set(moe_layers(arch))


def _grads(model: Any, x: torch.Tensor, routing: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with replay_routing(model, routing):
        out = model(x).logits
        torch.log_softmax(out, -1)[..., 5].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_router_grad_and_checkpointing(arch: str) -> None:
    model = model_for(arch)
    x = ids()
    routing = other_ids(11)
    model.train()
    plain = _grads(model, x, routing)
    routers = [n for n in plain if n.endswith(("gate.weight", "router.weight")) and plain[n].shape[0] == EXPERTS]
    assert len(routers) == len(moe_layers(arch))
    for n in routers:
        assert plain[n].abs().sum() > 0, n
    model.gradient_checkpointing_enable()
    try:
        ckpt = _grads(model, x, routing)
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
