"""rr's feeder in place of verl 0.9.1's ``set_router_replay_data``, through verl's own Megatron engine (issue 45).

- rr's feeder is what verl's forward step calls; verl's own feeder is never called.
- Side by side on the layouts where verl's feeder is right (R3 with its replay mask, R2's recorded rows): for every
  router, verl's targets and rr's targets are equal on every token either replays, and the masks are equal.
- R2: verl's ``compute_log_prob`` records the model's routing, verl's update (``RayPPOTrainer._update_actor`` ->
  the worker's ``update_actor`` -> ``train_mini_batch`` -> ``MegatronEngine.forward_backward_batch(forward_only=
  False)``) replays it through rr's feeder, forward and backward.
- Refused in the worker: a failed patch, an untested verl (its version faked), a setting rr's feeder refuses.

Stand-in for the update (named): the optimizer. megatron-core's ``Float16OptimizerWithFloat16Params`` is CUDA-only
(``device='cuda'`` at optimizer/optimizer.py:473-485, ``torch.cuda.*Tensor`` type checks at :671-699), so the
engine is built forward-only (no optimizer, no DDP wrapper) and its ``optimizer_zero_grad`` / ``optimizer_step``
/ ``lr_scheduler_step`` are replaced on the instance (grads zeroed; no step). Routing is fixed by the forward/backward, which are verl's.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from tests.verl_megatron.harness import take_targets
from tests.verl_megatron.test_engine_replay import (
    EXPERTS,
    LAYERS,
    batch_of,
    per_sample,
    random_rows,
    run_log_prob,
    sample_tokens,
    workers,  # noqa: F401 - the module-scoped fixture
)

MODULE = "verl.workers.engine.megatron.transformer_impl"


def _feeders() -> tuple[Any, Any, Any]:
    """(verl's engine module, rr's feeder as installed there, verl's own feeder it replaced)."""
    from rr_client.core.patching import MARKER

    mod = importlib.import_module(MODULE)
    rr = mod.set_router_replay_data
    return mod, rr, getattr(rr, MARKER)


@contextmanager
def side_by_side() -> Iterator[list[tuple[dict[int, Any], dict[int, Any]]]]:
    """For the block, each feeder call runs verl's own feeder, then rr's, on the same arguments; yields the
    ``(verl's, rr's)`` targets of every call. rr's targets are the ones left on the routers."""
    mod, rr, verl = _feeders()
    calls: list[tuple[dict[int, Any], dict[int, Any]]] = []

    def both(*args: Any, **kwargs: Any) -> None:
        verl(*args, **kwargs)
        theirs = take_targets(kwargs["model"])
        rr(*args, **kwargs)
        ours = take_targets(kwargs["model"])
        rr(*args, **kwargs)  # again, for the forward that follows (the copies above cleared them)
        calls.append((theirs, ours))

    mod.set_router_replay_data = both
    try:
        yield calls
    finally:
        mod.set_router_replay_data = rr


def assert_equal_where_replayed(calls: list[tuple[dict[int, Any], dict[int, Any]]], *, masked: bool) -> int:
    """verl's and rr's targets equal on every token either replays, per router and call; returns the rows compared."""
    compared = 0
    assert calls
    for theirs, ours in calls:
        assert sorted(theirs) == sorted(ours) == list(range(1, LAYERS + 1))
        for layer, (t_idx, t_mask) in theirs.items():
            o_idx, o_mask = ours[layer]
            assert t_idx.shape == o_idx.shape, layer
            if masked:
                assert torch.equal(t_mask, o_mask), f"layer {layer}: replay masks differ"
                on = o_mask
            else:
                assert t_mask is None and o_mask is None
                on = torch.ones(o_idx.shape[0], dtype=torch.bool)
            assert torch.equal(t_idx[on], o_idx[on]), f"layer {layer}: verl's and rr's targets differ"
            compared += int(on.sum())
    return compared


def test_rrs_feeder_replaces_verls_and_verls_is_never_called(
    workers: Any,  # noqa: F811
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rr_client.integrations import verl as rr_verl
    from rr_client.integrations.verl._megatron_feed import rr_feeder

    cfg, w = workers["R3"]
    mod, rr, verl = _feeders()
    assert rr.__code__ is rr_feeder(verl).__code__ and not rr_verl.failed_patches()
    called: list[int] = []
    utils = importlib.import_module("verl.utils.megatron.router_replay_utils")
    packs = utils.preprocess_thd_engine  # verl's feeder packs its rows with it (its module's own name for it)
    monkeypatch.setattr(utils, "preprocess_thd_engine", lambda *a, **k: called.append(1) or packs(*a, **k))
    toks = sample_tokens(11)
    rows = [random_rows(len(p) + len(r) - 1, seed=110 + i) for i, (p, r) in enumerate(toks)]
    _, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    assert not called
    lengths = [len(p) + len(r) for p, r in toks]
    for layer in (1, 2):
        for i, got in enumerate(per_sample(seen.maps[layer], lengths)):
            want = torch.zeros(lengths[i] - 1, EXPERTS, dtype=torch.bool)
            want.scatter_(1, torch.as_tensor(rows[i][:, layer - 1], dtype=torch.int64), True)
            assert torch.equal(got[:-1], want), (layer, i)


def test_r3_rrs_targets_equal_verls_for_every_router(workers: Any, tokenizer: Any) -> None:  # noqa: F811
    cfg, w = workers["R3"]
    toks = sample_tokens(12)
    rows = [random_rows(len(p) + len(r) - 1, seed=120 + i) for i, (p, r) in enumerate(toks)]
    with side_by_side() as calls:
        run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    assert len(calls) == 2  # one per micro-batch
    assert assert_equal_where_replayed(calls, masked=True) == sum(len(r) for r in rows) * LAYERS


def stand_in_optimizer(engine: Any) -> None:
    """The named stand-in for megatron's CUDA-only optimizer (module docstring): grads zeroed, no step."""

    def zero_grad() -> None:
        for chunk in engine.module:
            chunk.zero_grad(set_to_none=True)

    engine.optimizer_zero_grad = zero_grad
    engine.optimizer_step = lambda: 0.0
    engine.lr_scheduler_step = lambda: 0.0


def test_r2_records_in_compute_log_prob_and_replays_through_rrs_feeder_in_the_update(
    workers: Any,  # noqa: F811
    tokenizer: Any,
) -> None:
    from tests.verl import harness as vh
    from tests.verl_megatron import harness as h

    cfg, w = workers["R2"]
    t = vh.trainer(cfg, w)
    toks = sample_tokens(13)
    lengths = [len(p) + len(r) for p, r in toks]
    batch = batch_of(tokenizer, toks, None)
    old, seen_rec = run_log_prob(cfg, w, batch)
    rec = old.batch["routed_experts"]  # verl's record of the model's own routing, every token
    assert rec.is_nested
    for layer in (1, 2):  # the record is what the routers chose in the log-prob pass
        for i, got in enumerate(per_sample(seen_rec.maps[layer], lengths)):
            want = torch.zeros(lengths[i], EXPERTS, dtype=torch.bool)
            want.scatter_(1, rec[i][:, layer - 1].long(), True)
            assert torch.equal(got, want), (layer, i)
    batch = batch.union(old)
    engine = w.actor.engine
    stand_in_optimizer(engine)
    object.__setattr__(w.actor.engine_config, "forward_only", False)  # train_batch's guard; no optimizer built
    grads: list[float] = []
    gate = next(m for m in engine.module[0].modules() if type(m).__name__ == "TopKRouter").weight
    hook = gate.register_post_accumulate_grad_hook(lambda p: grads.append(float(p.grad.float().norm())))
    seen = h.MoeSeen(engine.module[0])
    try:
        with side_by_side() as calls:
            met = vh.update_actor(t, batch)
    finally:
        seen.remove()
        hook.remove()
        object.__setattr__(w.actor.engine_config, "forward_only", True)
    assert all(np.isfinite(met["actor/pg_loss"]))
    assert grads and all(g > 0 for g in grads)  # the update's backward ran through the replayed routers
    assert assert_equal_where_replayed(calls, masked=False) == sum(lengths) * LAYERS
    for layer in (1, 2):  # the update ran exactly the recorded experts, every token
        for i, got in enumerate(per_sample(seen.maps[layer], lengths)):
            want = torch.zeros(lengths[i], EXPERTS, dtype=torch.bool)
            want.scatter_(1, rec[i][:, layer - 1].long(), True)
            assert torch.equal(got, want), (layer, i)


def test_a_refused_setting_raises_in_the_worker(model_dir: Any, megatron_verl_process: None) -> None:
    """Settings rr's feeder would not hold under, each refused in the worker naming it: a CUDA graph over the router
    (before verl builds anything), forced load balancing (megatron's config, at the engine's build), the padded
    layout."""
    from rr_client.core.errors import ConfigurationError
    from tests.verl import harness as vh
    from tests.verl_megatron import harness as h

    cfg = h.ppo_config(model_dir, mode="R3")
    cfg.actor_rollout_ref.actor.megatron.override_transformer_config["cuda_graph_impl"] = "local"
    with pytest.raises(ConfigurationError, match=r"mode=R3 with .*override_transformer_config.*'local'.*CUDA graph"):
        vh.actor_worker(cfg)
    cfg = h.ppo_config(model_dir, mode="R2")
    cfg.actor_rollout_ref.actor.megatron.override_transformer_config["moe_router_force_load_balancing"] = True
    with pytest.raises(ConfigurationError, match=r"moe_router_force_load_balancing=True.*set .* to False"):
        vh.actor_worker(cfg)
    cfg = h.ppo_config(model_dir, mode="R3")
    cfg.actor_rollout_ref.model.use_remove_padding = False
    with pytest.raises(ConfigurationError, match=r"use_remove_padding=True"):
        vh.actor_worker(cfg)


def test_a_failed_patch_and_an_untested_verl_raise_in_the_worker(
    model_dir: Any,
    megatron_verl_process: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rr_client.core.errors import UnsupportedVersionError
    from rr_client.integrations.verl import _patches
    from tests.verl import harness as vh
    from tests.verl_megatron import harness as h

    cfg = h.ppo_config(model_dir, mode="R3")
    # a failed patch of verl's Megatron engine module (as apply_patch records one): the worker refuses
    monkeypatch.setitem(_patches.FAILED, MODULE, "ShapeError: set_router_replay_data lost 'model'")
    with pytest.raises(UnsupportedVersionError, match=r"rr's feeder is not active.*lost 'model'.*mode=disabled"):
        vh.actor_worker(cfg)
    monkeypatch.delitem(_patches.FAILED, MODULE)
    # an untested verl (its version faked): nothing is patched but the worker's guard, which refuses Megatron R3
    import types

    from verl.workers.engine_workers import ActorRolloutRefWorker

    from rr_client.integrations import verl as rr_verl

    monkeypatch.setattr(rr_verl, "_turned_off", "verl 0.9.2")
    actions = rr_verl._actions()
    assert MODULE not in actions and _patches.WORKERS_MODULE in actions
    fresh = types.ModuleType("verl_0_9_2_engine_workers")  # a fresh worker class: the real one stays as patched
    built: list[bool] = []
    fresh.ActorRolloutRefWorker = type(
        "ActorRolloutRefWorker", (ActorRolloutRefWorker,), {"__init__": lambda self, config, role: built.append(True)}
    )
    actions[_patches.WORKERS_MODULE](fresh)
    with pytest.raises(UnsupportedVersionError, match=r"megatron.router_replay.mode=R3.*verl 0.9.2 is not a release"):
        fresh.ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    assert not built
    cfg.actor_rollout_ref.actor.megatron.router_replay.mode = "disabled"  # without replay the guard lets it build
    fresh.ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    assert built
    cfg.actor_rollout_ref.actor.megatron.router_replay.mode = "R3"
    # and when the engine module's patch failed, its fallback guard refuses at the engine's build
    mod = importlib.import_module(MODULE)
    orig = mod.MegatronEngine.initialize
    fake = type("E", (), {"engine_config": cfg.actor_rollout_ref.actor.megatron})()
    with pytest.raises(UnsupportedVersionError, match=r"rr's feeder is not active in this process: patch failed"):
        _patches._guard_megatron_initialize(orig, "patch failed")(fake)
