"""ReplaySession: the lifecycle every trainer drives (open until backward, audit every N steps, merged metrics)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from rr_client import ConfigurationError, ReplayError
from rr_client.trainer import keys as K
from rr_client.trainer.audit import AuditClock
from rr_client.trainer.metrics import r3_metrics, token_logprobs
from rr_client.trainer.session import ReplaySession, merge_indexer_reports, merge_reports

from .helpers import LOGPROBS_INFO, LogprobsSample, random_routing, recorded, token_ids
from .tiny_models import VOCAB, tiny_model

B, T = 2, 6


@pytest.fixture()
def qwen() -> Any:
    return tiny_model("qwen3_moe")  # MoE layers 0 and 2


def batch(seed: int) -> torch.Tensor:
    return token_ids(VOCAB, B, T, seed)


own = recorded


def other(seed: int) -> torch.Tensor:
    return random_routing(seed, B, T, dense=(1,))


def step(session: ReplaySession, model: Any, x: torch.Tensor, rows: torch.Tensor, mask: Any = None) -> dict[str, float]:
    with session.step() as met:
        session.open_replay(rows, mask)
        model(x).logits.float().logsumexp(-1).mean().backward()
    return met


def test_audit_runs_on_the_first_step_then_every_nth(qwen: Any) -> None:
    session = ReplaySession(qwen, audit_every=3)
    x = batch(1)
    rows = own(qwen, x)
    audited = [bool(step(session, qwen, x, rows).get(K.AUDITED)) for _ in range(7)]
    assert audited == [True, False, False, True, False, False, True]
    assert session.steps == 7
    never = ReplaySession(qwen, audit_every=0)
    met = step(never, qwen, x, rows)
    counts = (K.STALE_MASKED, K.SPANS_UPDATE, K.PROVENANCE_UNKNOWN, K.CACHED_TOKENS)
    assert {k: v for k, v in met.items() if k not in counts} == {}  # nothing measured, nothing claimed ...
    assert met[K.PROVENANCE_UNKNOWN] == B  # ... but raw rows are noted by the stale-rows policy: no provenance


def test_merged_metrics_worst_share_weighted_agreement(qwen: Any) -> None:
    """Two micro-batches in one step: rows and forwards summed, agreement weighted by replayed rows."""
    session = ReplaySession(qwen, audit_every=1, log_layers=True)
    x1, x2 = batch(1), batch(2)
    with session.step() as met:
        session.open_replay(own(qwen, x1))  # the model's own choice: agreement 1
        qwen(x1).logits.sum().backward()
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[0] = True  # half the rows replayed with other experts, the rest the model's own
        session.open_replay(other(5), mask)
        qwen(x2).logits.sum().backward()
    rows1, rows2 = 2 * B * T, 2 * T  # MoE layers x replayed tokens
    assert met[K.REPLAYED_ROWS] == rows1 + rows2 and met[K.LEFT_ROWS] == 2 * T
    assert met[K.FORWARDS] == 2 and met[K.MOE_LAYERS] == 2
    assert met[K.APPLIED_SHARE] == 1.0 and met[K.APPLIED_SHARE_MIN_LAYER] == 1.0
    # the second block's agreement is low (other experts); the step's is weighted by rows, not a mean of means
    assert met[K.AGREEMENT] < 1.0
    second = (met[K.AGREEMENT] * (rows1 + rows2) - rows1) / rows2
    assert 0.0 <= second < 0.5
    assert met[K.layer(0, "replayed_rows")] == B * T + T and K.layer(1, "replayed_rows") not in met


def test_gaps_are_token_weighted_over_the_step(qwen: Any) -> None:
    """Two micro-batches of 1 and 9 tokens: the step's gap is the token-weighted mean (= one r3_metrics call)."""
    session = ReplaySession(qwen, audit_every=0)
    a_tr, a_en = torch.tensor([[-1.0]]), torch.tensor([[-3.0]])
    b_tr, b_en = torch.full((1, 9), -1.0), torch.full((1, 9), -1.5)
    with session.step() as met:
        session.add_gap(a_tr, a_en)
        session.add_gap(b_tr, b_en)
    whole = r3_metrics(torch.cat([a_tr, b_tr], 1), torch.cat([a_en, b_en], 1))
    assert met[K.LOGP_TOKENS] == 10
    assert met[K.MEAN_ABS_LOGP_DIFF] == pytest.approx(whole.mean_abs_diff) == pytest.approx((2.0 + 9 * 0.5) / 10)
    assert met[K.K3_KL] == pytest.approx(whole.k3_kl) and met[K.FRAC_ABS_DIFF_GT_LN2] == pytest.approx(0.1)
    with pytest.raises(ReplayError, match="non-finite"):
        with session.step():
            session.add_gap(torch.tensor([[float("nan")]]), torch.tensor([[0.0]]))


def test_block_stays_open_until_backward_with_checkpointing(qwen: Any) -> None:
    """Non-reentrant checkpointing re-runs the forward in backward: it runs replayed (the block is still open),
    so the gradients equal those of an uncheckpointed replayed step."""
    x, rows = batch(3), other(9)

    def grads(ckpt: bool) -> dict[str, torch.Tensor]:
        model = tiny_model("qwen3_moe")
        session = ReplaySession(model, audit_every=1)
        with session.step() as met:
            session.open_replay(rows)
            if ckpt:
                logits = checkpoint(lambda t: model(t).logits, x, use_reentrant=False)
            else:
                logits = model(x).logits
            logits.float().logsumexp(-1).mean().backward()
        assert met[K.APPLIED_SHARE] == 1.0
        assert met[K.FORWARDS] == 1  # forwards, not recomputes
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-6), n


def test_scoped_forward_leaves_the_open_block_alone(qwen: Any) -> None:
    session = ReplaySession(qwen, audit_every=1)
    x = batch(4)
    rows = own(qwen, x)
    with session.step() as met:
        session.open_replay(rows)
        loss = qwen(x).logits.sum()
        with torch.no_grad(), session.forward(rows):  # e.g. a reference forward before backward
            qwen(x)
        assert session.is_open
        loss.backward()
    assert met[K.FORWARDS] == 3 and not session.is_open  # the open block saw both forwards, the scoped one its own


def test_recording_measures_agreement_over_moe_layers(qwen: Any) -> None:
    session = ReplaySession(qwen, audit_every=0, moe_layers=[0, 2])
    x = batch(5)
    with session.step() as met:
        with torch.no_grad(), session.recording(own(qwen, x)):
            qwen(x)
    assert met[K.AGREEMENT] == 1.0
    with session.step() as met:
        with torch.no_grad(), session.recording(other(3)):
            qwen(x)
    assert met[K.AGREEMENT] < 0.5


def test_an_error_abandons_the_step(qwen: Any) -> None:
    session = ReplaySession(qwen, audit_every=1)
    x = batch(6)
    with pytest.raises(RuntimeError, match="boom"):
        with session.step():
            session.open_replay(own(qwen, x))
            qwen(x)
            raise RuntimeError("boom")
    assert not session.is_open and session.steps == 0
    assert step(session, qwen, x, own(qwen, x))[K.FORWARDS] == 1  # the next step starts clean


def test_a_replay_that_did_not_take_effect_raises_at_flush(qwen: Any) -> None:
    session = ReplaySession(qwen, audit_every=1)
    with pytest.raises(ReplayError, match="no forward"):
        with session.step():
            session.open_replay(own(qwen, batch(7)))  # no forward ran under the audit


def test_one_audit_clock_ticked_by_a_refused_step_too(qwen: Any) -> None:
    """The session's audit clock is the spine's AuditClock, and a step its verdict refuses at flush still counts:
    the next step is the second one (not audited at audit_every=2), as on Megatron, whose step was counted."""
    session = ReplaySession(qwen, audit_every=2)
    assert isinstance(session.clock, AuditClock) and session.clock.audited
    with pytest.raises(ReplayError, match="no forward"):
        with session.step():
            session.open_replay(own(qwen, batch(7)))  # no forward ran under the audit: refused at flush
    assert session.clock.steps == session.steps == 1 and not session.clock.audited
    x = batch(8)
    assert K.AUDITED not in step(session, qwen, x, own(qwen, x))  # the second step: not audited
    assert step(session, qwen, x, own(qwen, x))[K.AUDITED] == 1.0


def test_flush_keeps_the_blocks_own_keys(qwen: Any) -> None:
    """The step's report keeps what each block counted beside the shares (issue 56, item 11): orphan routers,
    unconsumed layers, routers left (hash-routed, outside the decoder), the worst block's."""
    session = ReplaySession(qwen, audit_every=1)
    x = batch(9)
    met = step(session, qwen, x, own(qwen, x))
    for k in (K.ORPHAN_ROUTERS, K.UNCONSUMED_LAYERS, K.LEFT_LAYERS_HASH, K.LEFT_ROUTERS_OUTSIDE_DECODER):
        assert met[k] == 0.0, k
    a = {K.FORWARDS: 1.0, K.REPLAYED_ROWS: 4.0, K.APPLIED_SHARE: 1.0, K.AGREEMENT: 1.0, K.ORPHAN_ROUTERS: 0.0}
    assert merge_reports([a, {**a, K.ORPHAN_ROUTERS: 2.0}])[K.ORPHAN_ROUTERS] == 2.0


def test_no_rows_means_nan_for_routers_and_indexers_alike() -> None:
    """A share over zero rows is NaN on every merge (it was 1.0 for the indexer's agreement), and a block without
    rows never hides another block's share, whatever their order."""
    empty = {
        K.INDEXER_LAYERS: 1.0,
        K.INDEXER_REPLAYED_ROWS: 0.0,
        K.INDEXER_APPLIED_SHARE: math.nan,
        K.INDEXER_AGREEMENT: math.nan,
    }
    m = merge_indexer_reports([empty])
    assert math.isnan(m[K.INDEXER_AGREEMENT]) and math.isnan(m[K.INDEXER_APPLIED_SHARE])
    half = {**empty, K.INDEXER_REPLAYED_ROWS: 4.0, K.INDEXER_APPLIED_SHARE: 0.5, K.INDEXER_AGREEMENT: 0.5}
    for order in ([empty, half], [half, empty]):
        m = merge_indexer_reports(order)
        assert m[K.INDEXER_APPLIED_SHARE] == 0.5 and m[K.INDEXER_AGREEMENT] == 0.5, order


def test_bad_settings_are_refused(qwen: Any) -> None:
    with pytest.raises(ConfigurationError):
        ReplaySession(qwen, audit_every=-1)
    with pytest.raises(ConfigurationError):
        ReplaySession(qwen, check_every=0)


def test_merge_reports_of_nothing_is_empty() -> None:
    assert merge_reports([]) == {} and merge_reports([{}]) == {}
    r = {
        K.FORWARDS: 1.0,
        K.REPLAYED_ROWS: 0.0,
        K.LEFT_ROWS: 4.0,
        K.MOE_LAYERS: 2.0,
        K.APPLIED_SHARE: math.nan,
        K.AGREEMENT: math.nan,
    }
    m = merge_reports([r])
    assert math.isnan(m[K.APPLIED_SHARE]) and math.isnan(m[K.AGREEMENT]) and m[K.LEFT_ROWS] == 4.0


def test_token_logprobs_gap_with_replay_is_zero_on_the_models_own_choice(qwen: Any) -> None:
    """A plain loop's measurement: replaying the model's own choice leaves its log-probs unchanged (gap 0)."""
    session = ReplaySession(qwen, audit_every=1)
    x = batch(8)
    with torch.no_grad():
        ref = token_logprobs(qwen(x).logits.float(), x)
    with session.step() as met:
        session.open_replay(own(qwen, x))
        lp = token_logprobs(qwen(x).logits.float(), x)
        session.add_gap(lp, ref)
        lp.sum().backward()
    assert met[K.MEAN_ABS_LOGP_DIFF] < 1e-6 and met[K.AGREEMENT] == 1.0


def test_add_gap_refuses_pre_temperature_logprobs_at_another_temperature(qwen: Any) -> None:
    """The engine's log-probs before temperature (vLLM raw_logprobs) or of unknown mode are refused at T != 1
    (LogprobsModeError naming the flag), never turned into a gap; after temperature (or at T = 1) they are
    measured, taken from a layout's ``logprobs`` beside its tokens."""
    from rr_client import LogprobsModeError, to_tensors

    trainer = torch.tensor([[0.0, -9.0, -0.5, -1.0, -1.5]])
    session = ReplaySession(qwen, audit_every=0)
    for mode in ("raw", None):
        rt = to_tensors([LogprobsSample(mode)], LOGPROBS_INFO, pad_side="right")
        with pytest.raises(LogprobsModeError, match="--logprobs-mode processed_logprobs"):
            session.add_gap(trainer, rt, rt.response_mask, temperature=0.7)
        with pytest.raises(LogprobsModeError, match="ReplaySession.add_gap"):
            session.add_gap(trainer, rt.logprobs, rt.response_mask, logprobs_mode=mode, temperature=0.7)
    assert session.flush() == {}  # nothing refused was measured
    rt = to_tensors([LogprobsSample("raw")], LOGPROBS_INFO, pad_side="right")
    session.add_gap(trainer, rt, rt.response_mask, temperature=1.0)  # T = 1: before and after are the same
    rt = to_tensors([LogprobsSample("processed")], LOGPROBS_INFO, pad_side="right")
    session.add_gap(trainer, rt, rt.response_mask, temperature=0.7)
    out = session.flush()
    assert out[K.LOGP_TOKENS] == 6 and out[K.MEAN_ABS_LOGP_DIFF] == pytest.approx(0.25 / 3)


def test_add_gap_refuses_raw_logprobs_sampled_with_a_filter_at_temperature_1(qwen: Any) -> None:
    """Raw (or unknown-mode) log-probs of tokens sampled at temperature 1 with top_p 0.9 are the untruncated
    distribution's: ``add_gap(sampling=...)`` refuses them naming the flag, never measures them; processed ones with
    the same params, and raw ones with plain sampling, are measured."""
    from rr_client import LogprobsModeError, to_tensors

    trainer = torch.tensor([[0.0, -9.0, -0.5, -1.0, -1.5]])
    top_p = {"temperature": 1.0, "top_p": 0.9}
    session = ReplaySession(qwen, audit_every=0)
    for mode in ("raw", None):
        rt = to_tensors([LogprobsSample(mode)], LOGPROBS_INFO, pad_side="right")
        with pytest.raises(LogprobsModeError, match=r"top_p=0\.9.*--logprobs-mode processed_logprobs"):
            session.add_gap(trainer, rt, rt.response_mask, sampling=top_p)
        with pytest.raises(LogprobsModeError, match="ReplaySession.add_gap"):
            session.add_gap(trainer, rt.logprobs, rt.response_mask, logprobs_mode=mode, temperature=1.0, sampling=top_p)
    assert session.flush() == {}  # nothing refused was measured
    rt = to_tensors([LogprobsSample("processed")], LOGPROBS_INFO, pad_side="right")
    session.add_gap(trainer, rt, rt.response_mask, sampling=top_p)
    rt = to_tensors([LogprobsSample("raw")], LOGPROBS_INFO, pad_side="right")
    session.add_gap(trainer, rt, rt.response_mask, sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    assert session.flush()[K.LOGP_TOKENS] == 6
