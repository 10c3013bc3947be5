"""Replay's cost model, counted on the CPU (rr_client.trainer.replay.cost): aten ops and host syncs per MoE layer.

Budgets (issue 28): inside forward + backward, replay adds 0 host syncs and at most 8 ops per MoE layer when the
sampled formula check does not run, and the check adds at most one formula and 2 ops on the forwards it samples;
opening a block costs at most 2 host syncs whatever the layer count; the audit at most 16 ops per layer and one
host read at exit; record_routing 0 ops and 0 syncs in the forward. On a GPU each op is a kernel launch and each
sync a stall; the time ratios are in docs/benchmarks.md (benchmarks/replay_overhead.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.errors import UnsupportedModelError
from rr_client.trainer.replay import SUPPORTED_ROUTERS, find_routers, record_routing, replay_routing
from rr_client.trainer.replay.cost import count_ops
from rr_client.trainer.replay.formulas import softmax_gather
from tests.trainer.tiny_models import ARCHS, tiny_config

FAMILIES = tuple(a for a in ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss") if a in ARCHS)  # 5.10: no deepseek_v3
B, T = 2, 8


def _model(arch: str, layers: int = 4) -> Any:
    import transformers

    cfg = tiny_config(arch)
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, list):  # GPT-OSS: one attention kind per layer
        cfg.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
    cfg.num_hidden_layers = layers
    if arch == "qwen3_moe":
        cfg.mlp_only_layers = [1]
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()


def _setup(arch: str, layers: int = 4) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    model = _model(arch, layers)
    x = torch.randint(1, 60, (B, T))
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    return model, x, rec.routed_experts.to(torch.int16), mask, len(find_routers(model))


def _step(model: Any, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).logits.float().mean().backward()


def _cost(model: Any, x: torch.Tensor, ctx: Any) -> tuple[Any, Any, Any]:
    """(opening, forward + backward, exit) counts of one block."""
    with count_ops() as opening:
        ctx.__enter__()
    try:
        with count_ops() as inside:
            _step(model, x)
    except BaseException:
        ctx.__exit__(None, None, None)
        raise
    with count_ops() as closing:
        ctx.__exit__(None, None, None)
    return opening, inside, closing


def _baseline(model: Any, x: torch.Tensor) -> Any:
    _step(model, x)
    with count_ops() as c:
        _step(model, x)
    return c


@pytest.mark.parametrize("masked", [False, True], ids=["all_rows", "masked"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_replay_inside_forward_and_backward(arch: str, masked: bool) -> None:
    model, x, rows, mask, n_moe = _setup(arch)
    base = _baseline(model, x)
    with replay_routing(model, rows, mask if masked else None):  # the sampled check runs on this first forward
        _step(model, x)
    opening, inside, closing = _cost(model, x, replay_routing(model, rows, mask if masked else None))
    assert inside.syncs == base.syncs, inside.sync_names - base.sync_names
    per_layer = (inside.ops - base.ops) / n_moe
    assert 0 < per_layer <= 8, (per_layer, inside.names - base.names)
    assert opening.syncs <= 2, opening.sync_names
    assert closing.syncs == 0, closing.sync_names  # no check sampled, no audit: nothing to read


@pytest.mark.parametrize("arch", FAMILIES)
def test_sampled_formula_check_costs_one_formula_and_one_read(arch: str) -> None:
    model, x, rows, _, n_moe = _setup(arch)
    base = _baseline(model, x)
    _, plain, _ = _cost(model, x, replay_routing(model, rows, check_formula=False))
    _, checked, closing = _cost(model, x, replay_routing(model, rows, check_every=1))
    assert checked.syncs == base.syncs
    extra = (checked.ops - plain.ops) / n_moe
    assert 0 < extra <= (plain.ops - base.ops) / n_moe + 2, (extra, checked.names - plain.names)
    assert closing.syncs == 1, closing.sync_names


@pytest.mark.parametrize("layers", [2, 8])
def test_opening_a_block_reads_the_host_once_whatever_the_layer_count(layers: int) -> None:
    model, _, rows, mask, _ = _setup("qwen3_moe", layers)
    with count_ops() as c, replay_routing(model, rows, mask, check_formula=False):
        pass
    assert c.syncs == 1, c.sync_names


@pytest.mark.parametrize("arch", FAMILIES)
def test_audit_ops_and_one_read_at_exit(arch: str) -> None:
    model, x, rows, mask, n_moe = _setup(arch)
    base = _baseline(model, x)
    opening, inside, closing = _cost(model, x, replay_routing(model, rows, mask, check_formula=False, audit=True))
    assert inside.syncs == base.syncs, inside.sync_names - base.sync_names
    assert (inside.ops - base.ops) / n_moe <= 16, inside.names - base.names
    assert closing.syncs == 1 and opening.syncs <= 2


@pytest.mark.parametrize("arch", FAMILIES)
def test_record_adds_nothing_to_the_forward(arch: str) -> None:
    model, x, *_ = _setup(arch)
    base = _baseline(model, x)
    with record_routing(model) as rec:
        with count_ops() as inside:
            _step(model, x)
    assert inside.ops == base.ops and inside.syncs == base.syncs
    assert rec.tensor(None).shape[:2] == (B, T)


def test_the_sampled_check_refuses_a_wrong_formula_on_its_first_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A formula that differs from the router (here: no renormalisation for a router that renormalises) is
    refused when the block exits, on the first replayed forward of the model; forwards between two samples are
    not checked (the check is sampled, every ``check_every``-th forward)."""
    monkeypatch.setitem(SUPPORTED_ROUTERS, "Qwen3MoeTopKRouter", softmax_gather(False))
    model, x, rows, _, _ = _setup("qwen3_moe")
    with pytest.raises(UnsupportedModelError, match="differ from rr's formula"):
        with replay_routing(model, rows, check_every=3):
            _step(model, x)
    for _ in range(2):  # forwards 2 and 3: not sampled
        with replay_routing(model, rows, check_every=3):
            _step(model, x)
    with pytest.raises(UnsupportedModelError, match="differ from rr's formula"):
        with replay_routing(model, rows, check_every=3):  # forward 4: sampled again
            _step(model, x)


def test_a_sampled_check_keeps_non_reentrant_checkpointing_consistent() -> None:
    """The check runs on the forward only; it saves nothing for backward, so torch's non-reentrant checkpoint
    (verl's default) sees the same saved tensors when backward recomputes the layer unsampled."""
    model, x, rows, mask, _ = _setup("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with replay_routing(model, rows, mask, check_every=1, audit=True) as report:
        _step(model, x)
    assert report is not None and report["r3/applied_share"] == 1.0
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
