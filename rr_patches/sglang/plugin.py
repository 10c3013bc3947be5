"""SGLang general plugin (entry point ``sglang.srt.plugins: rr``): registers rr's hooks through HookRegistry."""

from __future__ import annotations

import logging
import multiprocessing

from rr_patches.sglang.apply import TARGETS, TM_PATH, apply, check_sglang_shapes
from rr_patches.sglang.batch_items import apply_item_start_fix
from rr_server.serving.engines.sglang import profile_for

__all__ = ["register"]

logger = logging.getLogger("rr.sglang")
_registered = False


def register() -> None:
    """Called by SGLang's ``load_plugins()`` in every process; hooks the TokenizerManager of the main one.

    Refuses (raises UnsupportedSGLangError, which SGLang logs with its traceback) on a version or code
    shape rr was not tested against. Before 0.5.11 there is no plugin system: patches directly.
    """
    global _registered
    if _registered:
        return
    if multiprocessing.current_process().name != "MainProcess":
        _register_detokenizer()  # 0.5.22+: the detokenizer encodes rr's compact payload; schedulers: nothing
        return
    profile = profile_for()
    if not profile.has_plugins:
        apply(profile)
        _registered = True
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_sglang_shapes(profile)
    apply_item_start_fix(profile)  # 0.5.11: batch items lose routed_experts_start_len (no HookRegistry target)
    for name, hook in TARGETS.items():
        HookRegistry.register(f"{TM_PATH}.{name}", hook, HookType.AROUND)
    _registered = True
    logger.info("rr: registered SGLang %s hooks on %s", profile.version, ", ".join(TARGETS))


def _register_detokenizer() -> None:
    """In a non-main process of SGLang 0.5.22+: hook the detokenizer's output (harmless in a scheduler)."""
    global _registered
    profile = profile_for()
    if not profile.detok_encodes:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from rr_patches.sglang.detok import (
        DETOK_METHOD,
        DETOK_PATH,
        around_handle_batch_token_id_out,
    )

    HookRegistry.register(f"{DETOK_PATH}.{DETOK_METHOD}", around_handle_batch_token_id_out, HookType.AROUND)
    _registered = True
    logger.info("rr: SGLang %s: the detokenizer encodes rr's compact routing", profile.version)
