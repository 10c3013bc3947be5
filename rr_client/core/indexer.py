"""Sparse-attention indexer top-k (DeepSeek-V3.2-style DSA): the wire form and its one full check (numpy only; core).

A lightning indexer picks, for each query token and each layer that runs one, the ``index_topk`` earlier positions
sparse attention reads. A different pick in training is the same mismatch expert routing replay removes. Row ``t``
holds token ``t``'s picks, ``[rows, indexer_layers, index_topk]``, by the same convention as routing rows (token
``t`` is the one that predicted token ``t + 1``). Only tokens that choose are sent: token ``t`` reads ``t + 1``
positions (itself and every earlier one), so while ``t < index_topk`` it reads all of them and its row says nothing
(SGLang pads it with ``-1``); rows start at ``max(start, index_topk)``. On the wire (spec: docs/wire-format.md): base64
of a ``.npy`` in the smallest unsigned dtype that holds every position (uint16 up to 65,536 tokens, else uint32), with
``indexer_topk_start`` (the first row's token). :func:`check_indexer` is the one full check: shape (layer count and
width), row count, positions in range and causal (``0 <= p <= t``), no position twice in a row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from rr_client.core.codec import _as_int_array, _b64decode, _npy_header, _parse_npy
from rr_client.core.errors import (
    ArgumentTypeError,
    ConfigurationError,
    IndexerPositionError,
    MalformedPayloadError,
    ShapeMismatchError,
)

__all__ = [
    "INDEXER_FIELD",
    "INDEXER_START_FIELD",
    "INDEXER_ERROR_FIELD",
    "INDEXER_REF_FIELD",
    "INDEXER_FORMAT_FIELD",
    "INDEXER_FORMATS",
    "check_indexer_format",
    "IndexerDims",
    "CheckedIndexer",
    "indexer_dtype",
    "first_choosing_row",
    "check_indexer",
    "encode_indexer",
    "indexer_meta_fields",
    "decode_indexer",
]

INDEXER_FIELD = "indexer_topk"  #: SGLang's meta_info key, and rr's
INDEXER_START_FIELD = "indexer_topk_start"  #: the token position of rr's first indexer row
INDEXER_ERROR_FIELD = "indexer_topk_error"  #: a refused sample's ``"<ErrorType>: message"`` (``indexer_topk`` null)
INDEXER_REF_FIELD = "indexer_topk_ref"  #: by reference: the :class:`rr_client.RoutingRef` (kind "indexer") instead
INDEXER_FORMAT_FIELD = "indexer_topk_format"  #: a request's choice: "ref" (the default: their size) or "npy" (inline)
INDEXER_FORMATS = ("ref", "npy")


def check_indexer_format(fmt: Any) -> str:
    """An ``indexer_topk_format`` value (:data:`INDEXER_FORMATS`); ConfigurationError naming the field otherwise."""
    if fmt not in INDEXER_FORMATS:
        raise ConfigurationError(f"{INDEXER_FORMAT_FIELD} must be one of {list(INDEXER_FORMATS)}, got {fmt!r}")
    return str(fmt)


@dataclass(frozen=True, slots=True)
class IndexerDims:
    """A model's indexer: ``layers`` (the decoder layers that run one, ascending) and ``index_topk`` (positions each
    query token reads)."""

    layers: tuple[int, ...]
    index_topk: int

    def __post_init__(self) -> None:
        if self.index_topk <= 0 or not self.layers or list(self.layers) != sorted(set(self.layers)):
            raise ArgumentTypeError(
                f"IndexerDims needs index_topk > 0 and distinct ascending layers, got {self.index_topk}, "
                f"{list(self.layers)}"
            )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> IndexerDims | None:
        """From an HF ``config.json`` dict (its text config for multimodal ones): ``index_topk``, and every layer
        but GLM-5's ``indexer_types == "shared"`` ones (they reuse the previous layer's pick); None without one."""
        cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), Mapping) else cfg
        topk = cfg.get("index_topk")
        if not isinstance(topk, int) or isinstance(topk, bool) or topk <= 0:
            return None
        n = int(cfg.get("num_hidden_layers", 0))
        kinds = cfg.get("indexer_types")
        layers = [i for i in range(n) if not (isinstance(kinds, list) and i < len(kinds) and kinds[i] == "shared")]
        return cls(tuple(layers), topk)


@dataclass(frozen=True, slots=True)
class CheckedIndexer:
    """Indexer rows that passed :func:`check_indexer`: C-contiguous ``[rows, layers, index_topk]`` in the wire dtype,
    row 0 routing token ``start``."""

    array: np.ndarray
    start: int


def indexer_dtype(seq_len: int) -> np.dtype[Any]:
    """The smallest unsigned dtype that holds every position of a ``seq_len``-token sample."""
    return np.dtype(np.uint16) if seq_len <= 1 << 16 else np.dtype(np.uint32)


def first_choosing_row(index_topk: int, start: int = 0) -> int:
    """The first token position whose indexer row is sent: ``max(start, index_topk)``."""
    return max(start, index_topk)


def check_indexer(array: Any, dims: IndexerDims, *, rows: int, start: int) -> CheckedIndexer:
    """The one full check of one sample's indexer rows (token ``start`` .. ``start + rows``): typed errors naming the
    row, layer and position; the rows in the wire dtype."""
    arr = _as_int_array(array, holds="indexer rows must hold integer positions")
    want = (rows, len(dims.layers), dims.index_topk)
    if arr.ndim != 3 or arr.shape[1:] != want[1:]:
        raise ShapeMismatchError(
            f"indexer rows are {list(arr.shape)}, expected (rows, {len(dims.layers)} indexer layers "
            f"{list(dims.layers)}, index_topk {dims.index_topk})"
        )
    if arr.shape[0] != rows:
        raise ShapeMismatchError(f"indexer rows: {arr.shape[0]} rows, expected {rows} (tokens {start}..{start + rows})")
    if start < dims.index_topk and rows:
        raise MalformedPayloadError(
            f"indexer rows start at token {start}, but tokens before {dims.index_topk} read every earlier token "
            "(no choice): rows start at max(start, index_topk)"
        )
    if rows:
        t = np.arange(start, start + rows, dtype=np.int64)[:, None, None]
        bad = (arr < 0) | (arr.astype(np.int64, copy=False) > t)
        if bad.any():
            r, layer, k = (int(i) for i in np.unravel_index(int(np.argmax(bad)), arr.shape))
            raise IndexerPositionError(
                f"indexer row {r} (token {start + r}) layer {dims.layers[layer]}: position {int(arr[r, layer, k])} "
                f"is {'negative' if arr[r, layer, k] < 0 else 'a future token'}; a token reads positions 0..{start + r}"
            )
        srt = np.sort(arr, axis=-1)
        rep = (srt[..., 1:] == srt[..., :-1]).any(axis=-1)
        if rep.any():
            r, layer = (int(i) for i in np.unravel_index(int(np.argmax(rep)), rep.shape))
            raise IndexerPositionError(
                f"indexer row {r} (token {start + r}) layer {dims.layers[layer]} picks a position twice "
                f"({sorted(int(x) for x in arr[r, layer])[:8]}...): a top-{dims.index_topk} pick has distinct positions"
            )
    dt = indexer_dtype(start + rows + 1)
    out = np.ascontiguousarray(arr.astype(dt, copy=False))
    return CheckedIndexer(out, start)


def encode_indexer(checked: CheckedIndexer) -> str:
    """rr's wire payload (base64 ``.npy``) of rows that passed :func:`check_indexer`, and only of those."""
    if not isinstance(checked, CheckedIndexer):
        raise ArgumentTypeError(
            f"encode_indexer takes a CheckedIndexer from check_indexer, got {type(checked).__name__}"
        )
    a = checked.array
    return pybase64.b64encode(b"".join((_npy_header(a.dtype, a.shape), a.data))).decode("ascii")


def indexer_meta_fields(checked: CheckedIndexer) -> dict[str, Any]:
    """The ``meta_info`` entries a server adds for one sample's indexer rows."""
    return {INDEXER_FIELD: encode_indexer(checked), INDEXER_START_FIELD: checked.start}


def decode_indexer(
    payload: Any,
    dims: IndexerDims,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    start: int = 0,
    engine_rows_from: int = 0,
    engine_layers: int | None = None,
) -> CheckedIndexer:
    """One sample's indexer rows, checked by :func:`check_indexer`, from rr's payload (base64 ``.npy``, rows from
    ``max(start, index_topk)``) or the engine's (SGLang's headerless base64 int32, or its tensor, ``(seqlen - 1,
    engine_layers, index_topk)`` from token ``engine_rows_from``): the engine's rows before the first choosing token are
    dropped. ``engine_layers``: the layer slots of the engine's rows, slot ``i`` decoder layer ``i`` (SGLang 0.5.23
    gives every decoder layer one, GLM-5's "shared" layers mirrored): rr keeps the slots of ``dims.layers``; None:
    the engine's rows hold ``dims.layers`` only."""
    first = first_choosing_row(dims.index_topk, start)
    rows = max(prompt_tokens + completion_tokens - 1 - first, 0)
    slots = len(dims.layers) if engine_layers is None else engine_layers
    if slots <= dims.layers[-1] and slots != len(dims.layers):
        raise ShapeMismatchError(
            f"the engine's indexer rows have {slots} layer slots, but the model's indexer layers reach layer "
            f"{dims.layers[-1]}"
        )
    if isinstance(payload, (str, bytes, bytearray)):
        buf = _b64decode(payload)
        if bytes(buf[:6]) == b"\x93NUMPY":
            return check_indexer(_parse_npy(buf), dims, rows=rows, start=first)
        width = slots * dims.index_topk
        if len(buf) % (4 * width):
            raise ShapeMismatchError(
                f"SGLang's indexer payload holds {len(buf)} bytes, not whole rows of {slots} layer slots x "
                f"{dims.index_topk} int32 positions"
            )
        arr = np.frombuffer(buf, dtype="<i4").reshape(-1, slots, dims.index_topk)
    elif isinstance(payload, np.ndarray) or type(payload).__module__.startswith("torch"):
        arr = _as_int_array(payload, holds="indexer rows must hold integer positions")
        if arr.ndim != 3:
            raise ShapeMismatchError(f"the engine's indexer rows are {arr.ndim}-D {list(arr.shape)}, expected 3-D")
    else:
        raise MalformedPayloadError(f"{INDEXER_FIELD} must be base64 text or an array, got {type(payload).__name__}")
    if slots != len(dims.layers):  # one slot per decoder layer: keep the indexer layers' slots
        if arr.shape[1] != slots:
            raise ShapeMismatchError(
                f"the engine's indexer rows are {list(arr.shape)}, expected {slots} layer slots (one per decoder layer)"
            )
        arr = arr[:, list(dims.layers)]
    skip = first - engine_rows_from
    if skip < 0 or (skip > arr.shape[0] and rows):
        raise ShapeMismatchError(
            f"the engine's indexer rows start at token {engine_rows_from} ({arr.shape[0]} rows), the sample's first "
            f"choosing token is {first}"
        )
    return check_indexer(arr[skip:], dims, rows=rows, start=first)
