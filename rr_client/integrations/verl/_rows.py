"""verl's routing rows -> what ``replay_routing`` takes, with rr's full check; and the multi-turn row rule.

No verl import here: verl hands the engine ``routed_experts`` as a jagged nested tensor ``[B, j, L, K]`` whose
values line up with ``input_ids.values()`` (``left_right_2_no_padding``), zero rows where the rollout recorded
nothing (the last token, tool tokens after the last turn). These functions turn that into packed rows and a
replay mask, and refuse what would replay wrong instead of leaving it to the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rr_client.core.codec import check_routing
from rr_client.core.errors import MissingRoutingError, ShapeMismatchError, UnrecordedRoutingError
from rr_client.core.info import RRInfo

__all__ = ["packed_rows", "padded_rows", "accumulate_turn_rows", "unpack_recorded"]


def _sample_of_rows(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Sample index of every packed row, from the jagged ``offsets`` (``[B + 1]``)."""
    return torch.searchsorted(offsets.narrow(0, 1, offsets.numel() - 1), torch.arange(n, device=offsets.device),
                              right=True)


def packed_rows(routed: torch.Tensor, offsets: torch.Tensor, info: RRInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, L, K] int64, replay mask [N])`` of one micro-batch, checked once, on the rows' device.

    Rows are recorded where any id is non-zero (verl's convention: zero rows are unrecorded). In every sample
    the recorded rows must be a prefix of its tokens and not empty: a zero row between recorded ones, or a
    sample without any, is an error, never a silent native forward. The recorded rows then pass
    :func:`rr_client.core.codec.check_routing` (layers, top-k, id range, distinct ids, zero dense layers). The
    checks read one CPU copy of the micro-batch (one transfer); the returned rows and mask stay where verl
    put them, so the GPU path has no other host read here.
    """
    values = routed.values() if routed.is_nested else routed
    if values.dim() != 3:
        raise ShapeMismatchError(f"routed_experts must be [tokens, layers, topk] per sample, got {tuple(values.shape)}")
    n, layers, k = (int(s) for s in values.shape)
    if k != info.topk:
        raise ShapeMismatchError(f"routed_experts has top-{k}, the model routes top-{info.topk}")
    if k == 1:
        raise ShapeMismatchError("top-1 routing: an all-zero row (unrecorded) cannot be told from expert 0; rr "
                                 "refuses to replay verl's zero-padded layout for top-1 models")
    host, off = values.cpu(), offsets.cpu()  # the micro-batch's one device-to-host copy
    if int(off[-1]) != n:
        raise ShapeMismatchError(f"routed_experts has {n} rows but input_ids has {int(off[-1])} tokens")
    recorded = (host != 0).flatten(1).any(dim=1)
    sample = _sample_of_rows(off, n)
    counts = torch.zeros(off.numel() - 1, dtype=torch.long)
    counts.index_add_(0, sample, recorded.long())
    pos = torch.arange(n) - off[sample]
    prefix = pos < counts[sample]
    if not torch.equal(prefix, recorded):
        row = int((prefix != recorded).nonzero()[0, 0])
        i = int(sample[row])
        raise UnrecordedRoutingError(
            f"micro-batch sample {i} ({int(off[i + 1] - off[i])} tokens): token {int(pos[row])} has an "
            f"all-zero routing row, yet {int(counts[i])} rows are recorded; verl's rows must cover a prefix of the "
            "sample (the rollout lost rows?)")
    lengths = off[1:] - off[:-1]
    empty = ((counts == 0) & (lengths > 1)).nonzero()
    if empty.numel():
        raise MissingRoutingError(
            f"micro-batch sample {int(empty[0, 0])} carries no routing rows (all zero): the rollout returned none for it "
            "(is actor_rollout_ref.rollout.enable_rollout_routing_replay=True?)")
    if layers == info.num_hidden_layers:
        num_layers, moe = info.num_hidden_layers, info.moe_layers
    elif layers == len(info.moe_layers):
        num_layers, moe = layers, list(range(layers))
    else:
        raise ShapeMismatchError(f"routed_experts has {layers} layers; the model has {info.num_hidden_layers} "
                                 f"decoder layers ({len(info.moe_layers)} MoE)")
    dims = info.model_copy(update={"num_hidden_layers": num_layers, "moe_layers": moe})
    chosen = host[recorded]
    check_routing(chosen.numpy(), dims, rows=int(chosen.shape[0]))
    return values.long(), (values != 0).flatten(1).any(dim=1)


def padded_rows(rows: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``[N, L, K]`` and mask ``[N]`` -> verl's right-padded ``[B, width, L, K]`` and ``[B, width]``,
    on the rows' device, with integer indices (no boolean indexing: no host sync)."""
    off = offsets.to(rows.device)
    n = int(rows.shape[0])
    sample = _sample_of_rows(off, n)
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
        return torch.cat([held, torch.as_tensor(new)[held.shape[0]:].to(held.dtype)])
    return np.concatenate([np.asarray(held), np.asarray(new)[held.shape[0]:].astype(np.asarray(held).dtype)])
