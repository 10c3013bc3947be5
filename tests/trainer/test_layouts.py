"""Split (verl) and packed (THD) layouts, layer axis and pad policies, each against a per-sample Python reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rr_client import ConfigurationError, RRInfo, ShapeMismatchError, to_packed, to_tensors
from tests.support.routing_data import dims_info

L, E, K = 4, 8, 2
MOE = [0, 2, 3]  # layer 1 dense


@dataclass
class S:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    routed_experts: np.ndarray
    routed_experts_start: int = 0


def info(num_experts: int = E) -> RRInfo:
    return dims_info(L, num_experts, K, MOE)


def sample(i: int, lp: int, lo: int, start: int = 0, seed: int = 0, num_experts: int = E) -> S:
    rng = np.random.default_rng(seed * 100 + i)
    rows = lp + lo - 1 - start
    arr = np.zeros((rows, L, K), dtype=np.uint8 if num_experts <= 256 else np.uint16)
    for r in range(rows):
        for layer in MOE:
            arr[r, layer] = rng.choice(num_experts, K, replace=False)
    return S(i, list(rng.integers(1, 100, lp)), list(rng.integers(1, 100, lo)), arr, start)


BATCH = [sample(0, 3, 4), sample(1, 5, 1), sample(2, 1, 3), sample(3, 4, 4, start=2)]


def pad_value(policy: str) -> list[list[int]]:
    if policy == "zero":
        return [[0] * K] * L
    if policy == "distinct":
        return [[j % E for j in range(K)]] * L
    return [[-1] * K] * L


def spread_pads(routing: list, mask: list, layers: list[int]) -> list:
    """Reference of ``pad_experts="distinct"`` (issue 43): the n-th row without routing, in row-major order, holds
    ``(n * K + col + layer * K) % E`` at each absolute layer, so pads spread over every expert."""
    n = 0

    def walk(rows: list, m: list) -> list:
        nonlocal n
        if isinstance(m, list):
            return [walk(r, x) for r, x in zip(rows, m)]
        if m:
            return rows
        n += 1
        return [[((n - 1) * K + c + layer * K) % E for c in range(K)] for layer in layers]

    return walk(routing, mask)


def layer_list(moe_only: bool) -> list[int]:
    return MOE if moe_only else list(range(L))


def ref_row(s: S, j: int, layers: list[int], pad: list[list[int]]) -> tuple[bool, list[list[int]]]:
    """The reference's mask and routing for token ``j`` of ``s``: its row at ``layers``, or ``pad`` without one."""
    row = j - s.routed_experts_start
    if 0 <= row < len(s.routed_experts):
        return True, [[int(x) for x in s.routed_experts[row, layer]] for layer in layers]
    return False, pad


# ---------------------------------------------------------------- split (verl)


def ref_split(batch: list[S], P: int, R: int, policy: str, moe_only: bool) -> dict[str, list]:
    layers = layer_list(moe_only)
    pad = [pad_value(policy)[0]] * len(layers)
    out: dict[str, list] = {k: [] for k in ("ids", "attn", "resp", "mask", "routing", "pos")}
    for s in batch:
        ids, attn, resp, mask, routing, pos = [], [], [], [], [], []
        tokens = s.prompt_ids + s.output_ids
        # column c -> token index j or None
        col_tok = [None] * (P - len(s.prompt_ids)) + list(range(len(s.prompt_ids)))
        col_tok += list(range(len(s.prompt_ids), len(tokens))) + [None] * (R - len(s.output_ids))
        for j in col_tok:
            if j is None:
                ids.append(0)
                attn.append(0)
                resp.append(0)
                mask.append(False)
                routing.append(pad)
                pos.append(0)
                continue
            ids.append(tokens[j])
            attn.append(1)
            resp.append(int(j >= len(s.prompt_ids)))
            pos.append(j)
            has_row, rows = ref_row(s, j, layers, pad)
            mask.append(has_row)
            routing.append(rows)
        for k, v in zip(("ids", "attn", "resp", "mask", "routing", "pos"), (ids, attn, resp, mask, routing, pos)):
            out[k].append(v)
    if policy == "distinct":
        out["routing"] = spread_pads(out["routing"], out["mask"], layers)
    return out


@pytest.mark.parametrize("policy", ["zero", "distinct", "minus_one"])
@pytest.mark.parametrize("moe_only", [False, True])
def test_split_matches_reference(policy: str, moe_only: bool) -> None:
    P, R = 6, 5
    t = to_tensors(
        BATCH,
        info(),
        pad_side="split",
        prompt_length=P,
        response_length=R,
        moe_layers_only=moe_only,
        pad_experts=policy,
    )  # type: ignore[arg-type]
    ref = ref_split(BATCH, P, R, policy, moe_only)
    assert t.input_ids.tolist() == ref["ids"]
    assert t.attention_mask.tolist() == ref["attn"]
    assert t.response_mask.tolist() == ref["resp"]
    assert t.routed_experts_mask.tolist() == ref["mask"]
    assert t.position_ids is not None and t.position_ids.tolist() == ref["pos"]
    assert t.routed_experts.tolist() == ref["routing"]
    assert t.routed_experts.shape == (len(BATCH), P + R, len(layer_list(moe_only)), K)
    assert t.layers == layer_list(moe_only)
    assert t.layer_axis == ("moe" if moe_only else "absolute")
    assert t.routed_experts.dtype == (torch.int16 if policy == "minus_one" else torch.uint8)


def test_split_layer_major_is_a_permutation() -> None:
    tm = to_tensors(BATCH, info(), pad_side="split", prompt_length=5, response_length=4)
    lm = to_tensors(BATCH, info(), pad_side="split", prompt_length=5, response_length=4, layout="layer_major")
    assert torch.equal(lm.routed_experts, tm.routed_experts.permute(2, 0, 1, 3))


@pytest.mark.parametrize("P,R", [(4, 5), (6, 3)])
def test_split_too_long_is_a_typed_error(P: int, R: int) -> None:
    with pytest.raises(ShapeMismatchError, match="prompt_length|response_length"):
        to_tensors(BATCH, info(), pad_side="split", prompt_length=P, response_length=R)


def test_split_needs_lengths() -> None:
    with pytest.raises(ValueError):
        to_tensors(BATCH, info(), pad_side="split")
    with pytest.raises(ValueError):
        to_tensors(BATCH, info(), prompt_length=4, response_length=4)


def test_above_256_experts_int16_and_minus_one() -> None:
    batch = [sample(0, 3, 3, num_experts=300), sample(1, 2, 4, num_experts=300)]
    t = to_tensors(batch, info(300), pad_side="split", prompt_length=3, response_length=4, pad_experts="minus_one")
    ref = ref_split(batch, 3, 4, "minus_one", False)
    assert t.routed_experts.dtype == torch.int16 and t.routed_experts.tolist() == ref["routing"]


# ---------------------------------------------------------------- left/right keep their behaviour


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("policy", ["zero", "distinct", "minus_one"])
def test_left_right_pad_policy(pad_side: str, policy: str) -> None:
    t = to_tensors(BATCH, info(), pad_side=pad_side, pad_experts=policy)  # type: ignore[arg-type]
    pad = pad_value(policy)
    width = max(len(s.prompt_ids) + len(s.output_ids) for s in BATCH)
    if policy == "distinct":  # pads spread by ordinal (spread_pads); checked there, the real rows here
        assert t.routed_experts.tolist() == spread_pads(
            t.routed_experts.tolist(), t.routed_experts_mask.tolist(), list(range(L))
        )
        pad = None
    for b, s in enumerate(BATCH):
        n = len(s.prompt_ids) + len(s.output_ids)
        off = width - n if pad_side == "left" else 0
        for c in range(width):
            row = c - off - s.routed_experts_start
            if c - off < 0 or c - off >= n or not 0 <= row < len(s.routed_experts):
                assert not t.routed_experts_mask[b, c]
                assert pad is None or t.routed_experts[b, c].tolist() == pad
            else:
                assert t.routed_experts_mask[b, c]
                assert t.routed_experts[b, c].tolist() == s.routed_experts[row].tolist()
    assert t.position_ids is None


# ---------------------------------------------------------------- packed (THD)


def ref_packed(batch: list[S], append_row: bool, multiple: int | None, policy: str, moe_only: bool) -> dict[str, list]:
    layers = layer_list(moe_only)
    pad = [pad_value(policy)[0]] * len(layers)
    ids, pos, resp, cu, mask, routing, rcu = [], [], [], [0], [], [], [0]
    for s in batch:
        tokens = s.prompt_ids + s.output_ids
        for j, tok in enumerate(tokens):
            ids.append(tok)
            pos.append(j)
            resp.append(int(j >= len(s.prompt_ids)))
        cu.append(cu[-1] + len(tokens))
        n_rows = len(tokens) if append_row else len(tokens) - 1
        for j in range(n_rows):
            has_row, rows = ref_row(s, j, layers, pad)
            mask.append(has_row)
            routing.append(rows)
        rcu.append(rcu[-1] + n_rows)
    n_pad = 0
    while multiple and (len(ids) + n_pad) % multiple:
        n_pad += 1
    for j in range(n_pad):
        ids.append(0)
        pos.append(j)
        resp.append(0)
        mask.append(False)
        routing.append(pad)
    if policy == "distinct":
        routing = spread_pads(routing, mask, layers)
    return dict(ids=ids, pos=pos, resp=resp, cu=cu, mask=mask, routing=routing, rcu=rcu, n_pad=n_pad)


@pytest.mark.parametrize("append_row", [True, False])
@pytest.mark.parametrize("multiple", [None, 8])
@pytest.mark.parametrize("policy", ["zero", "distinct", "minus_one"])
@pytest.mark.parametrize("moe_only", [False, True])
def test_packed_matches_reference(append_row: bool, multiple: int | None, policy: str, moe_only: bool) -> None:
    p = to_packed(
        BATCH,
        info(),
        append_row=append_row,
        pad_to_multiple_of=multiple,
        pad_experts=policy,  # type: ignore[arg-type]
        moe_layers_only=moe_only,
    )
    ref = ref_packed(BATCH, append_row, multiple, policy, moe_only)
    assert p.input_ids.tolist() == ref["ids"]
    assert p.position_ids.tolist() == ref["pos"]
    assert p.response_mask.tolist() == ref["resp"]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == ref["cu"]
    assert p.routing_cu_seqlens.tolist() == ref["rcu"]
    assert p.routed_experts_mask.tolist() == ref["mask"]
    assert p.routed_experts.tolist() == ref["routing"]
    assert p.num_pad_tokens == ref["n_pad"]
    assert p.layers == layer_list(moe_only) and p.layer_axis == ("moe" if moe_only else "absolute")
    if multiple:
        assert len(p.input_ids) % multiple == 0
    if append_row:
        assert p.routed_experts.shape[0] == p.input_ids.shape[0]


def test_packed_equals_split_rows() -> None:
    """The same token's routing is in the same place in both layouts (cross-check of the two)."""
    t = to_tensors(BATCH, info(), pad_side="split", prompt_length=5, response_length=4)
    p = to_packed(BATCH, info())
    flat = t.attention_mask.bool()
    assert torch.equal(t.input_ids[flat], p.input_ids)
    assert torch.equal(t.routed_experts[flat], p.routed_experts)
    assert torch.equal(t.routed_experts_mask[flat], p.routed_experts_mask)
    assert torch.equal(t.position_ids[flat], p.position_ids)  # type: ignore[index]


def test_packed_rows_that_do_not_fit_are_refused() -> None:
    bad = sample(0, 3, 3)
    bad.routed_experts = np.concatenate([bad.routed_experts, bad.routed_experts[:2]])
    with pytest.raises(ShapeMismatchError):
        to_packed([bad], info())
    with pytest.raises(ShapeMismatchError):
        to_tensors([bad], info(), pad_side="split", prompt_length=3, response_length=3)


@dataclass
class LS(S):
    logprobs: np.ndarray | None = None
    logprobs_mode: str | None = "processed"


def _with_logprobs(batch: list[S]) -> list[LS]:
    out = []
    for s in batch:
        lp = -np.arange(1, len(s.output_ids) + 1, dtype=np.float64) / (s.index + 1)
        if len(lp) > 1:
            lp[1] = np.nan  # a log-prob the engine did not give stays NaN
        out.append(LS(s.index, s.prompt_ids, s.output_ids, s.routed_experts, s.routed_experts_start, lp))
    return out


@pytest.mark.parametrize("pad_side", ["left", "right", "split"])
def test_logprobs_sit_beside_their_completion_tokens(pad_side: str) -> None:
    batch = _with_logprobs(BATCH)
    opts = {"prompt_length": 5, "response_length": 4} if pad_side == "split" else {}
    t = to_tensors(batch, info(), pad_side=pad_side, **opts)  # type: ignore[arg-type]
    assert t.logprobs is not None and t.logprobs.dtype == torch.float32 and t.logprobs_mode == "processed"
    for i, s in enumerate(batch):
        resp = t.response_mask[i].bool()
        assert t.input_ids[i][resp].tolist() == s.output_ids
        np.testing.assert_array_equal(t.logprobs[i][resp].numpy(), s.logprobs.astype(np.float32))
        assert torch.isnan(t.logprobs[i][~resp]).all()
    p = to_packed(batch, info(), pad_to_multiple_of=8)
    flat = t.attention_mask.bool()
    assert p.logprobs is not None and p.logprobs_mode == "processed"
    np.testing.assert_array_equal(p.logprobs[: int(p.cu_seqlens[-1])].numpy(), t.logprobs[flat].numpy())
    assert torch.isnan(p.logprobs[int(p.cu_seqlens[-1]) :]).all()


def test_no_logprobs_no_tensor_and_mixed_or_short_refused() -> None:
    assert to_tensors(BATCH, info()).logprobs is None and to_packed(BATCH, info()).logprobs is None
    batch = _with_logprobs(BATCH)
    batch[2].logprobs = None
    with pytest.raises(ConfigurationError, match=r"samples \[2\] carry no log-probs"):
        to_tensors(batch, info())
    batch = _with_logprobs(BATCH)
    batch[0].logprobs = batch[0].logprobs[:-1]
    with pytest.raises(ShapeMismatchError, match="sample 0"):
        to_packed(batch, info())
    batch = _with_logprobs(BATCH)
    batch[1].logprobs_mode = "raw"
    with pytest.raises(ConfigurationError, match="different modes"):
        to_tensors(batch, info())
