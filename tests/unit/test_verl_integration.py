"""rr_client.integrations.verl's pure parts, without verl: rows -> replay mask + full check, the multi-turn row
rule, the R2 unpacking, the mode settings, the SGLang read, the version gate. verl's real code: tests/verl."""

from __future__ import annotations

import base64
import sys

import numpy as np
import pytest
import torch

from rr_client.core.errors import (ConfigurationError, ExpertIdOutOfRangeError, MissingRoutingError, ShapeMismatchError,
                              UnrecordedRoutingError, UnsupportedVersionError)
from rr_client.core.info import RRInfo
from rr_client.integrations.verl import accumulate_turn_rows, check_verl_version, packed_rows, unpack_recorded
from rr_client.integrations.verl._engine import replay_mode
from rr_client.integrations.verl._patches import (_Checked, _install_extract_shim, checked_meta_routing, fsdp_replay_on,
                                                  verl_reads, worker_replay_mode)
from tests.support.routing_data import make_routing

CFG = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
       "mlp_only_layers": [1], "decoder_sparse_step": 1}
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
    assert torch.equal(rows, nt.values().long())


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


def test_combine_reports_takes_the_worst_share() -> None:
    from rr_client.trainer.session import merge_reports as combine_reports

    a = {"r3/replayed_rows": 10.0, "r3/left_rows": 2.0, "r3/forwards": 1.0, "r3/applied_share": 1.0,
         "r3/agreement": 0.9, "r3/layer0/applied_share": 1.0}
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
