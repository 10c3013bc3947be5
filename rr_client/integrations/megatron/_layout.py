"""The layout math from a batch's rows to the tokens one rank's routers see, in Megatron's own order (torch only).

Megatron's routers see tokens sequence-first (``[s, b]`` flattened: row = ``s_idx * b + b_idx``; packed THD is
``b = 1``), after the batch was sliced for context parallelism (:func:`cp_zigzag_index`, as
``megatron.core.utils.get_batch_on_this_cp_rank`` slices ``[b, s, ...]``; :func:`cp_thd_index`, as Transformer
Engine's ``thd_get_partitioned_indices`` slices each packed sample) and scattered for sequence parallelism
(:func:`sp_shard`: each tensor-parallel rank routes one contiguous block of ``s / tp`` sequence positions). No
megatron import here: the functions are plain index arithmetic, unit-tested on their own. Pad rows and each
sample's last token are the rows' own rules (:mod:`rr_client.trainer.rows`), named here for the feeder.
"""

from __future__ import annotations

import torch

from rr_client.core.errors import ShapeMismatchError
from rr_client.trainer.rows import last_tokens, pad_ids

__all__ = ["cp_zigzag_index", "cp_thd_index", "sp_shard", "sequence_first", "distinct_pad_row", "last_tokens"]


def cp_zigzag_index(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions context-parallel rank ``cp_rank`` keeps of ``seq_len``: chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks (Megatron's ``get_batch_on_this_cp_rank``)."""
    _check_cp(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ShapeMismatchError(
            f"sequence length {seq_len} is not a multiple of 2 * context_parallel_size = "
            f"{2 * cp_size}: Megatron's get_batch_on_this_cp_rank cannot slice it"
        )
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def cp_thd_index(cu_seqlens_padded: torch.Tensor | list[int], total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The packed (THD) token positions context-parallel rank ``cp_rank`` keeps: of every sample (bounds
    ``cu_seqlens_padded``, each a multiple of ``2 * cp_size`` long) its chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank``, samples in order (Megatron's ``get_thd_batch_on_this_cp_rank``)."""
    _check_cp(cp_size, cp_rank)
    cu = [
        int(x)
        for x in (cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded, torch.Tensor) else cu_seqlens_padded)
    ]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != total:
        raise ShapeMismatchError(f"cu_seqlens_padded {cu} must rise from 0 to the {total} packed tokens")
    if cp_size == 1:
        return torch.arange(total)
    parts = []
    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        n = end - start
        if n % (2 * cp_size):
            raise ShapeMismatchError(
                f"packed sample {i} spans {n} tokens, not a multiple of 2 * "
                f"context_parallel_size = {2 * cp_size}: pad each sample (cu_seqlens_padded)"
            )
        chunk = n // (2 * cp_size)
        a, b = start + cp_rank * chunk, start + (2 * cp_size - 1 - cp_rank) * chunk
        parts += [torch.arange(a, a + chunk), torch.arange(b, b + chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def sp_shard(seq_len: int, tp_size: int, tp_rank: int) -> slice:
    """The sequence positions tensor-parallel rank ``tp_rank`` routes under sequence parallelism (Megatron's
    ``scatter_to_sequence_parallel_region``: contiguous ``seq_len / tp_size`` blocks of the first dimension)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ShapeMismatchError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if seq_len % tp_size:
        raise ShapeMismatchError(
            f"{seq_len} sequence positions on this context-parallel rank do not split "
            f"evenly over tensor_model_parallel_size={tp_size} (sequence parallel)"
        )
    block = seq_len // tp_size
    return slice(tp_rank * block, (tp_rank + 1) * block)


def sequence_first(rows: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` per-sample rows as the router's tokens ``[s * b, ...]`` (row = ``s_idx * b + b_idx``)."""
    return rows.transpose(0, 1).reshape(rows.shape[0] * rows.shape[1], *rows.shape[2:])


def distinct_pad_row(topk: int, num_experts: int, ordinal: int = 0, layer: int = 0) -> torch.Tensor:
    """``[topk]`` distinct, valid expert ids for pad ``ordinal`` at absolute ``layer``: one row of
    :func:`rr_client.trainer.rows.pad_ids` (``(ordinal * topk + col + layer * topk) % num_experts``)."""
    return pad_ids(torch.tensor([ordinal]), [layer], topk, num_experts)[0, 0]


def _check_cp(cp_size: int, cp_rank: int) -> None:
    """Refuse a context-parallel rank outside its group."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ShapeMismatchError(f"context-parallel rank {cp_rank} is not in [0, {cp_size})")
