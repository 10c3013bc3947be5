"""Replay under activation checkpointing, every kind: the recompute in backward replays the same rows inside the
block, and a checkpointed forward whose backward would run after the block is a ReplayError, never a silent
recompute with the model's own routing (reentrant checkpointing did that: router gradients off by ~1e-4).

Kinds: transformers' ``gradient_checkpointing_enable`` (reentrant, which TRL forces for PEFT + ZeRO-3, and not),
torch's own external wrapper (``apply_activation_checkpointing`` with ``checkpoint_wrapper``, both impls, as FSDP
users apply it) and ``torch.utils.checkpoint.checkpoint`` around the whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from rr_client.trainer.replay import ReplayError, find_routers, replay_routing
from tests.trainer.tiny_models import EXPERTS, LAYERS, TOPK, VOCAB, tiny_model

B, T = 2, 7
KINDS = ("hf_reentrant", "hf_non_reentrant", "wrapper_reentrant", "wrapper_non_reentrant", "function_reentrant")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and replayed rows that differ from the model's own choice (distinct ids per row)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(1, VOCAB, (B, T), generator=g)
    rows = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(B * T * LAYERS)])
    rows = rows.reshape(B, T, LAYERS, TOPK)
    rows[:, :, 1] = 0  # layer 1 is dense (mlp_only_layers): zero, as rr's layout writes it
    return x, rows


def _model(kind: str | None) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """A fresh tiny Qwen3-MoE in train mode, checkpointed as ``kind`` says, and its loss function."""
    model = tiny_model("qwen3_moe").train()
    if kind in ("hf_reentrant", "hf_non_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "hf_reentrant"})
    elif kind in ("wrapper_reentrant", "wrapper_non_reentrant"):
        impl = CheckpointImpl.REENTRANT if kind == "wrapper_reentrant" else CheckpointImpl.NO_REENTRANT
        layer_cls = type(model.model.layers[0])
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, layer_cls),
        )
        assert type(model.model.layers[0]).__name__ == "CheckpointWrapper"

    def logits(x: torch.Tensor) -> torch.Tensor:
        if kind == "function_reentrant":  # reentrant needs an input that requires grad: the embeddings
            emb = model.get_input_embeddings()(x)
            return checkpoint(lambda e: model(inputs_embeds=e, use_cache=False).logits, emb, use_reentrant=True)
        return model(x, use_cache=False).logits  # a recompute must not grow a KV cache

    return model, lambda x: torch.log_softmax(logits(x), -1)[..., 5].sum()


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _replayed_grads(kind: str | None, **kw: Any) -> dict[str, torch.Tensor]:
    x, rows = _inputs()
    model, loss = _model(kind)
    with replay_routing(model, rows, **kw):
        loss(x).backward()
    return _grads(model)


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    """Replayed gradients without checkpointing: what every checkpointed run must give; the replayed rows
    matter (the model's own routing gives other router gradients)."""
    grads = _replayed_grads(None)
    x, _ = _inputs()
    model, loss = _model(None)
    loss(x).backward()
    own = _grads(model)
    gates = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert gates and any(not torch.allclose(own[n], grads[n], atol=1e-6) for n in gates)
    return grads


@pytest.mark.parametrize("kind", KINDS)
def test_backward_inside_the_block_replays_the_recompute(kind: str, plain: dict[str, torch.Tensor]) -> None:
    got = _replayed_grads(kind, check_every=1)
    assert got.keys() == plain.keys()
    for n in plain:
        assert torch.allclose(got[n], plain[n], atol=1e-6, rtol=0), n


@pytest.mark.parametrize("kind", KINDS)
def test_backward_after_the_block_is_refused(kind: str) -> None:
    x, rows = _inputs()
    model, loss = _model(kind)
    with pytest.raises(ReplayError, match="checkpointed forward") as err:
        with replay_routing(model, rows):
            out = loss(x)
    assert str([r.layer for r in find_routers(model)]) in str(err.value)
    del out


@pytest.mark.parametrize("kind", ["hf_reentrant", "wrapper_non_reentrant"])
def test_forwards_that_owe_no_recompute_pass(kind: str) -> None:
    """A no-grad forward of a checkpointed model (old log-probs) and a forward whose graph is dropped before
    the block exits owe no recompute: no error, and the audit still proves every row reached its experts."""
    x, rows = _inputs()
    model, loss = _model(kind)
    with torch.no_grad(), replay_routing(model, rows):
        loss(x)
    with replay_routing(model, rows, audit=True) as report:
        loss(x)
    assert report is not None and report["r3/applied_share"] == 1.0


def test_audit_counts_forwards_not_recomputes_under_reentrant_checkpointing() -> None:
    x, rows = _inputs()
    model, loss = _model("hf_reentrant")
    with replay_routing(model, rows, audit=True, check_every=1) as report:
        loss(x).backward()
    assert report is not None
    assert report["r3/forwards"] == 1 and report["r3/applied_share"] == 1.0
