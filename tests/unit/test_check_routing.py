"""check_routing: the one full check every producer runs; each failure kind raises its typed error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rr_client.core import errors
from rr_client.core.codec import CheckedRouting, check_routing, decode_meta_info, routing_meta_fields
from rr_client.core.info import RRInfo
from tests.support.routing_data import make_routing

ROWS, L, K = 6, 3, 2
MOE = [0, 2]  # layer 1 dense


def info(num_experts: int = 8) -> RRInfo:
    """A Qwen3-MoE-style model: 3 layers, layer 1 dense, top-2."""
    cfg = {"num_hidden_layers": L, "num_experts": num_experts, "num_experts_per_tok": K, "mlp_only_layers": [1]}
    return RRInfo.from_hf_config(cfg, engine="test", engine_version="0")


def good(num_experts: int = 8, rows: int = ROWS) -> np.ndarray:
    """Valid routing: distinct ids per MoE row, zero dense rows, int32."""
    return make_routing(rows, L, K, num_experts, moe_layers=MOE, seed=3)


@pytest.mark.parametrize("num_experts,dtype", [(8, np.uint8), (256, np.uint8), (300, np.uint16)])
@pytest.mark.parametrize("kind", ["int32", "int64", "torch-int32", "torch-int64", "uint8-wire"])
def test_accepts_any_int_array_returns_wire_dtype_c_contiguous(num_experts: int, dtype: type, kind: str) -> None:
    ids = good(num_experts)
    value: object = {
        "int32": ids.astype(np.int32),
        "int64": ids.astype(np.int64),
        "torch-int32": torch.from_numpy(ids.astype(np.int32)),
        "torch-int64": torch.from_numpy(ids.astype(np.int64)),
        "uint8-wire": ids.astype(np.uint8 if num_experts <= 256 else np.uint16),
    }[kind]
    checked = check_routing(value, info(num_experts), rows=ROWS, start=2)
    assert isinstance(checked, CheckedRouting)
    assert checked.array.dtype == dtype and checked.array.flags.c_contiguous
    assert checked.array.shape == (ROWS, L, K) and checked.start == 2
    np.testing.assert_array_equal(checked.array, ids)


def test_non_contiguous_input_comes_out_c_contiguous() -> None:
    ids = good()
    fortran = np.asfortranarray(ids.astype(np.int64))
    strided = np.ascontiguousarray(np.repeat(ids, 2, axis=0))[::2]  # every other row: a strided view
    for value in (fortran, strided, torch.from_numpy(ids.astype(np.int64).transpose(1, 0, 2).copy()).permute(1, 0, 2)):
        checked = check_routing(value, info(), rows=ROWS)
        assert checked.array.flags.c_contiguous and checked.array.dtype == np.uint8
        np.testing.assert_array_equal(checked.array, ids)


def test_checked_routing_encodes_to_what_decodes_back() -> None:
    ids = good(300)
    meta = routing_meta_fields(check_routing(torch.from_numpy(ids), info(300), rows=ROWS))
    assert meta["routed_experts_dtype"] == "uint16"
    np.testing.assert_array_equal(
        decode_meta_info(meta, rows=ROWS, num_layers=L, topk=K, num_experts=300, moe_layers=MOE), ids
    )


def _with(row: int, layer: int, values: list[int]) -> np.ndarray:
    ids = good()
    ids[row, layer] = values
    return ids


FAILURES: list[tuple[str, object, dict[str, int], type[errors.RoutedExpertsError], str]] = [
    ("too few rows", good(rows=ROWS - 1), {}, errors.ShapeMismatchError, "5 rows, expected 6"),
    ("too many rows", good(rows=ROWS + 1), {}, errors.ShapeMismatchError, "7 rows, expected 6"),
    ("extra row beyond allowance", good(rows=ROWS + 2), {"allow_extra_rows": 1}, errors.ShapeMismatchError, "8 rows"),
    ("wrong layers", make_routing(ROWS, L + 1, K, 8), {}, errors.ShapeMismatchError, "4 layers"),
    ("wrong top-k", make_routing(ROWS, L, K + 1, 8, moe_layers=MOE), {}, errors.ShapeMismatchError, "top-k 3"),
    ("2-D", good().reshape(ROWS, -1), {}, errors.ShapeMismatchError, "3-D"),
    ("id == num_experts", _with(2, 0, [1, 8]), {}, errors.ExpertIdOutOfRangeError, r"expert id 8 .* outside \[0, 8\)"),
    ("id > 255 in int32", _with(2, 0, [1, 259]), {}, errors.ExpertIdOutOfRangeError, "259"),
    ("negative id", _with(2, 2, [-1, 3]), {}, errors.ExpertIdOutOfRangeError, "-1"),
    ("all-zero MoE row", _with(4, 2, [0, 0]), {}, errors.UnrecordedRoutingError, "row 4 layer 2 has all-zero"),
    ("repeated ids", _with(1, 0, [5, 5]), {}, errors.UnrecordedRoutingError, "row 1 layer 0 has repeated ids"),
    ("all-zero payload", np.zeros((ROWS, L, K), np.int32), {}, errors.UnrecordedRoutingError, "all-zero"),
    ("non-zero dense layer", _with(3, 1, [1, 2]), {}, errors.ShapeMismatchError, "row 3 layer 1 is a dense layer"),
    ("float ids", good().astype(np.float32), {}, errors.MalformedPayloadError, "integer"),
    ("not an array", good().tolist(), {}, errors.MalformedPayloadError, "numpy array or torch tensor"),
    ("negative start", good(), {"start": -1}, errors.ShapeMismatchError, "routed_experts_start"),
]


@pytest.mark.parametrize("name,value,kw,err,msg", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failure_raises_its_typed_error(
    name: str, value: object, kw: dict[str, int], err: type[errors.RoutedExpertsError], msg: str
) -> None:
    with pytest.raises(err, match=msg):
        check_routing(value, info(), rows=ROWS, **kw)


def test_missing_routing() -> None:
    with pytest.raises(errors.MissingRoutingError, match="no routing"):
        check_routing(None, info(), rows=ROWS)


def test_allow_extra_rows_trims() -> None:
    ids = good(rows=ROWS + 1)
    checked = check_routing(ids, info(), rows=ROWS, allow_extra_rows=1)
    np.testing.assert_array_equal(checked.array, ids[:ROWS])


def test_zero_rows_are_valid() -> None:
    """A request whose start equals its token count asks for no rows: an empty, well-typed array."""
    checked = check_routing(np.zeros((0, L, K), np.int32), info(), rows=0, start=5)
    assert checked.array.shape == (0, L, K) and checked.array.dtype == np.uint8
