"""``ReplaySession``: the one replay lifecycle every trainer drives, per micro-batch.

A trainer opens replay (R3: the rollout's rows) or recording (R2: the model's own choice) before a micro-batch's
forward; the block stays open until that micro-batch's backward has run (gradient checkpointing re-runs the
forward there) and is closed when the next micro-batch opens, or when the step is flushed. Every
``audit_every``-th step (the first always) runs under the replay audit. :meth:`ReplaySession.flush` merges the
step's blocks and log-prob gaps into one dict whose keys are :mod:`rr_client.trainer.keys`: the worst applied
share, row-weighted agreement, token-weighted gaps. TRL's and verl's integrations are thin adapters over it;
``examples/plain_loop_r3.py`` drives it from a plain PyTorch loop.

::

    session = ReplaySession(model)
    for batch in batches:
        session.open_replay(batch.routed_experts, batch.routed_experts_mask)
        loss = loss_fn(model(batch.input_ids))
        loss.backward()
        session.add_gap(trainer_logps.detach(), batch, batch.response_mask, temperature=T)  # batch.logprobs
        metrics = session.flush()          # closes the block: audit and formula-check verdicts raise here
        optimizer.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from rr_client.core.agreement import count_matches
from rr_client.core.errors import ConfigurationError, ReplayError
from rr_client.core.logprobs import check_comparable_logprobs
from rr_client.core.provenance import ProvenanceCheck, StalePolicy, check_stale_policy
from rr_client.trainer import keys as K
from rr_client.trainer.metrics import gap_stats, segment_gap_stats
from rr_client.trainer.provenance import Segments, check_samples, merge_checks, provenance_metrics
from rr_client.trainer.replay import CHECK_EVERY, RoutingRecord, record_routing, replay_routing

__all__ = ["ReplaySession", "AUDIT_EVERY", "merge_reports"]

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
    replayed = sum(r[K.REPLAYED_ROWS] for r in reports)
    out = {K.FORWARDS: sum(r[K.FORWARDS] for r in reports), K.REPLAYED_ROWS: replayed,
           K.LEFT_ROWS: sum(r[K.LEFT_ROWS] for r in reports), K.MOE_LAYERS: max(r.get(K.MOE_LAYERS, 0.0) for r in reports)}
    applied = [r[K.APPLIED_SHARE] for r in reports if not math.isnan(r[K.APPLIED_SHARE])]
    out[K.APPLIED_SHARE] = min(applied) if applied else math.nan
    shares = [v for r in reports for k, v in r.items()
              if K.is_layer_key(k) and k.endswith("/applied_share") and not math.isnan(v)]
    out[K.APPLIED_SHARE_MIN_LAYER] = min(shares) if shares else math.nan
    agree = sum(r[K.AGREEMENT] * r[K.REPLAYED_ROWS] for r in reports if r[K.REPLAYED_ROWS])
    out[K.AGREEMENT] = agree / replayed if replayed else math.nan
    for k in sorted({k for r in reports for k in r if K.is_segment_key(k) and k.endswith("/replayed_rows")}):
        base = k[:-len("replayed_rows")]
        rows = sum(r.get(k, 0.0) for r in reports)
        out[k] = rows
        if rows:
            out[base + "agreement"] = sum(r[base + "agreement"] * r[k] for r in reports if r.get(k)) / rows
    if log_layers:
        for k in sorted({k for r in reports for k in r if K.is_layer_key(k)}):
            vals = [r[k] for r in reports if k in r and not math.isnan(r[k])]
            if vals:
                out[k] = min(vals) if k.endswith(K.LAYER_SHARE_SUFFIXES) else sum(vals)
    return out


def _segment_gaps(seg_gaps: Sequence[tuple[tuple[tuple[str, int | None], ...], Any]], flat: list[float]
                  ) -> dict[str, float]:
    """The step's gap per segment key (and per segment over all turns) from the read values of ``seg_gaps``."""
    sums: dict[tuple[str, int | None], list[float]] = {}
    at = 0
    for names, _ in seg_gaps:
        for name in names:
            row, at = flat[at:at + 7], at + 7
            for key in {name, (name[0], None)}:
                acc = sums.setdefault(key, [0.0] * 7)
                for i, v in enumerate(row):
                    acc[i] += v
    out: dict[str, float] = {}
    for (name, turn), (n, s_abs, _sq, s_k3, n2, _n5, _bad) in sums.items():
        out[K.segment(name, K.LOGP_TOKENS[len(K.PREFIX):], turn)] = n
        if n:
            out[K.segment(name, K.MEAN_ABS_LOGP_DIFF[len(K.PREFIX):], turn)] = s_abs / n
            out[K.segment(name, K.K3_KL[len(K.PREFIX):], turn)] = s_k3 / n
            out[K.segment(name, K.FRAC_ABS_DIFF_GT_LN2[len(K.PREFIX):], turn)] = n2 / n
    return out


class ReplaySession:
    """Replay (R3) or recording (R2) in ``model`` per micro-batch, kept open until backward, merged per step.

    ``audit_every``: steps between audited steps (the first step always; 0 = never audit). ``check_every``:
    the sampled bit-for-bit formula check (:func:`rr_client.trainer.replay.replay_routing`). ``allow_untested``:
    replay a family whose formula is in rr but untested (docs/replay-coverage.md). ``layers``: the rows' layer
    axis when it is not absolute (e.g. MoE ordinals). ``moe_layers``: the MoE layers of an absolute layer axis,
    for the agreement of recorded routing. ``log_layers``: per-layer keys in :meth:`flush` too. ``stale_rows``:
    what :meth:`check_samples` does with a sample that may have been recomputed across a weight update
    (``"refuse"``: :class:`rr_client.StaleRoutingError`; ``"mask"``: kept unreplayed and counted).
    """

    def __init__(self, model: nn.Module, *, audit_every: int = AUDIT_EVERY, check_every: int = CHECK_EVERY,
                 allow_untested: bool = False, layers: Sequence[int] | None = None,
                 moe_layers: Sequence[int] | None = None, log_layers: bool = False,
                 stale_rows: StalePolicy = "refuse") -> None:
        if audit_every < 0 or check_every < 1:
            raise ConfigurationError(f"audit_every={audit_every} must be >= 0 and check_every={check_every} >= 1")
        self.model = model
        self.audit_every = audit_every
        self.check_every = check_every
        self.allow_untested = allow_untested
        self.layers = list(layers) if layers is not None else None
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self.log_layers = log_layers
        self.stale_rows: StalePolicy = check_stale_policy(stale_rows)
        self.steps = 0  #: flushed steps
        self._stack: ExitStack | None = None
        self._after_close: list[Any] = []
        self._reports: list[dict[str, float]] = []
        self._gaps: list[torch.Tensor] = []
        self._agree = [0, 0]  # recorded rows equal to the compared rows, rows compared
        self._seg_gaps: list[tuple[tuple[tuple[str, int | None], ...], torch.Tensor]] = []
        self._checks: list[ProvenanceCheck] = []

    # ------------------------------------------------------------------ state
    @property
    def audited(self) -> bool:
        """Whether blocks opened now run under the audit (the first step, then every ``audit_every``-th)."""
        return self.audit_every > 0 and self.steps % self.audit_every == 0

    @property
    def is_open(self) -> bool:
        """Whether a micro-batch's block is open (its backward may still be running)."""
        return self._stack is not None

    # ------------------------------------------------------------------ per micro-batch
    def open_replay(self, routed_experts: Any, mask: Any = None, *, layers: Sequence[int] | None = None,
                    tokens: Any = None, segments: Segments | None = None) -> None:
        """Close the previous micro-batch's block, then replay ``routed_experts`` (rows, or a
        :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`) in the next forwards. ``tokens``:
        which rows are real tokens (pads are counted neither replayed nor left; a RoutingTensors' own
        ``attention_mask`` by default), so every trainer's layout counts the same rows. ``segments``
        (:func:`rr_client.trainer.provenance.build_segments`): the audit per token segment too."""
        self.close()
        stack = ExitStack()
        report = stack.enter_context(replay_routing(
            self.model, routed_experts, mask, layers=layers if layers is not None else self.layers,
            check_every=self.check_every, audit=self.audited, allow_untested=self.allow_untested, tokens=tokens,
            segments=segments))
        if report is not None:
            self._reports.append(report)  # the audit fills it when the block closes
        self._stack = stack

    def open_record(self, compare_to: Any = None, mask: Any = None) -> RoutingRecord:
        """Close the previous block, then record the model's own choice (R2) in the next forwards; with
        ``compare_to`` (the rollout's rows, same layout), its agreement with them is added when the block closes."""
        self.close()
        stack = ExitStack()
        rec = stack.enter_context(record_routing(self.model, allow_untested=self.allow_untested))
        if compare_to is not None:
            self._after_close.append(lambda: self._add_agreement(rec.routed_experts, compare_to, mask))
        self._stack = stack
        return rec

    @contextmanager
    def forward(self, routed_experts: Any, mask: Any = None, *, layers: Sequence[int] | None = None,
                tokens: Any = None, segments: Segments | None = None) -> Iterator[None]:
        """A replay block closed when the ``with`` ends, for forwards without a backward (old-policy, reference);
        the block kept open for a backward, if any, stays open. ``tokens``: as in :meth:`open_replay`."""
        with replay_routing(self.model, routed_experts, mask, layers=layers if layers is not None else self.layers,
                            check_every=self.check_every, audit=self.audited,
                            allow_untested=self.allow_untested, tokens=tokens, segments=segments) as report:
            yield
        if report is not None:
            self._reports.append(report)

    @contextmanager
    def recording(self, compare_to: Any = None, mask: Any = None) -> Iterator[RoutingRecord]:
        """A recording closed when the ``with`` ends (see :meth:`open_record`), for forwards without a backward."""
        with record_routing(self.model, allow_untested=self.allow_untested) as rec:
            yield rec
        if compare_to is not None:
            self._add_agreement(rec.routed_experts, compare_to, mask)

    def close(self) -> None:
        """Close the open block (after its backward): the audit and the formula check raise here if replay
        failed (:class:`rr_client.ReplayError`, :class:`rr_client.UnsupportedModelError`)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        stack.close()
        after, self._after_close = self._after_close, []
        for fn in after:
            fn()

    def abandon(self) -> None:
        """Close the open block while an error is already on its way (its own verdict is dropped)."""
        stack, self._stack, self._after_close = self._stack, None, []
        if stack is not None:
            try:
                stack.close()
            except Exception:  # keep the error that is already raised
                pass

    # ------------------------------------------------------------------ measurements
    def add_gap(self, trainer_logps: Any, engine_logps: Any, mask: Any = None, *, temperature: float | None = None,
                logprobs_mode: str | None = None, segments: Segments | None = None) -> None:
        """Add a micro-batch's log-prob gap (trainer vs the engine's sampling log-probs, over ``mask``); kept on
        the device until :meth:`flush`, token-weighted over the step.

        ``engine_logps``: a tensor, or a :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`
        whose ``logprobs`` (and ``logprobs_mode``) are used. ``temperature``: the sampling temperature the trainer's
        log-probs were computed at; with it, log-probs the engine gave before temperature (``logprobs_mode``
        "raw") or of unknown mode are refused at a temperature other than 1 (:class:`rr_client.LogprobsModeError`),
        never turned into wrong gaps. ``segments``: the gap per token segment too (its ``logps`` codes, shaped
        like the log-probs), under ``r3/[turn<t>/]<segment>/mean_abs_logp_diff`` etc."""
        if hasattr(engine_logps, "logprobs") and hasattr(engine_logps, "logprobs_mode"):
            if engine_logps.logprobs is None:
                raise ConfigurationError("add_gap: the batch carries no engine log-probs (generate with "
                                         "return_logprob=True)")
            if logprobs_mode is not None and logprobs_mode != engine_logps.logprobs_mode:
                raise ConfigurationError(f"add_gap: logprobs_mode={logprobs_mode!r} but the batch's log-probs are "
                                         f"{engine_logps.logprobs_mode!r}")
            engine_logps, logprobs_mode = engine_logps.logprobs, engine_logps.logprobs_mode
        check_comparable_logprobs(logprobs_mode, temperature, consumer="ReplaySession.add_gap")
        mine = trainer_logps.detach() if hasattr(trainer_logps, "detach") else trainer_logps
        self._gaps.append(gap_stats(mine, engine_logps, mask))
        if segments is not None:
            self._seg_gaps.append((segments.names, segment_gap_stats(mine, engine_logps, mask, segments.logps,
                                                                     len(segments.names))))

    def check_samples(self, samples: Sequence[Any]) -> ProvenanceCheck:
        """The stale-rows policy on a batch's samples (:func:`rr_client.trainer.provenance.check_samples` with
        this session's ``stale_rows``), counted into the step; ``replay[i]`` False: mask sample ``i``'s rows."""
        check = check_samples(samples, self.stale_rows)
        self._checks.append(check)
        return check

    def add_provenance(self, check: ProvenanceCheck) -> None:
        """Count a batch's provenance check (made elsewhere) into the step's ``r3/stale_masked`` etc."""
        self._checks.append(check)

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
    def flush(self) -> dict[str, float]:
        """Close the open block and return the step's merged metrics (keys: :mod:`rr_client.trainer.keys`);
        counts the step for ``audit_every``. One host read for the gaps."""
        audited = self.audited
        self.close()
        out = merge_reports(self._reports, log_layers=self.log_layers)
        if out:
            out[K.AUDITED] = float(audited)
        if self._gaps:
            dev = self._gaps[0].device
            parts = [torch.stack([g.to(dev) for g in self._gaps]).sum(0)] + [t.to(dev).reshape(-1)
                                                                             for _, t in self._seg_gaps]
            flat = torch.cat(parts).tolist()  # the step's one host read of the gaps
            n, s_abs, _s_sq, s_k3, n2, _n5, bad = flat[:7]
            if bad:
                self._reset()
                raise ReplayError("non-finite log-prob difference in a measured token (trainer or engine log-prob "
                                  "is NaN/inf)")
            if n:
                out.update({K.MEAN_ABS_LOGP_DIFF: s_abs / n, K.K3_KL: s_k3 / n, K.FRAC_ABS_DIFF_GT_LN2: n2 / n,
                            K.LOGP_TOKENS: float(n)})
            out.update(_segment_gaps(self._seg_gaps, flat[7:]))
        if self._checks:
            out.update(provenance_metrics(merge_checks(self._checks)))
        if self._agree[1]:
            out[K.AGREEMENT] = self._agree[0] / self._agree[1]
        self._reset()
        self.steps += 1
        return out

    def _reset(self) -> None:
        self._reports, self._gaps, self._agree, self._seg_gaps, self._checks = [], [], [0, 0], [], []

    @contextmanager
    def step(self) -> Iterator[dict[str, float]]:
        """``with session.step() as metrics:`` one step; ``metrics`` is filled by :meth:`flush` at the end (an
        error abandons the open block and drops the step's measurements)."""
        metrics: dict[str, float] = {}
        try:
            yield metrics
        except BaseException:
            self.abandon()
            self._reset()
            raise
        metrics.update(self.flush())

