"""``MegatronReplay``: this rank's routers, checked once, fed per micro-batch through Megatron's own ``RouterReplay``.

Built on the model chunks of this rank: the routers are found by walking them (:mod:`._routers`), configurations that
bypass replay are refused (CUDA graphs over the router, forced balancing, input jitter among them), and targets are
set per router, never through the positional global list. Which rows each router call replays (a forward, a
recompute matched to its own forward, R2's recording bound to its samples), the checks of each call against the
router's input, and the audit are :mod:`._lifecycle`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from rr_client.core.errors import ArgumentTypeError, ConfigurationError, ReplayError
from rr_client.core.provenance import ProvenanceCheck, StalePolicy, check_stale_policy
from rr_client.integrations.megatron._feeder import Feed, MtpPolicy, PadClock, Parallel, feed, parallel_from_state
from rr_client.integrations.megatron._gate import check_megatron_version
from rr_client.integrations.megatron._lifecycle import AUDIT_EVERY, Lifecycle
from rr_client.integrations.megatron._routers import (
    MegatronRouter,
    check_config,
    check_registered,
    find_routers,
    has_transformer_layers,
)
from rr_client.trainer.audit import AuditClock
from rr_client.trainer.provenance import police_rows

__all__ = ["MegatronReplay", "Mode"]

Mode = Literal["R3", "R2"]


class MegatronReplay:
    """Replay (R3: the rollout's rows; R2: the rows the model recorded) on this rank's ``TopKRouter`` modules.

    ``model_chunks``: this rank's model (or its virtual-stage chunks); ``mtp``: MTP routers take rows
    (``"rows"``), are left to the model on purpose (``"skip"``), or take them when the rows hold their layer
    (``"auto"``); ``parallel``: this rank's layout (default: Megatron's ``parallel_state``); ``audit_every``: steps
    between audited steps (the first always; 0 = never): what each router chose against its rows, raised on in
    :meth:`step_done`; ``log_layers``: per-layer ``r3/layer<i>/...`` keys in its report; ``others``: the chunks of
    other models built in this process with routing replay on (a reference or critic model beside the actor): their
    routers are known, not orphans, and rr never feeds them (give each its own ``MegatronReplay``, naming this one's
    chunks in its ``others``); ``stale_rows``: the stale-rows policy on the rows each :meth:`set_micro_batch`
    gives (their own provenance, as :class:`rr_client.trainer.ReplaySession` applies it): ``"refuse"`` (default)
    raises :class:`rr_client.StaleRoutingError` for a sample that may have been recomputed across a weight update;
    ``"mask"`` runs its tokens on pad rows, out of the audit (Megatron replays every token): drop them from the
    loss (:func:`rr_client.trainer.provenance.drop_samples` with :attr:`last_check`'s ``replay``); ``"off"``
    turns it off on purpose. Rows without provenance (a raw tensor) pass.
    """

    def __init__(
        self,
        model_chunks: Any,
        *,
        mode: Mode = "R3",
        mtp: MtpPolicy = "auto",
        parallel: Parallel | None = None,
        audit_every: int = AUDIT_EVERY,
        log_layers: bool = False,
        others: Sequence[Any] = (),
        stale_rows: StalePolicy = "refuse",
    ) -> None:
        check_megatron_version()
        self.stale_rows: StalePolicy = check_stale_policy(stale_rows)
        self.last_check: ProvenanceCheck | None = None  #: the policy's verdict on the last rows set (None: off)
        if mode not in ("R3", "R2"):
            raise ConfigurationError(f"mode must be 'R3' or 'R2', got {mode!r}")
        if mtp not in ("auto", "rows", "skip"):
            raise ConfigurationError(f"mtp must be 'auto', 'rows' or 'skip', got {mtp!r}")
        self.chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
        self.mode, self.mtp = mode, mtp
        self.routers: list[MegatronRouter] = find_routers(self.chunks)
        if not self.routers and not has_transformer_layers(self.chunks):
            raise ReplayError(
                "the given model chunks hold no Megatron TransformerLayer: pass this rank's Megatron "
                "model chunks (a pipeline stage of dense layers only is accepted and fed nothing)"
            )
        check_config(self.routers)
        self.others = [r for chunk in others for r in find_routers(chunk)]
        check_registered(self.routers, self.others)
        self.parallel = parallel if parallel is not None else parallel_from_state(self.routers)
        self.left: list[MegatronRouter] = []  #: MTP routers the last feed left to the model
        self.clock = AuditClock(audit_every)  #: when a step is audited (a driving session shares its own)
        self._owns_clock = True  # advanced at step_done, unless a session's (share_clock)
        self.lifecycle = Lifecycle(self.routers, clock=self.clock, log_layers=log_layers)
        self.pads = PadClock()  #: each router's pad ordinals, numbered on across micro-batches and steps

    # ------------------------------------------------------------------ targets
    def routers_of(self, chunk: Any = None) -> list[MegatronRouter]:
        """The routers of model chunk ``chunk`` (its index, or the chunk module ``forward_step_func`` is given), or
        all of them."""
        if chunk is not None and not isinstance(chunk, int):
            found = [i for i, c in enumerate(self.chunks) if c is chunk]
            if not found:
                raise ArgumentTypeError(f"chunk {type(chunk).__name__} is none of this MegatronReplay's model chunks")
            chunk = found[0]
        return [r for r in self.routers if chunk is None or r.chunk == chunk]

    def targets_for(self, routing: Any, *, chunk: int | None = None, **layout: Any) -> Feed:
        """This rank's targets for ``routing`` (the routers of ``chunk``, or all): see
        :func:`rr_client.integrations.megatron.router_targets` for ``routing`` and ``layout``'s keys."""
        return feed(
            self.routers_of(chunk),
            routing,
            parallel=layout.pop("parallel", self.parallel),
            mtp=layout.pop("mtp", self.mtp),
            pads=layout.pop("pads", self.pads),
            **layout,
        )

    def _set_targets(
        self,
        targets: dict[Any, torch.Tensor],
        *,
        have: dict[Any, torch.Tensor] | None = None,
        batch: int | None = None,
        segments: torch.Tensor | None = None,
        names: Sequence[tuple[str, int | None]] | None = None,
    ) -> None:
        """Replay ``targets`` (router module -> ``[tokens, topk]``, sequence-first) in each router's next forward
        (and in the recompute of that forward, whenever it runs). Private: the targets are taken as checked, so only
        :meth:`set_micro_batch`, after the one rows check (or R2's record), calls it. ``have``: per router, which tokens have a rollout
        row (the audit's counts; default all); ``batch``: the micro-batch's ``b``, checked against the router's
        ``[s, b]`` (None: the token count alone is checked); ``segments``: the tokens' segment codes (``[tokens]``,
        sequence-first, -1: none) named by ``names`` (default: the single-result segments), counted on audited
        steps."""
        check_registered(self.routers, self.others)
        known = {r.module for r in self.routers}
        for module in targets:
            if module not in known:
                raise ReplayError(
                    f"a target is keyed by a router this MegatronReplay does not hold "
                    f"({type(module).__name__}): targets of another (rebuilt?) model"
                )
        self.lifecycle.fed(targets, have, batch=batch, segments=segments, names=names)

    def set_micro_batch(
        self,
        routing: Any = None,
        *,
        chunk: Any = None,
        key: Any = None,
        tokens: Any = None,
        segments: Any = None,
        **layout: Any,
    ) -> Feed:
        """Lay out ``routing`` for this rank and replay it in the next forward of the routers of ``chunk`` (or all);
        MTP routers the feed leaves get no action (they route themselves) and are listed in :attr:`left`. Call it
        inside ``forward_step_func``, once per micro-batch (and per model chunk under interleaving). The
        stale-rows policy (``stale_rows``) runs on the rows first (its verdict in :attr:`last_check`).
        ``segments`` (:func:`rr_client.trainer.provenance.build_segments`, or ``[b, s]`` codes of the single-result
        segments): on audited steps, replayed and agreeing rows per token segment, reported under the Hugging Face
        path's ``r3/[turn<t>/]<segment>/...`` keys. R2: no
        ``routing``; the record of micro-batch ``key`` (:meth:`record`) is replayed when it holds exactly these
        ``tokens`` (the micro-batch's ``[b, s]`` input ids, as given to :meth:`record`); samples reshuffled across
        micro-batches are gathered from the records by their tokens; a sample no record holds is refused."""
        if self.mode == "R2":
            if routing is not None:
                raise ConfigurationError(
                    "R2 replays the model's own record (set_micro_batch(key=..., tokens=...)), not rows"
                )
            mods = [r.module for r in self.routers_of(chunk) if r.mtp is False or self.mtp != "skip"]
            rows, batch = self.lifecycle.recorded(mods, key=key, tokens=tokens)
            got = Feed(rows, [], next((int(t.shape[0]) for t in rows.values()), 0), None, batch)
            self._set_targets(got.targets, batch=batch)
            return got
        if routing is None:
            raise ConfigurationError("R3 needs the micro-batch's routing (RoutingTensors, PackedRouting or rows)")
        self.last_check = None
        if self.stale_rows != "off":
            given = {k: layout.pop(k, None) for k in ("mask", "layers", "attention_mask")}
            routing, mask, self.last_check = police_rows(
                routing,
                self.stale_rows,
                mask=given["mask"],
                every_token=True,
                layers=given["layers"],
                tokens=given["attention_mask"],
            )
            if not all(self.last_check.replay):  # ReplayRows with mask, layers and tokens folded in
                given = {}
            layout.update({k: v for k, v in given.items() if v is not None})
        if segments is None and not isinstance(getattr(routing, "segments", None), (type(None), torch.Tensor)):
            segments = routing.segments  # ReplayRows' own Segments
        got = self.targets_for(routing, chunk=chunk, segments=segments, **layout)
        for r in got.left:
            r.replay.clear_router_replay_action()
        self.left = got.left
        self._set_targets(
            got.targets,
            have={m: got.have for m in got.targets} if got.have is not None else None,
            batch=got.batch,
            segments=got.segments,
            names=getattr(segments, "names", None),
        )
        self.lifecycle.fed({}, left=got.left)
        return got

    def record(self, key: Any, *, tokens: Any = None, chunk: Any = None) -> None:
        """R2's old-log-prob pass: the next forward of the routers of ``chunk`` (or all) records their own choice
        under ``key`` (a micro-batch id), bound to ``tokens`` (the micro-batch's ``[b, s]`` input ids; on a pipeline
        stage without them, any ``[b, n]`` integer ids of its samples), for :meth:`set_micro_batch`
        ``(key=key, tokens=tokens)`` in the update. Inside ``forward_step_func``, once per micro-batch."""
        if self.mode != "R2":
            raise ConfigurationError("record() is R2's recording pass; this MegatronReplay is R3")
        self.lifecycle.record([r.module for r in self.routers_of(chunk)], key, tokens)

    def forget_records(self) -> None:
        """Drop R2's records (after the update epochs that replay them)."""
        self.lifecycle.records.clear()

    def step_done(self, *, check: bool = True) -> dict[str, float]:
        """After the step's last backward: every router's targets, queue and action cleared; returns the step's
        ``r3/`` metrics (:mod:`rr_client.trainer.keys`). With ``check``, the audit's verdicts raise
        :class:`rr_client.ReplayError` (a fed router that never ran; on audited steps, a router that chose other
        experts than its rows)."""
        try:
            return self.lifecycle.step_done(check=check)
        finally:
            for r in self.routers:
                r.replay.clear_indices()
                r.replay.clear_router_replay_action()
            if self._owns_clock:
                self.clock.tick()

    def share_clock(self, clock: AuditClock) -> None:
        """Audit on ``clock`` (a :class:`rr_client.trainer.ReplaySession`'s, which advances it) instead of this
        replay's own: one clock for the step, whoever drives it."""
        self.clock = self.lifecycle.clock = clock
        self._owns_clock = False

    def close(self) -> None:
        """Clear the routers' replay state and remove the token-count hooks."""
        self.step_done(check=False)
        self.lifecycle.remove()
