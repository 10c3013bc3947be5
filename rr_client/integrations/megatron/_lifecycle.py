"""When each router replays what: Megatron's ``RouterReplay`` actions driven per router, per call, and the audit.

Megatron switches no action during training, and one global action cannot be right under pipelining with
recompute: 1F1B (or two micro-batches in flight) runs micro-batch 2's forward before micro-batch 1's backward,
whose recompute must use micro-batch 1's rows. So a forward pre-hook on every router decides at each call:

- a forward (outside autograd's backward): ``REPLAY_FORWARD`` on the rows :meth:`Lifecycle.fed` just set for this
  micro-batch; a second forward without new rows is refused (it would replay the previous micro-batch's rows);
- a recompute (inside autograd's backward): ``REPLAY_BACKWARD``, which pops the oldest queued rows; backwards run
  in forward order, so the queue (one entry per forward with grad; a no-grad forward's entry is dropped, since
  no recompute will pop it: grad off where the rows were set, as in a forward-only pass) gives each recompute its
  own micro-batch's rows;
- R2's recording pass: ``RECORD``, and the record is kept per micro-batch key for the update to replay.

:meth:`Lifecycle.step_done` clears every router's action, targets and queue. On audited steps a forward hook
compares what each router actually chose (its ``routing_map``) with the rows it was given, and the router's own
choice on the same logits with them; the report uses :mod:`rr_client.trainer.keys`, as the Hugging Face path does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rr_client.core.errors import MissingRoutingError, ReplayError
from rr_client.integrations.megatron._routers import MegatronRouter
from rr_client.trainer import keys as K
from rr_client.trainer.session import AUDIT_EVERY, merge_reports

__all__ = ["Lifecycle", "RouterState", "AUDIT_EVERY"]


@dataclass
class RouterState:
    """One router's place in the step: fed rows not yet consumed by a forward, the recording key, audit counts."""

    router: MegatronRouter
    driven: bool = False  #: fed (or recording) in this step: the hooks act on it
    fresh: bool = False  #: rows set for a forward that has not run yet
    grad: bool = True  #: grad was on where the rows were set (a backward, and its recompute, may follow)
    left: bool = False  #: an MTP router the feed left to the model on purpose
    record_key: Any = None  #: R2 recording: the micro-batch key its record is kept under
    have: torch.Tensor | None = None  #: which local tokens of the fed micro-batch have a rollout row (audit)
    have_queue: list[torch.Tensor | None] = field(default_factory=list)  #: ``have`` of queued recompute rows
    expect: torch.Tensor | None = None  #: the rows this call replays (set by the pre-hook)
    expect_have: torch.Tensor | None = None
    own: torch.Tensor | None = None  #: the router's own routing map on this call's logits (audit, forwards)
    forwards: int = 0
    recomputes: int = 0
    replayed: int = 0  #: (token, layer) rows with a rollout row, over forwards
    left_rows: int = 0  #: tokens this router routed itself (left MTP router), over forwards
    checked: int = 0  #: tokens whose applied experts were compared (forwards and recomputes)


def in_backward() -> bool:
    """True while autograd runs a backward pass (where Megatron's checkpointing recomputes the forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _Tally:
    """0-d device counts under string keys, read with one host transfer at the step's end (no sync in a hook)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        """Add a 0-d count."""
        self.parts.setdefault(key, []).append(value)

    def read(self) -> dict[str, int]:
        """Every key's total, one host read per device, then forgotten."""
        items = [(k, t) for k, ts in self.parts.items() for t in ts]
        self.parts = {}
        if not items:
            return {}
        out: dict[str, int] = {}
        for dev in {t.device for _, t in items}:  # one stack and one host read per device
            mine = [(k, t) for k, t in items if t.device == dev]
            for (k, _), v in zip(mine, torch.stack([t.reshape(()).long() for _, t in mine]).tolist()):
                out[k] = out.get(k, 0) + int(v)
        return out


class Lifecycle:
    """The per-call action driver and audit over ``routers`` (hooks installed until :meth:`remove`).

    ``audit_every``: steps between audited steps (the first always; 0 = never); ``log_layers``: per-layer keys in
    the step's report too."""

    def __init__(self, routers: Sequence[MegatronRouter], *, audit_every: int = AUDIT_EVERY,
                 log_layers: bool = False) -> None:
        if audit_every < 0:
            raise ReplayError(f"audit_every={audit_every} must be >= 0")
        self.states = {r.module: RouterState(r) for r in routers}
        self.audit_every = audit_every
        self.log_layers = log_layers
        self.steps = 0  #: steps done
        self.records: dict[Any, dict[Any, torch.Tensor]] = {}  #: R2: micro-batch key -> router module -> rows
        self._tally = _Tally()
        self._hooks = [h for r in routers for h in (
            r.module.register_forward_pre_hook(self._pre, prepend=True),
            r.module.register_forward_hook(self._post))]

    @property
    def audited(self) -> bool:
        """Whether this step runs under the audit (the first step, then every ``audit_every``-th)."""
        return self.audit_every > 0 and self.steps % self.audit_every == 0

    # ------------------------------------------------------------------ per micro-batch
    def fed(self, modules: Sequence[Any], have: dict[Any, torch.Tensor] | None = None,
            left: Sequence[MegatronRouter] = ()) -> None:
        """Rows were just set on ``modules`` (their ``RouterReplay``) for the next forward; ``have``: per module,
        which local tokens have a rollout row (the rest are pads); ``left``: MTP routers routing themselves."""
        for m in modules:
            st = self.states[m]
            if st.fresh:
                raise ReplayError(f"{st.router.describe()}: new rows set before its previous micro-batch's forward "
                                  "ran (set_micro_batch once per micro-batch, inside forward_step_func)")
            st.driven, st.fresh, st.left, st.record_key = True, True, False, None
            st.have, st.grad = (have.get(m) if have is not None else None), torch.is_grad_enabled()
        for r in left:
            st = self.states[r.module]
            st.driven, st.fresh, st.left, st.record_key = True, False, True, None
            r.replay.clear_router_replay_action()

    def record(self, modules: Sequence[Any], key: Any) -> None:
        """R2: the next forward of ``modules`` records its own choice under ``key`` (``RECORD``)."""
        if key in self.records and any(m in self.records[key] for m in modules):
            raise ReplayError(f"R2 record key {key!r} was already recorded this pass: one key per micro-batch")
        for m in modules:
            st = self.states[m]
            st.driven, st.fresh, st.left, st.record_key = True, False, False, key

    def recorded(self, key: Any, modules: Sequence[Any]) -> dict[Any, torch.Tensor]:
        """R2's record of micro-batch ``key`` for ``modules`` (router module -> ``[tokens, topk]``)."""
        rec = self.records.get(key)
        missing = [self.states[m].router.describe() for m in modules if rec is None or m not in rec]
        if missing:
            raise MissingRoutingError(f"R2: no record of micro-batch {key!r} for {missing[:4]} (record it in the "
                                      f"old-log-prob pass with the same key; recorded keys: {list(self.records)[:8]})")
        assert rec is not None
        return {m: rec[m] for m in modules}

    # ------------------------------------------------------------------ the hooks
    def _pre(self, module: Any, args: tuple[Any, ...]) -> None:
        """Set this call's action: RECORD, REPLAY_FORWARD (fresh rows) or REPLAY_BACKWARD (a recompute)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        st = self.states[module]
        st.expect = st.own = None
        if not st.driven or st.left:
            return
        rep = module.router_replay
        recompute = in_backward()
        if st.record_key is not None:
            rep.set_router_replay_action(A.RECORD)
            return
        if recompute:
            if not rep.replay_backward_list:
                raise ReplayError(f"{st.router.describe()}: a recompute in the backward with no queued rows (its "
                                  "forward ran without grad, or the step's rows were cleared before its backward)")
            rep.set_router_replay_action(A.REPLAY_BACKWARD)
            st.recomputes += 1
            st.expect = rep.replay_backward_list[0]
            st.expect_have = st.have_queue.pop(0) if st.have_queue else None
        else:
            if not st.fresh:
                raise ReplayError(f"{st.router.describe()}: a forward without new rows: it would replay the previous "
                                  "micro-batch's (call set_micro_batch for every micro-batch, inside "
                                  "forward_step_func, before the model's forward)")
            st.fresh = False
            rep.set_router_replay_action(A.REPLAY_FORWARD)
            st.forwards += 1
            st.expect, st.expect_have = rep.target_topk_idx, st.have
            if st.grad:  # grad on where the rows were set (inside a checkpointed forward it is off)
                st.have_queue.append(st.have)
            elif rep.replay_backward_list and rep.replay_backward_list[-1] is rep.target_topk_idx:
                rep.replay_backward_list.pop()  # no backward will recompute a no-grad forward: keep the queue aligned
        if self.audited and st.expect is not None and not recompute:
            st.own = _own_choice(module, args[0])

    def _post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        """Keep R2's record; on audited steps count what the router chose against the rows it was given."""
        st = self.states[module]
        if not st.driven:
            return
        recompute = in_backward()
        if st.left and not recompute:
            hidden = args[0]
            st.forwards += 1
            st.left_rows += hidden.numel() // hidden.shape[-1]
            return
        if st.record_key is not None and not recompute:
            rec = module.router_replay.recorded_topk_idx
            if rec is None:
                raise ReplayError(f"{st.router.describe()}: RECORD ran but Megatron kept no record")
            self.records.setdefault(st.record_key, {})[module] = rec.detach()
            st.forwards += 1
            return
        want = st.expect
        if want is None:
            return
        have = st.expect_have
        if not recompute:
            st.replayed += int(have.sum()) if have is not None else int(want.shape[0])
        if not self.audited:
            return
        routing_map = output[1]
        want_map = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, want.to(routing_map.device), True)
        key = st.router.row_layer
        self._tally.add(f"applied/{key}", (routing_map.bool() == want_map).all(dim=1).sum())
        st.checked += int(want.shape[0])
        if st.own is not None:
            same = (st.own == want_map).all(dim=1)
            if have is not None:
                same = same & have.to(same.device)
            self._tally.add(f"agree/{key}", same.sum())
        st.expect = st.own = None

    # ------------------------------------------------------------------ per step
    def step_done(self, *, check: bool = True) -> dict[str, float]:
        """Clear every router's action, targets and queue; return the step's report (keys: :mod:`rr_client.trainer.
        keys`). With ``check``, the audit's verdicts raise :class:`ReplayError`: rows fed to a router that never ran
        (an orphan), and, on audited steps, a router that chose other experts than it was given."""
        audited = self.audited
        counts = self._tally.read()
        states = list(self.states.values())
        replaying = [s for s in states if s.driven and not s.left and s.record_key is None]
        problems = []
        if check and any(s.forwards for s in states):
            orphans = [s.router.describe() for s in replaying if s.forwards == 0]
            if orphans:
                problems.append(f"orphan routers (rows set, never ran): {orphans[:4]}")
        report: dict[str, float] = {}
        if replaying:
            report = self._report(replaying, [s for s in states if s.left], counts, audited)
            if check and audited:
                for s in replaying:
                    got = counts.get(f"applied/{s.router.row_layer}", 0)
                    if got != s.checked:
                        problems.append(f"{s.router.describe()} chose the given experts on {got} of {s.checked} "
                                        "tokens (a setting that bypasses or undoes replay?)")
        for s in states:
            if s.driven:
                s.router.replay.clear_indices()
                s.router.replay.clear_router_replay_action()
            self.states[s.router.module] = RouterState(s.router)
        self.steps += 1
        if problems:
            raise ReplayError("Megatron replay audit: " + "; ".join(problems))
        if report:
            report[K.AUDITED] = float(audited)
        return report

    def _report(self, replaying: list[RouterState], left: list[RouterState], counts: dict[str, int],
                audited: bool) -> dict[str, float]:
        """One step's keys, through the session's merge (worst layer, row-weighted agreement)."""
        nan = math.nan
        replayed = sum(s.replayed for s in replaying)
        checked = sum(s.checked for s in replaying)
        applied = sum(counts.get(f"applied/{s.router.row_layer}", 0) for s in replaying)
        agree = sum(counts.get(f"agree/{s.router.row_layer}", 0) for s in replaying)
        out = {K.FORWARDS: float(max(s.forwards + s.recomputes for s in replaying)), K.MOE_LAYERS: float(len(replaying)),
               K.REPLAYED_ROWS: float(replayed), K.LEFT_ROWS: float(sum(s.left_rows for s in left)),
               K.APPLIED_SHARE: applied / checked if audited and checked else nan,
               K.AGREEMENT: agree / replayed if audited and replayed else nan,
               K.LEFT_ROUTERS_OUTSIDE_DECODER: float(len(left)), K.ORPHAN_ROUTERS: float(
                   sum(s.forwards == 0 for s in replaying))}
        for s in replaying:
            i = s.router.row_layer
            got_a, got_g = counts.get(f"applied/{i}", 0), counts.get(f"agree/{i}", 0)
            out[K.layer(i, "replayed_rows")] = float(s.replayed)
            out[K.layer(i, "applied_share")] = got_a / s.checked if audited and s.checked else nan
            out[K.layer(i, "agreement")] = got_g / s.replayed if audited and s.replayed else nan
        for s in left:
            out[K.layer(s.router.row_layer, "left_rows")] = float(s.left_rows)
        merged = merge_reports([out], log_layers=self.log_layers)
        for k in (K.LEFT_ROUTERS_OUTSIDE_DECODER, K.ORPHAN_ROUTERS):
            merged[k] = out[k]
        return merged

    def remove(self) -> None:
        """Remove the hooks (the routers' replay state is left to :meth:`step_done`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _own_choice(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The ``[tokens, experts]`` routing map the router would choose itself on this call's input (audit only)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = module.config
    with torch.no_grad():
        logits = module.gating(hidden).view(-1, cfg.num_moe_experts)
        _, own = topk_routing_with_score_function(
            logits, module.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=module.score_function, expert_bias=module.expert_bias, fused=False, router_replay=None)
    return own.bool()

