"""What rr changes in verl 0.9.1, one patch per verl module, each applied when that module is imported.

- ``verl.workers.engine.fsdp.transformer_impl`` (:func:`patch_fsdp_engine`): checks the shape of what rr's engine
  overrides and combines rr's mixin with ``FSDPEngineWithLMHead`` (rr's subclass); it changes nothing in verl.
- ``verl.workers.engine_workers`` (:func:`patch_engine_workers`): ``ActorRolloutRefWorker.__init__`` reads
  ``actor.fsdp_config.router_replay.mode``; only with ``actor.strategy=fsdp2`` and R2/R3 it registers rr's engine
  through ``EngineRegistry.register`` and turns ``enable_routing_replay`` on (verl forces it off for FSDP).
  FSDP1 (``strategy=fsdp``) with R2/R3 is refused, and so is any replay request rr's patches cannot serve.
- ``verl.experimental.agent_loop.tool_agent_loop`` (:func:`patch_tool_agent_loop`): with rr's FSDP replay on, a
  turn adds only the rows the trajectory did not hold (verl #5825, #6054).
- ``verl.workers.rollout.sglang_rollout.async_sglang_server`` (:func:`patch_sglang_server`): SGLang routing verl's
  own read would crash on (base64 since SGLang 0.5.11, the module it imports moved in 0.5.12) is decoded and
  checked by rr.

Each patch is contained (:func:`apply_patch`): one that fails (a renamed verl method, a shape rr does not wrap)
logs one error naming it and leaves its module as verl ships it; the import of verl goes on. Where rr's replay is
not active (an untested verl, a failed patch), :func:`guard_engine_workers` still wraps the worker's ``__init__``,
shape-agnostic, so that a worker asked for R2/R3 on FSDP raises instead of training unreplayed.

verl 0.5-0.7 also ship the legacy FSDP worker (``verl.workers.fsdp_workers.ActorRolloutRefWorker`` and its
``AsyncActorRolloutRefWorker``; 0.8 removed it), the one their ``main_ppo`` runs for fsdp/fsdp2 (0.5 and 0.6
always, 0.7 by default: ``trainer.use_legacy_worker_impl=auto``). It has no routing replay and rr does not replay in it, on any release:
:func:`guard_legacy_workers` wraps its ``__init__`` (always, whatever the release) so that a worker asked for
replay on FSDP raises (:func:`refuse_legacy_worker`) instead of training unreplayed.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from rr_client.core.errors import ConfigurationError, UnsupportedVersionError
from rr_client.core.patching import Shape, check_shapes, wrap_once
from rr_client.core.versions import OVERRIDE

from ._gate import REPLAY_MODES, TESTED_VERL, installed_verl_version

logger = logging.getLogger("rr_client.integrations.verl")

WHAT = f"verl {TESTED_VERL}"
REPLAY_STRATEGY = "fsdp2"
FSDP_STRATEGIES = ("fsdp", "fsdp2")
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
WORKERS_MODULE = "verl.workers.engine_workers"
LEGACY_WORKERS_MODULE = "verl.workers.fsdp_workers"  # verl 0.5-0.7 only (gone in 0.8)
LEGACY_SWITCH = "trainer.use_legacy_worker_impl"  # verl 0.5-0.7: auto (default) / enable = the legacy worker
VERL_ACTOR_MODE_KEY = "actor_rollout_ref.actor.router_replay.mode"  # verl 0.7's own (Megatron) replay switch
TOOL_LOOP_MODULE = "verl.experimental.agent_loop.tool_agent_loop"
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
MODE_KEY = "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
MEGATRON_MODE_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"
ROLLOUT_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
# verl's own replay switches (its Megatron engine's in 0.9.1, verl 0.7's actor-level one), which its FSDP worker
# ignores: on fsdp/fsdp2 they ask for replay that verl would not do
VERL_OWN_MODE_PATHS = (("megatron", "router_replay"), ("router_replay",))

# the shapes rr wraps or subclasses (parameter names, as rr_client.core.patching.check_shapes reads them)
WORKER_INIT = ["self", "config", "role", "distillation_config", "kwargs"]
TOOL_STEP = ["self", "agent_data", "sampling_params", "ignore_termination"]
MEGATRON_FEEDER = ["layers_topk_idx", "attention_mask", "tf_config", "vp_rank", "replay_mask", "local_cp_size", "model"]
MEGATRON_STEP = ["self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"]
MEGATRON_OUTPUTS = ["self", "output", "data"]
MEGATRON_BATCH = ["self", "data", "loss_function", "forward_only"]
SGLANG_GENERATE = [
    "self",
    "prompt_ids",
    "sampling_params",
    "request_id",
    "image_data",
    "video_data",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
]
ENGINE_SHAPES: dict[str, list[str]] = {
    "__init__": ["self", "model_config", "engine_config", "optimizer_config", "checkpoint_config"],
    "initialize": ["self"],
    "forward_backward_batch": ["self", "data", "loss_function", "forward_only"],
    "prepare_model_inputs": ["self", "micro_batch"],
    "prepare_model_outputs": ["self", "output", "output_args", "micro_batch", "logits_processor_func"],
}
REGISTRY_SHAPES: dict[str, list[str]] = {
    "register": ["model_type", "backend", "device", "vendor"],
    "get_engine_cls": ["model_type", "backend"],
}
HELPER_SHAPES: dict[str, dict[str, list[str]]] = {  # verl's functions rr's engine calls, by module
    "verl.utils.tensordict_utils": {"get_non_tensor_data": ["data", "key", "default"]},
    "verl.workers.utils.padding": {"no_padding_2_padding": ["tensor", "data"]},
}

_ENGINES: dict[str, type] = {}  # model type -> rr's engine class (built by patch_fsdp_engine)
FAILED: dict[str, str] = {}  # module -> why its patch failed (logged once)


# -- the mode, from what each patched object can see


def _get(cfg: Any, key: str) -> Any:
    """``cfg[key]`` of an omegaconf config, a mapping or a dataclass; None when absent."""
    if cfg is None:
        return None
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        try:
            return cfg.get(key, None)
        except Exception:  # noqa: BLE001 - a dataclass config's get() may not take a default
            pass
    return getattr(cfg, key, None)


def configured_replay(actor_rollout_ref: Any) -> tuple[str, str]:
    """``(actor.strategy, actor.fsdp_config.router_replay.mode)`` of verl's ``actor_rollout_ref`` config."""
    actor = _get(actor_rollout_ref, "actor")
    strategy = str(_get(actor, "strategy") or "")
    mode = _get(_get(_get(actor, "fsdp_config"), "router_replay"), "mode")
    return strategy, str(mode or "disabled")


def fsdp_replay_on(actor_rollout_ref: Any) -> bool:
    """Whether rr's FSDP replay is on: ``actor.strategy=fsdp2`` and ``fsdp_config.router_replay.mode`` R2/R3."""
    strategy, mode = configured_replay(actor_rollout_ref)
    return strategy == REPLAY_STRATEGY and mode in REPLAY_MODES


def verl_own_mode(config: Any) -> str | None:
    """``<key>=<mode>`` of a verl-own replay switch (``actor.megatron.router_replay.mode``, verl 0.7's
    ``actor.router_replay.mode``) set to R2/R3 in a worker's ``actor_rollout_ref`` config; None when none is."""
    actor = _get(config, "actor")
    for path in VERL_OWN_MODE_PATHS:
        node = actor
        for part in path:
            node = _get(node, part)
        mode = _get(node, "mode")
        if str(mode) in REPLAY_MODES:
            return f"actor_rollout_ref.actor.{'.'.join(path)}.mode={mode}"
    return None


def replay_requested(config: Any) -> str | None:
    """The setting of a worker's ``actor_rollout_ref`` config that asks verl's FSDP actor (fsdp or fsdp2) for
    routing replay (``router_replay.mode`` R2/R3, verl's own switch for its Megatron engine, or the rollout's
    routing with ``rollout.enable_rollout_routing_replay``); None when nothing does or the strategy is not FSDP."""
    strategy, mode = configured_replay(config)
    if strategy not in FSDP_STRATEGIES:
        return None
    if mode in REPLAY_MODES:
        return f"{MODE_KEY}={mode}"
    own = verl_own_mode(config)
    if own is not None:
        return own
    if _get(_get(config, "rollout"), "enable_rollout_routing_replay"):
        return f"{ROLLOUT_KEY}=True"
    return None


def worker_replay_mode(config: Any) -> str:
    """rr's mode for a worker's ``actor_rollout_ref`` config: R2/R3 on fsdp2, "disabled" for every other strategy
    (verl's own engines handle megatron and veomni). FSDP1 with R2/R3 is refused: rr never ran on it; so is the
    rollout's routing on FSDP with ``router_replay.mode`` disabled (the rows would reach no replay)."""
    strategy, mode = configured_replay(config)
    asked = replay_requested(config)
    if asked is None:
        return "disabled"
    if strategy != REPLAY_STRATEGY:
        raise ConfigurationError(
            f"actor_rollout_ref.actor.strategy={strategy} with fsdp_config.router_replay.mode={mode}"
            + (f" and {asked}" if mode not in REPLAY_MODES else "")
            + ": rr replays routing only in verl's FSDP2 "
            f"engine; set actor_rollout_ref.actor.strategy={REPLAY_STRATEGY} (or router_replay.mode=disabled and "
            f"{ROLLOUT_KEY}=False)"
        )
    if mode not in REPLAY_MODES:
        want = asked.rsplit("=", 1)[1] if asked.startswith("actor_rollout_ref.actor.") else "R3"
        raise ConfigurationError(
            f"{asked} with actor.strategy={strategy} but {MODE_KEY}={mode}: verl's FSDP actor reads no other replay "
            f"switch, so it would train unreplayed; set +{MODE_KEY}={want}, or turn off {asked.split('=')[0]}"
        )
    return mode


def _what() -> str:
    """The installed verl as a shape refusal names it, beside the release rr was tested with."""
    return f"verl {installed_verl_version() or '(version unknown)'} (rr was tested with {WHAT})"


# -- containment


class Patch(NamedTuple):
    """One verl module's patch: what it wraps, the function, what the user loses when it cannot apply, and what
    rr puts in its place then (None: nothing)."""

    target: str
    apply: Callable[[types.ModuleType], None]
    if_failed: str
    fallback: Callable[[types.ModuleType, str], None] | None = None


def apply_patch(name: str, module: types.ModuleType) -> bool:
    """Apply ``PATCHES[name]`` to ``module``; on any failure log one error naming it and leave the module as it is.

    Never raises: it runs inside verl's own import. A patch that failed once is not retried (nor logged again).
    """
    patch = PATCHES[name]
    if name in FAILED:
        return False
    try:
        patch.apply(module)
    except Exception as e:  # noqa: BLE001 - contained: verl's import must go on
        FAILED[name] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        logger.error(
            "rr: verl patch %s (%s) failed, %s is left as verl ships it and %s: %s",
            patch.apply.__name__,
            patch.target,
            name,
            patch.if_failed,
            FAILED[name],
        )
        logger.debug("rr: %s failed", patch.apply.__name__, exc_info=True)
        if patch.fallback is not None:
            apply_guard(
                module, f"rr's patch {patch.apply.__name__} of {patch.target} failed ({FAILED[name]})", patch.fallback
            )
        return False
    return True


def apply_guard(
    module: types.ModuleType, why: str, guard: Callable[[types.ModuleType, str], None] | None = None
) -> bool:
    """Put ``guard`` (default: :func:`guard_engine_workers`) on ``module``, contained like a patch: a failure logs
    one error (rr can then not refuse R2/R3 on FSDP there) and never raises."""
    try:
        (guard or guard_engine_workers)(module, why)
    except Exception as e:  # noqa: BLE001 - contained: verl's import must go on
        logger.error(
            "rr: cannot guard %s (%s: %s): a worker asked for router_replay R2/R3 on FSDP will train "
            "unreplayed, without a word from rr",
            module.__name__,
            type(e).__name__,
            e,
        )
        return False
    return True


# -- verl.workers.engine.fsdp.transformer_impl


def patch_fsdp_engine(mod: types.ModuleType) -> None:
    """Check the shape of what rr's engine overrides, then combine rr's mixin with ``FSDPEngineWithLMHead``.

    Nothing in verl changes here: the worker patch registers the class, and only where rr's FSDP mode is on.
    """
    from verl.workers.engine.base import EngineRegistry

    base = mod.FSDPEngineWithLMHead
    ours = _ENGINES.get("language_model")
    if ours is not None and base in ours.__bases__:
        return
    helpers = [Shape(importlib.import_module(name), fns) for name, fns in HELPER_SHAPES.items()]
    check_shapes(Shape(base, ENGINE_SHAPES), Shape(EngineRegistry, REGISTRY_SHAPES), *helpers, what=_what())
    from ._engine import engine_class

    _ENGINES["language_model"] = engine_class(base)


def rr_engine_class() -> type:
    """rr's engine class (imports verl's FSDP engine module if needed); UnsupportedVersionError when its patch failed."""
    name = ENGINE_MODULE
    importlib.import_module(name)
    ours = _ENGINES.get("language_model")
    if ours is None:
        raise UnsupportedVersionError(
            f"router_replay is on but rr's FSDP engine is not available ({FAILED.get(name, 'its patch did not run')}); "
            f"rr was tested with {WHAT}: set router_replay.mode=disabled or pin a tested verl"
        )
    return ours


def use_rr_engine(strategy: str) -> type:
    """Make verl's ``EngineRegistry`` hand out rr's engine for ``strategy`` on this process's device and vendor.

    Through verl's public ``EngineRegistry.register``: its (device, vendor) key is looked up before the device-only
    key verl registers ``FSDPEngineWithLMHead`` under. Any other engine registered there is refused (rr replays in
    verl's FSDP engine only), never replaced silently.
    """
    from verl.utils.device import get_device_name, get_vendor
    from verl.workers.engine.base import EngineRegistry

    ours = rr_engine_class()
    current = EngineRegistry.get_engine_cls("language_model", strategy)
    if current is ours:
        return ours
    base = ours.__bases__[-1]  # rr's engine is (rr's mixin, verl's engine class)
    device = os.getenv("VERL_ENGINE_DEVICE") or get_device_name()  # verl's own lookup order (get_engine_cls)
    vendor = os.getenv("VERL_ENGINE_VENDOR") or get_vendor()
    if current is not base or not vendor:
        raise ConfigurationError(
            f"router_replay is on with actor.strategy={strategy}, but verl uses {current.__qualname__} on "
            f"device={device!r}, vendor={vendor!r}: rr replays only in verl's {base.__qualname__}; set "
            "router_replay.mode=disabled or use verl's FSDP engine"
        )
    EngineRegistry.register(model_type="language_model", backend=strategy, device=device, vendor=vendor)(ours)
    if EngineRegistry.get_engine_cls("language_model", strategy) is not ours:
        raise UnsupportedVersionError(f"EngineRegistry.register did not make verl pick rr's engine in {WHAT}")
    return ours


# -- verl.workers.engine_workers


def refuse_inactive(config: Any, why: str) -> None:
    """Raise :class:`UnsupportedVersionError` when ``config`` asks for routing replay on FSDP while rr's replay is
    not active in this process (``why``): verl alone maps router_replay to disabled there and trains unreplayed; and
    when it asks verl's Megatron engine for R2/R3 (:func:`refuse_megatron_inactive`: verl's own feeder would run)."""
    megatron = megatron_replay_requested(config)
    if megatron is not None:
        refuse_megatron_inactive(why, megatron)
    asked = replay_requested(config)
    if asked is None:
        return
    raise UnsupportedVersionError(
        f"{asked} (actor.strategy={configured_replay(config)[0]}) asks for routing replay in verl's FSDP actor, but "
        f"rr's FSDP replay is not active in this process: {why}. verl alone would train unreplayed (it maps "
        f"router_replay to disabled on FSDP). Pin verl {TESTED_VERL}, set {OVERRIDE}=1 to patch an untested verl at "
        f"your own risk, or train without replay ({MODE_KEY}=disabled, {ROLLOUT_KEY}=False)"
    )


def inactive_patches(mode: str) -> str | None:
    """Why rr's replay cannot run as asked in this process (the patches it needs that failed), or None.

    Imports the modules of those patches first (each is patched at import): the engine's, and for R3 the tool
    loop's (a failed one would leave multi-turn rows to verl's overwrite). A patch fails the same way in every
    process of one install, so the actor worker's answer holds for the agent-loop workers too.
    """
    needed = [ENGINE_MODULE]
    if mode == "R3":
        try:
            importlib.import_module(TOOL_LOOP_MODULE)
            needed.append(TOOL_LOOP_MODULE)
        except ImportError:  # no tool loop in this verl install: nothing of it can run
            pass
    if ENGINE_MODULE not in FAILED:
        importlib.import_module(ENGINE_MODULE)
    failed = [
        f"rr's patch {PATCHES[n].apply.__name__} of {PATCHES[n].target} failed ({FAILED[n]})"
        for n in needed
        if n in FAILED
    ]
    return "; ".join(failed) or None


def check_megatron_feeder(config: Any) -> None:
    """With Megatron R2/R3 asked for: refuse, before verl builds anything, an untested megatron-core, a CUDA graph
    over the router in verl's transformer-config overrides, and a failed patch of verl's Megatron engine module
    (imported here: it is patched at import)."""
    asked = megatron_replay_requested(config)
    if asked is None:
        return
    from types import SimpleNamespace

    from rr_client.integrations.megatron import REFUSED, check_megatron_version, graphs_router

    check_megatron_version()
    from ._logprobs import ROLLOUT_LOGPROBS, check_rollout_logprobs

    refuse_r2_rollout_rows(config)
    ROLLOUT_LOGPROBS["rollout"] = check_rollout_logprobs(_get(config, "rollout"))
    override = dict(_get(_get(_get(config, "actor"), "megatron"), "override_transformer_config") or {})
    if graphs_router(SimpleNamespace(**override)):
        graph = {k: override[k] for k in ("cuda_graph_impl", "enable_cuda_graph", "cuda_graph_scope") if k in override}
        raise ConfigurationError(
            f"{asked} with actor_rollout_ref.actor.megatron.override_transformer_config {graph}: "
            f"{REFUSED['cuda_graph_impl']}; set cuda_graph_impl=none (or a transformer_engine cuda_graph_scope "
            "without the MoE layer, ['attn'])"
        )
    if MEGATRON_ENGINE_MODULE not in FAILED:
        importlib.import_module(MEGATRON_ENGINE_MODULE)
    if MEGATRON_ENGINE_MODULE in FAILED:
        patch = PATCHES[MEGATRON_ENGINE_MODULE]
        refuse_megatron_inactive(
            f"rr's patch {patch.apply.__name__} of {patch.target} failed ({FAILED[MEGATRON_ENGINE_MODULE]})", asked
        )


def _worker_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: Any, config: Any, role: str, *args: Any, **kwargs: Any) -> None:
        check_megatron_feeder(config)
        mode = worker_replay_mode(config)  # refuses FSDP1 + R2/R3 before verl builds anything
        if mode != "disabled":
            why = inactive_patches(mode)
            if why is not None:
                refuse_inactive(config, why)
            from ._logprobs import ROLLOUT_LOGPROBS, check_rollout_logprobs

            ROLLOUT_LOGPROBS["rollout"] = check_rollout_logprobs(_get(config, "rollout"))
        orig(self, config, role, *args, **kwargs)
        if mode != "disabled":
            use_rr_engine(configured_replay(config)[0])
            self.enable_routing_replay = True

    return __init__


def patch_engine_workers(mod: types.ModuleType) -> None:
    """``ActorRolloutRefWorker.__init__``: verl enables routing replay only for megatron/veomni; with
    ``actor.strategy=fsdp2`` and ``fsdp_config.router_replay.mode`` R2/R3 rr's engine replays it. Every other
    strategy, and the disabled mode, run verl's ``__init__`` unchanged."""
    wrap_once(mod.ActorRolloutRefWorker, "__init__", _worker_init, params=WORKER_INIT, what=_what())


def _guarded_init(why: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def wrap(orig: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(orig)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            config = kwargs["config"] if "config" in kwargs else (args[0] if args else None)
            refuse_inactive(config, why)
            orig(self, *args, **kwargs)

        return __init__

    return wrap


def guard_engine_workers(mod: types.ModuleType, why: str) -> None:
    """Where rr's replay is not active (``why``: an untested verl, the worker patch failed): wrap
    ``ActorRolloutRefWorker.__init__`` whatever its parameters (the config is its ``config`` argument or first
    one), only to refuse R2/R3 on FSDP (:func:`refuse_inactive`); every other config runs verl's ``__init__``."""
    wrap_once(mod.ActorRolloutRefWorker, "__init__", _guarded_init(why), what=f"verl (guard: {why})")


# -- verl.workers.fsdp_workers (verl 0.5-0.7: the legacy FSDP worker)


def legacy_replay_requested(config: Any) -> str | None:
    """What in a legacy FSDP worker's ``actor_rollout_ref`` config asks for routing replay: rr's switch, verl 0.7's
    own ``actor.router_replay.mode`` R2/R3 (which only its Megatron worker reads) or the rollout's rows
    (:func:`replay_requested`); None when nothing does or the strategy is not FSDP."""
    return replay_requested(config)


def refuse_legacy_worker(config: Any) -> None:
    """Raise :class:`UnsupportedVersionError` when ``config`` asks verl's legacy FSDP worker for routing replay: the
    worker has none and rr does not replay in it, so it would train unreplayed, without a word from verl."""
    asked = legacy_replay_requested(config)
    if asked is None:
        return
    found = installed_verl_version() or "(version unknown)"
    raise UnsupportedVersionError(
        f"{asked} (actor.strategy={configured_replay(config)[0]}) reached verl's legacy FSDP worker "
        f"({LEGACY_WORKERS_MODULE}.ActorRolloutRefWorker; verl {found} is installed), which verl 0.5-0.7's main_ppo "
        f"runs for fsdp/fsdp2 (0.5 and 0.6 always, 0.7 unless {LEGACY_SWITCH}=disable): it has no routing replay "
        f"and rr does not replay in it, so it would train unreplayed. rr replays only in verl's engine worker "
        f"(verl.workers.engine_workers) of verl {TESTED_VERL}, where the legacy worker is gone: upgrade verl to "
        f"{TESTED_VERL} ({LEGACY_SWITCH}=disable selects verl 0.7's engine worker, which rr refuses too: an "
        f"untested release its patch does not fit), or train without replay ({MODE_KEY}=disabled, "
        f"{ROLLOUT_KEY}=False, {VERL_ACTOR_MODE_KEY}=disabled)",
        package="verl",
        version="" if found.startswith("(") else found,
        tested=str(TESTED_VERL),
    )


def _legacy_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse_legacy_worker(kwargs["config"] if "config" in kwargs else (args[0] if args else None))
        orig(self, *args, **kwargs)

    return __init__


def guard_legacy_workers(mod: types.ModuleType, why: str = "") -> None:
    """``ActorRolloutRefWorker.__init__`` of verl's legacy ``fsdp_workers`` (its ``AsyncActorRolloutRefWorker``
    inherits it), whatever its parameters (the config is its ``config`` argument or first one): a config asking for
    routing replay on FSDP is refused (:func:`refuse_legacy_worker`); every other config runs verl's ``__init__``.
    Applied on every verl release that has the module, rr's replay active or not (``why`` is not needed)."""
    wrap_once(mod.ActorRolloutRefWorker, "__init__", _legacy_init, what="verl's legacy FSDP worker (rr's guard)")


def apply_legacy_guard(module: types.ModuleType) -> bool:
    """:func:`guard_legacy_workers` on ``module``, contained (:func:`apply_guard`): never raises out of verl's
    import; a failure logs one error."""
    return apply_guard(module, "verl's legacy FSDP worker has no routing replay", guard_legacy_workers)


# -- verl.experimental.agent_loop.tool_agent_loop


def _tool_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    from ._rows import accumulate_turn_rows

    @functools.wraps(orig)
    async def _handle_generating_state(self: Any, agent_data: Any, *args: Any, **kwargs: Any) -> Any:
        arr = _get(getattr(self, "config", None), "actor_rollout_ref")
        if not fsdp_replay_on(arr) and megatron_replay_requested(arr) != f"{MEGATRON_MODE_KEY}=R3":
            return await orig(self, agent_data, *args, **kwargs)
        held = agent_data.routed_experts
        try:
            return await orig(self, agent_data, *args, **kwargs)
        finally:
            if held is not None and agent_data.routed_experts is not held:
                agent_data.routed_experts = accumulate_turn_rows(held, agent_data.routed_experts)

    return _handle_generating_state


def patch_tool_agent_loop(mod: types.ModuleType) -> None:
    """``ToolAgentLoop._handle_generating_state``: verl overwrites the rows with each turn's (verl #5825, #6054);
    with rr's FSDP replay or verl Megatron R3 (rr's feeder) on, the rows already held are kept.

    The loop sees the whole trainer config (``AgentLoopBase.config``), so it acts only where rr replays:
    ``actor_rollout_ref.actor.strategy=fsdp2`` with ``fsdp_config.router_replay.mode`` R2/R3, or
    ``strategy=megatron`` with ``megatron.router_replay.mode=R3`` (R2 replays no rollout rows). For veomni or the
    disabled mode verl's own step runs, unchanged.
    """
    wrap_once(mod.ToolAgentLoop, "_handle_generating_state", _tool_step, params=TOOL_STEP, what=_what())


# -- verl.workers.rollout.sglang_rollout.async_sglang_server

_CAPTURER = "sglang.srt.layers.moe.routed_experts_capturer"  # the module verl's tokenizer branch imports
_SHIM = "__rr_shim__"


def _dims(hf_config: Any) -> dict[str, Any]:
    from rr_client.core.info import RRInfo

    info = RRInfo.from_hf_config(hf_config.to_dict(), engine="sglang", engine_version="")
    return dict(
        num_layers=info.num_hidden_layers, topk=info.topk, num_experts=info.num_experts, moe_layers=info.moe_layers
    )


def checked_meta_routing(output: dict[str, Any], prompt_len: int | None, hf_config: Any) -> None:
    """Replace ``output["meta_info"]["routed_experts"]`` (any SGLang format) by rr's checked int32 tensor."""
    import numpy as np
    import torch

    from rr_client.core.codec import decode_meta_info

    meta = output.get("meta_info")
    if not isinstance(meta, dict) or "routed_experts" not in meta or isinstance(meta.get("routed_experts"), _Checked):
        return
    rows = None
    out_ids = output.get("output_ids")
    if prompt_len is not None and out_ids is not None:
        rows = prompt_len + len(out_ids) - 1
    arr = decode_meta_info(meta, rows=rows, **_dims(hf_config))
    meta["routed_experts"] = _Checked(torch.from_numpy(arr.astype(np.int32)))


class _Checked:
    """rr-checked routing in the place verl reads SGLang's: ``.numpy()`` (verl's skip_tokenizer_init branch)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def numpy(self) -> Any:
        return self.tensor.numpy()


def _sglang_capturer_present() -> bool:
    """Whether SGLang's own module is at the path verl's tokenizer branch imports (moved in SGLang 0.5.12)."""
    mod = sys.modules.get(_CAPTURER)
    if mod is not None:
        return not getattr(mod, _SHIM, False)
    try:
        importlib.import_module(_CAPTURER)
    except ImportError:
        return False
    return True


def verl_reads(output: Mapping[str, Any], skip_tokenizer_init: bool) -> bool:
    """Whether verl's own read of this SGLang output works: its skip_tokenizer_init branch calls ``.numpy()`` on
    ``meta_info.routed_experts`` (a tensor before SGLang 0.5.11, a base64 string after); its tokenizer branch
    imports SGLang's ``extract_routed_experts_from_meta_info`` from a module SGLang 0.5.12 moved."""
    if not skip_tokenizer_init:
        return _sglang_capturer_present()
    meta = output.get("meta_info")
    routing = meta.get("routed_experts") if isinstance(meta, Mapping) else None
    return routing is None or (hasattr(routing, "numpy") and not isinstance(routing, (str, bytes, Mapping)))


class _CheckingTokenizerManager:
    """SGLang's ``TokenizerManager`` as verl's server holds it; ``generate_request`` outputs verl's own read would
    crash on leave decoded and checked by rr, every other output unchanged. Attributes pass through both ways."""

    _OWN = ("_rr_inner", "_rr_hf_config", "_rr_skip")

    def __init__(self, inner: Any, hf_config: Any, skip_tokenizer_init: bool) -> None:
        object.__setattr__(self, "_rr_inner", inner)
        object.__setattr__(self, "_rr_hf_config", hf_config)
        object.__setattr__(self, "_rr_skip", skip_tokenizer_init)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rr_inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. verl's ``tokenizer_manager.server_status = ...``
            setattr(self._rr_inner, name, value)

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        ids = getattr(obj, "input_ids", None)
        prompt_len = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], int) else None
        async for out in self._rr_inner.generate_request(obj, request):
            if (
                getattr(obj, "return_routed_experts", False)
                and isinstance(out, dict)
                and not verl_reads(out, self._rr_skip)
            ):
                checked_meta_routing(out, prompt_len, self._rr_hf_config)
            yield out


def _extract_shim() -> Any:
    """What verl's tokenizer branch imports, where SGLang no longer has it: rr's checked rows."""

    def extract_routed_experts_from_meta_info(output: Any) -> Any:
        re = output.get("meta_info", {}).get("routed_experts")
        if isinstance(re, _Checked):
            return re.numpy()
        raise ImportError(f"{_CAPTURER} is gone in this SGLang and rr did not check this output")

    return extract_routed_experts_from_meta_info


def _install_extract_shim() -> None:
    """Put rr's stand-in at the module path verl imports, only where SGLang has no module there (>= 0.5.12)."""
    if _sglang_capturer_present():
        return
    m = sys.modules.get(_CAPTURER)
    if m is None:
        m = types.ModuleType(_CAPTURER)
        m.__doc__ = "rr shim: verl imports this path; SGLang >= 0.5.12 moved the module to sglang.srt.state_capturer"
        setattr(m, _SHIM, True)
        m.extract_routed_experts_from_meta_info = _extract_shim()  # type: ignore[attr-defined]
        sys.modules[_CAPTURER] = m


def _sglang_generate(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = self.config
        if getattr(cfg, "enable_rollout_routing_replay", False):
            skip = bool(getattr(cfg, "skip_tokenizer_init", False))
            if not skip:
                _install_extract_shim()
            tm = getattr(self, "tokenizer_manager", None)
            if tm is not None and not isinstance(tm, _CheckingTokenizerManager):
                self.tokenizer_manager = _CheckingTokenizerManager(tm, self.model_config.hf_config, skip)
        return await orig(self, *args, **kwargs)

    return generate


def patch_sglang_server(mod: types.ModuleType) -> None:
    """``SGLangHttpServer.generate``: verl's routing read broke on SGLang 0.5.11 (base64) and 0.5.12 (moved module).

    The server cannot know the actor strategy: it is a Ray actor built from ``actor_rollout_ref.rollout``
    (``RolloutConfig``: no actor, no ``router_replay``) and the HF config. So it decides from what it sees: with
    ``rollout.enable_rollout_routing_replay`` off nothing changes; with it on, every output verl's own read can
    read (a tensor payload of SGLang < 0.5.11, SGLang's own extract function) goes to verl's read unchanged, for
    every strategy; rr decodes and checks only the outputs verl's read would crash on (base64 string, SGLang
    0.5.7-0.5.9's ``{}``, the moved module). For Megatron that replaces verl's crash, nothing verl could read.
    """
    wrap_once(mod.SGLangHttpServer, "generate", _sglang_generate, params=SGLANG_GENERATE, what=_what())


def patch_megatron_engine(mod: types.ModuleType) -> None:
    """verl's Megatron engine on rr (:mod:`._megatron_feed`, :mod:`._megatron`): ``set_router_replay_data`` as the
    engine calls it (its module's own name) becomes rr's feeder; ``MegatronEngine.initialize`` refuses, with R2/R3,
    what the feeder would not hold under; ``forward_step`` runs the stale-rows policy on each micro-batch;
    ``forward_backward_batch`` reports the step's counts and audit. Every shape is checked before anything is
    wrapped."""
    from ._megatron import clocked_train_mode, counted_batch, gapped_outputs, policed_step, refusing_initialize
    from ._megatron_feed import rr_feeder

    check_shapes(
        Shape(mod, {"set_router_replay_data": MEGATRON_FEEDER}),
        Shape(
            mod.MegatronEngine,
            {"initialize": ["self"], "forward_backward_batch": MEGATRON_BATCH, "train_mode": ["self", "kwargs"]},
        ),
        Shape(
            mod.MegatronEngineWithLMHead,
            {"forward_step": MEGATRON_STEP, "prepare_model_outputs": MEGATRON_OUTPUTS},
        ),
        what=_what(),
    )
    wrap_once(mod, "set_router_replay_data", rr_feeder, params=MEGATRON_FEEDER, what=_what())
    wrap_once(mod.MegatronEngine, "initialize", refusing_initialize, params=["self"], what=_what())
    wrap_once(mod.MegatronEngineWithLMHead, "forward_step", policed_step, params=MEGATRON_STEP, what=_what())
    wrap_once(
        mod.MegatronEngineWithLMHead, "prepare_model_outputs", gapped_outputs, params=MEGATRON_OUTPUTS, what=_what()
    )
    wrap_once(mod.MegatronEngine, "forward_backward_batch", counted_batch, params=MEGATRON_BATCH, what=_what())
    wrap_once(mod.MegatronEngine, "train_mode", clocked_train_mode, params=["self", "kwargs"], what=_what())


def megatron_replay_requested(config: Any) -> str | None:
    """``actor_rollout_ref.actor.megatron.router_replay.mode=<R2|R3>`` when a worker's ``actor_rollout_ref`` config
    asks verl's Megatron engine for routing replay; None otherwise."""
    actor = _get(config, "actor")
    if str(_get(actor, "strategy") or "") != "megatron":
        return None
    mode = _get(_get(_get(actor, "megatron"), "router_replay"), "mode")
    return f"{MEGATRON_MODE_KEY}={mode}" if str(mode) in REPLAY_MODES else None


def refuse_r2_rollout_rows(actor_rollout_ref: Any) -> None:
    """Raise :class:`ConfigurationError` for Megatron ``router_replay.mode=R2`` with the rollout's rows on: verl's
    ``compute_log_prob`` then skips its R2 record (the batch already carries ``routed_experts``) and the update
    replays the rollout's rows as R2, with no stale-rows policy, no replay mask and no audit."""
    asked = megatron_replay_requested(actor_rollout_ref)
    if asked != f"{MEGATRON_MODE_KEY}=R2" or not bool(
        _get(_get(actor_rollout_ref, "rollout"), "enable_rollout_routing_replay")
    ):
        return
    raise ConfigurationError(
        f"{asked} with {ROLLOUT_KEY}=True: verl's R2 update would replay the rollout's rows (compute_log_prob skips "
        "its record when the batch carries them) with no stale-rows policy and no audit; to replay the rollout's "
        f"routing set {MEGATRON_MODE_KEY}=R3, to replay the trainer's own recorded routing (R2) set {ROLLOUT_KEY}=False"
    )


def refuse_megatron_inactive(why: str, asked: str) -> None:
    """Raise :class:`UnsupportedVersionError`: ``asked`` (Megatron R2/R3) while rr's feeder is not active (``why``),
    so verl's own, unchecked feeder would run in its place."""
    raise UnsupportedVersionError(
        f"{asked} asks for routing replay on verl's Megatron engine, but rr's feeder is not active in this "
        f"process: {why}. verl's own feeder would replay in its place, unchecked. Pin verl {TESTED_VERL}, set "
        f"{OVERRIDE}=1 to patch an untested verl at your own risk, or train without replay "
        f"({MEGATRON_MODE_KEY}=disabled)"
    )


def _guard_megatron_initialize(orig: Callable[..., Any], why: str) -> Callable[..., Any]:
    @functools.wraps(orig)
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = str(getattr(getattr(getattr(self, "engine_config", None), "router_replay", None), "mode", ""))
        if mode in REPLAY_MODES:
            refuse_megatron_inactive(why, f"{MEGATRON_MODE_KEY}={mode}")
        return orig(self, *args, **kwargs)

    return initialize


def guard_megatron_engine(mod: types.ModuleType, why: str) -> None:
    """Where rr's feeder is not active on verl's Megatron engine (``why``: its patch failed): ``MegatronEngine.
    initialize``, whatever its parameters, refuses R2/R3 (:func:`refuse_megatron_inactive`)."""
    wrap_once(
        mod.MegatronEngine,
        "initialize",
        lambda orig: _guard_megatron_initialize(orig, why),
        what=f"verl's Megatron engine (guard: {why})",
    )


PATCHES: dict[str, Patch] = {
    ENGINE_MODULE: Patch(
        "FSDPEngineWithLMHead", patch_fsdp_engine, "router_replay R2/R3 on FSDP is refused at worker start"
    ),
    WORKERS_MODULE: Patch(
        "ActorRolloutRefWorker.__init__",
        patch_engine_workers,
        "rr's FSDP replay is off: a worker asked for router_replay R2/R3 on FSDP refuses to start",
        guard_engine_workers,
    ),
    TOOL_LOOP_MODULE: Patch(
        "ToolAgentLoop._handle_generating_state",
        patch_tool_agent_loop,
        "multi-turn routing rows would be verl's own (each turn overwrites the earlier ones): a worker asked for "
        "R3 on FSDP refuses to start",
    ),
    MEGATRON_ENGINE_MODULE: Patch(
        "set_router_replay_data",
        patch_megatron_engine,
        "rr's feeder is off: a Megatron engine asked for router_replay R2/R3 refuses to start",
        guard_megatron_engine,
    ),
    "verl.workers.rollout.sglang_rollout.async_sglang_server": Patch(
        "SGLangHttpServer.generate", patch_sglang_server, "verl reads SGLang's routing itself, unchecked"
    ),
}
