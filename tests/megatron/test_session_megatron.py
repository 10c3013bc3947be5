"""One ``ReplaySession`` over Megatron's ``RouterReplay`` (issue 43): a Megatron loop (megatron-core's real
``GPTModel``, Megatron's own no-pipelining schedule) driven by ``MegatronSession`` (a ``ReplaySession``).

The stale-rows policy runs where the rows enter (``open_replay`` inside ``forward_step_func``), with no
``check_samples``: a sample its provenance says was recomputed across a weight update is refused before any router
runs, or with ``stale_rows="mask"`` runs on pad rows (Megatron replays every token) while the other sample replays its
own rows, counted. And the step's ``r3/`` keys (audit, log-prob gap, per-segment gap, provenance counts) are the
Hugging Face path's on the same rows: the same key set on audited and unaudited steps, equal gaps for the same
log-probs, equal replayed rows and provenance counts. What each router chose is read by the harness's own hooks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rr_client import StaleRoutingError
from rr_client.client._results import GenerateResult
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.integrations.megatron import MegatronSession
from rr_client.trainer import keys as K
from rr_client.trainer.layouts import RoutingTensors, to_tensors
from rr_client.trainer.provenance import build_segments, drop_samples
from rr_client.trainer.session import ReplaySession
from tests.megatron import harness as H

E, TOPK = 8, 2
PATTERN = (1, 0, 1)  # as tests/trainer/tiny_models' qwen3_moe: decoder layers 0 and 2 MoE, layer 1 dense
SHAPES = [(5, 3, 2), (4, 4, 0)]  # (prompt, output, cached prompt tokens) per sample: S tokens each
B, S = len(SHAPES), 8
STALE = Provenance(preemptions=1, weight_version_admitted=1, weight_version_finished=2)  # recomputed across it


@pytest.fixture()
def gpt(megatron_process: None) -> Any:
    """A fresh GPTModel with full recompute (the recomputes replay too)."""
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, num_experts=E, topk=TOPK, recompute=True))


def info() -> RRInfo:
    return RRInfo(
        engine="test",
        engine_version="0",
        rr_version="0",
        num_hidden_layers=len(PATTERN),
        num_experts=E,
        topk=TOPK,
        moe_layers=[i for i, m in enumerate(PATTERN) if m],
        wire_dtype="uint8",
        logprobs_mode="processed",
    )


def samples(provs: list[Provenance | None], seed: int = 0) -> list[GenerateResult]:
    """Rollout-like samples: distinct expert ids per MoE row (zeros at the dense layer), engine log-probs."""
    g = np.random.default_rng(seed)
    out = []
    for i, ((p_len, o_len, _), prov) in enumerate(zip(SHAPES, provs)):
        rows = H.random_rows(1, p_len + o_len - 1, len(PATTERN), E, TOPK, seed=seed * 10 + i)[0].numpy()
        rows[:, [j for j, m in enumerate(PATTERN) if not m]] = 0
        out.append(
            GenerateResult(
                index=i,
                prompt_index=i,
                prompt_ids=g.integers(1, H.VOCAB, p_len).tolist(),
                output_ids=g.integers(1, H.VOCAB, o_len).tolist(),
                text=None,
                finish_reason="length",
                routed_experts=rows.astype(np.uint8),
                routed_experts_start=0,
                meta={},
                logprobs=-g.random(o_len) * 2,
                logprobs_mode="processed",
                provenance=prov,
            )
        )
    return out


def batch(results: list[GenerateResult]) -> RoutingTensors:
    return to_tensors(results, info(), pad_side="right", pad_to=S)


def megatron_step(
    session: ReplaySession, model: Any, rt: RoutingTensors, seg: Any
) -> tuple[dict[str, float], torch.Tensor, Any]:
    """One training step through Megatron's schedule: the micro-batch fed by the session inside
    ``forward_step_func``; the loss weighs out the samples the policy masked. Returns the step's metrics, the
    trainer's log-probs (``[b, s]``, token t's at t) and the loss weights."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    got: dict[str, Any] = {}
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)

    def forward_step(data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        check = session.open_replay(mb, chunk=chunk, segments=seg)  # the stale-rows policy, then the routers
        labels = torch.roll(mb.input_ids, -1, dims=1)
        weight = drop_samples(torch.roll(mb.response_mask, -1, dims=1).float(), check.replay)
        per_token = chunk(mb.input_ids, position_ids, H.causal_mask(S), labels=labels)  # [b, s] NLL of token t+1
        got["logps"], got["weight"] = torch.roll(-per_token.detach(), 1, dims=1), weight
        return per_token, lambda o: ((o.float() * weight).sum() / weight.sum().clamp(min=1), {})

    with session.step() as met:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([rt]),
            model=[model],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
        session.add_gap(got["logps"], rt, rt.response_mask.bool(), segments=seg)
    return met, got["logps"], got["weight"]


def hf_step(session: ReplaySession, rt: RoutingTensors, seg: Any, logps: torch.Tensor) -> dict[str, float]:
    """The same step on the Hugging Face path: the same rows, the same log-probs into the gap."""
    with session.step() as met:
        session.open_replay(rt, segments=seg)
        session.model(rt.input_ids, attention_mask=rt.attention_mask).logits.float().logsumexp(-1).mean().backward()
        session.add_gap(logps, rt, rt.response_mask.bool(), segments=seg)
    return met


def test_a_stale_sample_is_refused_where_the_rows_enter(gpt: Any) -> None:
    """Default policy, no check_samples: StaleRoutingError from open_replay, before any router ran."""
    session = MegatronSession([gpt], audit_every=1)
    rt = batch(samples([Provenance(), STALE]))
    with H.hooked([gpt]) as choices, pytest.raises(StaleRoutingError, match="batch sample 1: .*stale_rows='mask'"):
        megatron_step(session, gpt, rt, build_segments(samples([Provenance(), STALE]), rt))
    assert not any(choices.calls.values())  # refused before the forward
    met, _, _ = megatron_step(session, gpt, batch(samples([Provenance(), None])), None)  # the session goes on
    assert met[K.APPLIED_SHARE] == 1.0 and met[K.STALE_MASKED] == 0 and met[K.PROVENANCE_UNKNOWN] == 1
    session.detach()


def test_mask_runs_the_stale_sample_on_pad_rows_out_of_the_loss(gpt: Any) -> None:
    """stale_rows='mask': sample 0 replays its rows, sample 1 (stale) runs on pad rows with zero loss weight."""
    session = MegatronSession([gpt], audit_every=1, stale_rows="mask")
    res = samples([Provenance(), STALE])
    rt = batch(res)
    with H.hooked([gpt]) as choices:
        met, _, weight = megatron_step(session, gpt, rt, build_segments(res, rt))
    session.detach()
    assert met[K.STALE_MASKED] == 1 and met[K.SPANS_UPDATE] == 0 and met[K.APPLIED_SHARE] == 1.0
    assert met[K.REPLAYED_ROWS] == (S - 1) * sum(PATTERN)  # sample 0's rows (all but its last token) only
    assert weight[1].sum() == 0 and weight[0].sum() > 0
    for router in choices.routers:
        layer = int(router.layer_number) - 1
        forward, recompute = choices.calls[router]
        for call in (forward, recompute):
            chosen = call.routing_map.view(S, B, E)  # sequence-first
            mine = rt.routed_experts[:, :, layer].long()
            for t in range(S - 1):
                assert chosen[t, 0].nonzero().flatten().tolist() == sorted(mine[0, t].tolist())
            other = [chosen[t, 1].nonzero().flatten().tolist() != sorted(mine[1, t].tolist()) for t in range(S - 1)]
            assert sum(other) >= (S - 1) // 2  # the stale sample's rows were not replayed: pads instead
            assert all(int(chosen[t, 1].sum()) == TOPK for t in range(S))  # K distinct pad experts per token


def test_the_keys_are_the_hugging_face_paths_on_the_same_rows(gpt: Any) -> None:
    """The same rows and log-probs through both backends, two steps at audit_every=2: the same key set (audit,
    gap, per-segment gap, provenance) on the audited and the unaudited step, equal gaps, replayed rows and counts."""
    from tests.trainer.tiny_models import tiny_model

    megatron = MegatronSession([gpt], audit_every=2, stale_rows="mask")
    hf = ReplaySession(tiny_model("qwen3_moe", 0), audit_every=2, stale_rows="mask")
    for step in range(2):
        cached = Provenance(
            cached_tokens=SHAPES[0][2],
            cache_tier="device",
            preemptions=0,
            weight_version_admitted=1,
            weight_version_finished=1,
        )
        res = samples([cached, STALE], seed=step)
        rt = batch(res)
        seg = build_segments(res, rt)
        mg, logps, _ = megatron_step(megatron, gpt, rt, seg)
        hf_met = hf_step(hf, rt, seg, logps)
        assert set(mg) == set(hf_met), (sorted(set(mg) ^ set(hf_met)), step)
        gap = [k for k in mg if k.endswith(("logp_diff", "k3_kl", "gt_ln2", "logp_tokens"))]
        assert K.MEAN_ABS_LOGP_DIFF in gap and K.segment("generated", "mean_abs_logp_diff") in gap
        for k in gap + [K.STALE_MASKED, K.SPANS_UPDATE, K.PROVENANCE_UNKNOWN, K.CACHED_TOKENS]:
            assert mg[k] == pytest.approx(hf_met[k], rel=1e-12), k
        assert mg[K.STALE_MASKED] == 1 and mg[K.CACHED_TOKENS] == SHAPES[0][2]
        if step == 0:
            assert mg[K.AUDITED] == hf_met[K.AUDITED] == 1.0
            assert mg[K.REPLAYED_ROWS] == hf_met[K.REPLAYED_ROWS] == (S - 1) * sum(PATTERN)
            assert mg[K.APPLIED_SHARE] == hf_met[K.APPLIED_SHARE] == 1.0
            assert mg[K.APPLIED_SHARE_MIN_LAYER] == hf_met[K.APPLIED_SHARE_MIN_LAYER] == 1.0  # the same merge
            # the audit per segment: sample 0's rows (sample 1 masked) by position, per MoE layer, on both paths
            want = {"cached_prompt": 2, "computed_prompt": 3, "generated": 2}
            for name, n in want.items():
                key = K.segment(name, "replayed_rows")
                assert mg[key] == hf_met[key] == n * sum(PATTERN), key
                assert K.segment(name, "agreement") in mg
            segs = [K.segment(n, "replayed_rows") for n in K.SEGMENTS]
            assert sum(mg[k] for k in segs) == mg[K.REPLAYED_ROWS]
            agree = sum(mg[k] * mg[k.replace("replayed_rows", "agreement")] for k in segs)
            assert agree == pytest.approx(mg[K.AGREEMENT] * mg[K.REPLAYED_ROWS])  # the same rows' verdicts
        else:
            assert K.AUDITED not in mg and K.APPLIED_SHARE not in mg  # unaudited: no audit claimed, on both
    megatron.detach()


def test_segment_agreement_counts_the_routers_own_choice_per_segment(gpt: Any) -> None:
    """Rows that are the model's own choice on the generated tokens only: agreement 1.0 there, and the other
    segments' agreement is their rows' own (random rows rarely agree)."""
    from rr_client.integrations.megatron import MegatronReplay

    res = samples([Provenance(), Provenance()])
    rt = batch(res)
    seg = build_segments(res, rt)
    replay = MegatronReplay([gpt], audit_every=1)
    own = record_own(gpt, rt)
    gen = seg.rows == 2  # the generated segment's rows
    rows = torch.where(gen[..., None, None], own.to(rt.routed_experts.dtype), rt.routed_experts)
    replay.set_micro_batch(replace(rt, routed_experts=rows), segments=seg)
    forward(gpt, rt).backward()
    met = replay.step_done()
    replay.close()
    assert met[K.segment("generated", "replayed_rows")] == int(gen.sum()) * sum(PATTERN)
    assert met[K.segment("generated", "agreement")] == 1.0
    assert met[K.segment("computed_prompt", "agreement")] < 1.0


def record_own(model: Any, rt: RoutingTensors) -> torch.Tensor:
    """The model's own ``[b, s, layers, k]`` choice on ``rt`` (R2's record; zeros at the dense layer)."""
    from rr_client.integrations.megatron import MegatronReplay

    rec = MegatronReplay([model], mode="R2")
    rec.record("mb", tokens=rt.input_ids)
    with torch.no_grad():
        forward(model, rt)
    out = torch.zeros(B, S, len(PATTERN), TOPK, dtype=torch.long)
    for router in H.routers(model):
        got = rec.lifecycle.records["mb"].rows[router].view(S, B, TOPK).transpose(0, 1)
        out[:, :, int(router.layer_number) - 1] = got.sort(-1).values
    rec.step_done(check=False)
    rec.close()
    return out


def forward(model: Any, rt: RoutingTensors) -> torch.Tensor:
    """GPTModel's forward with labels: the summed loss."""
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    return model(rt.input_ids, position_ids, H.causal_mask(S), labels=torch.roll(rt.input_ids, -1, 1)).sum()


@pytest.mark.parametrize("policy", ["refuse", "mask", "off"])
def test_a_bare_megatron_replay_applies_the_stale_rows_policy(gpt: Any, policy: str) -> None:
    """MegatronReplay without a session: the rows' own provenance under ``stale_rows`` (default "refuse"): refused
    before any router runs, masked (pad rows, out of the audit), or replayed as they are ("off")."""
    from rr_client.integrations.megatron import MegatronReplay

    rt = batch(samples([Provenance(), STALE]))
    kw: dict[str, Any] = {} if policy == "refuse" else {"stale_rows": policy}  # refuse: the default
    replay = MegatronReplay([gpt], audit_every=1, **kw)
    with H.hooked([gpt]) as choices:
        if policy == "refuse":
            with pytest.raises(StaleRoutingError, match="batch sample 1"):
                replay.set_micro_batch(rt)
            replay.close()
            assert not any(choices.calls.values())
            return
        replay.set_micro_batch(rt)
        forward(gpt, rt).backward()
        met = replay.step_done()
    replay.close()
    stale_rows = sum(PATTERN) * (S - 1)
    if policy == "mask":
        assert replay.last_check is not None and replay.last_check.replay == (True, False)
        assert met[K.REPLAYED_ROWS] == stale_rows  # sample 0 only: sample 1's tokens run on pad rows
    else:
        assert replay.last_check is None and met[K.REPLAYED_ROWS] == 2 * stale_rows
    for router in choices.routers:
        chosen = choices.calls[router][0].routing_map.view(S, B, E)
        mine = rt.routed_experts[1, :, int(router.layer_number) - 1].long()
        same = [chosen[t, 1].nonzero().flatten().tolist() == sorted(mine[t].tolist()) for t in range(S - 1)]
        assert all(same) if policy == "off" else sum(same) <= (S - 1) // 2


def test_a_session_policy_off_is_not_overruled_by_its_megatron_replay(gpt: Any) -> None:
    """The session applies the policy once: its inner MegatronReplay runs with the policy off, so
    ``stale_rows="off"`` on the session replays a stale sample's own rows (counted under spans_update)."""
    session = MegatronSession([gpt], audit_every=1, stale_rows="off")
    assert session.megatron_replay.stale_rows == "off"
    res = samples([Provenance(), STALE])
    rt = batch(res)
    met, _, weight = megatron_step(session, gpt, rt, build_segments(res, rt))
    session.detach()
    assert met[K.REPLAYED_ROWS] == 2 * (S - 1) * sum(PATTERN) and met[K.STALE_MASKED] == 0
    assert weight[1].sum() > 0
