"""Sampled log-probs: parsed once into ``GenerateResult.logprobs`` (NaN for a missing one, checked against the
tokens), their mode from ``/rr/info``, and the one check that refuses comparing pre-temperature log-probs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rr_client import RRInfo
from rr_client.client._openai import parse_choices
from rr_client.client._results import parse_sample
from rr_client.core.errors import LogprobsModeError, ProtocolError, RRError
from rr_client.core.logprobs import check_comparable_logprobs, mode_from_vllm
from tests.support.routing_data import dims_info

INFO = dims_info(2, 4, 2, [0, 1], engine="vllm", engine_version="0.30.0", model="m", logprobs_mode="processed")


def _reply(lp: Any, out: list[int] | None = None) -> dict[str, Any]:
    out = [5, 6, 7] if out is None else out
    meta: dict[str, Any] = {"prompt_tokens": 2, "completion_tokens": len(out)}
    if lp is not None:
        meta["output_token_logprobs"] = lp
    return {"output_ids": out, "meta_info": meta}


def _sample(reply: dict[str, Any], info: RRInfo = INFO) -> Any:
    return parse_sample(reply, index=0, prompt_index=0, prompt_ids=[1, 2], info=info, want_routing=False)


def test_generate_logprobs_parsed_once_with_nan_for_missing() -> None:
    r = _sample(_reply([[-0.5, 5, None], [None, 6, None], [-1, 7, "x"]]))
    assert r.logprobs.dtype == np.float64 and r.logprobs.shape == (3,)
    assert r.logprobs[0] == -0.5 and math.isnan(r.logprobs[1]) and r.logprobs[2] == -1.0
    assert r.logprobs_mode == "processed"


def test_no_logprobs_asked_is_none() -> None:
    r = _sample(_reply(None))
    assert r.logprobs is None and r.logprobs_mode is None


def test_mode_is_none_when_the_server_does_not_say() -> None:
    info = RRInfo(**{**INFO.model_dump(), "logprobs_mode": None})
    assert _sample(_reply([[-0.5, 5], [-1, 6], [-2, 7]]), info).logprobs_mode is None


@pytest.mark.parametrize(
    ("lp", "err", "needle"),
    [
        ([[-0.5, 5, None], [-1, 6, None]], ProtocolError, "2 output_token_logprobs for 3"),
        ([[-0.5, 5, None], [-1, 9, None], [-1, 7, None]], ProtocolError, "names token 9"),
        ([[-0.5, 5], [-1, 6], ["-1", 7]], ProtocolError, "log-prob 2 is str"),
        ([[-0.5, 5], [-1, 6], [True, 7]], ProtocolError, "log-prob 2 is bool"),
        ([[-0.5, 5], [-1, 6], 3], ProtocolError, "output_token_logprobs[2]"),
        ({"a": 1}, ProtocolError, "must be a list"),
    ],
)
def test_generate_logprobs_that_disagree_with_the_tokens_are_typed(lp: Any, err: type, needle: str) -> None:
    with pytest.raises(err, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _sample(_reply(lp))


def _answer(choice_lp: Any, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {
        "id": "x",
        "choices": [
            {
                "index": 0,
                "text": "abc",
                "prompt_token_ids": [1, 2],
                "token_ids": token_ids or [5, 6, 7],
                "finish_reason": "length",
                "logprobs": choice_lp,
            }
        ],
    }


def _choices(answer: dict[str, Any]) -> Any:
    return parse_choices(answer, path="/v1/completions", info=INFO, want_routing=False, start=0, sent_prompt_ids=None)


def test_openai_completions_and_chat_logprobs() -> None:
    r = _choices(_answer({"tokens": ["a", "b", "c"], "token_logprobs": [-0.1, None, -0.3]}))[0]
    assert r.logprobs[0] == -0.1 and math.isnan(r.logprobs[1]) and r.logprobs[2] == -0.3
    assert r.logprobs_mode == "processed"
    chat = {
        "content": [{"token": "a", "logprob": -0.25}, {"token": "b", "logprob": -1.0}, {"token": "c", "logprob": -2.0}]
    }
    assert _choices(_answer(chat))[0].logprobs.tolist() == [-0.25, -1.0, -2.0]
    assert _choices(_answer(None))[0].logprobs is None


@pytest.mark.parametrize(
    ("block", "err"),
    [
        ({"token_logprobs": [-0.1, -0.2]}, ProtocolError),
        ({"content": [{"logprob": -0.1}]}, ProtocolError),
        ({"token_logprobs": [-0.1, "x", -0.3]}, ProtocolError),
        ({"tokens": []}, ProtocolError),
        ([1, 2, 3], ProtocolError),
    ],
)
def test_openai_logprobs_that_disagree_are_typed(block: Any, err: type) -> None:
    with pytest.raises(err):
        _choices(_answer(block))


@pytest.mark.parametrize(
    ("mode", "temperature"),
    [("processed", 0.7), ("processed", None), ("raw", 1.0), ("raw", None), (None, 1), (None, None)],
)
def test_comparable_logprobs_pass(mode: str | None, temperature: float | None) -> None:
    check_comparable_logprobs(mode, temperature, consumer="test")


@pytest.mark.parametrize("mode", ["raw", None])
def test_pre_temperature_or_unknown_logprobs_are_refused_naming_the_flag(mode: str | None) -> None:
    with pytest.raises(LogprobsModeError, match="--logprobs-mode processed_logprobs") as e:
        check_comparable_logprobs(mode, 0.7, consumer="ReplaySession.gap")
    assert "ReplaySession.gap" in str(e.value) and "0.7" in str(e.value)
    assert isinstance(e.value, RRError)


def test_an_unknown_mode_name_is_refused_at_any_temperature() -> None:
    with pytest.raises(LogprobsModeError, match="raw_logits"):
        check_comparable_logprobs("raw_logits", 1.0, consumer="x")


def test_vllm_modes_map_to_rrs() -> None:
    assert mode_from_vllm("processed_logprobs") == "processed" and mode_from_vllm("raw_logprobs") == "raw"
    assert mode_from_vllm("raw_logits") is None and mode_from_vllm(None) is None


def test_info_states_only_known_modes() -> None:
    with pytest.raises(ValueError):
        RRInfo(**{**INFO.model_dump(), "logprobs_mode": "raw_logprobs"})


def test_replicas_must_agree_on_the_logprobs_mode() -> None:
    """Every result is labelled with the pool's mode, so a replica stating another one is a mismatch."""
    from rr_client.client._replicas import info_mismatch

    raw = RRInfo(**{**INFO.model_dump(), "logprobs_mode": "raw"})
    assert info_mismatch(INFO, raw) == {"logprobs_mode": ("processed", "raw")}
    assert info_mismatch(INFO, RRInfo(**INFO.model_dump())) == {}


def test_sglang_logprobs_mode_follows_its_original_logprob_switch() -> None:
    """``SGLANG_RETURN_ORIGINAL_LOGPROB`` (read as SGLang reads it) turns SGLang's log-probs pre-temperature."""
    from rr_server.serving.engines.sglang import logprobs_mode

    assert logprobs_mode({}) == "processed" and logprobs_mode({"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}) == "processed"
    assert logprobs_mode({"SGLANG_RETURN_ORIGINAL_LOGPROB": "True"}) == "raw"
    assert logprobs_mode({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}) == "raw"


# --- beyond temperature: top-k / top-p / min-p / penalties (issue 44, item 5) ------------------------------------

# each filter or penalty on, as vLLM, SGLang's sampling_params and OpenAI bodies spell it
FILTERS_ON = {
    "top_k": 50,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.3,
}
# the same names off: what plain sampling sends (top_k 0 is off too: TRL's and vLLM's spelling)
FILTERS_OFF = {
    "top_k": -1,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


@pytest.mark.parametrize("mode", ["raw", None])
def test_raw_logprobs_with_top_p_09_at_temperature_1_are_refused(mode: str | None) -> None:
    """Issue 44's "done when": raw (or unknown) log-probs at temperature 1 with top_p 0.9 are the untruncated
    distribution's, not the one sampled from: refused, naming the flag, its value and the way out."""
    sampling = {"n": 4, "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": -1}
    with pytest.raises(LogprobsModeError) as e:
        check_comparable_logprobs(mode, 1.0, consumer="ReplaySession.add_gap", sampling=sampling)
    msg = str(e.value)
    for part in ("ReplaySession.add_gap", "top_p=0.9", "--logprobs-mode processed_logprobs", "SGLANG_RETURN_ORIGINAL"):
        assert part in msg, (part, msg)
    assert "top_k" not in msg and "temperature 1" not in msg.split(" or sample ")[0]  # only what is on is named
    assert isinstance(e.value, RRError)


@pytest.mark.parametrize("mode", ["raw", None])
@pytest.mark.parametrize("flag", list(FILTERS_ON))
def test_each_filter_or_penalty_is_refused_with_raw_logprobs_naming_it(mode: str | None, flag: str) -> None:
    """Every filter and penalty on its own, with raw or unknown-mode log-probs at temperature 1 (given or in the
    params): refused, the message names the flag and its value and how to turn it off."""
    for temperature, sampling in ((1.0, {flag: FILTERS_ON[flag]}), (None, {"temperature": 1, flag: FILTERS_ON[flag]})):
        with pytest.raises(LogprobsModeError) as e:
            check_comparable_logprobs(mode, temperature, consumer="test", sampling=sampling)
        assert f"{flag}={FILTERS_ON[flag]!r}" in str(e.value)
        assert "processed_logprobs" in str(e.value)
        assert f"{flag}={FILTERS_OFF[flag]:g}" in str(e.value)  # the way out: that flag's neutral value


@pytest.mark.parametrize("flag", list(FILTERS_ON))
def test_processed_logprobs_pass_with_the_filter_raw_ones_are_refused_for(flag: str) -> None:
    """Processed log-probs are the filtered distribution's, the one sampled from: they pass with each flag (and
    all at once, at any temperature) where raw ones with the same params are refused."""
    one = {"temperature": 1.0, flag: FILTERS_ON[flag]}
    with pytest.raises(LogprobsModeError):
        check_comparable_logprobs("raw", 1.0, consumer="test", sampling=one)
    check_comparable_logprobs("processed", 1.0, consumer="test", sampling=one)
    check_comparable_logprobs("processed", 0.7, consumer="test", sampling={**FILTERS_ON, "temperature": 0.7})


def test_raw_logprobs_with_plain_sampling_at_temperature_1_still_pass() -> None:
    """Temperature 1 and no filter: raw log-probs are the distribution sampled from. The same params with one
    filter switched on are refused, so the pass is the check's, not an absent one."""
    body = {"n": 2, "max_tokens": 8, "seed": 3, "temperature": 1.0, "logprobs": 0, **FILTERS_OFF}  # an OpenAI body
    for sampling in (body, {**body, "top_k": 0}, {k: None for k in FILTERS_OFF}, {}, None):
        check_comparable_logprobs("raw", 1.0, consumer="test", sampling=sampling)
        check_comparable_logprobs(None, None, consumer="test", sampling=sampling)
    with pytest.raises(LogprobsModeError, match="top_p=0.95"):
        check_comparable_logprobs("raw", 1.0, consumer="test", sampling={**body, "top_p": 0.95})


def test_temperature_and_filters_are_named_together() -> None:
    """Off temperature and filters on: one refusal naming all of them, the temperature taken from the params."""
    with pytest.raises(LogprobsModeError) as e:
        check_comparable_logprobs("raw", None, consumer="test", sampling={**FILTERS_ON, "temperature": 0.7})
    msg = str(e.value)
    assert "temperature 0.7" in msg and "log_softmax(logits / 0.7)" in msg
    for flag, value in FILTERS_ON.items():
        assert f"{flag}={value!r}" in msg, (flag, msg)


@pytest.mark.parametrize("value", ["x", True, float("nan"), [0.9]])
def test_a_filter_value_rr_cannot_judge_is_refused(value: Any) -> None:
    from rr_client.core.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="top_p="):
        check_comparable_logprobs("raw", 1.0, consumer="test", sampling={"top_p": value})
