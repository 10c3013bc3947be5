"""rr_client.integrations.verl's pure parts, without verl: rows -> replay mask + full check, the multi-turn row
rule, the R2 unpacking, the mode settings, the SGLang read, the version gate. verl's real code: tests/verl."""

from __future__ import annotations

import base64
import importlib.metadata
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from rr_client.core.errors import (
    ConfigurationError,
    ExpertIdOutOfRangeError,
    MissingRoutingError,
    ShapeMismatchError,
    UnrecordedRoutingError,
    UnsupportedVersionError,
)
from rr_client.core.info import RRInfo
from rr_client.integrations.verl import accumulate_turn_rows, check_verl_version, packed_rows, unpack_recorded
from rr_client.integrations.verl._engine import replay_mode
from rr_client.integrations.verl._patches import (
    _Checked,
    _install_extract_shim,
    checked_meta_routing,
    fsdp_replay_on,
    verl_reads,
    worker_replay_mode,
)
from tests.support.routing_data import make_routing

CFG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
}
INFO = RRInfo.from_hf_config(CFG, engine="verl", engine_version="0.9.1")


def jagged(lengths: list[int], recorded: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's nested ``routed_experts``: per sample ``recorded[i]`` rows from its first token, zero after."""
    parts = []
    for i, (n, r) in enumerate(zip(lengths, recorded)):
        rows = np.zeros((n, 3, 2), dtype=np.int16)
        rows[:r] = make_routing(r, 3, 2, 8, moe_layers=[0, 2], seed=seed + i)
        parts.append(torch.from_numpy(rows))
    offsets = torch.tensor(np.cumsum([0, *lengths]))
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets), offsets


def test_packed_rows_masks_exactly_the_unrecorded_tail() -> None:
    nt, off = jagged([5, 3, 1], [4, 2, 0])
    rows, mask = packed_rows(nt, off, INFO)
    assert rows.shape == (9, 3, 2) and rows.dtype == torch.int64
    assert mask.tolist() == [True] * 4 + [False] + [True] * 2 + [False] + [False]
    assert torch.equal(rows[mask], nt.values().long()[mask])
    # rows without routing are pad rows spread over the experts (issue 43): pad i at layer l = (2i + col + 2l) % 8
    assert rows[~mask].tolist() == [
        [[(2 * i + c + 2 * layer) % 8 for c in range(2)] for layer in range(3)] for i in range(3)
    ]


def test_packed_rows_refusals() -> None:
    nt, off = jagged([5, 3], [4, 2])
    holed = nt.values().clone()
    holed[1] = 0
    with pytest.raises(UnrecordedRoutingError, match=r"micro-batch sample 0 \(5 tokens\): token 1"):
        packed_rows(holed, off, INFO)
    with pytest.raises(MissingRoutingError, match="micro-batch sample 1 carries no routing rows"):
        packed_rows(jagged([5, 3], [4, 0])[0], off, INFO)
    bad = nt.values().clone()
    bad[2, 0] = torch.tensor([3, 8])
    with pytest.raises(ExpertIdOutOfRangeError, match=r"\[0, 8\)"):
        packed_rows(bad, off, INFO)
    dense = nt.values().clone()
    dense[0, 1] = torch.tensor([1, 2])
    with pytest.raises(ShapeMismatchError, match="dense layer"):
        packed_rows(dense, off, INFO)
    with pytest.raises(ShapeMismatchError, match="has 8 rows but input_ids has 9 tokens"):
        packed_rows(nt.values(), torch.tensor([0, 5, 9]), INFO)
    with pytest.raises(ShapeMismatchError, match="top-1"):
        packed_rows(nt.values()[..., :1], off, INFO.model_copy(update={"topk": 1}))


def test_packed_rows_accepts_moe_ordinal_layer_axis() -> None:
    nt, off = jagged([4], [3])
    moe_only = nt.values()[:, [0, 2]]
    rows, mask = packed_rows(moe_only, off, INFO)
    assert rows.shape == (4, 2, 2) and mask.tolist() == [True, True, True, False]


def test_accumulate_turn_rows_keeps_held_rows() -> None:
    held = make_routing(6, 3, 2, 8, seed=1)
    new = make_routing(10, 3, 2, 8, seed=2)
    got = accumulate_turn_rows(held, new)
    assert np.array_equal(got, np.concatenate([held, new[6:]]))
    t = accumulate_turn_rows(torch.from_numpy(held), torch.from_numpy(new))
    assert torch.equal(t, torch.from_numpy(np.concatenate([held, new[6:]])))
    assert accumulate_turn_rows(None, new) is new
    with pytest.raises(ShapeMismatchError, match="fewer than the 6 already held"):
        accumulate_turn_rows(held, new[:5])
    with pytest.raises(MissingRoutingError):
        accumulate_turn_rows(held, None)
    with pytest.raises(ShapeMismatchError, match="differs from the held"):
        accumulate_turn_rows(held, new[:, :2])


def test_unpack_recorded_strips_pad_and_rewraps() -> None:
    rows = torch.arange(7 * 3 * 2).reshape(7, 3, 2)
    nt = unpack_recorded(rows, torch.tensor([0, 2, 5]), pad=2)
    assert nt.is_nested and nt.dtype == torch.int16
    assert [t.shape[0] for t in nt.unbind()] == [2, 3]
    with pytest.raises(ShapeMismatchError, match="recorded 7 rows for 5 tokens"):
        unpack_recorded(rows, torch.tensor([0, 2, 5]))


def test_modes_and_worker_setting() -> None:
    class Cfg:
        router_replay = {"mode": "R2"}

    assert replay_mode(Cfg()) == "R2" and replay_mode(object()) == "disabled"
    with pytest.raises(ValueError, match="router_replay.mode='R4'"):
        replay_mode(type("C", (), {"router_replay": {"mode": "R4"}})())
    # verl's worker config is an omegaconf DictConfig (tests/verl builds the real one); mappings read the same
    c = {"actor": {"strategy": "fsdp2", "fsdp_config": {"router_replay": {"mode": "R3"}}}}
    assert worker_replay_mode(c) == "R3"
    assert fsdp_replay_on(c)
    c["actor"]["strategy"] = "megatron"  # verl's own engines handle megatron and veomni
    assert worker_replay_mode(c) == "disabled" and not fsdp_replay_on(c)
    assert worker_replay_mode({"actor": {"strategy": "fsdp", "fsdp_config": {}}}) == "disabled"
    c["actor"]["strategy"] = "fsdp"  # FSDP1 never ran with rr: refused, naming the setting that works
    with pytest.raises(ConfigurationError, match="actor_rollout_ref.actor.strategy=fsdp2"):
        worker_replay_mode(c)
    assert not fsdp_replay_on(c)
    c["actor"]["fsdp_config"]["router_replay"]["mode"] = "disabled"
    assert worker_replay_mode(c) == "disabled"


@pytest.mark.parametrize(
    "own", [{"megatron": {"router_replay": {"mode": "R3"}}}, {"router_replay": {"mode": "R2"}}], ids=["megatron", "0.7"]
)
def test_verls_own_switch_on_fsdp2_is_refused_naming_rrs(own: dict[str, Any]) -> None:
    """verl's own replay switches (its Megatron engine's, verl 0.7's actor-level one) on fsdp2: verl's FSDP worker
    reads neither and would train unreplayed; refused, naming rr's key with the mode asked."""
    c = {"actor": {"strategy": "fsdp2", "fsdp_config": {}, **own}}
    key, mode = ("megatron.router_replay", "R3") if "megatron" in own else ("router_replay", "R2")
    with pytest.raises(
        ConfigurationError,
        match=rf"actor_rollout_ref\.actor\.{key}\.mode={mode}.*fsdp_config\.router_replay\.mode={mode}",
    ):
        worker_replay_mode(c)
    c["actor"]["fsdp_config"] = {"router_replay": {"mode": mode}}  # rr's key set: rr's replay, no refusal
    assert worker_replay_mode(c) == mode
    c["actor"]["strategy"] = "megatron"  # on verl's Megatron engine, verl's own switch is verl's
    assert worker_replay_mode(c) == "disabled"


def test_combine_reports_takes_the_worst_share() -> None:
    from rr_client.trainer.session import merge_reports as combine_reports

    a = {
        "r3/replayed_rows": 10.0,
        "r3/left_rows": 2.0,
        "r3/forwards": 1.0,
        "r3/applied_share": 1.0,
        "r3/agreement": 0.9,
        "r3/layer0/applied_share": 1.0,
    }
    b = {**a, "r3/replayed_rows": 30.0, "r3/applied_share": 0.5, "r3/agreement": 0.5, "r3/layer0/applied_share": 0.5}
    m = combine_reports([a, b])
    assert m["r3/replayed_rows"] == 40 and m["r3/applied_share"] == 0.5 and m["r3/applied_share_min_layer"] == 0.5
    assert m["r3/agreement"] == pytest.approx((9 + 15) / 40)
    assert combine_reports([]) == {}


class _Cfg:
    def to_dict(self) -> dict:
        return CFG


def test_sglang_base64_payload_is_decoded_and_checked() -> None:
    rows = make_routing(9, 3, 2, 8, moe_layers=[0, 2], seed=4)  # SGLang sends int32, headerless base64
    out = {"output_ids": [1, 2, 3], "meta_info": {"routed_experts": base64.b64encode(rows.tobytes()).decode()}}
    checked_meta_routing(out, 7, _Cfg())
    got = out["meta_info"]["routed_experts"]
    assert isinstance(got, _Checked) and np.array_equal(got.numpy(), rows)
    short = {"output_ids": [1, 2, 3, 4], "meta_info": {"routed_experts": base64.b64encode(rows.tobytes()).decode()}}
    with pytest.raises(ShapeMismatchError, match="9 rows, expected 10"):
        checked_meta_routing(short, 7, _Cfg())
    with pytest.raises(MissingRoutingError, match="\\{\\}|no routing|routed_experts"):  # SGLang 0.5.7-0.5.9's {}
        checked_meta_routing({"output_ids": [1], "meta_info": {"routed_experts": {}}}, 7, _Cfg())


def test_rr_takes_over_only_what_verls_own_read_crashes_on() -> None:
    """verl's skip_tokenizer_init branch calls ``.numpy()``: a tensor (SGLang < 0.5.11) or no routing stays verl's;
    a base64 string (>= 0.5.11) or SGLang 0.5.7-0.5.9's ``{}`` is rr's. Its tokenizer branch imports SGLang's
    module, absent here (as in SGLang >= 0.5.12)."""
    out = lambda r: {"meta_info": {"routed_experts": r}}  # noqa: E731
    assert verl_reads(out(torch.zeros(3, 3, 2)), True) and verl_reads({"meta_info": {}}, True)
    assert not verl_reads(out("AAAA"), True) and not verl_reads(out({}), True)
    assert not verl_reads(out(torch.zeros(3, 3, 2)), False)


def test_extract_shim_stands_in_for_the_moved_sglang_module() -> None:
    name = "sglang.srt.layers.moe.routed_experts_capturer"
    saved = sys.modules.pop(name, None)
    try:
        _install_extract_shim()  # no SGLang here: the module path verl imports is provided
        from sglang.srt.layers.moe.routed_experts_capturer import extract_routed_experts_from_meta_info as f

        t = torch.arange(6).reshape(3, 1, 2)
        assert np.array_equal(f({"meta_info": {"routed_experts": _Checked(t)}}), t.numpy())
        with pytest.raises(ImportError, match="rr did not check"):
            f({"meta_info": {"routed_experts": "AAAA"}})
    finally:
        sys.modules.pop(name, None)
        if saved is not None:
            sys.modules[name] = saved


def test_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    check_verl_version("0.9.1")
    monkeypatch.delenv("RR_ALLOW_UNSUPPORTED_VERSION", raising=False)
    with pytest.raises(UnsupportedVersionError, match="tested with verl 0.9.1; found verl 0.8.0") as e:
        check_verl_version("0.8.0")
    assert e.value.version == "0.8.0" and "RR_ALLOW_UNSUPPORTED_VERSION=1" in str(e.value)
    assert check_verl_version("0.9.1.post1") == "0.9.1.post1"
    monkeypatch.setenv("RR_ALLOW_UNSUPPORTED_VERSION", "1")
    assert check_verl_version("0.8.0") == "0.8.0"


class _FSDPEngine:
    """verl's ``FSDPEngineWithLMHead`` as far as rr's engine relies on its shape."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        self.built = (model_config, optimizer_config, checkpoint_config)

    def initialize(self) -> None:
        return None

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        return ("verl", data, forward_only)

    def prepare_model_inputs(self, micro_batch: Any) -> Any:
        return {}, {}

    def prepare_model_outputs(self, output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any) -> Any:
        return {}


class _Registry:
    """verl's ``EngineRegistry`` as far as rr relies on its shape."""

    @staticmethod
    def register(model_type: str, backend: str, device: str = "cuda", vendor: str | None = None) -> Any:
        return lambda cls: cls

    @staticmethod
    def get_engine_cls(model_type: str, backend: str) -> type:
        return _FSDPEngine


def _no_metadata(dist: str) -> str:
    """``importlib.metadata.version`` where no distribution is installed."""
    raise importlib.metadata.PackageNotFoundError(dist)


@pytest.fixture
def fake_verl(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``verl.workers.engine.base`` with a registry of verl's shape, and a fresh table of rr's engines."""
    from rr_client.integrations.verl import _patches

    for name in ("verl", "verl.workers", "verl.workers.engine", "verl.utils", "verl.workers.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    helpers = {
        "verl.utils.tensordict_utils": ("get_non_tensor_data", lambda data, key, default: default),
        "verl.workers.utils.padding": ("no_padding_2_padding", lambda tensor, data: tensor),
    }
    for name, (fn_name, fn) in helpers.items():
        module = types.ModuleType(name)
        setattr(module, fn_name, fn)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["verl"].__version__ = "0.9.2"  # type: ignore[attr-defined]  # what a verl without metadata names
    monkeypatch.setattr(importlib.metadata, "version", _no_metadata)  # no verl distribution: its __version__
    base = types.ModuleType("verl.workers.engine.base")
    base.EngineRegistry = _Registry  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setattr(_patches, "_ENGINES", {})
    return _patches


def test_rr_engine_is_its_module_level_mixin_over_verls_class(fake_verl: Any) -> None:
    """The engine patch checks verl's shapes, then combines rr's mixin with verl's class (built once); with the
    mode disabled every call is verl's."""
    from rr_client.integrations.verl._engine import RRFSDPEngineMixin

    mod = types.SimpleNamespace(FSDPEngineWithLMHead=_FSDPEngine)
    fake_verl.patch_fsdp_engine(mod)
    ours = fake_verl._ENGINES["language_model"]
    assert ours.__name__ == ours.__qualname__ == "RRFSDPEngineWithLMHead"
    assert ours.__bases__ == (RRFSDPEngineMixin, _FSDPEngine) and ours.__module__ == RRFSDPEngineMixin.__module__
    fake_verl.patch_fsdp_engine(mod)
    assert fake_verl._ENGINES["language_model"] is ours  # re-entrant: not built twice
    engine = ours("model", type("Cfg", (), {"router_replay": {"mode": "disabled"}})(), "optim", "ckpt")
    assert engine.rr_mode == "disabled" and engine.built == ("model", "optim", "ckpt")
    assert engine.forward_backward_batch("batch", None, forward_only=True) == ("verl", "batch", True)


@pytest.mark.parametrize(
    "owner,method,reshaped,found",
    [
        (
            _FSDPEngine,
            "initialize",
            lambda self, device: None,
            "_FSDPEngine.initialize(self, device) does not have the shape rr relies on (self)",
        ),
        (
            _Registry,
            "get_engine_cls",
            staticmethod(lambda model_type: None),
            "_Registry.get_engine_cls(model_type) does not have the shape rr relies on (model_type, backend)",
        ),
        (
            "verl.workers.utils.padding",
            "no_padding_2_padding",
            lambda tensor, data, pad: tensor,
            "verl.workers.utils.padding.no_padding_2_padding(tensor, data, pad) does not have the shape rr relies on "
            "(tensor, data)",
        ),
    ],
)
def test_a_reshaped_verl_engine_is_refused(
    fake_verl: Any, monkeypatch: pytest.MonkeyPatch, owner: Any, method: str, reshaped: Any, found: str
) -> None:
    """verl changed a method rr's engine overrides, the registry call it makes or a helper it calls:
    UnsupportedVersionError naming it and the verl release, and no engine is built."""
    monkeypatch.setattr(sys.modules[owner] if isinstance(owner, str) else owner, method, reshaped)
    with pytest.raises(UnsupportedVersionError) as exc:
        fake_verl.patch_fsdp_engine(types.SimpleNamespace(FSDPEngineWithLMHead=_FSDPEngine))
    assert found in str(exc.value), exc.value
    assert str(exc.value).endswith(" in verl 0.9.2 (rr was tested with verl 0.9.1): refusing to patch or subclass it")
    assert "language_model" not in fake_verl._ENGINES
