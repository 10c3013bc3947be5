"""TRL's importance-sampling correction (TIS / MIS), computed with the engine's sampling log-probs.

TRL 1.16 applies it only on its own vLLM path; R3 removes the routing mismatch, not the numeric one, so rr
applies it on RRRollout's samples with TRL's settings (``vllm_importance_sampling_correction``, ``_mode``,
``_clip_min``, ``_clip_max``) and TRL's rules: the ratio is ``exp(old - engine)`` per token (summed per
sequence in the ``sequence_*`` modes), ``*_truncate`` clamps it into ``[clip_min, clip_max]``, ``*_mask`` sets
it to 0 outside; tokens with no engine log-prob (NaN) get ratio 1.
"""

from __future__ import annotations

import math

import torch

from rr_client.errors import ConfigurationError

__all__ = ["MODES", "importance_sampling_ratio"]

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(old_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, *,
                              mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes) ratios the loss multiplies per token."""
    if mode not in MODES:
        raise ConfigurationError(f"vllm_importance_sampling_mode={mode!r}; TRL accepts {', '.join(MODES)}")
    diff = torch.nan_to_num((old_logps - engine_logps.to(old_logps.device)) * mask.to(old_logps.device), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
