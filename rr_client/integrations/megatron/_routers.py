"""This rank's Megatron routers, found by walking the model chunks (never by position in ``RouterReplay``'s global
list), and the configurations that bypass or undo replay, refused by name.

A router is known by its ``layer_number`` (Megatron's global 1-based decoder layer, dense layers counted; an MTP
layer's router continues after the decoder in 0.16, restarts at 1 in newer releases) and whether it sits in the MTP
block. ``RouterReplay.global_router_replay_instances``
is process-global and never shrinks: instances there that belong to no router of the chunks (a model rebuilt
without clearing it, verl #7340) are orphans, refused, since every positional setter of Megatron would feed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rr_client.core.errors import ConfigurationError, ReplayError, UnsupportedModelError
from rr_client.core.optional import require

__all__ = [
    "MegatronRouter",
    "find_routers",
    "has_transformer_layers",
    "check_config",
    "check_registered",
    "moe_layers_of",
    "REFUSED",
]


@dataclass(frozen=True, eq=False)
class MegatronRouter:
    """One ``TopKRouter`` of this rank: the module, its model chunk (virtual stage), its ``layer_number``, whether it
    is an MTP router, its module path, experts and top-k."""

    module: Any
    chunk: int
    layer_number: int
    mtp: bool
    name: str
    num_experts: int
    topk: int

    @property
    def replay(self) -> Any:
        """Megatron's ``RouterReplay`` of this router (None when routing replay is off)."""
        return getattr(self.module, "router_replay", None)

    @property
    def device(self) -> torch.device:
        """Where the router's gate weight lives (its targets go there)."""
        return self.module.weight.device

    @property
    def row_layer(self) -> int:
        """The 0-based layer of the rows it reads: ``layer_number - 1``; an MTP router of depth ``j`` reads layer
        ``num_layers + j - 1`` (after the decoder, as DeepSeek-V3 numbers its MTP layer), whether its
        ``layer_number`` continues the decoder's (0.16) or restarts at 1 (newer releases)."""
        n = int(self.module.config.num_layers)
        if self.mtp and self.layer_number <= n:
            return n + self.layer_number - 1
        return self.layer_number - 1

    def describe(self) -> str:
        """``"decoder layer 3 (chunk 0, decoder.layers.2.mlp.router)"`` for messages."""
        kind = "MTP layer" if self.mtp else "decoder layer"
        return f"{kind} {self.layer_number} (chunk {self.chunk}, {self.name})"


def _unwrap(chunk: Any) -> Any:
    """A model chunk without its DDP / Float16Module wrappers (``.module`` until a GPT model)."""
    while not hasattr(chunk, "named_modules") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def find_routers(model_chunks: Any) -> list[MegatronRouter]:
    """Every ``TopKRouter`` of ``model_chunks`` (one module or this rank's list of virtual-stage chunks), in chunk
    then module order; refuses an MoE layer whose router is no ``TopKRouter``, a router without ``layer_number``
    and two routers of one chunk on one layer."""
    require("megatron.core", for_what="rr_client.integrations.megatron")
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
    found: list[MegatronRouter] = []
    seen: dict[tuple[bool, int], str] = {}
    for c, chunk in enumerate(chunks):
        for name, mod in _unwrap(chunk).named_modules():
            if isinstance(mod, BaseMoELayer) and not isinstance(getattr(mod, "router", None), TopKRouter):
                raise UnsupportedModelError(
                    f"MoE layer {name} of chunk {c} routes with "
                    f"{type(getattr(mod, 'router', None)).__name__}, not a TopKRouter: "
                    "Megatron's RouterReplay (and rr) cannot replay it"
                )
            if not isinstance(mod, TopKRouter):
                continue
            if mod.layer_number is None:
                raise ReplayError(
                    f"router {name} of chunk {c} has no layer_number: it was built outside a "
                    "TransformerLayer, so rr cannot tell which rows it takes"
                )
            mtp = "mtp" in name.split(".")
            r = MegatronRouter(mod, c, int(mod.layer_number), mtp, name, int(mod.num_experts), int(mod.topk))
            key = (mtp, r.layer_number)
            if key in seen:
                raise ReplayError(
                    f"{r.describe()} and {seen[key]} share layer_number {r.layer_number}: "
                    "their rows cannot be told apart"
                )
            seen[key] = r.describe()
            found.append(r)
    return found


def has_transformer_layers(model_chunks: Sequence[Any]) -> bool:
    """Whether the chunks hold any Megatron ``TransformerLayer`` (a pipeline stage of dense layers does; a model
    of another library does not)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return any(isinstance(m, TransformerLayer) for c in model_chunks for m in _unwrap(c).modules())


#: (setting, why replay does not hold under it); each refused with R2 / R3 when set
REFUSED = {
    "moe_router_load_balancing_type": "sinkhorn (and quantile) balancing pick experts without consulting replay",
    "moe_expert_capacity_factor": "token dropping drops replayed tokens after replay",
    "moe_router_fusion": "the fused (Transformer Engine) router skips replay",
    "moe_enable_routing_replay": "without it the routers have no RouterReplay to take targets",
    "moe_router_force_load_balancing": "forced balancing routes on random logits: replayed ids get gates from noise",
    "moe_router_force_biased": "forced-biased routing adds a bias the rollout never saw to the replayed gates",
    "moe_input_jitter_eps": "input jitter perturbs the router input: replayed ids get gates from jittered logits",
    "cuda_graph_impl": "a CUDA graph over the router replays the capture-time targets and skips the router module "
    "(Megatron's maybe_skip_or_early_return_by_cudagraph), so rr's rows and checks never run",
}

#: CUDA-graph scopes (Transformer Engine graphs) that leave the router out of the graph
_GRAPH_SCOPES_WITHOUT_ROUTER = {"attn", "mlp", "mamba"}


def graphs_router(cfg: Any) -> bool:
    """Whether a CUDA graph captures the MoE router: ``local`` graphs whole layers (or the iteration);
    ``transformer_engine`` the scopes named (empty or "full": the whole layer)."""
    impl = str(getattr(cfg, "cuda_graph_impl", "none") or "none")
    if getattr(cfg, "enable_cuda_graph", False) or getattr(cfg, "external_cuda_graph", False):
        return True
    if impl == "none":
        return False
    if impl != "transformer_engine":
        return True
    scope = getattr(cfg, "cuda_graph_scope", None) or []
    scopes = scope if isinstance(scope, (list, tuple)) else [scope]
    names = {getattr(s, "name", str(s)) for s in scopes}
    return not names or "full" in names or not names <= _GRAPH_SCOPES_WITHOUT_ROUTER


def _balancing_refused(value: Any) -> list[str]:
    """The load-balancing types in ``value`` (one or a per-layer list) that bypass replay."""
    kinds = value if isinstance(value, (list, tuple)) else [value]
    return [str(k) for k in kinds if str(k) == "sinkhorn" or "quantile" in str(k)]


def check_config(routers: Sequence[MegatronRouter]) -> None:
    """Refuse, with :class:`ConfigurationError` naming the setting, a router configuration under which Megatron
    would silently not replay: sinkhorn / quantile balancing, a capacity factor, the fused router, replay off,
    forced (or forced-biased) balancing, input jitter, a CUDA graph over the router."""
    for r in routers:
        cfg = r.module.config
        bad = _balancing_refused(getattr(cfg, "moe_router_load_balancing_type", None))
        if bad:
            _refuse(
                r,
                "moe_router_load_balancing_type",
                bad if len(bad) > 1 else bad[0],
                "'aux_loss', 'seq_aux_loss' or 'none'",
            )
        if getattr(cfg, "moe_expert_capacity_factor", None) is not None:
            _refuse(r, "moe_expert_capacity_factor", cfg.moe_expert_capacity_factor, "None (dropless)")
        if getattr(cfg, "moe_router_fusion", False):
            _refuse(r, "moe_router_fusion", True, "False")
        if r.replay is None or not getattr(cfg, "moe_enable_routing_replay", False):
            _refuse(r, "moe_enable_routing_replay", getattr(cfg, "moe_enable_routing_replay", None), "True")
        for flag in ("moe_router_force_load_balancing", "moe_router_force_biased"):
            if getattr(cfg, flag, False):
                _refuse(r, flag, getattr(cfg, flag), "False")
        if getattr(cfg, "moe_input_jitter_eps", None) is not None:
            _refuse(r, "moe_input_jitter_eps", cfg.moe_input_jitter_eps, "None")
        if graphs_router(cfg):
            _refuse(
                r,
                "cuda_graph_impl",
                f"{getattr(cfg, 'cuda_graph_impl', None)!s} (scope {getattr(cfg, 'cuda_graph_scope', None)!r})",
                "'none', or a transformer_engine cuda_graph_scope without the MoE layer (['attn'])",
            )


def _refuse(r: MegatronRouter, setting: str, value: Any, instead: str) -> None:
    """Raise the refusal of ``setting`` for router ``r``."""
    raise ConfigurationError(
        f"TransformerConfig.{setting}={value!r} ({r.describe()}): {REFUSED[setting]}, so "
        f"R2/R3 would silently not hold; set {setting} to {instead}"
    )


def check_registered(routers: Sequence[MegatronRouter], others: Sequence[MegatronRouter] = ()) -> None:
    """Refuse orphans: a router whose ``RouterReplay`` left the global list, or listed instances that belong to no
    router of these chunks nor of ``others`` (the routers of another model built on purpose, a reference model: a
    rebuilt model's leftovers would be fed by Megatron's positional setters instead)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    listed = RouterReplay.global_router_replay_instances
    ids = {id(x) for x in listed}
    gone = [r.describe() for r in routers if r.replay is not None and id(r.replay) not in ids]
    if gone:
        raise ReplayError(
            f"orphan routers: {gone[:4]} are no longer in RouterReplay.global_router_replay_instances "
            "(the list was cleared or the model rebuilt after these chunks were built); pass the "
            "model chunks that run"
        )
    mine = {id(r.replay) for r in (*routers, *others)}
    stale = [i for i, x in enumerate(listed) if id(x) not in mine]
    if stale:
        raise ReplayError(
            f"orphan routers: {len(stale)} of {len(listed)} RouterReplay instances (list positions "
            f"{stale[:8]}) belong to no router of the given model chunks: a model rebuilt without "
            "RouterReplay.clear_global_router_replay_instances(), or chunks left out; clear the list "
            "before building the model and pass every chunk of this rank. A second model built on "
            "purpose with replay on (a reference model): name its chunks in others= (or build it with "
            "moe_enable_routing_replay=False when it needs no replay)"
        )


def moe_layers_of(config: Any) -> list[int]:
    """The 0-based decoder layers Megatron builds as MoE, from ``moe_layer_freq`` (an int every-n, or a 0/1 list)."""
    freq = getattr(config, "moe_layer_freq", 1)
    n = int(config.num_layers)
    if isinstance(freq, int):
        return [i for i in range(n) if i % freq == 0]
    return [i for i, v in enumerate(list(freq)[:n]) if int(v) == 1]
