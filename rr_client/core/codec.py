"""The rr wire format, its encoder and a strict decoder for every routing format the engines emit.

Single source of truth for servers, the sidecar and the client. Spec: ``docs/wire-format.md``.
On the wire: standard base64 of a NumPy ``.npy`` v1.0 file, C-order, shape ``(rows, layers, topk)``,
dtype ``uint8`` when ``num_experts <= 256`` else ``uint16``.
"""

from __future__ import annotations

import ast
import binascii
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pybase64

import rr_client.core._rowcheck as _rowcheck
from rr_client.core.engines import SGLANG
from rr_client.core.errors import (
    ArgumentTypeError,
    ConfigurationError,
    ExpertIdOutOfRangeError,
    MalformedPayloadError,
    MissingRoutingError,
    RoutedExpertsError,
    ShapeMismatchError,
    UnrecordedRoutingError,
)

__all__ = [
    "NPY_MAGIC",
    "MAX_EXPERTS",
    "RoutingDims",
    "CheckedRouting",
    "wire_dtype",
    "check_routing",
    "check_payload",
    "encode_routed_experts",
    "routing_meta_fields",
    "FORMATS",
    "check_format",
    "routing_error_fields",
    "ReferenceStore",
    "decode_routed_experts",
    "decode_meta_info",
    "expected_rows",
    "checked_count",
]

NPY_MAGIC = b"\x93NUMPY"
MAX_EXPERTS = 65536
_MAX_HEADER = 4096
_MAX_NDIM = 32  # numpy's own limit is 64; routing is 1-, 2- or 3-D
_MAX_DIM = 2**31 - 1  # no routing axis comes near it; keeps numpy's size arithmetic exact
# routed_experts_format values: rr's .npy (the default) or SGLang's headerless int32
FORMATS = ("npy", "sglang", "ref")
# integer dtypes a routing payload may carry (little-endian or single byte); anything else is refused
_INT_DESCRS = {"|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8"}
_DTYPE_NAMES = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"}


def wire_dtype(num_experts: int) -> np.dtype[Any]:
    """``uint8`` for up to 256 experts (vLLM's rule, inclusive), ``uint16`` up to 65536."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ConfigurationError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts > MAX_EXPERTS:
        raise ConfigurationError(f"num_experts={num_experts} exceeds the wire format's limit of {MAX_EXPERTS}")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def expected_rows(prompt_tokens: int, completion_tokens: int, start: int = 0) -> int:
    """Rows an engine returns: every token but the last sampled one, from ``start`` on."""
    return max(prompt_tokens + completion_tokens - 1 - start, 0)


class RoutingDims(Protocol):
    """What a routing array is checked against; :class:`rr_client.RRInfo` is the one implementation."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def moe_layers(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class CheckedRouting:
    """Routing that passed :func:`check_routing`: C-contiguous ``(rows, L, K)`` in the wire dtype.

    Like a validated safetensors header: made once, trusted by every later user (the encoder).
    """

    array: np.ndarray
    start: int = 0


def check_routing(
    array: Any, dims: RoutingDims, *, rows: int, start: int = 0, allow_extra_rows: int = 0
) -> CheckedRouting:
    """The one full check every producer runs before encoding (vLLM plugin, SGLang patch, sidecar).

    Rows (``prompt + completion - 1 - start``), layers, top-k, id range, ``topk`` distinct ids in every
    MoE row (all-zero rows are the CPU ``torch.compile`` bug) and zero rows in dense layers. Takes a
    numpy array or torch tensor of any int dtype; raises a typed :class:`RoutedExpertsError`.
    """
    if array is None:
        raise MissingRoutingError("the engine returned no routing for this request")
    if start < 0:
        raise ShapeMismatchError(f"routed_experts_start must be >= 0, got {start}")
    arr = _as_int_array(array)
    if arr.ndim != 3:
        raise ShapeMismatchError(f"routing must be 3-D (rows, layers, topk), got shape {arr.shape}")
    arr = _checked_array(
        arr,
        rows=rows,
        num_layers=dims.num_hidden_layers,
        topk=dims.topk,
        num_experts=dims.num_experts,
        moe_layers=dims.moe_layers,
        allow_extra_rows=allow_extra_rows,
        validate=True,
    )
    return CheckedRouting(arr, int(start))


def check_payload(
    payload: Any,
    dims: RoutingDims,
    *,
    rows: int,
    start: int = 0,
    drop_rows: int = 0,
    dtype: Any = None,
    stated_shape: Sequence[int] | None = None,
) -> CheckedRouting:
    """The one door to the check: an engine's routing in any format -> :class:`CheckedRouting`, checked once.

    Every producer calls it once per sample (vLLM plugin, SGLang patch, sidecar, OpenAI path). ``payload``: a
    numpy array or torch tensor, rr/vLLM base64 ``.npy``, SGLang's headerless base64 (``dtype``, default int32),
    nested lists or ms-swift's dict. ``drop_rows`` leading rows are removed first (engines that ignore
    ``routed_experts_start``); ``rows`` is what must remain (``prompt + completion - 1 - start``);
    ``stated_shape`` (the sender's ``routed_experts_shape``) must match the payload before any row is dropped.
    """
    if payload is None:
        raise MissingRoutingError("the engine returned no routing for this request")
    if drop_rows < 0:
        raise ShapeMismatchError(f"routed_experts_start must be >= 0, got {drop_rows}")
    if rows == 0 and not drop_rows and isinstance(payload, (str, bytes)) and not payload:
        # no row asked (a P/D decode half of a one-token completion) and none sent: SGLang's base64 of no bytes
        payload = np.zeros((0, dims.num_hidden_layers or 0, dims.topk or 0), dtype=np.dtype(dtype or np.int32))
    arr = _shape3(_to_array(payload, dtype), dims.num_hidden_layers, dims.topk)
    if stated_shape is not None and (
        not isinstance(stated_shape, (list, tuple)) or [int(s) for s in arr.shape] != list(stated_shape)
    ):
        raise ShapeMismatchError(
            f"payload shape {list(arr.shape)} differs from stated routed_experts_shape {_short(stated_shape)}"
        )
    if drop_rows:
        if drop_rows > arr.shape[0]:
            raise ShapeMismatchError(f"routed_experts_start={drop_rows} exceeds the {arr.shape[0]} rows returned")
        arr = arr[drop_rows:]
    return check_routing(arr, dims, rows=rows, start=start)


# ----------------------------------------------------------------------------- encode


def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """A .npy v1.0 header, byte-identical to what ``np.save`` writes."""
    text = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (dtype.str, tuple(shape))  # noqa: UP031 - np.save's
    pad = 64 - (10 + len(text) + 1) % 64
    body = (text + " " * (pad % 64) + "\n").encode("latin1")
    return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(body)) + body


def _as_int_array(array: Any, *, holds: str = "routing must hold integer expert ids") -> np.ndarray:
    """numpy view of an int numpy array or torch tensor (no copy when already on CPU); ``holds`` begins the
    error for other dtypes (routing's, or the indexer's rows)."""
    if isinstance(array, np.ndarray):
        arr = array
    elif type(array).__module__.startswith("torch"):
        arr = array.detach().cpu().numpy()
    else:
        raise MalformedPayloadError(f"expected a numpy array or torch tensor, got {type(array).__name__}")
    if arr.dtype.kind not in "iu":
        raise MalformedPayloadError(f"{holds}, got dtype {arr.dtype}")
    return arr


def _check_range(arr: np.ndarray, num_experts: int) -> None:
    """Raise if any id is outside ``[0, num_experts)``; works for any int dtype before narrowing."""
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_experts:
        bad = (arr < 0) | (arr >= num_experts)
        idx = np.unravel_index(int(np.argmax(bad)), arr.shape)
        raise ExpertIdOutOfRangeError(
            f"expert id {int(arr[idx])} at (row, layer, k)={tuple(int(i) for i in idx)} outside [0, {num_experts})"
        )


def encode_routed_experts(checked: CheckedRouting) -> str:
    """rr's wire payload, base64 ``.npy`` in the wire dtype, of routing that passed :func:`check_routing`.

    The only public encoder, and it takes only :class:`CheckedRouting`: nothing reaches the wire unchecked.
    """
    if not isinstance(checked, CheckedRouting):
        raise ArgumentTypeError(
            f"encode_routed_experts takes a CheckedRouting from check_payload/check_routing, "
            f"got {type(checked).__name__}"
        )
    arr = checked.array
    return pybase64.b64encode(b"".join((_npy_header(arr.dtype, arr.shape), arr.data))).decode("ascii")


def check_format(fmt: Any) -> str:
    """A ``routed_experts_format`` value: ``"npy"`` (rr's), ``"sglang"`` or ``"ref"`` (:data:`FORMATS`); raises
    ConfigurationError (a ValueError) naming the field."""
    if fmt not in FORMATS:
        raise ConfigurationError(f"routed_experts_format must be one of {list(FORMATS)}, got {fmt!r}")
    return str(fmt)


class ReferenceStore(Protocol):
    """Where ``routed_experts_format="ref"`` keeps checked rows (every rr server holds one,
    ``rr_server.serving.store``): ``put`` returns the :class:`rr_client.RoutingRef` dict the answer carries."""

    def put(self, checked: CheckedRouting) -> dict[str, Any]:
        """Keep ``checked``'s rows; the ref dict naming them."""
        ...


def routing_meta_fields(
    checked: CheckedRouting, fmt: str = "npy", *, store: ReferenceStore | None = None
) -> dict[str, Any]:
    """The ``meta_info`` entries a server adds for one request: payload plus its stated shape and dtype.

    Takes only :class:`CheckedRouting` (made by :func:`check_routing`), so nothing reaches the wire unchecked.
    ``fmt="sglang"`` gives SGLang's own payload (headerless int32 base64) for clients that decode it themselves;
    ``fmt="ref"`` keeps the rows in ``store`` (the server's routing store, passed by the producer) and gives
    ``routed_experts_ref`` instead (:class:`rr_client.RoutingRef`).
    """
    if not isinstance(checked, CheckedRouting):
        raise ArgumentTypeError(
            f"routing_meta_fields takes a CheckedRouting from check_routing, got {type(checked).__name__}"
        )
    arr = checked.array
    if check_format(fmt) == "ref":
        if store is None:
            raise MissingRoutingError("routed_experts_format='ref': this server holds no routing store")
        return {
            "routed_experts_ref": store.put(checked),
            "routed_experts_shape": [int(s) for s in arr.shape],
            "routed_experts_dtype": arr.dtype.name,
            "routed_experts_format": fmt,
            "routed_experts_start": checked.start,
        }
    if check_format(fmt) == SGLANG.native_format:
        wide = arr.astype("<i4")  # C-contiguous copy: SGLang sends int32 ids with no header
        payload, dtype_name = pybase64.b64encode(wide.data).decode("ascii"), "int32"
    else:
        payload, dtype_name = encode_routed_experts(checked), arr.dtype.name
    return {
        "routed_experts": payload,
        "routed_experts_shape": [int(s) for s in arr.shape],
        "routed_experts_dtype": dtype_name,
        "routed_experts_format": fmt,
        "routed_experts_start": checked.start,
    }


def routing_error_fields(exc: RoutedExpertsError) -> dict[str, Any]:
    """What a sample carries instead of routing that failed :func:`check_routing` (clients raise on it)."""
    return {"routed_experts": None, "routed_experts_error": f"{type(exc).__name__}: {exc}"}


# ----------------------------------------------------------------------------- decode


def _b64decode(text: str | bytes) -> bytearray:
    """Strict standard base64 (no whitespace, no URL alphabet) into a writable buffer."""
    try:
        return pybase64.b64decode_as_bytearray(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise MalformedPayloadError(f"routed_experts is not valid standard base64: {e}") from e


def _parse_npy(buf: bytes | bytearray | memoryview) -> np.ndarray:
    """Parse a .npy file strictly: every header field is checked before the data is touched."""
    mv = memoryview(buf)
    if len(mv) < 10:
        raise MalformedPayloadError(f".npy payload truncated: {len(mv)} bytes, header needs at least 10")
    major, minor = mv[6], mv[7]
    if major == 1 and minor == 0:
        (hlen,), start = struct.unpack_from("<H", mv, 8), 10
    elif major in (2, 3) and minor == 0:
        if len(mv) < 12:
            raise MalformedPayloadError(".npy v2/v3 payload truncated inside its header length")
        (hlen,), start = struct.unpack_from("<I", mv, 8), 12
    else:
        raise MalformedPayloadError(f"unsupported .npy version {major}.{minor}")
    if hlen > _MAX_HEADER:
        raise MalformedPayloadError(f".npy header length {hlen} exceeds {_MAX_HEADER} bytes")
    if len(mv) < start + hlen:
        raise MalformedPayloadError(f".npy payload truncated: header says {hlen} bytes, {len(mv) - start} present")
    try:
        header = ast.literal_eval(bytes(mv[start : start + hlen]).decode("latin1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise MalformedPayloadError(f".npy header is not a Python literal: {e}") from e
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise MalformedPayloadError(f".npy header must hold exactly descr, fortran_order, shape; got {header!r}")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if descr not in _INT_DESCRS:
        raise MalformedPayloadError(f".npy dtype {descr!r} is not a little-endian integer type")
    if fortran is not False:
        raise MalformedPayloadError(".npy payload is Fortran-ordered; the wire format is C-order")
    if not isinstance(shape, tuple):
        raise MalformedPayloadError(f".npy shape {_short(shape)} is not a tuple of non-negative ints")
    dt = np.dtype(descr)
    count = checked_count(shape, dt.itemsize, len(mv) - start - hlen, f".npy payload of {dt.name}")
    return np.frombuffer(buf, dtype=dt, count=count, offset=start + hlen).reshape(shape)


def checked_count(shape: Any, itemsize: int, nbytes: int, where: str) -> int:
    """Elements of ``shape`` once every dimension is a bounded non-negative int and the shape needs exactly
    ``nbytes`` bytes: a hostile shape (``[0, 2**40, 2**40]``, ``[2**70]``) is a :class:`MalformedPayloadError`,
    never numpy's ValueError or OverflowError."""
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > _MAX_NDIM
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_DIM for s in shape)
    ):
        raise MalformedPayloadError(
            f"{where}: shape {_short(shape)} is not at most {_MAX_NDIM} non-negative ints up to {_MAX_DIM}"
        )
    if math.prod(max(s, 1) for s in shape) * itemsize > 2**62:  # numpy could not size it, even when empty
        raise MalformedPayloadError(f"{where}: shape {list(shape)} is too large for any routing")
    count = math.prod(shape)
    if count * itemsize != nbytes:
        raise MalformedPayloadError(f"{where}: {nbytes} bytes of data, shape {list(shape)} needs {count * itemsize}")
    return count


def _short(value: Any) -> str:
    """``repr`` cut to 200 characters (a hostile field may be huge)."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _dtype_from_name(name: Any) -> np.dtype[Any]:
    """An explicit dtype field (``routed_experts_dtype``, ms-swift ``dtype``) -> numpy dtype."""
    if isinstance(name, np.dtype):
        return name
    if not isinstance(name, str):
        raise MalformedPayloadError(f"dtype field must be a string, got {type(name).__name__}")
    key = name.removeprefix("torch.").removeprefix("np.").removeprefix("numpy.")
    try:
        dt = np.dtype(key)
    except (TypeError, ValueError, SyntaxError) as e:  # numpy parses comma strings ("0\x1b"): ValueError
        raise MalformedPayloadError(f"unknown dtype {_short(name)}") from e
    if dt.name not in _DTYPE_NAMES or dt.byteorder == ">":
        raise MalformedPayloadError(f"dtype {name!r} is not a little-endian integer type")
    return dt


def _from_raw(buf: bytes | bytearray | memoryview, dtype: Any) -> np.ndarray:
    """Bytes: a .npy file if it starts with the magic, else a headerless buffer (SGLang: int32 by default)."""
    if bytes(buf[:6]) == NPY_MAGIC:
        arr = _parse_npy(buf)
        if dtype is not None and arr.dtype != _dtype_from_name(dtype):
            raise MalformedPayloadError(f".npy payload is {arr.dtype.name} but the stated dtype is {dtype!r}")
        return arr
    dt = _dtype_from_name(dtype) if dtype is not None else np.dtype("<i4")
    if len(buf) % dt.itemsize:
        raise MalformedPayloadError(
            f"headerless payload of {len(buf)} bytes is not a whole number of {dt.name} ids "
            f"(truncated, or not {dt.name})"
        )
    return np.frombuffer(buf, dtype=dt)


def _from_swift_dict(d: Mapping[str, Any]) -> np.ndarray:
    """ms-swift's ``{"data": b64(tobytes), "shape": [...], "dtype": "...", "__ndarray__": true}``."""
    for key in ("data", "shape", "dtype"):
        if key not in d:
            raise MalformedPayloadError(f"ndarray dict payload is missing field {key!r}")
    shape = d["shape"]
    dt = _dtype_from_name(d["dtype"])
    data = d["data"]
    raw = _b64decode(data) if isinstance(data, (str, bytes)) else None
    if raw is None:
        raise MalformedPayloadError(f"ndarray dict 'data' must be a base64 string, got {type(data).__name__}")
    checked_count(shape, dt.itemsize, len(raw), f"ndarray dict of {dt.name}")
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def _from_nested_lists(payload: Sequence[Any]) -> np.ndarray:
    """vLLM 0.21's ``.tolist()`` JSON: ``[[[id, ...], ...], ...]``."""
    try:
        arr = np.asarray(payload)
    except ValueError as e:
        raise MalformedPayloadError(f"nested-list routing is ragged: {e}") from e
    if arr.size == 0:
        return np.zeros((0,), dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise MalformedPayloadError(f"nested-list routing must hold only ints, got {arr.dtype}")
    return arr


def _to_array(payload: Any, dtype: Any) -> np.ndarray:
    """Dispatch on the payload's type and magic to the matching reader."""
    if payload is None:
        raise MissingRoutingError("routed_experts is missing (null)")
    if isinstance(payload, str):
        if not payload:
            raise MissingRoutingError("routed_experts is an empty string")
        return _from_raw(_b64decode(payload), dtype)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return _from_raw(payload, dtype)
    if isinstance(payload, Mapping):
        if not payload:
            raise MissingRoutingError(
                "routed_experts is {}: the engine serialized a raw tensor through FastAPI's encoder "
                "(SGLang 0.5.7-0.5.9 with --skip-tokenizer-init); run the rr patch or the sidecar"
            )
        if payload.get("__ndarray__") or {"data", "shape", "dtype"} <= set(payload):
            return _from_swift_dict(payload)
        raise MalformedPayloadError(f"dict payload with keys {sorted(payload)} is not a known routing container")
    if isinstance(payload, list):
        return _from_nested_lists(payload)
    if isinstance(payload, np.ndarray) or type(payload).__module__.startswith("torch"):
        return _as_int_array(payload)
    raise MalformedPayloadError(f"unsupported routed_experts payload type {type(payload).__name__}")


def _shape3(arr: np.ndarray, num_layers: int | None, topk: int | None) -> np.ndarray:
    """Bring flat or 2-D payloads to ``(rows, layers, topk)`` and check the layer and top-k axes."""
    if arr.ndim in (1, 2):
        if num_layers is None or topk is None:
            raise ShapeMismatchError(
                f"payload of shape {arr.shape} states no (layers, topk); pass num_layers and topk to decode it"
            )
        per_row = num_layers * topk
        if arr.size % per_row:
            raise ShapeMismatchError(
                f"{arr.size} ids do not divide into rows of num_layers x topk = {num_layers} x {topk} = {per_row}"
            )
        arr = arr.reshape(-1, num_layers, topk)
    elif arr.ndim != 3:
        raise ShapeMismatchError(f"routing must be (rows, layers, topk), got {arr.ndim}-D shape {arr.shape}")
    if num_layers is not None and arr.shape[1] != num_layers:
        raise ShapeMismatchError(f"routing has {arr.shape[1]} layers, expected num_layers={num_layers}")
    if topk is not None and arr.shape[2] != topk:
        raise ShapeMismatchError(f"routing has top-k {arr.shape[2]}, expected topk={topk}")
    return arr


def _check_rows(arr: np.ndarray, rows: int | None, allow_extra_rows: int) -> np.ndarray:
    """Exact row count; up to ``allow_extra_rows`` trailing extra rows are trimmed when asked for."""
    if rows is None:
        return arr
    got = arr.shape[0]
    if got == rows:
        return arr
    if rows < got <= rows + allow_extra_rows:
        return arr[:rows]
    hint = f" (allowed extra: {allow_extra_rows})" if allow_extra_rows else ""
    raise ShapeMismatchError(f"routing has {got} rows, expected {rows}{hint}")


def _validate_ids(arr: np.ndarray, num_experts: int, moe_layers: Sequence[int] | None) -> None:
    """Exact per-row checks: id range, distinct ids in MoE layers (top-k >= 2), zero dense layers."""
    layers = arr.shape[1]
    mask = np.ones(layers, dtype=bool)
    if moe_layers is not None:
        mask[:] = False
        for i in moe_layers:
            if not 0 <= i < layers:
                raise ShapeMismatchError(f"moe layer index {i} outside the payload's {layers} layers")
            mask[i] = True
    # top-1 rows cannot show a repeat; the scan then checks only range and dense layers
    status, r, l = _rowcheck.check_rows(arr, num_experts, mask)
    if status == _rowcheck.OK:
        return
    row = [int(x) for x in arr[r, l]]
    if status == _rowcheck.OUT_OF_RANGE:
        raise ExpertIdOutOfRangeError(f"row {r} layer {l}: expert ids {row} include one outside [0, {num_experts})")
    if status == _rowcheck.DENSE_NONZERO:
        raise ShapeMismatchError(
            f"row {r} layer {l} is a dense layer but carries ids {row}: the payload's layer axis "
            f"does not match moe_layers={list(moe_layers or [])}"
        )
    what = "all-zero" if not any(row) else "repeated ids"
    raise UnrecordedRoutingError(
        f"row {r} layer {l} has {what} {row}: a real top-{arr.shape[2]} row has distinct experts, "
        "so the engine did not record this row"
    )


def decode_routed_experts(
    payload: Any,
    *,
    rows: int | None = None,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
    dtype: Any = None,
    moe_layers: Sequence[int] | None = None,
    allow_extra_rows: int = 0,
    validate: bool = True,
) -> np.ndarray:
    """Decode any engine's routing payload into a checked ``(rows, layers, topk)`` array.

    Reads rr's base64 ``.npy``, vLLM's ``.npy`` (same container), SGLang's headerless base64 int32
    (``dtype`` overrides, e.g. from ``routed_experts_dtype``), vLLM 0.21 nested lists, ms-swift's
    ndarray dict, raw bytes, numpy arrays and torch tensors. With ``num_experts`` the result is in the
    wire dtype (uint8/uint16) and, when ``validate``, every id is range-checked and every MoE row must
    hold ``topk`` distinct ids (layers outside ``moe_layers`` must be zero). Errors are typed, see
    :mod:`rr_client.core.errors`.
    """
    return _checked_array(
        _to_array(payload, dtype),
        rows=rows,
        num_layers=num_layers,
        topk=topk,
        num_experts=num_experts,
        moe_layers=moe_layers,
        allow_extra_rows=allow_extra_rows,
        validate=validate,
    )


def _checked_array(
    arr: np.ndarray,
    *,
    rows: int | None,
    num_layers: int | None,
    topk: int | None,
    num_experts: int | None,
    moe_layers: Sequence[int] | None,
    allow_extra_rows: int,
    validate: bool,
) -> np.ndarray:
    """The check itself, shared by :func:`check_routing` and :func:`decode_routed_experts`."""
    arr = _shape3(arr, num_layers, topk)
    arr = _check_rows(arr, rows, allow_extra_rows)
    if num_experts is None:
        return arr
    dt = wire_dtype(num_experts)
    if arr.dtype != dt:
        if validate:
            _check_range(arr, num_experts)  # before narrowing, so wide or negative ids cannot wrap
        arr = arr.astype(dt)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if validate:
        _validate_ids(arr, num_experts, moe_layers)
    return arr


def _refusal(why: str) -> RoutedExpertsError:
    """The typed error a server's ``routed_experts_error`` (``"<ErrorType>: message"``) names; MissingRoutingError
    when it names no routing error of :mod:`rr_client.core.errors`."""
    import rr_client.core.errors as errors

    name = why.split(":", 1)[0].strip()
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RoutedExpertsError)):
        cls = MissingRoutingError
    return cls(f"the server withheld routed_experts: {why}")


def _aborted(meta_info: Mapping[str, Any]) -> str:
    """``finish_reason``'s abort message when the engine aborted the request (SGLang's and rr's ``/generate``
    shape ``{"type": "abort", "message": ...}``), else ``""``."""
    fr = meta_info.get("finish_reason")
    if isinstance(fr, Mapping) and fr.get("type") == "abort":
        return f"finish_reason abort: {fr.get('message') or 'no message'}"
    return ""


def decode_meta_info(meta_info: Mapping[str, Any], **kwargs: Any) -> np.ndarray:
    """Decode ``meta_info["routed_experts"]``, honouring its stated ``routed_experts_dtype``/``_shape``."""
    payload = meta_info.get("routed_experts", meta_info.get("output_routed_experts"))
    why = meta_info.get("routed_experts_error")
    if payload is None:
        if aborted := _aborted(meta_info):  # e.g. queued when the server shut down: say so, not "was routing enabled?"
            raise MissingRoutingError(f"the engine aborted this request ({aborted}); it has no routing")
        if why:
            raise _refusal(str(why))
    if "routed_experts" not in meta_info and "output_routed_experts" not in meta_info:
        raise MissingRoutingError("meta_info has no 'routed_experts' field (was routing enabled on the server?)")
    if kwargs.get("dtype") is None and meta_info.get("routed_experts_dtype") is not None:
        kwargs["dtype"] = meta_info["routed_experts_dtype"]
    arr = decode_routed_experts(payload, **kwargs)
    stated = meta_info.get("routed_experts_shape")
    if (
        stated is not None
        and kwargs.get("allow_extra_rows", 0) == 0
        and (not isinstance(stated, (list, tuple)) or list(arr.shape) != list(stated))
    ):
        raise ShapeMismatchError(
            f"payload shape {list(arr.shape)} differs from stated routed_experts_shape {_short(stated)}"
        )
    return arr
