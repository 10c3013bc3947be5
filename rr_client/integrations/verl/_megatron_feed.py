"""rr's feeder in place of verl 0.9.1's ``set_router_replay_data`` on its Megatron engine (issue 45).

verl's engine calls its feeder once per micro-batch and model chunk, inside its forward step, with the micro-batch's
jagged rows ``[B, j, L, K]`` (R3: the rollout's, aligned to the tokens by verl's ``align_r3_router_replay_data``, with
verl's replay mask; R2: the rows verl's ``compute_log_prob`` recorded, no mask). Here those rows become rr's rows
once (:meth:`rr_client.trainer.rows.ReplayRows.from_jagged`: absolute layers or MoE ordinals by the axis length),
pass rr's one check for this chunk's routers (width, id range, distinct ids, recorded rows a prefix of each sample,
no rows at a dense layer), are laid out by rr's Megatron feeder (:func:`rr_client.integrations.megatron._feeder.feed`:
each packed sample padded as verl's ``preprocess_thd_engine`` pads it, the context-parallel zigzag slice, the
sequence-parallel shard) and handed to each router's own ``RouterReplay`` by its ``layer_number``, never by list
position. Tokens without a row (pads, each sample's last token) get distinct pad rows spread over all experts
(verl's R2 sends every pad to expert 0); R3's mask keeps verl's meaning (masked-off tokens route natively), less the
samples the stale-rows policy masked. verl's own feeder is never called.

What rr's feeder cannot lay out as verl's model does is refused, naming the setting (:func:`refuse_layout`):
dynamic context parallelism, the padded (non remove-padding) layout, FP8's THD padding, the contiguous CP layout.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rr_client.core import __version__
from rr_client.core.codec import wire_dtype
from rr_client.core.errors import ConfigurationError, MissingRoutingError
from rr_client.core.info import RRInfo
from rr_client.trainer.rows import ReplayRows

from ._rows import coverage_verdict, per_sample_count

__all__ = ["KEPT", "megatron_info", "refuse_layout", "padded_bounds", "verl_feed", "rr_feeder", "KEY_PREFIX"]

KEY_PREFIX = "actor_rollout_ref.actor.megatron"
_ROUTERS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()  # model chunk -> its routers


# the attribute, on the model chunk verl's forward_step hands its feeder, holding that micro-batch's samples the
# stale-rows policy kept replayed (a tuple of bools; None: all): set by rr's forward_step for that call only
KEPT = "_rr_kept_samples"


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


def refuse_layout(tf_config: Any, *, nested: bool = True, local_cp_size: Any = None) -> None:
    """Raise :class:`ConfigurationError` for a layout rr's feeder does not lay out as verl's model does."""
    if local_cp_size is not None:
        raise ConfigurationError(
            f"verl's dynamic context parallelism (local_cp_size={local_cp_size}) with router_replay: rr lays out "
            f"rows for Megatron's fixed CP groups only; set {KEY_PREFIX}.dynamic_context_parallel=False"
        )
    if not nested:
        raise ConfigurationError(
            "router_replay on verl's Megatron engine with padded (bshd) micro-batches: verl packs the rows "
            "thd-style while the model forwards [b, s]; set actor_rollout_ref.model.use_remove_padding=True"
        )
    if getattr(tf_config, "fp8", None) in ("e4m3", "hybrid"):
        raise ConfigurationError(
            f"router_replay with fp8={tf_config.fp8!r}: verl pads each packed sample for FP8 beyond Megatron's "
            "CP/TP alignment, which rr's feeder was not verified on; train the replayed actor without "
            f"{KEY_PREFIX}.override_transformer_config.fp8"
        )
    if getattr(tf_config, "experimental_attention_variant", None) == "dsv4_hybrid":
        raise ConfigurationError(
            "router_replay with experimental_attention_variant='dsv4_hybrid': verl shards its rows contiguously "
            "(and pads to csa_window_size), a layout rr's feeder does not lay out"
        )


def padded_bounds(offsets: torch.Tensor, tp_size: int, cp_size: int) -> torch.Tensor:
    """Each packed sample's padded bounds as verl's ``preprocess_thd_engine`` pads them for the model (zigzag CP):
    every sample to a multiple of ``tp * cp * (2 if cp > 1 else 1)``; int64 on the CPU."""
    align = tp_size * cp_size * (2 if cp_size > 1 else 1)
    lengths = offsets.long().cpu().diff()
    padded = lengths + (align - lengths % align) % align
    return torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])


def _routers(model: Any) -> list[Any]:
    """The chunk's routers (rr's :class:`~rr_client.integrations.megatron.MegatronRouter`), found once per chunk."""
    from rr_client.integrations.megatron import find_routers

    found = _ROUTERS.get(model)
    if found is None:
        found = _ROUTERS[model] = find_routers(model)
    return found


#: each model chunk's pad ordinals (rr_client.integrations.megatron._feeder.PadClock), kept while verl holds the chunk
_PADS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def verl_feed(
    layers_topk_idx: Any,
    tf_config: Any,
    *,
    model: Any,
    replay_mask: Any = None,
    local_cp_size: Any = None,
    keep: tuple[bool, ...] | None = None,
) -> dict[Any, tuple[torch.Tensor, torch.Tensor | None]]:
    """rr's targets for verl's call: ``{router module: (targets [local_tokens, topk] int64, the local tokens rr
    replays [local_tokens] bool)}`` for every router of ``model`` (this chunk) that takes rows. ``replay_mask``
    (R3): verl's jagged ``[B, j]`` mask; ``keep``: per sample, whether the stale-rows policy keeps it replayed
    (None: all)."""
    from rr_client.integrations.megatron import PadClock, feed, parallel_from_state

    if layers_topk_idx is None:
        raise MissingRoutingError(
            "verl's Megatron engine asked for replay without routed_experts (R2: compute_log_prob must record "
            "before the update; R3: the rollout must return routing, rollout.enable_rollout_routing_replay=True)"
        )
    if model is None:
        raise ConfigurationError("verl called its feeder without the forwarded model: rr feeds that model's routers")
    nested = bool(getattr(layers_topk_idx, "is_nested", False))
    refuse_layout(tf_config, nested=nested, local_cp_size=local_cp_size)
    info = megatron_info(tf_config)
    offsets = layers_topk_idx.offsets()
    rows = ReplayRows.from_jagged(
        layers_topk_idx, offsets, num_hidden_layers=info.num_hidden_layers, moe_layers=info.moe_layers
    )
    spare = [layer for layer in rows.layers if layer not in set(info.moe_layers)]
    if spare:  # rows at a dense layer: the layer axis is off (no router of any stage reads them)
        rows.check([], spare=spare, refuse_spare=True)
    have, pending = rows.have, rows.pending
    if replay_mask is not None:
        mask = replay_mask.values() if getattr(replay_mask, "is_nested", False) else replay_mask
        mask = mask.reshape(1, -1).to(have.device).bool()
        if keep is not None and not all(keep):
            per = torch.tensor(list(keep), dtype=torch.bool).repeat_interleave(offsets.long().cpu().diff())
            mask = mask & per.reshape(1, -1).to(have.device)
        have = have & mask
        pending += (_covers_replay_mask(rows, mask),)
    rows = replace(rows, have=have, pending=pending)
    routers = _routers(model)
    par = parallel_from_state(routers)
    got = feed(
        routers,
        rows,
        parallel=par,
        mtp="auto",  # verl's rows carry no MTP layer: MTP routers route themselves, as in verl
        cu_seqlens_padded=padded_bounds(offsets, par.tp_size, par.cp_size),
        pads=_PADS.setdefault(model, PadClock()),  # pads number on across this chunk's micro-batches
    )
    have = got.have
    return {m: (t, None if have is None else have.to(t.device, non_blocking=True)) for m, t in got.targets.items()}


def _covers_replay_mask(rows: ReplayRows, mask: torch.Tensor) -> Any:
    """R3: every token verl's replay mask replays (``build_r3_replay_mask``: each sample's tokens before its last,
    the ones its response log-probs are computed at) has a recorded row, read with the check's one host read;
    rows that stop early would have those tokens routed with pad rows under the loss (FSDP's rule,
    :func:`rr_client.integrations.verl._rows.replay_rows`' ``loss_end``)."""
    off = rows.cu_seqlens
    assert off is not None
    return coverage_verdict(rows.have[0], off, per_sample_count(mask.reshape(-1), off))


def rr_feeder(orig: Callable[..., Any]) -> Callable[..., Any]:
    """rr's feeder with verl's ``set_router_replay_data`` signature (verl's kept as ``__wrapped__``, never called):
    each router of ``model`` gets rr's targets through its own ``RouterReplay.set_target_indices`` (so verl's
    backward recompute pops them as it pops its own), with R3's replay mask; the tokens rr replays (R2: every
    recorded one) are ``rr_have`` on that ``RouterReplay``, for rr's audit. The samples the stale-rows policy kept
    come on ``model`` (:data:`KEPT`, set by rr's ``forward_step``)."""

    @functools.wraps(orig)
    def set_router_replay_data(
        layers_topk_idx: Any,
        attention_mask: Any,
        tf_config: Any,
        vp_rank: Any = None,
        replay_mask: Any = None,
        local_cp_size: Any = None,
        model: Any = None,
    ) -> None:
        with torch.no_grad():
            fed = verl_feed(
                layers_topk_idx,
                tf_config,
                model=model,
                replay_mask=replay_mask,
                local_cp_size=local_cp_size,
                keep=getattr(model, KEPT, None) if replay_mask is not None else None,
            )
        for module, (targets, have) in fed.items():
            module.router_replay.set_target_indices(targets, replay_mask=have if replay_mask is not None else None)
            module.router_replay.rr_have = (targets, have)  # the audit's rows, bound to these targets

    return set_router_replay_data
