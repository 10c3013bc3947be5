"""rr_client.trainer.metrics against straightforward per-token Python arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from rr_client.trainer.metrics import r3_metrics, routing_agreement, token_logprobs


def test_r3_metrics_reference() -> None:
    g = torch.Generator().manual_seed(0)
    lr = -torch.rand(3, 7, generator=g) * 3
    lt = lr + torch.randn(3, 7, generator=g) * 1.2
    mask = torch.rand(3, 7, generator=g) > 0.3
    m = r3_metrics(lt, lr, mask)
    ds = [float(lt[i, j]) - float(lr[i, j]) for i in range(3) for j in range(7) if mask[i, j]]
    assert m.tokens == len(ds)
    assert m.mean_abs_diff == pytest.approx(sum(abs(d) for d in ds) / len(ds), rel=1e-12)
    assert m.mean_sq_diff == pytest.approx(sum(d * d for d in ds) / len(ds), rel=1e-12)
    assert m.k3_kl == pytest.approx(sum(math.exp(d) - 1 - d for d in ds) / len(ds), rel=1e-9)
    assert m.frac_gt_ln2 == pytest.approx(sum(abs(d) > math.log(2) for d in ds) / len(ds))
    assert m.frac_gt_ln5 == pytest.approx(sum(abs(d) > math.log(5) for d in ds) / len(ds))
    assert 0 < m.frac_gt_ln5 < m.frac_gt_ln2 < 1


def test_identical_is_zero_and_masked_nan_ignored() -> None:
    lp = torch.tensor([[-1.0, float("nan"), -0.5]])
    m = r3_metrics(lp, lp.clone(), torch.tensor([[True, False, True]]))
    assert (m.mean_abs_diff, m.mean_sq_diff, m.k3_kl, m.frac_gt_ln2) == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        r3_metrics(lp, lp.clone())
    with pytest.raises(ValueError):
        r3_metrics(lp, lp.clone(), torch.zeros(1, 3, dtype=torch.bool))


def test_routing_agreement_sets_not_order() -> None:
    own = torch.tensor([[[1, 2], [0, 0], [3, 4]], [[5, 6], [0, 0], [1, 7]]])  # [T=2, L=3, K=2], layer 1 dense
    rep = torch.tensor([[[2, 1], [0, 0], [3, 5]], [[5, 6], [0, 0], [1, 7]]])
    assert routing_agreement(own, rep, layers=[0, 2]) == pytest.approx(3 / 4)
    assert routing_agreement(own, rep) == pytest.approx(5 / 6)
    assert routing_agreement(own, rep, torch.tensor([True, False]), layers=[0, 2]) == pytest.approx(1 / 2)


def test_token_logprobs_alignment() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    out = token_logprobs(logits, ids)
    assert out.shape == (2, 5) and (out[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 5):
            ref = torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]]
            assert out[b, t] == pytest.approx(float(ref), abs=1e-6)


def test_missing_engine_logprobs_name_return_logprob() -> None:
    """Forgetting return_logprob=True: a typed error saying so, not torch's 'Could not infer dtype of NoneType'."""
    from types import SimpleNamespace

    from rr_client.core.errors import ConfigurationError

    lt = torch.zeros(1, 3)
    with pytest.raises(ConfigurationError, match="return_logprob=True"):
        r3_metrics(lt, None)
    layout = SimpleNamespace(logprobs=None, logprobs_mode=None)  # what to_tensors gives without engine log-probs
    with pytest.raises(ConfigurationError, match="r3_metrics: the batch carries no engine log-probs .*return_logprob"):
        r3_metrics(lt, layout)
    m = r3_metrics(lt, SimpleNamespace(logprobs=torch.full((1, 3), -0.5), logprobs_mode="processed"))
    assert m.tokens == 3 and m.mean_abs_diff == pytest.approx(0.5)
