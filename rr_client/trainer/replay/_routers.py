"""Find the MoE routers rr replays in a Hugging Face transformers 5.x model, and hook them.

Routers are recognised by class name (transformers is never imported), keyed by their decoder-layer index
(``...layers.<i>...``) so a gradient-checkpointing recompute finds the same rows. :func:`survey` also lists
the routers rr leaves to the model (hash-routed layers, MTP/draft layers, towers) and refuses unknown ones.
A router's facts (expert count, top-k, output order) are read from the router that is installed, so one
family replays across the declared transformers range or is refused naming the installed release.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rr_client.core.errors import MissingDependencyError, UnsupportedModelError

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("rr_client.trainer.replay needs torch: pip install 'rr-replay[torch]'") from e

from rr_client.trainer.replay.coverage import FAMILY_ROUTERS, HIGHEST, TESTED, family_status, router_family
from rr_client.trainer.replay.formulas import HASH_ROUTERS, SUPPORTED_ROUTERS, WeightFn

__all__ = [
    "Router",
    "LeftRouter",
    "survey",
    "find_routers",
    "num_hidden_layers",
    "router_hooks",
    "router_device",
    "transformers_version",
]

_ROUTER_LIKE = re.compile(r"(router|topk.?gate|moegate|topk.?gating)$", re.IGNORECASE)


@dataclass
class Router:
    """One replayable MoE router: its decoder layer, module, MoE block, weight formula and size."""

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
class LeftRouter:
    """A router rr leaves to the model: hash-routed, or outside the decoder's layer list (MTP/draft, towers)."""

    name: str
    cls: str
    why: str  # "hash" | "outside_decoder"
    layer: int | None


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def transformers_version() -> str:
    """The installed transformers release, from its metadata (not imported), for refusals that name it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "(not installed)"


def _model_family(model: nn.Module) -> str | None:
    """The model's family (model type) as rr's coverage table names it, or None if rr does not know it."""
    for cfg in (_text_config(model), getattr(model, "config", None)):
        mt = str(getattr(cfg, "model_type", "") or "")
        for cand in (mt, mt.removesuffix("_text")):
            if cand in FAMILY_ROUTERS:
                return cand
    return None


def _family_without_router(model: nn.Module) -> UnsupportedModelError | None:
    """A supported family whose router classes the installed transformers does not have (an older layout)."""
    family = _model_family(model)
    if family is None or not FAMILY_ROUTERS[family] or family_status(family).status != "supported":
        return None
    names = {type(m).__name__ for m in model.modules()}
    if names & set(FAMILY_ROUTERS[family]):
        return None
    return UnsupportedModelError(
        f"model family {family!r} ({type(model).__name__}) has no {' / '.join(FAMILY_ROUTERS[family])} on "
        f"transformers {transformers_version()}: this release routes inside the MoE block (no router module "
        f"that returns its top-k choice), which rr cannot replay; rr replays {family} on transformers "
        f"{HIGHEST} (see docs/replay-coverage.md)"
    )


def _int_attr(objs: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    """The first positive int attribute among ``names`` on the first object that has one (releases move them)."""
    for obj in objs:
        for n in names:
            v = getattr(obj, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _facts(name: str, mod: nn.Module, block: nn.Module, cfg: Any) -> tuple[int, int]:
    """(expert count, top-k) of the installed router: its attributes, its weight's rows, its block, the config."""
    n = _int_attr((mod,), ("num_experts", "n_routed_experts"))
    w = getattr(mod, "weight", None)
    if n is None and isinstance(w, torch.Tensor) and w.dim() == 2:
        n = int(w.shape[0])
    n = n or _int_attr((block, cfg), ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"))
    k = _int_attr((mod, block), ("top_k",)) or _int_attr((cfg,), ("num_experts_per_tok", "moe_k", "moe_topk"))
    if n is None or k is None:
        raise UnsupportedModelError(
            f"{name}: cannot read the {'expert count' if n is None else 'top-k'} of {type(mod).__name__} on "
            f"transformers {transformers_version()} (not on the router, its block or the config)"
        )
    return n, k


def _decoder_lists(model: nn.Module, n_hidden: int | None) -> list[str]:
    """Names of the decoder's layer lists: ModuleLists named ``...layers`` of ``num_hidden_layers`` entries."""
    found = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and name.split(".")[-1] == "layers"
        and (n_hidden is None or len(mod) == n_hidden)
    ]
    # the outermost lists only (a layer list nested in another is not the decoder's)
    return [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]


def survey(model: nn.Module, *, allow_untested: bool = False) -> tuple[list[Router], list[LeftRouter]]:
    """Replayable decoder routers (layer order) and the routers left to the model; refuses unknown ones."""
    if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False) is True:
        raise UnsupportedModelError(
            "the model uses hub kernels (use_kernels=True), which can replace a whole MoE block so its router "
            "never runs; load it without kernels to replay routing"
        )
    cfg = _text_config(model)
    n_hidden = getattr(cfg, "num_hidden_layers", None)
    lists = _decoder_lists(model, int(n_hidden) if isinstance(n_hidden, int) else None)
    modules = dict(model.named_modules())
    routers: list[Router] = []
    left: list[LeftRouter] = []
    for name, mod in modules.items():
        cls = type(mod).__name__
        family = router_family(cls)
        if family is not None:
            st = family_status(family)
            if st.status == "refused" and not (allow_untested and family not in TESTED and cls in SUPPORTED_ROUTERS):
                raise UnsupportedModelError(f"{name}: model family {family!r} ({cls}) is refused: {st.reason}")
        fn = SUPPORTED_ROUTERS.get(cls)
        if fn is None and cls not in HASH_ROUTERS:
            if family is None and _ROUTER_LIKE.search(cls) and not isinstance(mod, nn.Linear):
                changed = _family_without_router(model)
                if changed is not None:
                    raise changed
                raise UnsupportedModelError(
                    f"{name}: router class {cls} is not supported by rr_client.trainer.replay "
                    f"(supported: {len(SUPPORTED_ROUTERS)} router classes, see docs/replay-coverage.md)"
                )
            continue
        prefix = next((lst for lst in lists if name.startswith(lst + ".")), None)
        layer = int(name[len(prefix) + 1 :].split(".")[0]) if prefix is not None else None
        if cls in HASH_ROUTERS:
            left.append(LeftRouter(name, cls, "hash", layer))
            continue
        if prefix is None:
            left.append(LeftRouter(name, cls, "outside_decoder", None))
            continue
        block = modules[name.rsplit(".", 1)[0]] if "." in name else model
        if callable(getattr(block, "route_tokens_to_experts", None)):
            raise UnsupportedModelError(
                f"{name}: on transformers {transformers_version()}, {cls} returns router logits only and "
                f"{type(block).__name__}.route_tokens_to_experts picks the top-k inside the MoE block, which rr "
                f"cannot replay; rr replays model family {family!r} on transformers {HIGHEST}, whose router "
                "returns its choice (see docs/replay-coverage.md)"
            )
        n_experts, top_k = _facts(name, mod, block, cfg)
        routers.append(Router(layer, name, mod, block, fn, n_experts, top_k))
    if not routers:
        if left:
            return [], left
        changed = _family_without_router(model)
        if changed is not None:
            raise changed
        classes = sorted(
            {
                type(m).__name__
                for m in modules.values()
                if "moe" in type(m).__name__.lower() or "expert" in type(m).__name__.lower()
            }
        )
        raise UnsupportedModelError(
            f"no supported MoE router found in {type(model).__name__}"
            + (f" (MoE-looking modules: {classes})" if classes else "")
        )
    layers = [r.layer for r in routers]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"more than one router per decoder layer: {layers}")
    return sorted(routers, key=lambda r: r.layer), left


def find_routers(model: nn.Module, *, allow_untested: bool = False) -> list[Router]:
    """Every replayable MoE router of ``model``'s decoder with its layer index, in layer order.

    Refuses unknown routers and refused families (:class:`UnsupportedModelError`, with the reason).
    Hash-routed routers and routers outside the decoder's layer list (MTP/draft, towers) are not returned:
    :func:`survey` lists them; replay leaves them to the model and the audit reports them."""
    routers, _ = survey(model, allow_untested=allow_untested)
    if not routers:
        raise UnsupportedModelError(f"no replayable MoE router in {type(model).__name__}'s decoder layers")
    return routers


def num_hidden_layers(model: nn.Module, routers: list[Router]) -> int:
    """The decoder's layer count from the (text) config, else one past the last router's layer."""
    cfg = _text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    return int(n) if n else max(r.layer for r in routers) + 1


# ---------------------------------------------------------------- kernel guard shared by both modes


@contextmanager
def router_hooks(routers: list[Router], router_hook: Callable[[Router, tuple[Any, ...]], Any]) -> Iterator[None]:
    """Install ``router_hook`` on every router, plus a guard that each MoE block's forward ran its router."""
    handles = []
    fired: dict[int, int] = {}

    def on_router(r: Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
            fired[r.layer] = fired.get(r.layer, 0) + 1
            if not _ids_first(r, out):
                return router_hook(r, out)
            got = router_hook(r, (out[0], out[2], out[1], *out[3:]))  # (logits, ids, weights): an older release
            return None if got is None else (got[0], got[2], got[1], *got[3:])

        return hook

    def on_block_pre(r: Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any) -> None:
            fired[r.layer] = 0

        return hook

    def on_block(r: Router) -> Callable[..., Any]:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            if not fired.get(r.layer):
                raise UnsupportedModelError(
                    f"layer {r.layer}: the MoE block {type(r.block).__name__} ran without calling its router "
                    f"{r.name} (a kernel or a patched forward replaced the block); routing cannot be replayed"
                )

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


def _ids_first(r: Router, out: Any) -> bool:
    """Whether the router returned ``(logits, ids, weights)`` (False: ``(logits, weights, ids)``); refuses any
    other output, naming the installed transformers (dtype checks only: no sync)."""
    if isinstance(out, tuple) and len(out) >= 3 and all(isinstance(t, torch.Tensor) for t in out[:3]):
        w_float, i_float = out[1].is_floating_point(), out[2].is_floating_point()
        if w_float != i_float:
            return i_float
    got = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
    raise UnsupportedModelError(
        f"{r.name}: {type(r.module).__name__} on transformers {transformers_version()} returned {got}, not "
        "(logits, weights, ids) with integer ids: rr cannot replay this router (see docs/replay-coverage.md)"
    )


def router_device(r: Router) -> torch.device | None:
    """Where the router runs (its first parameter's device), or None for a parameter-free router."""
    p = next(r.module.parameters(), None)
    return None if p is None else p.device
