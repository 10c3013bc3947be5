"""rr's one row check inside rr's feeder on verl 0.9.1's own Megatron engine (issue 45).

rr's verl plugin puts its feeder in place of ``set_router_replay_data`` in verl's engine module at its import: R3's
rows pass rr's check before any router target is set. Malformed rows verl's own feeder passes to megatron-core (a
repeated id, a zero row between recorded ones) are refused with rr's typed errors naming the sample, token and
router; the same rows through verl's feeder (verl as shipped: rr's feeder taken off) run without a word, on experts
other than the rollout's. The stale-rows policy and rr's audit on the same path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from rr_client.core.errors import MissingRoutingError, UnrecordedRoutingError
from tests.verl_megatron.test_engine_replay import (
    EXPERTS,
    batch_of,
    per_sample,
    random_rows,
    run_log_prob,
    sample_tokens,
    workers,  # noqa: F401 - the module-scoped fixture
)

MODULE = "verl.workers.engine.megatron.transformer_impl"


@contextmanager
def verl_as_shipped() -> Iterator[None]:
    """rr's feeder taken off for the block (verl's own, as it ships), then put back."""
    import importlib

    from rr_client.core.patching import MARKER

    mod = importlib.import_module(MODULE)
    wrapped = mod.set_router_replay_data
    mod.set_router_replay_data = getattr(wrapped, MARKER)
    try:
        yield
    finally:
        mod.set_router_replay_data = wrapped


def test_rrs_feeder_is_in_verls_megatron_engine(workers: Any) -> None:  # noqa: F811
    import importlib

    from rr_client.core.patching import is_wrapped
    from rr_client.integrations import verl as rr_verl

    workers["R3"]  # verl's engine module imported (and patched) by the worker's build
    assert is_wrapped(importlib.import_module(MODULE), "set_router_replay_data")
    assert not rr_verl.failed_patches()


def test_a_repeated_expert_id_is_refused_where_verl_runs_it(workers: Any, tokenizer: Any) -> None:  # noqa: F811
    cfg, w = workers["R3"]
    toks = sample_tokens(4)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=30 + i) for i, n in enumerate(lengths)]
    rows[1][1, 0] = [3, 3]  # micro-batch 0, sample 1, token 1, layer 0: one expert twice
    with pytest.raises(
        UnrecordedRoutingError,
        match=r"decoder layer 1 \(chunk 0, decoder.layers.0.mlp.router\): a row repeats an expert id",
    ):
        run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    with verl_as_shipped():  # verl's feeder: no error, and that token runs one expert, not top-2
        _, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    ran = per_sample(seen.maps[1], lengths)[1][1]
    assert int(ran.sum()) == 1 and bool(ran[3])


def test_a_hole_in_the_rows_is_refused_where_verl_routes_it_to_expert_zero(
    workers: Any,  # noqa: F811
    tokenizer: Any,
) -> None:
    cfg, w = workers["R3"]
    toks = sample_tokens(5)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=40 + i) for i, n in enumerate(lengths)]
    rows[2][2] = 0  # micro-batch 1, sample 0: token 2's rows lost between recorded ones
    with pytest.raises(UnrecordedRoutingError, match=r"micro-batch sample 0 \(6 tokens\): token 2 has an all-zero"):
        run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    with verl_as_shipped():  # verl's feeder: the lost row replays as "expert 0, twice"
        _, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    ran = per_sample(seen.maps[1], lengths)[2][2]
    assert bool(ran[0]) and int(ran.sum()) < 2
    # the worker goes on after rr's refusal: well-formed rows replay
    rows[2][2] = random_rows(1, seed=99)[0]
    _, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    assert w.actor.engine.rr_last_metrics["r3/provenance_unknown"] == len(toks)  # verl's batch here carries none
    want = torch.zeros(EXPERTS, dtype=torch.bool)
    want[torch.as_tensor(rows[2][2, 0], dtype=torch.int64)] = True
    assert torch.equal(per_sample(seen.maps[1], lengths)[2][2], want)


def test_rows_that_stop_before_the_last_loss_token_are_refused(workers: Any, tokenizer: Any) -> None:  # noqa: F811
    """Early-stopping rows (a prefix, so the prefix rule passes) whose last tokens fall under verl's R3 replay mask:
    refused, where narrowing the mask would route them with pad rows under the loss."""
    cfg, w = workers["R3"]
    toks = sample_tokens(4)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=50 + i) for i, n in enumerate(lengths)]
    rows[1][-3:] = 0  # micro-batch 0, sample 1: the rollout's rows stop 3 tokens early
    want = rf"micro-batch sample 1 \({lengths[1]} tokens\): routed_experts has rows for its first {lengths[1] - 4}"
    with pytest.raises(MissingRoutingError, match=want):
        run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    rows[1][-3:] = random_rows(3, seed=98)  # whole rows replay: the worker goes on
    run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))


def batch_with(tokenizer: Any, toks: Any, rows: Any, extra: list[dict[str, Any]]) -> Any:
    from tests.verl import harness as vh

    return vh.agent_loop_batch(
        tokenizer,
        [
            dict(prompt_ids=p, response_ids=r, routed_experts=rows[i], extra_fields=extra[i])
            for i, (p, r) in enumerate(toks)
        ],
    )


def test_a_sample_spanning_weight_versions_is_refused(workers: Any, tokenizer: Any) -> None:  # noqa: F811
    """The stale-rows policy on verl's Megatron path (default refuse): a trajectory verl generated across two weight
    versions (``min_global_steps`` != ``max_global_steps``) stops the step, naming the setting."""
    from rr_client.core.errors import StaleRoutingError

    cfg, w = workers["R3"]
    toks = sample_tokens(6)
    rows = [random_rows(len(p) + len(r) - 1, seed=50 + i) for i, (p, r) in enumerate(toks)]
    extra = [{"min_global_steps": 2, "max_global_steps": 2 + (i == 3)} for i in range(len(toks))]
    with pytest.raises(StaleRoutingError, match=r"batch sample 1.*RR_STALE_ROWS=mask"):
        run_log_prob(cfg, w, batch_with(tokenizer, toks, rows, extra))


def test_mask_policy_routes_the_stale_sample_natively(
    workers: Any,  # noqa: F811
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RR_STALE_ROWS=mask``: verl's replay mask is off on the spanning sample's tokens, so they run the model's own
    experts (as with replay disabled); every other sample runs exactly its rows."""
    monkeypatch.setenv("RR_STALE_ROWS", "mask")
    cfg, w = workers["R3"]
    toks = sample_tokens(7)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=60 + i) for i, n in enumerate(lengths)]
    extra = [{"min_global_steps": 4, "max_global_steps": 4 + (i == 1)} for i in range(len(toks))]
    _, seen = run_log_prob(cfg, w, batch_with(tokenizer, toks, rows, extra))
    met = w.actor.engine.rr_last_metrics  # the step's policy counts (verl's step metrics carry them as actor/r3/...)
    assert met["r3/stale_masked"] == 1 and met["r3/provenance_unknown"] == 0 and met["r3/spans_update"] == 0
    cfg0, w0 = workers["disabled"]
    _, native = run_log_prob(cfg0, w0, batch_of(tokenizer, toks, None))
    for layer in (1, 2):
        got, own = per_sample(seen.maps[layer], lengths), per_sample(native.maps[layer], lengths)
        assert torch.equal(got[1], own[1]), f"layer {layer}: the masked sample did not route natively"
        for i in (0, 2, 3):
            want = torch.zeros(lengths[i] - 1, EXPERTS, dtype=torch.bool)
            want.scatter_(1, torch.as_tensor(rows[i][:, layer - 1], dtype=torch.int64), True)
            assert torch.equal(got[i][:-1], want), f"sample {i} layer {layer}"


def test_rrs_audit_counts_every_replayed_row_and_catches_a_replay_that_did_not_happen(
    workers: Any,  # noqa: F811
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rr's audit on verl's Megatron path (audited step): every replayed row ran its target experts. A router whose
    replay silently does nothing (verl #7340's failure, made here by taking verl's targets away in its routing)
    is a ReplayError naming the layer, not a step trained on the model's own routing."""
    from rr_client.core.errors import ReplayError

    monkeypatch.setenv("RR_AUDIT_EVERY", "1")
    cfg, w = workers["R3"]
    toks = sample_tokens(8)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=70 + i) for i, n in enumerate(lengths)]
    run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    met = w.actor.engine.rr_last_metrics
    assert met["r3/applied_share"] == 1.0 and met["r3/applied_share_min_layer"] == 1.0
    assert met["r3/agreement"] < 0.5  # random rows: the routers' own choice rarely matches them
    assert met["r3/replayed_rows"] == sum(n - 1 for n in lengths) * 2  # the last token's placeholder: not replayed
    router = next(
        m for m in w.actor.engine.module[0].modules() if type(m).__name__ == "TopKRouter" and m.layer_number == 2
    )
    replay = router.router_replay
    original = type(replay).get_replay_topk

    def forgets_its_targets(self: Any, scores: Any, topk: Any, *args: Any, **kwargs: Any) -> Any:
        if self is replay:  # layer 2's replay routes natively, as an orphan router would
            return kwargs["default_compute_topk"](
                scores, topk, num_groups=kwargs.get("num_groups"), group_topk=kwargs.get("group_topk")
            )
        return original(self, scores, topk, *args, **kwargs)

    monkeypatch.setattr(type(replay), "get_replay_topk", forgets_its_targets)
    with pytest.raises(ReplayError, match=r"layer 2 ran its replayed experts on \d+ of \d+"):
        run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
