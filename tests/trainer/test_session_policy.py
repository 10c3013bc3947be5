"""The stale-rows policy where rows enter a ReplaySession (issue 43), in a plain loop with no ``check_samples``.

``to_tensors`` / ``to_packed`` carry each sample's provenance with the rows; ``open_replay`` (and ``forward``) apply the
session's ``stale_rows`` to it: refused by default, masked (rows left to the router, counted), or off on purpose.
Rows without provenance (a raw tensor) pass and are noted as unknown; the same rows entering twice count once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from rr_client import StaleRoutingError
from rr_client.client._results import GenerateResult
from rr_client.core.errors import ShapeMismatchError
from rr_client.core.info import RRInfo
from rr_client.core.provenance import Provenance
from rr_client.trainer import keys as K
from rr_client.trainer.layouts import to_packed, to_tensors
from rr_client.trainer.session import ReplaySession

from .helpers import engine_result, recorded
from .tiny_models import VOCAB, tiny_config, tiny_model

SHAPES = [(7, 5), (6, 3)]  # (prompt, output) per sample
STALE = Provenance(preemptions=1, weight_version_admitted=1, weight_version_finished=2)  # recomputed across an update
MOE = 2  # MoE layers of the tiny qwen3_moe (0 and 2)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("qwen3_moe", 0)


@pytest.fixture(scope="module")
def info() -> RRInfo:
    return RRInfo.from_hf_config(tiny_config("qwen3_moe").to_dict(), engine="test", engine_version="0")


def samples(m: Any, provs: list[Provenance | None]) -> list[GenerateResult]:
    g = np.random.default_rng(0)
    out = []
    for i, ((p_len, o_len), prov) in enumerate(zip(SHAPES, provs)):
        p, o = g.integers(1, VOCAB, p_len).tolist(), g.integers(1, VOCAB, o_len).tolist()
        rows = recorded(m, torch.tensor([p + o]))[0].numpy()[:-1]
        out.append(engine_result(i, p, o, rows, provenance=prov))
    return out


def plain_step(session: ReplaySession, m: Any, rows: Any, input_ids: torch.Tensor, **kw: Any) -> dict[str, float]:
    """A plain loop's step: open_replay on the batch (no check_samples), forward, backward, flush."""
    with session.step() as met:
        session.open_replay(rows, **kw)
        m(input_ids).logits.float().logsumexp(-1).mean().backward()
    return met


def rows_of(i: int) -> int:
    return (sum(SHAPES[i]) - 1) * MOE


def test_the_policy_runs_by_default_where_the_rows_enter(model: Any, info: RRInfo) -> None:
    rt = to_tensors(samples(model, [Provenance(), STALE]), info, pad_side="right")
    session = ReplaySession(model, audit_every=1)
    with pytest.raises(StaleRoutingError, match="batch sample 1: .*stale_rows='mask'"):
        plain_step(session, model, rt, rt.input_ids)
    assert not session.is_open  # refused before the block opened
    with pytest.raises(StaleRoutingError, match="batch sample 1"), torch.no_grad(), session.forward(rt):
        pass  # the other entry: a forward without backward


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_mask_leaves_the_stale_sample_to_the_router_and_counts_it(model: Any, info: RRInfo, layout: str) -> None:
    res = samples(model, [STALE, None])
    session = ReplaySession(model, audit_every=1, stale_rows="mask")
    if layout == "padded":
        rt = to_tensors(res, info, pad_side="right")
        met = plain_step(session, model, rt, rt.input_ids)
    else:
        pk = to_packed(res, info)
        met = plain_step(session, model, pk, pk.input_ids[None], tokens=None)
    assert met[K.STALE_MASKED] == 1 and met[K.PROVENANCE_UNKNOWN] == 1 and met[K.SPANS_UPDATE] == 0
    assert met[K.REPLAYED_ROWS] == rows_of(1) and met[K.APPLIED_SHARE] == 1.0
    assert met[K.LEFT_ROWS] >= rows_of(0)  # every row of the stale sample left to the router


def test_off_is_explicit_and_replays_the_rows_as_they_are(model: Any, info: RRInfo) -> None:
    rt = to_tensors(samples(model, [Provenance(), STALE]), info, pad_side="right")
    met = plain_step(ReplaySession(model, audit_every=1, stale_rows="off"), model, rt, rt.input_ids)
    assert met[K.REPLAYED_ROWS] == rows_of(0) + rows_of(1) and met[K.STALE_MASKED] == 0
    assert met[K.SPANS_UPDATE] == 1  # still counted


def test_rows_without_provenance_pass_noted_and_count_once(model: Any, info: RRInfo) -> None:
    rt = to_tensors(samples(model, [Provenance(cached_tokens=3), Provenance(cached_tokens=2)]), info, pad_side="right")
    session = ReplaySession(model, audit_every=1)
    raw = plain_step(session, model, rt.routed_experts, rt.input_ids, mask=rt.routed_experts_mask)
    assert raw[K.PROVENANCE_UNKNOWN] == len(SHAPES) and raw[K.STALE_MASKED] == 0  # a raw tensor: noted unknown
    with session.step() as met:  # the same rows into the loss block and a reference forward: checked once
        session.open_replay(rt)
        with torch.no_grad(), session.forward(rt):
            model(rt.input_ids)
        model(rt.input_ids).logits.float().logsumexp(-1).mean().backward()
    assert met[K.PROVENANCE_UNKNOWN] == 0 and met[K.CACHED_TOKENS] == 5  # counted once
    half = dataclasses.replace(
        rt,
        **{
            f.name: getattr(rt, f.name)[:1]
            for f in dataclasses.fields(rt)
            if isinstance(getattr(rt, f.name), torch.Tensor)
        },
    )
    with pytest.raises(ShapeMismatchError, match="names 2 samples, the rows hold 1"):
        session.open_replay(half)  # cut into micro-batches without cutting its provenance
    session.abandon()


def test_a_masked_sample_is_out_of_the_gap(model: Any, info: RRInfo) -> None:
    """A sample the policy masked (its rows not replayed) leaves the step's log-prob gap and its segments' gaps
    (issue 56, item 2): a huge gap on it moves neither ``r3/mean_abs_logp_diff`` nor ``r3/k3_kl``; it is counted
    under ``r3/stale_masked``."""
    res = samples(model, [STALE, None])
    rt = to_tensors(res, info, pad_side="right")
    session = ReplaySession(model, audit_every=1, stale_rows="mask")
    with torch.no_grad():
        mine = model(rt.input_ids).logits.float().log_softmax(-1).amax(-1)  # any trainer log-probs
    engine = mine.clone()
    engine[0] -= 30.0  # the masked sample's engine log-probs: far off
    resp = rt.response_mask.bool()
    with session.step() as met:
        session.open_replay(rt)
        model(rt.input_ids).logits.float().logsumexp(-1).mean().backward()
        session.add_gap(mine, engine, resp)
    assert met[K.STALE_MASKED] == 1
    assert met[K.LOGP_TOKENS] == int(resp[1].sum()) and met[K.MEAN_ABS_LOGP_DIFF] == 0.0 and met[K.K3_KL] == 0.0
    off = ReplaySession(model, audit_every=1, stale_rows="off")  # every sample replayed: both in the gap
    with off.step() as both:
        off.open_replay(rt)
        model(rt.input_ids).logits.float().logsumexp(-1).mean().backward()
        off.add_gap(mine, engine, resp)
    assert both[K.LOGP_TOKENS] == int(resp.sum()) and both[K.MEAN_ABS_LOGP_DIFF] > 10
