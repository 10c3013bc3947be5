"""``replay_routing`` (R3): force recorded top-k ids in every MoE router; weights stay differentiable.

Cost model (what ``tests/trainer/test_replay_cost.py`` holds, on the CPU and on fake CUDA tensors): opening a
block validates every layer's rows with one host read (:mod:`rr_client.trainer.replay._rows`) and moves them to
the routers' devices in one non-blocking upload per device; inside the forward and backward a router hook runs
the layer's weight formula on the replayed ids (plus one ``where`` when some rows keep the model's own choice)
and never syncs nor copies between host and device. The bit-for-bit formula check and the audit
keep their verdicts on the device and are read once when the block exits.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from rr_client.core.errors import ConfigurationError, ReplayError, ShapeMismatchError, UnsupportedModelError
from rr_client.trainer.replay._audit import Audit
from rr_client.trainer.replay._checkpoint import checkpoint_owner
from rr_client.trainer.replay._routers import Router, num_hidden_layers, router_hooks, survey
from rr_client.trainer.replay._rows import BlockRows, place_rows, readers_of, upload
from rr_client.trainer.replay.phase import DeviceTally, in_backward
from rr_client.trainer.rows import ReplayRows

__all__ = ["replay_routing", "ReplayHook", "CHECK_EVERY"]

#: default sampling of the bit-for-bit formula check: a router's 1st, 17th, 33rd, ... replayed forward
#: (per model, across blocks), so a changed transformers router is caught on the first step.
CHECK_EVERY = 16

# per model: how many (non-recompute) forwards each router layer has replayed, for the formula check's sampling
_REPLAYED_FORWARDS: weakref.WeakKeyDictionary[nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()


class ReplayHook:
    """The router hook of one block: replayed ids in, the formula's weights for them out; no sync, no copy.

    Called with a router and its output ``(logits, weights, ids, ...)``; returns the output to use instead.
    ``check_every`` (None: no formula check) samples the bit-for-bit formula check by the model's per-layer
    forward count in ``seen``; ``ckpt`` watches activation checkpoints (reentrant or not, the model's own or an
    external wrapper): :meth:`owed` lists the layers of checkpointed forwards whose recompute has not run."""

    def __init__(
        self,
        rows: BlockRows,
        tally: DeviceTally,
        audit: Audit | None,
        seen: dict[int, int],
        check_every: int | None,
        ckpt: bool = True,
    ) -> None:
        self.rows = rows
        self.tally = tally
        self.audit = audit
        self.seen = seen
        self.check_every = check_every
        self.ckpt = ckpt
        # checkpoint owner's id -> (weak ref, layers): checkpointed forwards whose recompute has not run yet
        self.pending: dict[int, tuple[weakref.ref[Any], set[int]]] = {}
        self.checked_layers: set[int] = set()

    def _watch(self, layer: int, recompute: bool) -> None:
        """Note a checkpointed forward's owner (its recompute is owed) or a recompute (paid)."""
        owner = checkpoint_owner(recompute)
        if owner is None:
            return
        if recompute:
            self.pending.pop(id(owner), None)
            return
        ref, layers = self.pending.get(id(owner), (None, set()))
        if ref is None or ref() is not owner:  # a new owner (an id may be reused once its owner died)
            ref, layers = weakref.ref(owner), set()
            self.pending[id(owner)] = (ref, layers)
        layers.add(layer)

    def owed(self) -> list[int]:
        """Layers of checkpointed forwards whose graph is alive and whose recompute has not run."""
        return sorted({layer for ref, layers in self.pending.values() if ref() is not None for layer in layers})

    def __call__(self, r: Router, out: Any) -> Any:
        logits, weights, own = out[0], out[1], out[2]
        recompute = in_backward()
        if self.ckpt:
            self._watch(r.layer, recompute)
        n_rows = self.rows.n_rows
        if logits.shape[0] != n_rows:
            raise ShapeMismatchError(
                f"layer {r.layer}: the router sees {logits.shape[0]} tokens but routed_experts has {n_rows} rows "
                "(rows must follow the flattened input_ids, batch-major)"
            )
        lr = self.rows.layers[r.layer]
        if lr.ids.device != own.device:  # the router ran elsewhere than its parameters: move once, keep
            lr.ids = upload(lr.ids, own.device)
            lr.use = None if lr.use is None else upload(lr.use, own.device)
            lr.ids_sorted = None if lr.ids_sorted is None else upload(lr.ids_sorted, own.device)
        if self.check_every is not None and not recompute:
            n = self.seen.get(r.layer, 0)
            self.seen[r.layer] = n + 1
            if n % self.check_every == 0:
                with torch.no_grad():  # saves nothing for backward: a checkpoint recompute (unsampled) matches
                    again = r.weights(r.module, logits, own).to(weights.dtype)
                    self.tally.add(f"formula/{r.layer}", (again != weights).any())
                self.checked_layers.add(r.layer)
        new_ids = lr.ids if lr.use is None else torch.where(lr.use, lr.ids, own)
        if self.audit is not None:
            self.audit.on_router(r, own, new_ids, recompute)
        return (logits, r.weights(r.module, logits, new_ids).to(weights.dtype), new_ids, *out[3:])


@contextmanager
def replay_routing(
    model: nn.Module,
    routed_experts: Any,
    mask: torch.Tensor | None = None,
    *,
    layers: Sequence[int] | None = None,
    check_formula: bool = True,
    check_every: int = CHECK_EVERY,
    audit: bool = False,
    allow_untested: bool = False,
    tokens: torch.Tensor | None = None,
    segments: Any = None,
) -> Iterator[dict[str, float] | None]:
    """Force ``routed_experts`` as every MoE router's top-k choice inside the block; weights stay differentiable.

    ``routed_experts``: ``[B, T, L, K]`` (padded, token-major) or ``[N, L, K]`` (packed) expert ids, rows in
    the order the router sees tokens (batch-major flatten of ``input_ids``), on any device (the CPU or the
    model's); or a :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`, whose
    ``routed_experts_mask`` and ``layers`` are then used; or :class:`rr_client.trainer.rows.ReplayRows`. ``mask``
    (same leading shape, any device): rows where it is False keep the model's own choice; rows whose ids are all
    negative (the ``-1`` pad) too. The layer axis is absolute (``L`` = decoder layers) or MoE ordinals (``L`` = MoE
    layers), or as ``layers`` says (:func:`rr_client.trainer.rows.axis_layers`).
    Errors: :class:`ShapeMismatchError` (token or layer count, top-k, a layer served dense),
    :class:`ExpertIdOutOfRangeError`, :class:`rr_client.ArgumentTypeError` (ids not integers),
    :class:`UnrecordedRoutingError` (repeated ids in a replayed row: pass the mask; a partly padded row),
    :class:`UnsupportedModelError` (a refused family, with the reason: docs/replay-coverage.md). The rows are
    validated once, when the block opens, for all layers at once (one host read), and moved to the routers'
    devices once.

    ``check_formula``: the router's weight formula is re-applied to the router's own ids and compared with
    the router's own weights bit for bit, so a changed transformers router is refused
    (:class:`UnsupportedModelError`) instead of replayed wrong. The check is *sampled*: each router's 1st,
    then every ``check_every``-th replayed forward of this model (1 = every forward); its verdict is read
    when the block exits, so leave the block before ``optimizer.step()``. Hash-routed layers (DeepSeek-V4) and
    routers outside the decoder's layer list (MTP/draft layers, towers) are left to the model.

    ``audit=True`` yields a dict, filled when the block exits, that a trainer logs as is: ``r3/forwards``,
    ``r3/moe_layers``, ``r3/replayed_rows``, ``r3/left_rows`` (rows of real tokens left to
    the model: mask False; pad tokens count neither way when ``tokens`` says which rows are real, by default a
    :class:`RoutingTensors`' ``attention_mask``), ``r3/applied_share`` (replayed
    rows whose experts module received exactly the replayed ids, observed at the experts' input),
    ``r3/agreement`` (replayed rows the model's own router chose too), the same per layer
    (``r3/layer<i>/...``) and the layers left to the model. Leaving the block raises :class:`ReplayError`
    (with ``.report``) for an orphan router (never ran), replayed rows no router consumed, or any replayed row
    that did not reach its experts. The audit's counts stay on the device until the block exits (one read).
    ``segments`` (a :class:`rr_client.trainer.provenance.Segments` whose ``rows`` has the rows' leading shape):
    the audit also reports each token segment's replayed rows and agreement (cached prompt, computed prompt,
    generated; per turn), ``r3/[turn<t>/]<segment>/agreement``, so a stale cached prefix stands out.

    With activation (gradient) checkpointing, backward re-runs the forwards: call ``backward()`` inside the
    block (the rows are keyed by decoder layer, so the recompute replays the same rows). Leaving the block with
    a checkpointed forward whose graph is alive and whose backward has not run is a :class:`ReplayError`,
    reentrant (``use_reentrant=True``) or not, from ``gradient_checkpointing_enable`` or an external wrapper
    (``torch.utils.checkpoint``, ``checkpoint_wrapper``, an ``autograd.Function`` re-running the layer).
    """
    if check_every < 1:
        raise ConfigurationError(f"check_every must be >= 1, got {check_every}")
    if tokens is None and not isinstance(routed_experts, ReplayRows):  # a RoutingTensors' real tokens
        tokens = getattr(routed_experts, "attention_mask", None)
    routers, left = survey(model, allow_untested=allow_untested)
    if not routers:
        raise UnsupportedModelError(f"no replayable MoE router in {type(model).__name__}'s decoder layers")
    hash_layers = [x.layer for x in left if x.why == "hash" and x.layer is not None]
    given = ReplayRows.of(
        routed_experts,
        mask=mask,
        layers=layers,
        num_hidden_layers=num_hidden_layers(model, routers),
        moe_layers=[r.layer for r in routers],
        extra=hash_layers,
    )
    if segments is None:
        segments = given.segments
    lead, axis = given.shape, list(given.layers)
    readers = readers_of(routers)
    spare = None
    if audit:
        consumed = set(given.positions(readers)) | {axis.index(h) for h in hash_layers if h in axis}
        spare = [layer for p, layer in enumerate(axis) if p not in consumed]
    st, n_use, unconsumed = given.check(readers, spare=spare)  # the rows' one check: one host read
    rows = place_rows(st, n_use, unconsumed, routers, audit=audit)

    tally = DeviceTally()
    if segments is not None and tuple(segments.rows.shape) != lead:
        raise ShapeMismatchError(
            f"segments shape {tuple(segments.rows.shape)} does not match routed_experts rows {lead}"
        )
    aud = Audit(routers, left, rows, tally, segments) if audit else None
    if aud is not None and tokens is not None:
        tok = torch.as_tensor(tokens)
        if tuple(tok.shape) != lead:
            raise ShapeMismatchError(f"tokens shape {tuple(tok.shape)} does not match routed_experts rows {lead}")
        tally.add("tokens", tok.bool().sum())  # read with the audit's counts at exit: no extra host read
    hook = ReplayHook(
        rows, tally, aud, _REPLAYED_FORWARDS.setdefault(model, {}), check_every if check_formula else None
    )

    extra = []
    if aud is not None:

        def on_model(_m: nn.Module, _a: Any) -> None:
            if not in_backward():
                aud.forwards += 1

        extra.append(model.register_forward_pre_hook(on_model))
        for r in routers:
            if r.experts is not None:
                extra.append(
                    r.experts.register_forward_pre_hook(
                        (lambda rr_: lambda _m, a, kw: aud.on_experts(rr_, a, kw))(r), with_kwargs=True
                    )
                )
            else:
                aud.bad_experts[r.layer] = "its MoE block has no experts module where rr can observe the ids"
    report: dict[str, float] | None = {} if audit else None
    try:
        with router_hooks(routers, hook):
            yield report
    finally:
        for h in extra:
            h.remove()
    counts = tally.read() if tally else {}  # the block's one host read of what the hooks kept on the device
    bad = sorted(layer for layer in hook.checked_layers if counts.get(f"formula/{layer}"))
    if bad:
        r0 = next(r for r in routers if r.layer == bad[0])
        raise UnsupportedModelError(
            f"layers {bad}: {type(r0.module).__name__}'s weights differ from rr's formula for it (transformers "
            "changed the router, or a dtype path rr does not know?); refusing to replay"
        )
    owed = hook.owed()
    if owed:
        raise ReplayError(
            f"a checkpointed forward (activation/gradient checkpointing, reentrant or not) ran inside "
            f"replay_routing and its backward has not: the recompute of layers {owed} in backward would route "
            "with the model's own choice. Call backward() inside the block (or drop the graph before leaving)."
        )
    if aud is not None and report is not None:
        aud.finish(counts)
        report.update(aud.report())
        problems = aud.problems()
        if problems:
            raise ReplayError("replay audit: " + "; ".join(problems), report=report)
