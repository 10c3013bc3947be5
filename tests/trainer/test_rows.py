"""``ReplayRows`` (issue 43): one form for replay input, one check, one layer-axis rule, one meaning for a negative
id; and pad rows that spread over every expert in every layout (padded left / right / split, packed THD, verl's
rows), counted here per expert from the pads themselves. Megatron's feeder: tests/megatron/test_feeder_rows.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rr_client import ArgumentTypeError, ShapeMismatchError, UnrecordedRoutingError, to_packed, to_tensors
from rr_client.integrations.verl import packed_rows
from rr_client.trainer import ReplayRows
from rr_client.trainer.replay import replay_routing
from rr_client.trainer.rows import Reader, axis_layers
from tests.support.routing_data import make_routing

from .helpers import random_routing, token_ids
from .test_layouts import BATCH, MOE, E, K, L, info, sample
from .tiny_models import VOCAB, moe_layers, tiny_model

READERS = [Reader(layer, E, K, f"layer {layer}") for layer in MOE]


def spread(counts: torch.Tensor) -> int:
    """max - min of a per-expert count."""
    return int(counts.max() - counts.min())


def pad_counts(rows: torch.Tensor, have: torch.Tensor) -> list[torch.Tensor]:
    """Per layer-axis position: how many pad rows (``have`` False) name each expert."""
    pads = rows[~have.bool()].long()  # [n_pads, L, K]
    assert pads.shape[0] > E, "too few pads to tell a spread from arange(K)"
    return [torch.bincount(pads[:, p].flatten(), minlength=E) for p in range(pads.shape[1])]


# ---------------------------------------------------------------- one form, one layer-axis rule, integer ids


def test_every_source_gives_the_same_rows() -> None:
    """RoutingTensors, PackedRouting (both row conventions) and a raw tensor of the same samples: the same rows on
    the same tokens, the same layers, coverage (``need``) = real tokens but each sample's last."""
    rt = to_tensors(BATCH, info(), pad_side="right")
    a = ReplayRows.of(rt)
    real = rt.attention_mask.bool()
    assert a.layers == tuple(range(L)) and a.shape == tuple(rt.input_ids.shape)
    assert torch.equal(a.rows, rt.routed_experts) and torch.equal(a.have, rt.routed_experts_mask)
    for append_row in (True, False):
        p = ReplayRows.of(to_packed(BATCH, info(), append_row=append_row))
        assert torch.equal(p.rows[0][p.have[0]], a.rows[a.have]) and torch.equal(p.need[0], a.need[real])
    raw = ReplayRows.of(
        rt.routed_experts, layers=list(range(L)), mask=rt.routed_experts_mask, attention_mask=rt.attention_mask
    )
    assert torch.equal(raw.rows, a.rows) and torch.equal(raw.need, a.need)
    moe = ReplayRows.of(to_tensors(BATCH, info(), pad_side="right", moe_layers_only=True))
    assert moe.layers == tuple(MOE) and torch.equal(moe.rows, a.rows[:, :, MOE])
    assert ReplayRows.of(a) is a


def test_the_layer_axis_is_one_rule() -> None:
    """``layers=`` must name one layer per position (4 positions for 3 layers, or 2, are refused, never taken by
    position); without it the axis is every decoder layer, or the MoE layers, or an error asking for it."""
    with pytest.raises(ShapeMismatchError, match=r"names 3 layers \[0, 1, 2\] but routed_experts's layer axis has 4"):
        axis_layers(4, [0, 1, 2])
    with pytest.raises(ShapeMismatchError, match="names 3 layers .* has 2 positions"):
        ReplayRows.of(torch.zeros(2, 3, 2, K, dtype=torch.long), layers=[0, 1, 2])
    with pytest.raises(ShapeMismatchError, match="distinct"):
        axis_layers(2, [1, 1])
    assert axis_layers(L, num_hidden_layers=L, moe_layers=MOE) == list(range(L))
    assert axis_layers(3, num_hidden_layers=L, moe_layers=MOE) == MOE
    with pytest.raises(ShapeMismatchError, match="pass layers="):
        axis_layers(2, num_hidden_layers=L, moe_layers=MOE)
    rt = to_tensors(BATCH, info(), pad_side="left")
    with pytest.raises(ShapeMismatchError, match="names 3 layers"):  # a RoutingTensors whose layers lie
        ReplayRows.of(rt, layers=MOE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_ids_are_refused(dtype: torch.dtype) -> None:
    """Float ids would be truncated to other experts: refused from every source, before any check."""
    rows = torch.ones(2, 3, L, K).to(dtype)
    with pytest.raises(ArgumentTypeError, match=f"dtype {dtype}: expert ids must be an integer tensor"):
        ReplayRows.of(rows, layers=list(range(L)))
    rt = to_tensors(BATCH, info())
    with pytest.raises(ArgumentTypeError, match="integer"):
        ReplayRows.of(rt.__class__(**{**vars(rt), "routed_experts": rt.routed_experts.to(dtype)}))


def test_float_ids_are_refused_by_replay_routing() -> None:
    model = tiny_model("qwen3_moe")
    rows = random_routing(1, 2, 5).float() + 0.4  # truncation would give the same ids: it must still be refused
    with pytest.raises(ArgumentTypeError, match="float32"):
        with replay_routing(model, rows):
            pass


# ---------------------------------------------------------------- one meaning for a negative id; partly padded


def test_a_negative_id_means_no_row_and_a_partly_padded_row_is_refused() -> None:
    """A token whose ids are all negative has no row; a row mixing negative pad ids and expert ids is refused,
    naming the token and the layer."""
    g = torch.from_numpy(make_routing(6, L, K, E, moe_layers=MOE, seed=1)).reshape(2, 3, L, K)
    g[1, 2] = -1  # a pad token
    rows = ReplayRows.of(g, layers=list(range(L)))
    assert rows.have.tolist() == [[True] * 3, [True, True, False]]
    _, n_use, _ = rows.check(READERS)
    assert n_use == [5, 5, 5]
    g[0, 1, 2, 1] = -1  # one id of one row: partly padded
    with pytest.raises(
        UnrecordedRoutingError,
        match=r"layer 2: the row of sample 0, position 1 is partly padded "
        r"\(\[\d, -1\]",
    ):
        ReplayRows.of(g, layers=list(range(L))).check(READERS)


def test_replay_routing_refuses_a_partly_padded_row() -> None:
    """The Hugging Face hooks take the same check: before, the row was silently left to the model."""
    model = tiny_model("qwen3_moe")
    x = token_ids(VOCAB, 2, 5)
    rows = random_routing(2, 2, 5)
    rows[1, 1] = -1  # a whole pad token: fine
    with torch.no_grad(), replay_routing(model, rows):
        model(x)
    layer = moe_layers("qwen3_moe")[-1]
    rows[0, 3, layer, 0] = -1
    with pytest.raises(UnrecordedRoutingError, match=f"layer {layer}: the row of sample 0, position 3 is partly"):
        with replay_routing(model, rows):
            pass


def test_a_layer_served_dense_is_refused() -> None:
    """A layer the engine served dense (every row zero, or no row at all) but the model routes: refused, also at
    top-1 where zeros are valid ids (every token would go to expert 0)."""
    top1 = [Reader(layer, E, 1, f"layer {layer}") for layer in MOE]
    g = torch.from_numpy(make_routing(6, L, 1, E, moe_layers=MOE, seed=2)).reshape(2, 3, L, 1)
    g[..., 0, :] = torch.arange(6).reshape(2, 3, 1) % E  # layer 0 has non-zero rows
    ReplayRows.of(g, layers=list(range(L))).check(top1)
    zero = g.clone()
    zero[:, :, 2] = 0
    with pytest.raises(ShapeMismatchError, match="layer 2: all 6 rows are zero: the engine served this layer dense"):
        ReplayRows.of(zero, layers=list(range(L))).check(top1)
    absent = g.clone()
    absent[:, :, 3] = -1
    with pytest.raises(ShapeMismatchError, match="layer 3: no token has a row at layer 3 .* served this layer dense"):
        ReplayRows.of(absent, layers=list(range(L))).check(top1)
    wide = torch.from_numpy(make_routing(6, L, K, E, moe_layers=MOE, seed=2)).reshape(2, 3, L, K)
    wide[:, :, 2] = 0  # top-2: zero rows repeat an id, and the whole layer says why
    with pytest.raises(ShapeMismatchError, match="layer 2: all 6 rows are zero"):
        ReplayRows.of(wide, layers=list(range(L))).check(READERS)


# ---------------------------------------------------------------- pads spread over every expert


@pytest.mark.parametrize("pad_side", ["left", "right", "split"])
@pytest.mark.parametrize("moe_only", [False, True])
def test_padded_pads_spread_over_every_expert(pad_side: str, moe_only: bool) -> None:
    """``pad_experts="distinct"``: per layer, pad tokens per expert within one of even (``arange(K)`` gave experts
    0..K-1 every pad: one expert-parallel rank)."""
    kw: dict[str, Any] = dict(prompt_length=8, response_length=9) if pad_side == "split" else dict(pad_to=16)
    t = to_tensors(
        BATCH,
        info(),
        pad_side=pad_side,
        pad_experts="distinct",
        moe_layers_only=moe_only,  # type: ignore[arg-type]
        **kw,
    )
    for counts in pad_counts(t.routed_experts, t.routed_experts_mask):
        assert spread(counts) <= 1, counts.tolist()
    pads = t.routed_experts[~t.routed_experts_mask].long()
    assert (pads.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct ids in every pad row
    assert not torch.equal(pads[:, 0], pads[:, -1])  # rotated per layer


@pytest.mark.parametrize("append_row", [True, False])
def test_packed_pads_spread_over_every_expert(append_row: bool) -> None:
    p = to_packed(
        BATCH + [sample(4, 2, 2)], info(), pad_experts="distinct", append_row=append_row, pad_to_multiple_of=48
    )
    for counts in pad_counts(p.routed_experts, p.routed_experts_mask):
        assert spread(counts) <= 1, counts.tolist()


def test_verl_rows_pads_spread_over_every_expert() -> None:
    """verl's jagged rows: the unrecorded rows (each sample's last token, tool tokens) come back as spread pads."""
    lengths, recorded = [9, 6, 4, 7], [5, 2, 3, 1]
    parts = []
    for i, (n, r) in enumerate(zip(lengths, recorded)):
        rows = np.zeros((n, L, K), dtype=np.int16)
        rows[:r] = make_routing(r, L, K, E, moe_layers=MOE, seed=i)
        parts.append(torch.from_numpy(rows))
    offsets = torch.tensor(np.cumsum([0, *lengths]))
    nt = torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets)
    rows, mask = packed_rows(nt, offsets, info())
    for counts in pad_counts(rows, mask):
        assert spread(counts) <= 1, counts.tolist()


def test_constructors_check_and_pads_stay_on_the_gpu() -> None:
    """Fake CUDA rows (tests/support/fake_cuda.py) with CPU masks and offsets: construction, the check's device
    side and pad filling never meet a CPU tensor (the one host read is the check's, left out here)."""
    from rr_client.trainer.rows import fill_pads
    from tests.support.fake_cuda import CUDA, fake_mode, on_cuda

    g = torch.from_numpy(make_routing(12, L, K, E, moe_layers=MOE, seed=3)).to(torch.int16)
    mask = torch.ones(12, dtype=torch.bool)
    mask[5] = False
    offsets = torch.tensor([0, 5, 12])
    mode = fake_mode()
    with mode:
        for rows in (
            ReplayRows.of(g.to(CUDA), mask=mask, layers=list(range(L))),
            ReplayRows.of(
                g.reshape(2, 6, L, K).to(CUDA),
                mask=mask.reshape(2, 6),
                layers=list(range(L)),
                attention_mask=torch.ones(2, 6),
            ),
            ReplayRows.from_jagged(g.to(CUDA), offsets, num_hidden_layers=L, moe_layers=MOE),
        ):
            st = rows.stats(READERS, spare=[1], coverage=True)
            assert on_cuda(rows.rows, rows.have, st.sel, st.use, st.stats)
            assert on_cuda(fill_pads(rows.flat, rows.have.reshape(-1), rows.layers, E))
