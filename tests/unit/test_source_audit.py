"""The source audit's counting (rr_client.core.source_audit) and its verdict in a sample's provenance (issue 57):
served rows against the engine's re-score, per cell and token, by segment, context depth and layer; the verdict in
``rr_provenance`` and the stale-rows policy acting on it."""

from __future__ import annotations

import numpy as np
import pytest

from rr_client.core.errors import ConfigurationError, MalformedPayloadError, ShapeMismatchError, StaleRoutingError
from rr_client.core.provenance import Provenance, check_provenance
from rr_client.core.source_audit import DEFAULT_THRESHOLD, compare_picks, compare_rows, merge_agreements
from rr_client.trainer import keys as K
from rr_client.trainer.provenance import provenance_metrics

L, TOPK, E = 4, 2, 8
MOE = [0, 2, 3]  # layer 1 dense (zeros on both sides)


def routing(n: int, seed: int = 0) -> np.ndarray:
    """``[n, L, K]`` distinct expert ids per row, layer 1 dense."""
    g = np.random.default_rng(seed)
    rows = np.argsort(g.random((n, L, E)), axis=-1)[..., :TOPK].astype(np.uint8)
    rows[:, 1] = 0
    return rows


def test_the_engines_own_rows_agree_on_every_cell_in_any_order() -> None:
    full = routing(30)  # the re-score: positions 0..29 (prompt 20 + output 10)
    served = full[4:29, :, ::-1].copy()  # asked from token 4, the last token has no row; ids in another order
    got = compare_rows(served, full, start=4, prompt_tokens=20, cached_tokens=8, moe_layers=MOE)
    assert (got.cells, got.agreed, got.tokens, got.tokens_agreed) == (25 * 3, 25 * 3, 25, 25)
    assert got.agreement == 1.0 and got.passes() and got.first_disagreement is None
    # positions 4..7 cached, 8..19 computed, 20..28 generated
    assert got.by_segment == {"cached_prompt": (12, 12), "computed_prompt": (36, 36), "generated": (27, 27)}
    assert got.by_depth == {"0-8k": (75, 75)} and got.layers == tuple(MOE)
    assert got.describe().startswith("ok: 75/75 cells agree")


def test_decode_rows_one_token_late_fail_in_the_generated_segment_only() -> None:
    full = routing(80, seed=1)
    served = full[:79].copy()
    served[73:] = full[72:78]  # generated rows (72..78) each holding the previous token's
    got = compare_rows(served, full, start=0, prompt_tokens=72, moe_layers=MOE)
    assert got.by_segment["computed_prompt"] == (216, 216)
    a, c = got.by_segment["generated"]
    assert a / c < 0.3 and got.failing() == ["generated"] and got.first_disagreement == 73
    assert got.agreement > DEFAULT_THRESHOLD  # the whole sample hides it: the per-segment verdict does not
    line = got.describe()
    assert line.startswith("FLAGGED: ") and "generated 0." in line and "first differing token 73" in line


def test_depth_buckets_and_the_worst_layer() -> None:
    n = 9000
    full = routing(n, seed=2)
    served = full[8000 : n - 1].copy()
    served[8500 - 8000 :, 3] = routing(n - 1 - 8500, seed=9)[:, 3]  # layer 3 wrong from position 8500 on
    got = compare_rows(served, full, start=8000, prompt_tokens=100, moe_layers=MOE)
    assert set(got.by_depth) == {"0-8k", "8-16k"} and got.by_depth["0-8k"] == (192 * 3, 192 * 3)
    assert got.by_depth["8-16k"][0] < got.by_depth["8-16k"][1]
    layer, share = got.worst_layer() or (None, None)
    assert layer == 3 and share < 0.6 and got.first_disagreement is not None and got.first_disagreement >= 8500
    assert "depth 8-16k" in got.failing() and "generated" in got.failing()
    both = merge_agreements([got, compare_rows(full[:50], full, start=0, prompt_tokens=20, moe_layers=MOE)])
    assert both is not None and both.samples == 2 and both.cells == got.cells + 150
    assert both.by_depth["0-8k"] == (192 * 3 + 150, 192 * 3 + 150) and merge_agreements([]) is None


def test_bad_shapes_and_thresholds_are_typed_errors() -> None:
    full = routing(10)
    with pytest.raises(
        ShapeMismatchError, match="re-score has 10 rows from token 0; served rows cover positions 2..10"
    ):
        compare_rows(full[:9], full, start=2, prompt_tokens=5)
    with pytest.raises(ShapeMismatchError, match=r"\[rows, layers, k\]"):
        compare_rows(full[:, :2], full, start=0, prompt_tokens=5)
    with pytest.raises(ConfigurationError, match="threshold must be a number in \\(0, 1\\]"):
        compare_rows(full[:9], full, start=0, prompt_tokens=5).failing(1.5)


def test_the_verdict_in_provenance_makes_the_sample_stale() -> None:
    full = routing(20, seed=3)
    bad = full[:19].copy()
    bad[10:] = routing(9, seed=4)
    detail = compare_rows(bad, full, start=0, prompt_tokens=10, moe_layers=MOE)
    flagged = Provenance(
        source_checked=True, source_agreement=detail.agreement, source_flagged=True, source_detail=detail
    )
    passed = Provenance(source_checked=True, source_agreement=1.0)
    wire = flagged.to_dict()
    assert wire["source_checked"] is True and wire["source_flagged"] is True and "source_detail" not in wire
    assert Provenance.from_dict(wire) == flagged and "source_checked" not in Provenance().to_dict()
    assert flagged.stale and not passed.stale
    with pytest.raises(StaleRoutingError, match=r"sample 1: the engine's own re-score .*agreement 0\.\d+.*'mask'"):
        check_provenance([passed, flagged])
    check = check_provenance([passed, flagged, None], "mask")
    assert check.replay == (True, False, True) and check.masked == 1
    assert (check.source_checked, check.source_flagged) == (2, 1) and check.source == detail
    met = provenance_metrics(check)
    assert met[K.SOURCE_CHECKED] == 2 and met[K.SOURCE_FLAGGED] == 1
    assert met[K.source("agreement", "generated")] < 0.5 and met[K.source("agreement", "computed_prompt")] == 1.0
    assert met[K.source("agreement", "depth_0-8k")] == detail.agreement
    unchecked = Provenance(source_flagged=True)  # fail_closed: the re-score failed
    with pytest.raises(StaleRoutingError, match="not re-scored, and the audit fails closed"):
        check_provenance([unchecked])


@pytest.mark.parametrize(
    "field,value",
    [("source_checked", "yes"), ("source_flagged", 1), ("source_agreement", 1.5), ("source_agreement", True)],
)
def test_malformed_source_fields_are_refused(field: str, value: object) -> None:
    wire = {**Provenance(source_checked=True, source_agreement=0.5).to_dict(), field: value}
    with pytest.raises(MalformedPayloadError, match=field):
        Provenance.from_dict(wire)


def test_source_and_depth_keys() -> None:
    assert K.source("agreement") == "r3/source/agreement"
    assert K.source("agreement", "cached_prompt") == "r3/source/cached_prompt/agreement"
    assert K.source("agreement", "depth_64k+") == "r3/source/depth_64k+/agreement"
    assert K.depth("16-32k", "k3_kl") == "r3/depth/16-32k/k3_kl" and K.is_depth_key("r3/depth/0-8k/agreement")
    with pytest.raises(ValueError, match="depth_1k"):
        K.source("agreement", "depth_1k")
    with pytest.raises(ValueError, match="depth bucket '1k'"):
        K.depth("1k", "agreement")


def test_indexer_picks_count_per_pick_so_a_boundary_tie_costs_one_pick() -> None:
    """Indexer picks (token positions, -1 padding) are compared pick by pick: a swapped boundary pick costs one pick
    of its row; picks of other positions (KV slots) fall; the re-score's picks may start at another token."""
    g = np.random.default_rng(5)
    n, layers, k, first = 40, 2, 8, 8
    full = np.stack([np.stack([g.permutation(p + 1)[:k] for _ in range(layers)]) for p in range(first, n)])
    served = full[2:].copy()  # served from token 10, the re-score from token 8 (its index_topk)
    served[5, 0, 0] = next(x for x in range(n) if x <= 15 and x not in full[7, 0])  # one tie swapped at token 15
    served[20, 1, :2] = -1  # padding is not a pick
    got = compare_picks(served, full, start=10, prompt_tokens=30, rescored_start=first)
    cells = served.size - 2
    assert (got.cells, got.agreed) == (cells, cells - 1) and got.first_disagreement == 15 and got.passes()
    slots = served.copy()
    pos = np.arange(10, n)[:, None, None]
    slots[20:] = np.where(served[20:] >= 0, (served[20:] + 3) % (pos[20:] + 1), -1)  # generated: KV slots
    bad = compare_picks(slots, full, start=10, prompt_tokens=30, rescored_start=first)
    assert bad.failing() == ["generated"] or "generated" in bad.failing()
    assert bad.by_segment["computed_prompt"][0] == bad.by_segment["computed_prompt"][1] - 1
    with pytest.raises(ShapeMismatchError, match="served picks cover positions 6..35"):
        compare_picks(served, full, start=6, prompt_tokens=30, rescored_start=first)
