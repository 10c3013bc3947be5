"""R3 in verl's FSDP actor (verl 0.9.1): routing replay where verl offers none, and its SGLang read fixed.

Switched on by verl's own setting, as for Megatron: ``actor_rollout_ref.actor.fsdp_config.router_replay.mode``
= ``R3`` (replay the rollout's rows; with ``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``) or
``R2`` (replay the log-prob recompute's own routing in the update epochs). Installing ``rr-replay[verl]``
registers a ``verl.plugins`` entry point, so every verl process (driver and Ray workers) runs :func:`install`
on ``import verl``; nothing else changes while the mode is ``disabled``. See docs/trainer.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from ._gate import TESTED_VERL, check_verl_version
from ._patches import PATCHES
from ._rows import accumulate_turn_rows, packed_rows, unpack_recorded

__all__ = ["TESTED_VERL", "check_verl_version", "install", "installed", "accumulate_turn_rows", "packed_rows",
           "unpack_recorded"]

logger = logging.getLogger("rr_client.integrations.verl")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after one named module executes (a post-import hook; no verl import of ours)."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                orig_loader = spec.loader
                patch = self.patches[name]

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                        return orig_loader.create_module(spec)

                    def exec_module(self, module: types.ModuleType) -> None:
                        orig_loader.exec_module(module)
                        patch(module)

                spec.loader = _Loader()
                return spec
        return None


_finder: _AfterImport | None = None


def install() -> None:
    """Patch verl where rr plugs in: now for modules already imported, at import for the rest. Re-entrant."""
    global _finder
    if _finder is None:
        _finder = _AfterImport(PATCHES)
        sys.meta_path.insert(0, _finder)
    for name, patch in PATCHES.items():
        mod = sys.modules.get(name)
        if mod is not None:
            patch(mod)


def installed() -> bool:
    """Whether :func:`install` ran in this process (the plugin entry point runs it on ``import verl``)."""
    return _finder is not None and _finder in sys.meta_path
