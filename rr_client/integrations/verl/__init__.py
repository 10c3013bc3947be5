"""R3 in verl's FSDP2 actor (verl 0.9.1): routing replay where verl offers none, and its SGLang read fixed.

Switched on by verl's own setting, as for Megatron: ``actor_rollout_ref.actor.fsdp_config.router_replay.mode``
= ``R3`` (replay the rollout's rows; with ``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``) or
``R2`` (replay the log-prob recompute's own routing in the update epochs), with ``actor_rollout_ref.actor.strategy
=fsdp2`` (FSDP1 with R2/R3 is refused). Installing rr-replay registers a ``verl.plugins`` entry point, so every verl
process (driver and Ray workers) runs :func:`install` on ``import verl``. On a verl release rr was not tested with it
logs one warning and patches nothing (``RR_ALLOW_UNSUPPORTED_VERSION=1`` patches anyway) but a guard: a worker asked
for R2/R3 on FSDP raises instead of training unreplayed. Each patch is contained (a failing one logs an error and
leaves its module as verl ships it; a worker that needs it for R2/R3 raises); nothing acts while the mode is
``disabled`` or the strategy is not fsdp2. verl 0.5-0.7's legacy FSDP worker (``verl.workers.fsdp_workers``, their
``main_ppo``'s default) has no replay and rr does not replay in it: asked for replay, it refuses to start, on every
release. Those releases load no ``verl.plugins`` entry point: rr runs there only with
``VERL_USE_EXTERNAL_MODULES=rr_client.integrations.verl._plugin``. See docs/trainer.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.versions import OVERRIDE

from ._gate import TESTED_VERL, check_verl_version
from ._patches import (
    FAILED,
    LEGACY_WORKERS_MODULE,
    PATCHES,
    WORKERS_MODULE,
    apply_guard,
    apply_legacy_guard,
    apply_patch,
)

__all__ = [
    "TESTED_VERL",
    "check_verl_version",
    "install",
    "installed",
    "guarded",
    "failed_patches",
    "accumulate_turn_rows",
    "packed_rows",
    "unpack_recorded",
]

logger = logging.getLogger("rr_client.integrations.verl")

_ROWS = ("accumulate_turn_rows", "packed_rows", "unpack_recorded")  # torch: loaded on first use, not on import verl


def __getattr__(name: str) -> Any:
    """The row helpers, imported on first use (they need torch; the plugin import must stay cheap)."""
    if name in _ROWS:
        return getattr(importlib.import_module("._rows", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs an action right after one named module executes (a post-import hook; no verl import of ours)."""

    def __init__(self, actions: Mapping[str, Callable[[types.ModuleType], Any]]) -> None:
        self.actions = dict(actions)
        self.names = set(actions)

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in self.names:
            return None
        action = self.actions[name]
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                orig_loader = spec.loader

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                        return orig_loader.create_module(spec)  # noqa: B023 - the class is made for this spec

                    def exec_module(self, module: types.ModuleType) -> None:
                        orig_loader.exec_module(module)  # noqa: B023
                        action(module)  # contained: logs, never raises

                    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, ... of the real loader
                        return getattr(orig_loader, attr)  # noqa: B023

                spec.loader = _Loader()
                return spec
        return None


_finder: _AfterImport | None = None
_turned_off: str | None = None  # the untested verl found (the version gate turned rr's replay off), warned once


def _actions() -> dict[str, Callable[[types.ModuleType], Any]]:
    """Per verl module, what runs at its import: every patch, or (verl untested) only the worker's guard; on every
    release, the legacy FSDP worker's guard (verl 0.5-0.7 have that module; rr never replays in it)."""
    legacy: dict[str, Callable[[types.ModuleType], Any]] = {LEGACY_WORKERS_MODULE: apply_legacy_guard}
    if _turned_off is None:
        return {**{name: functools.partial(apply_patch, name) for name in PATCHES}, **legacy}
    why = f"{_turned_off} is not a release rr was tested with (verl {TESTED_VERL}), so rr left verl unpatched"
    return {WORKERS_MODULE: functools.partial(apply_guard, why=why), **legacy}


def install() -> None:
    """Patch verl where rr plugs in: now for modules already imported, at import for the rest. Re-entrant.

    On a verl release rr was not tested with: one warning, nothing patched (unless ``RR_ALLOW_UNSUPPORTED_VERSION``)
    but the worker's guard, which refuses router_replay R2/R3 on FSDP (it would train unreplayed). On every release,
    verl's legacy FSDP worker (verl 0.5-0.7) is guarded the same way. The version comes from verl's metadata; no
    verl module is imported here.
    """
    global _finder, _turned_off
    if _finder is None:
        try:
            check_verl_version()
        except UnsupportedVersionError as e:
            found = f"verl {e.version}" if e.version else "no installed verl version"
            _turned_off = found
            logger.warning(
                "rr: %s is not what rr was tested with (verl %s): rr's FSDP routing replay is off and "
                "verl is left unpatched (a worker asked for router_replay R2/R3 on FSDP refuses to "
                "start); set %s=1 to patch it anyway, at your own risk",
                found,
                e.tested or TESTED_VERL,
                OVERRIDE,
            )
        _finder = _AfterImport(_actions())
        sys.meta_path.insert(0, _finder)
    for name, action in _finder.actions.items():
        mod = sys.modules.get(name)
        if mod is not None:
            action(mod)


def installed() -> bool:
    """Whether :func:`install` patched this process (the plugin entry point runs it on ``import verl``)."""
    return _finder is not None and _finder in sys.meta_path and _turned_off is None


def guarded() -> bool:
    """Whether this process has only rr's guard (an untested verl): R2/R3 on FSDP is refused, nothing replays."""
    return _finder is not None and _finder in sys.meta_path and _turned_off is not None


def failed_patches() -> dict[str, str]:
    """verl modules whose patch failed in this process (each was logged once), with why."""
    return dict(FAILED)
