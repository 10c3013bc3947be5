"""vLLM general plugin: adds rr's ``POST /generate`` and ``GET /rr/info`` to vLLM's own API server.

Why a plugin: vLLM calls every ``vllm.general_plugins`` entry point in each of its
processes, so installing rr needs no fork and no extra network hop. ``register()`` is a
no-op unless ``RR_ENABLE=1`` (set by ``rr-server launch vllm``); it is re-entrant, touches
only the API-server process, and refuses vLLM versions whose layout it has not been
checked against.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from rr_client.core import settings
from rr_client.core.patching import wrap_once
from rr_server.serving.engines.vllm import SUPPORTED, UnsupportedVLLMVersion, check_vllm_version, facts_for

__all__ = ["register", "SUPPORTED", "check_vllm_version", "UnsupportedVLLMVersion", "uses_endpoint_plugin"]

logger = logging.getLogger("rr.vllm")

ENDPOINT_GROUP = "vllm.endpoint_plugins"
PLUGIN_NAME = "rr"
# Where build_app is looked up at call time, newest layout first (module, attribute).
_HOOK_SITES: tuple[tuple[str, str], ...] = (
    ("vllm.entrypoints.launchers.api_server.entry", "build_app"),  # 0.29-0.33 (from launchers/app.py)
    ("vllm.entrypoints.openai.api_server", "build_app"),  # <= 0.28 (defines and calls it)
)
_state: dict[str, Any] = {"registered": False}


def _wrap_build_app(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's build_app so the returned FastAPI app also carries rr's routes."""

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = orig(*args, **kwargs)
        from rr_patches.vllm.routes import install_routes

        install_routes(app, kwargs.get("args", args[0] if args else None))
        return app

    build_app.__wrapped__ = orig  # type: ignore[attr-defined]
    build_app.__name__ = getattr(orig, "__name__", "build_app")
    build_app.__doc__ = getattr(orig, "__doc__", None)
    return build_app


def _patch(mod: Any, attr: str, version: str = "") -> bool:
    """Wrap ``mod.attr`` (a build_app) once (:func:`rr_client.core.patching.wrap_once`); True if it is (now) patched.

    build_app must take ``args`` first (later parameters vary between releases) and return the app; any other
    shape is UnsupportedVLLMVersion naming the vLLM ``version``, and nothing is changed.
    """
    if getattr(mod, attr, None) is None:
        return False
    wrap_once(
        mod, attr, _wrap_build_app, params=["args", ...], what=f"vLLM {version}".strip(), error=UnsupportedVLLMVersion
    )
    return True


def _install_hooks(*, import_missing: bool, version: str = "") -> list[str]:
    """Patch every known build_app site that exists; return the patched sites.

    With ``python -m vllm.entrypoints.openai.api_server`` that module is ``__main__`` (and, up to
    0.28, defines build_app itself), so it is patched there and never imported a second time.
    """
    patched: list[str] = []
    main = sys.modules.get("__main__")
    main_name = getattr(getattr(main, "__spec__", None), "name", None)
    for mod_name, attr in _HOOK_SITES:
        if mod_name == main_name:
            if _patch(main, attr, version):
                patched.append(f"__main__({mod_name}).{attr}")
            continue
        if not import_missing and mod_name not in sys.modules:
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a layout that does not exist in this version
            continue
        if _patch(mod, attr, version):
            patched.append(f"{mod_name}.{attr}")
    return patched


def _vllm_has_endpoint_group() -> bool:
    """True on vLLMs (0.30+) that load ``vllm.endpoint_plugins`` in the API server."""
    try:
        plugins = importlib.import_module("vllm.plugins")
    except ImportError:
        return False
    return getattr(plugins, "ENDPOINT_PLUGINS_GROUP", None) == ENDPOINT_GROUP


def _rr_endpoint_registered() -> bool:
    """rr's ``vllm.endpoint_plugins`` entry point is installed (an install without it falls back to the wrap)."""
    from importlib.metadata import entry_points

    return any(
        ep.name == PLUGIN_NAME and ep.value.startswith("rr_patches.") for ep in entry_points(group=ENDPOINT_GROUP)
    )


def uses_endpoint_plugin() -> bool:
    """Whether rr's routes come from the endpoint plugin (vLLM 0.30+ with rr's entry point) or the wrap."""
    return _vllm_has_endpoint_group() and _rr_endpoint_registered()


def _endpoint_allowed() -> bool:
    """vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` is set and names them."""
    raw = os.environ.get("VLLM_PLUGINS")
    return raw is not None and PLUGIN_NAME in [p.strip() for p in raw.split(",")]


def register() -> None:
    """vLLM plugin entry point: install rr's HTTP routes in the API-server process."""
    if not settings.flag("RR_ENABLE") or _state["registered"]:
        return
    # EngineCore / workers are multiprocessing children: patch only what they already imported
    # (e.g. multi-API-server children), never import the HTTP stack into them.
    top = multiprocessing.parent_process() is None
    allow = settings.flag("RR_ALLOW_UNSUPPORTED_VERSION")
    version = check_vllm_version(allow_unsupported=allow)
    if facts_for(version).cpu_reload_unpacked_experts:
        from rr_patches.vllm.reload_fix import install as install_reload_fix

        # every process (the worker runs in EngineCore, or here without multiprocessing); acts on CPU MoE layers only
        install_reload_fix()
    if uses_endpoint_plugin():
        # 0.30+: rr_patches.vllm.endpoint adds the routes through vLLM's own hook; no build_app wrap.
        if top and not _endpoint_allowed():
            raise UnsupportedVLLMVersion(
                f"vLLM {version} adds rr's /generate and /rr/info through its '{ENDPOINT_GROUP}' plugin, "
                f"which vLLM loads only when VLLM_PLUGINS names it: set VLLM_PLUGINS={PLUGIN_NAME} "
                f"(or add {PLUGIN_NAME} to your list)"
            )
        _state["registered"] = True
        if top:
            logger.info(
                "rr: vLLM %s plugin active; /generate and /rr/info come from %s:%s",
                version,
                ENDPOINT_GROUP,
                PLUGIN_NAME,
            )
        return
    sites = _install_hooks(import_missing=top, version=version)
    if not sites and not top:
        return
    if not sites:
        raise UnsupportedVLLMVersion(
            f"vLLM {version}: found no build_app to hook ({', '.join(m for m, _ in _HOOK_SITES)}); "
            "rr cannot add /generate to this version"
        )
    _state["registered"] = True
    logger.info("rr: vLLM %s plugin active; /generate and /rr/info hooked via %s", version, ", ".join(sites))
