"""Every supported MoE family replays on a tiny random model; every refused one is refused with its reason;
docs/replay-coverage.md equals what the code generates and lists every MoE family of the installed transformers.

Runs at both ends of the declared transformers range: 5.24 (.venv) and 5.10 (.venvs/verl,
scripts/test_transformers_lowest.sh).
On 5.10 the families refused there (``REFUSED_IN_LOWEST``) must be refused naming the release, and the families
5.10 does not have are skipped with that reason."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from rr_client.trainer.replay import (
    UnsupportedModelError,
    coverage,
    find_routers,
    record_routing,
    replay_routing,
    survey,
)
from rr_client.trainer.replay._routers import transformers_version
from rr_client.trainer.replay.coverage import (
    ABSENT_IN_LOWEST,
    FAMILY_ROUTERS,
    FP32_GATE,
    HIGHEST,
    LOWEST,
    REFUSED,
    REFUSED_IN_LOWEST,
    TESTED,
    coverage_markdown,
    declared_range,
    installed_moe_families,
)
from rr_client.trainer.router_reference import router_forward, router_topk

from .helpers import ExpertsSpy, ModelCache, grads, spied_forward, token_ids
from .tiny_families import VOCAB, forward, tiny_family_model, tiny_family_raw

B, T = 2, 5
_MINOR = transformers_version().split(".")[:2]
AT_LOWEST = _MINOR == LOWEST.split(".")[:2]
# at 5.10: the families it has whose router replays there (the others are checked by the refusal test below)
# a family the installed transformers lacks is not collected at all (deselected, never skipped)
_HERE = [f for f in coverage() if not (AT_LOWEST and f.model_type in ABSENT_IN_LOWEST)]
SUPPORTED = sorted(
    f.model_type for f in _HERE if f.status == "supported" and not (AT_LOWEST and f.model_type in REFUSED_IN_LOWEST)
)
REFUSED_FAMILIES = sorted(f.model_type for f in _HERE if f.status == "refused")
_MODELS = ModelCache(tiny_family_model)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def model_for(mt: str) -> Any:
    return _MODELS.get(mt)


def ids() -> torch.Tensor:
    return token_ids(VOCAB, B, T)


def _own_ids(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The router's integer ids: ``(logits, weights, ids)``, or ``(logits, ids, weights)`` (ERNIE-4.5 on 5.10)."""
    return out[1] if out[2].is_floating_point() else out[2]


def dims(model: Any) -> tuple[int, int, int, list[int]]:
    routers = find_routers(model)
    n = int(model.config.get_text_config().num_hidden_layers)
    return n, routers[0].top_k, routers[0].num_experts, [r.layer for r in routers]


def own_choice(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k, _, moe = dims(model)
    out, spy = spied_forward(model, x, forward, _own_ids)
    assert sorted(spy.router) == moe
    return out, spy.routing(B, T, n, k)


def other_ids(model: Any, seed: int) -> torch.Tensor:
    n, k, e, moe = dims(model)
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(B * T, n, k, dtype=torch.long)
    for layer in moe:
        out[:, layer] = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(B * T)])
    return out.reshape(B, T, n, k)


def test_coverage_lists_every_installed_moe_family_and_the_doc_is_generated() -> None:
    # the tests run at the ends of the declared range only: the range is what passed
    assert transformers_version() in (LOWEST, HIGHEST), transformers_version()
    import tomllib

    torch_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    lo, hi = LOWEST.split("."), HIGHEST.split(".")
    assert declared_range() == f">={lo[0]}.{lo[1]},<{hi[0]}.{int(hi[1]) + 1}"
    assert f"transformers{declared_range()}" in torch_extra
    assert installed_moe_families() == sorted(set(FAMILY_ROUTERS) - (ABSENT_IN_LOWEST if AT_LOWEST else set()))
    assert set(REFUSED_IN_LOWEST) <= TESTED and not set(REFUSED_IN_LOWEST) & ABSENT_IN_LOWEST
    assert TESTED <= set(FAMILY_ROUTERS) and not TESTED & set(REFUSED)
    assert (ROOT / "docs" / "replay-coverage.md").read_text(encoding="utf-8") == coverage_markdown()
    named = {
        "qwen3_5_moe",
        "glm4_moe_lite",
        "minimax_m2",
        "deepseek_v32",
        "deepseek_v4",
        "ernie4_5_moe",
        "hunyuan_v1_moe",
        "llama4",
        "dbrx",
        "granitemoe",
    }
    status = {f.model_type: f for f in coverage()}
    for mt in named:  # supported, or refused with a reason
        assert status[mt].status == "supported" or len(status[mt].reason) > 40, mt


@pytest.mark.parametrize("mt", SUPPORTED)
def test_own_choice_replayed_reproduces_output_and_audit_is_100(mt: str) -> None:
    model = model_for(mt)
    x = ids()
    out, routing = own_choice(model, x)
    with torch.no_grad(), replay_routing(model, routing, audit=True) as rep:
        again = forward(model, x)
    assert torch.equal(again, out)
    assert rep["r3/applied_share"] == 1.0 and rep["r3/agreement"] == 1.0
    assert rep["r3/replayed_rows"] == B * T * len(dims(model)[3])


@pytest.mark.parametrize("mt", SUPPORTED)
def test_other_ids_run_exactly_those_experts(mt: str) -> None:
    model = model_for(mt)
    x = ids()
    out, _ = own_choice(model, x)
    forced = other_ids(model, 5)
    n, k, _, moe = dims(model)
    with ExpertsSpy(model, _own_ids) as spy, torch.no_grad(), replay_routing(model, forced, audit=True) as rep:
        changed = forward(model, x)
    assert not torch.equal(changed, out)
    assert rep["r3/applied_share"] == 1.0
    flat = forced.reshape(-1, n, k)
    for layer in moe:
        assert torch.equal(spy.experts[layer], flat[:, layer]), layer


@pytest.mark.parametrize("mt", SUPPORTED)
def test_router_grad_and_checkpointing(mt: str) -> None:
    model = model_for(mt)
    x = ids()
    routing = other_ids(model, 11)
    model.train()
    try:
        plain = grads(model, x, routing, forward)
        for r in find_routers(model):
            g = [plain.get(f"{r.name}.{n}") for n, p in r.module.named_parameters() if p.dim() == 2]
            assert any(t is not None and t.abs().sum() > 0 for t in g), r.name
        model.gradient_checkpointing_enable()
        ckpt = grads(model, x, routing, forward)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n


def test_deepseek_v4_hash_layers_are_left_to_the_model() -> None:
    model = model_for("deepseek_v4")
    routers, left = survey(model)
    hashed = [x.layer for x in left if x.why == "hash"]
    assert hashed and not set(hashed) & {r.layer for r in routers}
    x = ids()
    _, routing = own_choice(model, x)
    with torch.no_grad(), replay_routing(model, routing, audit=True) as rep:
        forward(model, x)
    assert rep["r3/left_layers_hash"] == len(hashed)
    assert all(f"r3/layer{h}/left_rows_hash" in rep for h in hashed)


@pytest.mark.parametrize("mt", sorted(REFUSED_IN_LOWEST))
def test_family_whose_router_changed_is_refused_at_5_10_naming_it_and_replays_at_5_24(mt: str) -> None:
    model = tiny_family_raw(mt) if AT_LOWEST else model_for(mt)  # 5.24: the supported tests' model, built once
    if AT_LOWEST:
        with pytest.raises(UnsupportedModelError) as e:
            survey(model)
        assert mt in str(e.value) and transformers_version() in str(e.value)
        with pytest.raises(UnsupportedModelError):  # replay refuses before any forward
            with replay_routing(model, torch.zeros(B, T, 3, 2, dtype=torch.long)):
                pass
    else:  # the facts read from the installed router
        routers, _ = survey(model)
        assert routers and {(r.num_experts, r.top_k) for r in routers} == {(8, 2)}


def test_a_router_returning_logits_only_is_refused_naming_the_release() -> None:
    model = model_for("qwen3_moe")
    forced = other_ids(model, 5)
    r = find_routers(model)[0]
    own = r.module.forward
    r.module.forward = lambda *a, **k: own(*a, **k)[0]  # logits only, as DeepSeek-V3's router on 5.10
    try:
        with pytest.raises(UnsupportedModelError, match=f"transformers {transformers_version()}.*not \\(logits"):
            with torch.no_grad(), replay_routing(model, forced):
                forward(model, ids())
    finally:
        del r.module.forward


@pytest.mark.parametrize("mt", [m for m in REFUSED_FAMILIES if FAMILY_ROUTERS[m]])
def test_refused_family_is_refused_with_its_reason(mt: str) -> None:
    from rr_client.trainer.replay import survey as _survey

    reason = next(f.reason for f in coverage() if f.model_type == mt)
    router_cls = FAMILY_ROUTERS[mt][0]
    fake = torch.nn.Module()
    fake.config = None
    fake.layers = torch.nn.ModuleList([torch.nn.Module()])
    fake.layers[0].mlp = torch.nn.Module()
    fake.layers[0].mlp.gate = type(router_cls, (torch.nn.Module,), {})()  # a module of the refused class' name
    with pytest.raises(UnsupportedModelError) as e:
        _survey(fake)
    assert mt in str(e.value) and reason in str(e.value)


# ---------------------------------------------------------------- float32 router gates in a bfloat16 model

_BF16 = ModelCache(lambda mt: tiny_family_model(mt, dtype=torch.bfloat16))
FP32_GATE_HERE = sorted(FP32_GATE & set(SUPPORTED))


def bf16_model_for(mt: str) -> Any:
    return _BF16.get(mt)


def router_weight_dtypes(model: Any) -> set[torch.dtype]:
    return {p.dtype for r in find_routers(model) for p in r.module.parameters() if p.dim() == 2}


@pytest.mark.transformers_since("5.24")  # FP32_GATE lists what transformers 5.24 keeps in float32
@pytest.mark.parametrize("mt", SUPPORTED)
def test_fp32_gate_lists_the_routers_the_installed_release_keeps_in_float32(mt: str) -> None:
    model = bf16_model_for(mt)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    want = torch.float32 if mt in FP32_GATE else torch.bfloat16
    assert router_weight_dtypes(model) == {want}, mt


@pytest.mark.parametrize("mt", FP32_GATE_HERE)
def test_fp32_gate_family_replays_bit_for_bit_in_a_bf16_model(mt: str) -> None:
    """bf16 hidden states into a float32 gate: record and the audit read the router's own choice, the replayed
    own choice reproduces the output bit for bit (so do the gates), the formula check passes at every forward, and
    other ids reach exactly those experts."""
    model = bf16_model_for(mt)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    if not AT_LOWEST:
        assert router_weight_dtypes(model) == {torch.float32}
    x = ids()
    out, routing = own_choice(model, x)
    with torch.no_grad(), record_routing(model) as rec:
        forward(model, x)
    moe = dims(model)[3]
    assert torch.equal(rec.routed_experts[:, :, moe], routing[:, :, moe])
    with torch.no_grad(), replay_routing(model, routing, audit=True, check_every=1) as rep:
        again = forward(model, x)
    assert torch.equal(again, out)
    assert rep["r3/applied_share"] == 1.0 and rep["r3/agreement"] == 1.0
    forced = other_ids(model, 5)
    n, k, _, _ = dims(model)
    with (
        ExpertsSpy(model, _own_ids) as spy,
        torch.no_grad(),
        replay_routing(model, forced, audit=True, check_every=1) as rep,
    ):
        changed = forward(model, x)
    assert not torch.equal(changed, out) and rep["r3/applied_share"] == 1.0
    flat = forced.reshape(-1, n, k)
    for layer in moe:
        assert torch.equal(spy.experts[layer], flat[:, layer]), layer


@pytest.mark.transformers_since("5.24")  # neither family replays in float32 at 5.10
@pytest.mark.parametrize("mt", [m for m in ("deepseek_v2", "flint") if m in FP32_GATE_HERE])
def test_reference_topk_is_the_choice_of_a_float32_gate_in_a_bf16_model(mt: str) -> None:
    """rr's reference top-k (router_reference: the top-k of the router logits) equals the router's own choice for
    a plain top-k router whose gate is float32 while the model is bfloat16."""
    model = bf16_model_for(mt)
    n, k, _, moe = dims(model)
    tokens = token_ids(VOCAB, 1, 12)[0].tolist()
    _, logits = router_forward(model, tokens, moe)
    ref = router_topk(logits, n, k)
    with torch.no_grad(), record_routing(model) as rec:
        forward(model, torch.tensor([tokens]))
    own = rec.routed_experts[0].numpy()
    for layer in moe:
        assert (np.sort(ref[:, layer], -1) == np.sort(own[:, layer], -1)).all(), layer


# ---------------------------------------------------------------- a looped family (transformers 5.24)


@pytest.mark.transformers_since("5.24")  # inkling2_loop is new in 5.24 (deselected before it)
def test_looped_family_is_refused_by_name_on_its_tiny_model() -> None:
    model = tiny_family_raw("inkling2_loop")
    cfg = model.config.get_text_config()
    calls: dict[str, int] = {}
    handles = [
        m.register_forward_hook(lambda _m, _a, _o, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
        for n, m in model.named_modules()
        if type(m).__name__ == "Inkling2LoopTopKRouter"
    ]
    try:
        with torch.no_grad():
            forward(model, ids())
    finally:
        for h in handles:
            h.remove()
    # why: a looped layer's one router routes every pass, while rr's rows hold one choice per decoder layer
    looped = range(cfg.loop_layer_index_start, cfg.loop_layer_index_end)
    assert cfg.loop_num_passes > 1 and len(calls) == cfg.num_hidden_layers
    for name, count in calls.items():
        layer = int(name.split("layers.")[1].split(".")[0])
        assert count == (cfg.loop_num_passes if layer in looped else 1), name
    for kw in ({}, {"allow_untested": True}):
        with pytest.raises(UnsupportedModelError, match="inkling2_loop.*loop_num_passes"):
            survey(model, **kw)
    with pytest.raises(UnsupportedModelError, match="inkling2_loop"):
        with replay_routing(model, torch.zeros(B, T, cfg.num_hidden_layers, 2, dtype=torch.long)):
            pass
    with pytest.raises(UnsupportedModelError, match="inkling2_loop"):
        with record_routing(model):
            pass
