"""rr's Megatron feeder on real megatron-core ``GPTModel``s (one gloo process): which rows each router gets, laid out as
Megatron lays out tokens, and the typed refusals of what Megatron takes silently (rows, configurations, orphans).

What the routers chose is read from the harness's forward hooks on the routers (tests/megatron/harness.py), never
from the feeder's own bookkeeping.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.core.errors import (
    ConfigurationError,
    ExpertIdOutOfRangeError,
    MissingRoutingError,
    ReplayError,
    ShapeMismatchError,
    UnrecordedRoutingError,
)
from rr_client.trainer.layouts import PackedRouting, RoutingTensors
from tests.megatron import harness as H

B, S, E, K = 2, 8, 8, 2
PATTERN = (0, 1, 1)  # layer 1 dense, layers 2 and 3 MoE


def gpt(**spec: Any) -> Any:
    """A fresh GPTModel (dense layer 1, MoE layers 2 and 3 unless ``moe_pattern`` says otherwise)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(**{"moe_pattern": PATTERN, **spec}))


def rollout(seed: int = 0, layers: int = len(PATTERN), attention: torch.Tensor | None = None) -> RoutingTensors:
    """A padded batch as rr's trainer layer gives it: rows for every layer, none for each sample's last token."""
    attn = attention if attention is not None else torch.ones(B, S, dtype=torch.long)
    mask = attn.bool() & ~_last(attn)
    rows = H.random_rows(B, S, layers, E, K, seed=seed)
    rows[~mask] = 0
    ids = torch.randint(0, H.VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    return RoutingTensors(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask.long(),
        routed_experts=rows,
        routed_experts_mask=mask,
        layers=list(range(layers)),
    )


def _last(attn: torch.Tensor) -> torch.Tensor:
    """Each sample's last real token."""
    from rr_client.integrations.megatron._layout import last_tokens

    return last_tokens(attn)


def spread(rows: torch.Tensor, layer: int, first: int = 0) -> torch.Tensor:
    """Reference pad rows (issue 43): ``[tokens, K]`` in the router's token order, the n-th row marked -1 takes
    ``(n * K + col + layer * K) % E`` (``layer`` 0-based), so pads spread over every expert; ``n`` counts from
    ``first`` (a stateless feed starts each rank of a micro-batch at its shard: ``Parallel.shard``)."""
    out, n = rows.clone().long(), first
    for t in range(out.shape[0]):
        if bool((out[t] < 0).all()):
            out[t] = torch.tensor([(n * K + c + layer * K) % E for c in range(K)])
            n += 1
    return out


def forward(model: Any, ids: torch.Tensor, backward: bool = False) -> None:
    """One forward of ``ids`` ``[b, s]`` with labels (the MTP layer runs only with labels), optionally backward."""
    b, s = ids.shape
    out = model(ids, torch.arange(s).expand(b, s), H.causal_mask(s), labels=ids)
    if backward:
        out.float().sum().backward()


def test_every_router_chooses_its_own_layers_rows(megatron_process: None) -> None:
    """Each MoE router replays the rows of its layer_number (the dense layer has no router and takes none); pads
    (each sample's last token, left padding) route to K distinct experts; targets are int64 sequence-first."""
    from rr_client.integrations.megatron import MegatronReplay

    model = gpt()
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, :2] = 0  # sample 1 left-padded by two tokens
    batch = rollout(seed=1, attention=attn)
    replay = MegatronReplay(model)
    fed = replay.set_micro_batch(batch)
    assert sorted(int(m.layer_number) for m in fed.targets) == [2, 3]
    assert all(t.dtype == torch.int64 and t.shape == (S * B, K) for t in fed.targets.values())
    assert fed.tokens == S * B and torch.equal(fed.have, H.sequence_first(batch.routed_experts_mask[..., None])[:, 0])
    with H.hooked([model]) as choices:
        forward(model, batch.input_ids, backward=True)
    replay.step_done()
    mask = H.sequence_first(batch.routed_experts_mask.unsqueeze(-1)).squeeze(-1)
    for router in choices.routers:
        (call,) = choices.calls[router]
        want = H.sequence_first(batch.routed_experts[:, :, router.layer_number - 1])
        H.assert_chose(H.RouterCall(call.routing_map[mask], True), want[mask], f"layer {router.layer_number}")
        pads = spread(torch.full((int((~mask).sum()), K), -1), router.layer_number - 1)
        H.assert_chose(H.RouterCall(call.routing_map[~mask], True), pads, f"pads of layer {router.layer_number}")
    assert all(
        r.router_replay.router_replay_action is None and r.router_replay.target_topk_idx is None
        for r in choices.routers
    )


def test_moe_layer_axis_and_a_raw_tensor_give_the_same_targets(megatron_process: None) -> None:
    """Rows on the MoE-only layer axis (Megatron's ordinals, ``layers`` = their decoder layers) and a raw
    ``[b, s, L, K]`` tensor with ``layers=`` are laid out exactly as the absolute-axis RoutingTensors."""
    from dataclasses import replace

    from rr_client.integrations.megatron import router_targets

    model = gpt()
    batch = rollout(seed=2)
    absolute = router_targets(model, batch)
    moe = router_targets(
        model, replace(batch, routed_experts=batch.routed_experts[:, :, 1:], layers=[1, 2], layer_axis="moe")
    )
    raw = router_targets(model, batch.routed_experts, layers=[0, 1, 2], mask=batch.routed_experts_mask)
    layer_major = router_targets(model, replace(batch, routed_experts=batch.routed_experts.permute(2, 0, 1, 3)))
    for other in (moe, raw, layer_major):
        assert other.keys() == absolute.keys()
        assert all(torch.equal(other[r], absolute[r]) for r in absolute)


def test_context_and_sequence_parallel_layouts(megatron_process: None) -> None:
    """CP=2 keeps zigzag chunks r and 3-r of the sequence, SP=2 then a contiguous half, both sequence-first."""
    from rr_client.integrations.megatron import Parallel, router_targets

    model = gpt()
    batch = rollout(seed=3)
    layer3 = next(r for r in H.routers(model) if r.layer_number == 3)
    rows = batch.routed_experts[:, :, 2].long()
    rows[~batch.routed_experts_mask] = -1  # pads: spread in each rank's own token order
    for rank, positions in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        got = router_targets(model, batch, cp_size=2, cp_rank=rank, tp_size=1, tp_rank=0)[layer3]
        assert torch.equal(got, spread(H.sequence_first(rows[:, positions]), 2, rank))
    for rank, positions in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])):
        got = router_targets(model, batch, tp_size=2, tp_rank=rank, sequence_parallel=True, cp_size=1, cp_rank=0)[
            layer3
        ]
        assert torch.equal(got, spread(H.sequence_first(rows[:, positions]), 2, rank))
    both = router_targets(model, batch, cp_size=2, cp_rank=1, tp_size=2, tp_rank=1, sequence_parallel=True)[layer3]
    # CP rank 1 keeps 2..5, SP rank 1 its half; shard 1 * 2 + 1
    assert torch.equal(both, spread(H.sequence_first(rows[:, [4, 5]]), 2, 3))
    no_sp = router_targets(model, batch, tp_size=2, tp_rank=1, sequence_parallel=False, cp_size=1, cp_rank=0)
    assert no_sp[layer3].shape == (S * B, K)  # without SP every TP rank routes every token
    assert Parallel() == Parallel(1, 0, 1, 0, False)


def _packed(lengths: list[int], seed: int = 4) -> PackedRouting:
    """A packed (THD) batch with ``append_row=False`` rows (each sample's len - 1 rows, as engines send them)."""
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rcu = torch.tensor([0, *torch.tensor([x - 1 for x in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    rows = H.random_rows(1, int(rcu[-1]), len(PATTERN), E, K, seed=seed)[0]
    return PackedRouting(
        input_ids=torch.zeros(n, dtype=torch.long),
        position_ids=torch.zeros(n, dtype=torch.long),
        cu_seqlens=cu,
        response_mask=torch.ones(n, dtype=torch.long),
        routed_experts=rows,
        routed_experts_mask=torch.ones(int(rcu[-1]), dtype=torch.bool),
        routing_cu_seqlens=rcu,
        layers=list(range(len(PATTERN))),
    )


def test_packed_thd_rows_and_context_parallel_per_sample(megatron_process: None) -> None:
    """THD: token t of sample i takes engine row t of that sample; the last token a pad row; under CP=2 with
    padded bounds each sample is zigzag-sliced on its own (Transformer Engine's partitioned indices)."""
    from rr_client.integrations.megatron import router_targets

    model = gpt()
    packed = _packed([3, 6])  # rows: sample 0 -> 2, sample 1 -> 5
    layer2 = next(r for r in H.routers(model) if r.layer_number == 2)
    rows = packed.routed_experts[:, 1].long()
    pad = torch.full((K,), -1)
    on_tokens = torch.stack([rows[0], rows[1], pad, *rows[2:7], pad])  # [9, K]
    assert torch.equal(router_targets(model, packed, cp_size=1, cp_rank=0)[layer2], spread(on_tokens, 1))
    # Megatron's padded THD axis: sample 0 in [0, 4), sample 1 in [4, 12) (multiples of 2 * cp)
    padded = torch.stack([on_tokens[0], on_tokens[1], on_tokens[2], pad, *on_tokens[3:9], pad, pad])
    got = [router_targets(model, packed, cp_size=2, cp_rank=r, cu_seqlens_padded=[0, 4, 12])[layer2] for r in (0, 1)]
    assert torch.equal(got[0], spread(padded[[0, 3, 4, 5, 10, 11]], 1))
    assert torch.equal(got[1], spread(padded[[1, 2, 6, 7, 8, 9]], 1, 1))


def test_packed_thd_segments_follow_their_tokens_under_context_parallel(megatron_process: None) -> None:
    """The audit's token segments (``[b, s]`` codes laid out as the rows) reach each router in its token order: THD
    unpadded, and under CP=2 with padded bounds each sample's zigzag slices carry their own codes, pads none (-1)."""
    from rr_client.integrations.megatron import MegatronReplay
    from rr_client.integrations.megatron._feeder import Parallel

    replay = MegatronReplay(gpt())
    packed = _packed([3, 6])
    codes = torch.tensor([[0, 1, -1, 0, 0, 1, 2, 2, -1]])  # cached / computed / generated; -1 on each last token
    fed = replay.targets_for(packed, segments=codes, parallel=Parallel())
    assert torch.equal(fed.segments, codes[0]) and torch.equal(fed.have, codes[0] >= 0)
    padded = torch.tensor([0, 1, -1, -1, 0, 0, 1, 2, 2, -1, -1, -1])  # sample 0 in [0, 4), sample 1 in [4, 12)
    for rank, take in ((0, [0, 3, 4, 5, 10, 11]), (1, [1, 2, 6, 7, 8, 9])):
        fed = replay.targets_for(
            packed, segments=codes, parallel=Parallel(cp_size=2, cp_rank=rank), cu_seqlens_padded=[0, 4, 12]
        )
        assert torch.equal(fed.segments, padded[take]), (rank, fed.segments)
        assert torch.equal(fed.have, padded[take] >= 0)


def test_mtp_router_takes_rows_when_the_rollout_has_them_else_is_left(megatron_process: None) -> None:
    """``mtp="auto"``: MTP rows (layer num_layers + depth - 1) replayed when present, else the MTP router routes
    itself and is reported; ``"rows"`` without them is refused; ``"skip"`` leaves it even with rows."""
    from rr_client.integrations.megatron import MegatronReplay

    model = gpt(mtp_layers=1)
    replay = MegatronReplay(model)
    mtp_router = next(r for r in H.routers(model) if r.layer_number == 4)
    fed = replay.set_micro_batch(rollout(seed=5))
    assert [r.module for r in fed.left] == [mtp_router] and mtp_router not in fed.targets
    assert mtp_router.router_replay.router_replay_action is None
    replay.step_done(check=False)  # fed, no forward: step_done(check=True) would raise (tests/megatron/test_protocol)
    with pytest.raises(ShapeMismatchError, match="MTP layer 4 .* no MTP rows"):
        replay.targets_for(rollout(seed=5), mtp="rows")
    with_mtp = rollout(seed=6, layers=len(PATTERN) + 1)  # the rollout's MTP layer after the decoder's
    assert mtp_router in replay.targets_for(with_mtp).targets
    assert mtp_router not in replay.targets_for(with_mtp, mtp="skip").targets
    replay.set_micro_batch(with_mtp, mtp="rows")
    with H.hooked([model]) as choices:
        forward(model, with_mtp.input_ids)
    replay.step_done()
    mask = H.sequence_first(with_mtp.routed_experts_mask.unsqueeze(-1)).squeeze(-1)
    (call,) = choices.calls[mtp_router]
    want = H.sequence_first(with_mtp.routed_experts[:, :, 3])
    H.assert_chose(H.RouterCall(call.routing_map[mask], False), want[mask], "MTP router")


def test_two_chunks_holding_one_layer_are_refused(megatron_process: None) -> None:
    """Chunks of one rank (virtual stages) hold disjoint layers: two routers on one layer_number cannot be told
    apart and are refused rather than fed the same rows."""
    from rr_client.integrations.megatron import MegatronReplay

    H.new_model_state()
    first, second = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN)), H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    with pytest.raises(ReplayError, match="share layer_number 2"):
        MegatronReplay([first, second])


# ---------------------------------------------------------------- what Megatron takes silently, refused


def test_short_rows_are_refused_at_the_forward(megatron_process: None) -> None:
    """Targets for fewer tokens than the router sees (Megatron routes the rest to no expert) raise at the forward."""
    from rr_client.integrations.megatron import MegatronReplay

    model = gpt()
    replay = MegatronReplay(model)
    batch = rollout(seed=7)
    replay.set_micro_batch(batch)
    longer = torch.cat([batch.input_ids, batch.input_ids[:, :2]], dim=1)  # the forward sees 2 more positions
    with pytest.raises(ShapeMismatchError, match=r"decoder layer 2 .* targets are \(16, 2\), the router sees 20"):
        forward(model, longer)
    replay.close()  # layer 3 never ran: clear without the step's verdicts


def test_malformed_rows_raise_typed_errors(megatron_process: None) -> None:
    """Wrong width, ids >= experts, negative ids, repeated ids, real tokens without rows: typed errors, naming the
    layer; none reaches a router."""
    from dataclasses import replace

    from rr_client.integrations.megatron import router_targets

    model = gpt()
    batch = rollout(seed=8)
    wide = H.random_rows(B, S, len(PATTERN), E, K + 1, seed=8)
    with pytest.raises(ShapeMismatchError, match="rows are 3 experts wide, the router's top-k is 2"):
        router_targets(model, replace(batch, routed_experts=wide))
    for value, err, what in (
        (E, ExpertIdOutOfRangeError, "has 8 experts"),
        (-1, UnrecordedRoutingError, "sample 1, position 3 is partly padded"),
    ):
        bad = batch.routed_experts.clone().to(torch.int16)
        bad[1, 3, 2, 0] = value  # a -1 beside a real id: a partly padded row (issue 43), no longer "out of range"
        with pytest.raises(err, match=rf"decoder layer 3 .* {what}"):
            router_targets(model, replace(batch, routed_experts=bad))
    dup = batch.routed_experts.clone()
    dup[0, 0, 1] = 5
    with pytest.raises(UnrecordedRoutingError, match="decoder layer 2 .* repeats an expert id"):
        router_targets(model, replace(batch, routed_experts=dup))
    holes = batch.routed_experts_mask.clone()
    holes[0, :3] = False  # prompt rows the engine did not send (a routed_experts_start offset)
    with pytest.raises(MissingRoutingError, match="3 real tokens have no routing row .*sample 0, position 0"):
        router_targets(model, replace(batch, routed_experts_mask=holes))
    early = batch.routed_experts_mask.clone()
    real = torch.as_tensor(batch.attention_mask)[1].nonzero().flatten()
    early[1, int(real[-3]) :] = False  # rows that stop early (a prefix): tokens before the last loss token lack rows
    with pytest.raises(
        MissingRoutingError, match=f"2 real tokens have no routing row .*sample 1, position {int(real[-3])}"
    ):
        router_targets(model, replace(batch, routed_experts_mask=early))
    with pytest.raises(ShapeMismatchError, match="no rows; the rows hold layers \\[0, 1\\]"):
        router_targets(model, replace(batch, routed_experts=batch.routed_experts[:, :, :2], layers=[0, 1]))


def test_a_dense_only_stage_is_fed_nothing_and_a_foreign_model_refused(megatron_process: None) -> None:
    """A pipeline stage holding dense layers only has no router: accepted, fed nothing; chunks with no Megatron
    TransformerLayer at all (another library's model) are refused rather than silently replaying nothing."""
    from torch import nn

    from rr_client.integrations.megatron import MegatronReplay

    dense = gpt(moe_pattern=(0, 0, 0))
    replay = MegatronReplay(dense)
    fed = replay.set_micro_batch(rollout(seed=10))
    assert replay.routers == [] and fed.targets == {} and fed.tokens == S * B
    forward(dense, rollout(seed=10).input_ids)
    replay.step_done()
    with pytest.raises(ReplayError, match="hold no Megatron TransformerLayer"):
        MegatronReplay(nn.Sequential(nn.Linear(4, 4)))


def test_an_moe_layer_without_a_topk_router_is_refused(megatron_process: None) -> None:
    """An MoE layer whose router is not a TopKRouter (no RouterReplay) would train unreplayed: refused by name."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from torch import nn

    from rr_client.core.errors import UnsupportedModelError
    from rr_client.integrations.megatron import find_routers

    model = gpt()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    layer.router = nn.Linear(H.HIDDEN, E)  # a router type Megatron's replay does not know
    with pytest.raises(UnsupportedModelError, match="MoE layer decoder.layers.1.mlp of chunk 0 routes with Linear"):
        find_routers(model)


def test_orphan_routers_of_a_rebuilt_model_are_refused(megatron_process: None) -> None:
    """A model built again without clearing Megatron's global list leaves orphans there: refused; a replay held on
    a model whose instances were cleared (the model rebuilt) refuses to set targets."""
    from rr_client.integrations.megatron import MegatronReplay

    old = gpt()
    replay = MegatronReplay(old)
    new = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))  # appended to the list: old's 2 + new's 2 instances
    with pytest.raises(ReplayError, match="orphan routers: 2 of 4 RouterReplay instances"):
        MegatronReplay(new)
    H.new_model_state()  # cleared, then rebuilt: old's routers are orphans now
    rebuilt = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    with pytest.raises(ReplayError, match="orphan routers: .*no longer in RouterReplay.global_router_replay"):
        replay.set_micro_batch(rollout(seed=9))
    assert MegatronReplay(rebuilt).routers


@pytest.mark.parametrize(
    ("setting", "overrides"),
    [
        ("moe_router_load_balancing_type", {"moe_router_load_balancing_type": "sinkhorn", "moe_router_topk": 1}),
        ("moe_expert_capacity_factor", {"moe_expert_capacity_factor": 1.0}),
        ("moe_enable_routing_replay", {"moe_enable_routing_replay": False}),
    ],
)
def test_configurations_that_bypass_replay_are_refused(
    megatron_process: None, setting: str, overrides: dict[str, Any]
) -> None:
    """Sinkhorn balancing, a capacity factor (drops replayed tokens), replay off: ConfigurationError naming it."""
    from rr_client.integrations.megatron import MegatronReplay

    topk = overrides.pop("moe_router_topk", K)
    model = gpt(topk=topk, config_overrides=overrides)
    with pytest.raises(ConfigurationError, match=f"TransformerConfig.{setting}="):
        MegatronReplay(model)


def test_fused_router_is_refused(megatron_process: None) -> None:
    """``moe_router_fusion`` (Transformer Engine's fused top-k skips replay; TE is not installed here, so the setting
    is set on the built model's config): ConfigurationError naming it."""
    from rr_client.integrations.megatron import MegatronReplay

    model = gpt()
    H.routers(model)[0].config.moe_router_fusion = True
    with pytest.raises(ConfigurationError, match="TransformerConfig.moe_router_fusion=True"):
        MegatronReplay(model)
