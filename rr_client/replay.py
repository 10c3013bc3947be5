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
imports torch and never imports transformers itself (routers are recognised by class name).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rr_client.errors import ExpertIdOutOfRangeError, RRError, ShapeMismatchError, UnrecordedRoutingError

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rr_client.replay needs torch: pip install 'rr-replay[torch]'") from e

__all__ = [
    "ReplayError",
    "UnsupportedModelError",
    "RoutingRecord",
    "replay_routing",
    "record_routing",
    "find_routers",
    "SUPPORTED_ROUTERS",
]


class ReplayError(RRError):
    """Routing cannot be replayed or recorded correctly on this model."""


class UnsupportedModelError(ReplayError, TypeError):
    """An unknown router class, no router at all, or a kernel that replaces the whole MoE block."""


# ---------------------------------------------------------------- weight formulas (transformers 5.23)

WeightFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_topk(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen2/3-MoE, Qwen3-Next, OLMoE: softmax (fp32) -> gather -> optional renorm -> logits' dtype."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if module.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _softmax_topk_mixtral(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax(logits.float()) -> gather -> always renormalised; stays fp32."""
    w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True)


def _sigmoid_bias(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM4-MoE: unbiased sigmoid at the ids (the bias only chooses) -> renorm -> x scaling."""
    w = logits.sigmoid().gather(1, ids)
    if module.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * module.routed_scaling_factor


def _topk_then_softmax(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: logits (with the router's bias) at the ids -> softmax over the K chosen."""
    v = logits.gather(1, ids)
    return torch.softmax(v, dim=1, dtype=v.dtype)


SUPPORTED_ROUTERS: dict[str, WeightFn] = {
    "Qwen3MoeTopKRouter": _softmax_topk,
    "Qwen2MoeTopKRouter": _softmax_topk,
    "Qwen3NextTopKRouter": _softmax_topk,
    "OlmoeTopKRouter": _softmax_topk,
    "MixtralTopKRouter": _softmax_topk_mixtral,
    "DeepseekV3TopkRouter": _sigmoid_bias,
    "Glm4MoeTopkRouter": _sigmoid_bias,
    "GptOssTopKRouter": _topk_then_softmax,
}
_ROUTER_LIKE = re.compile(r"(router|topk.?gate|moegate)$", re.IGNORECASE)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Router:
    layer: int
    name: str
    module: nn.Module
    block: nn.Module
    weights: WeightFn
    num_experts: int
    top_k: int


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def find_routers(model: nn.Module) -> list[_Router]:
    """Every MoE router of ``model`` with its decoder-layer index, in layer order; refuses unknown ones."""
    if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False) is True:
        raise UnsupportedModelError(
            "the model uses hub kernels (use_kernels=True), which can replace a whole MoE block so its router "
            "never runs; load it without kernels to replay routing")
    modules = dict(model.named_modules())
    routers: list[_Router] = []
    for name, mod in modules.items():
        cls = type(mod).__name__
        fn = SUPPORTED_ROUTERS.get(cls)
        if fn is None:
            if _ROUTER_LIKE.search(cls) and not isinstance(mod, (nn.Linear,)):
                raise UnsupportedModelError(
                    f"{name}: router class {cls} is not supported by rr_client.replay "
                    f"(supported: {sorted(SUPPORTED_ROUTERS)})")
            continue
        m = _LAYER.search(name + ".")
        if m is None:
            raise UnsupportedModelError(f"{name}: cannot tell which decoder layer router {cls} belongs to")
        block = modules[name.rsplit(".", 1)[0]] if "." in name else model
        routers.append(_Router(int(m.group(1)), name, mod, block, fn, int(mod.num_experts), int(mod.top_k)))
    if not routers:
        classes = sorted({type(m).__name__ for m in modules.values() if "moe" in type(m).__name__.lower()
                          or "expert" in type(m).__name__.lower()})
        raise UnsupportedModelError(
            f"no supported MoE router found in {type(model).__name__}"
            + (f" (MoE-looking modules: {classes})" if classes else ""))
    layers = [r.layer for r in routers]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"more than one router per decoder layer: {layers}")
    return sorted(routers, key=lambda r: r.layer)


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
    n_axis: int, n_hidden: int, routers: list[_Router], layers: Sequence[int] | None
) -> dict[int, int]:
    """Absolute decoder layer -> position on the layer axis of the replayed tensor."""
    moe = [r.layer for r in routers]
    if layers is None:
        if n_axis == n_hidden:
            layers = list(range(n_hidden))
        elif n_axis == len(moe):
            layers = moe
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
    return {layer: layers.index(layer) for layer in moe}


@contextmanager
def replay_routing(
    model: nn.Module,
    routed_experts: Any,
    mask: torch.Tensor | None = None,
    *,
    layers: Sequence[int] | None = None,
    check_formula: bool = True,
) -> Iterator[None]:
    """Force ``routed_experts`` as every MoE router's top-k choice inside the block; weights stay differentiable.

    ``routed_experts``: ``[B, T, L, K]`` (padded, token-major) or ``[N, L, K]`` (packed) expert ids, rows in
    the order the router sees tokens (batch-major flatten of ``input_ids``); or a
    :class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`, whose ``routed_experts_mask`` and
    ``layers`` are then used. ``mask`` (same leading shape): rows where it is False keep the model's own
    choice; rows whose ids are all negative (the ``-1`` pad) too. The layer axis is absolute (``L`` = decoder
    layers) or MoE ordinals (``L`` = MoE layers), or as ``layers`` says. Errors: :class:`ShapeMismatchError`
    (token or layer count, top-k), :class:`ExpertIdOutOfRangeError`, :class:`UnrecordedRoutingError`
    (repeated ids in a replayed row: pass the mask), :class:`UnsupportedModelError`. With
    ``check_formula`` each hook also checks that its weight formula reproduces the router's own weights on
    the router's own ids, bit for bit, so a changed transformers router is caught instead of replayed wrong.

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
    routers = find_routers(model)
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
    pos = _layer_positions(flat.shape[1], _num_hidden_layers(model, routers), routers, layers)
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

    ckpt = any(getattr(mod, "gradient_checkpointing", False) is True for mod in model.modules())
    pending: dict[int, int] = {}  # checkpointed forwards whose recompute (in backward) has not run yet

    def hook(r: _Router, out: Any) -> Any:
        logits, weights, own = out
        if ckpt:
            if _in_backward():
                pending[r.layer] = pending.get(r.layer, 0) - 1
            elif torch.is_grad_enabled():
                pending[r.layer] = pending.get(r.layer, 0) + 1
        ids, use = per_layer[r.layer]
        if logits.shape[0] != n_rows:
            raise ShapeMismatchError(
                f"layer {r.layer}: the router sees {logits.shape[0]} tokens but routed_experts has {n_rows} rows "
                "(rows must follow the flattened input_ids, batch-major)")
        ids = ids.to(own.device)
        use = use.to(own.device)
        if check_formula:
            again = r.weights(r.module, logits, own)
            if again.dtype != weights.dtype or not torch.equal(again, weights):
                raise UnsupportedModelError(
                    f"layer {r.layer}: {type(r.module).__name__}'s weights differ from rr's formula for it "
                    "(transformers changed the router?); refusing to replay")
        new_ids = torch.where(use[:, None], ids, own)
        return logits, r.weights(r.module, logits, new_ids), new_ids

    with _hooks(routers, hook):
        yield
    if any(v > 0 for v in pending.values()):
        raise ReplayError(
            "gradient checkpointing is on and a forward ran inside replay_routing whose backward has not: the "
            "recompute in backward would route with the model's own choice. Call backward() inside the block.")


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
