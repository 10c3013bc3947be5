"""Test-only stand-in, loaded in every vLLM process through PYTHONPATH: replaces vLLM's Triton
greedy rejection-sampling kernel (GPU-only: no Triton CPU backend here) with the same rule in torch.

Named as a stand-in: only the kernel is replaced; vLLM's n-gram proposer, scheduler, spec-decode
bookkeeping, model runner and rr's capture run as shipped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from greedy_rejection import greedy_reject

TARGET = "vllm.v1.sample.rejection_sampler"


def _patch(module: ModuleType) -> None:
    module._rejection_greedy_sample = greedy_reject  # type: ignore[attr-defined]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches the rejection sampler module right after it is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module  # type: ignore[attr-defined]

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


import importlib.util  # noqa: E402

sys.meta_path.insert(0, _AfterImport())
