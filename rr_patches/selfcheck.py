"""``python -m rr_patches.selfcheck sglang|vllm``: rr's patch fits the engine installed here (no GPU, no server).

Imports the engine code rr hooks and runs the checks its patch runs at start-up, so an image whose engine rr does
not fit fails when it is built (docker/install_rr.sh), not at its first request. Exit 0 with one line saying what
fits; exit 1 with the refusal (which names every difference).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["check_sglang", "check_vllm", "main"]


def check_sglang() -> str:
    """The TokenizerManager and io_struct shapes rr's hooks need, on the installed SGLang (raises when they differ)."""
    from rr_patches.sglang.apply import TARGETS, TM_PATH, check_sglang_shapes
    from rr_server.serving.engines.sglang import profile_for

    profile = profile_for()
    check_sglang_shapes(profile)
    how = "patched directly (no plugin system)"
    if profile.has_plugins:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401 - the registry must import

        how = "through SGLang's HookRegistry"
    return f"SGLang {profile.version}: rr's hooks fit {TM_PATH} ({', '.join(TARGETS)}), {how}"


def check_vllm() -> str:
    """The installed vLLM is one rr supports, and rr's routes have a way in (the endpoint plugin or a build_app)."""
    from rr_patches.vllm.plugin import _HOOK_SITES, UnsupportedVLLMVersion, check_vllm_version, uses_endpoint_plugin

    version = check_vllm_version(allow_unsupported=False)
    if uses_endpoint_plugin():
        return f"vLLM {version}: rr's routes come from its vllm.endpoint_plugins entry point"
    for mod_name, attr in _HOOK_SITES:
        try:
            if getattr(importlib.import_module(mod_name), attr, None) is not None:
                return f"vLLM {version}: rr's routes wrap {mod_name}.{attr}"
        except ImportError:
            continue
    raise UnsupportedVLLMVersion(f"vLLM {version}: no build_app to hook ({', '.join(m for m, _ in _HOOK_SITES)})")


def main(argv: Sequence[str] | None = None) -> int:
    """Check the engine named in ``argv``; print what fits (exit 0) or why not (exit 1; 2 on a wrong argument)."""
    from rr_client.core.engines import ENGINE_NAMES

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in ENGINE_NAMES:
        sys.stderr.write(f"usage: python -m rr_patches.selfcheck {'|'.join(ENGINE_NAMES)}\n")
        return 2
    check = globals()[f"check_{args[0]}"]  # one check_<engine> per engine rr patches
    try:
        print(f"rr selfcheck: {check()}")
    except Exception as e:  # noqa: BLE001 - the refusal (or the import that failed) is the answer
        sys.stderr.write(f"rr selfcheck: {type(e).__name__}: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
