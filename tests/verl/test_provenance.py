"""verl's batch carries provenance (issue 44): what verl 0.9.1's rollout server returns per sample
(``num_cached_tokens`` from vLLM's ``RequestOutput``, ``min_global_steps`` / ``max_global_steps`` from its
fully-async partial rollouts) goes through verl's own agent-loop layout and trainer data steps into rr's engine,
which cuts the token segments by it and applies the stale-rows policy (``RR_STALE_ROWS``) before replaying.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rr_client.core.errors import StaleRoutingError
from tests.verl import harness as h
from tests.verl.test_fsdp_replay import MOE_LAYERS, SHAPES, assert_rows_ran, experts_seen, other_rows, sample_tokens

CACHED = [8, 0, 2, 4]  # prompt tokens vLLM served from its prefix cache, per sample (prompts: 12, 3, 5, 7)


def batch_with(tokenizer: Any, toks: Any, rows: Any, extra: list[dict[str, Any]]) -> Any:
    return h.agent_loop_batch(
        tokenizer,
        [
            dict(prompt_ids=p, response_ids=r, routed_experts=rows[i], extra_fields=extra[i])
            for i, (p, r) in enumerate(toks)
        ],
    )


@pytest.mark.parametrize(
    "rmpad,dyn",
    [(True, False), (False, False), (True, True)],
    ids=["remove_padding", "padded", "remove_padding-dynamic_bsz"],
)
def test_cached_tokens_cut_the_segments(workers: Any, tokenizer: Any, hf_model: Any, rmpad: bool, dyn: bool) -> None:
    """vLLM's per-sample cached count marks each sample's first rows cached prompt (dynamic batch size regroups
    the samples: their counts travel with them)."""
    toks = sample_tokens(1)
    rows = [h.own_routing(hf_model, p + r) for p, r in toks]
    extra = [{"num_cached_tokens": c, "global_steps": 7} for c in CACHED]
    cfg, w = workers[("R3", rmpad, dyn)]
    h.compute_log_prob(h.trainer(cfg, w), batch_with(tokenizer, toks, rows, extra))
    met = w.actor.engine.rr_last_metrics
    n_layers = len(MOE_LAYERS)
    assert met["r3/cached_prompt/replayed_rows"] == sum(CACHED) * n_layers
    assert met["r3/computed_prompt/replayed_rows"] == sum(p - c for (p, _), c in zip(SHAPES, CACHED)) * n_layers
    assert met["r3/generated/replayed_rows"] == sum(r - 1 for _, r in SHAPES) * n_layers
    assert met["r3/cached_tokens"] == sum(CACHED)
    assert met["r3/provenance_unknown"] == 0 and met["r3/stale_masked"] == 0
    assert met["r3/cached_prompt/agreement"] == 1.0


def test_without_verls_fields_provenance_is_counted_unknown(workers: Any, tokenizer: Any, hf_model: Any) -> None:
    toks = sample_tokens(1)
    rows = [h.own_routing(hf_model, p + r) for p, r in toks]
    cfg, w = workers[("R3", True)]
    h.compute_log_prob(h.trainer(cfg, w), batch_with(tokenizer, toks, rows, [{}] * len(toks)))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/provenance_unknown"] == len(toks) and met["r3/cached_prompt/replayed_rows"] == 0


def test_a_sample_spanning_weight_versions_is_refused(workers: Any, tokenizer: Any) -> None:
    """Default policy: a trajectory verl generated across two weight versions (its rows may have been recomputed
    under the new weights) stops the step, naming the setting; one generated under one version passes."""
    toks = sample_tokens(5)
    rows = [other_rows(len(p) + len(r) - 1, seed=i) for i, (p, r) in enumerate(toks)]
    same = [{"min_global_steps": 3, "max_global_steps": 3} for _ in toks]
    cfg, w = workers[("R3", True)]
    t = h.trainer(cfg, w)
    h.compute_log_prob(t, batch_with(tokenizer, toks, rows, same))
    assert w.actor.engine.rr_last_metrics["r3/spans_update"] == 0
    spans = [dict(e) for e in same]
    spans[3]["max_global_steps"] = 4
    with pytest.raises(StaleRoutingError, match=r"batch sample 1.*RR_STALE_ROWS=mask"):
        h.compute_log_prob(t, batch_with(tokenizer, toks, rows, spans))
    h.compute_log_prob(t, batch_with(tokenizer, toks, rows, same))  # the worker goes on
    assert w.actor.engine.rr_last_metrics["r3/applied_share"] == 1.0


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_mask_policy_leaves_the_stale_sample_to_the_router(
    model_dir: Any, verl_process: None, tokenizer: Any, hf_model: Any, rmpad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RR_STALE_ROWS=mask``: the spanning sample runs the model's own experts, the others exactly their rows."""
    monkeypatch.setenv("RR_STALE_ROWS", "mask")
    cfg = h.ppo_config(model_dir, mode="R3", remove_padding=rmpad)
    w = h.actor_worker(cfg)
    toks = sample_tokens(6)
    rows = [other_rows(len(p) + len(r) - 1, seed=20 + i) for i, (p, r) in enumerate(toks)]
    extra = [{"min_global_steps": 5, "max_global_steps": 5 + (i == 1)} for i in range(len(toks))]
    with experts_seen(w) as seen:
        h.compute_log_prob(h.trainer(cfg, w), batch_with(tokenizer, toks, rows, extra))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/stale_masked"] == 1
    assert met["r3/replayed_rows"] == sum(r.shape[0] for i, r in enumerate(rows) if i != 1) * len(MOE_LAYERS)
    expected = list(rows)
    expected[1] = h.own_routing(hf_model, toks[1][0] + toks[1][1])  # the router's own choice
    assert not np.array_equal(expected[1][:, MOE_LAYERS], rows[1][:, MOE_LAYERS])
    assert_rows_ran(seen, expected, [len(p) + len(r) for p, r in toks], rmpad)


def test_a_sample_the_source_audit_flagged_is_refused(workers: Any, tokenizer: Any) -> None:
    """A sample whose ``rr_provenance`` carries the source audit's flag (issue 57: the engine's own re-score of its
    tokens did not give its rows back) stops the step under the default policy, naming the audit; the worker goes on."""
    from rr_client.core.provenance import Provenance

    toks = sample_tokens(4)
    rows = [other_rows(len(p) + len(r) - 1, seed=40 + i) for i, (p, r) in enumerate(toks)]
    ok = Provenance(source_checked=True, source_agreement=1.0, weight_update_during=None).to_dict()
    bad = Provenance(source_checked=True, source_agreement=0.2, source_flagged=True, weight_update_during=None)
    extra = [{"rr_provenance": ok} for _ in toks]
    extra[2] = {"rr_provenance": bad.to_dict()}
    cfg, w = workers[("R3", True)]
    t = h.trainer(cfg, w)
    with pytest.raises(StaleRoutingError, match=r"batch sample \d+: the engine.s own re-score .*agreement 0\.200"):
        h.compute_log_prob(t, batch_with(tokenizer, toks, rows, extra))
    h.compute_log_prob(t, batch_with(tokenizer, toks, rows, [{"rr_provenance": ok} for _ in toks]))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/source/checked"] == len(toks) and met["r3/source/flagged"] == 0 and met["r3/applied_share"] == 1.0
