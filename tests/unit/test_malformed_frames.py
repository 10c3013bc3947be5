"""Every malformed routing frame, ``.npy`` payload or read request is a typed refusal (issue 36, item 7).

A frame or payload comes from a server the client does not control: whatever its bytes, decoding ends in rows or
in an :class:`RRError`, never numpy's ``ValueError``/``OverflowError`` or a ``RecursionError``. The read route
answers any body with a 4xx naming what is wrong (never a 500) and keeps serving.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pybase64
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rr_client.core.codec import check_routing, decode_routed_experts
from rr_client.core.errors import MalformedPayloadError, RRError
from rr_client.core.reference import (
    FRAME_MEDIA_TYPE,
    READ_PATH,
    ROWS_SCHEMA,
    FramePart,
    RoutingRef,
    checksum,
    decode_frame,
    encode_frame,
)
from rr_server.serving.store import STORE_ROUTES, MemoryStore
from rr_server.serving.store import install as rs
from tests.support.routing_data import make_routing, small_moe_info

INFO = small_moe_info()
HUGE = [2**31, 2**40, 2**62, 2**63, 2**64, 2**70, 10**30]
# every kind of JSON value a hostile header may put in a field: huge and negative ints, bools, floats, strings,
# nulls, lists and objects
hostile = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.sampled_from(HUGE),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.sampled_from(["uint8", "uint16", "float64", "k"]),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
dims = st.one_of(st.integers(min_value=0, max_value=4), st.sampled_from(HUGE), st.integers(min_value=-3, max_value=-1))


def _frame(header: Any, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _part(shape: Any, **over: Any) -> dict[str, Any]:
    rows = shape[0] if isinstance(shape, list) and shape and isinstance(shape[0], int) else 0
    return {
        "key": "k",
        "start": 0,
        "stop": rows,
        "shape": shape,
        "dtype": "uint8",
        "offset": 0,
        "nbytes": 0,
        "checksum": checksum(np.zeros(0, np.uint8)),
        **over,
    }


def _refused_or_rows(body: bytes) -> None:
    """Decoding ``body`` gives parts whose rows match their header, or raises an RRError (anything else fails)."""
    try:
        parts = decode_frame(body)
    except RRError:
        return
    for p in parts:
        assert p.rows.ndim == 3 and p.rows.shape[0] == p.stop - p.start and checksum(p.rows) == p.digest


@pytest.mark.parametrize(
    "shape", [[0, 2**40, 2**40], [0, 2**70, 1], [2**70, 0, 1], [0, 0, 0], [1, 2**62, 2**62], [0, 1, 2**64]], ids=str
)
def test_the_issues_shapes_are_refused(shape: list[int]) -> None:
    with pytest.raises(MalformedPayloadError, match="shape"):
        decode_frame(_frame({"schema": ROWS_SCHEMA, "parts": [_part(shape)]}))


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_a_deeply_nested_header_is_refused_before_json_parses_it(opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    with pytest.raises(MalformedPayloadError, match="nests 100000 deep"):
        decode_frame(_frame(opener * 100_000 + b"1" + closer * 100_000))
    # brackets inside strings are text, not nesting: a real header with such a key still decodes
    rows = make_routing(2, 3, 2, 8, moe_layers=[0, 2], seed=0).astype(np.uint8)
    key = '[[[[[[[[[[{{{{{{{{{{"\\"[['
    assert decode_frame(encode_frame([FramePart(key, 0, 2, rows)]))[0].key == key


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes(body: bytes) -> None:
    _refused_or_rows(body)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.one_of(st.lists(dims, min_size=3, max_size=3), st.lists(dims, max_size=5), hostile),
    fields=st.dictionaries(
        st.sampled_from(["key", "start", "stop", "dtype", "offset", "nbytes", "checksum"]), hostile, max_size=3
    ),
    data=st.binary(max_size=64),
)
def test_hostile_header_fields(shape: Any, fields: dict[str, Any], data: bytes) -> None:
    _refused_or_rows(_frame({"schema": ROWS_SCHEMA, "parts": [_part(shape, **fields)]}, data))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_valid_frame_with_any_byte_changed(data: st.DataObject) -> None:
    rows = make_routing(3, 3, 2, 8, moe_layers=[0, 2], seed=1).astype(np.uint8)
    good = bytearray(encode_frame([FramePart("k1", 0, 3, rows), FramePart("k2", 1, 2, rows[1:2])]))
    for _ in range(data.draw(st.integers(1, 4))):
        good[data.draw(st.integers(0, len(good) - 1))] = data.draw(st.integers(0, 255))
    _refused_or_rows(bytes(good))


# ------------------------------------------------------------------ the codec's .npy and ndarray-dict headers


def _npy(shape: Any, data: bytes = b"") -> bytes:
    text = "{'descr': '|u1', 'fortran_order': False, 'shape': %r, }" % (shape,)  # noqa: UP031 - np.save's header
    body = (text + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body + data


@pytest.mark.parametrize("shape", [(0, 2**40, 2**40), (2**70,), (2**32, 2**32), (0, 2**70, 1), (1,) * 70], ids=str)
def test_npy_and_dict_shapes_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(MalformedPayloadError, match="shape"):
        decode_routed_experts(_npy(shape))
    with pytest.raises(MalformedPayloadError, match="shape"):
        decode_routed_experts({"data": "", "shape": list(shape), "dtype": "uint8"})


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(dims, max_size=5), data=st.binary(max_size=48), as_dict=st.booleans())
def test_npy_any_shape(shape: list[int], data: bytes, as_dict: bool) -> None:
    payload: Any = (
        {"data": pybase64.b64encode(data).decode(), "shape": shape, "dtype": "uint8"}
        if as_dict
        else _npy(tuple(shape), data)
    )
    try:
        arr = decode_routed_experts(payload)
    except RRError:
        return
    assert list(arr.shape) == shape and arr.nbytes == len(data)


# ------------------------------------------------------------------ the read route's request body


@pytest.fixture(scope="module")
def read_client() -> Iterator[tuple[Any, RoutingRef]]:
    """The store's real routes in a Starlette app (TestClient), with one held ref."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    store = MemoryStore(1 << 20, "http://rr-store.test")
    rows = make_routing(4, 3, 2, 8, moe_layers=INFO.moe_layers, seed=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rs, "_STORE", store)
        ref = RoutingRef.from_dict(store.put(check_routing(rows, INFO, rows=4)))
        app = Starlette(routes=[Route(p, h, methods=list(m)) for p, h, m in STORE_ROUTES])
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, ref


def _still_serves(client: Any, ref: RoutingRef) -> None:
    r = client.post(READ_PATH, content=json.dumps({"refs": [{"store": ref.store, "key": ref.key}]}))
    assert r.status_code == 200 and r.headers["content-type"].startswith(FRAME_MEDIA_TYPE)
    assert decode_frame(r.content)[0].digest == ref.checksum


def _answered_4xx(client: Any, body: bytes) -> None:
    r = client.post(READ_PATH, content=body)
    if r.status_code == 200:
        decode_frame(r.content)  # a body that happens to name the held key
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"refs":' + b"[" * 50_000,
        b"",
        b"\xff",
        b"null",
        b'{"refs": [{"store": "s", "key": "k", "start": 1e400}]}',
        b'{"refs": [{"store": "s", "key": "k", "stop": 100000000000000000000000}]}',
    ],
    ids=["deep", "deep-refs", "empty", "not-utf8", "null", "inf", "huge-stop"],
)
def test_read_route_refuses_bad_bodies_and_keeps_serving(read_client: Any, body: bytes) -> None:
    client, ref = read_client
    _answered_4xx(client, body)
    _still_serves(client, ref)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    refs=st.one_of(
        hostile,
        st.lists(st.dictionaries(st.sampled_from(["store", "key", "start", "stop"]), hostile, max_size=4), max_size=3),
    ),
    raw=st.binary(max_size=40),
    as_raw=st.booleans(),
)
def test_read_route_any_body(read_client: Any, refs: Any, raw: bytes, as_raw: bool) -> None:
    client, ref = read_client
    _answered_4xx(client, raw if as_raw else json.dumps({"refs": refs}).encode())


def test_read_route_rows_of_the_held_key_with_hostile_ranges(read_client: Any) -> None:
    client, ref = read_client
    for start, stop in ((0, 2**70), (2**70, None), (3, 1), (-1, 2)):
        body = json.dumps({"refs": [{"store": ref.store, "key": ref.key, "start": start, "stop": stop}]}).encode()
        r = client.post(READ_PATH, content=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (start, stop, r.status_code)
    _still_serves(client, ref)


@settings(max_examples=150, deadline=None)
@given(stated=hostile, dtype=hostile)
def test_stated_shape_and_dtype_of_any_kind(stated: Any, dtype: Any) -> None:
    """What a sender states next to the payload (``routed_experts_shape`` / ``_dtype``) is compared, never trusted."""
    from rr_client.core.codec import check_payload, decode_meta_info, encode_routed_experts

    good = check_routing(make_routing(2, 3, 2, 8, moe_layers=INFO.moe_layers, seed=4), INFO, rows=2)
    for call in (
        lambda: check_payload(good.array, INFO, rows=2, stated_shape=stated),
        lambda: decode_meta_info(
            {
                "routed_experts": encode_routed_experts(good),
                "routed_experts_shape": stated,
                "routed_experts_dtype": dtype,
            }
        ),
    ):
        try:
            call()
        except RRError:
            pass
