"""verl's routing rows -> what ``replay_routing`` takes, with rr's full check; and the multi-turn row rule.

No verl import here: verl hands the engine ``routed_experts`` as a jagged nested tensor ``[B, j, L, K]`` whose
values line up with ``input_ids.values()`` (``left_right_2_no_padding``), zero rows where the rollout recorded
nothing (the last token, tool tokens after the last turn). These functions turn that into packed rows and a
replay mask (through :class:`rr_client.trainer.rows.ReplayRows` and its one check), and refuse what would replay
wrong instead of leaving it to the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rr_client.core.errors import MissingRoutingError, ShapeMismatchError
from rr_client.core.info import RRInfo
from rr_client.trainer.rows import Reader, ReplayRows, fill_pads

__all__ = ["packed_rows", "padded_rows", "sample_of_rows", "accumulate_turn_rows", "unpack_recorded"]


def sample_of_rows(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Sample index of each of ``n`` packed rows, from the jagged ``offsets`` (``[B + 1]``); rows past the last
    sample (verl's pads) get the last sample's index."""
    return torch.searchsorted(
        offsets.narrow(0, 1, offsets.numel() - 1), torch.arange(n, device=offsets.device), right=True
    ).clamp_max(offsets.numel() - 2)


def packed_rows(routed: torch.Tensor, offsets: torch.Tensor, info: RRInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, L, K] int64, replay mask [N])`` of one micro-batch, checked once, on the rows' device.

    The rows become :class:`rr_client.trainer.rows.ReplayRows` (:meth:`~rr_client.trainer.rows.ReplayRows.from_jagged`:
    a token has a row where any id is non-zero, verl's convention; in every sample the recorded rows must be a
    prefix of its tokens and not empty: a zero row between recorded ones, or a sample without any, is an error,
    never a silent native forward) and pass the rows' one check for the model's MoE layers (top-k, id range,
    distinct ids, no partly padded row, no rows at a dense layer), on the rows' device with one host read. Rows
    without routing come back as pad rows spread over all experts (:func:`rr_client.trainer.rows.fill_pads`), the
    mask False there; rows and mask stay where verl put them.
    """
    rows = ReplayRows.from_jagged(routed, offsets, num_hidden_layers=info.num_hidden_layers, moe_layers=info.moe_layers)
    readers = [
        Reader(layer, info.num_experts, info.topk, f"layer {layer}")
        for layer in info.moe_layers
        if layer in rows.layers
    ]
    spare = [layer for layer in rows.layers if layer not in set(info.moe_layers)]
    rows.check(readers, spare=spare, refuse_spare=True)
    have = rows.have.reshape(-1)
    return fill_pads(rows.flat, have, rows.layers, info.num_experts), have


def padded_rows(
    rows: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``[N, L, K]`` and mask ``[N]`` -> verl's right-padded ``[B, width, L, K]`` and ``[B, width]``,
    on the rows' device, with integer indices (no boolean indexing: no host sync)."""
    off = offsets.to(rows.device)
    n = int(rows.shape[0])
    sample = sample_of_rows(off, n)
    col = torch.arange(n, device=rows.device) - off.index_select(0, sample)
    dense = rows.new_zeros((off.numel() - 1, width, *rows.shape[1:])).index_put_((sample, col), rows)
    dmask = mask.new_zeros((off.numel() - 1, width)).index_put_((sample, col), mask)
    return dense, dmask


def unpack_recorded(rows: torch.Tensor, offsets: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """R2: the rows a record pass saw (``[N + pad, L, K]``, packed order) -> jagged int16 ``[B, j, L, K]``."""
    if pad:
        rows = rows[:-pad]
    if rows.shape[0] != int(offsets[-1]):
        raise ShapeMismatchError(f"recorded {rows.shape[0]} rows for {int(offsets[-1])} tokens")
    return torch.nested.nested_tensor_from_jagged(rows.to(torch.int16).contiguous(), offsets)


def accumulate_turn_rows(held: Any, new: Any) -> Any:
    """Multi-turn: keep every row already held, take from ``new`` only the rows after them.

    Each turn's engine output covers the whole conversation so far (its prompt includes the earlier turns),
    but re-prefilled rows of earlier turns are not the routing those tokens were generated with. rr's
    ``Trajectory`` rule: a turn adds only rows it did not hold. ``new`` must cover at least the held rows.
    """
    if held is None:
        return new
    if new is None:
        raise MissingRoutingError("a later turn returned no routing while earlier turns did")
    if tuple(held.shape[1:]) != tuple(new.shape[1:]):
        raise ShapeMismatchError(f"turn routing shape {tuple(new.shape)} differs from the held {tuple(held.shape)}")
    if new.shape[0] < held.shape[0]:
        raise ShapeMismatchError(f"a turn returned {new.shape[0]} rows, fewer than the {held.shape[0]} already held")
    if isinstance(held, torch.Tensor):
        return torch.cat([held, torch.as_tensor(new)[held.shape[0] :].to(held.dtype)])
    return np.concatenate([np.asarray(held), np.asarray(new)[held.shape[0] :].astype(np.asarray(held).dtype)])
