"""Sparse-attention indexer replay (rr_client.trainer.replay.replay_indexer) in transformers' own DSA models
(``deepseek_v32``, ``glm_moe_dsa``, tiny and random): inside the block every replayed token's attention reads exactly
the engine's positions, measured by an instrument independent of rr (the eager attention's own weights: non-zero at
the positions read); without replay the same instrument shows other positions (the control). Malformed rows are
typed errors when the block opens; the audit reports applied share and agreement per layer."""

from __future__ import annotations

import pytest
import torch

from rr_client import IndexerPositionError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.trainer import replay_indexer
from rr_client.trainer.replay import find_indexers

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
    ],
    ids=["future", "repeat", "partial"],
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
    """DeepSeek-V4's indexer picks compressed KV entries, not token positions: refused, naming the module and why;
    a model without an indexer is refused too."""
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
