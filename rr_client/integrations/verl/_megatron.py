"""rr's session on verl 0.9.1's own Megatron engine (issue 45): the refusals at engine build, the stale-rows policy
per micro-batch, the step's counts, and the audit. The feeder itself, rr's in place of verl's
``set_router_replay_data``, is :mod:`._megatron_feed`.

- :func:`refusing_initialize` wraps ``MegatronEngine.initialize``: with ``router_replay.mode`` R2/R3, once the model
  is built, what rr's feeder would not hold under is refused in the worker, naming the setting: an untested
  megatron-core, a router configuration that bypasses replay (CUDA graphs over the router, the fused router, forced
  balancing, token dropping, input jitter: :func:`rr_client.integrations.megatron._routers.check_config`), dynamic
  context parallelism, the padded layout, FP8's THD padding.
- R2 with the rollout's rows (``rollout.enable_rollout_routing_replay=True``) is refused at the worker's start
  (:func:`._patches.refuse_r2_rollout_rows`): verl's R2 update would replay them with no stale-rows policy.
- :func:`policed_step` wraps ``MegatronEngineWithLMHead.forward_step``: the stale-rows policy on an R3 micro-batch's
  samples (their provenance from verl's batch, :mod:`._provenance`), counted once per micro-batch (the first model
  chunk's step; every VPP chunk steps through the same samples): ``RR_STALE_ROWS=refuse`` (default) raises
  :class:`rr_client.StaleRoutingError`; ``mask`` leaves the samples it names to the router (the feeder turns their
  replay mask off, verl's own meaning of its mask) and out of the log-prob gap; ``off`` replays them. The samples
  kept go to the feeder on the model chunk verl hands it (:data:`KEPT`), explicitly, for that call only.
- :func:`counted_batch` wraps ``MegatronEngine.forward_backward_batch``: the step's counts and the audit's keys in
  ``engine.rr_last_metrics`` and verl's step metrics (``actor/r3/...``). The audit clock
  (:class:`rr_client.integrations.verl._clock.TrainingStepClock`, ``engine.rr_clock``, verl FSDP's too) counts
  training steps, not engine calls: a step's first ``forward_only=False`` call opens it, its last update call
  (verl's ``update_lr_scheduler``), the end of the engine's outermost ``train_mode`` (:func:`clocked_train_mode`)
  or the next forward-only call closes it, and every call of an audited step is audited, R2 and R3 alike.
- :class:`RouterAudit`: on audited steps, what every router ran against the targets it was given.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rr_client.core import settings
from rr_client.core.errors import ReplayError
from rr_client.integrations.megatron import check_config, check_megatron_version, find_routers, own_choice
from rr_client.trainer import keys as K
from rr_client.trainer.audit import LayerCounts, layer_keys, share
from rr_client.trainer.metrics import gap_keys, gap_stats
from rr_client.trainer.provenance import merge_checks, provenance_metrics
from rr_client.trainer.session import AUDIT_EVERY

from . import _provenance
from ._clock import TrainingStepClock
from ._engine import check_gap_logprobs
from ._gate import REPLAY_MODES
from ._megatron_feed import KEPT, megatron_info, refuse_layout

__all__ = [
    "megatron_info",
    "refusing_initialize",
    "policed_step",
    "gapped_outputs",
    "counted_batch",
    "audit_clock",
    "clocked_train_mode",
    "RouterAudit",
]


def replay_mode(engine: Any) -> str:
    """The engine's ``router_replay.mode`` ("disabled" when unset)."""
    return str(getattr(getattr(getattr(engine, "engine_config", None), "router_replay", None), "mode", "disabled"))


def refuse_engine(engine: Any) -> None:
    """The refusals of rr's feeder on a built verl Megatron engine replaying R2/R3 (see the module docstring)."""
    check_megatron_version()
    cfg = engine.engine_config
    refuse_layout(
        engine.tf_config,
        nested=bool(getattr(cfg, "use_remove_padding", True)),
        local_cp_size="dynamic" if getattr(cfg, "dynamic_context_parallel", False) else None,
    )
    check_config(find_routers(engine.module))


def refusing_initialize(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngine.initialize``, then, with R2/R3, rr's refusals on the built model (in the worker,
    before any step)."""

    @functools.wraps(orig)
    def initialize(self: Any) -> Any:
        out = orig(self)
        if replay_mode(self) in REPLAY_MODES:
            refuse_engine(self)
        return out

    return initialize


def _police(engine: Any, batch: Any, *, count: bool) -> tuple[bool, ...] | None:
    """The stale-rows policy on an R3 micro-batch's samples: raises (refuse), or the samples kept replayed (None:
    all); the check joins the step's counts only when ``count`` (once per micro-batch)."""
    if replay_mode(engine) != "R3" or batch.get("routed_experts", None) is None:
        return None
    ids = batch["input_ids"]
    n = ids.offsets().numel() - 1 if getattr(ids, "is_nested", False) else int(ids.shape[0])
    check = _provenance.police(_provenance.batch_provenances(batch, n), _provenance.stale_policy())
    checks = getattr(engine, "_rr_checks", None)
    if count and isinstance(checks, list):  # the step's checks (counted_batch), once per micro-batch
        checks.append(check)
    return None if all(check.replay) else tuple(check.replay)


def policed_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngineWithLMHead.forward_step`` with rr's stale-rows policy on the micro-batch it takes:
    refuse raises here; the samples mask leaves out go to the feeder on the model chunk verl hands it (its
    ``model`` argument, :data:`KEPT`, for this call only) and to the gap (:func:`gapped_outputs`). Counted on the
    first model chunk only: every VPP chunk steps through the same micro-batch."""

    @functools.wraps(orig)
    def forward_step(
        self: Any, batch_iter: Any, model: Any, logits_processor_func: Any, postprocess_micro_batch_func: Any
    ) -> Any:
        from verl.utils.megatron_utils import unwrap_model

        batch = next(batch_iter)
        chunk = unwrap_model(model)
        keep = _police(self, batch, count=getattr(chunk, "vp_stage", None) in (None, 0))
        self._rr_keep = keep  # this micro-batch's, for its log-prob gap (prepare_model_outputs, after the forward)
        setattr(chunk, KEPT, keep)
        try:
            return orig(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        finally:
            setattr(chunk, KEPT, None)

    return forward_step


class RouterAudit:
    """rr's audit of the replay on verl's Megatron engine: a forward hook on every ``TopKRouter`` compares the experts
    it chose (its ``routing_map``) with the targets it was given, and the experts it would have chosen itself on the
    same input (``r3/agreement``), on the tokens rr's feeder replays with the router's current targets
    (``rr_have`` on verl's ``RouterReplay``: R3's replay mask, R2's recorded tokens), in ``REPLAY_FORWARD``
    forwards. Counts stay on the device; one host read per call."""

    def __init__(self, chunks: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [
            m
            for chunk in (chunks if isinstance(chunks, (list, tuple)) else [chunks])
            for m in chunk.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None
        ]
        # layer_number -> [replayed rows, rows that ran their targets, rows the router's own choice agrees with]
        self.counts: dict[int, torch.Tensor] = {}
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, router: Any, _args: Any, output: Any) -> None:
        replay = router.router_replay
        action = getattr(replay, "router_replay_action", None)
        target = getattr(replay, "target_topk_idx", None)
        if getattr(action, "name", None) != "REPLAY_FORWARD" or target is None:
            return
        routing_map = output[1]
        want = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, target.to(routing_map.device).long(), True)
        held = getattr(replay, "rr_have", None)  # (targets, the tokens rr's feeder replays with them)
        mask = held[1] if held is not None and held[0] is target else getattr(replay, "target_replay_mask", None)
        mask = torch.ones(want.shape[0], dtype=torch.bool, device=want.device) if mask is None else mask.bool()
        mask = mask.to(want.device)
        same = (routing_map.bool() == want).all(dim=1) & mask
        agree = (own_choice(router, _args[0]).to(want.device) == want).all(dim=1) & mask
        got = torch.stack([mask.sum(), same.sum(), agree.sum()]).long()
        layer = int(router.layer_number)
        self.counts[layer] = self.counts[layer] + got if layer in self.counts else got

    def close(self) -> dict[str, float]:
        """Remove the hooks; the step's ``r3/`` audit keys. Raises :class:`rr_client.ReplayError` naming the layer
        where a replayed row did not run its target experts (verl's replay silently off: verl #7340's orphan
        routers, a stale target)."""
        for h in self.handles:
            h.remove()
        if not self.counts:
            return {}
        layers = sorted(self.counts)
        read = torch.stack([self.counts[layer] for layer in layers]).tolist()  # the step's one host read
        per = {layer: [int(x) for x in c] for layer, c in zip(layers, read)}
        counts = [
            LayerCounts(layer - 1, replayed=n, checked=n, applied=ok, agreed=ag) for layer, (n, ok, ag) in per.items()
        ]
        met = layer_keys(counts)  # layer_number is 1-based; the keys name the wire's 0-based layer
        met[K.APPLIED_SHARE_MIN_LAYER] = min(
            (share(c.applied, c.checked) for c in counts if c.checked), default=math.nan
        )
        bad = [layer for layer, (n, ok, _) in per.items() if ok < n]
        if bad:
            layer = bad[0]
            n, ok, _ = per[layer]
            raise ReplayError(
                f"verl's Megatron replay: the router of layer {layer} ran its replayed experts on {ok} of {n} "
                f"replayed rows (layers short: {bad}); the rows did not reach the router",
                report=met,
            )
        return met


def gapped_outputs(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngineWithLMHead.prepare_model_outputs`` with, on a replayed micro-batch that carries the
    rollout's log-probs (``rollout_log_probs``, verl's ``rollout.calculate_log_probs=True``), the log-prob gap between
    the actor's and the rollout's over the response tokens of the samples replayed (not those the stale-rows policy
    masked), kept on the device for the step (:func:`counted_batch`). A gap whose two sides would not mean the same thing (the rollout's raw log-probs away
    from temperature 1) is refused first."""

    @functools.wraps(orig)
    def prepare_model_outputs(self: Any, output: Any, data: Any) -> Any:
        model_output = orig(self, output, data)
        gaps = getattr(self, "_rr_gaps", None)
        lp = model_output.get("log_probs") if isinstance(model_output, dict) else None
        if not isinstance(gaps, list) or lp is None or replay_mode(self) not in REPLAY_MODES:
            return model_output
        if "rollout_log_probs" not in data.keys():
            return model_output
        from verl.workers.utils.padding import no_padding_2_padding

        check_gap_logprobs(data["temperature"] if "temperature" in data.keys() else None)
        mine = no_padding_2_padding(lp.detach(), data)
        ref = data.select("rollout_log_probs", "response_mask").to_padded_tensor()
        mask = ref["response_mask"].bool()
        keep = getattr(self, "_rr_keep", None)  # this micro-batch's samples the stale-rows policy kept (None: all)
        if keep is not None:  # masked samples routed natively: out of the replay's gap
            mask = mask & torch.tensor(keep, dtype=torch.bool).to(mask.device, non_blocking=True)[:, None]
        gaps.append(gap_stats(mine.float(), ref["rollout_log_probs"].float(), mask))
        return model_output

    return prepare_model_outputs


def audit_clock(engine: Any) -> TrainingStepClock:
    """The engine's audit clock (``engine.rr_clock``, verl FSDP's :class:`TrainingStepClock`), every
    ``RR_AUDIT_EVERY`` training steps; a changed setting starts a new clock (its first step audited)."""
    every = settings.integer("RR_AUDIT_EVERY", default=AUDIT_EVERY)
    clock = getattr(engine, "rr_clock", None)
    if clock is None or clock.every != every:
        clock = engine.rr_clock = TrainingStepClock(every)
    return clock


def clocked_train_mode(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngine.train_mode`` inside the audit clock's: leaving the outermost block ends the
    training step's update calls (update calls without verl's ``update_lr_scheduler`` mark end their step)."""

    @functools.wraps(orig)
    @contextlib.contextmanager
    def train_mode(self: Any, **kwargs: Any) -> Iterator[Any]:
        with audit_clock(self).train_mode(), orig(self, **kwargs) as mode:
            yield mode

    return train_mode


def _last_update(data: Any) -> bool:
    """Whether this update call is the step's last: verl's ``train_mini_batch`` marks it for its lr-scheduler step
    (``update_lr_scheduler``)."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data, key="update_lr_scheduler", default=False))


def counted_batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngine.forward_backward_batch`` with the step's stale-rows counts (``r3/stale_masked``,
    ``r3/spans_update``, ``r3/provenance_unknown``, ``r3/cached_tokens``, summed over its R3 micro-batches), the
    audit's keys and the log-prob gap (``r3/mean_abs_logp_diff``, ``r3/k3_kl``, ...: :func:`gapped_outputs`) kept in
    ``engine.rr_last_metrics`` and, on the last pipeline stage, in verl's step metrics as ``actor/r3/...``."""

    @functools.wraps(orig)
    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:

        self._rr_checks, self._rr_gaps = [], []
        clock = audit_clock(self)
        clock.call_starts(forward_only)
        audit = RouterAudit(self.module) if replay_mode(self) in REPLAY_MODES and clock.audited else None
        try:
            out = orig(self, data, loss_function, forward_only)
        finally:
            checks, self._rr_checks = self._rr_checks, None
            gaps, self._rr_gaps = self._rr_gaps, None
            clock.call_ends(forward_only, _last_update(data))
            audited = audit.close() if audit is not None else {}
        gapped = gap_keys(torch.stack(gaps).sum(0).tolist()) if gaps else {}  # the gaps' one host read
        self.rr_last_metrics = {
            **audited,
            **gapped,
            **(provenance_metrics(merge_checks(checks)) if checks else {}),
        }
        if self.rr_last_metrics and isinstance(out, dict) and isinstance(out.get("metrics"), dict):
            for k, v in self.rr_last_metrics.items():
                out["metrics"][f"actor/{k}"] = [v]
        return out

    return forward_backward_batch
