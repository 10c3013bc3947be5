"""TRL's importance-sampling correction (TIS / MIS) as a function, for loops that are not TRL's (no TRL import).

``R3GRPOTrainer`` lets TRL's own code compute and apply the correction (``R3GRPOTrainer._trl_correction``); this is
the same rule for a plain loop (examples/plain_loop_r3.py), checked equal to TRL 1.16's on the real server:
the ratio is ``exp(old - engine)`` per token (summed per sequence in the ``sequence_*`` modes), ``*_truncate``
clamps it into ``[clip_min, clip_max]``, ``*_mask`` sets it to 0 outside; tokens with no engine log-prob (NaN)
get ratio 1. The loss multiplies its per-token terms by it (detached, it carries no gradient).

``engine_logps`` is a tensor or a layout (:class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`,
whose ``logprobs_mode`` comes along); with ``temperature`` / ``sampling`` (the params the engine sampled with) raw or
unknown-mode log-probs are refused where they are not the distribution the tokens were drawn from
(:func:`rr_client.core.logprobs.check_comparable_logprobs`: temperature != 1, top-k, top-p, min-p, penalties).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rr_client.core.errors import ConfigurationError
from rr_client.core.logprobs import check_comparable_logprobs, engine_logprobs

__all__ = ["MODES", "importance_sampling_ratio"]

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    engine_logps: Any,
    mask: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    logprobs_mode: str | None = None,
    temperature: float | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes) ratios the loss multiplies per token; refuses
    (:class:`rr_client.LogprobsModeError`) engine log-probs that are not the sampled distribution's."""
    if mode not in MODES:
        raise ConfigurationError(f"vllm_importance_sampling_mode={mode!r}; TRL accepts {', '.join(MODES)}")
    engine_logps, logprobs_mode = engine_logprobs(engine_logps, logprobs_mode, consumer="importance_sampling_ratio")
    check_comparable_logprobs(logprobs_mode, temperature, consumer="importance_sampling_ratio", sampling=sampling)
    diff = torch.nan_to_num((old_logps - engine_logps.to(old_logps.device)) * mask.to(old_logps.device), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
