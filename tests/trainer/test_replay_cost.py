"""Replay's cost model, counted on the CPU (rr_client.trainer.replay.cost): aten ops and host syncs per MoE layer.

Budgets (issue 28): inside forward + backward, replay adds 0 host syncs and at most 8 ops per MoE layer when the
sampled formula check does not run, and the check adds at most one formula and 2 ops on the forwards it samples;
opening a block costs at most 2 host syncs whatever the layer count; the audit at most 16 ops per layer and one
host read at exit; record_routing 0 ops and 0 syncs in the forward. On a GPU each op is a kernel launch and each
sync a stall; the time ratios are in docs/benchmarks.md (benchmarks/replay_overhead.py).

On a CPU a ``.cpu()`` or a host-to-device copy is invisible (the tensors already live there), so the hooks also run
on fake CUDA tensors (tests/support/fake_cuda.py): replay's and the audit's router hooks and record_routing's copy
nothing between host and device and read nothing; opening a block places the rows with one non-blocking upload per
device; reading a record is one device-to-host copy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.core.errors import UnsupportedModelError
from rr_client.trainer.replay import SUPPORTED_ROUTERS, find_routers, record_routing, replay_routing, survey
from rr_client.trainer.replay._audit import Audit, DeviceTally
from rr_client.trainer.replay._replay import ReplayHook
from rr_client.trainer.replay._routers import Router, num_hidden_layers, router_hooks
from rr_client.trainer.replay._rows import place_rows, readers_of
from rr_client.trainer.replay.cost import count_ops
from rr_client.trainer.replay.formulas import softmax_gather
from rr_client.trainer.rows import ReplayRows
from tests.support.fake_cuda import CUDA, fake_mode, on_cuda, to_fake_cuda
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


def test_the_counter_sees_copies_and_allclose() -> None:
    """Negative controls on fake CUDA tensors: each transfer a hook could hide is counted."""
    mode = fake_mode()
    host = torch.ones(4)
    with mode:
        dev = torch.ones(4, device=CUDA)
        with count_ops() as c:
            dev.cpu()
            host.to(CUDA)
            host.to(CUDA, non_blocking=True)
            dev.to(torch.device("cuda", 1))
        with count_ops() as same:
            dev.to(CUDA)
            host.cpu()
    assert c.copies == 4 and c.syncs == 2, (c.copy_names, c.sync_names)  # the non-blocking upload does not sync
    assert same.copies == 0 and same.syncs == 0
    with count_ops() as c:
        torch.allclose(host, host)
    assert c.syncs == 1, c.sync_names


def _stub_routers(routers: list[Router], mode: Any) -> dict[int, tuple[torch.Tensor, ...]]:
    """Stand-in, named: each router's ``forward`` returns fixed fake CUDA outputs (transformers' router forwards
    need a CUDA device guard on fake tensors); calling the module still runs its real hooks."""
    outs = {}
    with mode:
        for r in routers:
            outs[r.layer] = (
                torch.randn(B * T, r.num_experts, device=CUDA),
                torch.rand(B * T, r.top_k, device=CUDA),
                torch.randint(0, r.num_experts, (B * T, r.top_k), device=CUDA),
            )
            r.module.forward = (lambda o: lambda *_a, **_k: o)(outs[r.layer])
    return outs


@pytest.mark.parametrize("arch", FAMILIES)
def test_hooks_on_a_fake_gpu_copy_nothing(arch: str) -> None:
    """A ``.cpu()``, ``.to(device)``, ``.item()`` or ``tolist()`` put into a hook fails here (on a CPU they are
    free, so the CPU budgets above cannot see them)."""
    mode = fake_mode()
    model = to_fake_cuda(_model(arch), mode)
    routers, left = survey(model)
    n_hidden = num_hidden_layers(model, routers)
    g = torch.Generator().manual_seed(1)
    rows = torch.stack([torch.randperm(8, generator=g)[: routers[0].top_k] for _ in range(B * T * n_hidden)])
    rows = rows.reshape(B * T, n_hidden, -1).to(torch.int16)
    mask = torch.ones(B * T, dtype=torch.bool)
    mask[-1] = False
    given = ReplayRows.of(rows, mask=mask, num_hidden_layers=n_hidden, moe_layers=[r.layer for r in routers])
    st, n_use, _ = given.check(readers_of(routers))  # real CPU rows: the block's one host read
    with mode, count_ops() as opening:
        placed = place_rows(st, n_use, [], routers, audit=True)
    assert opening.copies == 1 and opening.syncs == 0, (opening.copy_names, opening.sync_names)
    assert all(on_cuda(lr.ids, lr.use, lr.ids_sorted) for lr in placed.layers.values())
    outs = _stub_routers(routers, mode)
    h = torch.zeros(B * T, 4)
    tally = DeviceTally()
    aud = Audit(routers, left, placed, tally)
    hook = ReplayHook(placed, tally, aud, {}, 1)  # the formula check on every forward, the audit on
    with mode:
        h = torch.zeros(B * T, 4, device=CUDA)
        with router_hooks(routers, hook), count_ops() as inside:
            for r in routers:
                out = r.module(h)
                aud.on_experts(r, (h, out[2].clone(), out[1]), {})
        assert inside.copies == 0 and inside.syncs == 0, (inside.copy_names, inside.sync_names)
        with record_routing(model) as rec, count_ops() as recorded:
            for r in routers:
                r.module(h)
        assert recorded.ops == 0 and recorded.copies == 0 and recorded.syncs == 0, recorded.names
        with count_ops() as read:
            got = rec.routed_experts
    assert read.copies == 1 and read.syncs == 1, read.copy_names  # reading the record: one transfer
    assert got.device.type == "cpu" and tuple(got.shape) == (B * T, n_hidden, routers[0].top_k)
    assert set(outs) == {r.layer for r in routers}
