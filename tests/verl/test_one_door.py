"""verl's FSDP engine on the session's spine (issue 56), through verl's own worker and trainer data steps: the audit
runs per training step (every call of an audited step, its update calls included), each micro-batch's rows enter
through the session's one door (policy and check once), rows that stop before a sample's last loss token are
refused, and samples the stale-rows policy masks leave the log-prob gap.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from rr_client.core.errors import MissingRoutingError
from tests.verl import harness as h
from tests.verl.test_fsdp_replay import MOE_LAYERS, other_rows, sample_tokens


def batch_of(tokenizer: Any, samples: list[dict[str, Any]]) -> Any:
    return h.agent_loop_batch(tokenizer, samples)


def rows_for(toks: list[tuple[list[int], list[int]]], seed: int) -> list[np.ndarray]:
    return [other_rows(len(p) + len(r) - 1, seed=seed + i) for i, (p, r) in enumerate(toks)]


@pytest.mark.parametrize("marked", [True, False], ids=["lr_scheduler_mark", "no_mark"])
def test_audited_steps_include_their_update_calls(
    model_dir: Any, verl_process: None, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    """verl's default shape of a step: one log-prob call, then one update call per mini-batch (here 4: 5 engine
    calls a step). With ``RR_AUDIT_EVERY=5`` the first step is audited in all its calls, the second in none; an
    audit clock counting engine calls audited only the log-prob calls (calls 0 and 5). Without verl's
    ``update_lr_scheduler`` mark on the last mini-batch, the step still ends with ``train_mini_batch``'s
    ``train_mode`` block, not at the next step's first call."""
    monkeypatch.setenv("RR_AUDIT_EVERY", "5")
    cfg = h.ppo_config(model_dir, mode="R3", micro_batch=2, mini_batch=2)
    w = h.actor_worker(cfg)
    t = h.trainer(cfg, w)
    engine = w.actor.engine
    calls: list[bool] = []
    run = type(engine).forward_backward_batch

    def counted(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        calls.append(forward_only)
        if not marked:
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(data, update_lr_scheduler=False)
        return run(self, data, loss_function, forward_only)

    monkeypatch.setattr(type(engine), "forward_backward_batch", counted)
    toks = sample_tokens(7) + sample_tokens(8)  # 8 samples: 4 update mini-batches of 2
    seen = []
    for step in range(2):
        batch = batch_of(
            tokenizer,
            [
                dict(prompt_ids=p, response_ids=r, routed_experts=x)
                for (p, r), x in zip(toks, rows_for(toks, 10 * step))
            ],
        )
        batch = batch.union(h.compute_log_prob(t, batch))
        logprob_pass = dict(engine.rr_last_metrics)
        met = h.update_actor(t, batch)
        seen.append((logprob_pass, met))
        assert engine.rr_session.steps == step + 1  # one tick per training step, not per engine call
    assert calls == [True, False, False, False, False] * 2
    (lp0, up0), (lp1, up1) = seen
    assert lp0["r3/audited"] == 1.0 and lp0["r3/applied_share"] == 1.0
    assert up0["actor/r3/audited"] == [1.0] * 4, up0.get("actor/r3/audited")
    assert up0["actor/r3/applied_share"] == [1.0] * 4
    assert all(v > 0 for v in up0["actor/r3/replayed_rows"])
    # the second step runs unaudited in every call: no audit keys, the rows still replayed
    assert "r3/applied_share" not in lp1 or math.isnan(lp1["r3/applied_share"]), lp1
    assert all(math.isnan(v) for v in up1.get("actor/r3/applied_share", [math.nan])), up1
    assert up1.get("actor/r3/audited", [0.0] * 4) == [0.0] * 4


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_rows_that_stop_before_the_last_loss_token_are_refused(
    workers: Any, tokenizer: Any, hf_model: Any, rmpad: bool
) -> None:
    """Rows for 3 of a sample's 10 tokens pass the prefix rule, yet tokens 3..8 would route natively under the
    loss: refused naming the sample, its rows and its last loss token. Rows that stop after the last loss token
    (tool tokens the loss does not read) pass, and those tokens route with the model's own choice."""
    cfg, w = workers[("R3", rmpad)]
    t = h.trainer(cfg, w)
    toks = sample_tokens(9)
    toks[0] = (toks[0][0][:4], toks[0][1][:6])  # 4 + 6 = 10 tokens
    rows = rows_for(toks, 30)
    short = [r.copy() for r in rows]
    short[0][3:] = 0  # rows for the first 3 tokens only
    with pytest.raises(
        MissingRoutingError,
        match=r"micro-batch sample 0 \(10 tokens\): routed_experts has rows for its first 3 tokens, but its last "
        r"loss token \(response_mask\) is token 9",
    ):
        h.compute_log_prob(
            t,
            batch_of(
                tokenizer, [dict(prompt_ids=p, response_ids=r, routed_experts=x) for (p, r), x in zip(toks, short)]
            ),
        )
    # the loss reads responses 0..2 only (3..5: a tool's answer): rows for tokens 0..5 cover every token before
    # the last loss token (position 6)
    tool = [r.copy() for r in rows]
    tool[0][6:] = 0
    samples = [dict(prompt_ids=p, response_ids=r, routed_experts=x) for (p, r), x in zip(toks, tool)]
    samples[0]["response_mask"] = [1, 1, 1, 0, 0, 0]
    h.compute_log_prob(t, batch_of(tokenizer, samples))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/applied_share"] == 1.0
    n_rows = sum(len(p) + len(r) - 1 for p, r in toks) - 3
    assert met["r3/replayed_rows"] == n_rows * len(MOE_LAYERS)
    assert met["r3/left_rows"] == (len(toks) + 3) * len(MOE_LAYERS)


def test_each_micro_batch_is_policed_and_checked_once(
    workers: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's rows enter through the session's door: the stale-rows policy runs once per micro-batch (the session's
    own, not a copy beside it) and the rows' check once (not once in verl's conversion and again in the replay)."""
    import rr_client.trainer.provenance as prov_mod
    import rr_client.trainer.rows as rows_mod
    import rr_client.trainer.session as session_mod

    counts = {"door": 0, "policy": 0, "check": 0}

    def counting(mod: Any, name: str, key: str) -> None:
        fn = getattr(mod, name)

        def counted(*a: Any, **kw: Any) -> Any:
            counts[key] += 1
            return fn(*a, **kw)

        monkeypatch.setattr(mod, name, counted)

    counting(session_mod, "police_rows", "door")  # the session's own policy where rows enter
    counting(prov_mod, "check_provenance", "policy")  # any run of the policy, the session's or a copy beside it
    counting(rows_mod, "row_stats", "check")  # the rows' one check
    cfg, w = workers[("R3", True)]
    toks = sample_tokens(11)  # 4 samples: 2 micro-batches of 2
    samples = [dict(prompt_ids=p, response_ids=r, routed_experts=x) for (p, r), x in zip(toks, rows_for(toks, 40))]
    h.compute_log_prob(h.trainer(cfg, w), batch_of(tokenizer, samples))
    assert counts == {"door": 2, "policy": 2, "check": 2}
    assert w.actor.engine.rr_last_metrics["r3/provenance_unknown"] == len(toks)  # the session counted the policy


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_a_masked_sample_leaves_the_logprob_gap(
    model_dir: Any, verl_process: None, tokenizer: Any, rmpad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RR_STALE_ROWS=mask``: the sample spanning a weight update runs unreplayed, and its log-prob gap (here
    huge: its rollout log-probs are -60) is out of ``r3/mean_abs_logp_diff``, ``r3/k3_kl`` and the per-segment gap,
    which equal the gap over the other samples' response tokens."""
    monkeypatch.setenv("RR_STALE_ROWS", "mask")
    cfg = h.ppo_config(model_dir, mode="R3", remove_padding=rmpad)
    w = h.actor_worker(cfg)
    toks = sample_tokens(12)
    rollout = [[-60.0 if i == 1 else -2.0] * len(r) for i, (_, r) in enumerate(toks)]
    samples = [
        dict(
            prompt_ids=p,
            response_ids=r,
            routed_experts=x,
            response_logprobs=rollout[i],
            extra_fields={"min_global_steps": 5, "max_global_steps": 5 + (i == 1)},
        )
        for i, ((p, r), x) in enumerate(zip(toks, rows_for(toks, 50)))
    ]
    old = h.compute_log_prob(h.trainer(cfg, w), batch_of(tokenizer, samples))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/stale_masked"] == 1
    lp = old.batch["old_log_probs"].double()
    d = [lp[i, : len(r)] - rollout[i][0] for i, (_, r) in enumerate(toks) if i != 1]
    d_all = torch.cat(d)
    assert met["r3/logp_tokens"] == sum(len(r) for i, (_, r) in enumerate(toks) if i != 1)
    assert met["r3/mean_abs_logp_diff"] == pytest.approx(float(d_all.abs().mean()), rel=1e-6)
    assert met["r3/k3_kl"] == pytest.approx(float((torch.expm1(d_all) - d_all).mean()), rel=1e-6)
    assert met["r3/generated/mean_abs_logp_diff"] == pytest.approx(met["r3/mean_abs_logp_diff"], rel=1e-9)
    assert met["r3/mean_abs_logp_diff"] < 10  # the masked sample's gap (~58) would dominate it
