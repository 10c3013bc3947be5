"""rr's session on verl 0.9.1's own Megatron engine (issue 45): the refusals at engine build, the stale-rows policy
per micro-batch, the step's counts, and the audit. The feeder itself, rr's in place of verl's
``set_router_replay_data``, is :mod:`._megatron_feed`.

- :func:`refusing_initialize` wraps ``MegatronEngine.initialize``: with ``router_replay.mode`` R2/R3, once the model
  is built, what rr's feeder would not hold under is refused in the worker, naming the setting: an untested
  megatron-core, a router configuration that bypasses replay (CUDA graphs over the router, the fused router, forced
  balancing, token dropping, input jitter: :func:`rr_client.integrations.megatron._routers.check_config`), dynamic
  context parallelism, the padded layout, FP8's THD padding.
- :func:`policed_inputs` wraps ``MegatronEngineWithLMHead.prepare_model_inputs``: the stale-rows policy on an R3
  micro-batch's samples (their provenance from verl's batch, :mod:`._provenance`): ``RR_STALE_ROWS=refuse``
  (default) raises :class:`rr_client.StaleRoutingError`; ``mask`` leaves the samples it names to the router (the
  feeder turns their replay mask off, verl's own meaning of its mask); ``off`` replays them.
- :func:`counted_batch` wraps ``MegatronEngine.forward_backward_batch``: the step's counts and the audit's keys in
  ``engine.rr_last_metrics`` and verl's step metrics (``actor/r3/...``).
- :class:`RouterAudit`: on audited steps, what every router ran against the targets it was given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from rr_client.core import settings
from rr_client.core.errors import ReplayError
from rr_client.integrations.megatron import check_config, check_megatron_version, find_routers, own_choice
from rr_client.trainer import keys as K
from rr_client.trainer.metrics import gap_keys, gap_stats
from rr_client.trainer.provenance import merge_checks, provenance_metrics
from rr_client.trainer.session import AUDIT_EVERY

from . import _provenance
from ._engine import check_gap_logprobs
from ._gate import REPLAY_MODES
from ._megatron_feed import KEEP, megatron_info, refuse_layout

__all__ = [
    "KEEP",
    "megatron_info",
    "refusing_initialize",
    "policed_inputs",
    "gapped_outputs",
    "counted_batch",
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


def policed_inputs(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngineWithLMHead.prepare_model_inputs`` with rr's stale-rows policy on an R3 micro-batch's
    samples (their provenance from verl's batch): refuse raises here; mask leaves the samples it names to the
    feeder, which turns their replay off."""

    @functools.wraps(orig)
    def prepare_model_inputs(self: Any, batch: Any) -> Any:
        inputs = orig(self, batch)
        KEEP.set(None)
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
            KEEP.set(check.replay)
        return inputs

    return prepare_model_inputs


class RouterAudit:
    """rr's audit of the replay on verl's Megatron engine: a forward hook on every ``TopKRouter`` compares the experts
    it chose (its ``routing_map``) with the targets it was given, and the experts it would have chosen itself on the
    same input (``r3/agreement``), on the tokens the replay mask replays, in ``REPLAY_FORWARD`` forwards. Counts stay
    on the device; one host read per step."""

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
        mask = getattr(replay, "target_replay_mask", None)
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
        replayed = sum(c[0] for c in per.values())
        applied = sum(c[1] for c in per.values())
        agreed = sum(c[2] for c in per.values())
        met = {
            K.REPLAYED_ROWS: float(replayed),
            K.APPLIED_SHARE: applied / replayed if replayed else 1.0,
            K.APPLIED_SHARE_MIN_LAYER: min((c[1] / c[0] if c[0] else 1.0) for c in per.values()),
            K.AGREEMENT: agreed / replayed if replayed else 1.0,
        }
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
    the actor's and the rollout's over the response tokens, kept on the device for the step
    (:func:`counted_batch`). A gap whose two sides would not mean the same thing (the rollout's raw log-probs away
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
        gaps.append(gap_stats(mine.float(), ref["rollout_log_probs"].float(), ref["response_mask"].bool()))
        return model_output

    return prepare_model_outputs


def counted_batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``MegatronEngine.forward_backward_batch`` with the step's stale-rows counts (``r3/stale_masked``,
    ``r3/spans_update``, ``r3/provenance_unknown``, ``r3/cached_tokens``, summed over its R3 micro-batches), the
    audit's keys and the log-prob gap (``r3/mean_abs_logp_diff``, ``r3/k3_kl``, ...: :func:`gapped_outputs`) kept in
    ``engine.rr_last_metrics`` and, on the last pipeline stage, in verl's step metrics as ``actor/r3/...``."""

    @functools.wraps(orig)
    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:

        self._rr_checks, self._rr_gaps = [], []
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
            gaps, self._rr_gaps = self._rr_gaps, None
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
