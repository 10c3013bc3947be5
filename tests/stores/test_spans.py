"""Provenance spans: a datum built from spans of two sequences resolves to exactly those tokens' rows (each ref read
once, through the one check), bound to the datum's tokens; every malformed span list is a typed error before any
row is read."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client import (
    Provenance,
    ProvenanceSpan,
    ProvenanceSpanError,
    RoutedExpertsClient,
    RoutingExpiredError,
    RoutingRef,
    SequenceBook,
    StaleRoutingError,
    tokens_digest,
)
from rr_server.serving.store.objects import ObjectStore
from tests.support.routing_data import checked_routing, small_moe_info

INFO = small_moe_info()

# turn 1: prompt P1 (5) + output O1 (4); turn 2's prompt is all of turn 1 plus a tool answer (3), output O2 (3)
P1, O1 = [11, 12, 13, 14, 15], [21, 22, 23, 24]
P2, O2 = [*P1, *O1, 31, 32, 33], [41, 42, 43]


def _sequence(store: ObjectStore, prompt: list[int], output: list[int], seed: int) -> tuple[RoutingRef, np.ndarray]:
    rows = checked_routing(INFO, len(prompt) + len(output) - 1, seed=seed)  # the last sampled token is never run
    ref = RoutingRef.from_dict(store.put(rows))
    prov = Provenance(tokens_digest=tokens_digest(prompt, output))
    return replace(ref, provenance=prov), rows.array


@pytest.fixture()
def book(tmp_path: Path) -> tuple[SequenceBook, dict[str, np.ndarray], str]:
    url = f"file://{tmp_path}"
    store = ObjectStore(url)
    b = SequenceBook("episode-7")
    r1, a1 = _sequence(store, P1, O1, 1)
    r2, a2 = _sequence(store, P2, O2, 2)
    b.add("turn-1", r1, P1, O1)
    b.add("turn-2", r2, P2, O2)
    return b, {"turn-1": a1, "turn-2": a2}, url


def resolve(book: SequenceBook, url: str, spans: list[Any], datum: list[int]) -> np.ndarray:
    async def run() -> np.ndarray:
        async with RoutedExpertsClient("http://127.0.0.1:9", info=INFO, object_stores=[url]) as c:
            return await c.resolve_spans(book, spans, datum)

    return asyncio.run(run())


def test_a_multi_turn_datum_from_spans_of_two_samples(book: tuple[SequenceBook, dict[str, np.ndarray], str]) -> None:
    b, rows, url = book
    full = [*P2, *O2]
    datum = full[:-1]  # the trainer's input tokens: every token but the last (its target)
    n1 = len(P1) + len(O1) - 1  # turn 1 ran its prompt and all but its last sampled token
    spans = [
        {"sequence_id": "turn-1", "offset": 0, "length": len(P1), "kind": "prompt"},
        {"sequence_id": "turn-1", "offset": len(P1), "length": len(O1) - 1, "kind": "sampled"},
        {"sequence_id": "turn-2", "offset": n1, "length": len(P2) - n1, "kind": "prompt"},  # O1's last + the tool's
        ProvenanceSpan("turn-2", len(P2), len(O2) - 1, "sampled", datum_offset=len(P2)),
    ]
    got = resolve(b, url, spans, datum)
    want = np.concatenate([rows["turn-1"][:n1], rows["turn-2"][n1:]])
    assert got.shape == (len(datum), 3, 2) and np.array_equal(got, want)
    # turn 1's last output token was never run by turn 1's request (no row): turn 2's prompt ran it
    with pytest.raises(ProvenanceSpanError, match=r"has routing rows for tokens \[0, 8\) only"):
        b.plan([{"sequence_id": "turn-1", "offset": 0, "length": 9}], P1 + O1)


@pytest.mark.parametrize(
    ("spans", "datum", "match"),
    [
        ([], [11], "no spans"),
        ([{"sequence_id": "turn-1", "offset": 0, "length": 3}], P1, "cover 3 tokens, the datum has 5"),
        (
            [
                {"sequence_id": "turn-1", "offset": 0, "length": 3},
                {"sequence_id": "turn-1", "offset": 3, "length": 2, "datum_offset": 2},
            ],
            P1,
            "overlaps the span before it",
        ),
        (
            [
                {"sequence_id": "turn-1", "offset": 0, "length": 2},
                {"sequence_id": "turn-1", "offset": 3, "length": 2, "datum_offset": 3},
            ],
            P1,
            "leaves a gap",
        ),
        ([{"sequence_id": "turn-1", "offset": 6, "length": 9}], list(range(9)), "point past its 9 tokens"),
        ([{"sequence_id": "turn-9", "offset": 0, "length": 1}], [11], "no sequence 'turn-9'"),
        ([{"sequence_id": "turn-1", "offset": 0, "length": 2}], [11, 99], "datum token 1 is 99"),
        ([{"sequence_id": "turn-1", "offset": -1, "length": 2}], [11, 12], "need offset >= 0"),
        ([{"sequence_id": "turn-1", "offset": 0, "length": 0}], [], "need offset >= 0, length >= 1"),
        ([{"sequence_id": "turn-1", "offset": "0", "length": 2}], [11, 12], "offset must be an integer"),
        ([{"sequence_id": "", "offset": 0, "length": 2}], [11, 12], "sequence_id must be a non-empty string"),
        ([{"sequence_id": "turn-1", "offset": 0, "length": 2, "kind": "tool"}], [11, 12], "kind 'tool'"),
        (["turn-1"], [11], "must be an object"),
        ([{"sequence_id": "turn-1", "offset": 0, "length": 7}], P1, "cover more than the datum's 5 tokens"),
    ],
)
def test_every_malformed_span_list_is_typed(
    book: tuple[SequenceBook, dict[str, np.ndarray], str], spans: list[Any], datum: list[int], match: str
) -> None:
    b, _, url = book
    with pytest.raises(ProvenanceSpanError, match=match):
        resolve(b, url, spans, datum)


def test_retired_sequences_and_mispaired_refs(book: tuple[SequenceBook, dict[str, np.ndarray], str]) -> None:
    b, _, url = book
    ref = b._seq["turn-1"].ref
    with pytest.raises(ProvenanceSpanError, match="already held"):
        b.add("turn-1", ref, P1, O1)
    with pytest.raises(StaleRoutingError, match="other tokens"):  # turn 1's ref bound to turn 2's tokens
        b.add("turn-1b", ref, P2, O2)
    with pytest.raises(ProvenanceSpanError, match="carries no tokens digest"):
        b.add("turn-1c", replace(ref, provenance=None), P1, O1)
    assert b.retire(ref.weight_version) == 2 and len(b) == 0
    with pytest.raises(RoutingExpiredError, match="retired with weight version 0"):
        resolve(b, url, [{"sequence_id": "turn-1", "offset": 0, "length": 5}], P1)
