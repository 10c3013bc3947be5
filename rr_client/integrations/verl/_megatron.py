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

The stale-rows policy runs on each R3 micro-batch too (``prepare_model_inputs``, where the micro-batch's per-sample
provenance is in reach: :mod:`._provenance`): ``RR_STALE_ROWS=refuse`` (default) raises
:class:`rr_client.StaleRoutingError`; ``mask`` turns verl's replay mask off on that sample's tokens, so they route
natively (verl's own meaning of its mask); ``off`` replays them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from rr_client.core import __version__, settings
from rr_client.core.codec import wire_dtype
from rr_client.core.errors import ConfigurationError
from rr_client.core.info import RRInfo
from rr_client.trainer.session import AUDIT_EVERY

from . import _provenance
from ._rows import packed_rows

__all__ = ["megatron_info", "check_megatron_rows", "checked_feeder", "policed_inputs", "counted_batch", "RouterAudit"]

# per micro-batch: the samples the stale-rows policy kept replayed (None: all), from prepare_model_inputs to the
# feeder verl's forward_step calls next
_KEEP: ContextVar[tuple[bool, ...] | None] = ContextVar("rr_verl_megatron_keep", default=None)


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


def _masked_samples(replay_mask: torch.Tensor, keep: Sequence[bool]) -> torch.Tensor:
    """verl's jagged ``[B, j]`` replay mask, off on every token of the samples not in ``keep``."""
    offsets = replay_mask.offsets()
    flags = torch.tensor(list(keep), dtype=torch.bool, device=offsets.device)
    per_token = flags.repeat_interleave(offsets.diff())
    values = replay_mask.values().bool() & per_token.to(replay_mask.device)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def policed_inputs(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngineWithLMHead.prepare_model_inputs`` with rr's stale-rows policy on an R3 micro-batch's
    samples (their provenance from verl's batch): refuse raises here; mask leaves the samples it names to the
    feeder, which turns their replay off."""

    @functools.wraps(orig)
    def prepare_model_inputs(self: Any, batch: Any) -> Any:
        inputs = orig(self, batch)
        _KEEP.set(None)
        replay = getattr(getattr(self, "engine_config", None), "router_replay", None)
        if inputs.get("routed_experts") is None or getattr(replay, "mode", None) != "R3":
            return inputs
        ids = inputs["input_ids"]
        n = ids.offsets().numel() - 1 if getattr(ids, "is_nested", False) else int(ids.shape[0])
        check = _provenance.police(_provenance.batch_provenances(batch, n), _provenance.stale_policy())
        checks = getattr(self, "_rr_checks", None)
        if isinstance(checks, list):  # the step's checks (counted_batch), per micro-batch
            checks.append(check)
        if not all(check.replay):
            _KEEP.set(check.replay)
        return inputs

    return prepare_model_inputs


class RouterAudit:
    """rr's audit of verl's Megatron replay, independent of verl's feeder: a forward hook on every ``TopKRouter``
    compares the experts it chose (its ``routing_map``) with the targets verl's feeder gave it, on the tokens verl's
    replay mask replays, in ``REPLAY_FORWARD`` forwards. Counts stay on the device; one host read per step."""

    def __init__(self, chunks: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [
            m
            for chunk in (chunks if isinstance(chunks, (list, tuple)) else [chunks])
            for m in chunk.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None
        ]
        self.counts: dict[int, torch.Tensor] = {}  # layer_number -> [replayed rows, rows that ran their targets]
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, router: Any, _args: Any, output: Any) -> None:
        replay = router.router_replay
        action = getattr(replay, "router_replay_action", None)
        target = getattr(replay, "target_topk_idx", None)
        if getattr(action, "name", None) != "REPLAY_FORWARD" or target is None:
            return
        routing_map = output[1]
        want = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, target.to(routing_map.device).long(), True)
        mask = getattr(replay, "target_replay_mask", None)
        mask = torch.ones(want.shape[0], dtype=torch.bool, device=want.device) if mask is None else mask.bool()
        same = (routing_map.bool() == want).all(dim=1) & mask.to(want.device)
        got = torch.stack([mask.sum(), same.sum()]).long()
        layer = int(router.layer_number)
        self.counts[layer] = self.counts[layer] + got if layer in self.counts else got

    def close(self) -> dict[str, float]:
        """Remove the hooks; the step's ``r3/`` audit keys. Raises :class:`rr_client.ReplayError` naming the layer
        where a replayed row did not run its target experts (verl's replay silently off: verl #7340's orphan
        routers, a stale target)."""
        from rr_client.core.errors import ReplayError
        from rr_client.trainer import keys as K

        for h in self.handles:
            h.remove()
        if not self.counts:
            return {}
        layers = sorted(self.counts)
        read = torch.stack([self.counts[layer] for layer in layers]).tolist()  # the step's one host read
        per = {layer: [int(x) for x in c] for layer, c in zip(layers, read)}
        replayed = sum(c[0] for c in per.values())
        applied = sum(c[1] for c in per.values())
        met = {
            K.REPLAYED_ROWS: float(replayed),
            K.APPLIED_SHARE: applied / replayed if replayed else 1.0,
            K.APPLIED_SHARE_MIN_LAYER: min((c[1] / c[0] if c[0] else 1.0) for c in per.values()),
        }
        bad = [layer for layer, (n, ok) in per.items() if ok < n]
        if bad:
            layer = bad[0]
            n, ok = per[layer]
            raise ReplayError(
                f"verl's Megatron replay: the router of layer {layer} ran its replayed experts on {ok} of {n} "
                f"replayed rows (layers short: {bad}); the rows did not reach the router",
                report=met,
            )
        return met


def counted_batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngine.forward_backward_batch`` with the step's stale-rows counts (``r3/stale_masked``,
    ``r3/spans_update``, ``r3/provenance_unknown``, ``r3/cached_tokens``, summed over its R3 micro-batches) kept in
    ``engine.rr_last_metrics`` and, on the last pipeline stage, in verl's step metrics as ``actor/r3/...``."""

    @functools.wraps(orig)
    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        from rr_client.trainer.provenance import merge_checks, provenance_metrics

        self._rr_checks = []
        steps = getattr(self, "_rr_steps", 0)
        self._rr_steps = steps + 1
        every = settings.integer("RR_AUDIT_EVERY", default=AUDIT_EVERY)
        replaying = getattr(getattr(self, "engine_config", None), "router_replay", None)
        audit = (
            RouterAudit(self.module)
            if getattr(replaying, "mode", "disabled") == "R3" and every and steps % every == 0
            else None
        )
        try:
            out = orig(self, data, loss_function, forward_only)
        finally:
            checks, self._rr_checks = self._rr_checks, None
            audited = audit.close() if audit is not None else {}
        self.rr_last_metrics = {**audited, **(provenance_metrics(merge_checks(checks)) if checks else {})}
        if self.rr_last_metrics and isinstance(out, dict) and isinstance(out.get("metrics"), dict):
            for k, v in self.rr_last_metrics.items():
                out["metrics"][f"actor/{k}"] = [v]
        return out

    return forward_backward_batch


def checked_feeder(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``set_router_replay_data`` with rr's check first, on R3's rows (the calls with a replay mask), and the
    samples the stale-rows policy masked left to the router."""

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
            keep = _KEEP.get()
            if keep is not None:
                replay_mask = _masked_samples(replay_mask, keep)
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
