"""Sparse-attention indexer top-k (rr_client.core.indexer): the rows that are sent, their wire form and the one full
check, with every malformed payload a typed error naming what is wrong."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from rr_client import (
    IndexerDims,
    IndexerPositionError,
    MalformedPayloadError,
    ShapeMismatchError,
    check_indexer,
    decode_indexer,
    encode_indexer,
)
from rr_client.core.indexer import INDEXER_START_FIELD, indexer_dtype, indexer_meta_fields

DIMS = IndexerDims(layers=(0, 1, 3), index_topk=4)
PROMPT, COMPLETION = 9, 5
SEQ = PROMPT + COMPLETION


def picks(seq: int = SEQ, seed: int = 0, topk: int = 4, layers: int = 3) -> np.ndarray:
    """SGLang's int32 rows for tokens 0 .. seq - 2: distinct causal positions where the token chooses, -1 padding
    before (a token ``t < topk`` reads all ``t + 1`` positions)."""
    g = np.random.default_rng(seed)
    out = np.full((seq - 1, layers, topk), -1, dtype=np.int32)
    for t in range(seq - 1):
        for layer in range(layers):
            if t + 1 <= topk:
                out[t, layer, : t + 1] = np.arange(t + 1)
            else:
                out[t, layer] = g.choice(t + 1, topk, replace=False)
    return out


def test_from_hf_config_reads_index_topk_and_skips_shared_layers() -> None:
    assert IndexerDims.from_hf_config({"num_hidden_layers": 3, "index_topk": 2048}) == IndexerDims((0, 1, 2), 2048)
    glm = {"num_hidden_layers": 4, "index_topk": 64, "indexer_types": ["full", "shared", "full", "shared"]}
    assert IndexerDims.from_hf_config(glm) == IndexerDims((0, 2), 64)
    assert IndexerDims.from_hf_config({"text_config": glm}) == IndexerDims((0, 2), 64)
    assert IndexerDims.from_hf_config({"num_hidden_layers": 4}) is None


def test_sglang_rows_become_the_choosing_rows_in_the_smallest_dtype_and_round_trip() -> None:
    raw = picks()
    payload = base64.b64encode(raw.tobytes()).decode()
    checked = decode_indexer(payload, DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION)
    assert checked.start == 4 and checked.array.dtype == np.uint16
    assert np.array_equal(checked.array, raw[4:])
    fields = indexer_meta_fields(checked)
    assert fields[INDEXER_START_FIELD] == 4
    again = decode_indexer(fields["indexer_topk"], DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION)
    assert np.array_equal(again.array, checked.array) and again.start == 4
    # a later turn asked from token 6 (SGLang's routed_experts_start_len=6): rows from token 6
    late = decode_indexer(
        base64.b64encode(raw[6:].tobytes()).decode(),
        DIMS,
        prompt_tokens=PROMPT,
        completion_tokens=COMPLETION,
        start=6,
        engine_rows_from=6,
    )
    assert late.start == 6 and np.array_equal(late.array, raw[6:])
    assert indexer_dtype(1 << 16) == np.uint16 and indexer_dtype((1 << 16) + 1) == np.uint32


def test_a_sample_shorter_than_index_topk_has_no_rows() -> None:
    raw = picks(seq=4)
    checked = decode_indexer(base64.b64encode(raw.tobytes()).decode(), DIMS, prompt_tokens=3, completion_tokens=1)
    assert checked.array.shape == (0, 3, 4)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda a: a.__setitem__((2, 1, 0), 7 + 4 + 1), IndexerPositionError, r"row 2 \(token 6\) layer 1: position 12 is a future token"),
        (lambda a: a.__setitem__((0, 2, 3), -1), IndexerPositionError, r"row 0 \(token 4\) layer 3: position -1 is negative"),
        (lambda a: a.__setitem__((5, 0, 1), a[5, 0, 0]), IndexerPositionError, r"row 5 \(token 9\) layer 0 picks a position twice"),
    ],
    ids=["future", "negative", "repeat"],
)  # fmt: skip
def test_malformed_positions_are_typed_errors(edit: object, error: type, match: str) -> None:
    rows = picks()[4:].copy()
    edit(rows)  # type: ignore[operator]
    with pytest.raises(error, match=match):
        check_indexer(rows, DIMS, rows=SEQ - 1 - 4, start=4)


def test_shape_and_type_errors_name_what_is_wrong() -> None:
    rows = picks()[4:]
    n = rows.shape[0]
    with pytest.raises(ShapeMismatchError, match=r"expected \(rows, 3 indexer layers \[0, 1, 3\], index_topk 4\)"):
        check_indexer(rows[:, :2], DIMS, rows=n, start=4)
    with pytest.raises(ShapeMismatchError, match="expected \\(rows, 3 indexer layers"):
        check_indexer(rows[..., :3], DIMS, rows=n, start=4)
    with pytest.raises(ShapeMismatchError, match=f"{n - 1} rows, expected {n}"):
        check_indexer(rows[1:], DIMS, rows=n, start=4)
    with pytest.raises(MalformedPayloadError, match="integer positions"):
        check_indexer(rows.astype(np.float32), DIMS, rows=n, start=4)
    with pytest.raises(MalformedPayloadError, match="tokens before 4 read every earlier token"):
        check_indexer(picks()[2:], DIMS, rows=SEQ - 3, start=2)
    with pytest.raises(ShapeMismatchError, match="not whole rows"):
        decode_indexer(base64.b64encode(b"\0" * 20).decode(), DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION)
    with pytest.raises(MalformedPayloadError, match="base64 text or an array"):
        decode_indexer({"data": 1}, DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION)
    with pytest.raises(TypeError, match="takes a CheckedIndexer"):
        encode_indexer(rows)  # type: ignore[arg-type]


def test_engine_rows_with_a_slot_per_decoder_layer_keep_the_indexer_layers() -> None:
    """SGLang 0.5.23's rows hold a slot per decoder layer (GLM-5's shared layers mirrored): decoded by that count, rr
    keeps the slots of its indexer layers; a count that cannot hold them, or rows of another count, are refused."""
    raw = picks(layers=4)  # decoder layers 0..3; DIMS runs indexers on 0, 1, 3
    payload = base64.b64encode(raw.tobytes()).decode()
    got = decode_indexer(payload, DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION, engine_layers=4)
    assert np.array_equal(got.array, raw[4:, [0, 1, 3]])
    same = decode_indexer(raw, DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION, engine_layers=4)
    assert np.array_equal(same.array, got.array)
    with pytest.raises(ShapeMismatchError, match="reach layer 3"):
        decode_indexer(payload, DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION, engine_layers=2)
    with pytest.raises(ShapeMismatchError, match="expected 5 layer slots"):
        decode_indexer(picks(layers=4), DIMS, prompt_tokens=PROMPT, completion_tokens=COMPLETION, engine_layers=5)
