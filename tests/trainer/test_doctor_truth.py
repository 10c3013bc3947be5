"""The doctor's ground truth is what the checkpoint's routers select, also where that is not the logits' top-k.

GLM-4.5 / DeepSeek-V3-style routers choose by sigmoid score plus ``e_score_correction_bias`` inside expert
groups: the top-k of ``router_logits`` is another set on many tokens, so a ground truth built from it would
fail a correct deployment. Tiny random GLM-4-MoE (transformers' own class), layer 0 dense.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rr_client.trainer.replay import record_routing
from rr_client.trainer.router_reference import router_forward, router_topk
from rr_server.doctor.truth import LayerAgreement, RouterReference
from tests.trainer.tiny_families import tiny_family_model

TOKENS = list(range(3, 43))
MOE = [1, 2]


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("glm4_moe")
    tiny_family_model("glm4_moe").save_pretrained(out)
    return out


def _engine_rows(path: Path) -> np.ndarray:
    """What a correct engine returns: the routers' own selection (rows for tokens 0..n-2, dense layer zero)."""
    ref = RouterReference(str(path))
    with torch.no_grad(), record_routing(ref.model) as rec:
        ref.model(torch.tensor([TOKENS]))
    return rec.routed_experts[0].numpy()[:-1].astype(np.uint8)


def _score(path: Path, routing: np.ndarray, start: int = 0) -> dict[int, LayerAgreement]:
    into: dict[int, LayerAgreement] = {}
    RouterReference(str(path)).compare(routing, TOKENS, start, MOE, into)
    return into


def test_logits_topk_is_not_the_selection_here(glm4_dir: Path) -> None:
    """Guards the test below: on this model the old reference (logits' top-k) disagrees with the selection."""
    ref = RouterReference(str(glm4_dir))
    _, logits = router_forward(ref.model, TOKENS, MOE)
    topk = router_topk(logits, 3, 2)[:-1]
    rows = _engine_rows(glm4_dir)
    same = [(set(a) == set(b)) for layer in MOE for a, b in zip(topk[:, layer], rows[:, layer])]
    assert not all(same), "grouped, bias-corrected selection equals plain top-k on every token: no test"


def test_correct_rows_score_100_percent(glm4_dir: Path) -> None:
    rows = _engine_rows(glm4_dir)
    agg = _score(glm4_dir, rows)
    assert sorted(agg) == MOE
    assert all(a.share == 1.0 and a.total == rows.shape[0] for a in agg.values()), {k: a.share for k, a in agg.items()}


def test_other_rows_are_named(glm4_dir: Path) -> None:
    rows = _engine_rows(glm4_dir)
    bad = rows.copy()
    bad[5, 2] = [e for e in range(8) if e not in rows[5, 2]][:2]
    agg = _score(glm4_dir, bad)
    assert agg[1].share == 1.0 and agg[2].equal == rows.shape[0] - 1
    assert agg[2].first_diff == (5, sorted(bad[5, 2].tolist()), sorted(rows[5, 2].tolist()))


def test_rows_from_a_start(glm4_dir: Path) -> None:
    rows = _engine_rows(glm4_dir)
    agg = _score(glm4_dir, rows[7:], start=7)
    assert all(a.share == 1.0 for a in agg.values())
