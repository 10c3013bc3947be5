"""The stale-rows policy and the audit by token segment on a real transformers model (issue 38).

A planted stale prefix (the cached segment's rows taken from another model's router, as after a host-tier restore of
another weight version) moves the cached segment's agreement and nothing else's; samples whose provenance says they
may have been recomputed across a weight update are refused, or kept with replay off and counted."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rr_client import StaleRoutingError
from rr_client.client._results import GenerateResult
from rr_client.client.trajectory import Trajectory
from rr_client.core.errors import ConfigurationError, MalformedPayloadError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.trainer import keys as K
from rr_client.trainer.layouts import to_packed, to_tensors
from rr_client.trainer.metrics import token_logprobs
from rr_client.trainer.provenance import build_segments, mask_samples
from rr_client.trainer.session import ReplaySession

from .helpers import engine_result, recorded
from .tiny_models import VOCAB, tiny_config, tiny_model

SHAPES = [(16, 8, 10), (12, 6, 0)]  # (prompt, output, cached prompt tokens) per sample


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("qwen3_moe", 0)  # MoE layers 0 and 2


@pytest.fixture(scope="module")
def info() -> RRInfo:
    return RRInfo.from_hf_config(tiny_config("qwen3_moe").to_dict(), engine="test", engine_version="0")


def own(m: Any, seq: list[int]) -> np.ndarray:
    return recorded(m, torch.tensor([seq]))[0].numpy()


def samples(m: Any, stale_from: Any = None, provs: list[Provenance | None] | None = None) -> list[GenerateResult]:
    g = np.random.default_rng(0)
    out = []
    for i, (p_len, o_len, cached) in enumerate(SHAPES):
        p, o = g.integers(1, VOCAB, p_len).tolist(), g.integers(1, VOCAB, o_len).tolist()
        rows = own(m, p + o)[:-1]
        if stale_from is not None:
            rows[:cached] = own(stale_from, p + o)[:cached]
        prov = Provenance(
            cached_tokens=cached,
            cache_tier="host" if cached else None,
            preemptions=0,
            weight_version_admitted=1,
            weight_version_finished=1,
        )
        prov = provs[i] if provs is not None else prov
        out.append(engine_result(i, p, o, rows, meta={} if prov is None else {"rr_provenance": prov.to_dict()}))
    return out


def audited_step(m: Any, batch: list[GenerateResult], info: RRInfo, **kw: Any) -> dict[str, float]:
    session = ReplaySession(m, audit_every=1, **kw)
    rt = to_tensors(batch, info, pad_side="right")
    check = session.check_samples(batch)
    rt = mask_samples(rt, check.replay)
    seg = build_segments(batch, rt)
    with session.step() as met:
        session.open_replay(rt, segments=seg)
        logits = m(rt.input_ids, attention_mask=rt.attention_mask).logits
        logits.float().logsumexp(-1).mean().backward()
        mine = token_logprobs(logits.detach(), rt.input_ids)
        engine = mine + torch.where(torch.arange(mine.shape[1]) % 2 == 0, 0.25, 0.0)  # a known gap on even tokens
        session.add_gap(mine, engine, rt.response_mask.bool(), segments=seg)
    return met


def seg(name: str, metric: str = "agreement") -> str:
    return K.segment(name, metric)


def test_a_stale_cached_prefix_moves_only_the_cached_segments_agreement(model: Any, info: RRInfo) -> None:
    clean = audited_step(model, samples(model), info)
    stale = audited_step(model, samples(model, stale_from=tiny_model("qwen3_moe", 1)), info)
    assert clean[K.AGREEMENT] == 1.0 and all(clean[seg(s)] == 1.0 for s in K.SEGMENTS)
    cached_rows = SHAPES[0][2] * 2  # cached tokens x MoE layers
    assert clean[seg("cached_prompt", "replayed_rows")] == stale[seg("cached_prompt", "replayed_rows")] == cached_rows
    assert stale[seg("cached_prompt")] < 0.1  # the stale prefix stands out in its own segment ...
    assert stale[seg("computed_prompt")] == 1.0 and stale[seg("generated")] == 1.0  # ... and nowhere else
    assert stale[K.AGREEMENT] > 0.7  # while the whole-batch number hides most of it
    gen_tokens = sum(o for _, o, _ in SHAPES) - len(SHAPES)  # response tokens after the first (token_logprobs)
    assert stale[seg("generated", "logp_tokens")] == stale[K.LOGP_TOKENS] > 0
    assert stale[seg("generated", "mean_abs_logp_diff")] == pytest.approx(stale[K.MEAN_ABS_LOGP_DIFF])
    assert 0 < stale[K.MEAN_ABS_LOGP_DIFF] < 0.25 and gen_tokens > 0
    assert stale[K.CACHED_TOKENS] == SHAPES[0][2] and stale[K.STALE_MASKED] == 0 == stale[K.SPANS_UPDATE]
    # every token is in the first 8K: the depth bucket holds the whole gap, and no deeper bucket is reported
    assert stale[K.depth("0-8k", "logp_tokens")] == stale[K.LOGP_TOKENS]
    assert stale[K.depth("0-8k", "mean_abs_logp_diff")] == pytest.approx(stale[K.MEAN_ABS_LOGP_DIFF])
    assert not any(k.startswith("r3/depth/8-16k") for k in stale)


def test_refuse_names_the_sample_recomputed_across_an_update(model: Any, info: RRInfo) -> None:
    preempted = Provenance(preemptions=1, weight_version_admitted=1, weight_version_finished=2)
    batch = samples(model, provs=[Provenance(), preempted])
    with pytest.raises(StaleRoutingError, match="batch sample 1: .*preemptions 1.*stale_rows='mask'"):
        audited_step(model, batch, info)


def test_mask_keeps_the_sample_unreplayed_and_counts_it(model: Any, info: RRInfo) -> None:
    preempted = Provenance(preemptions=2, weight_version_admitted=1, weight_version_finished=2)
    batch = samples(model, provs=[preempted, None])
    met = audited_step(model, batch, info, stale_rows="mask")
    rows0 = (SHAPES[0][0] + SHAPES[0][1] - 1) * 2
    rows1 = (SHAPES[1][0] + SHAPES[1][1] - 1) * 2
    assert met[K.STALE_MASKED] == 1 and met[K.PROVENANCE_UNKNOWN] == 1 and met[K.SPANS_UPDATE] == 0
    # every row of sample 0 left to the router (and each sample's last token, which has no row)
    assert met[K.REPLAYED_ROWS] == rows1 and met[K.LEFT_ROWS] == rows0 + 2 * len(SHAPES)
    assert met[seg("cached_prompt", "replayed_rows")] == 0 and seg("cached_prompt") not in met


def test_spanning_an_update_without_a_recompute_is_kept_and_flagged(model: Any, info: RRInfo) -> None:
    spans = Provenance(preemptions=0, weight_version_admitted=1, weight_version_finished=2)
    met = audited_step(model, samples(model, provs=[spans, Provenance(preemptions=0)]), info)
    assert met[K.SPANS_UPDATE] == 1 and met[K.STALE_MASKED] == 0 and met[K.AGREEMENT] == 1.0
    unknown_preemptions = Provenance(preemptions=None, weight_update_during=True)
    with pytest.raises(StaleRoutingError, match="batch sample 0"):  # the engine did not say: may be recomputed
        audited_step(model, samples(model, provs=[unknown_preemptions, None]), info)


def test_cached_tokens_from_older_weights_are_refused_or_masked(model: Any, info: RRInfo) -> None:
    """A sample admitted after an update that hit prefix blocks computed before it (the server's cache was not
    cleared): its cached rows are the old weights' (``stale_from``); refused by default, masked and counted with
    ``mask``; the same flag without a cache hit changes nothing."""
    older = Provenance(cached_tokens=10, preemptions=0, weight_version_admitted=2, weight_version_finished=2,
                       cached_under_older_weights=True)  # fmt: skip
    no_hit = Provenance(cached_tokens=0, preemptions=0, weight_version_admitted=2, weight_version_finished=2,
                        cached_under_older_weights=True)  # fmt: skip
    stale_rows_batch = samples(model, stale_from=tiny_model("qwen3_moe", 1), provs=[older, no_hit])
    with pytest.raises(StaleRoutingError, match="batch sample 0: its 10 cached tokens may come from KV computed"):
        audited_step(model, stale_rows_batch, info)
    met = audited_step(model, stale_rows_batch, info, stale_rows="mask")
    assert met[K.STALE_MASKED] == 1 and met[K.AGREEMENT] == 1.0  # the old-weight rows are not replayed
    assert (
        Provenance.from_dict(older.to_dict()) == older and Provenance.from_dict(Provenance().to_dict()).stale is False
    )


def test_bad_policy_and_bad_provenance_are_typed_errors(model: Any, info: RRInfo) -> None:
    with pytest.raises(ConfigurationError, match="stale_rows='drop'"):
        ReplaySession(model, stale_rows="drop")  # type: ignore[arg-type]
    bad = samples(model)
    bad[0].meta["rr_provenance"] = {"schema": "rr.provenance/1", "cached_tokens": -3}
    with pytest.raises(MalformedPayloadError, match="sample 0: rr_provenance: cached_tokens"):
        ReplaySession(model).check_samples(bad)


def test_packed_batches_mask_and_segment_the_same_rows(model: Any, info: RRInfo) -> None:
    batch = samples(model)
    pk = to_packed(batch, info, append_row=False)
    sg = build_segments(batch, pk)
    assert tuple(sg.rows.shape) == tuple(pk.routed_experts_mask.shape)
    counts = torch.bincount(sg.rows[sg.rows >= 0], minlength=3).tolist()
    assert counts == [10, 6 + 12, 7 + 5]  # cached, computed prompt, generated rows (the last token has none)
    masked = mask_samples(pk, [True, False])
    assert int(masked.routed_experts_mask.sum()) == SHAPES[0][0] + SHAPES[0][1] - 1


def test_trajectory_turns_get_their_own_segments(info: RRInfo) -> None:
    traj = Trajectory(None, [5, 6, 7, 8])  # type: ignore[arg-type]  # turns taken as the client would hand them
    t0 = Provenance(cached_tokens=2)
    r0 = GenerateResult(
        0,
        0,
        [5, 6, 7, 8],
        [9, 10],
        None,
        "stop",
        np.zeros((5, 3, 2)),
        0,
        {"rr_provenance": t0.to_dict()},
        provenance=t0,
    )
    traj._take_turn(r0, 0)
    traj.extend([11, 12])
    t1 = Provenance(cached_tokens=6)  # the first turn's prompt and output came from the prefix cache
    r1 = GenerateResult(
        0,
        0,
        traj.input_ids,
        [13, 14, 15],
        None,
        "stop",
        np.zeros((5, 3, 2)),
        5,
        {"rr_provenance": t1.to_dict()},
        provenance=t1,
    )
    traj._take_turn(r1, 5)
    rt = to_tensors([traj], info, pad_side="right")
    sg = build_segments([traj], rt)
    names = [sg.key(c, "x") for c in range(len(sg.names))]
    assert names[:3] == ["r3/turn0/cached_prompt/x", "r3/turn0/computed_prompt/x", "r3/turn0/generated/x"]
    # turn 1's rows start at the first turn's last output token (prefilled in turn 1, from its cache here)
    assert sg.rows[0].tolist() == [0, 0, 1, 1, 2, 3, 4, 4, 5, 5, -1]
    assert sg.logps[0].tolist() == [-1, -1, -1, -1, 2, 2, -1, -1, 5, 5, 5]


def test_the_source_audits_verdict_is_refused_or_masked_by_the_session(model: Any, info: RRInfo) -> None:
    """A sample the source audit flags (its generated rows one token late against the model's own re-score) is
    refused by the session's door by default, masked with ``stale_rows="mask"``, and the step reports the audit
    under ``r3/source/...`` (per segment and depth); a sample it passes is replayed."""
    from rr_client.client.source_audit import SourceAudit

    batch = samples(model)
    audit = SourceAudit(1.0)
    judged = []
    for r in batch:
        rescored = own(model, r.prompt_ids + r.output_ids)  # the engine's rows for every token, from token 0
        served = r.routed_experts.copy()
        if r.index == 0:
            served[len(r.prompt_ids) + 1 :] = served[len(r.prompt_ids) : -1]  # decode rows one token late
        judged.append(audit.judge(replace(r, routed_experts=served), rescored, info))
    assert [bool(r.provenance.source_flagged) for r in judged] == [True, False]
    with pytest.raises(StaleRoutingError, match="batch sample 0: the engine's own re-score"):
        audited_step(model, judged, info)
    met = audited_step(model, judged, info, stale_rows="mask")
    assert met[K.SOURCE_CHECKED] == 2 and met[K.SOURCE_FLAGGED] == 1 == met[K.STALE_MASKED]
    assert met[K.source("agreement", "generated")] < 1.0 == met[K.source("agreement", "computed_prompt")]
    assert met[K.source("agreement", "depth_0-8k")] == met[K.source("agreement")] < 1.0
    assert met[K.AGREEMENT] == 1.0  # the flagged rows are not replayed


def test_the_gap_by_context_depth_shows_where_a_long_context_fault_starts(model: Any, info: RRInfo) -> None:
    """Log-probs that drift only past 8K tokens: the step's gap splits by depth bucket (``r3/depth/<bucket>/...``),
    the first 8K clean, the 8-16K bucket carrying the whole drift (built by build_segments, no forward needed)."""
    p_len, o_len = 8150, 100
    g = np.random.default_rng(3)
    sample = engine_result(0, g.integers(1, VOCAB, p_len).tolist(), g.integers(1, VOCAB, o_len).tolist(),
                           np.zeros((p_len + o_len - 1, 3, 2), dtype=np.uint8), meta={})  # fmt: skip
    n = p_len + o_len
    batch = type("B", (), {"attention_mask": torch.ones(1, n, dtype=torch.long)})()
    seg = build_segments([sample], batch)
    assert (
        seg.depths is not None
        and int((seg.depths == 0).sum()) == 8192 - p_len
        and int((seg.depths == 1).sum()) == n - 8192
    )
    engine = torch.zeros(1, n)
    mine = torch.where(torch.arange(n) >= 8192, 0.5, 0.0)[None]
    session = ReplaySession(model)
    session.add_gap(mine, engine, seg.logps >= 0, segments=seg)
    met = session.flush()
    assert met[K.depth("0-8k", "logp_tokens")] == 8192 - p_len and met[K.depth("0-8k", "mean_abs_logp_diff")] == 0
    assert met[K.depth("8-16k", "logp_tokens")] == n - 8192 and met[K.depth("8-16k", "mean_abs_logp_diff")] == 0.5
    assert met[K.segment("generated", "logp_tokens")] == o_len
