"""verl 0.9.1's own Megatron engine on two gloo ranks with rr's feeder: PP = 2 and CP = 2 (issue 45).

Each spawned rank builds verl's ``ActorRolloutRefWorker`` (``actor.strategy=megatron``, R3) with
``pipeline_model_parallel_size=2`` or ``context_parallel_size=2`` and runs the worker's ``compute_log_prob`` on the
batch ``RayPPOTrainer._compute_old_log_prob`` builds (tests/verl_megatron/engine_ranks.py). What each rank's routers
ran is read from megatron-core's own ``routing_map`` (harness.MoeSeen) and put back into sample order by the test's
own arithmetic (PP: each stage's layer; CP: Megatron's zigzag THD split, every sample padded to a multiple of
2 * cp and its chunks ``r`` and ``2 * cp - 1 - r`` on rank ``r``): every token with a rollout row ran exactly its
row's experts, per layer. PP = 2's log-probs equal the one-rank engine's on the same batch.

Stand-ins beyond test_engine_replay.py's (named): Ray's dispatch (each rank calls the worker itself, the last stage's
output kept); ``torch.cuda.synchronize`` a no-op (megatron's p2p shape exchange); ``batch_p2p_comm=False`` (gloo has
no batched P2P) and ``variable_seq_lengths=True`` set on the built config (verl's schedule call sends shapes first;
the allgather dispatcher's config check refuses it at build, and with TP = EP = 1 it gathers nothing); under CP the
local attention attends within its rank's slice of each sample (no ring attention without Transformer Engine), which
changes the hidden states, not which experts the rows force.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.megatron.launcher import results_of, run_cases
from tests.verl_megatron import engine_ranks as er
from tests.verl_megatron.test_engine_replay import (
    EXPERTS,
    LAYERS,
    MICRO,
    TOPK,
    batch_of,
    per_sample,
    random_rows,
    sample_tokens,
    workers,  # noqa: F401 - the module-scoped fixture
)


@pytest.fixture(scope="module")
def outcomes(megatron_verl_process: None, model_dir: Any) -> dict[str, list[tuple[bool, Any]]]:
    """Each layout in its own pair of ranks: verl's worker builds Megatron's parallel state once per process."""
    return {**run_cases([er.case_pp2]), **run_cases([er.case_cp2])}


def _want(rows: np.ndarray, layer: int) -> np.ndarray:
    """``[n - 1, E]`` bool: the experts each token with a row must run at ``layer`` (1-based)."""
    out = np.zeros((rows.shape[0], EXPERTS), dtype=bool)
    np.put_along_axis(out, rows[:, layer - 1].astype(np.int64), True, axis=1)
    return out


def test_pp2_each_stage_runs_the_rows_of_its_layer(
    outcomes: dict[str, list[tuple[bool, Any]]],
    workers: Any,  # noqa: F811
    tokenizer: Any,
) -> None:
    res = results_of(outcomes, er.case_pp2)
    assert [r["layers"] for r in res] == [[1], [2]]  # one MoE layer per stage
    rows, lengths = res[0]["rows"], res[0]["lengths"]
    checked = 0
    for rank, r in enumerate(res):
        layer = rank + 1
        maps = r["maps"][layer]
        assert len(maps) == len(lengths) // MICRO
        for i, sample in enumerate(per_sample([torch.from_numpy(m) for m in maps], lengths)):
            got = sample.numpy()
            assert np.array_equal(got[:-1], _want(rows[i], layer)), f"stage {rank} sample {i}"
            assert int(got[-1].sum()) == TOPK
            checked += got.shape[0] - 1
        assert r["metrics"]["r3/applied_share"] == 1.0
    assert checked == sum(n - 1 for n in lengths) * LAYERS
    # the last stage's log-probs are the one-rank engine's on the same batch
    assert res[0]["log_probs"] is None and res[1]["log_probs"] is not None
    cfg, w = workers["R3"]
    toks = sample_tokens(31)
    same = [random_rows(len(p) + len(q) - 1, seed=310 + i) for i, (p, q) in enumerate(toks)]
    assert all(np.array_equal(a, b) for a, b in zip(same, rows))
    one = w.compute_log_prob(er.trainer_batch(batch_of(tokenizer, toks, same)))
    lp = one["log_probs"].to_padded_tensor(0.0).float()
    np.testing.assert_allclose(res[1]["log_probs"], lp.numpy(), atol=1e-2)


def _zigzag(lengths: list[int], cp: int, rank: int) -> list[tuple[int, int, int]]:
    """``(sample, start, stop)`` token ranges of each sample that CP rank ``rank`` holds, in its order: every sample
    padded to a multiple of ``2 * cp``, chunks ``rank`` and ``2 * cp - 1 - rank`` (Megatron's THD split)."""
    out = []
    for i, n in enumerate(lengths):
        padded = -(-n // (2 * cp)) * 2 * cp
        c = padded // (2 * cp)
        out += [(i, rank * c, rank * c + c), (i, (2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    return out


def test_cp2_each_rank_runs_the_rows_of_its_zigzag_slice(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    res = results_of(outcomes, er.case_cp2)
    assert [r["layers"] for r in res] == [[1, 2], [1, 2]]
    rows, lengths = res[0]["rows"], res[0]["lengths"]
    checked = 0
    for layer in (1, 2):
        for mb in range(len(lengths) // MICRO):
            ls = lengths[mb * MICRO : (mb + 1) * MICRO]
            padded = [np.zeros((-(-n // 4) * 4, EXPERTS), dtype=bool) for n in ls]
            for rank, r in enumerate(res):  # each rank's map, in its token order, back to the samples' positions
                m, at = r["maps"][layer][mb], 0
                for i, a, b in _zigzag(ls, 2, rank):
                    padded[i][a:b] = m[at : at + b - a]
                    at += b - a
                assert at == m.shape[0], f"rank {rank}: {m.shape[0]} routed tokens, the split says {at}"
            for j, n in enumerate(ls):
                i = mb * MICRO + j
                assert np.array_equal(padded[j][: n - 1], _want(rows[i], layer)), f"layer {layer} sample {i}"
                assert int(padded[j][n - 1].sum()) == TOPK  # the last token: the model's own routing
                checked += n - 1
    assert checked == sum(n - 1 for n in lengths) * LAYERS
    assert sum(r["metrics"]["r3/replayed_rows"] for r in res) == checked
    assert all(r["metrics"]["r3/applied_share"] == 1.0 for r in res)
    # verl gathers the log-probs over the CP group; its output rank (is_mp_src_rank_with_outputs) returns them
    assert res[1]["log_probs"] is None and np.isfinite(res[0]["log_probs"]).all()
    assert res[0]["log_probs"].shape[0] == len(lengths)
