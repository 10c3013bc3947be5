"""What rr changes in verl, one function per verl module, each applied when that module is imported.

- ``verl.workers.engine.fsdp.transformer_impl``: the FSDP actor engine in verl's registry becomes rr's subclass.
- ``verl.workers.engine_workers``: the worker stops forcing ``router_replay`` to "disabled" for FSDP strategies.
- ``verl.experimental.agent_loop.tool_agent_loop``: a turn adds only the rows the trajectory did not hold.
- ``verl.workers.rollout.sglang_rollout.async_sglang_server``: SGLang's ``meta_info.routed_experts`` (a tensor
  before 0.5.11, base64 after, rr's ``.npy`` with the rr patch) is decoded and checked by rr before verl reads it.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any

logger = logging.getLogger("rr_client.integrations.verl")

FSDP_STRATEGIES = ("fsdp", "fsdp2")
_DONE = "__rr_patched__"


def _patched(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` is rr's wrapper already (re-entrant installs patch nothing twice)."""
    return bool(getattr(getattr(obj, name), _DONE, False))


def _mark(fn: Any) -> Any:
    """Tag ``fn`` as rr's wrapper (see :func:`_patched`)."""
    setattr(fn, _DONE, True)
    return fn


def patch_engine_registry(mod: types.ModuleType) -> None:
    """Swap verl's ``FSDPEngineWithLMHead`` for rr's subclass under every (backend, device) it is registered for."""
    from verl.workers.engine.base import EngineRegistry

    from ._engine import make_engine_class

    base = mod.FSDPEngineWithLMHead
    if getattr(mod, "RRFSDPEngineWithLMHead", None) is None:
        mod.RRFSDPEngineWithLMHead = make_engine_class(base)  # type: ignore[attr-defined]
    ours = mod.RRFSDPEngineWithLMHead
    for backend in FSDP_STRATEGIES:
        registry = EngineRegistry._engines.get("language_model", {}).get(backend, {})
        for key, cls in list(registry.items()):
            if cls is base:
                registry[key] = ours


def worker_replay_mode(config: Any) -> str:
    """``actor.fsdp_config.router_replay.mode`` of a worker's omegaconf config, for the FSDP strategies."""
    actor = config.get("actor", None) if hasattr(config, "get") else None
    if actor is None or actor.get("strategy", None) not in FSDP_STRATEGIES:
        return "disabled"
    fsdp = actor.get("fsdp_config", None) or {}
    rr = fsdp.get("router_replay", None) or {}
    return str(rr.get("mode", "disabled") or "disabled")


def patch_engine_workers(mod: types.ModuleType) -> None:
    """verl sets ``enable_routing_replay`` only for megatron/veomni; rr's engine replays FSDP too."""
    cls = mod.ActorRolloutRefWorker
    if _patched(cls, "__init__"):
        return
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self: Any, config: Any, role: str, *args: Any, **kwargs: Any) -> None:
        orig(self, config, role, *args, **kwargs)
        mode = worker_replay_mode(self.config)
        if mode != "disabled":
            self.enable_routing_replay = True

    cls.__init__ = _mark(__init__)


def patch_tool_agent_loop(mod: types.ModuleType) -> None:
    """verl's ``ToolAgentLoop`` overwrites the rows with each turn's (verl #5825, #6054); keep the held ones."""
    from ._rows import accumulate_turn_rows

    cls = mod.ToolAgentLoop
    if _patched(cls, "_handle_generating_state"):
        return
    orig = cls._handle_generating_state

    @functools.wraps(orig)
    async def _handle_generating_state(self: Any, agent_data: Any, *args: Any, **kwargs: Any) -> Any:
        held = agent_data.routed_experts
        try:
            return await orig(self, agent_data, *args, **kwargs)
        finally:
            if held is not None and agent_data.routed_experts is not held:
                agent_data.routed_experts = accumulate_turn_rows(held, agent_data.routed_experts)

    cls._handle_generating_state = _mark(_handle_generating_state)


def _dims(hf_config: Any) -> dict[str, Any]:
    from rr_client.info import RRInfo

    info = RRInfo.from_hf_config(hf_config.to_dict(), engine="sglang", engine_version="")
    return dict(num_layers=info.num_hidden_layers, topk=info.topk, num_experts=info.num_experts,
                moe_layers=info.moe_layers)


def checked_meta_routing(output: dict[str, Any], prompt_len: int | None, hf_config: Any) -> None:
    """Replace ``output["meta_info"]["routed_experts"]`` (any SGLang format) by rr's checked int32 tensor."""
    import numpy as np
    import torch

    from rr_client.codec import decode_meta_info

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


class _CheckingTokenizerManager:
    """SGLang's ``TokenizerManager`` as verl's server holds it; ``generate_request`` outputs leave checked."""

    def __init__(self, inner: Any, hf_config: Any) -> None:
        self._rr_inner = inner
        self._rr_hf_config = hf_config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rr_inner, name)

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        ids = getattr(obj, "input_ids", None)
        prompt_len = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], int) else None
        async for out in self._rr_inner.generate_request(obj, request):
            if getattr(obj, "return_routed_experts", False) and isinstance(out, dict):
                checked_meta_routing(out, prompt_len, self._rr_hf_config)
            yield out


def _extract_shim(orig: Any) -> Any:
    """verl's other branch calls SGLang's ``extract_routed_experts_from_meta_info``: read rr's checked rows."""

    def extract_routed_experts_from_meta_info(output: Any) -> Any:
        re = output.get("meta_info", {}).get("routed_experts")
        if isinstance(re, _Checked):
            return re.numpy()
        if orig is None:
            raise ImportError("sglang.srt.layers.moe.routed_experts_capturer is gone in this SGLang and rr did not "
                              "check this output")
        return orig(output)

    return _mark(extract_routed_experts_from_meta_info)


def _install_extract_shim() -> None:
    name = "sglang.srt.layers.moe.routed_experts_capturer"
    try:
        import importlib

        m = importlib.import_module(name)
    except ImportError:  # SGLang 0.5.23 moved it to sglang.srt.state_capturer.routed_experts
        m = types.ModuleType(name)
        m.__doc__ = "rr shim: verl imports this path; SGLang >= 0.5.23 moved the module"
        sys.modules[name] = m
    orig = getattr(m, "extract_routed_experts_from_meta_info", None)
    if orig is None or not getattr(orig, _DONE, False):
        m.extract_routed_experts_from_meta_info = _extract_shim(orig)  # type: ignore[attr-defined]


def patch_sglang_server(mod: types.ModuleType) -> None:
    """verl's ``SGLangHttpServer.generate`` reads routing that broke on SGLang 0.5.11 (base64) and 0.5.23 (moved)."""
    cls = mod.SGLangHttpServer
    if _patched(cls, "generate"):
        return
    orig = cls.generate
    _install_extract_shim()

    @functools.wraps(orig)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        tm = getattr(self, "tokenizer_manager", None)
        if tm is not None and not isinstance(tm, _CheckingTokenizerManager) and self.config.enable_rollout_routing_replay:
            self.tokenizer_manager = _CheckingTokenizerManager(tm, self.model_config.hf_config)
        return await orig(self, *args, **kwargs)

    cls.generate = _mark(generate)


PATCHES = {
    "verl.workers.engine.fsdp.transformer_impl": patch_engine_registry,
    "verl.workers.engine_workers": patch_engine_workers,
    "verl.experimental.agent_loop.tool_agent_loop": patch_tool_agent_loop,
    "verl.workers.rollout.sglang_rollout.async_sglang_server": patch_sglang_server,
}
