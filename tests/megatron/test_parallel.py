"""Two gloo ranks, real megatron-core: PP=2 (1F1B, and interleaved with two virtual stages), TP=2 with sequence
parallel, CP=2 (zigzag), rows fed by rr's ``MegatronReplay``; under TP+SP, CP and THD (test_feeder.py) the audit's token
segments follow their tokens.

Every router on every rank is hooked (tests/megatron/harness.py, independent of the feeder); each case asserts on the
rank that every router chose exactly the rollout's experts for every token that has rows, the rows the test itself
cuts out of the rollout with Megatron's own slicing (``get_batch_on_this_cp_rank``, the sequence-parallel split of
the first dimension, the stage's ``layer_number``). The layouts share one spawn (each rank imports megatron-core
once).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.megatron import harness as H
from tests.megatron.launcher import results_of, run_cases

B, S, E, K = 2, 8, 8, 2
PATTERN = (0, 1, 1, 1)  # layer 1 dense, layers 2-4 MoE; PP=2: stage 0 holds layers 1-2, stage 1 layers 3-4


def rollout(seed: int) -> Any:
    """A padded rollout batch as rr's trainer layer gives it: rows for every decoder layer, none for the last token."""
    from rr_client.trainer.layouts import RoutingTensors

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -1] = False  # the last token has no routing (nothing was generated from it)
    rows = H.random_rows(B, S, len(PATTERN), E, K, seed=seed)
    rows[~mask] = 0
    return RoutingTensors(
        input_ids=torch.randint(0, H.VOCAB, (B, S), generator=g),
        attention_mask=torch.ones(B, S, dtype=torch.long),
        response_mask=mask.long(),
        routed_experts=rows,
        routed_experts_mask=mask,
        layers=list(range(len(PATTERN))),
    )


def check(
    choices: H.RouterChoices, expected: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], *, recompute: bool = False
) -> dict[int, int]:
    """Assert each router's forwards chose its expected rows per micro-batch, in order, and so did its recomputes
    (a recompute runs in the backward with grad on; the forward it repeats ran under ``no_grad``); ``{layer: calls}``.
    """
    seen: dict[int, int] = {}
    for router in choices.routers:
        layer = int(router.layer_number)
        calls, want = choices.calls[router], expected[layer]
        runs = (
            [("forward", [c for c in calls if not c.grad_enabled]), ("recompute", [c for c in calls if c.grad_enabled])]
            if recompute
            else [("forward", calls)]
        )
        for kind, got in runs:
            assert len(got) == len(want), f"layer {layer}: {len(got)} router {kind}s, {len(want)} micro-batches"
            for i, (call, (rows, mask)) in enumerate(zip(got, want)):
                what = f"rank {torch.distributed.get_rank()} layer {layer} {kind} of micro-batch {i}"
                H.assert_chose(H.RouterCall(call.routing_map[mask], call.grad_enabled), rows[mask], what)
                pads = call.routing_map[~mask]
                assert bool((pads.sum(dim=1) == K).all()), f"{what}: a pad token without {K} distinct experts"
        seen[layer] = len(calls)
    return seen


SEGMENTS = torch.tensor([0, 0, 0, 1, 1, 2, 2, -1]).expand(B, S)  # cached, computed, generated; -1: the last token


def check_segments(met: dict[str, float], local_codes: torch.Tensor, moe_layers: int) -> None:
    """The audit's replayed rows per token segment on this rank: its own tokens' codes (as Megatron sliced them),
    once per MoE layer, none for the tokens without a row."""
    from rr_client.trainer import keys as K

    for code, name in enumerate(K.SEGMENTS):
        want = int((local_codes == code).sum()) * moe_layers
        assert met[K.segment(name, "replayed_rows")] == want, (name, met[K.segment(name, "replayed_rows")], want)


def local_rows(routing: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's rows of decoder ``layer`` (1-based) and their mask, in the router's token order."""
    rows = routing.routed_experts[:, :, layer - 1]
    return H.sequence_first(rows), H.sequence_first(routing.routed_experts_mask.unsqueeze(-1)).squeeze(-1)


def pp2_1f1b(rank: int) -> dict[int, int]:
    """PP=2, 1F1B over two micro-batches with full recompute: each stage's routers replay their own layers' rows,
    micro-batch by micro-batch, in the forwards and in the recomputes (stage 0 has both micro-batches in flight)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, pp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True))
    replay = MegatronReplay([model])
    batches = [rollout(seed=11), rollout(seed=12)]
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)

    def forward_step(data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        """Feed this micro-batch's rows right before its forward."""
        routing = batches[next(data)]
        replay.set_micro_batch(routing)
        out = chunk(routing.input_ids, position_ids, H.causal_mask(S), labels=routing.input_ids)
        return out, lambda o: (o.float().mean(), {})

    with H.hooked([model]) as choices:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(2)),
            model=[model],
            num_microbatches=2,
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
    replay.close()
    layers = [int(r.layer_number) for r in choices.routers]
    return check(choices, {layer: [local_rows(b, layer) for b in batches] for layer in layers}, recompute=True)


def pp2_interleaved(rank: int) -> dict[int, int]:
    """PP=2 with two virtual stages (interleaved 1F1B), full recompute: each chunk's routers replay their own layers'
    rows (rank 0 holds layers 1 and 3, rank 1 layers 2 and 4), fed per chunk inside ``forward_step_func``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, pp=2, vpp=2)
    H.new_model_state()
    chunks = [H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True), vp_stage=v) for v in range(2)]
    replay = MegatronReplay(chunks)
    batches = [rollout(seed=41), rollout(seed=42)]
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)

    def forward_step(data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        """Feed this micro-batch's rows to this chunk's routers right before its forward."""
        routing = batches[next(data)]
        replay.set_micro_batch(routing, chunk=chunk)
        out = chunk(routing.input_ids, position_ids, H.causal_mask(S), labels=routing.input_ids)
        return out, lambda o: (o.float().mean(), {})

    with H.hooked(chunks) as choices:
        # one iterator per chunk: each chunk's forward_step draws micro-batches 0, 1 in its own order
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(range(2)), iter(range(2))],
            model=chunks,
            num_microbatches=2,
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
    replay.close()
    layers = [int(r.layer_number) for r in choices.routers]
    return check(choices, {layer: [local_rows(b, layer) for b in batches] for layer in layers}, recompute=True)


def tp2_sequence_parallel(rank: int) -> dict[int, int]:
    """TP=2 with sequence parallel: each TP rank's routers see (and replay) only their own sequence shard."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, tp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, sequence_parallel=True))
    replay = MegatronReplay([model])
    routing = rollout(seed=21)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    with H.hooked([model]) as choices:
        replay.set_micro_batch(routing, segments=SEGMENTS)  # the whole batch: the feeder cuts this rank's part
        out = model(routing.input_ids, position_ids, H.causal_mask(S), labels=routing.input_ids)
        out.float().mean().backward()
    met = replay.step_done()
    replay.close()

    def shard(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's own sequence-parallel split of ``[s, b, ...]`` on this rank, then flattened."""
        group = parallel_state.get_tensor_model_parallel_group()
        rows = _split_along_first_dim(routing.routed_experts[:, :, layer - 1].transpose(0, 1).contiguous(), group)
        mask = _split_along_first_dim(routing.routed_experts_mask.transpose(0, 1).contiguous(), group)
        return rows.reshape(-1, K), mask.reshape(-1)

    group = parallel_state.get_tensor_model_parallel_group()
    check_segments(met, _split_along_first_dim(SEGMENTS.transpose(0, 1).contiguous(), group), moe_layers=3)

    return check(choices, {layer: [shard(layer)] for layer in (2, 3, 4)})


def cp2_zigzag(rank: int) -> dict[int, int]:
    """CP=2: each rank routes the two zigzag chunks ``get_batch_on_this_cp_rank`` gives it, and replays exactly those."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, cp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    replay = MegatronReplay([model])
    routing = rollout(seed=31)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    local = get_batch_on_this_cp_rank(
        {
            "tokens": routing.input_ids.clone(),
            "position_ids": position_ids.clone(),
            "rows": routing.routed_experts.clone(),
            "mask": routing.routed_experts_mask.clone(),
            "segments": SEGMENTS.clone(),
        }
    )
    s_local = local["tokens"].shape[1]
    with H.hooked([model]) as choices:
        replay.set_micro_batch(routing, segments=SEGMENTS)  # the whole batch: the feeder cuts this rank's part
        out = model(local["tokens"], local["position_ids"], H.causal_mask(s_local), labels=local["tokens"])
        out.float().mean().backward()
    met = replay.step_done()
    replay.close()
    check_segments(met, local["segments"], moe_layers=3)

    def sliced(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This CP rank's rows of ``layer``, as Megatron sliced the batch, in the router's order."""
        return H.sequence_first(local["rows"][:, :, layer - 1]), H.sequence_first(local["mask"].unsqueeze(-1))[:, 0]

    return check(choices, {layer: [sliced(layer)] for layer in (2, 3, 4)})


def _reversed_backwards(
    model: Any, replay: Any, feeds: list[tuple[Any, Any]], position_ids: torch.Tensor, seq: int
) -> H.RouterChoices:
    """Two micro-batches in flight (``(routing, tokens)`` each), their backwards in reverse order (B2 before B1)."""
    with H.hooked([model]) as choices:
        losses = []
        for routing, tokens in feeds:
            replay.set_micro_batch(routing)
            losses.append(model(tokens, position_ids, H.causal_mask(seq), labels=tokens).float().mean())
        losses[1].backward()
        losses[0].backward()
    replay.step_done()
    replay.close()
    # the check reads forwards (grad off, checkpointed) then recomputes in call order: B2's recompute ran first
    for router in choices.routers:
        calls = choices.calls[router]
        choices.calls[router] = calls[:2] + calls[2:][::-1]
    return choices


def tp2_sp_reversed_backwards(rank: int) -> dict[int, int]:
    """TP=2 + SP, full recompute, B2's backward before B1's: every shard's recomputes replay their own micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, tp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, sequence_parallel=True, recompute=True))
    batches = [rollout(seed=51), rollout(seed=52)]
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    choices = _reversed_backwards(model, MegatronReplay([model]), [(b, b.input_ids) for b in batches], position_ids, S)
    group = parallel_state.get_tensor_model_parallel_group()

    def shard(routing: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _split_along_first_dim(routing.routed_experts[:, :, layer - 1].transpose(0, 1).contiguous(), group)
        mask = _split_along_first_dim(routing.routed_experts_mask.transpose(0, 1).contiguous(), group)
        return rows.reshape(-1, K), mask.reshape(-1)

    return check(choices, {layer: [shard(b, layer) for b in batches] for layer in (2, 3, 4)}, recompute=True)


def cp2_reversed_backwards(rank: int) -> dict[int, int]:
    """CP=2 (zigzag), full recompute, B2's backward before B1's: each rank's recomputes replay their own slices."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, cp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True))
    batches = [rollout(seed=61), rollout(seed=62)]
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    locals_ = [
        get_batch_on_this_cp_rank(
            {
                "tokens": b.input_ids.clone(),
                "position_ids": position_ids.clone(),
                "rows": b.routed_experts.clone(),
                "mask": b.routed_experts_mask.clone(),
            }
        )
        for b in batches
    ]
    s_local = locals_[0]["tokens"].shape[1]
    choices = _reversed_backwards(
        model,
        MegatronReplay([model]),
        [(b, loc["tokens"]) for b, loc in zip(batches, locals_)],
        locals_[0]["position_ids"],
        s_local,
    )

    def sliced(loc: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return H.sequence_first(loc["rows"][:, :, layer - 1]), H.sequence_first(loc["mask"].unsqueeze(-1))[:, 0]

    return check(choices, {layer: [sliced(loc, layer) for loc in locals_] for layer in (2, 3, 4)}, recompute=True)


def pp2_forward_only_left_behind(rank: int) -> dict[int, int]:
    """PP=2: a forward-only schedule run with grad on (a log-prob pass that forgot no_grad) and no step_done, then
    the 1F1B training schedule with recompute: the training recomputes replay their own micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rr_client.integrations.megatron import MegatronReplay

    H.init_parallel(rank=rank, world_size=2, pp=2)
    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True))
    replay = MegatronReplay([model])
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)

    def run(batches: list[Any], forward_only: bool) -> None:
        def forward_step(data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
            routing = batches[next(data)]
            replay.set_micro_batch(routing)
            out = chunk(routing.input_ids, position_ids, H.causal_mask(S), labels=routing.input_ids)
            return out, lambda o: (o.float().mean(), {})

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(2)),
            model=[model],
            num_microbatches=2,
            seq_length=S,
            micro_batch_size=B,
            forward_only=forward_only,
        )

    run([rollout(seed=71), rollout(seed=72)], True)  # grad on, nothing recomputes it, no step_done
    batches = [rollout(seed=73), rollout(seed=74)]
    with H.hooked([model]) as choices:
        run(batches, False)
    replay.step_done()
    replay.close()
    layers = [int(r.layer_number) for r in choices.routers]
    return check(choices, {layer: [local_rows(b, layer) for b in batches] for layer in layers}, recompute=True)


CASES = [
    pp2_1f1b,
    pp2_interleaved,
    tp2_sequence_parallel,
    cp2_zigzag,
    tp2_sp_reversed_backwards,
    cp2_reversed_backwards,
    pp2_forward_only_left_behind,
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[tuple[bool, Any]]]:
    """Every case on two spawned gloo ranks (one spawn)."""
    return run_cases(CASES)


def test_pp2_each_stage_replays_its_own_layers(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    """Stage 0 routes MoE layer 2, stage 1 layers 3 and 4, each in two forwards and two recomputes, as the rollout did."""
    assert results_of(outcomes, pp2_1f1b) == [{2: 4}, {3: 4, 4: 4}]


def test_pp2_interleaved_each_chunk_replays_its_own_layers(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    """Rank 0's chunks route MoE layer 3 (layer 1 is dense), rank 1's layers 2 and 4: two forwards and two
    recomputes each, as the rollout did."""
    assert results_of(outcomes, pp2_interleaved) == [{3: 4}, {2: 4, 4: 4}]


def test_tp2_sequence_parallel_shards_replay_their_tokens(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    """Both TP ranks route every MoE layer on their own half of the sequence, as the rollout did."""
    assert results_of(outcomes, tp2_sequence_parallel) == [{2: 1, 3: 1, 4: 1}] * 2


def test_cp2_zigzag_slices_replay_their_tokens(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    """Both CP ranks route every MoE layer on their zigzag chunks, as the rollout did."""
    assert results_of(outcomes, cp2_zigzag) == [{2: 1, 3: 1, 4: 1}] * 2


def test_tp2_sp_recomputes_replay_their_own_micro_batch_in_reverse_order(
    outcomes: dict[str, list[tuple[bool, Any]]],
) -> None:
    """TP=2 + SP, B2 before B1: two forwards and two recomputes per router, each on its own micro-batch's shard."""
    assert results_of(outcomes, tp2_sp_reversed_backwards) == [{2: 4, 3: 4, 4: 4}] * 2


def test_cp2_recomputes_replay_their_own_micro_batch_in_reverse_order(
    outcomes: dict[str, list[tuple[bool, Any]]],
) -> None:
    """CP=2, B2 before B1: two forwards and two recomputes per router, each on its own micro-batch's slices."""
    assert results_of(outcomes, cp2_reversed_backwards) == [{2: 4, 3: 4, 4: 4}] * 2


def test_pp2_a_grad_on_forward_only_pass_does_not_shift_training(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    """PP=2: a grad-on forward-only schedule left behind, then 1F1B: each recompute still takes its own rows."""
    assert results_of(outcomes, pp2_forward_only_left_behind) == [{2: 4}, {3: 4, 4: 4}]
