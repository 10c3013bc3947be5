"""``ReplaySession``: the one replay lifecycle every trainer drives, per micro-batch, over two backends.

A trainer opens replay (R3: the rollout's rows) or recording (R2: the model's own choice) before a micro-batch's
forward; the block stays open until that micro-batch's backward has run (gradient checkpointing re-runs the
forward there) and is closed when the next micro-batch opens, or when the step is flushed. Every
``audit_every``-th step (the first always) runs under the replay audit. :meth:`ReplaySession.flush` merges the
step's blocks and log-prob gaps into one dict whose keys are :mod:`rr_client.trainer.keys`: the worst applied
share, row-weighted agreement, token-weighted gaps. TRL's and verl's integrations are thin adapters over it;
``examples/plain_loop_r3.py`` drives it from a plain PyTorch loop.

Two backends behind the same session: the Hugging Face hooks (``ReplaySession(model)``) and Megatron-core's own
``RouterReplay`` (:class:`rr_client.integrations.megatron.MegatronSession`, a ``ReplaySession`` whose backend is a
:class:`rr_client.integrations.megatron.MegatronReplay`: ``open_replay`` feeds the micro-batch inside
``forward_step_func``, ``flush`` ends Megatron's step; the integration passes it in as ``backend=``). The audit
cadence, the stale-rows policy, the log-prob gap and the keys are the session's, the same for both.

The stale-rows policy (``stale_rows``, default ``"refuse"``) runs wherever rows enter the session
(:meth:`~ReplaySession.open_replay`, :meth:`~ReplaySession.forward`), on the provenance the rows carry
(``to_tensors`` / ``to_packed`` keep each sample's), or on ``samples=``: a sample that may have been recomputed
across a weight update raises :class:`rr_client.StaleRoutingError`, or with ``"mask"`` is left unreplayed; rows
without provenance (a raw tensor) pass and are counted under ``r3/provenance_unknown``. ``stale_rows="off"``
turns it off on purpose. It is the one door: no adapter checks, counts or masks rows on its own.

::

    session = ReplaySession(model)
    for batch in batches:
        session.open_replay(batch)         # the stale-rows policy on its samples' provenance, then replay
        loss = loss_fn(model(batch.input_ids))
        loss.backward()
        session.add_gap(trainer_logps.detach(), batch, batch.response_mask, sampling=params)  # batch.logprobs
        metrics = session.flush()          # closes the block: audit and formula-check verdicts raise here
        optimizer.step()
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from rr_client.core.agreement import count_matches
from rr_client.core.errors import ConfigurationError
from rr_client.core.logprobs import check_comparable_logprobs, engine_logprobs
from rr_client.core.provenance import ProvenanceCheck, StalePolicy, check_stale_policy
from rr_client.trainer import keys as K
from rr_client.trainer.audit import AuditClock, merged_keys
from rr_client.trainer.metrics import gap_keys, gap_stats, segment_gap_stats
from rr_client.trainer.provenance import (
    Segments,
    check_samples,
    drop_samples,
    mask_indexer,
    merge_checks,
    police_rows,
    provenance_metrics,
)
from rr_client.trainer.replay import (
    CHECK_EVERY,
    RoutingRecord,
    count_indexers,
    record_routing,
    replay_indexer,
    replay_routing,
)

__all__ = ["ReplaySession", "ReplayBackend", "AUDIT_EVERY", "merge_reports", "merge_indexer_reports"]

logger = logging.getLogger("rr_client.trainer")

#: default: the replay audit (ids proven to reach the experts; +6-8% of a step on an H100) runs on the first step
#: and then every 10th, so a broken replay is caught on step 0 and the steady-state cost is under 1%.
AUDIT_EVERY = 10


def merge_reports(reports: Sequence[dict[str, float]], *, log_layers: bool = False) -> dict[str, float]:
    """One step's audit from its blocks' reports: rows and forwards summed, the worst applied share (of a block
    and of a layer), agreement weighted by replayed rows; per-layer keys (worst share / agreement, summed rows)
    with ``log_layers``."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    out = {
        # a block's own counts (orphan routers, unconsumed layers, layers left ...): the worst block's
        k: max(r[k] for r in reports if k in r)
        for k in sorted({k for r in reports for k in r})
        if not (K.is_layer_key(k) or K.is_segment_key(k))
    }
    replayed = sum(r.get(K.REPLAYED_ROWS, 0.0) for r in reports)
    out.update(
        {
            K.FORWARDS: sum(r.get(K.FORWARDS, 0.0) for r in reports),
            K.REPLAYED_ROWS: replayed,
            K.LEFT_ROWS: sum(r.get(K.LEFT_ROWS, 0.0) for r in reports),
            K.MOE_LAYERS: max(r.get(K.MOE_LAYERS, 0.0) for r in reports),
            **merged_keys(reports),
        }
    )
    for k in sorted({k for r in reports for k in r if K.is_segment_key(k) and k.endswith("/replayed_rows")}):
        base = k[: -len("replayed_rows")]
        rows = sum(r.get(k, 0.0) for r in reports)
        out[k] = rows
        if rows:
            out[base + "agreement"] = sum(r[base + "agreement"] * r[k] for r in reports if r.get(k)) / rows
    if log_layers:
        out.update(_merge_layer_keys(reports, K.is_layer_key))
    return out


def merge_indexer_reports(reports: Sequence[dict[str, float]], *, log_layers: bool = False) -> dict[str, float]:
    """One step's indexer audit (:func:`rr_client.trainer.replay_indexer`'s reports) by :func:`merge_reports`'
    rules: rows summed, the worst block's applied share, agreement weighted by replayed rows; per-layer keys with
    ``log_layers``."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    rows = sum(r[K.INDEXER_REPLAYED_ROWS] for r in reports)
    out = {
        K.INDEXER_LAYERS: max(r[K.INDEXER_LAYERS] for r in reports),
        K.INDEXER_REPLAYED_ROWS: rows,
        **merged_keys(reports, indexer=True),
    }
    if log_layers:
        out.update(_merge_layer_keys(reports, K.is_indexer_layer_key))
    return out


def _merge_layer_keys(reports: Sequence[dict[str, float]], is_key: Any) -> dict[str, float]:
    """The per-layer keys ``is_key`` picks, over a step's reports: the worst share / agreement, summed counts."""
    out: dict[str, float] = {}
    for k in sorted({k for r in reports for k in r if is_key(k)}):
        vals = [r[k] for r in reports if k in r and not math.isnan(r[k])]
        if vals:
            out[k] = min(vals) if k.endswith(K.LAYER_SHARE_SUFFIXES) else sum(vals)
    return out


def _segment_gaps(
    seg_gaps: Sequence[tuple[tuple[tuple[str, int | None], ...], Any]], flat: list[float]
) -> dict[str, float]:
    """The step's gap per segment key (and per segment over all turns) from the read values of ``seg_gaps``."""
    sums: dict[tuple[str, int | None], list[float]] = {}
    at = 0
    for names, _ in seg_gaps:
        for name in names:
            row, at = flat[at : at + 7], at + 7
            for key in {name, (name[0], None)}:
                acc = sums.setdefault(key, [0.0] * 7)
                for i, v in enumerate(row):
                    acc[i] += v
    out: dict[str, float] = {}
    for (name, turn), row in sums.items():
        out.update(_gap_row(functools.partial(K.segment, name, turn=turn), row))
    return out


def _depth_gaps(flat: list[float]) -> dict[str, float]:
    """The step's gap per context-depth bucket (``r3/depth/<bucket>/...``) from the read sums ``[buckets x 7]``;
    buckets no token reached have no keys."""
    out: dict[str, float] = {}
    for code, bucket in enumerate(K.DEPTH_BUCKETS):
        row = flat[7 * code : 7 * code + 7]
        if row[0]:
            out.update(_gap_row(functools.partial(K.depth, bucket), row))
    return out


def _gap_row(named: Any, row: Sequence[float]) -> dict[str, float]:
    """The gap keys of one summed :func:`~rr_client.trainer.metrics.segment_gap_stats` row, each named
    ``named(metric)``: its token count, and the means where it has tokens."""
    n, s_abs, _sq, s_k3, n2 = row[:5]
    out = {named(K.LOGP_TOKENS[len(K.PREFIX) :]): n}
    if n:
        out[named(K.MEAN_ABS_LOGP_DIFF[len(K.PREFIX) :])] = s_abs / n
        out[named(K.K3_KL[len(K.PREFIX) :])] = s_k3 / n
        out[named(K.FRAC_ABS_DIFF_GT_LN2[len(K.PREFIX) :])] = n2 / n
    return out


def _close_quietly(stack: ExitStack) -> None:
    """Close ``stack`` while an error is already on its way (the blocks' own verdicts are dropped)."""
    try:
        stack.close()
    except Exception:  # keep the error that is already raised
        pass


class ReplayBackend(Protocol):
    """What a :class:`ReplaySession` needs of a backend other than the Hugging Face hooks (Megatron's:
    :class:`rr_client.integrations.megatron.MegatronSession`). The session keeps the audit cadence, the stale-rows
    policy, the gaps, the provenance counts and the merge; the backend replays, audits and reports one step."""

    every_token: bool  #: it replays every token (a masked sample gets pad rows, not its own router)

    def feed(
        self,
        routing: Any,
        *,
        chunk: Any,
        mask: Any,
        layers: Any,
        attention_mask: Any,
        layout: dict[str, Any],
        segments: Any = None,
    ) -> Any: ...  # R3: one micro-batch's rows (and their token segments) for its next forward

    def replay_record(self, *, key: Any, input_ids: Any, chunk: Any) -> Any: ...  # R2: replay a record

    def record(self, *, key: Any, input_ids: Any, chunk: Any) -> None: ...  # R2: record the next forward

    def step_done(self) -> dict[str, float]: ...  # end the step, checked: its report (merge_reports' keys)

    def abandon(self) -> None: ...  # end the step unchecked (an error is on its way)

    def close(self) -> None: ...  # done: remove the hooks


class ReplaySession:
    """Replay (R3) or recording (R2) in ``model`` per micro-batch, kept open until backward, merged per step.

    ``ReplaySession(model)``: the Hugging Face hooks (:func:`rr_client.trainer.replay.replay_routing`);
    :class:`rr_client.integrations.megatron.MegatronSession` ``(model_chunks)``: Megatron-core's ``RouterReplay``,
    the same session (its ``backend``, a :class:`ReplayBackend`).

    ``audit_every``: steps between audited steps (the first step always; 0 = never audit). ``check_every``:
    the sampled bit-for-bit formula check (:func:`rr_client.trainer.replay.replay_routing`). ``allow_untested``:
    replay a family whose formula is in rr but untested (docs/replay-coverage.md). ``layers``: the rows' layer
    axis when it is not absolute (e.g. MoE ordinals). ``moe_layers``: the MoE layers of an absolute layer axis,
    for the agreement of recorded routing. ``log_layers``: per-layer keys in :meth:`flush` too. ``stale_rows``:
    what the session does with a sample that may have been recomputed across a weight update, wherever rows
    enter it (:meth:`open_replay`, :meth:`forward`, :meth:`check_samples`): ``"refuse"`` (default):
    :class:`rr_client.StaleRoutingError`; ``"mask"``: kept unreplayed and counted; ``"off"``: the policy turned
    off on purpose (replayed as they are, counted under ``r3/spans_update``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        audit_every: int = AUDIT_EVERY,
        check_every: int = CHECK_EVERY,
        allow_untested: bool = False,
        layers: Sequence[int] | None = None,
        moe_layers: Sequence[int] | None = None,
        log_layers: bool = False,
        stale_rows: StalePolicy = "refuse",
        backend: ReplayBackend | None = None,
    ) -> None:
        if check_every < 1:
            raise ConfigurationError(f"check_every={check_every} must be >= 1")
        self.model = model
        self.clock = AuditClock(audit_every)  #: the one audit clock (backends and adapters ask it; flush ticks it)
        self.check_every = check_every
        self.allow_untested = allow_untested
        self.layers = list(layers) if layers is not None else None
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self.log_layers = log_layers
        self.stale_rows: StalePolicy = check_stale_policy(stale_rows)
        self.backend = backend  #: None: the Hugging Face hooks; else the backend that replays (Megatron's)
        self._fed = False  # a backend: rows fed (or a record opened) since the last flush
        self._stack: ExitStack | None = None
        self._after_close: list[Any] = []
        self._reports: list[dict[str, float]] = []
        self._indexer_reports: list[dict[str, float]] = []  # replay_indexer's audits, merged under r3/indexer/
        # the model's sparse-attention indexers (Hugging Face backend): a step replaying routing without their picks
        # reports them left to the model (r3/indexer/left_layers), and says so once in the log
        self._indexers = count_indexers(model) if backend is None and isinstance(model, nn.Module) else 0
        self._indexer_fed = False  # picks replayed in this step
        self._routing_fed = False  # routing replayed in this step
        self._warned_indexers = False
        self._gaps: list[torch.Tensor] = []
        self._agree = [0, 0]  # recorded rows equal to the compared rows, rows compared
        self._seg_gaps: list[tuple[tuple[tuple[str, int | None], ...], torch.Tensor]] = []
        self._depth_gaps: list[torch.Tensor] = []  # per add_gap: the gap sums per depth bucket ([buckets, 7])
        self._checks: list[ProvenanceCheck] = []  # check_samples: they count the step
        self._row_checks: list[ProvenanceCheck] = []  # the policy where trained rows entered (open_replay)
        self._forward_checks: list[ProvenanceCheck] = []  # ... where rows of forwards without backward entered
        self._keep: tuple[bool, ...] | None = None  # the last opened block's samples the policy kept (add_gap's)
        self._policed: dict[int, tuple[Any, Any, Any, ProvenanceCheck]] = {}  # id(rows) -> rows, mask, out, check

    # ------------------------------------------------------------------ state
    @property
    def audit_every(self) -> int:
        """Steps between audited steps (:attr:`clock`'s ``every``)."""
        return self.clock.every

    @property
    def steps(self) -> int:
        """Finished steps (:attr:`clock`'s)."""
        return self.clock.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.clock.steps = value

    @property
    def is_open(self) -> bool:
        """Whether a micro-batch's block is open (its backward may still be running); Megatron: whether rows were
        fed since the last :meth:`flush`."""
        return self._fed if self.backend is not None else self._stack is not None

    # ------------------------------------------------------------------ the stale-rows policy where rows enter
    def _police(
        self,
        routing: Any,
        mask: Any,
        samples: Sequence[Any] | None,
        *,
        every_token: bool = False,
        layers: Sequence[int] | None = None,
        tokens: Any = None,
        trained: bool = False,
        own: bool = True,
    ) -> tuple[Any, Any, ProvenanceCheck]:
        """``(rows, mask, check)`` after the stale-rows policy on ``routing``'s samples: their provenance from
        ``samples``, else the rows' own (``to_tensors`` / ``to_packed``), else noted unknown (one per sample).
        ``every_token``: the backend replays every token (Megatron): masked samples become pad rows, not rows
        left to the router. The same rows entering twice in a step (two chunks, a reference forward) are checked
        and counted once; a step counts its ``trained`` rows (:meth:`open_replay`'s), or, with none, those of its
        forwards without backward. ``own``: rows for the session's model, whose kept samples :meth:`add_gap`
        measures."""
        hit = self._policed.get(id(routing))
        if hit is not None and hit[0] is routing and hit[1] is mask:
            out_rows, out_mask, check = hit[2][0], hit[2][1], hit[3]
        else:
            out_rows, out_mask, check = police_rows(
                routing,
                self.stale_rows,
                mask=mask,
                samples=samples,
                every_token=every_token,
                layers=layers,
                tokens=tokens,
            )
            (self._row_checks if trained else self._forward_checks).append(check)
            self._policed[id(routing)] = (routing, mask, (out_rows, out_mask), check)
        if own:
            self._keep = check.replay
        return out_rows, out_mask, check

    def police(
        self, routing: Any, mask: Any = None, *, samples: Sequence[Any] | None = None
    ) -> tuple[Any, Any, ProvenanceCheck]:
        """The session's stale-rows policy on rows replayed in another model (TRL's separate reference model):
        ``(rows, mask, check)`` with the masked samples' rows off, counted into the step as a forward's rows."""
        return self._police(routing, mask, samples, own=False)

    # ------------------------------------------------------------------ per micro-batch
    def open_replay(
        self,
        routed_experts: Any = None,
        mask: Any = None,
        *,
        layers: Sequence[int] | None = None,
        tokens: Any = None,
        segments: Segments | None = None,
        samples: Sequence[Any] | None = None,
        chunk: Any = None,
        key: Any = None,
        input_ids: Any = None,
        indexer_topk: Any = None,
        indexer_layers: Sequence[int] | None = None,
        **layout: Any,
    ) -> ProvenanceCheck | None:
        """Apply the stale-rows policy, close the previous micro-batch's block, then replay ``routed_experts``
        (rows, or a :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting` /
        :class:`rr_client.trainer.rows.ReplayRows`) in the next forwards. ``tokens``: which rows are real tokens
        (pads are counted neither replayed nor left; a RoutingTensors' own ``attention_mask`` by default), so every
        trainer's layout counts the same rows. ``segments`` (:func:`rr_client.trainer.provenance.build_segments`):
        the audit per token segment too (both backends). ``samples``: the batch's samples in the rows' order,
        whose provenance the policy reads (default: the provenance the rows carry; none: counted unknown). Returns
        the policy's :class:`rr_client.core.provenance.ProvenanceCheck` (``replay[i]`` False: sample ``i`` masked;
        None for R2's replay of a record).

        Megatron (:class:`rr_client.integrations.megatron.MegatronSession`): call it inside ``forward_step_func``,
        once per micro-batch (and per chunk: ``chunk=``); ``layout`` takes :func:`rr_client.integrations.megatron.router_targets`' keys
        (``cu_seqlens_padded``, ...); ``tokens`` is the batch's ``attention_mask``. Megatron replays every token,
        so a sample the policy masks runs on pad rows: drop it from the loss
        (:func:`rr_client.trainer.provenance.drop_samples` with the returned ``replay``). R2: no rows, ``key=`` and
        ``input_ids=`` (the micro-batch's ``[b, s]`` ids) replay the record :meth:`open_record` kept.

        ``indexer_topk`` (``[B, T, indexer layers, index_topk]`` batch columns, ``-1``: not replayed; default: a
        :class:`rr_client.RoutingTensors`' own ``indexer_topk``, checked against the model's indexer layers by its
        ``indexer_layers``, or by ``indexer_layers=``): the engine's sparse-attention indexer picks,
        replayed beside the routing (:func:`rr_client.trainer.replay_indexer`, audited with the routing, under
        ``r3/indexer/``); a sample the policy masks keeps its own picks too. Hugging Face models only."""
        indexer = self._indexer_rows(routed_experts, indexer_topk, indexer_layers)
        if self.backend is None:
            if chunk is not None or key is not None or input_ids is not None or layout:
                extra = sorted(
                    [
                        *layout,
                        *(n for n, v in (("chunk", chunk), ("key", key), ("input_ids", input_ids)) if v is not None),
                    ]
                )
                raise ConfigurationError(
                    f"open_replay: {extra} apply to the Megatron backend only "
                    "(rr_client.integrations.megatron.MegatronSession)"
                )
            if routed_experts is None:
                raise ConfigurationError("open_replay needs the rows to replay")
            rows, mask, check = self._police(routed_experts, mask, samples, trained=True)
            self.close()
            stack = self._open_block(rows, mask, check, indexer, layers=layers, tokens=tokens, segments=segments)
            self._stack = stack
            return check
        if routed_experts is None and segments is not None:
            raise ConfigurationError("open_replay(segments=) applies to R3's rows; R2 replays the model's own record")
        self._fed = True
        if routed_experts is None:
            if key is None or input_ids is None:
                raise ConfigurationError(
                    "open_replay without rows is R2's replay on Megatron: pass key= and "
                    "input_ids= (as given to open_record)"
                )
            self.backend.replay_record(key=key, input_ids=input_ids, chunk=chunk)
            return None
        given = hasattr(routed_experts, "have") and hasattr(routed_experts, "rows")  # ReplayRows: mask, layers in
        axis = layers if layers is not None or given else self.layers
        rows, mask, check = self._police(
            routed_experts,
            mask,
            samples,
            every_token=self.backend.every_token,
            layers=axis,
            tokens=tokens,
            trained=True,
        )
        if rows is not routed_experts and not given:  # the policy folded mask, layers and tokens into ReplayRows
            mask, axis, tokens = None, None, None
        self.backend.feed(
            rows, chunk=chunk, mask=mask, layers=axis, attention_mask=tokens, layout=layout, segments=segments
        )
        return check

    def open_record(
        self, compare_to: Any = None, mask: Any = None, *, key: Any = None, input_ids: Any = None, chunk: Any = None
    ) -> RoutingRecord | None:
        """Close the previous block, then record the model's own choice (R2) in the next forwards; with
        ``compare_to`` (the rollout's rows, same layout), its agreement with them is added when the block closes.
        Megatron: inside ``forward_step_func`` of the old-log-prob pass, ``key=`` (the micro-batch's id) and
        ``input_ids=`` (its ``[b, s]`` ids) bind the record for :meth:`open_replay` ``(key=, input_ids=)``."""
        if self.backend is not None:
            if compare_to is not None or mask is not None:
                raise ConfigurationError(
                    "open_record(compare_to=) is the Hugging Face backend's; on Megatron the "
                    "audit's r3/agreement compares the router's own choice"
                )
            if key is None:
                raise ConfigurationError("open_record on Megatron: pass key= (the micro-batch's id) and input_ids=")
            self._fed, self._keep = True, None
            self.backend.record(key=key, input_ids=input_ids, chunk=chunk)
            return None
        if key is not None or input_ids is not None or chunk is not None:
            raise ConfigurationError("open_record: key / input_ids / chunk apply to the Megatron backend only")
        self.close()
        self._keep = None  # R2 records every sample's own routing: none is masked
        stack = ExitStack()
        rec = stack.enter_context(record_routing(self.model, allow_untested=self.allow_untested))
        if compare_to is not None:
            self._after_close.append(lambda: self._add_agreement(rec.routed_experts, compare_to, mask))
        self._stack = stack
        return rec

    @contextmanager
    def forward(
        self,
        routed_experts: Any,
        mask: Any = None,
        *,
        layers: Sequence[int] | None = None,
        tokens: Any = None,
        segments: Segments | None = None,
        samples: Sequence[Any] | None = None,
        indexer_topk: Any = None,
        indexer_layers: Sequence[int] | None = None,
    ) -> Iterator[None]:
        """A replay block closed when the ``with`` ends, for forwards without a backward (old-policy, reference);
        the block kept open for a backward, if any, stays open. ``tokens``, ``samples``,
        ``indexer_topk``, ``indexer_layers``: as in :meth:`open_replay` (the stale-rows policy runs here too).
        Megatron: forward-only passes feed through :meth:`open_replay` inside ``forward_step_func``, like training
        ones."""
        self._hf_only("forward()")
        indexer = self._indexer_rows(routed_experts, indexer_topk, indexer_layers)
        rows, mask, check = self._police(routed_experts, mask, samples)
        with self._open_block(rows, mask, check, indexer, layers=layers, tokens=tokens, segments=segments):
            yield

    @contextmanager
    def recording(self, compare_to: Any = None, mask: Any = None) -> Iterator[RoutingRecord]:
        """A recording closed when the ``with`` ends (see :meth:`open_record`), for forwards without a backward."""
        self._hf_only("recording()")
        with record_routing(self.model, allow_untested=self.allow_untested) as rec:
            yield rec
        if compare_to is not None:
            self._add_agreement(rec.routed_experts, compare_to, mask)

    def _indexer_rows(
        self, routed_experts: Any, indexer_topk: Any, indexer_layers: Sequence[int] | None
    ) -> tuple[Any, Sequence[int] | None] | None:
        """The indexer picks to replay with these rows and their layers (None: the model's): given, or a
        RoutingTensors' own; refused on a backend that cannot replay them (Megatron), never dropped."""
        if indexer_topk is not None:
            rows, layers = indexer_topk, indexer_layers
        else:  # a RoutingTensors' own, with the layers they are of
            rows, layers = (getattr(routed_experts, n, None) for n in ("indexer_topk", "indexer_layers"))
        if rows is not None and self.backend is not None:
            raise ConfigurationError(
                "indexer_topk: rr replays sparse-attention indexer picks in Hugging Face models "
                "(ReplaySession(model)), not through Megatron's RouterReplay; generate without "
                "return_indexer_topk (or drop RoutingTensors.indexer_topk) to replay the routing alone"
            )
        return None if rows is None else (rows, layers)

    def _open_block(
        self,
        rows: Any,
        mask: Any,
        check: ProvenanceCheck | None,
        indexer: Any,
        *,
        layers: Sequence[int] | None,
        tokens: Any,
        segments: Segments | None,
    ) -> ExitStack:
        """One replay block: the indexer's picks (if any), then the routing, in a new stack whose audit reports
        join the step's (filled when it closes); a refusal while opening takes off what was already in place."""
        stack = ExitStack()
        try:
            real = tokens if tokens is not None else getattr(rows, "attention_mask", None)
            idx_report = self._enter_indexer(stack, indexer, check, real)
            report = stack.enter_context(
                replay_routing(
                    self.model,
                    rows,
                    mask,
                    layers=layers if layers is not None else self.layers,
                    check_every=self.check_every,
                    audit=self.clock.audited,
                    allow_untested=self.allow_untested,
                    tokens=tokens,
                    segments=segments,
                )
            )
        except BaseException:
            _close_quietly(stack)  # the refusal is the error: hooks already in place come off unchecked
            raise
        self._routing_fed = True
        for r, into in ((report, self._reports), (idx_report, self._indexer_reports)):
            if r is not None:
                into.append(r)  # an empty dict until the block closes (dropped by the merge if it never does)
        return stack

    def _enter_indexer(
        self, stack: ExitStack, indexer: Any, check: ProvenanceCheck | None, real: Any
    ) -> dict[str, float] | None:
        """Replay ``indexer`` (picks, their layers or None; the samples the stale-rows policy masked keep their own
        picks; ``real``: the batch's real tokens, which every pick must land on) in ``stack``'s block; its audit
        report (filled when the block closes), if audited."""
        if indexer is None:
            return None
        self._indexer_fed = True
        rows, layers = indexer
        if check is not None:
            rows = mask_indexer(rows, check.replay)
        return stack.enter_context(replay_indexer(self.model, rows, layers=layers, audit=self.clock.audited, real=real))

    def _hf_only(self, what: str) -> None:
        if self.backend is not None:
            raise ConfigurationError(
                f"ReplaySession.{what} is the Hugging Face backend's: on Megatron, feed every "
                "pass (forward-only too) with open_replay / open_record inside "
                "forward_step_func, and flush() after it"
            )

    def close(self) -> None:
        """Close the open block (after its backward): the audit and the formula check raise here if replay
        failed (:class:`rr_client.ReplayError`, :class:`rr_client.UnsupportedModelError`). Megatron: nothing (a
        step's micro-batches stay in flight until :meth:`flush`)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        stack.close()
        after, self._after_close = self._after_close, []
        for fn in after:
            fn()

    def abandon(self) -> None:
        """Close the open block while an error is already on its way (its own verdict is dropped). Megatron: the
        step is ended unchecked (it still counts for ``audit_every``, as Megatron's does)."""
        stack, self._stack, self._after_close = self._stack, None, []
        if stack is not None:
            _close_quietly(stack)
        if self.backend is not None:
            self.backend.abandon()
            self._fed = False
            self.clock.tick()

    def detach(self) -> None:
        """Done with the model: close the open block; Megatron: clear every router and remove rr's hooks
        (``MegatronReplay.close``)."""
        self.close()
        if self.backend is not None:
            self.backend.close()

    # ------------------------------------------------------------------ measurements
    def add_gap(
        self,
        trainer_logps: Any,
        engine_logps: Any,
        mask: Any = None,
        *,
        temperature: float | None = None,
        logprobs_mode: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        segments: Segments | None = None,
        keep: Sequence[bool] | None = None,
        cu_seqlens: Any = None,
    ) -> None:
        """Add a micro-batch's log-prob gap (trainer vs the engine's sampling log-probs, over ``mask``); kept on
        the device until :meth:`flush`, token-weighted over the step.

        ``engine_logps``: a tensor, or a :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`
        whose ``logprobs`` (and ``logprobs_mode``) are used. ``temperature``: the sampling temperature the trainer's
        log-probs were computed at (default: ``sampling``'s); ``sampling``: the sampling params the engine drew the
        tokens with (vLLM / SGLang / OpenAI names). Log-probs the engine gave before temperature and its filters
        (``logprobs_mode`` "raw") or of unknown mode are refused at a temperature other than 1, and with top-k,
        top-p, min-p or a penalty on in ``sampling`` (:class:`rr_client.LogprobsModeError`,
        :func:`rr_client.core.logprobs.check_comparable_logprobs`), never turned into wrong gaps. ``segments``: the
        gap per token segment too (its ``logps`` codes, shaped like the log-probs), under
        ``r3/[turn<t>/]<segment>/mean_abs_logp_diff`` etc.

        Samples the stale-rows policy masked are out of the gap (their rows were not replayed: their gap says
        nothing of replay; they are counted under ``r3/stale_masked``): ``keep`` (one bool per sample; packed
        log-probs with ``cu_seqlens``), by default the samples of the rows opened last (:meth:`open_replay` /
        :meth:`forward` of these log-probs' micro-batch; Megatron: ``forward_step_func``'s ``open_replay``, then its
        loss function). Log-probs of another micro-batch than the one opened last: pass its check's ``replay``; a
        batch of another sample count is a :class:`rr_client.ShapeMismatchError`, never a guess."""
        engine_logps, logprobs_mode = engine_logprobs(engine_logps, logprobs_mode, consumer="ReplaySession.add_gap")
        check_comparable_logprobs(logprobs_mode, temperature, consumer="ReplaySession.add_gap", sampling=sampling)
        mine = trainer_logps.detach() if hasattr(trainer_logps, "detach") else trainer_logps
        if keep is None:
            keep = self._keep
        if keep is not None and not all(keep):
            base = torch.ones(tuple(mine.shape), dtype=torch.bool) if mask is None else torch.as_tensor(mask)
            mask = drop_samples(base, keep, cu_seqlens)
        self._gaps.append(gap_stats(mine, engine_logps, mask))
        if segments is not None:
            self._seg_gaps.append(
                (segments.names, segment_gap_stats(mine, engine_logps, mask, segments.logps, len(segments.names)))
            )
            if segments.depths is not None:
                self._depth_gaps.append(
                    segment_gap_stats(mine, engine_logps, mask, segments.depths, len(K.DEPTH_BUCKETS))
                )

    def check_samples(self, samples: Sequence[Any]) -> ProvenanceCheck:
        """The stale-rows policy on a batch's samples (:func:`rr_client.trainer.provenance.check_samples` with
        this session's ``stale_rows``), counted into the step; ``replay[i]`` False: mask sample ``i``'s rows.
        Not needed where the rows carry their samples' provenance (:meth:`open_replay` applies the policy); when
        called, the step's provenance counts are this call's, not the rows' again."""
        check = check_samples(samples, self.stale_rows)
        self._checks.append(check)
        return check

    def _add_agreement(self, own: Any, rows: Any, mask: Any) -> None:
        """Recorded vs compared rows: (equal, counted) (row, MoE layer) cells where ``mask`` holds."""
        own_t = own if isinstance(own, torch.Tensor) else torch.as_tensor(own)
        rows_t = torch.as_tensor(rows).to(own_t.device)
        if mask is not None:
            m = torch.as_tensor(mask).to(own_t.device).bool()
            own_t, rows_t = own_t[m], rows_t[m]
        if own_t.numel():
            same, total = count_matches(own_t, rows_t, layers=self.moe_layers)
            self._agree[0] += same
            self._agree[1] += total

    # ------------------------------------------------------------------ per step
    def flush(self, *, tick: bool = True) -> dict[str, float]:
        """Close the open block (Megatron: end the step, ``MegatronReplay.step_done``, whose verdicts raise here)
        and return the step's merged metrics (keys: :mod:`rr_client.trainer.keys`); ticks :attr:`clock`, also
        for a step whose verdict refuses it, unless ``tick=False`` (a training step of several flushes, as verl's
        engine calls: its own clock ends the step). One host read for the gaps."""
        try:
            return self._merge_step(self.clock.audited)
        except BaseException:
            self._reset()
            raise
        finally:
            if tick:
                self.clock.tick()

    def _merge_step(self, audited: bool) -> dict[str, float]:
        """The step's metrics (see :meth:`flush`), its state reset; raises the step's verdicts."""
        self.close()
        if self.backend is not None:
            self._fed = False
            report = self.backend.step_done()
            if report and audited:  # as the Hugging Face hooks: an unaudited step claims no audit keys
                self._reports.append(report)
        out = merge_reports(self._reports, log_layers=self.log_layers)
        out.update(merge_indexer_reports(self._indexer_reports, log_layers=self.log_layers))
        if self._indexers and self._routing_fed and not self._indexer_fed:
            out[K.INDEXER_LEFT_LAYERS] = float(self._indexers)
            if not self._warned_indexers:
                self._warned_indexers = True
                logger.warning(
                    "rr: %d sparse-attention indexers ran on their own picks while the routing was replayed: the "
                    "engine's picks differ where their scores tie or differ in precision, and so does the attention. "
                    "Replay them too: generate with return_indexer_topk=True (TRL: RRRollout(indexer=True)); "
                    "logged as %s",
                    self._indexers,
                    K.INDEXER_LEFT_LAYERS,
                )
        if out:
            out[K.AUDITED] = float(audited)
        if self._gaps:
            dev = self._gaps[0].device
            parts = [torch.stack([g.to(dev) for g in self._gaps]).sum(0)] + [
                t.to(dev).reshape(-1) for _, t in self._seg_gaps
            ]
            if self._depth_gaps:
                parts.append(torch.stack([d.to(dev) for d in self._depth_gaps]).sum(0).reshape(-1))
            flat = torch.cat(parts).tolist()  # the step's one host read of the gaps
            n_seg = 7 * sum(len(names) for names, _ in self._seg_gaps)
            out.update(gap_keys(flat[:7]))
            out.update(_segment_gaps(self._seg_gaps, flat[7 : 7 + n_seg]))
            if self._depth_gaps:
                out.update(_depth_gaps(flat[7 + n_seg :]))
        checks = self._checks or self._row_checks or self._forward_checks
        if checks:
            out.update(provenance_metrics(merge_checks(checks)))
        if self._agree[1]:
            out[K.AGREEMENT] = self._agree[0] / self._agree[1]
        self._reset()
        return out

    def _reset(self) -> None:
        self._reports, self._gaps, self._agree, self._seg_gaps, self._checks = [], [], [0, 0], [], []
        self._depth_gaps = []
        self._indexer_reports = []
        self._row_checks, self._forward_checks, self._policed, self._keep = [], [], {}, None
        self._indexer_fed = self._routing_fed = False

    @contextmanager
    def step(self, *, tick: bool = True) -> Iterator[dict[str, float]]:
        """``with session.step() as metrics:`` one step; ``metrics`` is filled by :meth:`flush` at the end (an
        error abandons the open block and drops the step's measurements); ``tick``: as :meth:`flush`'s."""
        metrics: dict[str, float] = {}
        try:
            yield metrics
        except BaseException:
            self.abandon()
            self._reset()
            raise
        metrics.update(self.flush(tick=tick))
