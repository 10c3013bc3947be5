"""Routing replay (R3) and recording (R2) for Hugging Face transformers 5.x MoE models.

``with replay_routing(model, routed_experts, mask):`` forces the given top-k expert ids in every MoE layer's
router for the forward passes inside the block; the gate weights are recomputed from the model's own
router logits with the architecture's formula, so the router keeps its gradient. ``with
record_routing(model) as rec:`` gives the model's own choice afterwards as ``rec.routed_experts``
``[B, T, L, K]`` in rr's layout (absolute decoder layers, dense layers zero): verl's R2 mode.

The integration point is each model's router module (``...TopKRouter``), which returns
``(router_logits, weights, indices)``; a forward hook replaces weights and indices. Routers are keyed by
their decoder-layer index (``...layers.<i>...``), so gradient checkpointing, which re-runs layer
forwards, replays the same rows. This is the only rr module that needs transformers' model classes; it
imports torch and never imports transformers itself (routers are recognised by class name). Which
families are supported, and why the others are refused: :mod:`rr_client.replay.coverage`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rr_client.errors import (
    ExpertIdOutOfRangeError,
    ReplayError,
    ShapeMismatchError,
    UnrecordedRoutingError,
    UnsupportedModelError,
)

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rr_client.replay needs torch: pip install 'rr-replay[torch]'") from e

from rr_client.replay.coverage import TESTED, family_status, router_family
from rr_client.replay.formulas import HASH_ROUTERS, SUPPORTED_ROUTERS, WeightFn

_ROUTER_LIKE = re.compile(r"(router|topk.?gate|moegate|topk.?gating)$", re.IGNORECASE)


@dataclass
class _Router:
    layer: int
    name: str
    module: nn.Module
    block: nn.Module
    weights: WeightFn
    num_experts: int
    top_k: int

    @property
    def experts(self) -> nn.Module | None:
        return getattr(self.block, "experts", None) if self.block is not self.module else None


@dataclass
class _Left:
    """A router rr leaves to the model: hash-routed, or outside the decoder's layer list (MTP/draft, towers)."""

    name: str
    cls: str
    why: str  # "hash" | "outside_decoder"
    layer: int | None


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _decoder_lists(model: nn.Module, n_hidden: int | None) -> list[str]:
    """Names of the decoder's layer lists: ModuleLists named ``...layers`` of ``num_hidden_layers`` entries."""
    found = [name for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers"
             and (n_hidden is None or len(mod) == n_hidden)]
    # the outermost lists only (a layer list nested in another is not the decoder's)
    return [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]


def survey(model: nn.Module, *, allow_untested: bool = False) -> tuple[list[_Router], list[_Left]]:
    """Replayable decoder routers (layer order) and the routers left to the model; refuses unknown ones."""
    if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False) is True:
        raise UnsupportedModelError(
            "the model uses hub kernels (use_kernels=True), which can replace a whole MoE block so its router "
            "never runs; load it without kernels to replay routing")
    cfg = _text_config(model)
    n_hidden = getattr(cfg, "num_hidden_layers", None)
    lists = _decoder_lists(model, int(n_hidden) if isinstance(n_hidden, int) else None)
    modules = dict(model.named_modules())
    routers: list[_Router] = []
    left: list[_Left] = []
    for name, mod in modules.items():
        cls = type(mod).__name__
        family = router_family(cls)
        if family is not None:
            st = family_status(family)
            if st.status == "refused" and not (allow_untested and family not in TESTED
                                               and cls in SUPPORTED_ROUTERS):
                raise UnsupportedModelError(f"{name}: model family {family!r} ({cls}) is refused: {st.reason}")
        fn = SUPPORTED_ROUTERS.get(cls)
        if fn is None and cls not in HASH_ROUTERS:
            if family is None and _ROUTER_LIKE.search(cls) and not isinstance(mod, nn.Linear):
                raise UnsupportedModelError(
                    f"{name}: router class {cls} is not supported by rr_client.replay "
                    f"(supported: {len(SUPPORTED_ROUTERS)} router classes, see docs/replay-coverage.md)")
            continue
        prefix = next((lst for lst in lists if name.startswith(lst + ".")), None)
        layer = int(name[len(prefix) + 1:].split(".")[0]) if prefix is not None else None
        if cls in HASH_ROUTERS:
            left.append(_Left(name, cls, "hash", layer))
            continue
        if prefix is None:
            left.append(_Left(name, cls, "outside_decoder", None))
            continue
        block = modules[name.rsplit(".", 1)[0]] if "." in name else model
        routers.append(_Router(layer, name, mod, block, fn, int(mod.num_experts), int(mod.top_k)))
    if not routers:
        if left:
            return [], left
        classes = sorted({type(m).__name__ for m in modules.values() if "moe" in type(m).__name__.lower()
                          or "expert" in type(m).__name__.lower()})
        raise UnsupportedModelError(
            f"no supported MoE router found in {type(model).__name__}"
            + (f" (MoE-looking modules: {classes})" if classes else ""))
    layers = [r.layer for r in routers]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"more than one router per decoder layer: {layers}")
    return sorted(routers, key=lambda r: r.layer), left


def find_routers(model: nn.Module, *, allow_untested: bool = False) -> list[_Router]:
    """Every replayable MoE router of ``model``'s decoder with its layer index, in layer order.

    Refuses unknown routers and refused families (:class:`UnsupportedModelError`, with the reason).
    Hash-routed routers and routers outside the decoder's layer list (MTP/draft, towers) are not returned:
    :func:`survey` lists them; replay leaves them to the model and the audit reports them."""
    routers, _ = survey(model, allow_untested=allow_untested)
    if not routers:
        raise UnsupportedModelError(f"no replayable MoE router in {type(model).__name__}'s decoder layers")
    return routers


def _num_hidden_layers(model: nn.Module, routers: list[_Router]) -> int:
    cfg = _text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    return int(n) if n else max(r.layer for r in routers) + 1


# ---------------------------------------------------------------- kernel guard shared by both modes


@contextmanager
def _hooks(routers: list[_Router], router_hook: Callable[[_Router, tuple[Any, ...]], Any]) -> Iterator[None]:
    """Install ``router_hook`` on every router, plus a guard that each MoE block's forward ran its router."""
    handles = []
    fired: dict[int, int] = {}

    def on_router(r: _Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
            fired[r.layer] = fired.get(r.layer, 0) + 1
            return router_hook(r, out)
        return hook

    def on_block_pre(r: _Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any) -> None:
            fired[r.layer] = 0
        return hook

    def on_block(r: _Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            if not fired.get(r.layer):
                raise UnsupportedModelError(
                    f"layer {r.layer}: the MoE block {type(r.block).__name__} ran without calling its router "
                    f"{r.name} (a kernel or a patched forward replaced the block); routing cannot be replayed")
        return hook

    try:
        for r in routers:
            handles.append(r.module.register_forward_hook(on_router(r)))
            if r.block is not r.module:
                handles.append(r.block.register_forward_pre_hook(on_block_pre(r)))
                handles.append(r.block.register_forward_hook(on_block(r)))
        yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- replay (R3)


def _layer_positions(
    n_axis: int, n_hidden: int, routers: list[_Router], layers: Sequence[int] | None, extra: Sequence[int] = ()
) -> tuple[dict[int, int], list[int]]:
    """Absolute decoder layer -> position on the layer axis of the replayed tensor; and the axis' layers."""
    moe = [r.layer for r in routers]
    if layers is None:
        if n_axis == n_hidden:
            layers = list(range(n_hidden))
        elif n_axis == len(moe):
            layers = moe
        elif n_axis == len(moe) + len(extra):
            layers = sorted(set(moe) | set(extra))
        else:
            raise ShapeMismatchError(
                f"routed_experts has {n_axis} layers; the model has {n_hidden} decoder layers, {len(moe)} MoE "
                f"layers ({moe}); pass layers=")
    layers = [int(x) for x in layers]
    if len(layers) != n_axis:
        raise ShapeMismatchError(f"layers lists {len(layers)} layers but routed_experts has {n_axis}")
    missing = [layer for layer in moe if layer not in layers]
    if missing:
        raise ShapeMismatchError(f"routed_experts has no rows for MoE layers {missing} (layers={layers})")
    return {layer: layers.index(layer) for layer in moe}, layers


def _valid_rows(ids: torch.Tensor) -> torch.Tensor:
    """Rows that look like recorded routing: no negative id, not all zero, no repeated id."""
    srt = ids.sort(dim=-1).values
    distinct = (srt[:, 1:] != srt[:, :-1]).all(dim=-1) if ids.shape[-1] > 1 else torch.ones_like(srt[:, 0], dtype=torch.bool)
    return (ids >= 0).all(dim=-1) & distinct & (ids != 0).any(dim=-1)


class _Audit:
    """Counters of one ``replay_routing`` block; ``report()`` is the plain dict a trainer logs."""

    def __init__(self, routers: list[_Router], left: list[_Left], n_rows: int) -> None:
        self.routers = routers
        self.left = left
        self.n_rows = n_rows
        z = dict.fromkeys([r.layer for r in routers], 0)
        self.replayed, self.left_rows, self.agree = dict(z), dict(z), dict(z)
        self.checked, self.applied = dict(z), dict(z)
        self.router_runs, self.expert_runs = dict(z), dict(z)
        self.expect: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bad_experts: dict[int, str] = {}
        self.forwards = 0
        self.unconsumed: list[int] = []

    def on_router(self, r: _Router, own: torch.Tensor, new_ids: torch.Tensor, use: torch.Tensor,
                  recompute: bool) -> None:
        self.router_runs[r.layer] += 1
        self.expect[r.layer] = (new_ids, use)
        if recompute:
            return
        n_use = int(use.sum())
        self.replayed[r.layer] += n_use
        self.left_rows[r.layer] += int(use.numel()) - n_use
        same = (own.sort(dim=-1).values == new_ids.sort(dim=-1).values).all(dim=-1)
        self.agree[r.layer] += int((same & use).sum())

    def on_experts(self, r: _Router, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.expert_runs[r.layer] += 1
        exp = self.expect.pop(r.layer, None)
        if exp is None:
            self.bad_experts[r.layer] = "the experts ran without their router running first"
            return
        want, use = exp
        got = next((a for a in list(args) + list(kwargs.values())
                    if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() == 2
                    and a.shape[0] == want.shape[0] and a.shape[1] == want.shape[1]), None)
        n_use = int(use.sum())
        self.checked[r.layer] += n_use
        if got is None:
            self.bad_experts[r.layer] = "no [N, K] expert-id tensor among the experts module's inputs"
            return
        same = (got.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
        self.applied[r.layer] += int((same & use).sum())

    def report(self) -> dict[str, float]:
        out: dict[str, float] = {}
        rep = sum(self.replayed.values())
        chk = sum(self.checked.values())
        out["r3/forwards"] = float(self.forwards)
        out["r3/moe_layers"] = float(len(self.routers))
        out["r3/replayed_rows"] = float(rep)
        out["r3/left_rows"] = float(sum(self.left_rows.values()))
        out["r3/applied_share"] = sum(self.applied.values()) / chk if chk else float("nan")
        out["r3/agreement"] = sum(self.agree.values()) / rep if rep else float("nan")
        out["r3/left_layers_hash"] = float(sum(x.why == "hash" for x in self.left))
        out["r3/left_routers_outside_decoder"] = float(sum(x.why == "outside_decoder" for x in self.left))
        out["r3/orphan_routers"] = float(sum(self.router_runs[r.layer] == 0 for r in self.routers))
        out["r3/unconsumed_layers"] = float(len(self.unconsumed))
        for r in self.routers:
            i = r.layer
            out[f"r3/layer{i}/replayed_rows"] = float(self.replayed[i])
            out[f"r3/layer{i}/left_rows"] = float(self.left_rows[i])
            out[f"r3/layer{i}/applied_share"] = self.applied[i] / self.checked[i] if self.checked[i] else float("nan")
            out[f"r3/layer{i}/agreement"] = self.agree[i] / self.replayed[i] if self.replayed[i] else float("nan")
        for x in self.left:
            if x.why == "hash" and x.layer is not None:
                out[f"r3/layer{x.layer}/left_rows_hash"] = float(self.n_rows * self.forwards)
        return out

    def problems(self) -> list[str]:
        msgs = []
        if self.forwards == 0:
            msgs.append("no forward pass ran inside replay_routing(audit=True)")
            return msgs
        orphans = [r for r in self.routers if self.router_runs[r.layer] == 0]
        if orphans:
            msgs.append("orphan routers (in the model, never ran in the forward; a rebuilt or bypassed decoder "
                        "layer?): " + ", ".join(f"layer {r.layer} {r.name}" for r in orphans))
        if self.unconsumed:
            msgs.append(f"replayed rows at layers {self.unconsumed} were consumed by no router (the model has no "
                        "replayable router there: layers shifted, or dense/MoE layer mapping wrong?)")
        for r in self.routers:
            i = r.layer
            if i in self.bad_experts:
                msgs.append(f"layer {i}: {self.bad_experts[i]} ({r.name})")
            elif self.router_runs[i] and self.expert_runs[i] == 0 and self.replayed[i]:
                msgs.append(f"layer {i}: the experts module never ran after {r.name} (the block bypasses it)")
            elif self.checked[i] and self.applied[i] != self.checked[i]:
                msgs.append(f"layer {i}: only {self.applied[i]}/{self.checked[i]} replayed rows reached the experts "
                            f"with the replayed ids (the MoE block {type(r.block).__name__} does not pass its "
                            "router's choice to its experts)")
        return msgs


@contextmanager
def replay_routing(
    model: nn.Module,
    routed_experts: Any,
    mask: torch.Tensor | None = None,
    *,
    layers: Sequence[int] | None = None,
    check_formula: bool = True,
    audit: bool = False,
    allow_untested: bool = False,
) -> Iterator[dict[str, float] | None]:
    """Force ``routed_experts`` as every MoE router's top-k choice inside the block; weights stay differentiable.

    ``routed_experts``: ``[B, T, L, K]`` (padded, token-major) or ``[N, L, K]`` (packed) expert ids, rows in
    the order the router sees tokens (batch-major flatten of ``input_ids``); or a
    :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`, whose ``routed_experts_mask`` and
    ``layers`` are then used. ``mask`` (same leading shape): rows where it is False keep the model's own
    choice; rows whose ids are all negative (the ``-1`` pad) too. The layer axis is absolute (``L`` = decoder
    layers) or MoE ordinals (``L`` = MoE layers), or as ``layers`` says. Errors: :class:`ShapeMismatchError`
    (token or layer count, top-k), :class:`ExpertIdOutOfRangeError`, :class:`UnrecordedRoutingError`
    (repeated ids in a replayed row: pass the mask), :class:`UnsupportedModelError` (a refused family, with
    the reason: docs/replay-coverage.md). With ``check_formula`` each hook also checks that its weight
    formula reproduces the router's own weights on the router's own ids, bit for bit, so a changed
    transformers router is caught instead of replayed wrong. Hash-routed layers (DeepSeek-V4) and routers
    outside the decoder's layer list (MTP/draft layers, towers) are left to the model.

    ``audit=True`` yields a dict, filled when the block exits, that a trainer logs as is: ``r3/replayed_rows``,
    ``r3/left_rows`` (mask, pads), ``r3/applied_share`` (replayed rows whose experts module received exactly
    the replayed ids, observed at the experts' input), ``r3/agreement`` (replayed rows the model's own
    router chose too), the same per layer (``r3/layer<i>/...``) and the layers left to the model. Leaving the
    block raises :class:`ReplayError` (with ``.report``) for an orphan router (never ran), replayed rows no
    router consumed, or any replayed row that did not reach its experts.

    With gradient checkpointing, backward re-runs the forwards: call ``backward()`` inside the block (the
    rows are keyed by decoder layer, so the recompute replays the same rows); leaving the block with a
    checkpointed forward whose backward has not run is a :class:`ReplayError`.
    """
    if hasattr(routed_experts, "routed_experts") and hasattr(routed_experts, "routed_experts_mask"):
        if mask is None:
            mask = routed_experts.routed_experts_mask
        if layers is None:
            layers = routed_experts.layers
        routed_experts = routed_experts.routed_experts
    routers, left = survey(model, allow_untested=allow_untested)
    if not routers:
        raise UnsupportedModelError(f"no replayable MoE router in {type(model).__name__}'s decoder layers")
    re_t = torch.as_tensor(routed_experts)
    if re_t.dim() < 3:
        raise ShapeMismatchError(f"routed_experts must be [..., L, K], got shape {tuple(re_t.shape)}")
    k = re_t.shape[-1]
    bad_k = [r.layer for r in routers if r.top_k != k]
    if bad_k:
        raise ShapeMismatchError(f"routed_experts has top-{k}; routers of layers {bad_k} pick top-{routers[0].top_k}")
    lead = tuple(re_t.shape[:-2])
    flat = re_t.reshape(-1, re_t.shape[-2], k)
    n_rows = flat.shape[0]
    hash_layers = [x.layer for x in left if x.why == "hash" and x.layer is not None]
    pos, axis = _layer_positions(flat.shape[1], _num_hidden_layers(model, routers), routers, layers, hash_layers)
    if mask is not None:
        m = torch.as_tensor(mask).bool()
        if tuple(m.shape) != lead:
            raise ShapeMismatchError(f"mask shape {tuple(m.shape)} does not match routed_experts rows {lead}")
        m = m.reshape(-1)
    else:
        m = torch.ones(n_rows, dtype=torch.bool)
    flat = flat.long()
    per_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for r in routers:
        ids = flat[:, pos[r.layer]]
        use = m & (ids >= 0).all(dim=-1)
        chosen = ids[use]
        if chosen.numel():
            if int(chosen.min()) < 0 or int(chosen.max()) >= r.num_experts:
                raise ExpertIdOutOfRangeError(
                    f"layer {r.layer}: replayed expert ids span [{int(chosen.min())}, {int(chosen.max())}], "
                    f"model has {r.num_experts} experts")
            srt = chosen.sort(dim=-1).values
            if (srt[:, 1:] == srt[:, :-1]).any():
                raise UnrecordedRoutingError(
                    f"layer {r.layer}: a replayed row repeats an expert id (zero padding without its mask?); "
                    "pass mask=routed_experts_mask or use pad_experts='distinct'")
        per_layer[r.layer] = (ids.clamp_min(0), use)

    aud = _Audit(routers, left, n_rows) if audit else None
    if aud is not None:
        consumed = set(pos.values()) | {axis.index(h) for h in hash_layers if h in axis}
        for p, layer in enumerate(axis):
            if p not in consumed and bool((_valid_rows(flat[:, p]) & m).any()):
                aud.unconsumed.append(layer)

    ckpt = any(getattr(mod, "gradient_checkpointing", False) is True for mod in model.modules())
    pending: dict[int, int] = {}  # checkpointed forwards whose recompute (in backward) has not run yet
    devs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(r: _Router, out: Any) -> Any:
        logits, weights, own = out[0], out[1], out[2]
        recompute = _in_backward()
        if ckpt:
            if recompute:
                pending[r.layer] = pending.get(r.layer, 0) - 1
            elif torch.is_grad_enabled():
                pending[r.layer] = pending.get(r.layer, 0) + 1
        if logits.shape[0] != n_rows:
            raise ShapeMismatchError(
                f"layer {r.layer}: the router sees {logits.shape[0]} tokens but routed_experts has {n_rows} rows "
                "(rows must follow the flattened input_ids, batch-major)")
        cached = devs.get(r.layer)
        if cached is None or cached[0].device != own.device:
            ids, use = per_layer[r.layer]
            cached = devs[r.layer] = (ids.to(own.device), use.to(own.device))
        ids, use = cached
        if check_formula:
            again = r.weights(r.module, logits, own).to(weights.dtype)
            if not torch.equal(again, weights):
                raise UnsupportedModelError(
                    f"layer {r.layer}: {type(r.module).__name__}'s weights differ from rr's formula for it "
                    "(transformers changed the router, or a dtype path rr does not know?); refusing to replay")
        new_ids = torch.where(use[:, None], ids, own)
        if aud is not None:
            aud.on_router(r, own, new_ids, use, recompute)
        return (logits, r.weights(r.module, logits, new_ids).to(weights.dtype), new_ids, *out[3:])

    extra = []
    if aud is not None:
        def on_model(_m: nn.Module, _a: Any) -> None:
            if not _in_backward():
                aud.forwards += 1
        extra.append(model.register_forward_pre_hook(on_model))
        for r in routers:
            if r.experts is not None:
                extra.append(r.experts.register_forward_pre_hook(
                    (lambda rr_: lambda _m, a, kw: aud.on_experts(rr_, a, kw))(r), with_kwargs=True))
            else:
                aud.bad_experts[r.layer] = "its MoE block has no experts module where rr can observe the ids"
    report: dict[str, float] | None = {} if audit else None
    try:
        with _hooks(routers, hook):
            yield report
    finally:
        for h in extra:
            h.remove()
    if any(v > 0 for v in pending.values()):
        raise ReplayError(
            "gradient checkpointing is on and a forward ran inside replay_routing whose backward has not: the "
            "recompute in backward would route with the model's own choice. Call backward() inside the block.")
    if aud is not None and report is not None:
        report.update(aud.report())
        problems = aud.problems()
        if problems:
            raise ReplayError("replay audit: " + "; ".join(problems), report=report)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointing recomputes forwards)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


# ---------------------------------------------------------------- record (R2)


@dataclass
class RoutingRecord:
    """What ``record_routing`` saw: the model's own top-k ids of the last forward, in rr's layout."""

    num_hidden_layers: int
    moe_layers: list[int]
    topk: int
    shape: tuple[int, ...] | None = None
    _layers: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def routed_experts(self) -> torch.Tensor:
        """``[B, T, L, K]`` int64 (``[N, L, K]`` for 1-D ``input_ids``), absolute layers; dense layers zero."""
        if not self._layers:
            raise ReplayError("no forward pass ran inside record_routing")
        n = next(iter(self._layers.values())).shape[0]
        out = torch.zeros((n, self.num_hidden_layers, self.topk), dtype=torch.long)
        for layer, ids in self._layers.items():
            out[:, layer] = ids
        if self.shape is not None and len(self.shape) >= 1:
            return out.reshape(*self.shape, self.num_hidden_layers, self.topk)
        return out


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record the model's own top-k choice per MoE layer (R2); a recompute under gradient checkpointing
    re-records the same rows. ``rec.routed_experts`` is filled after the forward inside the block."""
    routers = find_routers(model)
    rec = RoutingRecord(_num_hidden_layers(model, routers), [r.layer for r in routers], routers[0].top_k)

    def on_model(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            e = kwargs.get("inputs_embeds")
            rec.shape = tuple(e.shape[:-1]) if e is not None else None
        else:
            rec.shape = tuple(x.shape)
        rec._layers.clear()

    def hook(r: _Router, out: Any) -> Any:
        rec._layers[r.layer] = out[2].detach().long().cpu()
        return None

    h = model.register_forward_pre_hook(on_model, with_kwargs=True)
    try:
        with _hooks(routers, hook):
            yield rec
    finally:
        h.remove()
