"""``importance_sampling_ratio`` on the engine's log-probs: refused (LogprobsModeError) where they are not the
distribution the tokens were drawn from (raw or unknown mode with temperature != 1 or a sampling filter on), from a
tensor with its mode or from a layout carrying it; the ratio itself is tested against TRL's in
tests/unit/test_trl_integration.py and on the real server in tests/vllm/test_trl_grpo.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rr_client import ConfigurationError, LogprobsModeError, to_tensors
from rr_client.trainer.correction import importance_sampling_ratio

from .helpers import LOGPROBS_INFO, LogprobsSample

OLD = torch.tensor([[0.0, -9.0, -0.25, -1.0, -1.5]])  # the engine's log-probs at the completion: ratio 1
TOP_P = {"n": 2, "temperature": 1.0, "top_p": 0.9}  # issue 44's case: temperature 1, top_p 0.9


def _ratio(engine: Any, **kw: Any) -> torch.Tensor:
    """TRL's default correction (sequence_mask at 3) of ``OLD`` against ``engine``."""
    mask = torch.tensor([[False, False, True, True, True]])
    return importance_sampling_ratio(OLD, engine, mask, mode="sequence_mask", clip_min=None, clip_max=3.0, **kw)


@pytest.mark.parametrize("mode", ["raw", None])
def test_raw_logprobs_sampled_with_top_p_09_are_refused(mode: str | None) -> None:
    rt = to_tensors([LogprobsSample(mode)], LOGPROBS_INFO, pad_side="right")
    with pytest.raises(LogprobsModeError) as e:
        _ratio(rt, sampling=TOP_P)  # the mode from the layout
    assert "importance_sampling_ratio" in str(e.value) and "top_p=0.9" in str(e.value)
    assert "--logprobs-mode processed_logprobs" in str(e.value)
    with pytest.raises(LogprobsModeError, match="top_p=0.9"):
        _ratio(rt.logprobs, logprobs_mode=mode, temperature=1.0, sampling=TOP_P)  # a tensor and its mode


@pytest.mark.parametrize(
    "flag, value",
    [
        ("top_k", 20),
        ("min_p", 0.1),
        ("repetition_penalty", 1.2),
        ("presence_penalty", 0.3),
        ("frequency_penalty", 0.3),
    ],
)
def test_every_filter_is_refused_with_raw_logprobs_and_passes_with_processed(flag: str, value: float) -> None:
    sampling = {"temperature": 1.0, flag: value}
    with pytest.raises(LogprobsModeError, match=f"{flag}={value!r}"):
        _ratio(to_tensors([LogprobsSample("raw")], LOGPROBS_INFO, pad_side="right"), sampling=sampling)
    got = _ratio(to_tensors([LogprobsSample("processed")], LOGPROBS_INFO, pad_side="right"), sampling=sampling)
    assert got.shape == (1, 1) and torch.isfinite(got).all()


def test_processed_logprobs_and_plain_raw_sampling_give_the_ratio() -> None:
    """Processed log-probs with top_p 0.9, and raw ones at temperature 1 with no filter, give TRL's ratio
    (``OLD`` equals the engine's there: 1); raw ones are refused as soon as top_p is below 1."""
    processed = _ratio(to_tensors([LogprobsSample("processed")], LOGPROBS_INFO, pad_side="right"), sampling=TOP_P)
    plain = {**TOP_P, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    raw = to_tensors([LogprobsSample("raw")], LOGPROBS_INFO, pad_side="right")
    assert torch.allclose(processed, torch.ones(1, 1)) and torch.allclose(_ratio(raw, sampling=plain), processed)
    with pytest.raises(LogprobsModeError):
        _ratio(raw, sampling={**plain, "top_p": 0.99})


def test_a_layout_without_logprobs_or_of_another_mode_is_refused() -> None:
    rt = to_tensors([LogprobsSample("processed")], LOGPROBS_INFO, pad_side="right")
    with pytest.raises(ConfigurationError, match="logprobs_mode='raw' but the batch's log-probs are 'processed'"):
        _ratio(rt, logprobs_mode="raw")
