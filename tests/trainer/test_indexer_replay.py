"""Sparse-attention indexer replay (rr_client.trainer.replay.replay_indexer) in transformers' own DSA models
(``deepseek_v32``, ``glm_moe_dsa``, tiny and random): inside the block every replayed token's attention reads exactly
the engine's positions, measured by an instrument independent of rr (the eager attention's own weights: non-zero at
the positions read); without replay the same instrument shows other positions (the control). Malformed rows are
typed errors when the block opens; the audit reports applied share and agreement per layer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rr_client import (
    ConfigurationError,
    IndexerPositionError,
    MissingRoutingError,
    ReplayError,
    RoutingRef,
    RRInfo,
    ShapeMismatchError,
    UnrecordedRoutingError,
)
from rr_client.trainer import keys as K
from rr_client.trainer import replay_indexer
from rr_client.trainer.layouts import to_packed, to_tensors
from rr_client.trainer.provenance import mask_samples
from rr_client.trainer.replay import find_indexers
from rr_client.trainer.session import ReplaySession

from .helpers import engine_result, recorded
from .tiny_families import tiny_family_raw

pytestmark = pytest.mark.transformers_since("5.23")

TOPK, B, S = 4, 2, 12
FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def dsa_model(family: str) -> torch.nn.Module:
    model = tiny_family_raw(family, index_topk=TOPK, index_n_heads=2, index_head_dim=16)
    return model.eval()


def engine_picks(layers: int, seed: int = 3) -> torch.Tensor:
    """What an engine's indexer picked: distinct causal positions for tokens that choose (t >= index_topk), -1 before."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, S, layers, TOPK), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(TOPK, S):
            for layer in range(layers):
                out[b, t, layer] = torch.randperm(t + 1, generator=g)[:TOPK].to(torch.int32)
    return out


def read_positions(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The instrument: per layer, ``[B, S, S]`` True where the eager attention put weight (summed over heads)."""
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    return [a.sum(1) > 0 for a in out.attentions]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_replayed_token_reads_exactly_the_engines_positions(family: str) -> None:
    model = dsa_model(family)
    layers = [layer for layer, _ in find_indexers(model)]
    ids = torch.randint(1, 60, (B, S), generator=torch.Generator().manual_seed(1))
    picks = engine_picks(len(layers))
    want = torch.zeros(B, S, len(layers), S, dtype=torch.bool)
    for b in range(B):
        for t in range(TOPK, S):
            for li in range(len(layers)):
                want[b, t, li, picks[b, t, li].long()] = True
    own = read_positions(model, ids)
    with replay_indexer(model, picks, audit=True) as report:
        read = read_positions(model, ids)
    for li, layer in enumerate(layers):
        assert torch.equal(read[layer][:, TOPK:], want[:, TOPK:, li]), f"layer {layer}"
    assert any(not torch.equal(own[layer][:, TOPK:], want[:, TOPK:, li]) for li, layer in enumerate(layers))
    assert report is not None
    assert report["r3/indexer/applied_share"] == 1.0 and report["r3/indexer/layers"] == len(layers)
    assert report["r3/indexer/replayed_rows"] == B * (S - TOPK) * len(layers)
    assert report["r3/indexer/agreement"] < 1.0
    assert torch.equal(read_positions(model, ids)[layers[0]], own[layers[0]])  # hooks gone after the block


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda p: p.__setitem__((0, 5, 0, 1), 9), IndexerPositionError, r"token 5, layer 0\) picks a future position"),
        (lambda p: p.__setitem__((1, 7, 1, 2), p[1, 7, 1, 0]), IndexerPositionError, "picks a position twice"),
        (lambda p: p.__setitem__((0, 6, 2, 3), -1), UnrecordedRoutingError, "partly -1"),
        (lambda p: p[0, 6, 2].fill_(-32768), IndexerPositionError, r"token 6, layer 2\) holds a negative position other"),
    ],
    ids=["future", "repeat", "partial", "wrapped-negative"],
)  # fmt: skip
def test_malformed_rows_are_refused_when_the_block_opens(edit: object, error: type, match: str) -> None:
    model = dsa_model("deepseek_v32")
    picks = engine_picks(3)
    edit(picks)  # type: ignore[operator]
    with pytest.raises(error, match=match):
        with replay_indexer(model, picks):
            pytest.fail("the block must not open")


def test_wrong_width_or_layer_count_is_a_shape_error() -> None:
    model = dsa_model("deepseek_v32")
    picks = engine_picks(3)
    with pytest.raises(ShapeMismatchError, match=r"3 indexer layers \[0, 1, 2\], index_topk 4"):
        with replay_indexer(model, picks[..., :3]):
            pass
    with pytest.raises(ShapeMismatchError, match="3 indexer layers"):
        with replay_indexer(model, picks[:, :, :2]):
            pass
    with pytest.raises(ShapeMismatchError, match="lay the rows out as the model's input_ids"):
        with replay_indexer(model, picks):
            model(torch.randint(1, 60, (B, S - 1)))


def test_an_indexer_rr_cannot_replay_is_refused_by_name() -> None:
    """DeepSeek-V4's indexer picks compressed KV entries, GLM-5-next's pooled keys, not token positions: refused,
    naming the module and why; a model without an indexer is refused too."""
    from rr_client import UnsupportedModelError

    v4 = tiny_family_raw(
        "deepseek_v4",
        layer_types=["sliding_attention", "compressed_sparse_attention", "sliding_attention"],
        index_topk=TOPK,
        index_n_heads=2,
        index_head_dim=16,
    )
    with pytest.raises(UnsupportedModelError, match=r"layers.1.self_attn.compressor.indexer \(DeepseekV4Indexer\)"):
        with replay_indexer(v4, engine_picks(1)):
            pass
    with pytest.raises(UnsupportedModelError, match="has no sparse-attention indexer"):
        with replay_indexer(tiny_family_raw("qwen3_moe"), engine_picks(1)):
            pass
    # GLM-5-next picks pools of index_kpool keys and expands them (plus the open tail pool): not token positions
    glm5 = tiny_family_raw("glm5_next", index_topk=TOPK, index_n_heads=2, index_head_dim=16)
    with pytest.raises(UnsupportedModelError, match=r"layers.0.self_attn.indexer \(Glm5NextTextIndexer\).*pools keys"):
        with replay_indexer(glm5, engine_picks(3)):
            pass


# ---------------------------------------------------------------------------------- beside the routing, in a session
SHAPES = [(9, 6), (5, 4), (3, 9)]  # (prompt, output) per sample: padded batches of different real lengths


def dsa_batch(model: torch.nn.Module) -> tuple[list[Any], RRInfo]:
    """Samples as the client hands them over: the model's own routing (what an engine on these weights routes) and
    engine indexer picks that differ from the model's (sequence positions, from token index_topk on)."""
    info = RRInfo.from_hf_config(model.config.to_dict(), engine="test", engine_version="0")
    assert info.indexer is not None
    g = torch.Generator().manual_seed(5)
    out = []
    for i, (lp, lo) in enumerate(SHAPES):
        seq = torch.randint(1, 60, (lp + lo,), generator=g).tolist()
        rows = recorded(model, torch.tensor([seq]))[0].numpy()
        n = lp + lo - 1  # rows: every token but the last
        picks = np.stack(
            [
                np.stack([torch.randperm(t + 1, generator=g)[:TOPK].numpy() for _ in info.indexer.layers])
                for t in range(TOPK, n)
            ]
        ).astype(np.uint16)
        out.append(engine_result(i, seq[:lp], seq[lp:], rows[:n], indexer_topk=picks, indexer_topk_start=TOPK))
    return out, info


def test_to_tensors_moves_each_samples_picks_under_its_padded_columns() -> None:
    """Per-sample Python reference: token t of sample b sits at column pos[t]; its picks p become pos[p]."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    for kw in (
        {"pad_side": "left"},
        {"pad_side": "right"},
        {"pad_side": "split", "prompt_length": 10, "response_length": 9},
    ):
        rt = to_tensors(batch, info, **kw)
        assert rt.indexer_topk is not None and rt.indexer_topk.dtype == torch.int16
        want = torch.full_like(rt.indexer_topk, -1)
        for b, r in enumerate(batch):
            pos = torch.nonzero(rt.attention_mask[b]).flatten().tolist()
            for j, row in enumerate(r.indexer_topk):
                want[b, pos[TOPK + j]] = torch.tensor([[pos[p] for p in layer] for layer in row.tolist()])
        assert torch.equal(rt.indexer_topk, want), kw


def test_layouts_refuse_what_they_cannot_carry() -> None:
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    with pytest.raises(MissingRoutingError, match=r"samples \[1\] carry no indexer picks while others do"):
        to_tensors([batch[0], replace(batch[1], indexer_topk=None)], info)
    ref = RoutingRef(
        store="memory", url="http://e", key="k", rows=1, layers=3, topk=TOPK, dtype="uint16", start=TOPK,
        weight_version=0, checksum="0" * 16, kind="indexer",
    )  # fmt: skip
    with pytest.raises(MissingRoutingError, match=r"samples \[0\] hold indexer refs not read yet"):
        to_tensors([replace(batch[0], indexer_topk=None, indexer_ref=ref)], info)
    with pytest.raises(ShapeMismatchError, match="do not fit its 15 tokens"):
        to_tensors([replace(batch[0], indexer_topk_start=TOPK + 1)], info)
    with pytest.raises(
        ShapeMismatchError, match=r"indexer rows \[10, 3, 3\], expected \[rows, 3 indexer layers, index_topk 4\]"
    ):
        to_tensors([replace(batch[0], indexer_topk=batch[0].indexer_topk[..., :3])], info)
    raw = batch[0].indexer_topk.astype(np.int32)
    raw[2, 1, 0] = -1  # SGLang's padding, not rr's form: would land on the last column
    with pytest.raises(IndexerPositionError, match="sample 0: an indexer row holds a negative position"):
        to_tensors([replace(batch[0], indexer_topk=raw)], info)
    with pytest.raises(ConfigurationError, match="padded batch"):
        to_packed(batch, info)
    assert to_packed([replace(r, indexer_topk=None) for r in batch], info).routed_experts.shape[0] > 0


def read_columns(model: torch.nn.Module, rt: Any) -> list[torch.Tensor]:
    """The instrument, as above, on a padded batch with its attention mask."""
    with torch.no_grad():
        out = model(rt.input_ids, attention_mask=rt.attention_mask, output_attentions=True)
    return [a.sum(1) > 0 for a in out.attentions]


def test_a_session_replays_routing_and_indexer_together_and_logs_both() -> None:
    """``open_replay(rt)`` replays ``rt.indexer_topk`` with the routing: every replayed token reads exactly the
    engine's columns (the eager attention's own weights), both audits in the step's metrics under their own keys;
    the session's stale-rows mask leaves a masked sample's picks to the model as well as its routing."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    rt = to_tensors(batch, info, pad_side="left")
    assert rt.indexer_topk is not None
    session = ReplaySession(model, audit_every=1, log_layers=True)
    own = read_columns(model, rt)
    with session.step() as met:
        session.open_replay(rt)
        read = read_columns(model, rt)
    idx = rt.indexer_topk.long()
    layers = [layer for layer, _ in find_indexers(model)]
    chosen = (idx >= 0).all(-1)
    n_rows = int(chosen.sum())
    assert n_rows == sum(lp + lo - 1 - TOPK for lp, lo in SHAPES) * len(layers)
    for li, layer in enumerate(layers):
        b, t = torch.nonzero(chosen[:, :, li], as_tuple=True)
        want = torch.zeros(len(b), rt.input_ids.shape[1], dtype=torch.bool).scatter(1, idx[b, t, li], True)
        assert torch.equal(read[layer][b, t], want), f"layer {layer}"
        assert not torch.equal(own[layer][b, t], want)  # the control: the model's own pick differs
    assert met[K.INDEXER_APPLIED_SHARE] == 1.0 and met[K.INDEXER_REPLAYED_ROWS] == n_rows
    assert met[K.INDEXER_LAYERS] == len(layers) and met[K.INDEXER_AGREEMENT] < 1.0
    assert met[K.indexer_layer(layers[0], "applied_share")] == 1.0
    # the routing replayed beside it (other attention reads move the trainer's own router off the recorded pick)
    assert met[K.APPLIED_SHARE] == 1.0 and met[K.REPLAYED_ROWS] > 0 and met[K.AGREEMENT] < 1.0

    assert K.INDEXER_LEFT_LAYERS not in met  # nothing left to the model's own pick

    masked = mask_samples(rt, [True, False, True])
    assert masked.indexer_topk is not None and bool((masked.indexer_topk[1] == -1).all())
    with session.step() as met:
        with session.forward(masked):
            read_columns(model, masked)
    sample1 = (SHAPES[1][0] + SHAPES[1][1] - 1 - TOPK) * len(layers)
    assert met[K.INDEXER_REPLAYED_ROWS] == n_rows - sample1


def test_routing_replayed_without_the_picks_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A DSA model whose routing is replayed without the indexer's picks: every such step reports the indexers left
    to their own pick (``r3/indexer/left_layers``), and the log says once how to replay them."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    rt = replace(to_tensors(batch, info), indexer_topk=None, indexer_layers=None)
    session = ReplaySession(model)
    with caplog.at_level("WARNING", logger="rr_client.trainer"):
        for _ in range(2):
            with session.step() as met:
                session.open_replay(rt)
                read_columns(model, rt)
            assert met[K.INDEXER_LEFT_LAYERS] == 3
    ours = [r.getMessage() for r in caplog.records if r.name == "rr_client.trainer"]
    assert len(ours) == 1 and "3 sparse-attention indexers" in ours[0] and "RRRollout(indexer=True)" in ours[0]
    dense = ReplaySession(tiny_family_raw("qwen3_moe"))  # no indexer: nothing to say
    assert dense._indexers == 0


def test_picks_of_other_layers_than_the_models_indexers_are_refused() -> None:
    """The batch carries the server's indexer layers; a model whose indexers sit elsewhere (another checkpoint's
    layout, the same count) is refused when the block opens, never replayed into the wrong layers."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    rt = to_tensors(batch, info)
    assert rt.indexer_layers == [0, 1, 2]
    session = ReplaySession(model)
    with pytest.raises(ShapeMismatchError, match=r"indexer rows are of layers \[0, 2, 3\], the model's .* \[0, 1, 2\]"):
        session.open_replay(replace(rt, indexer_layers=[0, 2, 3]))
    with pytest.raises(ShapeMismatchError, match="rows from another checkpoint's layout"):
        with session.forward(
            rt.routed_experts, rt.routed_experts_mask, indexer_topk=rt.indexer_topk, indexer_layers=[1, 2, 3]
        ):
            pass


def test_megatron_refuses_indexer_rows_by_name() -> None:
    """A backend that cannot replay the indexer (Megatron's RouterReplay) refuses the picks instead of dropping
    them. The backend here is a named stand-in: the refusal comes before any backend call."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    rt = to_tensors(batch, info)

    class NoBackendCalls:  # stand-in for MegatronReplay: any call is a test failure
        every_token = True

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"backend.{name} called")

    session = ReplaySession(model, backend=NoBackendCalls())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not through Megatron's RouterReplay"):
        session.open_replay(rt)


@pytest.mark.parametrize("fault", ["positions_for_columns", "pick_on_padding", "row_at_padding"])
def test_picks_are_checked_against_the_batchs_real_tokens(fault: str) -> None:
    """On a left-padded batch, picks are batch columns: engine positions handed over unshifted, a pick of a padding
    column, or a replayed row at a padding column are IndexerPositionErrors naming the sample, not attention over
    padding (the causal and range checks pass all three)."""
    model = dsa_model("deepseek_v32")
    batch, info = dsa_batch(model)
    rt = to_tensors(batch, info, pad_side="left")
    assert rt.indexer_topk is not None
    idx = rt.indexer_topk.clone()
    pads = (rt.attention_mask == 0).sum(1)
    b = int(pads.argmax())  # the most left-padded sample
    pad = int(pads[b])
    assert pad > TOPK
    if fault == "positions_for_columns":  # the engine's positions, not moved under the sample's columns
        idx[b] = torch.where(idx[b] >= 0, idx[b] - pad, idx[b])
        match = rf"sample {b}, column \d+, layer \d+\) picks padding columns"
    elif fault == "pick_on_padding":
        t = int(((idx[b, :, 0] >= 0).all(-1)).nonzero()[0, 0])
        idx[b, t, 0, 0] = 0 if int(idx[b, t, 0, 1:].min()) > 0 else pad - 1
        match = rf"sample {b}, column {t}, layer \d+\) picks padding columns"
    else:
        idx[b, pad - 1, 0] = torch.arange(TOPK, dtype=idx.dtype)
        match = rf"sample {b}, column {pad - 1}, layer \d+\) is replayed at a padding column"
    session = ReplaySession(model, audit_every=1)
    with pytest.raises(IndexerPositionError, match=match):
        with session.step():
            session.open_replay(replace(rt, indexer_topk=idx))
    with session.step():  # the session goes on: the batch's own picks replay
        session.open_replay(rt)
        read_columns(model, rt)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_audit_fails_when_the_attention_does_not_consume_the_picks(family: str) -> None:
    """The audit observes what the attention consumes, downstream of rr's hook: a hook after rr's that hands the
    attention other columns (the first index_topk, causal and in range) makes the block raise, where an audit of
    rr's own hook output would have said 1.0."""
    model = dsa_model(family)
    ids = torch.randint(1, 60, (B, S), generator=torch.Generator().manual_seed(1))
    picks = engine_picks(len(find_indexers(model)))

    def elsewhere(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return torch.arange(TOPK, dtype=out.dtype).expand_as(out).contiguous()

    with pytest.raises(ReplayError, match=r"replayed rows did not reach the attention") as err:
        with replay_indexer(model, picks, audit=True):
            handles = [m.register_forward_hook(elsewhere) for _, m in find_indexers(model)]
            try:
                read_positions(model, ids)
            finally:
                for h in handles:
                    h.remove()
    assert err.value.report is not None and err.value.report["r3/indexer/applied_share"] < 1.0


def test_each_indexer_takes_its_rows_on_its_own_device() -> None:
    """A model split over devices: each indexer's hook hands its attention rows on that indexer's device, not the
    first indexer's (the last indexer here on ``meta``, a device of its own that needs no accelerator)."""
    model = dsa_model("deepseek_v32")
    indexers = find_indexers(model)
    indexers[-1][1].to("meta")
    with replay_indexer(model, engine_picks(len(indexers))):
        for _, m in indexers:
            device = next(m.parameters()).device
            (hook,) = m._forward_hooks.values()
            picked = hook(m, (), torch.zeros(B, S, TOPK, dtype=torch.int32, device=device))
            assert picked.device == device
