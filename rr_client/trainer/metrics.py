"""R3 effectiveness metrics: how far the trainer's log-probs are from the rollout's, and how often routing agrees.

With ``d = logp_train - logp_rollout`` over response tokens (AReaL PR #1207's set): ``mean|d|``, ``mean d^2``,
k3 KL ``mean(exp(d) - 1 - d)`` (an estimator of KL(rollout || train)), the fraction of tokens with
``|d| > ln 2`` and ``|d| > ln 5``, plus routing agreement: the share of (token, MoE layer) top-k *sets*
the trainer's own router would have chosen identically (:mod:`rr_client.core.agreement`). Imports torch (optional
extra), never transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rr_client.core.errors import ConfigurationError, MissingDependencyError, ReplayError

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("rr_client.trainer.metrics needs torch: pip install 'rr-replay[torch]'") from e

# the one implementation (numpy), re-exported for trainers
from rr_client.core.agreement import routing_agreement

__all__ = [
    "R3Metrics",
    "gap_stats",
    "gap_keys",
    "segment_gap_stats",
    "r3_metrics",
    "routing_agreement",
    "token_logprobs",
]


@dataclass(frozen=True)
class R3Metrics:
    """Per-batch log-prob gap statistics over the masked (response) tokens."""

    tokens: int
    mean_abs_diff: float
    mean_sq_diff: float
    k3_kl: float
    frac_gt_ln2: float
    frac_gt_ln5: float
    routing_agreement: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _t(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def gap_stats(logp_train: Any, logp_rollout: Any, mask: Any = None) -> torch.Tensor:
    """The device side of :func:`r3_metrics`: ``[tokens, sum|d|, sum d^2, sum k3, n(|d|>ln2), n(|d|>ln5),
    non-finite]`` as one float64 tensor on ``logp_train``'s device, with no host read (``mask`` and
    ``logp_rollout`` may live elsewhere: they are moved there once)."""
    lt = _t(logp_train).double()
    lr = _t(logp_rollout).to(device=lt.device, dtype=torch.float64)
    if lt.shape != lr.shape:
        raise ConfigurationError(f"logp_train {tuple(lt.shape)} and logp_rollout {tuple(lr.shape)} differ in shape")
    if mask is None:
        m = torch.ones_like(lt, dtype=torch.bool)
    else:
        m = _t(mask).to(device=lt.device, dtype=torch.bool)
    if m.shape != lt.shape:
        raise ConfigurationError(f"mask {tuple(m.shape)} does not match the log-probs {tuple(lt.shape)}")
    d = torch.where(m, lt - lr, 0.0)
    ad = d.abs()
    return torch.stack(
        [
            m.sum(),
            ad.sum(),
            (d * d).sum(),
            (torch.expm1(d) - d).sum(),
            ((ad > math.log(2)) & m).sum(),
            ((ad > math.log(5)) & m).sum(),
            (torch.isfinite(d).logical_not() & m).sum(),
        ]
    ).double()


def gap_keys(stats: Sequence[float]) -> dict[str, float]:
    """The step's gap keys from the host values of summed :func:`gap_stats` (``[tokens, sum|d|, sum d^2, sum k3,
    n(|d|>ln2), n(|d|>ln5), non-finite]``); :class:`ReplayError` on a non-finite difference; empty with no tokens."""
    from rr_client.trainer import keys as K

    n, s_abs, _s_sq, s_k3, n2, _n5, bad = (float(x) for x in stats[:7])
    if bad:
        raise ReplayError("non-finite log-prob difference in a measured token (trainer or engine log-prob is NaN/inf)")
    if not n:
        return {}
    return {K.MEAN_ABS_LOGP_DIFF: s_abs / n, K.K3_KL: s_k3 / n, K.FRAC_ABS_DIFF_GT_LN2: n2 / n, K.LOGP_TOKENS: n}


def segment_gap_stats(logp_train: Any, logp_rollout: Any, mask: Any, codes: torch.Tensor, n_codes: int) -> torch.Tensor:
    """:func:`gap_stats` per segment code: ``[n_codes, 7]`` float64 on ``logp_train``'s device, no host read;
    ``codes`` (same shape, -1: no segment) says which segment each position's log-prob belongs to."""
    lt = _t(logp_train).double()
    lr = _t(logp_rollout).to(device=lt.device, dtype=torch.float64)
    m = torch.ones_like(lt, dtype=torch.bool) if mask is None else _t(mask).to(device=lt.device, dtype=torch.bool)
    c = codes.to(device=lt.device, dtype=torch.long)
    if not (lt.shape == lr.shape == m.shape == c.shape):
        raise ConfigurationError(
            f"log-probs {tuple(lt.shape)}, {tuple(lr.shape)}, mask {tuple(m.shape)} and segment "
            f"codes {tuple(c.shape)} differ in shape"
        )
    d = torch.where(m, lt - lr, 0.0)
    ad = d.abs()
    cols = torch.stack(
        [
            m.double(),
            ad,
            d * d,
            torch.expm1(d) - d,
            ((ad > math.log(2)) & m).double(),
            ((ad > math.log(5)) & m).double(),
            (torch.isfinite(d).logical_not() & m).double(),
        ],
        dim=-1,
    )
    seg = torch.where(m & (c >= 0), c, n_codes).reshape(-1)
    out = torch.zeros((n_codes + 1, 7), dtype=torch.float64, device=lt.device)
    return out.index_add_(0, seg, cols.reshape(-1, 7)).narrow(0, 0, n_codes)


def r3_metrics(
    logp_train: Any, logp_rollout: Any, mask: Any = None, *, routing_agreement: float | None = None
) -> R3Metrics:
    """Gap statistics over the tokens where ``mask`` is true (all tokens if None), computed in float64.

    ``logp_train`` and ``logp_rollout`` have the same shape (e.g. ``[B, T]``), on any devices; ``mask`` is
    usually the response mask. NaN in an unmasked position is an error; masked positions are ignored whatever
    they hold. One host read (:func:`gap_stats` does the rest on the device). ``logp_rollout`` may be the layout
    itself (its ``logprobs``); none there (or None) is a ConfigurationError naming ``return_logprob=True``."""
    from rr_client.core.logprobs import engine_logprobs

    if logp_rollout is None:
        raise ConfigurationError("r3_metrics: no engine log-probs to compare with (generate with return_logprob=True)")
    logp_rollout, _ = engine_logprobs(logp_rollout, None, consumer="r3_metrics")
    n, s_abs, s_sq, s_k3, n2, n5, bad = gap_stats(logp_train, logp_rollout, mask).tolist()
    if n == 0:
        raise ConfigurationError("no tokens selected by the mask")
    if bad:
        raise ConfigurationError("non-finite log-prob difference in a selected token")
    return R3Metrics(
        tokens=int(n),
        mean_abs_diff=s_abs / n,
        mean_sq_diff=s_sq / n,
        k3_kl=s_k3 / n,
        frac_gt_ln2=n2 / n,
        frac_gt_ln5=n5 / n,
        routing_agreement=routing_agreement,
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``out[..., t]`` = log p(input_ids[..., t] | tokens before t) from causal-LM logits; ``out[..., 0] = 0``.

    Same ``[B, T]`` (or packed ``[N]`` per sample) alignment as ``input_ids``, so the response mask applies
    directly. Computed in float32 (or the logits' dtype if wider).
    """
    lf = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    t = input_ids.shape[-1]
    nxt = input_ids.narrow(-1, 1, t - 1).unsqueeze(-1)
    lp = torch.log_softmax(lf.narrow(-2, 0, t - 1), dim=-1).gather(-1, nxt).squeeze(-1)
    return torch.cat([torch.zeros_like(lp.narrow(-1, 0, 1)), lp], dim=-1)
