"""Check that SGLang's code has the shape rr wraps, then install the hooks (directly, or via HookRegistry)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from rr_client.core.patching import MARKER, Shape, check_shapes, wrap_once
from rr_patches.sglang.batch_items import apply_item_start_fix
from rr_patches.sglang.hooks import around_handle_batch_output, around_init, around_send
from rr_server.serving.engines import ReleaseFacts
from rr_server.serving.engines.sglang import UnsupportedSGLangError, profile_for

__all__ = ["TARGETS", "TM_PATH", "apply", "check_sglang_shapes", "is_applied", "install_for_launcher", "wrap_hook"]

logger = logging.getLogger("rr.sglang")
TM_PATH = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
# method of TokenizerManager -> AROUND hook
TARGETS: dict[str, Callable[..., Any]] = {
    "__init__": around_init,
    "_send_one_request": around_send,
    "_send_batch_request": around_send,
    "_handle_batch_output": around_handle_batch_output,
}
_SEND_ONE_SHAPES = (["self", "obj", "tokenized_obj", "created_time"], ["self", "tokenized_obj"])
# method -> the parameter names (or accepted lists) rr wraps; None: any (the hook passes every argument on)
_PARAMS: dict[str, list[str] | Sequence[list[str]] | None] = {
    "__init__": None,
    "_send_one_request": _SEND_ONE_SHAPES,
    "_send_batch_request": None,
    "_handle_batch_output": ["self", "recv_obj"],
}


def _refusal(version: str) -> Callable[[str], UnsupportedSGLangError]:
    """The error :func:`rr_client.core.patching.check_shapes` raises for SGLang ``version``: UnsupportedSGLangError
    (what the launcher and SGLang's plugin loader report)."""
    return functools.partial(UnsupportedSGLangError, package="sglang", version=version)


def check_sglang_shapes(profile: ReleaseFacts) -> None:
    """Refuse (UnsupportedSGLangError naming every difference) unless each function and field rr relies on has
    the shape :func:`rr_client.core.patching.check_shapes` is told here.

    The full pre-check, run before anything is patched (directly or through HookRegistry); :func:`wrap_hook`
    checks each wrapped signature again as it wraps.
    """
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager

    routing = (profile.field, "prompt_tokens", "completion_tokens")
    check_shapes(
        Shape(
            TokenizerManager,
            {name: _PARAMS[name] for name in TARGETS},
            coroutines={"_handle_batch_output": profile.handle_is_async},
        ),
        Shape(io_struct.BatchTokenIDOutput, fields=routing),
        Shape(io_struct.BatchStrOutput, fields=routing),
        Shape(io_struct.TokenizedGenerateReqInput, fields=("return_routed_experts",)),
        Shape(ReqState, fields=("out_list",)),
        what=f"SGLang {profile.version}",
        error=_refusal(profile.version),
    )


def _around(hook: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrapper factory for :func:`rr_client.core.patching.wrap_once`: HookRegistry's AROUND call shape, and
    ``async def`` originals stay coroutine functions."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def awrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                return await hook(original, self, *args, **kwargs)

            return awrapper

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, self, *args, **kwargs)

        return wrapper

    return factory


def wrap_hook(
    owner: type,
    name: str,
    hook: Callable[..., Any],
    *,
    version: str,
    params: list[str] | Sequence[list[str]] | None = None,
) -> bool:
    """Install ``hook`` AROUND ``owner.name`` once (:func:`rr_client.core.patching.wrap_once`); True when wrapped now.

    A missing method or one of another shape is UnsupportedSGLangError (what the launcher and SGLang's plugin
    loader report), and nothing is changed.
    """
    return wrap_once(owner, name, _around(hook), params=params, what=f"SGLang {version}", error=_refusal(version))


def is_applied() -> bool:
    """True when TokenizerManager already carries every rr hook (by this module or by HookRegistry)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        via_registry = {t.rsplit(".", 1)[1] for t in HookRegistry._patched if t.startswith(TM_PATH + ".")}
    except ImportError:  # < 0.5.11: no plugin system
        via_registry = set()

    def hooked(name: str) -> bool:
        fn = TokenizerManager.__dict__.get(name)
        while fn is not None:
            if getattr(fn, MARKER, None) is not None:
                return True
            fn = getattr(fn, "__wrapped__", None)
        return name in via_registry

    return all(hooked(name) for name in TARGETS)


def apply(profile: ReleaseFacts | None = None) -> ReleaseFacts:
    """Monkeypatch TokenizerManager in this process (idempotent); the launcher's path on 0.5.7-0.5.10."""
    profile = profile or profile_for()
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    apply_item_start_fix(profile)
    _apply_detokenizer(profile)
    if is_applied():
        return profile
    check_sglang_shapes(profile)
    for name, hook in TARGETS.items():
        wrap_hook(TokenizerManager, name, hook, version=profile.version, params=_PARAMS[name])
    logger.info("rr: patched SGLang %s TokenizerManager (%s)", profile.version, ", ".join(TARGETS))
    return profile


def _apply_detokenizer(profile: ReleaseFacts) -> None:
    """0.5.22+: the detokenizer encodes rr's compact payload (see :mod:`rr_patches.sglang.detok`); idempotent."""
    if not profile.detok_encodes:
        return
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    from rr_patches.sglang.detok import DETOK_METHOD, around_handle_batch_token_id_out

    wrap_hook(
        DetokenizerManager,
        DETOK_METHOD,
        around_handle_batch_token_id_out,
        version=profile.version,
        params=["self", "recv_obj"],
    )


def install_for_launcher() -> str:
    """``rr-server launch sglang``'s way in (entry point ``rr.launch_patches: sglang``); returns how it patched.

    SGLang's own plugin loader on 0.5.11+ (``SGLANG_PLUGINS`` gains ``rr`` when it is set without it), a direct
    monkeypatch before. Raises UnsupportedSGLangError on an untested version.
    """
    profile = profile_for()
    if profile.has_plugins:
        allowed = os.environ.get("SGLANG_PLUGINS", "")
        if allowed and "rr" not in {p.strip() for p in allowed.split(",")}:
            os.environ["SGLANG_PLUGINS"] = allowed + ",rr"
        from sglang.srt.plugins import load_plugins

        load_plugins()
        if is_applied():
            return f"plugin (SGLang {profile.version})"
        logger.warning("rr: the 'rr' plugin entry point was not loaded; patching directly")
    apply(profile)
    return f"monkeypatch (SGLang {profile.version})"
