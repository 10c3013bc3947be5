"""rr's feeder beside verl 0.9.1's own ``set_router_replay_data`` on two gloo ranks: CP=2 (zigzag THD), TP=2 with
sequence parallelism, PP=2 with a dense first layer (verl #5452's dense + pipeline-offset configuration).

Each rank builds megatron-core 0.16.1's ``GPTModel`` (tests/megatron/harness.py, layers dense/MoE/MoE/MoE) after
verl's own ``apply_router_replay_patch`` (stand-in: tests/verl/cpu_platform.py, verl's accelerator as the CPU; so every router holds verl's ``RouterReplay``, as in verl's engine), and
calls both feeders exactly as verl's forward step does (jagged rows, verl's R3 replay mask from its own
``build_r3_replay_mask``, ``model=`` the chunk), on odd sample lengths so that the CP / TP alignment pads them.
Per router: the replay masks are equal, the targets equal on every token either replays; R2 (no mask, rows on the
MoE-ordinal axis as verl records them): equal on every real token, and on the pad tokens verl sends every one to
expert 0 (a repeated id: one EP rank takes every pad) while rr's pads are distinct ids spread over the experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.megatron import harness as H
from tests.megatron.launcher import results_of, run_cases
from tests.verl_megatron.harness import take_targets

PATTERN = (0, 1, 1, 1)  # layer 1 dense, layers 2-4 MoE; PP=2: stage 0 holds layers 1-2, stage 1 layers 3-4
LENGTHS = [7, 5, 10]  # odd lengths: padded to 4 (CP=2 zigzag) or 2 (TP=2) per sample
E, K = 8, 2


def _model(rank: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> Any:
    import os

    from tests.verl import cpu_platform

    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # set by a verl engine built in the
        os.environ.pop(var, None)  # parent (attention_backend=local), inherited here: this model's backend is auto

    cpu_platform.install()  # verl's accelerator as the CPU, before its feeder module reads the device name
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()
    H.init_parallel(rank=rank, world_size=2, tp=tp, pp=pp, cp=cp)
    H.new_model_state()
    return H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, num_experts=E, topk=K, sequence_parallel=tp > 1))


def _rows(r2: bool) -> tuple[Any, Any]:
    """(jagged rows, jagged R3 replay mask or None). R3: every decoder layer on the axis (zero rows at the dense
    layer), none for each sample's last token, aligned as verl's ``align_r3_router_replay_data`` aligns them; R2:
    the MoE layers' ordinals, a row for every token (verl's record)."""
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask

    g = torch.Generator().manual_seed(7)
    moe = [i for i, f in enumerate(PATTERN) if f]
    parts = []
    for n in LENGTHS:
        rows = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * len(PATTERN))]).view(n, -1, K)
        if r2:
            parts.append(rows[:, moe])
        else:
            rows[:, [i for i, f in enumerate(PATTERN) if not f]] = 0
            parts.append(rows[:-1])
    nested = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    if r2:
        return nested, None
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in LENGTHS], layout=torch.jagged)
    aligned = align_r3_router_replay_data(nested, ids)
    return aligned, build_r3_replay_mask(ids, torch.ones(len(LENGTHS), 3, dtype=torch.long))


def _side_by_side(model: Any, r2: bool) -> dict[str, Any]:
    """Both feeders on the same call; per router the comparison (run on the rank, returned for the parent)."""
    import importlib

    from rr_client.integrations.verl._megatron_feed import rr_feeder

    verl = importlib.import_module("verl.utils.megatron.router_replay_utils").set_router_replay_data
    rows, mask = _rows(r2)
    args = (rows, None, model.config, 0)
    verl(*args, replay_mask=mask, model=model)
    theirs = take_targets(model)
    rr_feeder(verl)(*args, replay_mask=mask, model=model)
    ours = take_targets(model)
    per: dict[int, dict[str, Any]] = {}
    for layer in sorted(set(theirs) | set(ours)):
        (t, tm), (o, om) = theirs[layer], ours[layer]
        same_mask = (tm is None and om is None) or (tm is not None and om is not None and torch.equal(tm, om))
        on = om if om is not None else (t != 0).any(dim=1)  # R2: verl's real tokens (its pads are zero rows)
        pads = (t == 0).all(dim=1) if om is None else torch.zeros(0, dtype=torch.bool)
        per[layer] = dict(
            tokens=int(o.shape[0]),
            shapes_equal=tuple(t.shape) == tuple(o.shape),
            masks_equal=same_mask,
            replayed=int(on.sum()),
            equal_where_replayed=bool(torch.equal(t[on], o[on])),
            pads=int(pads.sum()),
            verl_pads_expert0=bool((t[pads] == 0).all()) if om is None else None,
            rr_pads_distinct=bool((o[pads][:, 0] != o[pads][:, 1]).all()) if om is None else None,
            rr_pad_experts=int(o[pads].unique().numel()) if om is None else None,
        )
    return {"layers": sorted(per), "per": per}


def case_cp2_r3(rank: int) -> dict[str, Any]:
    return _side_by_side(_model(rank, cp=2), r2=False)


def case_cp2_r2(rank: int) -> dict[str, Any]:
    return _side_by_side(_model(rank, cp=2), r2=True)


def case_tp2_sp_r3(rank: int) -> dict[str, Any]:
    return _side_by_side(_model(rank, tp=2), r2=False)


def case_pp2_r3(rank: int) -> dict[str, Any]:
    return _side_by_side(_model(rank, pp=2), r2=False)


def case_pp2_r2(rank: int) -> dict[str, Any]:
    return _side_by_side(_model(rank, pp=2), r2=True)


CASES = [case_cp2_r3, case_cp2_r2, case_tp2_sp_r3, case_pp2_r3, case_pp2_r2]


@pytest.fixture(scope="module")
def outcomes(megatron_verl_process: None) -> dict[str, list[tuple[bool, Any]]]:
    return run_cases(CASES)


def _assert_equal(results: list[dict[str, Any]], layers_per_rank: list[list[int]], *, r2: bool) -> None:
    assert [r["layers"] for r in results] == layers_per_rank
    for rank, res in enumerate(results):
        for layer, c in res["per"].items():
            where = f"rank {rank}, layer {layer}: {c}"
            assert c["shapes_equal"] and c["masks_equal"] and c["equal_where_replayed"], where
            assert c["replayed"] > 0, where
            if r2:
                assert c["verl_pads_expert0"] and c["rr_pads_distinct"], where


def test_cp2_zigzag_rrs_targets_equal_verls(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    res = results_of(outcomes, case_cp2_r3)
    _assert_equal(res, [[2, 3, 4], [2, 3, 4]], r2=False)
    # each CP rank holds half of every sample padded to 4: (8 + 8 + 12) / 2 tokens
    assert {c["tokens"] for r in res for c in r["per"].values()} == {14}


def test_cp2_r2_pads_spread_where_verls_all_take_expert_0(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    res = results_of(outcomes, case_cp2_r2)
    _assert_equal(res, [[2, 3, 4], [2, 3, 4]], r2=True)
    assert sum(c["pads"] for r in res for c in r["per"].values()) == 3 * (1 + 3 + 2)  # 6 pads, per MoE layer
    assert all(c["rr_pad_experts"] > K for r in res for c in r["per"].values() if c["pads"] > 1)


def test_tp2_sequence_parallel_rrs_targets_equal_verls(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    res = results_of(outcomes, case_tp2_sp_r3)
    _assert_equal(res, [[2, 3, 4], [2, 3, 4]], r2=False)
    assert {c["tokens"] for r in res for c in r["per"].values()} == {(8 + 6 + 10) // 2}


def test_pp2_dense_first_stage_offsets_rrs_targets_equal_verls(outcomes: dict[str, list[tuple[bool, Any]]]) -> None:
    _assert_equal(results_of(outcomes, case_pp2_r3), [[2], [3, 4]], r2=False)
    _assert_equal(results_of(outcomes, case_pp2_r2), [[2], [3, 4]], r2=True)
