"""Megatron's protocol enforced, not assumed: on a real one-process GPTModel with full recompute, every way a step can
leave the documented order either replays each micro-batch's own rows or raises a typed error.

What each router chose is read by the harness's own hooks (tests/megatron/harness.py), independent of rr. The
orders tried: the backwards in reverse (B2 before B1), one backward of the summed losses, a grad-on forward-only pass
left in the queue before training; a batch fed flattened, a step whose fed routers never ran, a recompute on other
weights, R2 on reshuffled micro-batches, and the settings under which replay cannot hold (CUDA graphs over the
router, forced balancing, input jitter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client.core.errors import ConfigurationError, MissingRoutingError, ReplayError, ShapeMismatchError
from rr_client.trainer import keys as K
from tests.megatron import harness as H

B, S, E, TOPK = 2, 6, 8, 2
PATTERN = (0, 1, 1)  # decoder layer 1 dense, layers 2 and 3 MoE
LAYERS = [0, 1, 2]


@pytest.fixture()
def gpt(megatron_process: None) -> Any:
    """A fresh GPTModel with full recompute (every router re-runs in the backward)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: tokens ``[b, s]`` and rollout-like rows ``[b, s, 3, k]`` (distinct ids per token)."""
    tokens = torch.randint(0, H.VOCAB, (B, S), generator=torch.Generator().manual_seed(100 + seed))
    return tokens, H.random_rows(B, S, len(LAYERS), E, TOPK, seed=seed)


def _forward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """GPTModel's forward with labels: the summed loss."""
    b, s = tokens.shape
    return model(tokens, torch.arange(s).unsqueeze(0).expand(b, s), H.causal_mask(s), labels=tokens).sum()


def _want(router: Any, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``router`` must replay, in its token order."""
    return H.sequence_first(rows[:, :, int(router.layer_number) - 1])


def _replay(model: Any, **kw: Any) -> Any:
    from rr_client.integrations.megatron import MegatronReplay

    return MegatronReplay(model, **kw)


def _assert_own_rows(
    choices: H.RouterChoices, order: list[int], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Each router's calls (``order``: the micro-batch of each call) chose exactly that micro-batch's rows."""
    for router in choices.routers:
        calls = choices.calls[router]
        assert len(calls) == len(order), f"layer {router.layer_number}: {len(calls)} calls"
        for i, (call, mb) in enumerate(zip(calls, order)):
            H.assert_chose(call, _want(router, batches[mb][1]), f"layer {router.layer_number} call {i} (mb {mb})")


def _two_forwards(model: Any, replay: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Forward both micro-batches (rows set just before each, as forward_step_func does); their losses."""
    losses = []
    for tokens, rows in batches:
        replay.set_micro_batch(rows, layers=LAYERS)
        losses.append(_forward(model, tokens))
    return losses


@pytest.mark.parametrize("backward", ["reversed", "summed"])
def test_every_recompute_replays_its_own_micro_batch_in_any_backward_order(gpt: Any, backward: str) -> None:
    """B2's backward before B1's, or one backward of the summed losses: every recompute still takes its own rows."""
    replay = _replay(gpt)
    batches = [_batch(1), _batch(2)]
    with H.hooked([gpt]) as choices:
        losses = _two_forwards(gpt, replay, batches)
        if backward == "reversed":
            losses[1].backward()
            losses[0].backward()
            order = [0, 1, 1, 0]
        else:
            (losses[0] + losses[1]).backward()
    if backward == "summed":  # autograd picks the recompute order: read it from which rows each call matches
        for router in choices.routers:
            recomputes = choices.calls[router][2:]
            hit = [
                mb
                for call in recomputes
                for mb in (0, 1)
                if torch.equal(call.routing_map, H.rows_to_map(_want(router, batches[mb][1]), E))
            ]
            assert sorted(hit) == [0, 1], f"layer {router.layer_number}: recomputes matched {hit}"
        order = [0, 1, *hit]
    _assert_own_rows(choices, order, batches)
    report = replay.step_done()
    assert report[K.APPLIED_SHARE] == 1.0 and report[K.FORWARDS] == 4
    replay.close()


def test_a_grad_on_forward_only_pass_left_behind_does_not_shift_training(gpt: Any) -> None:
    """A log-prob pass run with grad on and no step_done, then training with recompute in reverse order: the
    recomputes take the training forwards' own rows (the left-over pass's rows are never replayed there)."""
    replay = _replay(gpt)
    batches = [_batch(1), _batch(2)]
    other = [_batch(3), _batch(4)]  # the forward-only pass ran on other samples
    _two_forwards(gpt, replay, other)  # grad on, no backward, no step_done
    with H.hooked([gpt]) as choices:
        losses = _two_forwards(gpt, replay, batches)
        losses[1].backward()
        losses[0].backward()
    _assert_own_rows(choices, [0, 1, 1, 0], batches)
    assert replay.step_done()[K.APPLIED_SHARE] == 1.0
    replay.close()


def test_megatrons_own_fifo_is_never_filled(gpt: Any) -> None:
    """rr keeps the recompute rows itself: Megatron's REPLAY_BACKWARD queue stays empty (it grew by one target per
    router and micro-batch when nothing popped it)."""
    replay = _replay(gpt)
    for _ in range(3):
        _two_forwards(gpt, replay, [_batch(1), _batch(2)])
        for r in H.routers(gpt):
            assert r.router_replay.replay_backward_list == []
    replay.step_done(check=False)
    replay.close()


def test_a_recompute_on_other_input_is_refused_at_step_done(gpt: Any) -> None:
    """The weights changed between a forward and its backward: the recompute's router input matches no forward,
    so no rows are known to be its own: step_done raises."""
    replay = _replay(gpt)
    tokens, rows = _batch(1)
    replay.set_micro_batch(rows, layers=LAYERS)
    loss = _forward(gpt, tokens)
    with torch.no_grad():
        for layer in gpt.decoder.layers:  # inside each checkpointed layer, before its router
            for p in layer.self_attention.parameters():
                p.add_(torch.randn_like(p))
    loss.backward()
    with pytest.raises(ReplayError, match="matched no forward"):
        replay.step_done()
    replay.close()


def test_a_recompute_without_a_forward_with_grad_is_refused(gpt: Any) -> None:
    """Rows set under no_grad (a forward-only pass) and then a backward: no forward waits for that recompute."""
    replay = _replay(gpt)
    tokens, rows = _batch(1)
    with torch.no_grad():
        replay.set_micro_batch(rows, layers=LAYERS)
    loss = _forward(gpt, tokens)
    with pytest.raises(ReplayError, match="no forward with grad"):
        loss.backward()
    replay.step_done(check=False)
    replay.close()


def test_a_flattened_batch_is_refused(gpt: Any) -> None:
    """``[1, B*S]`` routing for a ``[B, S]`` batch has the right token count but another order: refused."""
    replay = _replay(gpt)
    tokens, rows = _batch(1)
    replay.set_micro_batch(rows.reshape(1, B * S, len(LAYERS), TOPK), layers=LAYERS)
    with torch.no_grad(), pytest.raises(ShapeMismatchError, match=r"router sees \[s, b\] = \[6, 2\]"):
        _forward(gpt, tokens)
    replay.step_done(check=False)
    replay.close()


def test_a_fed_step_with_no_router_call_raises(gpt: Any) -> None:
    """Rows set, no forward ran: step_done(check=True) raises (it was quiet when no router at all had run)."""
    replay = _replay(gpt)
    replay.set_micro_batch(_batch(1)[1], layers=LAYERS)
    with pytest.raises(ReplayError, match="no fed router ran"):
        replay.step_done()
    replay.close()


def _r2_record(gpt: Any, replay: Any, batches: list[torch.Tensor]) -> None:
    """R2's log-prob pass: each micro-batch recorded under its index, bound to its tokens."""
    with torch.no_grad():
        for key, tokens in enumerate(batches):
            replay.record(key, tokens=tokens)
            _forward(gpt, tokens)
    replay.step_done()


def _r2_choices(gpt: Any, batches: list[torch.Tensor]) -> H.RouterChoices:
    """What the routers choose themselves on ``batches`` (no replay), one forward each."""
    with H.hooked([gpt]) as own, torch.no_grad():
        for tokens in batches:
            _forward(gpt, tokens)
    return own


def test_r2_matches_a_reshuffled_update_to_its_records(gpt: Any) -> None:
    """R2 recorded micro-batches 0 and 1; the update runs them swapped under the same keys, then with the samples
    regrouped across micro-batches: every call replays each sample's own record."""
    replay = _replay(gpt, mode="R2", audit_every=1)
    batches = [_batch(1)[0], _batch(2)[0]]
    own = _r2_choices(gpt, batches)
    _r2_record(gpt, replay, batches)
    with torch.no_grad():  # the update's weights differ from the recording pass's
        for router in H.routers(gpt):
            router.weight.add_(torch.randn_like(router.weight))
    regrouped = [torch.stack([batches[1][0], batches[0][1]]), torch.stack([batches[0][0], batches[1][1]])]
    sources = [[(1, 0), (0, 1)], [(0, 0), (1, 1)]]  # (recorded micro-batch, sample) of each update sample
    for update, src in ((batches[::-1], [[(1, 0), (1, 1)], [(0, 0), (0, 1)]]), (regrouped, sources)):
        with H.hooked([gpt]) as choices:
            losses = []
            for key, tokens in enumerate(update):  # the keys say 0, 1: the tokens say which records
                replay.set_micro_batch(key=key, tokens=tokens)
                losses.append(_forward(gpt, tokens))
            for loss in losses[::-1]:
                loss.backward()
        for router in choices.routers:
            calls = choices.calls[router]
            for i, mb in enumerate([0, 1, 1, 0]):
                want = torch.stack([own.calls[router][r].routing_map.view(S, B, E)[:, c] for r, c in src[mb]], dim=1)
                assert torch.equal(calls[i].routing_map, want.reshape(S * B, E)), f"layer {router.layer_number} {i}"
        assert replay.step_done()[K.APPLIED_SHARE] == 1.0
    with pytest.raises(MissingRoutingError, match=r"sample\(s\) \[1\]"):
        replay.set_micro_batch(key=0, tokens=torch.stack([batches[0][0], _batch(5)[0][0]]))
    with pytest.raises(ConfigurationError, match="tokens="):
        replay.set_micro_batch(key=0)
    replay.close()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("cuda_graph_impl", "local"),
        ("cuda_graph_impl", "transformer_engine"),
        ("moe_router_force_load_balancing", True),
        ("moe_input_jitter_eps", 0.01),
        ("moe_router_force_biased", True),
    ],
)
def test_settings_under_which_replay_cannot_hold_are_refused_by_name(gpt: Any, setting: str, value: Any) -> None:
    """CUDA graphs over the router (the graph keeps capture-time targets and skips rr's hooks), forced balancing,
    forced-biased routing and input jitter (ids replayed, gates from perturbed logits): refused, named."""
    from megatron.core.transformer.enums import CudaGraphScope

    routers = H.routers(gpt)
    cfg = routers[0].config
    saved = {k: getattr(cfg, k, None) for k in (setting, "cuda_graph_scope")}
    try:
        setattr(cfg, setting, value)
        if setting == "cuda_graph_impl" and value == "transformer_engine":
            cfg.cuda_graph_scope = [CudaGraphScope.moe_router]
        with pytest.raises(ConfigurationError, match=f"TransformerConfig.{setting}="):
            _replay(gpt)
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


def test_a_cuda_graph_that_leaves_the_router_out_is_accepted(gpt: Any) -> None:
    """Transformer Engine graphs of attention alone do not capture the router: accepted."""
    from megatron.core.transformer.enums import CudaGraphScope

    cfg = H.routers(gpt)[0].config
    saved = cfg.cuda_graph_impl, cfg.cuda_graph_scope
    try:
        cfg.cuda_graph_impl, cfg.cuda_graph_scope = "transformer_engine", [CudaGraphScope.attn]
        _replay(gpt).close()
    finally:
        cfg.cuda_graph_impl, cfg.cuda_graph_scope = saved


def test_a_second_model_with_replay_is_refused_with_the_fix_or_named(megatron_process: None) -> None:
    """An actor and a reference model both built with replay on: each refuses the other's routers as orphans, with
    the fix in the message; named in ``others=``, both replay their own rows."""
    H.new_model_state()
    actor = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    ref = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    with pytest.raises(ReplayError, match="others="):
        _replay(actor)
    a, r = _replay(actor, others=[ref]), _replay(ref, others=[actor])
    batches = [_batch(1), _batch(2)]
    with H.hooked([actor, ref]) as choices, torch.no_grad():
        for model, replay, (tokens, rows) in ((actor, a, batches[0]), (ref, r, batches[1])):
            replay.set_micro_batch(rows, layers=LAYERS)
            _forward(model, tokens)
    for router in choices.routers:
        rows = batches[0][1] if any(router is x for x in H.routers(actor)) else batches[1][1]
        H.assert_chose(choices.calls[router][0], _want(router, rows))
    a.step_done()
    r.step_done()
    a.close()
    r.close()


def test_the_recompute_pool_is_bounded(gpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards with grad that no backward recomputes: the pool drops none it still needs, refuses past its cap, and
    step_done empties it."""
    from rr_client.integrations.megatron import _recompute

    monkeypatch.setattr(_recompute, "MAX_LIVE", 3)
    replay = _replay(gpt)
    tokens, rows = _batch(1)
    with pytest.raises(ReplayError, match="call step_done"):
        for _ in range(4):
            replay.set_micro_batch(rows, layers=LAYERS)
            _forward(gpt, tokens)
    replay.step_done(check=False)
    assert all(len(st.pool) == 0 for st in replay.lifecycle.states.values() if st.pool is not None)
    replay.close()


@pytest.mark.parametrize("audit_every", [0, 1])
def test_the_hooks_read_nothing_from_the_device(gpt: Any, audit_every: int) -> None:
    """Two micro-batches in flight, backwards reversed, with replay (and the audit): the same host reads as the model
    without replay (rr_client.trainer.replay.cost counts every sync; step_done's one read is outside)."""
    from rr_client.trainer.replay.cost import count_ops

    batches = [_batch(1), _batch(2)]

    def step(replay: Any | None) -> int:
        losses = []
        with count_ops() as counted:
            for tokens, rows in batches:
                if replay is not None:
                    with count_ops() as feed:  # the feed's own check reads the rows once: not a hook
                        replay.set_micro_batch(rows, layers=LAYERS)
                    counted.syncs -= feed.syncs
                losses.append(_forward(gpt, tokens))
            losses[1].backward()
            losses[0].backward()
        return counted.syncs

    base = step(None)
    replay = _replay(gpt, audit_every=audit_every)
    with_replay = step(replay)
    replay.step_done()
    replay.close()
    assert with_replay == base, f"{with_replay - base} host reads in rr's hooks"
