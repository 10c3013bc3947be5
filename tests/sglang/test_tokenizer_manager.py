"""SGLang's real TokenizerManager + HTTP layer, fed by the stand-in scheduler: unpatched bugs, patched answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client.core import errors as rr_errors
from rr_client.core.codec import decode_meta_info
from rr_client.core.errors import MissingRoutingError
from rr_server.demo.tiny_moe import reference_routing
from rr_server.serving.engines.sglang import profile_for
from tests.sglang.conftest import MODEL_SPEC
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang
L, E, K = MODEL_SPEC["num_layers"], MODEL_SPEC["num_experts"], MODEL_SPEC["topk"]
MOE_LAYERS = [i for i in range(L) if i not in MODEL_SPEC["mlp_only_layers"]]
PROMPT = [3, 17, 29, 41, 53, 67, 71]


def _body(**kw: Any) -> dict[str, Any]:
    """A /generate request for PROMPT (token ids) or text."""
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 5, "temperature": 0.0}}
    body.update(kw)
    if "text" not in body and "input_ids" not in body:
        body["input_ids"] = PROMPT
    return body


def _expected(model: Path, h: Harness, rid: str, start: int = 0) -> np.ndarray:
    """Reference rows for one request: CPU transformers routing of prompt + completion - 1, from start."""
    r = h.sched.reqs[rid]
    return reference_routing(model, (r.prompt + r.completion)[:-1])[start:]


def _decode(meta: dict[str, Any], rows: int) -> np.ndarray:
    """The rr client's strict decode of one answer's meta_info."""
    return decode_meta_info(meta, rows=rows, num_layers=L, topk=K, num_experts=E, moe_layers=MOE_LAYERS)


def _assert_rr(meta: dict[str, Any], expected: np.ndarray, start: int = 0) -> None:
    """meta_info carries rr's wire format and decodes to exactly the reference rows."""
    assert meta["routed_experts_format"] == "npy"
    assert meta["routed_experts_dtype"] == "uint8"
    assert meta["routed_experts_shape"] == list(expected.shape)
    assert meta["routed_experts_start"] == start
    got = _decode(meta, rows=expected.shape[0])
    np.testing.assert_array_equal(got, expected.astype(np.uint8))


@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
async def test_unpatched_engine_answer(tiny_moe: Path, skip: bool) -> None:
    """Unpatched: 0.5.7-0.5.9 + skip_tokenizer_init loses routing as ``{}``; otherwise headerless int32."""
    h = Harness(tiny_moe, skip_tokenizer_init=skip)
    status, body = await h.post(_body(return_routed_experts=True))
    assert status == 200
    meta = body["meta_info"]
    ref = _expected(tiny_moe, h, meta["id"])
    if skip and h.profile.release <= (0, 5, 9):
        assert meta["routed_experts"] == {}, "the {} bug should reproduce on this version"
        with pytest.raises(MissingRoutingError):
            _decode(meta, rows=ref.shape[0])
        return
    assert isinstance(meta["routed_experts"], str) and "routed_experts_format" not in meta
    got = decode_meta_info(meta, rows=ref.shape[0], num_layers=L, topk=K)  # SGLang's own int32 format
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
async def test_patched_normal_path(tiny_moe: Path, patched: None, skip: bool) -> None:
    """Patched: routing arrives intact in rr's format, equal to the reference, through the real /generate."""
    h = Harness(tiny_moe, skip_tokenizer_init=skip)
    status, body = await h.post(_body(return_routed_experts=True))
    assert status == 200
    meta = body["meta_info"]
    _assert_rr(meta, _expected(tiny_moe, h, meta["id"]))
    assert "routed_experts_error" not in meta


async def test_patched_text_batch(tiny_moe: Path, patched: None) -> None:
    """A batch /generate (list of prompts) answers a list, each with its own rows."""
    h = Harness(tiny_moe)
    status, body = await h.post(
        _body(text=["hello world", "the quick brown fox jumps"], return_routed_experts=True), n_requests=2
    )
    assert status == 200 and isinstance(body, list) and len(body) == 2
    for item in body:
        _assert_rr(item["meta_info"], _expected(tiny_moe, h, item["meta_info"]["id"]))


async def test_not_asked_is_stripped_but_scheduler_was_asked(tiny_moe: Path, patched: None) -> None:
    """A request without the flag reaches the scheduler with it (forced) and answers without routing."""
    h = Harness(tiny_moe, skip_tokenizer_init=True)
    status, body = await h.post(_body())
    assert status == 200
    rid = body["meta_info"]["id"]
    assert h.sched.reqs[rid].asked is True
    assert not any(k.startswith("routed_experts") for k in body["meta_info"])


async def _mixed(h: Harness) -> tuple[list[Any], BaseException | None]:
    """B (no routing) then A and C (routing) in ONE scheduler batch, order [B, A, C]."""
    h.tm.event_loop = asyncio.get_running_loop()
    import httpx

    bodies = {
        rid: _body(rid=rid, input_ids=PROMPT[: 4 + i], return_routed_experts=rid != "B")
        for i, rid in enumerate(["A", "B", "C"])
    }
    transport = httpx.ASGITransport(app=h.http.app)
    err: BaseException | None = None
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as client:
        calls = [asyncio.ensure_future(client.post("/generate", json=b, timeout=60)) for b in bodies.values()]
        await h._wait_for(3)
        states = {rid: h.tm.rid_to_state[rid] for rid in ("A", "B", "C")}
        try:
            await h.deliver(h.sched.step(["B", "A", "C"]))
        except IndexError as e:  # what kills SGLang's handle_loop in production
            err = e
            for rid, st in states.items():  # wake the HTTP calls (0.5.11+ notifies only after the loop)
                if not st.out_list:
                    st.out_list.append({"meta_info": {"id": rid, "aborted_by_test": True}})
                st.finished = True
                st.event.set()
        resps = await asyncio.gather(*calls)
    return [r.json() for r in resps], err


async def test_mixed_batch_unpatched(tiny_moe: Path) -> None:
    """<= 0.5.12: B (did not ask) gets A's rows, A gets C's, then the handler dies (IndexError); fixed in 0.5.13."""
    h = Harness(tiny_moe)
    (a, b, c), err = await _mixed(h)
    if h.profile.mixed_batch_bug:
        assert isinstance(err, IndexError)
        for victim, owner in ((b, "A"), (a, "C")):  # each silently holds another request's rows
            leaked = decode_meta_info(victim["meta_info"], num_layers=L, topk=K)
            np.testing.assert_array_equal(leaked, _expected(tiny_moe, h, owner))
    else:
        assert err is None and "routed_experts" not in b["meta_info"]


@pytest.mark.parametrize("sglang_code", [False, True], ids=["standin_batch", "sglang_code"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
async def test_mixed_batch_patched(tiny_moe: Path, patched: None, skip: bool, sglang_code: bool) -> None:
    """Patched, every version: each asker gets exactly its own rows, B gets none, nothing crashes.

    ``sglang_code``: the scheduler batch is built by SGLang's own output function (tests/sglang/standin.py).
    """
    h = Harness(tiny_moe, skip_tokenizer_init=skip)
    h.sched.sglang_builds_output = sglang_code
    (a, b, c), err = await _mixed(h)
    assert err is None
    assert all(h.sched.reqs[r].asked for r in "ABC")
    _assert_rr(a["meta_info"], _expected(tiny_moe, h, "A"))
    _assert_rr(c["meta_info"], _expected(tiny_moe, h, "C"))
    assert not any(k.startswith("routed_experts") for k in b["meta_info"])
    assert _expected(tiny_moe, h, "A").shape != _expected(tiny_moe, h, "C").shape


@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
async def test_streaming_final_chunk(tiny_moe: Path, patched: None, skip: bool) -> None:
    """Streaming: only the final chunk carries routing, in rr's format, equal to the reference."""
    h = Harness(tiny_moe, skip_tokenizer_init=skip)
    status, events = await h.post(_body(stream=True, return_routed_experts=True), chunks=3)
    assert status == 200 and len(events) >= 2
    *middle, last = events
    for ev in middle:
        assert ev["meta_info"]["finish_reason"] is None
        assert not any(k.startswith("routed_experts") for k in ev["meta_info"])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    _assert_rr(last["meta_info"], _expected(tiny_moe, h, last["meta_info"]["id"]))


@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
async def test_routed_experts_start(tiny_moe: Path, patched: None, skip: bool) -> None:
    """routed_experts_start_len=3: rows [3, P+R-1) on every version (sliced by rr where SGLang ignores it)."""
    h = Harness(tiny_moe, skip_tokenizer_init=skip)
    status, body = await h.post(_body(return_routed_experts=True, routed_experts_start_len=3))
    assert status == 200
    meta = body["meta_info"]
    start = 3 if profile_for().has_start_field else 0  # 0.5.7 has no such request field
    _assert_rr(meta, _expected(tiny_moe, h, meta["id"], start), start=start)
    assert meta["routed_experts_shape"][0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start


@pytest.mark.parametrize("corrupt", ["out_of_range", "wrong_size", "not_int"])
async def test_refused_payload_never_forwarded(
    tiny_moe: Path, patched: None, corrupt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload rr cannot trust is replaced by null + routed_experts_error; the client raises a typed error."""
    import torch

    h = Harness(tiny_moe, skip_tokenizer_init=True)
    real = h.sched.routing_rows

    def bad_rows(req: Any) -> Any:
        rows = real(req)
        if corrupt == "out_of_range":
            rows[0, 0, 0] = E + 3
        elif corrupt == "wrong_size":
            rows = rows.reshape(-1)[:-1]
        else:
            rows = rows.to(torch.float32)
        return rows

    monkeypatch.setattr(h.sched, "routing_rows", bad_rows)
    status, body = await h.post(_body(return_routed_experts=True))
    assert status == 200
    meta = body["meta_info"]
    assert meta["routed_experts"] is None
    expected_type = {
        "out_of_range": "ExpertIdOutOfRangeError",
        "wrong_size": "ShapeMismatchError",
        "not_int": "MalformedPayloadError",
    }[corrupt]
    assert meta["routed_experts_error"].startswith(expected_type)
    with pytest.raises(getattr(rr_errors, expected_type), match="withheld"):  # the client raises the named type
        _decode(meta, rows=3)


async def test_always_env_gives_routing_without_flag(
    tiny_moe: Path, patched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind sglang-router 0.3.2 (drops the flag): RR_SGLANG_ALWAYS_RETURN_ROUTED_EXPERTS=1 still answers routing."""
    from rr_patches.sglang.hooks import ALWAYS_ENV

    monkeypatch.setenv(ALWAYS_ENV, "1")
    h = Harness(tiny_moe, skip_tokenizer_init=True)
    status, body = await h.post(_body())  # no return_routed_experts, as the router forwards it
    assert status == 200
    _assert_rr(body["meta_info"], _expected(tiny_moe, h, body["meta_info"]["id"]))


async def test_detokenizer_payload_per_version(tiny_moe: Path, patched: None) -> None:
    """What SGLang's real detokenizer hands the TokenizerManager: rr's compact ``.npy`` from 0.5.22 (rr's plugin
    loads in the detokenizer there), SGLang's headerless int32 before; the answer is the same checked routing."""
    import base64

    h = Harness(tiny_moe)
    field = profile_for().field
    payloads: list[Any] = []
    detokenize = h.detok.handle_batch_token_id_out  # SGLang's method, with rr's class-level hook when patched

    def spy(recv_obj: Any) -> Any:
        out = detokenize(recv_obj)
        payloads.extend(p for p in (getattr(out, field, None) or []) if p is not None)  # before the TM sees it
        return out

    h.detok.handle_batch_token_id_out = spy
    status, body = await h.post(_body(return_routed_experts=True))
    assert status == 200
    meta = body["meta_info"]
    _assert_rr(meta, _expected(tiny_moe, h, meta["id"]))
    assert payloads, "the detokenizer handed over no routing"
    rows, layers, topk = meta["routed_experts_shape"]
    if not isinstance(payloads[-1], str):  # <= 0.5.10: the detokenizer passes SGLang's tensor through
        assert not profile_for().detok_encodes and tuple(payloads[-1].shape)[1:] == (layers, topk)
        return
    raw = base64.b64decode(payloads[-1])
    if profile_for().detok_encodes:
        import io

        arr = np.load(io.BytesIO(raw), allow_pickle=False)  # rr's compact .npy, not int32
        assert arr.dtype == np.uint8 and arr.shape[1:] == (layers, topk)
    else:
        assert raw[:6] != b"\x93NUMPY" and len(raw) == rows * layers * topk * 4, "SGLang's own headerless int32"
