"""The /generate protocol without a server: parsing, the bad-request corpus, sampling translation, reply items."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rr_client.core.codec import decode_meta_info, routing_error_fields
from rr_client.core.errors import ShapeMismatchError
from rr_client.core.info import RRInfo
from rr_server.serving.generate_protocol import (
    SSE_DONE,
    BadRequest,
    build_item,
    parse_generate_request,
    sse_line,
)
from rr_server.serving.vllm_translate import checked_routing_fields, finish_reason_dict, to_vllm_sampling_kwargs
from tests.support import bad_requests
from tests.support.bad_requests import BadRequestCase


def test_parse_single_and_batch() -> None:
    r = parse_generate_request(b'{"text": "hi", "return_routed_experts": true, "routed_experts_start": 2}')
    assert r.prompts == ["hi"] and not r.is_batch and r.return_routed_experts and r.routed_experts_start == 2
    r = parse_generate_request({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {}]})
    assert r.is_batch and r.prompts == [[1, 2], [3]] and [s.n for s in r.sampling] == [2, 1]
    r = parse_generate_request({"text": "a", "routed_experts_start_len": 4})  # SGLang's older name
    assert r.routed_experts_start == 4
    r = parse_generate_request({"text": "a", "logprob_start_len": -1, "return_text_in_logprobs": True})
    assert r.prompts == ["a"]  # SGLang fields trainers send with a value rr can honour are tolerated


def _parse_and_translate(body: bytes) -> None:
    """What the rr plugin does before any engine call: parse, then map every prompt's sampling to vLLM."""
    req = parse_generate_request(body)
    for i, sp in enumerate(req.sampling):
        to_vllm_sampling_kwargs(sp, routed_experts_start=req.routed_experts_start, return_logprob=req.return_logprob[i])


@pytest.mark.parametrize("case", bad_requests.params())
def test_bad_request_corpus(case: BadRequestCase) -> None:
    """Every corpus entry rr's parser is meant to refuse gets its status and message; the rest pass it."""
    if not case.rejected_at(bad_requests.PARSER):
        _parse_and_translate(case.body)  # only an engine (or SGLang behind the sidecar) can refuse these
        return
    with pytest.raises(BadRequest) as e:
        _parse_and_translate(case.body)
    assert e.value.status == case.status
    assert case.needle in str(e.value), str(e.value)


def test_sampling_translation() -> None:
    req = parse_generate_request(
        {
            "text": "a",
            "sampling_params": {
                "max_new_tokens": 7,
                "stop": ["x"],
                "top_k": -1,
                "sampling_seed": 3,
                "no_stop_trim": True,
            },
        }
    )
    kw = to_vllm_sampling_kwargs(req.sampling[0], routed_experts_start=5, return_logprob=True)
    assert kw["max_tokens"] == 7 and kw["stop"] == ["x"] and kw["top_k"] == 0 and kw["seed"] == 3
    assert kw["include_stop_str_in_output"] and kw["routed_experts_prompt_start"] == 5 and kw["logprobs"] == 0
    kw = to_vllm_sampling_kwargs(
        parse_generate_request({"text": "a"}).sampling[0], routed_experts_start=0, return_logprob=False
    )
    assert "routed_experts_prompt_start" not in kw and "logprobs" not in kw and "seed" not in kw


def test_finish_reason_dict() -> None:
    assert finish_reason_dict(None, None) is None
    assert finish_reason_dict("length", None) == {"type": "length", "length": None}
    assert finish_reason_dict("stop", 7) == {"type": "stop", "matched": 7}
    assert finish_reason_dict("abort", None) == {"type": "abort", "message": "abort"}


INFO = RRInfo.from_hf_config(
    {"num_hidden_layers": 2, "num_experts": 300, "num_experts_per_tok": 2}, engine="vllm", engine_version="test"
)
GOOD = np.array([[[1, 299], [3, 4]]] * 4)  # prompt 3 + completion 2 - 1 = 4 rows


def _item(**kw: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        rid="r", text="t", output_ids=[1, 2], prompt_tokens=3, cached_tokens=0, finish_reason=None, e2e_latency=0.0
    )
    base.update(kw)
    return build_item(**base)  # type: ignore[arg-type]


def test_build_item_carries_checked_routing() -> None:
    fields = checked_routing_fields(GOOD, INFO, prompt_ids=[7, 8, 9], output_ids=[1, 2], start=0)
    item = _item(routing_fields=fields, prompt_token_ids=[7, 8, 9])
    meta = item["meta_info"]
    assert meta["routed_experts_shape"] == [4, 2, 2] and meta["routed_experts_dtype"] == "uint16"  # type: ignore[index]
    assert meta["prompt_token_ids"] == [7, 8, 9]  # type: ignore[index]
    np.testing.assert_array_equal(decode_meta_info(meta, rows=4, num_layers=2, topk=2, num_experts=300), GOOD)  # type: ignore[arg-type]
    started = checked_routing_fields(GOOD[1:], INFO, prompt_ids=[7, 8, 9], output_ids=[1, 2], start=1)
    assert started["routed_experts_start"] == 1 and started["routed_experts_shape"] == [3, 2, 2]


def test_failed_check_becomes_error_marker() -> None:
    with pytest.raises(ShapeMismatchError, match="4 rows, expected 5") as failed:
        checked_routing_fields(GOOD, INFO, prompt_ids=[7, 8, 9], output_ids=[1, 2, 3], start=0)
    fields = routing_error_fields(failed.value)
    item = _item(output_ids=[1, 2, 3], routing_fields=fields, prompt_token_ids=[7, 8, 9])
    meta = item["meta_info"]
    assert meta["routed_experts"] is None and meta["routed_experts_error"].startswith("ShapeMismatchError: ")  # type: ignore[index]
    assert "prompt_token_ids" not in meta  # type: ignore[operator]
    with pytest.raises(ShapeMismatchError, match="withheld routed_experts: ShapeMismatchError"):
        decode_meta_info(meta, num_experts=300)  # type: ignore[arg-type]


def test_build_item_without_routing_or_text() -> None:
    none = _item(text=None, output_ids=[1], prompt_token_ids=[7, 8, 9])
    assert "text" not in none and not any(k.startswith("routed_experts") for k in none["meta_info"])  # type: ignore[union-attr]
    assert "prompt_token_ids" not in none["meta_info"]  # type: ignore[operator]
    assert none["meta_info"]["completion_tokens"] == 1  # type: ignore[index]


def test_sse_lines() -> None:
    line = sse_line({"a": 1})
    assert line.startswith("data: ") and line.endswith("\n\n") and orjson.loads(line[6:]) == {"a": 1}
    assert SSE_DONE == "data: [DONE]\n\n"


@pytest.mark.parametrize(
    "key,hint",
    [
        ("max_tokens", "(use max_new_tokens)"),
        ("min_tokens", "(use min_new_tokens)"),
        ("logprobs", "(use return_logprob=true at the top level of the body)"),
        ("return_logprob", "(use return_logprob at the top level of the body, not in sampling_params)"),
    ],
)
def test_other_apis_sampling_keys_are_refused_with_the_generate_name(key: str, hint: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_generate_request({"input_ids": [1, 2], "sampling_params": {key: 4}})
    assert f"sampling_params.{key}: Extra inputs are not permitted {hint}" in str(e.value), str(e.value)
    with pytest.raises(BadRequest, match="sampling_params.top_q: Extra inputs are not permitted;|permitted$"):
        parse_generate_request({"input_ids": [1, 2], "sampling_params": {"top_q": 4}})  # no hint invented


def test_cache_salt_is_one_per_prompt_and_reaches_vllms_completion_body() -> None:
    """``cache_salt`` (the source audit's prefix-cache bypass): a string for every prompt or one per prompt, passed to
    the engine (the sidecar's ``/v1/completions`` body for vLLM); anything else is a 400 naming it."""
    from rr_server.proxy.vllm_backend import completion_body

    r = parse_generate_request({"input_ids": [[1, 2], [3]], "cache_salt": "s"})
    assert r.cache_salts == ["s", "s"]
    r = parse_generate_request({"input_ids": [[1, 2], [3]], "cache_salt": ["a", "b"]})
    assert [completion_body(r, i, "m").get("cache_salt") for i in range(2)] == ["a", "b"]
    assert "cache_salt" not in completion_body(parse_generate_request({"input_ids": [1]}), 0, "m")
    for bad, why in ((["a"], "cache_salt has 1 entries but there are 2 prompts"), ("", "cache_salt must be")):
        with pytest.raises(BadRequest, match=why):
            parse_generate_request({"input_ids": [[1, 2], [3]], "cache_salt": bad})
