"""Codec: round trips, every foreign format, and a corpus of bad payloads that must each raise its typed error."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pybase64
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rr_client.core import _rowcheck, codec, errors
from rr_client.core.info import RRInfo
from tests.support.routing_data import make_routing, npy_payload

L, K, E = 4, 2, 8
ROWS = 7
INFO = RRInfo.from_hf_config(
    {"num_hidden_layers": L, "num_experts": E, "num_experts_per_tok": K}, engine="test", engine_version="0"
)


def npy_b64(arr: np.ndarray) -> str:
    """What vLLM 0.22-0.30 sends: base64 of ``np.save``."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


# ------------------------------------------------------------------ dtype rule and encoder


def test_wire_dtype_switches_above_256_inclusive() -> None:
    assert codec.wire_dtype(8) == np.uint8
    assert codec.wire_dtype(256) == np.uint8
    assert codec.wire_dtype(257) == np.uint16
    assert codec.wire_dtype(65536) == np.uint16
    with pytest.raises(ValueError):
        codec.wire_dtype(65537)
    with pytest.raises(ValueError):
        codec.wire_dtype(0)


def test_expected_rows() -> None:
    assert codec.expected_rows(5, 3) == 7
    assert codec.expected_rows(5, 3, start=2) == 5
    assert codec.expected_rows(1, 0) == 0


def test_encoded_payload_is_np_load_compatible_and_compact() -> None:
    ids = make_routing(ROWS, L, K, E)
    payload = codec.encode_routed_experts(codec.check_routing(ids, INFO, rows=ROWS))
    loaded = np.load(io.BytesIO(base64.b64decode(payload)))
    assert loaded.dtype == np.uint8 and loaded.shape == (ROWS, L, K)
    np.testing.assert_array_equal(loaded, ids)
    # header identical to numpy's own writer
    buf = io.BytesIO()
    np.save(buf, ids.astype(np.uint8))
    assert base64.b64decode(payload) == buf.getvalue()
    assert payload == npy_payload(ids, num_experts=E)


def test_check_payload_accepts_torch_and_int64_and_picks_uint16() -> None:
    ids = make_routing(ROWS, L, K, 300)
    info300 = INFO.model_copy(update={"num_experts": 300})
    checked = codec.check_payload(torch.from_numpy(ids.astype(np.int64)), info300, rows=ROWS)
    payload = codec.encode_routed_experts(checked)
    out = codec.decode_routed_experts(payload, rows=ROWS, num_layers=L, topk=K, num_experts=300)
    assert out.dtype == np.uint16
    np.testing.assert_array_equal(out, ids)


def test_encoder_takes_only_checked_routing() -> None:
    """The only public encoder refuses a raw array: nothing reaches the wire without the check."""
    with pytest.raises(TypeError, match="CheckedRouting"):
        codec.encode_routed_experts(make_routing(ROWS, L, K, E))  # type: ignore[arg-type]


def test_check_payload_refuses_out_of_range_and_bad_input() -> None:
    ids = make_routing(ROWS, L, K, E)
    ids[3, 1, 0] = E
    with pytest.raises(errors.ExpertIdOutOfRangeError, match=r"expert id 8 .* outside \[0, 8\)"):
        codec.check_payload(ids, INFO, rows=ROWS)
    ids[3, 1, 0] = -1
    with pytest.raises(errors.ExpertIdOutOfRangeError):
        codec.check_payload(ids, INFO, rows=ROWS)
    with pytest.raises(errors.MalformedPayloadError, match="integer"):
        codec.check_payload(np.zeros((ROWS, L, K), np.float32), INFO, rows=ROWS)
    with pytest.raises(errors.MissingRoutingError):
        codec.check_payload(None, INFO, rows=ROWS)


def test_check_payload_one_door_for_every_format() -> None:
    """rr/vLLM .npy, SGLang's headerless int32, lists and arrays all give the same checked routing."""
    ids = make_routing(ROWS, L, K, E)
    want = codec.check_routing(ids, INFO, rows=ROWS).array
    int32 = pybase64.b64encode(ids.astype("<i4").tobytes()).decode()
    for payload, kw in (
        (npy_payload(ids, num_experts=E), {}),
        (int32, {}),
        (ids.tolist(), {}),
        (torch.from_numpy(ids), {}),
        (ids.astype(np.uint8).tobytes(), {"dtype": "uint8"}),
    ):
        got = codec.check_payload(payload, INFO, rows=ROWS, **kw)
        assert isinstance(got, codec.CheckedRouting)
        np.testing.assert_array_equal(got.array, want)
    # drop_rows: an engine that ignores routed_experts_start returns every row; the door drops them first
    started = codec.check_payload(int32, INFO, rows=ROWS - 2, start=2, drop_rows=2)
    np.testing.assert_array_equal(started.array, want[2:])
    assert started.start == 2
    with pytest.raises(errors.ShapeMismatchError, match="exceeds the 7 rows"):
        codec.check_payload(int32, INFO, rows=0, start=9, drop_rows=9)
    with pytest.raises(errors.ShapeMismatchError, match="stated routed_experts_shape"):
        codec.check_payload(int32, INFO, rows=ROWS, stated_shape=[ROWS + 1, L, K])


def test_routing_meta_fields_states_shape_dtype_start() -> None:
    ids = make_routing(ROWS, L, K, E)
    checked = codec.check_routing(ids, INFO, rows=ROWS, start=3)
    meta = codec.routing_meta_fields(checked)
    assert meta["routed_experts_shape"] == [ROWS, L, K]
    assert meta["routed_experts_dtype"] == "uint8"
    assert meta["routed_experts_format"] == "npy"
    assert meta["routed_experts_start"] == 3
    assert meta["routed_experts"] == codec.encode_routed_experts(checked)  # the same bytes as the encoder
    np.testing.assert_array_equal(codec.decode_meta_info(meta, num_experts=E), ids)


def test_routing_meta_fields_takes_only_checked_routing() -> None:
    """Nothing reaches the wire unchecked: a raw array is refused, only check_routing's result is taken."""
    ids = make_routing(ROWS, L, K, E)
    with pytest.raises(TypeError, match="CheckedRouting"):
        codec.routing_meta_fields(ids)  # type: ignore[arg-type]
    assert isinstance(codec.check_routing(ids, INFO, rows=ROWS), codec.CheckedRouting)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 40),
    layers=st.integers(1, 6),
    topk=st.integers(1, 8),
    extra=st.integers(0, 600),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(rows: int, layers: int, topk: int, extra: int, seed: int) -> None:
    num_experts = topk + extra
    ids = make_routing(rows, layers, topk, num_experts, seed=seed)
    payload = npy_payload(ids, num_experts=num_experts)
    out = codec.decode_routed_experts(payload, rows=rows, num_layers=layers, topk=topk, num_experts=num_experts)
    assert out.dtype == codec.wire_dtype(num_experts)
    assert out.shape == (rows, layers, topk)
    np.testing.assert_array_equal(out, ids)


# ------------------------------------------------------------------ every format in the wild


def test_decodes_sglang_headerless_int32() -> None:
    ids = make_routing(ROWS, L, K, E)
    payload = pybase64.b64encode(ids.astype(np.int32).tobytes()).decode()  # SGLang / slime / miles
    out = codec.decode_routed_experts(payload, rows=ROWS, num_layers=L, topk=K, num_experts=E)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, ids)


def test_decodes_sglang_with_stated_dtype() -> None:
    ids = make_routing(ROWS, L, K, E)
    meta = {
        "routed_experts": base64.b64encode(ids.astype(np.uint16).tobytes()).decode(),
        "routed_experts_dtype": "uint16",
    }
    np.testing.assert_array_equal(codec.decode_meta_info(meta, rows=ROWS, num_layers=L, topk=K, num_experts=E), ids)
    # SGLang 0.5.7's field name
    meta = {"output_routed_experts": base64.b64encode(ids.astype(np.int32).tobytes()).decode()}
    np.testing.assert_array_equal(codec.decode_meta_info(meta, rows=ROWS, num_layers=L, topk=K, num_experts=E), ids)


@pytest.mark.parametrize("num_experts", [8, 256, 300])
def test_decodes_vllm_npy(num_experts: int) -> None:
    ids = make_routing(ROWS, L, K, num_experts)
    arr = ids.astype(np.uint8 if num_experts <= 256 else np.uint16)  # vLLM 0.22-0.30
    out = codec.decode_routed_experts(npy_b64(arr), rows=ROWS, num_layers=L, topk=K, num_experts=num_experts)
    np.testing.assert_array_equal(out, ids)


def test_decodes_vllm_021_nested_lists_after_json() -> None:
    ids = make_routing(ROWS, L, K, E)
    payload = json.loads(json.dumps(ids.astype(np.int16).tolist()))
    np.testing.assert_array_equal(codec.decode_routed_experts(payload, rows=ROWS, num_experts=E), ids)


def test_decodes_ms_swift_ndarray_dict() -> None:
    ids = make_routing(ROWS, L, K, E).astype(np.int64)
    payload = {
        "data": base64.b64encode(ids.tobytes()).decode(),
        "shape": list(ids.shape),
        "dtype": "int64",
        "__ndarray__": True,
    }
    got = codec.decode_routed_experts(payload, rows=ROWS, num_layers=L, topk=K, num_experts=E)
    np.testing.assert_array_equal(got, ids)


def test_decodes_raw_bytes_numpy_and_torch() -> None:
    ids = make_routing(ROWS, L, K, E)
    raw = base64.b64decode(npy_b64(ids.astype(np.uint8)))
    np.testing.assert_array_equal(codec.decode_routed_experts(raw, num_experts=E), ids)
    got = codec.decode_routed_experts(ids.astype(np.int32).tobytes(), num_layers=L, topk=K, num_experts=E)
    np.testing.assert_array_equal(got, ids)
    np.testing.assert_array_equal(codec.decode_routed_experts(torch.from_numpy(ids), num_experts=E), ids)
    np.testing.assert_array_equal(codec.decode_routed_experts(ids, num_experts=E), ids)


def test_all_formats_agree() -> None:
    ids = make_routing(ROWS, L, K, E)
    kw = dict(rows=ROWS, num_layers=L, topk=K, num_experts=E)
    outs = [
        codec.decode_routed_experts(npy_payload(ids, num_experts=E), **kw),
        codec.decode_routed_experts(pybase64.b64encode(ids.tobytes()).decode(), **kw),
        codec.decode_routed_experts(npy_b64(ids.astype(np.uint8)), **kw),
        codec.decode_routed_experts(ids.tolist(), **kw),
        codec.decode_routed_experts(
            {"data": base64.b64encode(ids.tobytes()).decode(), "shape": list(ids.shape), "dtype": "int32"}, **kw
        ),
    ]
    for o in outs:
        assert o.dtype == np.uint8
        np.testing.assert_array_equal(o, outs[0])


def test_dense_layers_checked_with_moe_layers() -> None:
    ids = make_routing(ROWS, L, K, E, moe_layers=[1, 2, 3])
    out = codec.decode_routed_experts(npy_payload(ids, num_experts=E), num_experts=E, moe_layers=[1, 2, 3])
    assert not out[:, 0].any()
    with pytest.raises(errors.UnrecordedRoutingError):  # dense zero rows are not real routing if called MoE
        codec.decode_routed_experts(npy_payload(ids, num_experts=E), num_experts=E)
    shifted = make_routing(ROWS, L, K, E, moe_layers=[0, 1, 2])  # layer axis off by one
    with pytest.raises(errors.ShapeMismatchError, match="dense layer"):
        codec.decode_routed_experts(npy_payload(shifted, num_experts=E), num_experts=E, moe_layers=[1, 2, 3])


def test_extra_rows_only_behind_option() -> None:
    ids = make_routing(ROWS + 1, L, K, E)
    payload = npy_payload(ids, num_experts=E)
    with pytest.raises(errors.ShapeMismatchError, match=r"8 rows, expected 7"):
        codec.decode_routed_experts(payload, rows=ROWS, num_experts=E)
    out = codec.decode_routed_experts(payload, rows=ROWS, num_experts=E, allow_extra_rows=1)
    np.testing.assert_array_equal(out, ids[:ROWS])
    with pytest.raises(errors.ShapeMismatchError):  # two extra rows exceed the allowance
        codec.decode_routed_experts(
            npy_payload(make_routing(ROWS + 2, L, K, E), num_experts=E), rows=ROWS, num_experts=E, allow_extra_rows=1
        )


def test_validate_false_still_checks_shape() -> None:
    ids = make_routing(ROWS, L, K, E)
    ids[0, 0] = 0
    out = codec.decode_routed_experts(npy_payload(ids, num_experts=E), rows=ROWS, num_experts=E, validate=False)
    assert not out[0, 0].any()
    with pytest.raises(errors.ShapeMismatchError):
        codec.decode_routed_experts(npy_payload(ids, num_experts=E), rows=ROWS + 1, num_experts=E, validate=False)


# ------------------------------------------------------------------ the bad-payload corpus


def _good() -> np.ndarray:
    return make_routing(ROWS, L, K, E)


def _with(row: int, layer: int, values: list[int]) -> np.ndarray:
    ids = _good()
    ids[row, layer] = values
    return ids


def _npy_with_header(header: str, data: bytes) -> str:
    h = header.encode()
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data).decode()


GOOD_NPY = npy_payload(_good(), num_experts=E)
KW = dict(rows=ROWS, num_layers=L, topk=K, num_experts=E)

BAD_CORPUS: list[tuple[str, object, dict[str, object], type[errors.RoutedExpertsError], str]] = [
    (
        "truncated npy",
        base64.b64encode(base64.b64decode(GOOD_NPY)[:-5]).decode(),
        KW,
        errors.MalformedPayloadError,
        "needs",
    ),
    (
        "truncated header",
        base64.b64encode(base64.b64decode(GOOD_NPY)[:30]).decode(),
        KW,
        errors.MalformedPayloadError,
        "truncated",
    ),
    ("bad base64 chars", GOOD_NPY[:20] + "!!" + GOOD_NPY[22:], KW, errors.MalformedPayloadError, "base64"),
    ("base64 bad padding", GOOD_NPY[:-1], KW, errors.MalformedPayloadError, "base64"),
    (
        "urlsafe alphabet",
        base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode(),
        KW,
        errors.MalformedPayloadError,
        "base64",
    ),
    ("float npy", npy_b64(_good().astype(np.float32)), KW, errors.MalformedPayloadError, "not a little-endian integer"),
    ("big-endian npy", npy_b64(_good().astype(">i4")), KW, errors.MalformedPayloadError, "little-endian"),
    ("fortran npy", npy_b64(np.asfortranarray(_good().astype(np.uint8))), KW, errors.MalformedPayloadError, "Fortran"),
    (
        "npy version 9",
        base64.b64encode(b"\x93NUMPY\x09\x00" + b"\x00" * 40).decode(),
        KW,
        errors.MalformedPayloadError,
        "version",
    ),
    ("npy header not a dict", _npy_with_header("[1, 2]", b""), KW, errors.MalformedPayloadError, "exactly"),
    (
        "npy header code",
        _npy_with_header("{'descr': __import__('os'), 'fortran_order': False, 'shape': (1,)}", b""),
        KW,
        errors.MalformedPayloadError,
        "literal",
    ),
    (
        "npy extra header key",
        _npy_with_header("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 4, 2), 'x': 1}", b""),
        KW,
        errors.MalformedPayloadError,
        "exactly",
    ),
    (
        "npy negative shape",
        _npy_with_header("{'descr': '|u1', 'fortran_order': False, 'shape': (-1, 4, 2)}", b""),
        KW,
        errors.MalformedPayloadError,
        "non-negative",
    ),
    (
        "npy trailing bytes",
        base64.b64encode(base64.b64decode(GOOD_NPY) + b"\x00").decode(),
        KW,
        errors.MalformedPayloadError,
        "needs",
    ),
    (
        "stated dtype disagrees",
        {"routed_experts": GOOD_NPY, "routed_experts_dtype": "int32"},
        KW,
        errors.MalformedPayloadError,
        "stated",
    ),
    (
        "int32 decoded as uint8 width",
        pybase64.b64encode(_good().astype(np.uint8).tobytes()).decode(),
        KW,
        errors.ShapeMismatchError,
        "divide",
    ),
    (
        "headerless odd bytes",
        pybase64.b64encode(b"\x01\x02\x03").decode(),
        KW,
        errors.MalformedPayloadError,
        "whole number",
    ),
    (
        "wrong rows",
        npy_payload(make_routing(ROWS - 1, L, K, E), num_experts=E),
        KW,
        errors.ShapeMismatchError,
        "6 rows, expected 7",
    ),
    (
        "wrong layers",
        npy_payload(make_routing(ROWS, L + 1, K, E), num_experts=E),
        KW,
        errors.ShapeMismatchError,
        "5 layers",
    ),
    (
        "wrong topk",
        npy_payload(make_routing(ROWS, L, K + 1, E), num_experts=E),
        KW,
        errors.ShapeMismatchError,
        "top-k 3",
    ),
    (
        "2-D without dims",
        npy_b64(_good().reshape(ROWS, -1).astype(np.uint8)),
        {"num_experts": E},
        errors.ShapeMismatchError,
        "states no",
    ),
    ("4-D", npy_b64(_good()[None].astype(np.uint8)), KW, errors.ShapeMismatchError, "4-D"),
    (
        "id out of range",
        npy_b64(_with(2, 1, [1, E]).astype(np.uint8)),
        KW,
        errors.ExpertIdOutOfRangeError,
        "row 2 layer 1",
    ),
    (
        "negative id int32",
        pybase64.b64encode(_with(2, 1, [1, -1]).tobytes()).decode(),
        KW,
        errors.ExpertIdOutOfRangeError,
        "-1",
    ),
    (
        "huge id int32 wraps to valid uint8",
        pybase64.b64encode(_with(2, 1, [1, 256 + 3]).tobytes()).decode(),
        KW,
        errors.ExpertIdOutOfRangeError,
        "259",
    ),
    (
        "duplicate ids",
        npy_b64(_with(5, 3, [4, 4]).astype(np.uint8)),
        KW,
        errors.UnrecordedRoutingError,
        "row 5 layer 3 has repeated",
    ),
    ("all-zero MoE row", npy_b64(_with(0, 0, [0, 0]).astype(np.uint8)), KW, errors.UnrecordedRoutingError, "all-zero"),
    (
        "all-zero payload (vLLM torch.compile bug)",
        npy_b64(np.zeros((ROWS, L, K), np.uint8)),
        KW,
        errors.UnrecordedRoutingError,
        "all-zero",
    ),
    ("null", None, KW, errors.MissingRoutingError, "missing"),
    ("empty string", "", KW, errors.MissingRoutingError, "empty"),
    ("sglang {} loss", {}, KW, errors.MissingRoutingError, "skip-tokenizer-init"),
    ("unknown dict", {"foo": 1}, KW, errors.MalformedPayloadError, "not a known"),
    (
        "swift dict missing data",
        {"shape": [ROWS, L, K], "dtype": "int32", "__ndarray__": True},
        KW,
        errors.MalformedPayloadError,
        "'data'",
    ),
    (
        "swift dict wrong size",
        {"data": base64.b64encode(b"\x00" * 12).decode(), "shape": [ROWS, L, K], "dtype": "int32", "__ndarray__": True},
        KW,
        errors.MalformedPayloadError,
        "needs",
    ),
    (
        "swift dict float",
        {"data": base64.b64encode(b"\x00" * 4).decode(), "shape": [1], "dtype": "float32"},
        KW,
        errors.MalformedPayloadError,
        "integer",
    ),
    ("ragged lists", [[[1, 2]], [[1]]], KW, errors.MalformedPayloadError, "ragged"),
    ("float lists", [[[1.5, 2.0]] * L] * ROWS, KW, errors.MalformedPayloadError, "ints"),
    ("int payload", 12, KW, errors.MalformedPayloadError, "unsupported"),
]


@pytest.mark.parametrize("name,payload,kw,err,msg", BAD_CORPUS, ids=[c[0] for c in BAD_CORPUS])
def test_bad_payload_corpus(name: str, payload: object, kw: dict[str, object], err: type[Exception], msg: str) -> None:
    with pytest.raises(err, match=msg):
        if isinstance(payload, dict) and "routed_experts" in payload:
            codec.decode_meta_info(payload, **kw)
        else:
            codec.decode_routed_experts(payload, **kw)


def test_missing_field_in_meta_info() -> None:
    with pytest.raises(errors.MissingRoutingError, match="no 'routed_experts' field"):
        codec.decode_meta_info({"prompt_tokens": 3}, num_experts=E)


def test_stated_shape_must_match() -> None:
    meta = codec.routing_meta_fields(codec.check_routing(_good(), INFO, rows=ROWS))
    meta["routed_experts_shape"] = [ROWS + 1, L, K]
    with pytest.raises(errors.ShapeMismatchError, match="stated"):
        codec.decode_meta_info(meta, num_experts=E)


# ------------------------------------------------------------------ C and numpy checkers agree


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 70),
    layers=st.integers(1, 5),
    topk=st.sampled_from([1, 2, 3, 8]),
    wide=st.booleans(),
    corrupt=st.sampled_from(["none", "dup", "zero", "range", "dense"]),
    seed=st.integers(0, 2**31),
)
def test_c_checker_matches_numpy(rows: int, layers: int, topk: int, wide: bool, corrupt: str, seed: int) -> None:
    num_experts = 300 if wide else 16
    rng = np.random.default_rng(seed)
    moe = rng.random(layers) < 0.7
    ids = make_routing(rows, layers, topk, num_experts, moe_layers=list(np.flatnonzero(moe)), seed=seed)
    r, l = int(rng.integers(rows)), int(rng.integers(layers))
    if corrupt == "dup" and topk > 1:
        ids[r, l, 1] = ids[r, l, 0]
    elif corrupt == "zero":
        ids[r, l] = 0
    elif corrupt == "range":
        ids[r, l, 0] = num_experts - 1 + int(rng.integers(1, 3)) if wide else int(rng.integers(num_experts, 256))
    elif corrupt == "dense":
        ids[r, l, 0] = 1
    arr = np.ascontiguousarray(ids.astype(codec.wire_dtype(num_experts) if corrupt != "range" or wide else np.uint8))
    expect = _rowcheck.check_rows_numpy(arr, num_experts, moe)
    assert _rowcheck.check_rows(arr, num_experts, moe) == expect
    if corrupt == "none":
        assert expect[0] == _rowcheck.OK


def test_c_extension_is_built() -> None:
    # the fast path is what the benchmark measures; setup must have compiled it
    assert _rowcheck.HAVE_C


def test_server_withheld_routing_reason_is_surfaced() -> None:
    with pytest.raises(errors.MissingRoutingError, match="withheld routed_experts: rows 3 != 4"):
        codec.decode_meta_info({"routed_experts_error": "rows 3 != 4"}, num_experts=E)
    # a reason naming rr's typed error is raised as that type, so a trainer can catch it precisely
    with pytest.raises(errors.ShapeMismatchError, match="withheld routed_experts: ShapeMismatchError: x"):
        codec.decode_meta_info({"routed_experts": None, "routed_experts_error": "ShapeMismatchError: x"}, num_experts=E)
    with pytest.raises(errors.UnrecordedRoutingError):
        codec.decode_meta_info(
            {"routed_experts": None, "routed_experts_error": "UnrecordedRoutingError: y"}, num_experts=E
        )
    # a name that is not one of rr's routing errors is never looked up as something else
    with pytest.raises(errors.MissingRoutingError, match="KeyError: z"):
        codec.decode_meta_info({"routed_experts": None, "routed_experts_error": "KeyError: z"}, num_experts=E)


def test_aborted_request_says_so() -> None:
    # a request the engine aborted (queued when the server shut down) has no routing: the error names the abort
    aborted = {"type": "abort", "message": "Abort before prompt prefill"}
    with pytest.raises(errors.MissingRoutingError, match="engine aborted this request .*Abort before prompt prefill"):
        codec.decode_meta_info(
            {
                "finish_reason": aborted,
                "routed_experts": None,
                "routed_experts_error": "MissingRoutingError: no routing",
            },
            num_experts=E,
        )
    with pytest.raises(errors.MissingRoutingError, match="engine aborted this request"):
        codec.decode_meta_info({"finish_reason": aborted}, num_experts=E)
    # routing that is there is decoded whatever the finish reason says
    import base64
    import io

    arr = np.array([[[1, 2]]], dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, arr)
    got = codec.decode_meta_info(
        {"finish_reason": aborted, "routed_experts": base64.b64encode(buf.getvalue()).decode()}, num_experts=E
    )
    assert got.tolist() == arr.tolist()


def test_no_row_asked_and_an_empty_payload_is_zero_rows_but_an_empty_payload_for_rows_is_missing() -> None:
    """A P/D decode half of a one-token completion asks no row, and SGLang answers the base64 of no bytes: zero rows,
    checked. The same empty payload where rows were asked stays a refusal (the engine captured nothing)."""
    for empty in ("", b""):
        checked = codec.check_payload(empty, INFO, rows=0, start=7)
        assert checked.array.shape == (0, INFO.num_hidden_layers, INFO.topk) and checked.start == 7
    with pytest.raises(errors.MissingRoutingError, match="empty string"):
        codec.check_payload("", INFO, rows=1)
