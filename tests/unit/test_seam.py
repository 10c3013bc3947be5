"""The prefill/decode seam (rr_client.core.seam): two servers' halves of one sample joined where the decode server took
over, or refused with a typed error, never a merged tensor."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from rr_client import (
    Half,
    MalformedPayloadError,
    MissingRoutingError,
    Provenance,
    SeamMismatchError,
    StaleRoutingError,
    UnrecordedRoutingError,
    merge_halves,
)
from rr_client.core.provenance import check_provenance
from rr_client.core.reference import RoutingRef, checksum
from rr_client.core.seam import Seam, SeamRef, joined_provenance, plan_seam
from tests.support.routing_data import dims_info

E, K = 8, 2
INFO = dims_info(3, E, K, [1, 2], engine="sglang", engine_version="0.5.23", model="tiny")
PROMPT, COMPLETION = 9, 6
TOTAL = PROMPT + COMPLETION - 1  # routed tokens of the sample


def rows(n: int, seed: int) -> np.ndarray:
    """``[n, 3, 2]`` uint8: layer 0 dense (zeros), layers 1-2 distinct experts."""
    g = np.random.default_rng(seed)
    out = np.zeros((n, 3, K), dtype=np.uint8)
    for t in range(n):
        for layer in (1, 2):
            out[t, layer] = g.choice(E, K, replace=False)
    return out


FULL = rows(TOTAL, 0)  # what one server alone would have returned


def version(v: int) -> Provenance:
    return Provenance(weight_version_admitted=v, weight_version_finished=v, preemptions=0)


def halves(prefill_stop: int = PROMPT, decode_start: int = PROMPT, **kw: object) -> tuple[Half, Half]:
    p = Half(FULL[:prefill_stop].copy(), 0, INFO, "http://prefill:30000", version(3))
    d = Half(FULL[decode_start:].copy(), decode_start, INFO, "http://decode:30001", version(3))
    return p, d


def test_the_merge_is_the_single_server_rows_and_records_the_seam() -> None:
    p, d = halves()
    merged, seam = merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    assert np.array_equal(merged, FULL) and merged.dtype == np.uint8
    assert seam.at == PROMPT and seam.prefill_span == (0, PROMPT) and seam.decode_span == (PROMPT, TOTAL)
    assert seam.weight_version == 3 and seam.overlap == 0
    assert seam.to_dict()["decode"] == {"server": "http://decode:30001", "span": [PROMPT, TOTAL]}


def test_prefill_rows_past_the_seam_must_equal_the_decode_servers() -> None:
    p, d = halves(prefill_stop=PROMPT + 2)  # the prefill server also routed the first two decode tokens
    merged, seam = merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    assert np.array_equal(merged, FULL) and seam.overlap == 2
    p.rows[PROMPT + 1, 1] = [(FULL[PROMPT + 1, 1, 0] + 1) % E, FULL[PROMPT + 1, 1, 0]]
    if len(set(p.rows[PROMPT + 1, 1].tolist())) < K:  # keep it a valid row, only different
        p.rows[PROMPT + 1, 1] = [(FULL[PROMPT + 1, 1, 0] + 2) % E, (FULL[PROMPT + 1, 1, 0] + 3) % E]
    with pytest.raises(
        SeamMismatchError, match=rf"tokens {PROMPT}..{PROMPT + 2} and they differ \(first at token {PROMPT + 1}\)"
    ):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)


def test_a_prefill_answer_with_zero_rows_is_refused() -> None:
    p, d = halves()
    p.rows[3:] = 0  # SGLang #23885: overlap scheduling returned the prefill rows all zeros
    with pytest.raises(UnrecordedRoutingError, match=r"row 3 layer 1 has all-zero"):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(topk=3), r"differ in topk: 2 vs 3"),
        (dict(model="other"), r"differ in model: 'tiny' vs 'other'"),
        (dict(moe_layers=[1]), r"differ in moe_layers"),
        (dict(engine="vllm"), r"differ in engine"),
    ],
)
def test_halves_of_different_models_are_refused(change: dict[str, object], match: str) -> None:
    p, d = halves()
    d = replace(d, info=INFO.model_copy(update=change))
    with pytest.raises(SeamMismatchError, match=match):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)


def test_a_width_or_dtype_mismatch_is_refused() -> None:
    p, d = halves()
    with pytest.raises(SeamMismatchError, match=r"uint16 .* width, layer count or dtype differ"):
        merge_halves(p, replace(d, rows=d.rows.astype(np.uint16)), received=PROMPT, total_rows=TOTAL)
    with pytest.raises(SeamMismatchError, match=r"\[5, 3, 1\]"):
        merge_halves(p, replace(d, rows=d.rows[:, :, :1]), received=PROMPT, total_rows=TOTAL)


def test_missing_spans_are_refused() -> None:
    p, d = halves(prefill_stop=PROMPT - 2)
    with pytest.raises(MissingRoutingError, match=rf"tokens {PROMPT - 2}..{PROMPT} have no row"):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    p, d = halves(decode_start=PROMPT + 1)
    with pytest.raises(MissingRoutingError, match=rf"tokens {PROMPT}..{PROMPT + 1} have no row"):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    p, d = halves()
    with pytest.raises(MissingRoutingError, match=rf"end at token {TOTAL - 1}, the sample's at {TOTAL}"):
        merge_halves(p, replace(d, rows=d.rows[:-1]), received=PROMPT, total_rows=TOTAL)


def test_a_decode_server_that_recomputed_what_it_received_is_refused() -> None:
    p, d = halves(decode_start=PROMPT - 3)  # rows from token 6 on, yet it says it received the KV of 9
    with pytest.raises(SeamMismatchError, match=r"recomputed what it claims to have received"):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)


def test_weight_versions_must_match_and_not_span_an_update() -> None:
    p, d = halves()
    with pytest.raises(StaleRoutingError, match=r"prefill server .* at weight version 3, the decode server .* at 4"):
        merge_halves(p, replace(d, provenance=version(4)), received=PROMPT, total_rows=TOTAL)
    spanning = Provenance(weight_version_admitted=3, weight_version_finished=4, preemptions=0)
    with pytest.raises(StaleRoutingError, match=r"decode server .* across a weight update \(versions 3 -> 4\)"):
        merge_halves(p, replace(d, provenance=spanning), received=PROMPT, total_rows=TOTAL)
    merged, seam = merge_halves(replace(p, provenance=None), d, received=PROMPT, total_rows=TOTAL)
    assert seam.weight_version == 3  # one side says: recorded


def test_a_sample_routed_from_a_later_token_merges_from_there() -> None:
    first = 4  # routed_experts_start: rows from token 4 on
    p = Half(FULL[first:PROMPT].copy(), first, INFO, "p", version(3))
    d = Half(FULL[PROMPT:].copy(), PROMPT, INFO, "d", version(3))
    merged, seam = merge_halves(p, d, received=PROMPT, total_rows=TOTAL - first, first=first)
    assert np.array_equal(merged, FULL[first:]) and seam.prefill_span == (first, PROMPT)
    with pytest.raises(MissingRoutingError, match=r"start at token 0, the sample's at 4"):
        merge_halves(replace(p, rows=FULL[:PROMPT], start=0), d, received=PROMPT, total_rows=TOTAL - first, first=first)


def ref_of(h: Half, key: str) -> RoutingRef:
    a = np.asarray(h.rows)
    return RoutingRef(
        store="s1", url=h.server, key=key, rows=a.shape[0], layers=a.shape[1], topk=a.shape[2], dtype=str(a.dtype),
        start=h.start, weight_version=3, checksum=checksum(a), provenance=h.provenance,
    )  # fmt: skip


def test_a_seam_ref_is_planned_from_refs_alone_and_round_trips_as_json() -> None:
    """By reference, every check that needs no rows runs when the SeamRef is made: spans, decode prompt rows,
    weight versions; the JSON a trainer rank receives parses back to the same ref, and a tampered one is refused."""
    p, d = halves()
    rp, rd = replace(p, rows=ref_of(p, "a")), replace(d, rows=ref_of(d, "b"))
    seam = plan_seam(rp, rd, received=PROMPT, total_rows=TOTAL)
    assert seam == merge_halves(p, d, received=PROMPT, total_rows=TOTAL)[1]
    sref = SeamRef(rp.rows, rd.rows, seam)
    assert SeamRef.from_dict(json.loads(json.dumps(sref.to_dict()))) == sref
    assert sref.weight_version == 3 and sref.nbytes == FULL.nbytes
    bad = sref.to_dict()
    bad["seam"]["decode"]["span"] = [PROMPT, PROMPT + 2]
    with pytest.raises(MalformedPayloadError, match="not the seam's"):
        SeamRef.from_dict(bad)
    with pytest.raises(MalformedPayloadError, match="rr.seam_ref/1"):
        SeamRef.from_dict(sref.prefill.to_dict())
    with pytest.raises(StaleRoutingError, match="weight version 3, the decode server .* at 4"):
        plan_seam(rp, replace(rd, provenance=version(4)), received=PROMPT, total_rows=TOTAL)
    dp, dd = halves(decode_start=PROMPT - 2)
    with pytest.raises(SeamMismatchError, match="never ran those tokens"):
        plan_seam(rp, replace(dd, rows=ref_of(dd, "c")), received=PROMPT, total_rows=TOTAL)
    wide = replace(rd, rows=replace(rd.rows, dtype="uint16"))
    with pytest.raises(SeamMismatchError, match="width, layer count or dtype differ"):
        plan_seam(rp, wide, received=PROMPT, total_rows=TOTAL)


def test_already_checked_halves_are_not_checked_twice_but_unchecked_ones_are() -> None:
    """``checked=True`` (rows a parsed answer or a resolved ref already passed the full check) skips the second
    check; without it, all-zero rows are refused."""
    p, d = halves()
    p.rows[2, 1:] = 0
    with pytest.raises(UnrecordedRoutingError):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    merged, _ = merge_halves(p, d, received=PROMPT, total_rows=TOTAL, checked=True)
    assert not merged[2, 1:].any()


def test_a_prefill_half_past_the_sample_is_a_typed_refusal_naming_the_rows() -> None:
    """A prefill server that answered more rows than the sample has (tokens past its end): a SeamMismatchError
    naming the row counts, never numpy's broadcast ValueError from comparing the overlap."""
    p = Half(rows(TOTAL + 2, 1), 0, INFO, "http://prefill:30000", version(3))
    d = Half(FULL[PROMPT:].copy(), PROMPT, INFO, "http://decode:30001", version(3))
    with pytest.raises(
        SeamMismatchError,
        match=rf"returned {TOTAL + 2} rows \(tokens 0..{TOTAL + 2}\), past the sample's {TOTAL} routed",
    ):
        merge_halves(p, d, received=PROMPT, total_rows=TOTAL)
    with pytest.raises(SeamMismatchError, match="past the sample's"):
        plan_seam(replace(p, rows=ref_of(p, "a")), replace(d, rows=ref_of(d, "b")), received=PROMPT, total_rows=TOTAL)


def test_a_one_token_completion_seam_round_trips() -> None:
    """A one-token completion: the prefill server sampled the only token, the decode server routed none (an empty
    span at the seam); its Seam and SeamRef parse back from JSON."""
    p = Half(FULL[:PROMPT].copy(), 0, INFO, "http://prefill:30000", version(3))
    d = Half(FULL[PROMPT:PROMPT], PROMPT, INFO, "http://decode:30001", version(3))
    merged, seam = merge_halves(p, d, received=PROMPT, total_rows=PROMPT)
    assert np.array_equal(merged, FULL[:PROMPT]) and seam.decode_span == (PROMPT, PROMPT)
    assert Seam.from_dict(json.loads(json.dumps(seam.to_dict()))) == seam
    sref = SeamRef(ref_of(p, "a"), ref_of(d, "b"), seam)
    assert SeamRef.from_dict(json.loads(json.dumps(sref.to_dict()))) == sref


def stale_cache(cached: int = 4) -> Provenance:
    """A half admitted after an update whose prefix-cache hit may be KV of older weights."""
    return Provenance(cached, "device", 0, 3, 3, cached_under_older_weights=True, tokens_digest="a" * 32)


def test_a_pd_samples_provenance_is_built_from_both_halves() -> None:
    """The cache facts are the prefill half's (where the prompt's KV came from), weight spans either half's,
    preemptions and the digest the decode half's: a stale prefill half makes the sample stale, like a stale decode
    half; a SeamRef answers the same provenance."""
    clean = Provenance(0, None, 1, 3, 3, cached_under_older_weights=False, tokens_digest="d" * 32)
    joined = joined_provenance(stale_cache(), clean)
    assert joined is not None and joined.stale and joined.cached_tokens == 4 and joined.cache_tier == "device"
    assert (joined.preemptions, joined.tokens_digest) == (1, "d" * 32)
    with pytest.raises(StaleRoutingError, match="its 4 cached tokens may come from KV computed under older"):
        check_provenance([joined])
    assert joined_provenance(clean, replace(stale_cache(2), tokens_digest="d" * 32)).stale  # the decode half's own
    assert not joined_provenance(replace(clean, preemptions=0), clean).stale  # type: ignore[union-attr]
    spanning = replace(clean, weight_version_admitted=2)  # an update on the prefill server only
    both = joined_provenance(spanning, clean)
    assert both is not None and both.spans_update and both.may_be_recomputed_across_update
    unknown = joined_provenance(None, clean)  # the prompt's server said nothing: its cache and updates unknown
    assert unknown is not None and unknown.cached_under_older_weights is None and unknown.weight_update_during is None
    assert joined_provenance(replace(clean, weight_update_during=None), clean).weight_update_during is None  # type: ignore[union-attr]
    assert joined_provenance(None, None) is None
    p, d = halves()
    sref = SeamRef(ref_of(replace(p, provenance=stale_cache()), "a"), ref_of(replace(d, provenance=clean), "b"),
                   plan_seam(p, d, received=PROMPT, total_rows=TOTAL))  # fmt: skip
    assert sref.provenance == joined
