"""R3/R2 in verl 0.9.1's FSDP actor engine, through verl's own worker, agent-loop layout and trainer data steps.

Both of verl's paths are run: remove-padding (packed ``[1, N]``, verl's default) and padded (``[B, T]``). The
experts that ran are observed independently of rr's audit, by a hook on every MoE layer's experts module, and
compared token by token with the rows the test put under each token of verl's layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from rr_client.core.errors import (
    ConfigurationError,
    ExpertIdOutOfRangeError,
    MissingRoutingError,
    UnrecordedRoutingError,
)
from tests.verl import harness as h

MOE_LAYERS = [0, 2]
# (prompt, response) lengths: full-width, short, single-token response, and mid-size samples
SHAPES = [(12, 8), (3, 2), (5, 1), (7, 6)]


def sample_tokens(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = np.random.default_rng(seed)
    return [(g.integers(5, 60, p).tolist(), g.integers(5, 60, r).tolist()) for p, r in SHAPES]


def other_rows(n: int, seed: int) -> np.ndarray:
    """``[n, 3, 2]`` rows of distinct random experts on the MoE layers (zero on the dense layer 1)."""
    g = np.random.default_rng(seed)
    rows = np.zeros((n, 3, 2), dtype=np.int64)
    for layer in MOE_LAYERS:
        rows[:, layer] = np.stack([g.choice(8, 2, replace=False) for _ in range(n)])
    return rows


def batch_of(tokenizer: Any, toks: list[tuple[list[int], list[int]]], rows: list[np.ndarray] | None) -> Any:
    return h.agent_loop_batch(
        tokenizer,
        [
            dict(prompt_ids=p, response_ids=r, routed_experts=None if rows is None else rows[i])
            for i, (p, r) in enumerate(toks)
        ],
    )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@contextmanager
def experts_seen(worker: Any) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Every MoE layer's experts-module input ids (``[tokens, K]``) per forward, outside rr's audit. The
    gradient-checkpointing recompute in backward goes to ``seen["recompute", layer]``."""
    seen: dict[Any, list[torch.Tensor]] = {}
    model = worker.actor.engine.module
    handles = []
    for layer in MOE_LAYERS:
        experts = model.model.layers[layer].mlp.experts

        def pre(_m: Any, args: tuple[Any, ...], _l: int = layer) -> None:
            ids = next(a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point())
            seen.setdefault(("recompute", _l) if _in_backward() else _l, []).append(ids.detach().clone())

        handles.append(experts.register_forward_pre_hook(pre))
    try:
        yield seen
    finally:
        for hd in handles:
            hd.remove()


def per_sample(ids: list[torch.Tensor], lengths: list[int], rmpad: bool, micro: int = 2) -> list[torch.Tensor]:
    """Split the experts' inputs back per sample, from the sample lengths alone (verl keeps batch order, micro
    batches of ``micro`` samples): packed ``N (+pad)`` rows, or ``B x T`` right-padded rows."""
    out = []
    for mb, t in enumerate(ids):
        ls = lengths[mb * micro : (mb + 1) * micro]
        if rmpad:
            start = 0
            for n in ls:
                out.append(t[start : start + n])
                start += n
        else:
            width = t.shape[0] // len(ls)
            for j, n in enumerate(ls):
                out.append(t[j * width : j * width + n])
    return out


def assert_rows_ran(
    seen: dict[int, list[torch.Tensor]], rows: list[np.ndarray], lengths: list[int], rmpad: bool
) -> int:
    """Under every token that has a row, the experts that ran are exactly that row's (as sets); returns the count."""
    checked = 0
    for layer in MOE_LAYERS:
        got = per_sample(seen[layer], lengths, rmpad)
        assert len(got) == len(rows)
        for i, r in enumerate(rows):
            want = np.sort(r[:, layer], axis=-1)
            ran = np.sort(got[i][: r.shape[0]].numpy(), axis=-1)
            assert np.array_equal(ran, want), (
                f"sample {i} layer {layer}: experts ran {ran.tolist()} != rows {want.tolist()}"
            )
            checked += r.shape[0]
    return checked


@pytest.mark.parametrize(
    "rmpad,dyn",
    [(True, False), (False, False), (True, True)],
    ids=["remove_padding", "padded", "remove_padding-dynamic_bsz"],
)
def test_replaying_the_models_own_choice_reproduces_verls_log_probs(
    workers: Any, tokenizer: Any, hf_model: Any, rmpad: bool, dyn: bool
) -> None:
    """Bit-equal log-probs; with dynamic batch size verl regroups the samples, and the rows travel with them."""
    toks = sample_tokens(1)
    rows = [h.own_routing(hf_model, p + r) for p, r in toks]
    cfg, w = workers[("R3", rmpad, dyn)]
    replayed = h.compute_log_prob(h.trainer(cfg, w), batch_of(tokenizer, toks, rows))
    met = w.actor.engine.rr_last_metrics
    cfg0, w0 = workers[("disabled", rmpad, dyn)]
    native = h.compute_log_prob(h.trainer(cfg0, w0), batch_of(tokenizer, toks, None))
    assert not w0.actor.engine.rr_last_metrics  # disabled: verl's engine path, nothing replayed
    assert torch.equal(replayed.batch["old_log_probs"], native.batch["old_log_probs"])
    n_rows = sum(p + r - 1 for p, r in SHAPES) * len(MOE_LAYERS)
    assert met["r3/replayed_rows"] == n_rows
    # left to the model: each sample's last token (no row); pad positions of [B, T] count neither way, so both
    # layouts (and TRL's) report the same rows
    assert met["r3/left_rows"] == len(SHAPES) * len(MOE_LAYERS)
    assert met["r3/applied_share"] == 1.0 and met["r3/agreement"] == 1.0
    # the audit by token segment (issue 38): every prompt token's row is computed prompt (this batch carries no
    # provenance: nothing known cached), every generated token's but the last generated
    assert met["r3/computed_prompt/replayed_rows"] == sum(p for p, _ in SHAPES) * len(MOE_LAYERS)
    assert met["r3/generated/replayed_rows"] == sum(r - 1 for _, r in SHAPES) * len(MOE_LAYERS)
    assert met["r3/cached_prompt/replayed_rows"] == 0
    assert met["r3/computed_prompt/agreement"] == 1.0 and met["r3/generated/agreement"] == 1.0


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_replaying_other_rows_runs_exactly_those_experts(workers: Any, tokenizer: Any, rmpad: bool) -> None:
    toks = sample_tokens(2)
    rows = [other_rows(len(p) + len(r) - 1, seed=i) for i, (p, r) in enumerate(toks)]
    cfg, w = workers[("R3", rmpad)]
    with experts_seen(w) as seen:
        replayed = h.compute_log_prob(h.trainer(cfg, w), batch_of(tokenizer, toks, rows))
    met = w.actor.engine.rr_last_metrics
    checked = assert_rows_ran(seen, rows, [len(p) + len(r) for p, r in toks], rmpad)
    assert checked == met["r3/replayed_rows"]
    assert met["r3/applied_share"] == 1.0 and met["r3/applied_share_min_layer"] == 1.0
    assert met["r3/agreement"] < 0.5  # random rows: the model would have chosen otherwise
    cfg0, w0 = workers[("disabled", rmpad)]
    native = h.compute_log_prob(h.trainer(cfg0, w0), batch_of(tokenizer, toks, None))
    assert not torch.allclose(replayed.batch["old_log_probs"], native.batch["old_log_probs"])


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_update_with_replay_trains_the_router(model_dir: Any, verl_process: None, tokenizer: Any, rmpad: bool) -> None:
    cfg = h.ppo_config(model_dir, mode="R3", remove_padding=rmpad, lr=1e-2)
    w = h.actor_worker(cfg)
    t = h.trainer(cfg, w)
    toks = sample_tokens(3)
    rows = [other_rows(len(p) + len(r) - 1, seed=10 + i) for i, (p, r) in enumerate(toks)]
    batch = batch_of(tokenizer, toks, rows)
    batch = batch.union(h.compute_log_prob(t, batch))
    model = w.actor.engine.module
    gates = {layer: model.model.layers[layer].mlp.gate.weight for layer in MOE_LAYERS}
    before = {k: v.full_tensor().detach().clone() for k, v in gates.items()}
    grads: dict[int, float] = {}
    hooks = [
        p.register_post_accumulate_grad_hook(
            lambda p, _l=layer: grads.__setitem__(_l, float(p.grad.full_tensor().norm()))
        )
        for layer, p in gates.items()
    ]
    with experts_seen(w) as seen:
        met = h.update_actor(t, batch)
    for hd in hooks:
        hd.remove()
    assert all(math.isfinite(x) for x in met["actor/pg_loss"])
    assert set(grads) == set(MOE_LAYERS) and all(g > 0 for g in grads.values()), grads
    for layer in MOE_LAYERS:
        assert not torch.equal(before[layer], gates[layer].full_tensor().detach())
    assert met["actor/r3/applied_share"] == [1.0]
    assert met["actor/r3/replayed_rows"] == [sum(r.shape[0] for r in rows) * len(MOE_LAYERS)]
    assert met["actor/r3/generated/replayed_rows"] == [sum(len(r) - 1 for _, r in toks) * len(MOE_LAYERS)]
    assert "actor/r3/computed_prompt/agreement" in met and "actor/r3/cached_prompt/replayed_rows" in met
    assert_rows_ran(seen, rows, [len(p) + len(r) for p, r in toks], rmpad)
    # verl's default gradient checkpointing re-ran every MoE forward in backward, with the same replayed experts
    assert w.actor.engine.module.model.gradient_checkpointing
    for layer in MOE_LAYERS:
        again = seen[("recompute", layer)]
        assert len(again) == len(seen[layer])
        assert all(any(torch.equal(a, f) for f in seen[layer]) for a in again)


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_r2_records_in_the_log_prob_pass_and_replays_in_the_update(
    workers: Any, tokenizer: Any, hf_model: Any, rmpad: bool
) -> None:
    cfg, w = workers[("R2", rmpad)]
    t = h.trainer(cfg, w)
    toks = sample_tokens(4)
    batch = batch_of(tokenizer, toks, None)
    old = h.compute_log_prob(t, batch)
    rec = old.batch["routed_experts"]  # what verl's trainer unions into the batch for the update
    assert rec.is_nested and rec.dtype == torch.int16
    for i, (p, r) in enumerate(toks):  # every token, the last included: the trainer's own choice
        own = h.own_routing(hf_model, p + r + [5])  # one extra token: rows for all len(p + r) positions
        got = rec[i].numpy()
        assert got.shape == own.shape
        for layer in MOE_LAYERS:
            assert np.array_equal(np.sort(got[:, layer], -1), np.sort(own[:, layer], -1)), (i, layer)
        assert not got[:, 1].any()  # dense layer
    batch = batch.union(old)
    with experts_seen(w) as seen:
        met = h.update_actor(t, batch)
    assert met["actor/r3/applied_share"] == [1.0] and met["actor/r3/agreement"] == [1.0]
    assert_rows_ran(seen, [rec[i].numpy() for i in range(len(toks))], [len(p) + len(r) for p, r in toks], rmpad)


def test_refusals(workers: Any, tokenizer: Any, model_dir: Any) -> None:
    cfg, w = workers[("R3", True)]
    t = h.trainer(cfg, w)
    toks = sample_tokens(5)
    with pytest.raises(MissingRoutingError, match="enable_rollout_routing_replay"):
        h.compute_log_prob(t, batch_of(tokenizer, toks, None))
    rows = [other_rows(len(p) + len(r) - 1, seed=i) for i, (p, r) in enumerate(toks)]
    holed = [r.copy() for r in rows]
    holed[2][1] = 0  # a lost row between recorded ones
    with pytest.raises(UnrecordedRoutingError, match=r"micro-batch sample 0 \(6 tokens\): token 1 has an all-zero"):
        h.compute_log_prob(t, batch_of(tokenizer, toks, holed))
    bad = [r.copy() for r in rows]
    bad[0][3, 0] = [1, 9]
    with pytest.raises(ExpertIdOutOfRangeError, match=r"\[0, 8\)"):
        h.compute_log_prob(t, batch_of(tokenizer, toks, bad))
    empty = [r.copy() for r in rows]
    empty[3][:] = 0
    with pytest.raises(MissingRoutingError, match="micro-batch sample 1 carries no routing rows"):
        h.compute_log_prob(t, batch_of(tokenizer, toks, empty))
    # the worker is still usable after each refusal
    h.compute_log_prob(t, batch_of(tokenizer, toks, rows))
    assert w.actor.engine.rr_last_metrics["r3/applied_share"] == 1.0
    sp = h.ppo_config(model_dir, mode="R3")
    sp.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size = 2
    with pytest.raises(ConfigurationError, match="ulysses_sequence_parallel_size=2"):
        h.actor_worker(sp)


def test_worker_turns_replay_on_for_fsdp(workers: Any) -> None:
    """verl forces replay "disabled" for every strategy but megatron/veomni; with rr its fsdp2 setting counts, and
    rr's engine is registered through verl's ``EngineRegistry.register`` under this process's (device, vendor)."""
    assert workers[("R3", True)][1].enable_routing_replay is True
    assert workers[("disabled", True)][1].enable_routing_replay is False
    from rr_client.core.patching import is_wrapped
    from rr_client.integrations import verl as rr_verl
    from rr_client.integrations.verl._engine import RRFSDPEngineMixin
    from rr_client.integrations.verl._patches import use_rr_engine

    assert rr_verl.installed() and not rr_verl.failed_patches()  # by verl's own plugin loader (the rr entry point)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert is_wrapped(ActorRolloutRefWorker, "__init__")
    ours = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert ours.__name__ == "RRFSDPEngineWithLMHead" and ours.__bases__ == (RRFSDPEngineMixin, FSDPEngineWithLMHead)
    engines = dict(EngineRegistry._engines["language_model"]["fsdp2"])
    assert engines["cuda"] is FSDPEngineWithLMHead  # verl's own registration is left as it is
    init = ActorRolloutRefWorker.__init__
    rr_verl.install()  # re-entrant: nothing is wrapped or registered twice
    assert use_rr_engine("fsdp2") is ours  # a second R3 worker in this process registers nothing
    assert ActorRolloutRefWorker.__init__ is init and EngineRegistry._engines["language_model"]["fsdp2"] == engines
