"""rr_server.serving.openai_routing and the codec's "sglang" format, as pure functions (real engines: tests/vllm, tests/sglang)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from rr_client import decode_meta_info
from rr_client.core.codec import check_routing, routing_meta_fields
from rr_server.serving.generate_protocol import BadRequest, parse_generate_request
from rr_server.serving.openai_routing import engine_body, finish_answer, parse_openai_routing
from tests.support.routing_data import dims_info

INFO = dims_info(2, 8, 2, [0, 1], engine="vllm", engine_version="0.30.0", model="m")


def _routing(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(8, 2, replace=False) for _ in range(2)] for _ in range(rows)]).astype(np.uint8)


def test_sglang_format_is_headerless_int32_and_decodes_back() -> None:
    arr = _routing(5)
    fields = routing_meta_fields(check_routing(arr, INFO, rows=5), "sglang")
    assert (fields["routed_experts_dtype"], fields["routed_experts_format"]) == ("int32", "sglang")
    raw = base64.b64decode(fields["routed_experts"])
    assert len(raw) == 5 * 2 * 2 * 4  # no header
    assert np.array_equal(np.frombuffer(raw, dtype=np.int32).reshape(5, 2, 2), arr)
    assert np.array_equal(decode_meta_info(fields, rows=5, num_layers=2, topk=2, num_experts=8), arr)
    with pytest.raises(ValueError, match="routed_experts_format"):
        routing_meta_fields(check_routing(arr, INFO, rows=5), "int32")


def test_generate_request_format_field(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_generate_request({"text": "a"}).routed_experts_format == "npy"
    assert parse_generate_request({"text": "a", "routed_experts_format": "sglang"}).routed_experts_format == "sglang"
    monkeypatch.setenv("RR_ROUTED_EXPERTS_FORMAT", "sglang")
    assert parse_generate_request({"text": "a"}).routed_experts_format == "sglang"
    assert parse_generate_request({"text": "a", "routed_experts_format": "npy"}).routed_experts_format == "npy"
    with pytest.raises(BadRequest, match="routed_experts_format"):
        parse_generate_request({"text": "a", "routed_experts_format": "json"})


@pytest.mark.parametrize(
    "body,field",
    [
        ({"routed_experts_format": "json"}, "routed_experts_format"),
        ({"return_routed_experts": 1}, "return_routed_experts"),
        ({"return_routed_experts": True, "routed_experts_start": True}, "routed_experts_start"),
        ({"return_routed_experts": True, "routed_experts_start": 4, "prompt": [1, 2]}, "routed_experts_start"),
        ({"return_routed_experts": True, "stream": True}, "stream"),
    ],
)
def test_parse_refuses_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        parse_openai_routing(body, engine="vllm")


def test_no_rr_field_is_not_rrs_business() -> None:
    assert parse_openai_routing({"prompt": "x", "max_tokens": 3}, engine="vllm") is None
    # SGLang's own names count on SGLang (the engine would otherwise answer int32 under sgl_ext)
    assert parse_openai_routing({"prompt": "x", "routed_experts_start_len": 2}, engine="sglang") is not None
    assert parse_openai_routing({"prompt": "x", "routed_experts_start_len": 2}, engine="vllm") is None


def test_engine_body_uses_each_engines_names() -> None:
    body = {
        "prompt": [1, 2, 3],
        "return_routed_experts": True,
        "routed_experts_start": 2,
        "routed_experts_format": "npy",
        "max_tokens": 4,
    }
    r = parse_openai_routing(body, engine="vllm")
    assert r is not None
    assert engine_body(body, r, engine="vllm") == {
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "return_token_ids": True,
        "routed_experts_prompt_start": 2,
    }
    assert engine_body(body, r, engine="sglang") == {
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "return_token_ids": True,
        "return_routed_experts": True,
        "routed_experts_start_len": 2,
    }


def test_finish_answer_checks_each_choice() -> None:
    good = _routing(4 + 3 - 1)
    bad = good.copy()
    bad[2, 1] = 0  # an all-zero MoE row: the engine did not record it
    blob = lambda a: routing_meta_fields(check_routing(a, INFO, rows=a.shape[0]))["routed_experts"]  # noqa: E731
    answer = {
        "choices": [
            {
                "index": 0,
                "text": "a",
                "token_ids": [7, 8, 9],
                "prompt_token_ids": [1, 2, 3, 4],
                "routed_experts": blob(good),
            },
            {
                "index": 1,
                "text": "b",
                "token_ids": [7, 8, 9],
                "prompt_token_ids": [1, 2, 3, 4],
                "routed_experts": base64.b64encode(b"\x93NUMPY\x01\x00" + b"x" * 4).decode(),
            },
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 6},
    }
    r = parse_openai_routing({"return_routed_experts": True}, engine="vllm")
    assert r is not None
    out = finish_answer(answer, r, INFO, engine="vllm")
    c0, c1 = out["choices"]
    assert c0["routed_experts_shape"] == [6, 2, 2] and c0["text"] == "a"
    assert c1["routed_experts"] is None and "MalformedPayloadError" in c1["routed_experts_error"]


def test_finish_answer_transcodes_sglang_int32() -> None:
    arr = _routing(5)
    native = base64.b64encode(arr.astype(np.int32).tobytes()).decode()
    answer = {
        "choices": [{"index": 0, "text": "x", "sgl_ext": {"routed_experts": native}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }
    r = parse_openai_routing({"return_routed_experts": True}, engine="sglang")
    assert r is not None
    out = finish_answer(answer, r, INFO, engine="sglang")["choices"][0]
    assert "sgl_ext" not in out  # moved, and an empty sgl_ext goes like SGLang drops it
    assert out["routed_experts_dtype"] == "uint8"
    assert np.array_equal(decode_meta_info(out, rows=5, num_layers=2, topk=2, num_experts=8), arr)
    short = {
        "choices": [{"index": 0, "sgl_ext": {"routed_experts": native}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }  # one row missing
    out = finish_answer(short, r, INFO, engine="sglang")["choices"][0]
    assert out["routed_experts"] is None and "6" in out["routed_experts_error"]
