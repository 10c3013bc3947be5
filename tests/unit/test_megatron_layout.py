"""The Megatron feeder's layout math without megatron-core: CP zigzag and THD slicing, SP shard, sequence-first order,
pads, each sample's last token (rr_client/integrations/megatron/_layout.py)."""

from __future__ import annotations

import pytest
import torch

from rr_client.core.errors import ShapeMismatchError
from rr_client.integrations.megatron._layout import (
    cp_thd_index,
    cp_zigzag_index,
    distinct_pad_row,
    last_tokens,
    sequence_first,
    sp_shard,
)


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r() -> None:
    """As get_batch_on_this_cp_rank: 2*cp chunks, rank r keeps chunks r and 2cp-1-r, in that order."""
    assert cp_zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_zigzag_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_zigzag_index(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_ranks_cover_every_position_once(cp: int) -> None:
    seq = 8 * cp
    got = torch.cat([cp_zigzag_index(seq, cp, r) for r in range(cp)])
    assert sorted(got.tolist()) == list(range(seq))


def test_zigzag_refuses_what_megatron_cannot_slice() -> None:
    with pytest.raises(ShapeMismatchError, match="not a multiple of 2 \\* context_parallel_size = 4"):
        cp_zigzag_index(6, 2, 0)
    with pytest.raises(ShapeMismatchError, match="context-parallel rank 2 is not in"):
        cp_zigzag_index(8, 2, 2)


def test_thd_slices_every_packed_sample_zigzag() -> None:
    """Per sample (padded bounds), rank r keeps that sample's chunks r and 2cp-1-r; samples stay in order."""
    cu = [0, 4, 12]  # sample 0: 4 tokens (chunks of 1), sample 1: 8 tokens (chunks of 2)
    assert cp_thd_index(cu, 12, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert cp_thd_index(cu, 12, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    assert cp_thd_index(torch.tensor(cu), 12, 1, 0).tolist() == list(range(12))


def test_thd_refuses_unpadded_samples_and_bad_bounds() -> None:
    with pytest.raises(ShapeMismatchError, match="packed sample 1 spans 6 tokens"):
        cp_thd_index([0, 4, 10], 10, 2, 0)
    with pytest.raises(ShapeMismatchError, match="must rise from 0 to the 12 packed tokens"):
        cp_thd_index([0, 4, 8], 12, 2, 0)


def test_sp_shard_is_a_contiguous_block_of_the_sequence() -> None:
    assert sp_shard(8, 2, 0) == slice(0, 4)
    assert sp_shard(8, 2, 1) == slice(4, 8)
    assert sp_shard(8, 1, 0) == slice(0, 8)
    with pytest.raises(ShapeMismatchError, match="do not split evenly over tensor_model_parallel_size=4"):
        sp_shard(6, 4, 0)


def test_sequence_first_is_the_routers_token_order() -> None:
    """Row s_idx * b + b_idx holds sample b_idx's token s_idx (Megatron's [s, b] flattened)."""
    rows = torch.arange(2 * 3).reshape(2, 3, 1)  # sample b, position s -> 3b + s
    assert sequence_first(rows).flatten().tolist() == [0, 3, 1, 4, 2, 5]


def test_pad_rows_are_distinct_valid_experts() -> None:
    assert distinct_pad_row(4, 8).tolist() == [0, 1, 2, 3]
    with pytest.raises(ShapeMismatchError, match="top-k 9 exceeds the 8 experts"):
        distinct_pad_row(9, 8)


def test_last_tokens_follow_the_attention_mask() -> None:
    """Left, right and split padding: the last real token of each sample; an empty sample has none."""
    attn = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    assert last_tokens(attn).long().tolist() == [[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]


def test_megatron_core_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.16.x passes; other releases are refused naming the tested one; none installed names the extra (the
    absence is faked by the metadata reader returning None: megatron-core is installed here)."""
    from rr_client.core.errors import MissingDependencyError, UnsupportedVersionError
    from rr_client.integrations.megatron import _gate

    monkeypatch.delenv("RR_ALLOW_UNSUPPORTED_VERSION", raising=False)
    assert _gate.check_megatron_version("0.16.1") == "0.16.1"
    for other in ("0.17.0", "0.15.3", "0.19.2"):
        with pytest.raises(
            UnsupportedVersionError, match=f"tested with megatron-core 0.16; found megatron-core {other}"
        ):
            _gate.check_megatron_version(other)
    monkeypatch.setenv("RR_ALLOW_UNSUPPORTED_VERSION", "1")
    assert _gate.check_megatron_version("0.19.2") == "0.19.2"
    monkeypatch.setattr(_gate, "installed_version", lambda dists: None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'rr-replay\[megatron\]'"):
        _gate.check_megatron_version()
