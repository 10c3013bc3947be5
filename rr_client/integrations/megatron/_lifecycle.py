"""When each router replays what: Megatron's ``RouterReplay`` driven per router and per call, checked, and audited.

Megatron switches no action during training, and its own recompute queue (``REPLAY_BACKWARD`` pops a FIFO) is right
only when the backwards run in forward order. So a forward pre-hook on every router decides at each call:

- a forward (outside autograd's backward): the rows :meth:`Lifecycle.fed` set for this micro-batch, refused unless
  they have one row per token in the router's own ``[s, b]`` order (a flattened or transposed batch is refused) and
  refused when none were set since the last forward (it would replay the previous micro-batch's rows); a forward
  with grad (one a recompute may re-run) keeps its rows in the router's :class:`RecomputePool`;
- a recompute (inside autograd's backward): the rows of the forward whose router input it re-runs, matched on the
  device by a fingerprint of that input, whatever order the backwards run in (B2 before B1, one backward of summed
  losses, a grad-on forward-only pass left behind);
- R2's recording pass: ``RECORD``; the record is kept with the micro-batch's tokens, so the update replays it on
  the same samples (matched by tokens when reshuffled, refused when a sample has none).

Megatron's own FIFO is never filled (targets go on ``target_topk_idx``, action ``REPLAY_FORWARD``). The hooks read
nothing from the device: counts and verdicts go into a :class:`DeviceTally` read once in :meth:`Lifecycle.step_done`,
which raises on a fed router that never ran (also when none ran), a recompute that matched no forward, and, on
audited steps, a router that chose other experts than it was given; the report uses :mod:`rr_client.trainer.keys`,
as the Hugging Face path does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rr_client.core.errors import ConfigurationError, MissingRoutingError, ReplayError, ShapeMismatchError
from rr_client.integrations.megatron._recompute import RecomputePool, recomputed
from rr_client.integrations.megatron._routers import MegatronRouter
from rr_client.trainer import keys as K
from rr_client.trainer.audit import AuditClock, LayerCounts, layer_keys, segment_keys
from rr_client.trainer.replay.phase import DeviceTally, in_backward
from rr_client.trainer.session import AUDIT_EVERY, merge_reports

__all__ = ["Lifecycle", "RouterState", "R2Record", "AUDIT_EVERY"]


@dataclass
class RouterState:
    """One router's place in the step: the rows set for its next forward, the recording key, audit counts."""

    router: MegatronRouter
    recomputable: bool = False  #: Megatron's config re-runs this router in the backward
    pool: RecomputePool | None = None  #: this step's grad-on forwards, for their recomputes
    driven: bool = False  #: fed (or recording) in this step: the hooks act on it
    fresh: bool = False  #: rows set for a forward that has not run yet
    grad: bool = True  #: grad was on where the rows were set (a backward, and its recompute, may follow)
    left: bool = False  #: an MTP router the feed left to the model on purpose
    record_key: Any = None  #: R2 recording: the micro-batch key its record is kept under
    pending: torch.Tensor | None = None  #: ``[tokens, topk]`` rows for the next forward
    have: torch.Tensor | None = None  #: which local tokens of the fed micro-batch have a rollout row (audit)
    batch: int | None = None  #: the fed micro-batch's ``b`` (the router sees ``[tokens // b, b]``)
    expect: torch.Tensor | None = None  #: the rows this call replays (set by the pre-hook)
    expect_have: torch.Tensor | None = None
    seg: torch.Tensor | None = None  #: the fed micro-batch's local segment codes (the audit's per-segment counts)
    expect_seg: torch.Tensor | None = None
    own: torch.Tensor | None = None  #: the router's own routing map on this call's logits (audit, forwards)
    forwards: int = 0
    recomputes: int = 0
    left_rows: int = 0  #: tokens this router routed itself (left MTP router), over forwards
    checked: int = 0  #: tokens whose applied experts were compared (forwards and recomputes)


@dataclass
class R2Record:
    """R2: one micro-batch's recorded routing (router module -> ``[s * b, topk]``, sequence-first), the ``[s, b]``
    the routers saw, and its samples' tokens (``[b, ...]`` on the host), which bind the record to its samples."""

    rows: dict[Any, torch.Tensor] = field(default_factory=dict)
    grid: tuple[int, int] | None = None
    tokens: torch.Tensor | None = None


def _sample_tokens(tokens: Any) -> torch.Tensor:
    """The micro-batch's tokens as a ``[b, n]`` host tensor (one row per sample; a packed THD batch is one row)."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ShapeMismatchError(
            f"tokens must be the micro-batch's [b, s] integer input_ids (or [b, n] sample ids), "
            f"got {tuple(tokens.shape)} {tokens.dtype}"
        )
    return tokens.detach().cpu()


class Lifecycle:
    """The per-call action driver and audit over ``routers`` (hooks installed until :meth:`remove`).

    ``clock``: when a step is audited (:class:`rr_client.trainer.audit.AuditClock`, advanced by whoever owns it:
    :class:`MegatronReplay`, or the session driving it); ``log_layers``: per-layer keys in the step's report too."""

    def __init__(self, routers: Sequence[MegatronRouter], *, clock: AuditClock, log_layers: bool = False) -> None:
        self.routers = list(routers)
        self.states = {r.module: self._fresh_state(r) for r in routers}
        self.clock = clock
        self.log_layers = log_layers
        self.records: dict[Any, R2Record] = {}  #: R2: micro-batch key -> its record
        self._tally = DeviceTally()
        self.segment_names: tuple[tuple[str, int | None], ...] | None = None  #: this step's segments' names
        self._hooks = [
            h
            for r in routers
            for h in (
                r.module.register_forward_pre_hook(self._pre, prepend=True),
                r.module.register_forward_hook(self._post),
            )
        ]

    @staticmethod
    def _fresh_state(r: MegatronRouter) -> RouterState:
        """A router's state at the start of a step."""
        rec = recomputed(r)  # only the layers Megatron checkpoints keep rows for their recomputes
        return RouterState(r, recomputable=rec, pool=RecomputePool(r.describe()) if rec else None)

    # ------------------------------------------------------------------ per micro-batch
    def fed(
        self,
        targets: dict[Any, torch.Tensor],
        have: dict[Any, torch.Tensor] | None = None,
        left: Sequence[MegatronRouter] = (),
        *,
        batch: int | None = None,
        segments: torch.Tensor | None = None,
        names: Sequence[tuple[str, int | None]] | None = None,
    ) -> None:
        """Rows ``targets`` (router module -> ``[tokens, topk]``) for the next forward of each router; ``have``: per
        module, which local tokens have a rollout row (the rest are pads); ``left``: MTP routers routing
        themselves; ``batch``: the micro-batch's ``b`` (checked against the router's input); ``segments``: the
        local tokens' segment codes (``[tokens]``, -1: none) named by ``names`` (one set per step), counted per
        segment on audited forwards."""
        seg = None
        if segments is not None and targets:
            names = tuple(names if names is not None else ((n, None) for n in K.SEGMENTS))
            if self.segment_names is not None and self.segment_names != names:
                raise ConfigurationError(
                    f"segments named {names[:3]}... in a step whose other micro-batches' are "
                    f"named {self.segment_names[:3]}...: one set of segment names per step"
                )
            self.segment_names = names
            seg = torch.where(segments < 0, len(names), segments.long())  # -1: the discarded bin
        for m, rows in targets.items():
            st = self.states[m]
            if st.fresh:
                raise ReplayError(
                    f"{st.router.describe()}: new rows set before its previous micro-batch's forward "
                    "ran (set_micro_batch once per micro-batch, inside forward_step_func)"
                )
            st.driven, st.fresh, st.left, st.record_key = True, True, False, None
            st.pending, st.batch = rows, batch
            st.have, st.grad = (have.get(m) if have is not None else None), torch.is_grad_enabled()
            st.seg = None if seg is None else seg.to(rows.device, non_blocking=True)
        for r in left:
            st = self.states[r.module]
            st.driven, st.fresh, st.left, st.record_key = True, False, True, None
            r.replay.clear_router_replay_action()

    def record(self, modules: Sequence[Any], key: Any, tokens: Any) -> None:
        """R2: the next forward of ``modules`` records its own choice under ``key`` (``RECORD``), bound to
        ``tokens`` (the micro-batch's ``[b, s]`` input ids, or ``[b, n]`` sample ids on a stage without them)."""
        if tokens is None:
            raise ConfigurationError(
                "R2 binds each record to its samples: record(key, tokens=input_ids) (on a "
                "pipeline stage without input_ids, any [b, n] integer ids of the samples)"
            )
        rec = self.records.get(key)
        if rec is not None and any(m in rec.rows for m in modules):
            raise ReplayError(f"R2 record key {key!r} was already recorded this pass: one key per micro-batch")
        self.records.setdefault(key, R2Record()).tokens = _sample_tokens(tokens)
        for m in modules:
            st = self.states[m]
            st.driven, st.fresh, st.left, st.record_key = True, False, False, key

    def recorded(
        self, modules: Sequence[Any], *, key: Any = None, tokens: Any = None
    ) -> tuple[dict[Any, torch.Tensor], int]:
        """R2's rows for a micro-batch of ``tokens`` (router module -> ``[s * b, topk]``) and its ``b``: the record
        of ``key`` when it holds exactly these samples, else the samples gathered from the records by their tokens
        (an update that reshuffled the samples); a sample no record holds is refused."""
        if tokens is None:
            raise ConfigurationError(
                "R2 replays a record on the samples it was recorded on: set_micro_batch(key=..., tokens=input_ids)"
            )
        want = _sample_tokens(tokens)
        rec = self.records.get(key) if key is not None else None
        if rec is not None and rec.tokens is not None and torch.equal(rec.tokens, want):
            return self._rows_of(rec, modules, key), int(want.shape[0])
        return self._gather(want, modules, key), int(want.shape[0])

    def _rows_of(self, rec: R2Record, modules: Sequence[Any], key: Any) -> dict[Any, torch.Tensor]:
        """The rows of ``rec`` for ``modules``, refusing a router the record pass never ran."""
        missing = [self.states[m].router.describe() for m in modules if m not in rec.rows]
        if missing:
            raise MissingRoutingError(
                f"R2: the record of micro-batch {key!r} has no rows for {missing[:4]} (record "
                "every chunk's routers in the old-log-prob pass)"
            )
        return {m: rec.rows[m] for m in modules}

    def _gather(self, want: torch.Tensor, modules: Sequence[Any], key: Any) -> dict[Any, torch.Tensor]:
        """Each sample's recorded rows, found by its tokens across every record (sequence-first columns)."""
        index: dict[bytes, tuple[Any, int]] = {}
        for k, rec in self.records.items():
            if rec.tokens is not None and rec.grid is not None and int(rec.tokens.shape[0]) == rec.grid[1]:
                for col in range(int(rec.tokens.shape[0])):
                    index.setdefault(rec.tokens[col].numpy().tobytes(), (k, col))
        found = [index.get(row.numpy().tobytes()) for row in want]
        lost = [i for i, f in enumerate(found) if f is None]
        if lost:
            what = f"the record of micro-batch {key!r} holds other samples; " if key in self.records else ""
            raise MissingRoutingError(
                f"R2: {what}sample(s) {lost[:8]} of this micro-batch were recorded in no "
                f"micro-batch of the old-log-prob pass (recorded keys: {list(self.records)[:8]}):"
                " replay the update on the samples that were recorded"
            )
        grids = {self.records[k].grid[0] for k, _ in found}  # type: ignore[index,misc]
        if len(grids) != 1:
            raise ShapeMismatchError(
                f"R2: this micro-batch's samples were recorded at sequence lengths "
                f"{sorted(grids)}: replay them in micro-batches of one length"
            )
        out: dict[Any, torch.Tensor] = {}
        for m in modules:
            cols = []
            for k, col in found:  # type: ignore[misc]
                rec = self.records[k]
                rows = self._rows_of(rec, [m], k)[m]
                s, b = rec.grid  # type: ignore[misc]
                cols.append(rows.view(s, b, -1)[:, col])
            out[m] = torch.stack(cols, dim=1).reshape(-1, cols[0].shape[-1])
        return out

    # ------------------------------------------------------------------ the hooks
    def _pre(self, module: Any, args: tuple[Any, ...]) -> None:
        """Put this call's rows on the router (``REPLAY_FORWARD``), or ``RECORD``; nothing read from the device."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        st = self.states[module]
        st.expect = st.own = st.expect_seg = None
        if not st.driven or st.left:
            return
        rep = module.router_replay
        recompute = in_backward()
        if st.record_key is not None:
            rep.set_router_replay_action(A.RECORD)
            return
        hidden = args[0]
        tokens = hidden.numel() // hidden.shape[-1]
        if recompute:
            if st.pool is None:
                raise ReplayError(
                    f"{st.router.describe()}: a recompute in the backward, but its config recomputes "
                    "no router (recompute_granularity full, or selective with 'moe'): rr keeps no rows "
                    "for it; recompute through Megatron's own settings"
                )
            rows, have = st.pool.take(hidden, tokens)
            st.recomputes += 1
        else:
            if not st.fresh:
                raise ReplayError(
                    f"{st.router.describe()}: a forward without new rows: it would replay the previous "
                    "micro-batch's (call set_micro_batch for every micro-batch, inside "
                    "forward_step_func, before the model's forward)"
                )
            st.fresh = False
            rows, have = st.pending, st.have
            assert rows is not None
            self._check_tokens(st, hidden, rows)
            if st.grad and st.pool is not None:
                st.pool.add(rows, have, hidden)
            st.forwards += 1
            if have is not None:
                self._tally.add(f"replayed/{st.router.row_layer}", have.sum())
            else:
                self._tally.add(f"replayed/{st.router.row_layer}", torch.tensor(int(rows.shape[0])))
        rep.target_topk_idx = rows
        rep.set_router_replay_action(A.REPLAY_FORWARD)
        st.expect, st.expect_have = rows, have
        if not recompute:
            st.expect_seg = st.seg
        if self.clock.audited and not recompute:
            st.own = own_choice(module, hidden)

    @staticmethod
    def _check_tokens(st: RouterState, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        """Refuse rows that are not one per token the router sees, in its ``[s, b]`` order."""
        name, topk = st.router.describe(), int(st.router.module.topk)
        tokens = hidden.numel() // hidden.shape[-1]
        if rows.dim() != 2 or int(rows.shape[0]) != tokens or int(rows.shape[1]) != topk:
            raise ShapeMismatchError(
                f"{name}: replay targets are {tuple(rows.shape)}, the router sees {tokens} "
                f"tokens with top-k {topk}: Megatron would route the difference silently "
                "(check the context- / sequence-parallel layout and the micro-batch)"
            )
        if st.batch is not None and hidden.dim() == 3 and int(hidden.shape[1]) != st.batch:
            raise ShapeMismatchError(
                f"{name}: the rows are laid out for a batch of {st.batch} sample(s) of "
                f"{tokens // max(st.batch, 1)} tokens, the router sees [s, b] = "
                f"{list(hidden.shape[:2])}: a flattened or transposed batch would replay rows "
                "on other tokens; give the routing the micro-batch's own [b, s]"
            )

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
            hidden = args[0]
            entry = self.records.setdefault(st.record_key, R2Record())
            entry.rows[module] = rec.detach()
            entry.grid = (int(hidden.shape[0]), int(hidden.shape[1])) if hidden.dim() == 3 else (int(rec.shape[0]), 1)
            st.forwards += 1
            return
        want = st.expect
        if want is None:
            return
        st.expect = None
        if not self.clock.audited:
            st.own = None
            return
        have = st.expect_have
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
            if st.expect_seg is not None:
                self._by_segment(same, have, st.expect_seg)
        st.own = st.expect_seg = None

    def _by_segment(self, hit: torch.Tensor, have: torch.Tensor | None, seg: torch.Tensor) -> None:
        """Agreeing and replayed rows per segment code, as one device vector (no host read), as the Hugging Face
        audit counts them."""
        assert self.segment_names is not None
        s = len(self.segment_names)
        seg = seg.to(hit.device)
        used = torch.ones_like(hit) if have is None else have.to(hit.device)
        vec = torch.zeros(2 * (s + 1), dtype=torch.long, device=hit.device)
        vec.index_add_(0, seg, hit.long()).index_add_(0, seg + s + 1, used.long())
        self._tally.add_vector("segments", vec)

    # ------------------------------------------------------------------ per step
    def step_done(self, *, check: bool = True) -> dict[str, float]:
        """Clear every router's action, targets and rows; return the step's report (keys: :mod:`rr_client.trainer.
        keys`). With ``check``, raise :class:`ReplayError` on rows fed to a router that never ran (also when no
        router ran), a recompute whose input matched none of the step's forwards (or one forward taken twice, or
        two with one input but other rows), and, on audited steps, a router that chose other experts than it was
        given."""
        audited = self.clock.audited
        states = list(self.states.values())
        for s in states:
            if s.pool is not None:
                s.pool.verdicts(self._tally, f"recompute/{s.router.row_layer}")
        counts = self._tally.read()
        seg_vec, names = self._tally.vectors.pop("segments", None), self.segment_names
        self.segment_names = None
        replaying = [s for s in states if s.driven and not s.left and s.record_key is None]
        problems = []
        if check:
            orphans = [s.router.describe() for s in replaying if s.forwards == 0]
            if orphans:
                none = " (no fed router ran in this step)" if not any(s.forwards for s in replaying) else ""
                problems.append(f"orphan routers (rows set, never ran{none}): {orphans[:4]}")
            for s in states:
                layer = s.router.row_layer
                miss, reused, ambiguous = (
                    counts.get(f"recompute/{layer}/{v}", 0) for v in ("miss", "reused", "ambiguous")
                )
                if miss or reused or ambiguous:
                    problems.append(
                        f"{s.router.describe()}: {miss} recompute(s) whose router input matched no "
                        f"forward of this step, {reused} forward(s) taken by two recomputes, "
                        f"{ambiguous} forward(s) live at a recompute's pick with its input but other rows: a "
                        "recompute may have replayed another micro-batch's rows (a backward run twice, "
                        "the weights changed between a forward and its backward, or identical samples "
                        "with other rows in flight together: run one's backward before the other's forward)"
                    )
        report: dict[str, float] = {}
        if replaying:
            report = self._report(replaying, [s for s in states if s.left], counts, audited, seg_vec, names)
            if check and audited:
                for s in replaying:
                    got = counts.get(f"applied/{s.router.row_layer}", 0)
                    if got != s.checked:
                        problems.append(
                            f"{s.router.describe()} chose the given experts on {got} of {s.checked} "
                            "tokens (a setting that bypasses or undoes replay?)"
                        )
        for s in states:
            if s.driven:
                s.router.replay.clear_indices()
                s.router.replay.clear_router_replay_action()
            self.states[s.router.module] = self._fresh_state(s.router)
        if problems:
            raise ReplayError("Megatron replay audit: " + "; ".join(problems))
        if report:
            report[K.AUDITED] = float(audited)
        return report

    def _report(
        self,
        replaying: list[RouterState],
        left: list[RouterState],
        counts: dict[str, int],
        audited: bool,
        seg_vec: list[int] | None = None,
        names: tuple[tuple[str, int | None], ...] | None = None,
    ) -> dict[str, float]:
        """One step's keys, through the session's merge (worst layer, row-weighted agreement; per segment on
        audited steps fed segments: ``r3/[turn<t>/]<segment>/replayed_rows`` and ``.../agreement``)."""
        layer_counts = [
            LayerCounts(
                s.router.row_layer,
                replayed=counts.get(f"replayed/{s.router.row_layer}", 0),
                checked=s.checked,
                applied=counts.get(f"applied/{s.router.row_layer}", 0),
                agreed=counts.get(f"agree/{s.router.row_layer}", 0),
            )
            for s in replaying
        ]
        out = layer_keys(layer_counts, audited=audited)  # the one writer of applied_share (NaN: no rows)
        out[K.FORWARDS] = float(max(s.forwards + s.recomputes for s in replaying))
        out[K.LEFT_ROWS] = float(sum(s.left_rows for s in left))
        out[K.LEFT_LAYERS_HASH] = 0.0  # Megatron-core has no hash-routed layers
        out[K.LEFT_ROUTERS_OUTSIDE_DECODER] = float(len(left))
        out[K.ORPHAN_ROUTERS] = float(sum(s.forwards == 0 for s in replaying))
        out[K.UNCONSUMED_LAYERS] = 0.0  # the feed refuses rows at a layer without a router before any forward
        for s in left:
            out[K.layer(s.router.row_layer, "left_rows")] = float(s.left_rows)
        if audited and names is not None:
            out.update(segment_keys(seg_vec, names))
        return merge_reports([out], log_layers=self.log_layers)

    def remove(self) -> None:
        """Remove the hooks (the routers' replay state is left to :meth:`step_done`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def own_choice(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The ``[tokens, experts]`` routing map the router would choose itself on this call's input (audit only)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = module.config
    with torch.no_grad():
        logits = module.gating(hidden).view(-1, cfg.num_moe_experts)
        _, own = topk_routing_with_score_function(
            logits,
            module.topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=module.score_function,
            expert_bias=module.expert_bias,
            fused=False,
            router_replay=None,
        )
    return own.bool()
