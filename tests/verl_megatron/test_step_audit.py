"""rr's audit clock, R2 audit, gap and refusals on verl 0.9.1's own Megatron engine (issue 56 items 2, 4, 8, 11).

- The audit clock counts training steps, not engine calls: verl's trainer step is one ``compute_log_prob`` call and
  ``ppo_epochs * mini-batches`` update calls (here 1 + 2 * 2 = 5, ``RayPPOTrainer._compute_old_log_prob`` and
  ``_update_actor`` through the worker), and every call of an audited step is audited, the update's too; R2 too.
- ``RR_STALE_ROWS=mask``: the masked sample is out of ``r3/mean_abs_logp_diff``.
- R2 with the rollout's rows is refused at the worker's start, naming both keys.

Stand-in (named, as in test_rr_feeder.py): megatron's CUDA-only optimizer (grads zeroed, no step).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests.verl_megatron.test_engine_replay import (
    batch_of,
    random_rows,
    sample_tokens,
    workers,  # noqa: F401 - the module-scoped fixture
)
from tests.verl_megatron.test_rr_check import batch_with
from tests.verl_megatron.test_rr_feeder import stand_in_optimizer

APPLIED = "r3/applied_share"


@pytest.fixture
def training(workers: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # noqa: F811
    """Build (mode) -> (trainer config with 2 mini-batches x 2 epochs, worker), its engine able to update, audit
    every 2nd step on a fresh clock; the forward-only engine config put back after."""
    from tests.verl import harness as vh

    monkeypatch.setenv("RR_AUDIT_EVERY", "2")
    made: list[Any] = []

    def make(mode: str) -> tuple[Any, Any]:
        cfg, w = workers[mode]
        cfg = copy.deepcopy(cfg)
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2  # 4 samples: 2 mini-batches
        cfg.actor_rollout_ref.actor.ppo_epochs = 2
        engine = w.actor.engine
        stand_in_optimizer(engine)
        object.__setattr__(w.actor.engine_config, "forward_only", False)
        engine.rr_clock = None  # a fresh clock: step 0 is audited
        made.append(w)
        return vh.trainer(cfg, w), w

    yield make
    for w in made:
        object.__setattr__(w.actor.engine_config, "forward_only", True)


def train_step(t: Any, w: Any, batch: Any, *, marked: bool = True) -> tuple[dict[str, float], list[float]]:
    """One trainer step (verl's old-log-prob pass, then its update): the log-prob call's ``r3/`` keys and the
    update calls' ``applied_share`` values (one per audited update call). ``marked=False``: verl's
    ``update_lr_scheduler`` mark taken off the last update call."""
    from tests.verl import harness as vh

    calls: list[bool] = []
    engine = w.actor.engine
    inner = type(engine).forward_backward_batch

    def counting(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        calls.append(forward_only)
        if not marked:
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(data, update_lr_scheduler=False)
        return inner(self, data, loss_function, forward_only)

    engine.forward_backward_batch = counting.__get__(engine)
    try:
        old = vh.compute_log_prob(t, batch)
        logprob = dict(engine.rr_last_metrics)
        met = vh.update_actor(t, batch.union(old))
    finally:
        del engine.forward_backward_batch
    assert calls == [True, False, False, False, False]  # verl's 5 engine calls of one step
    return logprob, list(met.get(f"actor/{APPLIED}", []))


# R3 without the mark runs before R2: an R3 audit after the R2 worker ran in the same process sees no R3 keys
# (two workers share one process only in these tests; not yet understood, see the closing note of issue 56)
@pytest.mark.parametrize(("mode", "marked"), [("R3", True), ("R3", False), ("R2", True)])
def test_audited_steps_include_their_update_calls(training: Any, tokenizer: Any, mode: str, marked: bool) -> None:
    """RR_AUDIT_EVERY=2 with 5 engine calls per step: steps 0 and 2 are audited in every call, the log-prob pass
    (R3's; R2's records, nothing to audit) and all 4 update calls; step 1 in none. verl Megatron R2 is audited.
    Without verl's last-mini-batch mark, each step still ends with its update (the engine's ``train_mode``)."""
    t, w = training(mode)
    toks = sample_tokens(21)
    rows = [random_rows(len(p) + len(r) - 1, seed=210 + i) for i, (p, r) in enumerate(toks)]
    batch = batch_of(tokenizer, toks, rows if mode == "R3" else None)
    for step in range(3):
        logprob, updates = train_step(t, w, batch, marked=marked)
        assert w.actor.engine.rr_clock.steps == step + 1
        audited = step % 2 == 0
        if mode == "R3":
            assert (APPLIED in logprob) == audited, (step, logprob)
        assert updates == ([1.0] * 4 if audited else []), (step, updates)
    assert w.actor.engine.rr_clock.steps == 3


def test_masked_samples_are_out_of_the_log_prob_gap(
    workers: Any,  # noqa: F811
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RR_STALE_ROWS=mask``: the spanning sample routes natively and leaves the gap. The rollout's log-probs are
    the replayed actor's own for the kept samples (gap 0) and far off for the masked one (which would dominate)."""
    from tests.verl import harness as vh

    monkeypatch.setenv("RR_STALE_ROWS", "mask")
    cfg, w = workers["R3"]
    toks = sample_tokens(22)
    rows = [random_rows(len(p) + len(r) - 1, seed=220 + i) for i, (p, r) in enumerate(toks)]
    fresh = [{"min_global_steps": 3, "max_global_steps": 3} for _ in toks]
    own = vh.compute_log_prob(vh.trainer(cfg, w), batch_with(tokenizer, toks, rows, fresh)).batch["old_log_probs"]
    logprobs = [own[i, : len(r)].tolist() for i, (_, r) in enumerate(toks)]
    logprobs[1] = [-30.0] * len(toks[1][1])  # the masked sample's: nothing like the actor's
    extra = [{"min_global_steps": 3, "max_global_steps": 3 + (i == 1)} for i in range(len(toks))]
    batch = vh.agent_loop_batch(
        tokenizer,
        [
            dict(
                prompt_ids=p,
                response_ids=r,
                routed_experts=rows[i],
                response_logprobs=logprobs[i],
                extra_fields=extra[i],
            )
            for i, (p, r) in enumerate(toks)
        ],
    )
    vh.compute_log_prob(vh.trainer(cfg, w), batch)
    met = w.actor.engine.rr_last_metrics
    assert met["r3/stale_masked"] == 1
    assert met["r3/mean_abs_logp_diff"] < 1e-3, met  # the masked sample's ~29 per token is not in it


def test_r2_with_the_rollouts_rows_is_refused(model_dir: Any, megatron_verl_process: None) -> None:
    from rr_client.core.errors import ConfigurationError
    from tests.verl import harness as vh
    from tests.verl_megatron import harness as h

    cfg = h.ppo_config(model_dir, mode="R2")
    cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    with pytest.raises(
        ConfigurationError,
        match=r"megatron.router_replay.mode=R2 with actor_rollout_ref.rollout.enable_rollout_routing_replay=True.*"
        r"mode=R3.*enable_rollout_routing_replay=False",
    ):
        vh.actor_worker(cfg)


def test_a_step_without_rows_reports_nan_not_one() -> None:
    """The audit's "no rows" is NaN (rr_client.trainer.audit.share), on verl's Megatron path too."""
    from rr_client.integrations.verl._megatron import RouterAudit

    audit = object.__new__(RouterAudit)
    audit.handles, audit.counts = [], {}
    assert audit.close() == {}
    import torch

    audit.counts = {1: torch.tensor([0, 0, 0])}
    assert math.isnan(audit.close()[APPLIED])


def test_the_policy_counts_each_micro_batch_once_over_vpp_chunks(
    workers: Any,  # noqa: F811
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every VPP chunk steps through the same micro-batches (megatron's interleaved schedule calls verl's
    ``forward_step`` once per chunk and micro-batch): the stale-rows counts are one per micro-batch, and each
    chunk's feeder call gets the samples kept. verl's real micro-batches (taken from a log-prob pass) go through
    rr's ``forward_step`` for two chunks tagged ``vp_stage`` 0 and 1 as megatron-core's VPP chunks are; the model
    forward behind it is left out (it is what test_rr_check.py runs)."""
    from types import SimpleNamespace

    from rr_client.integrations.verl._megatron import policed_step
    from rr_client.integrations.verl._megatron_feed import KEPT
    from rr_client.trainer.provenance import merge_checks, provenance_metrics
    from tests.verl import harness as vh

    monkeypatch.setenv("RR_STALE_ROWS", "mask")
    cfg, w = workers["R3"]
    engine = w.actor.engine
    toks = sample_tokens(23)
    rows = [random_rows(len(p) + len(r) - 1, seed=230 + i) for i, (p, r) in enumerate(toks)]
    extra = [{"min_global_steps": 1, "max_global_steps": 1 + (i == 1)} for i in range(len(toks))]
    taken: list[Any] = []
    step = type(engine).forward_step

    def taking(self: Any, batch_iter: Any, *args: Any, **kwargs: Any) -> Any:
        batch = next(batch_iter)
        taken.append(batch)
        return step(self, iter([batch]), *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(type(engine), "forward_step", taking)
        vh.compute_log_prob(vh.trainer(cfg, w), batch_with(tokenizer, toks, rows, extra))
    assert len(taken) == 2  # two micro-batches of 2
    fed: list[Any] = []
    rr_step = policed_step(lambda self, batch_iter, model, *a: fed.append(getattr(model, KEPT)) or next(batch_iter))
    chunks = [SimpleNamespace(vp_stage=0), SimpleNamespace(vp_stage=1)]
    engine._rr_checks = []
    try:
        for batch in taken:
            for chunk in chunks:
                rr_step(engine, iter([batch]), chunk, None, None)
        checks = engine._rr_checks
    finally:
        engine._rr_checks = None
    assert len(checks) == len(taken)  # once per micro-batch, not per chunk
    assert provenance_metrics(merge_checks(checks))["r3/stale_masked"] == 1
    assert fed == [(True, False), (True, False), None, None]  # both chunks' feeders: micro-batch 0's sample 1 off
    assert all(getattr(c, KEPT) is None for c in chunks)  # for that call only
