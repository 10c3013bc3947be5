"""rr's one row check on verl 0.9.1's own Megatron feeder (issue 45, first part): the rows verl's Megatron engine
hands ``set_router_replay_data`` pass :meth:`rr_client.trainer.rows.ReplayRows.check` before verl sets a single
router target.

verl's feeder checks only that each sample has as many rows as tokens (or one fewer); megatron-core then accepts a
repeated expert id, an id past the expert count (an index error deep in the dispatcher, or a silent clamp), a zero
row between recorded ones (every such token routed to expert 0), rows at a dense layer, without a word. Here each
micro-batch's rows (verl's jagged ``[B, j, L, K]``, aligned to the tokens by verl's ``align_r3_router_replay_data``)
pass rr's check against the model's MoE shape from megatron-core's ``TransformerConfig``: top-k width, id range,
distinct ids, recorded rows a prefix of each sample's tokens, zero rows at dense layers. A failure raises rr's typed
error (:class:`rr_client.ExpertIdOutOfRangeError`, :class:`rr_client.UnrecordedRoutingError`, ...) naming the
micro-batch sample, token and layer; verl's own feeder then runs unchanged on rows that passed.

Only R3 (the rollout's rows: verl passes its replay mask) is checked; R2's record is megatron-core's own choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rr_client.core import __version__
from rr_client.core.codec import wire_dtype
from rr_client.core.errors import ConfigurationError
from rr_client.core.info import RRInfo

from ._rows import packed_rows

__all__ = ["megatron_info", "check_megatron_rows", "checked_feeder"]


def _moe_layer_flags(tf_config: Any) -> list[bool]:
    """Per decoder layer (0-based): whether it is MoE, from ``moe_layer_freq`` (an int N: every N-th layer from
    layer 0; a list: megatron's per-layer pattern of 1 MoE / 0 dense)."""
    n = int(tf_config.num_layers)
    freq = getattr(tf_config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    pattern = [bool(x) for x in freq]
    if len(pattern) != n:
        raise ConfigurationError(f"moe_layer_freq names {len(pattern)} layers, the model has {n}")
    return pattern


def megatron_info(tf_config: Any) -> RRInfo:
    """The model's MoE shape as rr checks rows against it, from megatron-core's ``TransformerConfig``."""
    experts, topk = getattr(tf_config, "num_moe_experts", None), getattr(tf_config, "moe_router_topk", None)
    if not experts or not topk:
        raise ConfigurationError("router_replay on a Megatron model without MoE layers (num_moe_experts unset)")
    flags = _moe_layer_flags(tf_config)
    return RRInfo(
        engine="verl-megatron",
        engine_version="",
        rr_version=__version__,
        num_hidden_layers=len(flags),
        num_experts=int(experts),
        topk=int(topk),
        moe_layers=[i for i, f in enumerate(flags) if f],
        wire_dtype=wire_dtype(int(experts)).name,
    )


def check_megatron_rows(layers_topk_idx: Any, tf_config: Any) -> None:
    """rr's full check on one micro-batch's R3 rows as verl's Megatron engine feeds them (jagged ``[B, j, L, K]``,
    one row per token, zero rows where the rollout recorded none); raises rr's typed errors."""
    if not getattr(layers_topk_idx, "is_nested", False):
        raise ConfigurationError("rr checks verl's jagged R3 rows only (verl's remove-padding layout)")
    packed_rows(layers_topk_idx, layers_topk_idx.offsets(), megatron_info(tf_config))


def checked_feeder(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``set_router_replay_data`` with rr's check first, on R3's rows (the calls with a replay mask)."""

    @functools.wraps(orig)
    def set_router_replay_data(
        layers_topk_idx: Any,
        attention_mask: Any,
        tf_config: Any,
        vp_rank: Any = None,
        replay_mask: Any = None,
        local_cp_size: Any = None,
        model: Any = None,
    ) -> Any:
        if replay_mask is not None and layers_topk_idx is not None:
            check_megatron_rows(layers_topk_idx, tf_config)
        return orig(
            layers_topk_idx,
            attention_mask,
            tf_config,
            vp_rank,
            replay_mask=replay_mask,
            local_cp_size=local_cp_size,
            model=model,
        )

    return set_router_replay_data
