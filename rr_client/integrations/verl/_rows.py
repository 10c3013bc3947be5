"""verl's routing rows -> what ``replay_routing`` takes, with rr's full check; and the multi-turn row rule.

No verl import here: verl hands the engine ``routed_experts`` as a jagged nested tensor ``[B, j, L, K]`` whose
values line up with ``input_ids.values()`` (``left_right_2_no_padding``), zero rows where the rollout recorded
nothing (the last token, tool tokens after the last turn). These functions turn that into packed rows and a
replay mask (through :class:`rr_client.trainer.rows.ReplayRows` and its one check), and refuse what would replay
wrong instead of leaving it to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rr_client.core.errors import MissingRoutingError, ShapeMismatchError
from rr_client.core.info import RRInfo
from rr_client.trainer.rows import Pending, Reader, ReplayRows, fill_pads

__all__ = [
    "packed_rows",
    "replay_rows",
    "padded_rows",
    "sample_of_rows",
    "accumulate_turn_rows",
    "unpack_recorded",
]


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


def replay_rows(
    routed: torch.Tensor,
    offsets: torch.Tensor,
    info: RRInfo,
    *,
    pad: int = 0,
    width: int | None = None,
    loss_end: torch.Tensor | None = None,
    provenance: Sequence[Any] | None = None,
) -> ReplayRows:
    """One micro-batch's rows as :class:`rr_client.trainer.rows.ReplayRows` laid out as the model sees its tokens,
    not yet checked: the session's door (``ReplaySession.open_replay``) applies the stale-rows policy to their
    ``provenance`` (one per sample), masks once and checks them once, with one host read.

    Packed ``[1, N + pad]`` (verl's remove-padding, ``pad`` tokens appended without rows; ``cu_seqlens`` the
    samples' bounds) or, with ``width``, right-padded ``[B, width]``. Besides the check's own verdicts, read with it:
    :meth:`~rr_client.trainer.rows.ReplayRows.from_jagged`'s (the recorded rows are a non-empty prefix of each
    sample), no recorded row at a layer the model builds dense, and, with ``loss_end`` (``[B]``: the position of
    each sample's last loss token, 0 where it has none), rows for every token before it: a sample whose rows stop
    early would route its later tokens with the model's own choice, under the loss."""
    jag = ReplayRows.from_jagged(routed, offsets, num_hidden_layers=info.num_hidden_layers, moe_layers=info.moe_layers)
    flat, have, off = jag.rows[0], jag.have[0], jag.cu_seqlens
    assert off is not None
    pending = jag.pending + _dense_verdict(jag, info)
    if loss_end is not None:
        pending += (coverage_verdict(have, off, loss_end),)
    provs = None if provenance is None else tuple(provenance)
    if width is not None:
        dense, dmask = padded_rows(flat, have, off, width)
        return ReplayRows(dense, dmask, jag.layers, provenance=provs, pending=pending)
    if pad:
        flat = torch.cat([flat, flat.new_zeros((pad, *flat.shape[1:]))])
        have = torch.cat([have, have.new_zeros(pad)])
    n = int(flat.shape[0])
    return ReplayRows(
        flat.unsqueeze(0), have.unsqueeze(0), jag.layers, cu_seqlens=off, shape=(n,), provenance=provs, pending=pending
    )


def _dense_verdict(rows: ReplayRows, info: RRInfo) -> tuple[Pending, ...]:
    """A recorded row at an axis layer the model builds dense (verl: any id non-zero): its layer axis is off."""
    moe = set(info.moe_layers)
    spare = [p for p, layer in enumerate(rows.layers) if layer not in moe]
    if not spare:
        return ()
    vals = rows.rows[0].index_select(1, torch.tensor(spare, device=rows.device))
    hit = (vals != 0).any(dim=-1) & rows.have[0].unsqueeze(1)  # [N, spare]

    def error() -> Exception:
        layer = rows.layers[spare[int(hit.any(dim=0).nonzero()[0, 0])]]
        return ShapeMismatchError(
            f"dense layer {layer} holds routing rows: the rows' layer axis does not match the model's MoE layers "
            f"{list(info.moe_layers)} (a dense/MoE layer mismatch between engine and trainer, verl #5037)"
        )

    return ((hit.any(), error),)


def per_sample_count(flags: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: how many of the packed ``[N]`` ``flags`` are set in each sample (``off``: the jagged
    offsets), on ``flags``' device, without a host read."""
    b = int(off.numel()) - 1
    sample = sample_of_rows(off.to(flags.device), int(flags.shape[0]))
    counts = torch.zeros(max(b, 1), dtype=torch.long, device=flags.device).index_add_(0, sample, flags.long())
    return counts.narrow(0, 0, b)


def coverage_verdict(have: torch.Tensor, off: torch.Tensor, loss_end: torch.Tensor) -> Pending:
    """Every sample's recorded rows (a prefix, by :meth:`ReplayRows.from_jagged`'s verdict) reach its last loss
    token: that token's log-prob is computed at the tokens before it, so each of them needs its row."""
    counts = per_sample_count(have, off)
    need = loss_end.to(have.device).long()
    short = counts < need

    def error() -> Exception:
        i = int(short.nonzero()[0, 0])
        got, end = int(counts[i]), int(need[i])
        return MissingRoutingError(
            f"micro-batch sample {i} ({int(off[i + 1] - off[i])} tokens): routed_experts has rows for its first "
            f"{got} tokens, but its last loss token (response_mask) is token {end}: tokens {got}..{end - 1} would "
            "route with the model's own choice under the loss (the rollout returned rows for fewer tokens than the "
            "sample trains on)"
        )

    return short.any(), error


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
